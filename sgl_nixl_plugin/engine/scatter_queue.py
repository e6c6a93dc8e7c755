"""Receiver side of the staging path: scatter landed pieces without waiting for each.

Each landed piece's scatter is launched at once (on GPUs, onto the copy stream, followed by
an event), so the next piece's scatter is queued while this one runs; completions come out
in arrival order. Other items (a room's final status, an abort ack) can be queued between
pieces: they come out only after every piece queued before them has finished scattering,
which is what lets the receiver report Success only once its pages hold the bytes.

Two ways to consume: ``ready()`` never blocks (a polling loop), ``wait()`` blocks until the
oldest item is done (a dedicated thread).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class ScatterQueue:
    def __init__(self, copier: Any, stream: Any = None) -> None:
        self.copier = copier
        self.stream = stream
        self._items: deque[tuple[Any, Any]] = deque()  # (token, event or None)
        self._cond = threading.Condition()

    def launch(
        self,
        token: Any,
        *,
        bases: Any,
        units: Any,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
    ) -> None:
        """Scatter one piece from staging address ``stage``; ``token`` comes out when done."""
        self.copier.scatter(bases, units, unit_len, stride, offset, stage, self.stream)
        event = None
        if self.stream is not None:
            import torch

            event = torch.cuda.Event()
            event.record(self.stream)
        self._put(token, event)

    def after(self, token: Any) -> None:
        """Queue ``token`` to come out after every piece launched before it."""
        self._put(token, None)

    def _put(self, token: Any, event: Any) -> None:
        with self._cond:
            self._items.append((token, event))
            self._cond.notify()

    def __len__(self) -> int:
        return len(self._items)

    def ready(self) -> list[Any]:
        """Tokens of the items done so far, oldest first (never blocks)."""
        out = []
        with self._cond:
            while self._items and (self._items[0][1] is None or self._items[0][1].query()):
                out.append(self._items.popleft()[0])
        return out

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Block until the oldest item is done (or ``timeout``), then return ``ready()``."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: bool(self._items), timeout):
                return []
            event = self._items[0][1]
        if event is not None:
            event.synchronize()  # releases the GIL; later launches go on meanwhile
        return self.ready()

    def wake(self) -> None:
        """Release a ``wait()`` that waits on an empty queue (at shutdown)."""
        with self._cond:
            self._cond.notify_all()
