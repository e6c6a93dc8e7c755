"""Unit indices the GPU reads straight from pinned host memory: no upload before a gather.

A sender learns a request's pages only when it is asked to send, so its first gather waits
for the index upload (pin, allocate, copy, event: 0.2 ms on a thread that just woke up).
With unified addressing, pinned host memory has the same address on the device, so a
kernel can read the indices in place: the host copies them into a kept pinned buffer and
launches. A buffer returns to the pool with an event recorded after the request's last
gather, and is reused only once that event has passed.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class MappedUnits:
    """A 1-D int64 view of pinned host memory, passed to Triton like a tensor (it reads
    ``data_ptr()`` and ``dtype``); slicing stays in the same buffer."""

    __slots__ = ("_buf", "_ptr", "_n", "dtype")

    def __init__(self, buf: Any, ptr: int, n: int, dtype: Any) -> None:
        self._buf, self._ptr, self._n, self.dtype = buf, ptr, n, dtype

    @property
    def shape(self) -> tuple[int]:
        return (self._n,)

    def data_ptr(self) -> int:
        return self._ptr

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, s: slice) -> MappedUnits:
        start, stop, step = s.indices(self._n)
        if step != 1:
            raise ValueError("mapped units slice with a step")
        return MappedUnits(self._buf, self._ptr + 8 * start, max(0, stop - start), self.dtype)


class MappedPool:
    """Pinned int64 buffers handed out per request (``take``) and given back (``give``)
    with an event that must pass before the host writes the buffer again. Bounded: past
    ``max_buffers`` in use, ``take`` returns None and the caller uploads as before."""

    def __init__(self, torch: Any, max_buffers: int = 64) -> None:
        self.torch = torch
        self.max_buffers = max_buffers
        self._lock = threading.Lock()
        self._free: list[tuple[Any, Any]] = []  # (pinned tensor, event or None)
        self._count = 0

    def take(self, units: np.ndarray) -> MappedUnits | None:
        n = int(units.shape[0])
        buf = self._reuse(n)
        if buf is None:
            with self._lock:
                if self._count >= self.max_buffers:
                    return None
                self._count += 1
            cap = max(1024, 1 << (max(1, n) - 1).bit_length())
            buf = self.torch.empty(cap, dtype=self.torch.int64, pin_memory=True)
        host = buf.numpy()
        host[:n] = units
        return MappedUnits(buf, int(buf.data_ptr()), n, self.torch.int64)

    def reserve(self, count: int, capacity: int) -> None:
        """Pin ``count`` buffers of ``capacity`` indices now: pinning is a driver call of
        about a millisecond, which the first requests would otherwise pay (within
        ``max_buffers``)."""
        with self._lock:
            count = min(count, self.max_buffers - self._count)
            self._count += max(0, count)
        for _ in range(max(0, count)):
            buf = self.torch.empty(capacity, dtype=self.torch.int64, pin_memory=True)
            with self._lock:
                self._free.append((buf, None))

    def _reuse(self, n: int) -> Any:
        with self._lock:
            for i, (buf, ev) in enumerate(self._free):
                if buf.shape[0] >= n and (ev is None or ev.query()):
                    del self._free[i]
                    return buf
        return None

    def give(self, units: MappedUnits, stream: Any, event: Any = None) -> None:
        """Return ``units``' buffer once the work queued on ``stream`` so far has run (or
        once ``event``, already recorded after that work, has passed)."""
        ev = event
        if ev is None and stream is not None:
            ev = self.torch.cuda.Event()
            ev.record(stream)
        with self._lock:
            self._free.append((units._buf, ev))

    @property
    def in_use(self) -> int:
        with self._lock:
            return self._count - len(self._free)
