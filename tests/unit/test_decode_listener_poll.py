"""How often the decode's listener wakes: 1 ms while data is due or a warm-up waits (a
user's first request waits for it), 100 ms idle; a request or a warm-up shortens the
current sleep at once.

The listener runs on a real ZMQ socket; what it asks of its side (rooms pending, ABORT_ACKs,
a warm-up waiting) is a small stand-in whose answers each test sets.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from helpers.waiting import poll_until
from helpers.zmq_pair import loopback_pair

from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides.decode_listener import (
    BUSY_POLL_MS,
    IDLE_POLL_MS,
    STAGING_WARM_SLACK_S,
    WARMUP_POLL_MS,
    DecodeListener,
)


class Side:
    """What the listener asks of the decode side, with answers the test sets."""

    def __init__(self, zctx: zmq.Context, sock: Any) -> None:
        self.pending: set[tuple[str, int]] = set()
        self.acks = False
        self.warming = False
        self.staging_bounds: list[float] = []  # each look at the staging offers' warm-up
        self.staging_warming = False
        self.progressed = 0
        self.ctx = SimpleNamespace(
            zmq_ctx=zctx,
            server_socket=sock,
            settings=Settings(),
            engine=SimpleNamespace(agent=SimpleNamespace(progress=self._progress)),
            warmup=SimpleNamespace(waiting=lambda: self.warming),
            staging=SimpleNamespace(offers=SimpleNamespace(warming=self._staging_warming)),
            sglang=SimpleNamespace(abort_acks_pending=lambda: self.acks),
        )

    def _staging_warming(self, bound_s: float) -> bool:
        self.staging_bounds.append(bound_s)
        return self.staging_warming

    def _progress(self) -> None:
        self.progressed += 1

    def pending_endpoints(self) -> set[tuple[str, int]]:
        return set(self.pending)


class Listener(DecodeListener):
    def check_liveness(self) -> None:
        """Only the part under test (no peers to watch or ping here)."""
        self._update_poll()


@pytest.fixture
def listener() -> Iterator[tuple[DecodeListener, Side]]:
    with loopback_pair() as (zctx, pull, _push, _):
        side = Side(zctx, pull)
        loop = Listener(side)  # type: ignore[arg-type]
        yield loop, side
        loop.stop()
        if loop.thread.ident is not None:
            loop.thread.join(10)


def test_idle_until_told_then_each_rate_for_what_is_due(
    listener: tuple[DecodeListener, Side],
) -> None:
    loop, side = listener
    assert loop.poll_ms() == IDLE_POLL_MS
    loop.expect_data(warmup=True)
    assert loop.poll_ms() == WARMUP_POLL_MS == BUSY_POLL_MS
    loop.expect_data()
    assert loop.poll_ms() == BUSY_POLL_MS
    loop.expect_data(warmup=True)  # a warm-up never slows a busy loop
    assert loop.poll_ms() == BUSY_POLL_MS

    side.pending = {("127.0.0.1", 1)}
    loop._update_poll()
    assert loop.poll_ms() == BUSY_POLL_MS
    side.pending, side.acks = set(), True
    loop._update_poll()
    assert loop.poll_ms() == BUSY_POLL_MS
    side.acks, side.warming = False, True
    loop._update_poll()
    assert loop.poll_ms() == WARMUP_POLL_MS
    side.warming = False
    loop._update_poll()
    assert loop.poll_ms() == IDLE_POLL_MS


def test_a_request_interrupts_the_idle_sleep(listener: tuple[DecodeListener, Side]) -> None:
    """The loop starts in a sleep far longer than the wait below (its idle period set to
    60 s); a request must end that sleep and start the 1 ms polling at once."""
    loop, side = listener
    loop._poll_ms = 60_000
    loop.start()
    side.pending = {("127.0.0.1", 1)}  # the request's room, as SGLang's tables show it
    loop.expect_data()
    poll_until(lambda: side.progressed, lambda n: n >= 20, 5, what="1 ms progress")
    assert loop.poll_ms() == BUSY_POLL_MS


def test_after_a_staging_offer_the_listener_progresses_through_the_prefills_warm_up(
    listener: tuple[DecodeListener, Side],
) -> None:
    """A prefill rank that takes our staging area WRITEs into it at once; over TCP that
    WRITE moves only as we progress, so the listener polls at the warm-up rate while the
    offers say one may be coming (for the prefill's bound and a little more), idle after."""
    loop, side = listener
    side.staging_warming = True
    loop._update_poll()
    assert loop.poll_ms() == WARMUP_POLL_MS
    assert side.staging_bounds == [Settings().warmup_timeout_s + STAGING_WARM_SLACK_S]
    side.staging_warming = False
    loop._update_poll()
    assert loop.poll_ms() == IDLE_POLL_MS
