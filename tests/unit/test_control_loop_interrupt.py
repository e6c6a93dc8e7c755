"""Another thread can end a control loop's sleep at once; a stopped loop closes its eventfd.

An idle decode sleeps 100 ms between wake-ups; the first transfer request after an idle
spell must not wait that out (over UCX-on-TCP the decode's progress completes the WRITE).
The loops here sleep 60 s between wake-ups, so only ``interrupt`` (or ``stop``) can end a sleep
within the bounded waits below.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from helpers.zmq_pair import loopback_pair

from sgl_nixl_plugin.transport.control_loop import ControlLoop


class SleepyLoop(ControlLoop):
    def __init__(self, zctx: zmq.Context, sock: Any) -> None:
        super().__init__(zctx, sock, 1.0, 5, "test-sleepy")
        self.ticks = 0
        self.ticked = threading.Condition()

    def poll_ms(self) -> int:
        return 60_000

    def on_frames(self, frames: list[Any]) -> None:
        pass

    def check_liveness(self) -> None:
        pass

    def tick(self) -> None:
        with self.ticked:
            self.ticks += 1
            self.ticked.notify_all()

    def wait_ticks(self, n: int, timeout: float) -> bool:
        with self.ticked:
            return self.ticked.wait_for(lambda: self.ticks >= n, timeout)


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Context, Any]]:
    with loopback_pair() as (zctx, pull, _push, _):
        yield zctx, pull


def _eventfds() -> int:
    """Open eventfds of this process (the loopback pair's TCP connection may open sockets
    meanwhile, so only these are counted)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
        except OSError:  # the listing's own fd, closed by now
            pass
    return n


def test_interrupt_ends_a_long_sleep_each_time(sockets: tuple[zmq.Context, Any]) -> None:
    zctx, pull = sockets
    loop = SleepyLoop(zctx, pull)
    loop.start()
    try:
        for n in (1, 2, 3):
            loop.interrupt()
            assert loop.wait_ticks(n, 10), f"interrupt {n} did not end the loop's 60 s sleep"
        assert loop.ticks == 3 and loop.wakeups == 3
    finally:
        loop.stop()
        loop.thread.join(10)
    assert not loop.thread.is_alive(), "stop did not end the loop's 60 s sleep"


def test_a_stopped_loop_closes_its_eventfd_and_ignores_later_interrupts(
    sockets: tuple[zmq.Context, Any],
) -> None:
    zctx, pull = sockets
    before = _eventfds()
    loop = SleepyLoop(zctx, pull)
    assert _eventfds() == before + 1
    loop.start()
    loop.stop()
    loop.thread.join(10)
    assert not loop.thread.is_alive()
    assert _eventfds() == before
    # an fd opened now may reuse the closed number: a late interrupt must not write into it
    probe = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        loop.interrupt()
        with pytest.raises(BlockingIOError):
            os.eventfd_read(probe)
    finally:
        os.close(probe)


def test_a_loop_stopped_before_it_started_closes_its_eventfd(
    sockets: tuple[zmq.Context, Any],
) -> None:
    zctx, pull = sockets
    before = _eventfds()
    loop = SleepyLoop(zctx, pull)
    loop.stop()
    assert _eventfds() == before
    loop.interrupt()  # a no-op, not a write to a closed fd
