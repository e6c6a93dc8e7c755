"""Test-only SGLang general plugin: DP attention (``--enable-dp-attention``) on a CPU host.

SGLang 0.5.23 runs DP attention on a CPU host but for two gaps, filled here and nothing of
the KV transfer touched:

* every DP rank's batch is padded to one size before the MLP sync, and on a CPU the
  padding asks the attention backend for ``get_cpu_graph_seq_len_fill_value()``, which
  ``TorchNativeAttnBackend`` lacks (an AttributeError at the first batch): it gets 1, the
  value SGLang's AMX backend returns;
* the logits gather under DP attention calls ``GroupCoordinator.all_to_all_single``, which
  always goes through a custom op registered for CUDA only ("Could not run
  'sglang::reg_all_to_all_single' with arguments from the 'CPU' backend"): on CPU tensors it
  calls the group's plain gloo all-to-all, as SGLang's all-gather and reduce-scatter do.

Logs ``MARKER`` once per process, which the stage checks.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sgl_realserver_dp_cpu")

MARKER = "realserver-shim: DP attention on CPU"


def register() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    coordinator = parallel_state.GroupCoordinator
    if getattr(coordinator, "_realserver_dp_cpu", False):
        return
    coordinator._realserver_dp_cpu = True
    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1
    through_op = coordinator.all_to_all_single

    def all_to_all_single(self, output, input):
        if self.world_size > 1 and input.device.type == "cpu":
            return self._all_to_all_single(output, input)
        return through_op(self, output, input)

    coordinator.all_to_all_single = all_to_all_single
    logger.warning(MARKER)
