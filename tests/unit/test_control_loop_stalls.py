"""A control thread that was away from its socket says so, and says where the time went.

Decodes call a prefill rank lost after a few seconds without a pong. When that happens to a
live rank (the real-server stage once saw it under load), the rank's own log must tell
whether its handlers were slow or its thread was not run at all. The loop runs on a real
ZMQ socket; the handler under test is slow on purpose (its delay is the behaviour tested).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from helpers.zmq_pair import loopback_pair

from sgl_nixl_plugin.transport.control_loop import ControlLoop

INTERVAL_S = 0.2


class SlowHandlerLoop(ControlLoop):
    """Spends ``hold_s`` on every message, as a long registration would."""

    def __init__(self, zctx: zmq.Context, sock: Any, hold_s: float) -> None:
        super().__init__(zctx, sock, INTERVAL_S, 5, "test-ctl")
        self.hold_s = hold_s
        self.handled = threading.Event()

    def on_frames(self, frames: list[Any]) -> None:
        time.sleep(self.hold_s)
        self.handled.set()

    def check_liveness(self) -> None:
        pass


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.seen.set()


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Context, Any, Any]]:
    with loopback_pair() as (zctx, pull, push, _):
        yield zctx, pull, push


@pytest.fixture
def captured() -> Iterator[Captured]:
    handler = Captured()
    log = logging.getLogger("sgl_nixl_plugin.transport.control_loop")
    log.addHandler(handler)
    yield handler
    log.removeHandler(handler)


def _run(loop: SlowHandlerLoop, push: Any) -> None:
    loop.start()
    try:
        push.send_multipart([b"x"])
        assert loop.handled.wait(10), "the loop never handled the message"
    finally:
        # the warning, if any, follows the handler within the same pass of the loop
        loop.stop()
        loop.thread.join(10)
    assert not loop.thread.is_alive()


def test_a_slow_handler_is_named_with_its_time(
    sockets: tuple[zmq.Context, Any, Any], captured: Captured
) -> None:
    zctx, pull, push = sockets
    loop = SlowHandlerLoop(zctx, pull, hold_s=INTERVAL_S * 3)
    _run(loop, push)
    assert len(captured.lines) == 1, captured.lines
    line = captured.lines[0]
    assert "test-ctl: away from its socket for" in line
    assert "handling 1 messages" in line
    handling = float(line.split("late, ")[1].split("s handling")[0])
    assert handling >= INTERVAL_S * 3 - 0.05
    assert "peers call a rank lost after 1.0s without a pong" in line


def test_a_quick_handler_logs_nothing(
    sockets: tuple[zmq.Context, Any, Any], captured: Captured
) -> None:
    zctx, pull, push = sockets
    loop = SlowHandlerLoop(zctx, pull, hold_s=0.0)
    _run(loop, push)
    assert captured.lines == []
