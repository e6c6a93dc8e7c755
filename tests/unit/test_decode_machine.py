"""A decode room's transitions, over random orders of its events (hypothesis).

The machine driver plays SGLang's receiver (``init``, the transfer requests, a host
destination, completion-flag words handed out, an abort, SGLang's own Failed, the clear),
the room's prefill ranks (statuses, stored flags, abort ACKs), the liveness watch (a rank
lost) and the clock, in any order, and keeps its own account of what was sent where and
what each rank said; the invariants hold that account against the machine: the outcome is
decided once (a status after the room ended, an abort or a failure changes nothing; a
Success only once every expected sender reported one), and flag words are freed once. The table
driver does the same through ``DecodeRooms`` for a few rooms that share one clock, and
checks what the rest of the decode reads: a record leaves its table once, a host room's
pages are safe only once drained, and a drained room never holds its table.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from sgl_nixl_plugin.protocol.decode_machine import (
    AbortAcked,
    Aborted,
    ApplyStatus,
    Cleared,
    Close,
    DecodeMachine,
    DecodePhase,
    Effect,
    Event,
    FailedHere,
    FlagGiven,
    FlagSeen,
    FreeFlags,
    HostPages,
    NextTarget,
    Opened,
    PeerLost,
    ReleaseSlots,
    RequestsEnd,
    RequestsStart,
    SentTo,
    StatusIn,
    Tick,
)
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms

P = DecodePhase
Q = 5.0  # the quarantine after a loss
RANKS = [("10.0.0.1", 1), ("10.0.0.1", 2), ("10.0.0.2", 1)]
rank = st.sampled_from(RANKS)
prank = st.integers(0, 2)  # a prefill rank as its statuses and flags name it
#: how far the phase has come (live phases never go back; a room never comes back to life)
ORDER = {P.CONNECTING: 0, P.REQUESTING: 1, P.RECEIVING: 2, P.ABORTED: 3, P.DRAINING: 4}


def safe(sent: set, acked: set, lost: dict, now: float) -> bool:
    """The driver's own account: nothing more can land in the room's pages."""
    return all(ep in acked or (ep in lost and now - lost[ep] >= Q) for ep in sent)


class Room(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = DecodeMachine(7, set(RANKS[:1]), quarantine_s=Q)
        self.effects: list[Effect] = []
        self.now = 0.0
        self.sent: set = set()  # ranks a request went to, as SentTo said
        self.acked: set = set()
        self.lost: dict = {}  # host rooms: when each rank it was sent to was lost
        self.host = False
        self.cleared: bool | None = None  # ok of SGLang's clear
        self.aborted_ok = False  # an abort came after SGLang cleared the room with Success
        self.highest = 0  # the furthest phase seen while live
        self.expected = 1  # senders whose Success makes the room's (SGLang's count)
        self.decided: bool | None = None  # an abort, a failure, or every Success: ok
        self.reported: set[int] = set()  # ranks whose Success (status or flag) counted
        self.given: list[int] = []  # flag words handed out while live
        self.due: dict[int, int] = {}  # word -> rank, not yet seen
        self.words = 100

    @initialize(n=st.integers(1, 3))
    def senders(self, n: int) -> None:
        self.expected = n

    def feed(self, event: Event) -> list[Effect]:
        was = self.m.phase
        out = self.m.on(event)
        self.effects += out
        if was.terminal:
            assert out == [] and self.m.phase is was, (event, out)  # a closed room stays so
        if not was.live:
            assert not self.m.phase.live  # no way back to life
            assert not any(isinstance(e, (SentTo, ReleaseSlots, ApplyStatus)) for e in out)
        for e in out:
            if isinstance(e, SentTo):
                self.sent.add(e.endpoint)
        return out

    def count(self, kind: type) -> int:
        return sum(isinstance(e, kind) for e in self.effects)

    # -- SGLang's receiver -----------------------------------------------------------------
    @rule(eps=st.sets(rank, min_size=1))
    def opened(self, eps: set) -> None:
        self.feed(Opened(frozenset(eps)))
        if self.m.phase.live:
            assert self.m.endpoints == eps

    @rule(order=st.lists(rank, min_size=1, max_size=3, unique=True))
    def requests_start(self, order: list) -> None:
        self.feed(RequestsStart(tuple(order)))

    @rule()
    def next_target(self) -> None:
        due = list(self.m.targets)
        out = self.feed(NextTarget())
        if due and self.m.phase.live:
            assert out == [SentTo(due[0])]
        else:
            assert out == []

    @rule()
    def requests_end(self) -> None:
        self.feed(RequestsEnd())
        assert not self.m.targets

    @rule()
    def host_pages(self) -> None:
        if self.m.phase.live:
            self.host = True
        self.feed(HostPages())

    @rule()
    def aborted(self) -> None:
        before = self.m.phase
        out = self.feed(Aborted())
        assert out == []  # an abort alone never releases nor closes anything
        if before.live:
            assert self.m.phase is P.ABORTED
            self.decided = False if self.decided is None else self.decided
        else:
            assert self.m.phase is before  # after the clear (Success or not): nothing
            self.aborted_ok = self.aborted_ok or before is P.SUCCEEDED

    @rule(ok=st.booleans())
    def cleared(self, ok: bool) -> None:
        live = self.m.phase.live
        out = self.feed(Cleared(ok, self.now))
        if not live:
            return
        self.cleared = ok
        assert out[0] == ReleaseSlots(failed=not ok)  # slots return at the clear, whatever else
        free = [FreeFlags(tuple(self.given))] if self.given else []
        if ok:
            assert out[1:] == free + [Close(P.SUCCEEDED)]
        elif self.host and not safe(self.sent, self.acked, self.lost, self.now):
            assert out[1:] == [] and self.m.phase is P.DRAINING
        else:
            assert out[1:] == free + [Close(P.FAILED)]

    @rule()
    def failed_here(self) -> None:
        """SGLang set Failed itself (its timeouts), or this side failed the room."""
        if self.m.phase.live and self.decided is None:
            self.decided = False
        assert self.feed(FailedHere()) == []

    @rule(r=prank)
    def flag_given(self, r: int) -> None:
        self.words += 1
        if self.m.phase.live:
            self.given.append(self.words)
            self.due[self.words] = r
        assert self.feed(FlagGiven(self.words, 1, r)) == []

    # -- the prefill ranks, the liveness watch, the clock ----------------------------------
    def _status(self, out: list[Effect], live: bool, r: int, ok: bool) -> None:
        """What a status may do: nothing once the room ended or its outcome was decided;
        a Failed applies at once, a Success once every expected sender reported one."""
        if not live or self.decided is not None:
            assert out == [], out  # a status after the end, an abort or a failure
            return
        if not ok:
            self.decided = False
            assert out == [ApplyStatus(False, (r,), "why")]
            return
        self.reported.add(r)
        if len(self.reported) < self.expected:
            assert out == []
            return
        self.decided = True
        assert out == [ApplyStatus(True, tuple(sorted(self.reported)))]

    @rule(r=prank, ok=st.booleans())
    def status(self, r: int, ok: bool) -> None:
        live, outcome = self.m.phase.live, self.m.outcome
        out = self.feed(StatusIn(r, ok, "" if ok else "why", self.expected))
        self._status(out, live, r, ok)
        if not live or outcome is not None:
            assert self.m.outcome == outcome  # and the machine's outcome stays

    @rule(data=st.data())
    def flag_seen(self, data: st.DataObject) -> None:
        word = data.draw(st.sampled_from(sorted(self.due) + [1]))  # 1: never given
        live = self.m.phase.live
        out = self.feed(FlagSeen(word, self.expected))
        if live and word in self.due:
            self._status(out, live, self.due.pop(word), True)
        else:
            assert out == []

    @rule(ep=rank)
    def abort_acked(self, ep) -> None:
        if not self.m.phase.terminal:
            self.acked.add(ep)
        self.feed(AbortAcked(ep, self.now))

    @rule(ep=rank)
    def peer_lost(self, ep) -> None:
        if not self.m.phase.terminal and self.host and ep in self.sent:
            self.lost.setdefault(ep, self.now)
        self.feed(PeerLost(ep, self.now))

    @rule(dt=st.sampled_from([0.5, 2.0, 4.9, 5.0, 30.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        self.feed(Tick(self.now))

    # -- what holds after every step -------------------------------------------------------
    @invariant()
    def ends_once(self) -> None:
        assert self.count(Close) <= 1 and self.count(ReleaseSlots) <= 1
        closes = [e for e in self.effects if isinstance(e, Close)]
        if closes:
            assert self.m.phase is closes[0].phase and self.m.phase.terminal
            assert self.count(ReleaseSlots) == 1  # slots went back at the clear
        if self.m.phase.terminal:
            assert closes

    @invariant()
    def one_outcome(self) -> None:
        """At most one status reaches SGLang as the room's outcome; a Success names every
        sender, and only once every expected one reported."""
        applied = [e for e in self.effects if isinstance(e, ApplyStatus)]
        assert len(applied) <= 1
        for e in applied:
            assert self.m.outcome is e.ok is self.decided
            if e.ok:
                assert set(e.ranks) == self.reported and len(e.ranks) >= self.expected
        if self.m.phase.live:
            assert self.m.outcome is self.decided

    @invariant()
    def flag_words_freed_once(self) -> None:
        """Every word handed out is freed once, at the room's way out, with its Close."""
        frees = [e for e in self.effects if isinstance(e, FreeFlags)]
        assert len(frees) <= 1
        freed = [w for e in frees for w in e.words]
        assert sorted(freed) == (sorted(self.given) if self.m.phase.terminal else [])
        if frees:
            i = self.effects.index(frees[0])
            assert isinstance(self.effects[i + 1], Close)
        if not self.m.phase.terminal:
            assert [w for w, _, _ in self.m.flags_due] == sorted(self.due)

    @invariant()
    def phases_go_forward(self) -> None:
        if self.m.phase in ORDER:
            now = ORDER[self.m.phase]
            if self.m.phase is not P.ABORTED:  # a request may go out after an abort
                assert now >= min(self.highest, ORDER[P.RECEIVING])
            self.highest = max(self.highest, now)

    @invariant()
    def the_drain_is_the_drivers(self) -> None:
        assert self.m.sent_to == self.sent and self.m.acked >= self.acked & self.sent
        assert self.m.host == self.host
        drained = safe(self.sent, self.acked, self.lost, self.now)
        if not self.m.phase.terminal:
            assert self.m.drained(self.now) == drained
        assert self.m.acks_due() <= self.m.undrained()
        if not (self.host and self.m.phase in (P.ABORTED, P.DRAINING)):
            assert self.m.acks_due() == set()

    @invariant()
    def nothing_in_flight_at_a_terminal_phase(self) -> None:
        """A host room's pages are given back only once every rank it was sent to acked
        or was lost a quarantine ago; a room ends Succeeded only as SGLang cleared it."""
        if self.m.phase is P.SUCCEEDED:
            assert self.cleared is True
        if self.m.phase is P.FAILED:
            assert self.cleared is False
            if self.host:
                assert self.m.drained(self.now)
                assert safe(self.sent, self.acked, self.lost, self.now)

    @invariant()
    def a_drained_room_does_not_wait(self) -> None:
        """DRAINING only while something may still land: it closes at the event that
        drains it (an ACK, or the tick that ends a lost rank's quarantine)."""
        if self.m.phase is P.DRAINING:
            assert self.host and not safe(self.sent, self.acked, self.lost, self.now)

    def teardown(self) -> None:
        """SGLang clears the room if it has not, every rank acks: it ends, once."""
        if self.m.phase.live:
            self.cleared = False
            self.feed(Cleared(False, self.now))
        for ep in RANKS:
            self.feed(AbortAcked(ep, self.now))
        assert self.count(Close) == 1 and self.m.phase.terminal
        assert self.m.on(Aborted()) == [] and self.m.on(Cleared(False, self.now)) == []
        assert self.m.on(StatusIn(0, True, "", 1)) == [] and self.m.on(StatusIn(0, False)) == []
        assert self.count(FreeFlags) == (1 if self.given else 0)


