"""Test-only SGLang general plugin: SGLang's decode host pool on a CPU-only host.

Decode host receive (``--disaggregation-decode-host-receive-threshold`` below 1) needs the
``host_pool`` retraction backup, whose host KV pool SGLang 0.5.23 cannot build or copy on a
CPU host; this shim fills exactly those two gaps and touches nothing of the transfer:

* the pool's memory is pinned with ``cudaHostRegister`` (``pool_host.common.
  _cuda_host_register``): "Found no NVIDIA driver". On a CPU host there is nothing to pin;
* host <-> device copies of the ``layer_first`` layout call ``sgl_kernel`` ops that
  ``pool_host/mha.py`` imports on CUDA/HIP/XPU only (a NameError here): plain index copies
  stand in, one per layer, as the kernels do.

Each restore of a received request into the device pool logs ``MARKER`` once (at layer 0):
the stage counts them to prove the requests really went through the host pool.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("sgl_realserver_host_pool_cpu")

MARKER = "realserver-shim: host pool KV loaded to device"


def register() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.mem_cache.pool_host import common, mha

    if getattr(mha, "_realserver_host_pool_cpu", False):
        return
    mha._realserver_host_pool_cpu = True

    def no_pinning(buffer, registration_granularity_bytes=None):
        setattr(buffer, common._CUDA_HOST_REGISTERED_RANGES_ATTR, [])

    common._cuda_host_register = no_pinning

    def copy_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size):
        dst_k[dst_indices.long()] = src_k[src_indices.long()]
        dst_v[dst_indices.long()] = src_v[src_indices.long()]

    mha.transfer_kv_per_layer = copy_layer

    host_pool = mha.MHATokenToKVPoolHost
    backup = host_pool.backup_from_device_all_layer
    load = host_pool.load_to_device_per_layer

    @functools.wraps(backup)
    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        if self.layout != "layer_first" or io_backend != "kernel":
            return backup(self, device_pool, host_indices, device_indices, io_backend)
        dst, src = host_indices.long(), device_indices.long()
        for i in range(self.layer_num):
            self.k_buffer[i][dst] = self.device_k_buffers[i][src]
            self.v_buffer[i][dst] = self.device_v_buffers[i][src]

    @functools.wraps(load)
    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, *a, **kw
    ):
        if layer_id == 0:
            logger.warning("%s: %d tokens", MARKER, len(host_indices))
        return load(self, device_pool, host_indices, device_indices, layer_id, *a, **kw)

    host_pool.backup_from_device_all_layer = backup_from_device_all_layer
    host_pool.load_to_device_per_layer = load_to_device_per_layer
