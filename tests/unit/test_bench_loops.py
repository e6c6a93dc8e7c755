"""The bench's rank loops wake on the manager's status changes instead of sleeping
through them (the sleep put ~0.3 ms of the bench's own wait into every latency)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sgl_nixl_plugin.bench.driver import StatusBell


class Manager:
    def __init__(self) -> None:
        self.request_status: dict[int, int] = {}

    def update_status(self, room: int, status: int) -> None:
        self.request_status[room] = status


def test_a_status_change_rings_the_bell_and_still_reaches_the_table() -> None:
    mgr = Manager()
    bell = StatusBell(mgr)
    assert not bell._event.is_set()
    mgr.update_status(7, 4)
    assert mgr.request_status == {7: 4}
    assert bell._event.is_set()
    bell.wait()  # returns at once and re-arms
    assert not bell._event.is_set()


def test_a_change_from_another_thread_ends_a_long_wait() -> None:
    """With a wait far longer than the test's timeout, only the ring can end it."""
    mgr = Manager()
    bell = StatusBell(mgr)
    bell.WAIT_S = 600.0
    ended = threading.Event()

    def loop() -> None:
        bell.wait()
        ended.set()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    mgr.update_status(3, 2)
    assert ended.wait(timeout=30), "the bell did not wake the loop"
    t.join(timeout=5)


def test_an_update_that_raises_still_rings() -> None:
    """SGLang's update_status may raise (an unknown room); the loop must still look."""

    class Strict(Manager):
        def update_status(self, room: int, status: Any) -> None:
            raise KeyError(room)

    mgr = Strict()
    bell = StatusBell(mgr)
    with pytest.raises(KeyError):
        mgr.update_status(1, 1)
    assert bell._event.is_set()