Room.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_room_over_random_event_orders = Room.TestCase


class Table(RuleBasedStateMachine):
    """Three room ids through ``DecodeRooms`` on one clock (reused once they left)."""

    ROOMS = (1, 2, 3)

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.rooms = DecodeRooms(4, quarantine_s=Q, clock=lambda: self.now)
        self.sent: dict[int, set] = {}
        self.acked: dict[int, set] = {}
        self.lost: dict[int, dict] = {}  # host rooms: rank -> when lost after it was sent to
        self.host: dict[int, bool] = {}
        self.failed_host: set[int] = set()  # cleared failed, pages held by SGLang
        self.aborted: set[int] = set()  # live rooms whose abort went out
        self.freed: list[int] = []  # completion-flag words the table freed, in order
        self.rooms.free_flag = self.freed.append
        self.words: dict[int, list[int]] = {}  # live room -> flag words handed out for it
        self.given: list[int] = []

    def _safe(self, room: int) -> bool:
        return safe(self.sent[room], self.acked[room], self.lost[room], self.now)

    @precondition(lambda self: any(r not in self.rooms for r in self.ROOMS))
    @rule(data=st.data(), eps=st.sets(rank, min_size=1, max_size=2))
    def open_and_request(self, data: st.DataObject, eps: set) -> None:
        room = data.draw(st.sampled_from([r for r in self.ROOMS if r not in self.rooms]))
        rec = self.rooms.open(room, eps)
        if not rec.phase.live:  # reused while draining: the receiver fails the new room
            assert room in self.failed_host and self.rooms.is_host(room)
            return
        self.failed_host.discard(room)
        self.sent[room], self.acked[room], self.host[room] = set(), set(), False
        self.lost[room], self.words[room] = {}, []
        host = data.draw(st.booleans())
        self.rooms.start_requests(room, sorted(eps))
        if host:
            self.rooms.set_host(room)
            self.host[room] = True
        for _ in range(data.draw(st.integers(0, len(eps)))):
            ep = self.rooms.next_target(room)
            assert ep is not None
            self.sent[room].add(ep)
        if data.draw(st.booleans()):
            self.rooms.grant(room, np.arange(4), sorted(eps)[0])
        self.rooms.end_requests(room)

    @precondition(lambda self: any(r in self.rooms for r in self.ROOMS))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from([r for r in self.ROOMS if r in self.rooms]))
        self.rooms.aborted(room)
        self.aborted.add(room)
        assert room in self.rooms

    @precondition(lambda self: any(r in self.rooms for r in self.ROOMS))
    @rule(data=st.data())
    def flag(self, data: st.DataObject) -> None:
        room = data.draw(st.sampled_from([r for r in self.ROOMS if r in self.rooms]))
        word = len(self.given)
        self.given.append(word)
        self.words[room].append(word)
        assert self.rooms.feed(room, FlagGiven(word, 1, 0)) == []

    @precondition(lambda self: any(r in self.rooms for r in self.ROOMS))
    @rule(data=st.data(), ok=st.booleans())
    def clear(self, data: st.DataObject, ok: bool) -> None:
        room = data.draw(st.sampled_from([r for r in self.ROOMS if r in self.rooms]))
        self.rooms.close(room, ok)
        self.aborted.discard(room)
        assert room not in self.rooms and self.rooms.close(room, ok) == []
        if not ok and self.host[room] and not self._safe(room):
            self.failed_host.add(room)
            assert self.rooms.sizes()["host_draining"] >= 1

    @rule(room=st.sampled_from(ROOMS), ep=rank)
    def ack(self, room: int, ep) -> None:
        if room in self.rooms or room in self.failed_host:
            self.acked[room].add(ep)
        self.rooms.abort_acked(room, ep)

    @rule(ep=rank)
    def lose(self, ep) -> None:
        for room in self.ROOMS:
            if (room in self.rooms or room in self.failed_host) and self.host[room]:
                if ep in self.sent[room]:
                    self.lost[room].setdefault(ep, self.now)
        self.rooms.peer_lost(ep)

    @rule(dt=st.sampled_from([1.0, 4.9, 5.0, 30.0]))
    def tick(self, dt: float) -> None:
        self.now += dt
        if self.rooms.drain_endpoints() is not None:  # the liveness check's question
            self.failed_host = {r for r in self.failed_host if not self._safe(r)}

    @rule(room=st.sampled_from(ROOMS))
    def ask_safe(self, room: int) -> None:
        said = self.rooms.release_safe(room)
        if room in self.failed_host:
            assert said == self._safe(room)  # never early, never stuck
            if said:
                self.failed_host.discard(room)
        elif room not in self.rooms:
            assert said  # a room without a record is safe

    @invariant()
    def one_table(self) -> None:
        sizes = self.rooms.sizes()
        live = [r for r in self.ROOMS if r in self.rooms]
        assert sizes["rooms"] == len(live) == len(self.rooms)
        held = [r for r in self.failed_host if self.rooms.is_host(r) and r not in self.rooms]
        # a draining record is still there unless something drained it meanwhile
        assert sizes["host_draining"] >= len([r for r in held if not self._safe(r)])
        assert sizes["host_draining"] <= len(held)
        for r in self.failed_host:
            if not self._safe(r):
                assert not self.rooms.release_safe(r)

    @invariant()
    def flag_words_freed_once(self) -> None:
        """A word is freed once, never while its room is live."""
        assert len(set(self.freed)) == len(self.freed) and set(self.freed) <= set(self.given)
        for room in self.ROOMS:
            if room in self.rooms:
                assert not set(self.words[room]) & set(self.freed)

    @invariant()
    def watched(self) -> None:
        """The liveness watch follows the ranks whose ACK a host room's pages wait for,
        except those already lost (their quarantine runs out by itself)."""
        due: set = set()
        for room in self.ROOMS:
            if self.host.get(room) and room in self.failed_host | self.aborted:
                due |= self.sent[room] - self.acked[room] - set(self.lost[room])
        assert self.rooms.drain_endpoints() == due

    def teardown(self) -> None:
        """Every room cleared, every rank acked: nothing is left in the table."""
        for room in self.ROOMS:
            if room in self.rooms:
                self.rooms.close(room, False)
            for ep in RANKS:
                self.rooms.abort_acked(room, ep)
            assert self.rooms.release_safe(room)
        self.now += Q
        assert sorted(self.freed) == self.given  # every word handed out came back, once
        assert self.rooms.sizes() == {
            "rooms": 0,
            "host_draining": 0,
            "waiting": 0,
            "slots_held": 0,
            "slots_busy": 0,
        }


