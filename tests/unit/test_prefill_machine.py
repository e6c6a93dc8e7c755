"""A prefill room's transitions, over random orders of its events (hypothesis).

The driver plays the owning worker (chunks, posts, settles, failures, SGLang's status, the
answer to ``ConcludeSuccess``) and SGLang's scheduler (``Released``, at any time), within
the worker's contract: it posts only while something of the room is in flight (a chunk
being submitted holds the count), and answers a ``ConcludeSuccess`` before anything else.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from sgl_nixl_plugin.protocol.prefill_machine import (
    ChunkIn,
    Close,
    Concluded,
    ConcludeFailure,
    ConcludeSuccess,
    Effect,
    Event,
    Failure,
    Mirror,
    Posted,
    PrefillPhase,
    Released,
    RoomClosed,
    RoomMachine,
    Settled,
    StatusEnded,
)

P = PrefillPhase


class Room(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = RoomMachine(7)
        self.effects: list[Effect] = []
        self.held = 0  # what the driver knows to be in flight
        self.last_seen = False  # a last chunk reached the room while it was sending
        self.stopped = False  # a failure, an ended status or a release reached it sending
        self.answered: bool | None = None  # SGLang's answer to ConcludeSuccess
        self.stopped_sending = False  # no new WRITE may start, for good

    def feed(self, event: Event) -> list[Effect]:
        before, was_closed = self.m.in_flight, self.m.phase.terminal
        sends = self.m.phase.sends
        out = self.m.on(event)
        self.effects += out
        if was_closed:
            assert out == [], (event, out)  # a closed room does nothing more
        mirrors = [e.in_flight for e in out if isinstance(e, Mirror)]
        if self.m.in_flight != before:
            assert mirrors == [self.m.in_flight], out  # each change mirrored, once
        else:
            assert mirrors in ([], [before]), out
        if ConcludeSuccess() in out:  # every chunk came and landed, nothing stopped it
            assert self.last_seen and self.m.in_flight == 0 and not self.stopped
        if sends and isinstance(event, (Failure, StatusEnded, Released)):
            self.stopped = True
        if isinstance(event, Settled) and event.error and sends:
            self.stopped = True
        if isinstance(event, Concluded):
            self.answered = event.ok
        return out

    def count(self, kind: type) -> int:
        return sum(isinstance(e, kind) for e in self.effects)

    # -- the owning worker ----------------------------------------------------------------
    def _owner_may(self) -> bool:
        return not self.m.phase.terminal and self.m.phase is not P.CONCLUDING

    @precondition(lambda self: self._owner_may())
    @rule(last=st.booleans())
    def chunk_in(self, last: bool) -> None:
        if last and self.m.phase.sends:
            self.last_seen = True
        self.feed(ChunkIn(last))
        self.held += 1

    @precondition(lambda self: self._owner_may() and self.held > 0)
    @rule(n=st.integers(1, 3))
    def posted(self, n: int) -> None:
        self.feed(Posted(n))
        self.held += n

    @precondition(lambda self: self.held > 0)
    @rule(data=st.data(), error=st.sampled_from(["", "", "", "remote hung up"]))
    def settled(self, data: st.DataObject, error: str) -> None:
        n = data.draw(st.integers(1, self.held))
        self.held -= n
        self.feed(Settled(n, error))

    @precondition(lambda self: self.m.phase is not P.CONCLUDING)
    @rule(reason=st.sampled_from(["no destination", "decode dropped"]))
    def failure(self, reason: str) -> None:
        self.feed(Failure(reason))

    @precondition(lambda self: self.m.phase is not P.CONCLUDING)
    @rule()
    def status_ended(self) -> None:
        self.feed(StatusEnded())

    @precondition(lambda self: self.m.phase is P.CONCLUDING)
    @rule(ok=st.booleans())
    def concluded(self, ok: bool) -> None:
        self.feed(Concluded(ok))

    # -- SGLang's scheduler thread ---------------------------------------------------------
    @rule()
    def released(self) -> None:
        self.feed(Released())

    # -- what holds after every step -------------------------------------------------------
    @invariant()
    def counts(self) -> None:
        assert self.m.in_flight == self.held >= 0

    @invariant()
    def one_outcome(self) -> None:
        assert self.count(Close) <= 1 and self.count(ConcludeFailure) <= 1
        assert self.count(ConcludeSuccess) <= 1
        closes = [e for e in self.effects if isinstance(e, Close)]
        if closes:
            assert self.m.phase is closes[0].phase and self.m.in_flight == 0
        if any(c.phase is P.SUCCEEDED for c in closes):
            assert self.count(ConcludeFailure) == 0 and self.count(ConcludeSuccess) == 1

    @invariant()
    def no_write_after_draining(self) -> None:
        if self.stopped_sending:
            assert not self.m.phase.sends
        self.stopped_sending = not self.m.phase.sends

    @invariant()
    def a_stop_ends_failed(self) -> None:
        if self.stopped and self.count(ConcludeSuccess) == 0:
            assert self.m.phase in (P.DRAINING, P.FAILED)

    def teardown(self) -> None:
        """Let everything settle, answer Success, then SGLang clears the sender: the room
        has closed exactly once, Succeeded only where SGLang emitted Success."""
        if self.held:
            self.held, n = 0, self.held
            self.feed(Settled(n))
        if self.m.phase is P.CONCLUDING:
            self.feed(Concluded(True))
        self.feed(StatusEnded())
        closes = [e for e in self.effects if isinstance(e, Close)]
        assert len(closes) == 1 and self.m.in_flight == 0
        succeeded = closes[0].phase is P.SUCCEEDED
        assert succeeded == (self.answered is True)
        if succeeded:
            assert self.last_seen and self.count(ConcludeFailure) == 0


Room.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
test_room_over_random_event_orders = Room.TestCase


@settings(max_examples=200, deadline=None)
@given(
    before=st.lists(st.sampled_from(["chunk", "last", "post", "settle"]), max_size=12),
    reason=st.sampled_from(["a post was refused", "no destination"]),
)
def test_a_failure_at_any_point_ends_failed_once(before: list[str], reason: str) -> None:
    """Whatever came before, a failure of ours while the room sends is concluded once, and
    the room closes Failed once what it has in flight settled."""
    m, held = RoomMachine(1), 0
    for step in before:
        if step in ("chunk", "last"):
            m.on(ChunkIn(step == "last"))
            held += 1
        elif step == "post" and held:
            m.on(Posted())
            held += 1
        elif step == "settle" and held > 1:  # keep the room from concluding
            m.on(Settled())
            held -= 1
    if not m.phase.sends:
        return
    out = m.on(Failure(reason))
    assert ConcludeFailure(reason) in out and m.phase is (P.FAILED if not held else P.DRAINING)
    assert m.on(Failure("again")) == []
    effects = list(out)
    for _ in range(held):
        effects += m.on(Settled())
    effects += m.on(StatusEnded())
    assert effects.count(Close(P.FAILED)) == 1 and effects.count(ConcludeFailure(reason)) == 1
    assert not any(isinstance(e, ConcludeSuccess) for e in effects)


def test_a_chunk_landing_concludes_success_then_closes():
    m = RoomMachine(1)
    assert m.on(ChunkIn(last=True)) == [Mirror(1)] and m.phase is P.LANDING
    assert m.on(Posted(2)) == [Mirror(3)]
    assert m.on(Settled()) == [Mirror(2)]  # the chunk's posts are done
    assert m.on(Settled(2)) == [Mirror(0), ConcludeSuccess()]
    assert m.on(Released()) == []  # the outcome is being decided: it stands
    assert m.on(Concluded(True)) == [Close(P.SUCCEEDED)]


def test_an_ended_status_drains_without_concluding_then_closes():
    m = RoomMachine(1)
    m.on(ChunkIn(last=False))
    assert m.on(StatusEnded()) == [] and m.phase is P.DRAINING
    assert m.on(Failure("late")) == []  # the first cause stands; nothing concluded here
    assert m.on(Settled()) == [Mirror(0), Close(P.FAILED)]


def test_a_release_closes_only_a_room_no_worker_claimed():
    unclaimed = RoomMachine(1)
    assert unclaimed.on(Released()) == [Close(P.FAILED)]
    claimed = RoomMachine(2)
    claimed.on(ChunkIn(last=False))
    claimed.on(Settled())
    assert claimed.on(Released()) == [] and claimed.phase is P.DRAINING
    assert claimed.on(StatusEnded()) == [Close(P.FAILED)]  # its worker closes it


def test_nothing_new_starts_in_a_closed_room():
    m = RoomMachine(1)
    m.on(Released())
    with pytest.raises(RoomClosed):
        m.on(Posted())
    with pytest.raises(RoomClosed):
        m.on(ChunkIn(last=True))
    with pytest.raises(ValueError):
        RoomMachine(2).on(Settled())  # never below zero
