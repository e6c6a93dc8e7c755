"""Peer setup beside a control loop: the slow work of accepting a peer, off the loop.

Accepting a decode means loading its NIXL metadata, preparing descriptor lists, a warm-up
WRITE that pays the transport's wire-up, and (one pass) mapping its pool over CUDA IPC:
milliseconds on a quiet host, seconds on a loaded one (one warm-up returned after 18 s).
Run on the control thread, that wait kept every other peer's pings and rooms waiting too.
Here it runs on a thread of its own, one setup at a time (NIXL's agent is set up by one
thread at a time, as before); each result goes back to the control loop, which wakes at
once and finishes the registration there, so the peer tables keep a single writer.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class SetupThread:
    """Runs submitted setup jobs in order on one thread; ``finished`` hands back each
    job's key with its result (or the exception it raised), and ``notify`` (the control
    loop's ``interrupt``) runs after each, from this thread."""

    def __init__(self, name: str, notify: Callable[[], None]) -> None:
        self._jobs: queue.Queue[tuple[Any, Callable[[], Any]] | None] = queue.Queue()
        self._done: deque[tuple[Any, Any]] = deque()
        self._notify = notify
        self.running: Any = None  # the key of the job in progress (for logs and tests)
        self.completed = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._jobs.put(None)

    def submit(self, key: Any, job: Callable[[], Any]) -> None:
        self._jobs.put((key, job))

    def finished(self) -> list[tuple[Any, Any]]:
        """The results that came back since the last call, in the order they finished."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            key, job = item
            self.running = key
            try:
                result = job()
            except Exception as exc:  # the control loop decides what a failed setup means
                result = exc
            self.running = None
            self.completed += 1
            self._done.append((key, result))
            try:
                self._notify()
            except Exception:
                logger.exception("sgl-nixl %s: could not wake the control loop", self.thread.name)