Table.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_rooms_over_random_event_orders = Table.TestCase


# -- single paths -----------------------------------------------------------------------------
def _host_room(*ranks) -> DecodeMachine:
    m = DecodeMachine(1, set(ranks), quarantine_s=Q)
    m.on(RequestsStart(tuple(ranks)))
    m.on(HostPages())
    for _ in ranks:
        m.on(NextTarget())
    m.on(RequestsEnd())
    return m


def test_a_room_goes_connecting_requesting_receiving_then_closes_succeeded():
    m = DecodeMachine(1, {RANKS[0]})
    assert m.phase is P.CONNECTING
    assert m.on(RequestsStart((RANKS[0],))) == [] and m.phase is P.REQUESTING
    assert m.on(NextTarget()) == [SentTo(RANKS[0])] and m.on(NextTarget()) == []
    assert m.on(RequestsEnd()) == [] and m.phase is P.RECEIVING
    assert m.on(Cleared(True, 0.0)) == [ReleaseSlots(failed=False), Close(P.SUCCEEDED)]
    assert m.on(Aborted()) == [] and m.phase is P.SUCCEEDED  # an abort after Success


def test_a_failed_host_room_drains_after_its_clear_and_closes_at_the_last_ack():
    m = _host_room(RANKS[0], RANKS[1])
    assert m.on(Aborted()) == [] and m.phase is P.ABORTED
    assert m.acks_due() == {RANKS[0], RANKS[1]}
    m.on(AbortAcked(RANKS[0], 1.0))
    assert m.on(Cleared(False, 1.0)) == [ReleaseSlots(failed=True)] and m.phase is P.DRAINING
    assert m.on(Opened(frozenset({RANKS[2]}))) == [] and m.endpoints == {RANKS[0], RANKS[1]}
    assert m.on(Tick(1e6)) == []  # no timeout while the rank is alive
    assert m.on(AbortAcked(RANKS[1], 1e6)) == [Close(P.FAILED)]
    assert m.on(AbortAcked(RANKS[1], 1e6)) == []


