"""The VRAM copier without Triton: ``index_select`` / ``index_copy_`` per region on tensors
wrapped around raw device pointers (the fallback; ~6x slower than the Triton kernel)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.copy_common import (
    _as_bases,
    _as_units,
    _check_geometry,
    _require_torch_cuda,
)
from sgl_nixl_plugin.engine.copy_device import GpuCopier, _DeviceIndex, _StreamScope


class _CudaBuf:
    """A ``__cuda_array_interface__`` over raw device memory (no stream: no implicit sync)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> None:
        self.__cuda_array_interface__ = {
            "data": (int(addr), False),
            "shape": shape,
            "strides": strides,
            "typestr": "|u1",
            "version": 2,
        }


def device_view(
    torch: Any,
    device: Any,
    addr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None = None,
) -> Any:
    """A uint8 CUDA tensor over device memory at ``addr`` (strides in bytes; no copy)."""
    buf = _CudaBuf(
        addr,
        tuple(int(s) for s in shape),
        None if strides is None else tuple(int(s) for s in strides),
    )
    t = torch.as_tensor(buf, device=device)
    if t.data_ptr() != int(addr):  # as_tensor must wrap, never copy
        raise RuntimeError("torch copied a device buffer instead of wrapping it")
    return t


class TorchCopier(GpuCopier):
    """GPU memory without Triton: ``index_select`` / ``index_copy_`` once per region."""

    def __init__(self, device: int = 0) -> None:
        torch = _require_torch_cuda(device)
        self.torch = torch
        self.device = torch.device("cuda", device)
        self._index = _DeviceIndex(torch, self.device)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_bases(self, bases: Any, stream: Any = None) -> np.ndarray:
        return _as_bases(bases)

    def bind(self, stream: Any) -> None:
        pass

    def _copy(
        self,
        gather: bool,
        bases: Any,
        units: Any,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any,
    ) -> None:
        torch = self.torch
        unit_len, stride, offset, stage = int(unit_len), int(stride), int(offset), int(stage)
        _check_geometry(unit_len, stride, offset, stage)
        b = _as_bases(bases)
        if isinstance(units, torch.Tensor):
            n = int(units.shape[0])
            rows = int(units.max()) + 1 if n else 0  # syncs; the fallback may
        else:
            units = _as_units(units)
            n = len(units)
            rows = int(units.max()) + 1 if n else 0
        if n == 0 or len(b) == 0:
            return
        with _StreamScope(torch, self.device, stream) as s:
            idx = self._index.units(units, s)
            if idx.dtype != torch.int64:
                idx = idx.long()
            staged_all = device_view(torch, self.device, stage, (len(b), n, unit_len))
            for i, base in enumerate(b.tolist()):
                region = device_view(
                    torch, self.device, base + offset, (rows, unit_len), (stride, 1)
                )
                if gather:
                    torch.index_select(region, 0, idx, out=staged_all[i])
                else:
                    region.index_copy_(0, idx, staged_all[i])
