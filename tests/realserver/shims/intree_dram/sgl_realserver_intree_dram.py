"""Test-only SGLang general plugin for the in-tree nixl *control* run of the real-server stage.

Why: on a CPU host SGLang 0.5.23's in-tree nixl backend labels the KV pool ``VRAM`` (its
decode side hard-codes the label; the prefill side defaults to it), and UCX refuses to
register host memory as VRAM, so the control run cannot start. This plugin relabels the KV
regions ``DRAM`` just before the in-tree ``NixlKVManager`` reads them, and only when no CUDA
device exists (it refuses to act otherwise, so it can never mask a real GPU label).

How it is found: this folder holds a ``.dist-info`` with an ``sglang.srt.plugins`` entry
point, so putting the folder on ``PYTHONPATH`` makes it an installed plugin as far as
``importlib.metadata`` is concerned. Only the control run does that, and it also sets
``SGLANG_PLUGINS=realserver_intree_dram``: SGLang's whitelist then loads this plugin and
skips ``sgl_nixl_plugin``, so the control servers run SGLang's own nixl classes. The plugin
run never sees this folder (it needs no such override).
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sgl_realserver_intree_dram")

#: The test looks for this in the control servers' logs (and for its absence in plugin runs).
MARKER = "realserver-shim: in-tree nixl KV regions relabelled DRAM"


def register() -> None:
    import torch
    from sglang.srt.disaggregation.nixl import conn

    manager_cls = conn.NixlKVManager
    original = manager_cls.__init__
    if getattr(original, "_realserver_dram", False):
        return

    @functools.wraps(original)
    def __init__(self, args, *rest, **kwargs):
        if torch.cuda.is_available():
            raise RuntimeError(
                "sgl_realserver_intree_dram is a CPU-only test shim; a CUDA device is visible"
            )
        args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
        logger.warning("%s (%d regions)", MARKER, len(args.kv_data_ptrs))
        original(self, args, *rest, **kwargs)

    __init__._realserver_dram = True
    manager_cls.__init__ = __init__