def test_a_lost_rank_frees_the_pages_a_quarantine_after_its_loss():
    m = _host_room(RANKS[0])
    m.on(Aborted())
    assert m.on(PeerLost(RANKS[2], 0.0)) == [] and m.lost_at == {}  # not sent to
    m.on(PeerLost(RANKS[0], 10.0))
    assert m.acks_due() == set()
    assert m.on(Cleared(False, 12.0)) == [ReleaseSlots(failed=True)]
    assert m.on(Tick(14.9)) == [] and m.on(Tick(15.0)) == [Close(P.FAILED)]


def test_device_rooms_and_unsent_host_rooms_close_at_their_clear():
    device = DecodeMachine(1, {RANKS[0]})
    device.on(RequestsStart((RANKS[0],)))
    device.on(NextTarget())
    device.on(Aborted())
    assert device.on(Cleared(False, 0.0)) == [ReleaseSlots(failed=True), Close(P.FAILED)]
    unsent = DecodeMachine(2, {RANKS[0]})
    unsent.on(HostPages())
    unsent.on(Aborted())
    assert unsent.drained(0.0)
    assert unsent.on(Cleared(False, 0.0))[-1] == Close(P.FAILED)


def test_a_reused_room_id_gets_its_draining_record_back_not_live():
    now = [0.0]
    rooms = DecodeRooms(2, quarantine_s=Q, clock=lambda: now[0])
    rooms.open(7, {RANKS[0]})
    rooms.start_requests(7, [RANKS[0]])
    rooms.set_host(7)
    rooms.next_target(7)
    rooms.end_requests(7)
    rooms.aborted(7)
    rooms.close(7, ok=False)
    rec = rooms.open(7, {RANKS[1]})
    assert rec.phase is P.DRAINING and 7 not in rooms and rooms.get(7) is None
    assert rooms.grant(7, np.arange(2), RANKS[1]) == ([], False) and rooms.slots.free == 2
    rooms.start_requests(7, [RANKS[1]])
    assert rooms.next_target(7) is None and not rooms.release_safe(7)
    rooms.abort_acked(7, RANKS[0])
    assert rooms.release_safe(7) and rooms.sizes()["host_draining"] == 0
    assert rooms.open(7, {RANKS[1]}).phase is P.CONNECTING  # a new record now


