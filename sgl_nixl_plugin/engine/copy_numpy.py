"""The DRAM copier: numpy views over raw host addresses, one vectorised copy per region."""

from __future__ import annotations

from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.copy_common import _as_bases, _as_units, _check_geometry


class _HostBuf:
    """An ``__array_interface__`` over raw host memory (no ctypes type per size: no leak)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> None:
        self.__array_interface__ = {
            "data": (int(addr), False),
            "shape": shape,
            "strides": strides,
            "typestr": "|u1",
            "version": 3,
        }


def host_view(
    addr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None
) -> np.ndarray:
    """A writable uint8 numpy view of host memory at ``addr`` (strides in bytes)."""
    return np.asarray(
        _HostBuf(
            addr,
            tuple(int(s) for s in shape),
            None if strides is None else tuple(int(s) for s in strides),
        )
    )


class NumpyCopier:
    """Host memory: one vectorised numpy copy per region of the piece."""

    mem_kind = "DRAM"

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        pass

    def gather(
        self,
        bases: np.ndarray,
        units: np.ndarray,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any = None,
    ) -> None:
        self._copy(True, bases, units, unit_len, stride, offset, stage)

    def scatter(
        self,
        bases: np.ndarray,
        units: np.ndarray,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any = None,
    ) -> None:
        self._copy(False, bases, units, unit_len, stride, offset, stage)

    def synchronize(self, stream: Any = None) -> None:
        pass  # numpy copies are synchronous

    def prepare_units(self, units: Any, stream: Any = None) -> np.ndarray:
        return _as_units(units)

    def prepare_bases(self, bases: Any, stream: Any = None) -> np.ndarray:
        return _as_bases(bases)

    def bind(self, stream: Any) -> None:
        pass

    @staticmethod
    def _copy(
        gather: bool, bases: Any, units: Any, unit_len: int, stride: int, offset: int, stage: int
    ) -> None:
        unit_len, stride, offset, stage = int(unit_len), int(stride), int(offset), int(stage)
        _check_geometry(unit_len, stride, offset, stage)
        b = _as_bases(bases)
        u = _as_units(units)
        n = len(u)
        if n == 0 or len(b) == 0:
            return
        rows = int(u.max()) + 1  # the region views end at the last unit the request names
        dense = stride == unit_len
        for i, base in enumerate(b.tolist()):
            region = host_view(base + offset, (rows, unit_len), (stride, 1))
            staged = host_view(stage + i * n * unit_len, (n, unit_len))
            if gather:
                if dense:
                    # take on a C-contiguous source writes straight into ``out``
                    # (mode="clip": "raise" would buffer ``out``; indices are in range).
                    np.take(region, u, axis=0, out=staged, mode="clip")
                else:
                    # take would copy a strided source whole; a fancy read copies only
                    # the named units (into a temporary).
                    staged[...] = region[u]
            else:
                region[u] = staged
