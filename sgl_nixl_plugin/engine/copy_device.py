"""GPU-side bookkeeping shared by the VRAM copiers: the stream scope, region bases and
page indices uploaded once and sliced per piece (16-byte aligned for Triton)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.copy_common import _as_bases, _as_units


class _StreamScope:
    """``with torch.cuda.device(d), torch.cuda.stream(s)`` returning the stream."""

    def __init__(self, torch: Any, device: Any, stream: Any) -> None:
        self.torch, self.device, self.stream = torch, device, stream

    def __enter__(self) -> Any:
        t = self.torch
        self._dev = t.cuda.device(self.device)
        self._dev.__enter__()
        s = self.stream if self.stream is not None else t.cuda.current_stream(self.device)
        self._str = t.cuda.stream(s)
        self._str.__enter__()
        return s

    def __exit__(self, *exc: Any) -> None:
        self._str.__exit__(*exc)
        self._dev.__exit__(*exc)


class DeviceBases:
    """Region base addresses already on the GPU (``prepare_bases``). Slicing keeps them
    there, so the pieces of a request share one upload; ``bits`` is the OR of every
    address (a conservative alignment for any slice)."""

    __slots__ = ("tensor", "bits", "_aligned", "_key")

    def __init__(
        self, tensor: Any, bits: int, aligned: dict[Any, Any] | None = None, key: Any = None
    ) -> None:
        self.tensor, self.bits = tensor, bits
        self._aligned = {} if aligned is None else aligned  # shared by all slices
        self._key = key

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def __getitem__(self, s: slice) -> DeviceBases:
        return DeviceBases(self.tensor[s], self.bits, self._aligned, (s.start, s.stop))

    def aligned(self) -> Any:
        """The tensor, at a 16-byte aligned address: Triton compiles one variant per
        pointer alignment, and a slice starting at an odd region would otherwise cost a
        compile (~0.1 s) the first time it occurs. A misaligned slice is copied once (on
        the current stream, where it is used) and the copy kept."""
        t = self.tensor
        if t.data_ptr() % 16 == 0:
            return t
        hit = self._aligned.get(self._key)
        if hit is None:
            if len(self._aligned) >= 4096:  # bounded: at most regions^2 slices exist
                self._aligned.clear()
            hit = self._aligned[self._key] = t.clone()
        return hit


def _aligned_units(units: Any) -> Any:
    """``units`` at a 16-byte aligned address (see ``DeviceBases.aligned``)."""
    return units if units.data_ptr() % 16 == 0 else units.clone()


class _DeviceIndex:
    """Device copies of ``bases`` (kept; they repeat across requests) and of ``units``
    (a few recent ones, compared by content), uploaded from pinned host memory."""

    BASES_CACHE = 1024
    UNITS_CACHE = 4

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self._lock = threading.Lock()
        self._bases: OrderedDict[bytes, tuple[Any, Any]] = OrderedDict()
        self._units: list[tuple[np.ndarray, Any, Any]] = []  # (host copy, tensor, ready event)

    def warm_uploads(self, largest: int = 1 << 17, per_size: int = 4) -> None:
        """Run uploads of every power-of-two index count up to ``largest``, ``per_size``
        at once, and wait: torch keeps the pinned blocks (one size class each) for later
        uploads, so the first requests' indices do not pay for pinning (about a
        millisecond per new block)."""
        stream, n = self.torch.cuda.current_stream(self.device), 128
        while n <= largest:
            held = [self._upload(np.zeros(n, dtype=np.int64), stream) for _ in range(per_size)]
            n *= 2
        stream.synchronize()
        del held

    def bases(self, bases: Any, stream: Any) -> tuple[Any, int]:
        """The device copy of ``bases`` and the OR of all of them (for the alignment);
        validated and uploaded once per distinct set (they repeat for every piece)."""
        key = bases.tobytes() if isinstance(bases, np.ndarray) else bytes(np.asarray(bases))
        with self._lock:
            hit = self._bases.get(key)
            if hit is not None:
                self._bases.move_to_end(key)
        if hit is None:
            b = _as_bases(bases)
            acc = int(np.bitwise_or.reduce(b)) if b.size else 0
            dev, ev = self._upload(b.view(np.int64), stream)
            hit = (dev, ev, acc, len(b))
            with self._lock:
                self._bases[key] = hit
                while len(self._bases) > self.BASES_CACHE:
                    self._bases.popitem(last=False)
        return self._ready(hit[:2], stream), hit[2]

    def units(self, u: Any, stream: Any) -> Any:
        torch = self.torch
        if isinstance(u, torch.Tensor):
            if u.dim() != 1:
                raise ValueError(f"units must be 1-D, got shape {tuple(u.shape)}")
            if u.device != self.device:
                u = u.to(self.device, non_blocking=True)
            if u.dtype not in (torch.int64, torch.int32):
                u = u.long()
            return u.contiguous()  # the kernel reads units[j] at units_ptr + j
        u = _as_units(u)
        with self._lock:
            for i, (host, dev, ev) in enumerate(self._units):
                if host.shape == u.shape and np.array_equal(host, u):
                    if i:
                        self._units.insert(0, self._units.pop(i))
                    return self._ready((dev, ev), stream)
        dev, ev = self._upload(u, stream)
        with self._lock:
            self._units.insert(0, (u.copy(), dev, ev))
            del self._units[self.UNITS_CACHE :]
        return dev

    def _upload(self, host: np.ndarray, stream: Any) -> tuple[Any, Any]:
        """Enqueue an H2D copy on ``stream`` (from a pinned block; torch's host allocator
        keeps that block until the copy has run) and record an event after it."""
        torch = self.torch
        src = torch.from_numpy(np.ascontiguousarray(host)).pin_memory()
        dev = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        dev.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        return dev, ev

    @staticmethod
    def _ready(entry: tuple[Any, Any], stream: Any) -> Any:
        """The cached tensor, usable on ``stream`` (waits for its upload, and tells the
        caching allocator the tensor is used there)."""
        dev, ev = entry
        stream.wait_event(ev)
        dev.record_stream(stream)
        return dev


class GpuCopier:
    """What both VRAM copiers share; subclasses set ``torch``, ``device``, ``_index`` and
    implement ``_copy``."""

    mem_kind = "VRAM"
    torch: Any
    device: Any
    _index: _DeviceIndex

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
        raise NotImplementedError

    def gather(
        self,
        bases: Any,
        units: Any,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any = None,
    ) -> None:
        self._copy(True, bases, units, unit_len, stride, offset, stage, stream)

    def scatter(
        self,
        bases: Any,
        units: Any,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any = None,
    ) -> None:
        self._copy(False, bases, units, unit_len, stride, offset, stage, stream)

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream``, or for the whole device when no stream is given."""
        if stream is not None:
            stream.synchronize()
        else:
            self.torch.cuda.synchronize(self.device)

    def _is_current(self, stream: Any) -> bool:
        """Whether ``stream`` is already this thread's current stream on our device."""
        return False

    def prepare_units(self, units: Any, stream: Any = None) -> Any:
        if stream is not None and self._is_current(stream):  # a bound thread: no scope
            return self._index.units(units, stream)
        with _StreamScope(self.torch, self.device, stream) as s:
            return self._index.units(units, s)