@settings(max_examples=100, deadline=None)
@given(ok=st.booleans(), host=st.booleans(), acks=st.sets(rank), t=st.floats(0, 100))
def test_an_abort_after_the_clear_changes_nothing(ok, host, acks, t) -> None:
    m = _host_room(*RANKS) if host else DecodeMachine(1, set(RANKS))
    for ep in acks:
        m.on(AbortAcked(ep, t))
    m.on(Cleared(ok, t))
    phase, due, sent = m.phase, m.acks_due(), set(m.sent_to)
    assert m.on(Aborted()) == [] and m.phase is phase and m.acks_due() == due
    assert m.sent_to == sent


def test_unknown_events_are_refused():
    with pytest.raises(TypeError):
        DecodeMachine(1, set()).on("cleared")  # type: ignore[arg-type]


def test_a_success_applies_once_every_sender_reported_by_status_or_flag():
    m = DecodeMachine(1, set(RANKS[:2]))
    m.on(FlagGiven(9, 3, 1))
    assert m.on(StatusIn(0, True, "", expected=2)) == []
    assert m.on(FlagSeen(8, expected=2)) == []  # not this room's word
    assert m.on(FlagSeen(9, expected=2)) == [ApplyStatus(True, (0, 1))]
    assert m.flags_due == [] and m.flag_words == [9]
    assert m.on(StatusIn(1, True, "", expected=2)) == []  # the status after its flag
    assert m.on(StatusIn(1, False, "late", expected=2)) == []  # the outcome was decided
    assert m.on(Cleared(True, 0.0)) == [
        ReleaseSlots(failed=False),
        FreeFlags((9,)),
        Close(P.SUCCEEDED),
    ]


@pytest.mark.parametrize("first", [Aborted(), FailedHere(), StatusIn(2, False, "first")])
def test_no_status_applies_over_an_abort_or_a_failure(first) -> None:
    m = DecodeMachine(1, set(RANKS))
    m.on(first)
    assert m.outcome is False
    assert m.on(StatusIn(0, True)) == [] and m.on(StatusIn(1, False, "second")) == []


def test_a_status_for_a_room_no_longer_live_is_dropped_by_its_table():
    rooms = DecodeRooms(0)
    assert rooms.feed(5, StatusIn(0, True)) == []  # no record
    rooms.open(5, {RANKS[0]})
    assert rooms.feed(5, StatusIn(0, True)) == [ApplyStatus(True, (0,))]
    rooms.close(5, ok=True)
    assert rooms.feed(5, StatusIn(0, False, "late")) == []
