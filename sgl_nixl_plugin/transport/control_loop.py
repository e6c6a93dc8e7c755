"""The control thread both sides run: one ZMQ socket, the peer watch, and a periodic tick.

Subclasses say what a message means (``on_frames``), what losing a peer means (``on_lost``),
how long to sleep (``poll_ms``) and what to do on every wake-up (``tick``). Another thread
that changes what the loop should do next calls ``interrupt`` rather than waiting out the poll,
so a long idle sleep costs no latency. The loop itself never dies: socket errors and handler
bugs are logged and the thread goes on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from sgl_nixl_plugin.transport.liveness import Endpoint, PeerWatch, drain

logger = logging.getLogger(__name__)


class ControlLoop:
    def __init__(
        self,
        zmq_ctx: zmq.Context,
        sock: Any,
        interval_s: float,
        misses: int,
        name: str,
        stall_s: float = 30.0,
    ) -> None:
        self.sock = sock  # the side's PULL socket: every control message arrives here
        self.watch = PeerWatch(zmq_ctx, interval_s, misses, stall_s)
        self._stop = threading.Event()
        self._next_check = 0.0
        self._interrupt_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._interrupt_lock = threading.Lock()  # an interrupt never writes to a closed (reused) fd
        self.wakeups = 0  # times the loop woke up: what an idle rank costs, countable
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.thread.ident is None:  # never started: no loop will close the eventfd
            self._close_interrupt()
        else:
            self.interrupt()

    def interrupt(self) -> None:
        """End the loop's current sleep now (any thread; a no-op once the loop has ended)."""
        with self._interrupt_lock:
            if self._interrupt_fd >= 0:
                os.eventfd_write(self._interrupt_fd, 1)

    # -- what subclasses define ---------------------------------------------------------
    def poll_ms(self) -> int:
        return max(10, int(self.watch.interval * 1000 / 2))

    def on_frames(self, frames: list[Any]) -> None:
        raise NotImplementedError

    def on_lost(self, endpoint: Endpoint, why: str) -> None:
        raise NotImplementedError

    def on_batch_end(self) -> None:
        """Runs after every batch of frames read from the socket."""

    def check_liveness(self) -> None:
        """Sync the watch with the peers that matter now and ping them (throttled by ``due``)."""
        raise NotImplementedError

    def tick(self) -> None:
        """Runs after every wake-up."""
        if self.due():
            self.check_liveness()

    def due(self) -> bool:
        """True at most four times per liveness interval."""
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + self.watch.interval / 4
        return True

    def _note_stall(
        self, late_s: float, handling_s: float, ticking_s: float, messages: int
    ) -> None:
        """Warn when this thread was away from its socket for a liveness interval or more:
        peers call a rank lost after ``deadline`` without a pong, and this line says
        whether the time went to our own handlers or the thread was not run at all (CPU
        or GIL starvation)."""
        limit = self.watch.interval
        if max(late_s, 0.0) + handling_s + ticking_s < limit:
            return
        logger.warning(
            "sgl-nixl %s: away from its socket for %.1fs (woke %.1fs late, %.1fs handling %d "
            "messages, %.1fs in periodic work); peers call a rank lost after %.1fs without "
            "a pong",
            self.thread.name,
            max(late_s, 0.0) + handling_s + ticking_s,
            max(late_s, 0.0),
            handling_s,
            messages,
            ticking_s,
            self.watch.deadline,
        )

    # -- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        sock = self.sock
        poller = self.watch.poller
        poller.register(sock, zmq.POLLIN)
        poller.register(self._interrupt_fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                timeout_ms = self.poll_ms()
                asked = time.monotonic()
                events = poller.poll(timeout_ms)
                woke = time.monotonic()
                self.wakeups += 1
                messages = 0
                for ready, _ in events:
                    if ready == self._interrupt_fd:
                        self._clear_interrupt()
                    elif ready is sock:
                        for frames in drain(sock):  # the whole backlog: a pong may be in it
                            self.on_frames(frames)
                            messages += 1
                        self.on_batch_end()
                    elif self.watch.owns(ready):
                        for endpoint, why in self.watch.on_monitor(ready):
                            self.watch.forget(endpoint)
                            self.on_lost(endpoint, why)
                handled = time.monotonic()
                self.tick()
                late = woke - asked - timeout_ms / 1000
                self._note_stall(late, handled - woke, time.monotonic() - handled, messages)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.error("sgl-nixl %s: socket error: %s", self.thread.name, exc)
                time.sleep(0.05)
            except Exception:
                logger.exception("sgl-nixl %s: error; the thread goes on", self.thread.name)
        self.watch.close()
        self._close_interrupt()

    def _close_interrupt(self) -> None:
        with self._interrupt_lock:
            if self._interrupt_fd >= 0:
                os.close(self._interrupt_fd)
                self._interrupt_fd = -1

    def _clear_interrupt(self) -> None:
        try:
            os.eventfd_read(self._interrupt_fd)
        except BlockingIOError:  # already read
            pass
