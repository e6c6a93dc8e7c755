"""Test-only SGLang general plugin: the negative control of the real-server stage.

A decode server that loads it zeroes the layer-0 key of one prompt token (the middle one)
of every request, right after the KV transfer succeeded and before the request joins a
decode batch. The stage must then see different output ids: that proves the comparison
depends on the KV the decode server *received* (a decode that recomputed the prompt, or a
stage comparing the wrong thing, would still pass). The first output token is sampled on the
prefill server and must still match.

Only ``test_stage_detects_damaged_kv`` puts this folder on the decode server's PYTHONPATH,
with ``SGLANG_PLUGINS=sgl_nixl_plugin,realserver_kv_damage``.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sgl_realserver_kv_damage")

#: Logged once per damaged request; the test counts these.
MARKER = "realserver-shim: damaged received KV"
#: SGLang's warmup requests carry this bootstrap host (no real transfer): left alone.
_WARMUP_HOST = "2.2.2.2"


def register() -> None:
    from sglang.srt.disaggregation import decode

    queue_cls = decode.DecodeTransferQueue
    original = queue_cls._commit_transfer_to_req
    if getattr(original, "_realserver_damage", False):
        return

    @functools.wraps(original)
    def _commit_transfer_to_req(self, decode_req):
        req = decode_req.req
        if getattr(req, "bootstrap_host", None) != _WARMUP_HOST:
            n = len(req.origin_input_ids)
            row = self.scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            slot = row[n // 2 : n // 2 + 1].long()
            kv = self.scheduler.token_to_kv_pool_allocator.get_kvcache()
            kv.k_buffer[0][slot] = 0
            logger.warning("%s: layer 0 key of prompt token %d of %d", MARKER, n // 2, n)
        return original(self, decode_req)

    _commit_transfer_to_req._realserver_damage = True
    queue_cls._commit_transfer_to_req = _commit_transfer_to_req
