"""A decode rank's room records and the slot policy, in process (no SGLang, no sockets)."""

from __future__ import annotations

import numpy as np

from sgl_nixl_plugin.protocol.decode_machine import FailedHere, StatusIn
from sgl_nixl_plugin.protocol.decode_rooms import DecodePhase, DecodeRooms

P5, P6, P9 = ("127.0.0.1", 5), ("127.0.0.1", 6), ("127.0.0.1", 9)


def _drained(rooms: DecodeRooms) -> None:
    assert rooms.sizes() == {
        "rooms": 0,
        "host_draining": 0,
        "waiting": 0,
        "slots_held": 0,
        "slots_busy": 0,
    }


def test_a_room_record_lives_from_init_to_clear():
    rooms = DecodeRooms(4)
    rec = rooms.open(7, {P5})
    assert rec.phase is DecodePhase.CONNECTING and rooms.endpoints(7) == {P5}
    rooms.start_requests(7, [P5])
    assert rec.phase is DecodePhase.REQUESTING
    assert rooms.next_target(7) == P5 and rooms.next_target(7) is None
    rooms.end_requests(7)
    assert rec.phase is DecodePhase.RECEIVING
    assert rooms.rooms_served_by(P5) == [7] and rooms.pending_endpoints() == {P5}
    rooms.close(7, ok=True)
    assert rec.phase is DecodePhase.SUCCEEDED and 7 not in rooms and rooms.rooms_served_by(P5) == []
    _drained(rooms)


def test_a_rooms_prefill_ranks_owe_it_data_until_its_outcome_or_abort():
    """Liveness watches closely the ranks whose data a room still waits for: the room's
    machine says which (its phase and outcome), not SGLang's status table."""
    rooms = DecodeRooms(4)
    for room, ep in ((7, P5), (8, P6), (9, P9)):
        rooms.open(room, {ep})
    assert rooms.pending_endpoints() == {P5, P6, P9}
    rooms.feed(7, StatusIn(0, True, "", expected=2))  # one of two senders
    assert rooms.pending_endpoints() == {P5, P6, P9}
    rooms.feed(7, StatusIn(1, True, "", expected=2))  # the room's Success
    rooms.feed(8, FailedHere())  # SGLang failed it (a timeout)
    assert rooms.pending_endpoints() == {P9}
    rooms.aborted(9)
    assert rooms.pending_endpoints() == set()
    for room in (7, 8, 9):
        rooms.close(room, ok=room == 7)
    _drained(rooms)


def test_a_decode_takes_back_only_scattered_slots_of_the_room_from_its_sender():
    rooms = DecodeRooms(4)
    rooms.open(7, {P5})
    rooms.open(8, {P6})
    slots, fresh = rooms.grant(7, np.arange(4), P5)
    assert len(slots) == 4 and fresh and rooms.slots.free == 0
    assert rooms.occupy(7, slots[0]) == ""  # a piece there is not scattered yet
    assert rooms.take_back(7, P5, slots)[0]  # busy slot: refused
    assert rooms.take_back(7, P9, slots[1:])[0]  # not the room's sender
    assert rooms.take_back(8, P6, slots[1:])[0]  # not that room's slots
    assert rooms.take_back(7, P5, [slots[1], slots[1]])[0]  # named twice
    assert rooms.slots.free == 0 and rooms.counters.returned == 0
    # room 8 waits: room 7 holds slots with a piece in flight, so no recall yet
    rooms.grant(8, np.arange(4), P6)
    ok, grants, recalls = rooms.ask(8, P6)
    assert ok and grants == [] and recalls == [] and rooms.waiting == 1
    rooms.scattered(slots[0])  # its PieceDone went out
    ok, grants, recalls = rooms.ask(8, P6)  # asked again: not queued twice
    assert ok and recalls == [(P5, 7)] and rooms.counters.recalls == 1 and rooms.waiting == 1
    assert rooms.serve() == ([], [])  # a recall stands once per room until answered
    bad, grants = rooms.take_back(7, P5, slots)
    assert bad == [] and sorted(s for _, r, s in grants if r == 8) == sorted(slots)
    assert all(ep == P6 for ep, _, _ in grants) and rooms.waiting == 0
    assert rooms.counters.returned == 4 and rooms.slots.of_room(7) == [] and rooms.is_staged(7)
    rooms.close(7, ok=True)
    rooms.close(8, ok=True)
    _drained(rooms)


def test_a_decode_frees_a_senders_slots_at_its_success_and_serves_rooms_in_request_order():
    """TP mismatch: room 7 has two senders, two slots each. Sender 5's Success frees its own
    idle slots at once; waiting senders are served in the order the decode asked for their
    rooms, not the order their asks came in (every decode rank then grants alike)."""
    rooms = DecodeRooms(4)
    rooms.open(7, {P5, P9})
    rooms.open(8, {P6})
    rooms.open(10, {P6})
    a, _ = rooms.grant(7, np.arange(4), P5, senders=2)
    b, _ = rooms.grant(7, np.arange(4), P9, senders=2)
    assert len(a) == len(b) == 2 and rooms.slots.free == 0
    rooms.grant(8, np.arange(4), P6)  # requested first ...
    rooms.grant(10, np.arange(4), P6)
    rooms.ask(10, P6)  # ... but its sender asks last
    rooms.ask(8, P6)
    rooms.occupy(7, a[1])  # a piece of sender 5 not scattered yet
    grants = rooms.sender_done(7, P5)
    assert rooms.counters.freed_early == 1 and sorted(rooms.slots.of_room(7)) == sorted([a[1], *b])
    assert grants == [(P6, 8, a[0])]  # room 8 first
    rooms.scattered(a[1])
    assert rooms.sender_done(7, P5) == [(P6, 10, a[1])]
    assert rooms.sender_done(7, ("127.0.0.1", 1)) == []  # not a sender of the room
    assert sorted(rooms.slots.of_room(7)) == sorted(b)
    for room in (7, 8, 10):
        rooms.close(room, ok=True)
    _drained(rooms)


def test_a_waiting_sender_gets_the_idle_slots_of_another_sender_of_its_room():
    rooms = DecodeRooms(4)
    rooms.open(7, {P5, P9})
    rooms.grant(7, np.arange(4), P5)  # sender 5's request took all four slots
    ok, _, recalls = rooms.ask(7, P9)
    assert ok and recalls == [(P5, 7)]  # only the idle holder, not the sender that waits


def test_only_a_prefill_rank_of_a_staged_room_may_ask():
    rooms = DecodeRooms(2)
    rooms.open(7, {P5})
    assert rooms.ask(7, P5)[0] is False  # not staged (no request granted yet)
    rooms.grant(7, np.arange(2), P5)
    assert rooms.ask(7, P6)[0] is False  # not one of its prefill ranks
    assert rooms.ask(99, P5)[0] is False and rooms.waiting == 0


def test_every_terminal_path_drains_the_record():
    """Success, failure (slots quarantined, then free), an abort while waiting for slots,
    and the loss of the prefill rank: each leaves no record, no waiter, no held slot."""
    now = [0.0]
    rooms = DecodeRooms(4, quarantine_s=5.0, clock=lambda: now[0])
    # success
    rooms.open(1, {P5})
    rooms.grant(1, np.arange(2), P5)
    rooms.close(1, ok=True)
    _drained(rooms)
    # failure with a piece in flight: quarantined, then free
    rooms.open(2, {P5})
    slots, _ = rooms.grant(2, np.arange(2), P5)
    rooms.occupy(2, slots[0])
    rooms.close(2, ok=False)
    _drained(rooms)
    assert rooms.slots.free == 0
    now[0] = 5.0
    assert rooms.slots.free == 4
    # aborted while its sender waits for a slot
    rooms.open(3, {P5})
    rooms.open(4, {P6})
    rooms.grant(3, np.arange(8), P5)
    rooms.grant(4, np.arange(8), P6)
    rooms.ask(4, P6)
    assert rooms.waiting == 1
    rooms.close(4, ok=False)
    assert rooms.waiting == 0
    rooms.close(3, ok=True)
    _drained(rooms)
    # prefill rank lost: its rooms are found, failed by the adapter, then cleared by SGLang
    rooms.open(5, {P5})
    rooms.open(6, {P6})
    assert rooms.rooms_served_by(P5) == [5]
    rooms.close(5, ok=False)
    rooms.close(6, ok=True)
    _drained(rooms)
    assert rooms.close(5, ok=True) == []  # a second clear is harmless


def test_a_closed_rooms_slots_go_to_the_oldest_waiting_room():
    rooms = DecodeRooms(4)
    for room, ep in ((1, P5), (2, P6), (3, P9)):
        rooms.open(room, {ep})
        rooms.grant(room, np.arange(8), ep)
    rooms.ask(3, P9)
    rooms.ask(2, P6)
    grants = rooms.close(1, ok=True)
    assert {r for _, r, _ in grants} == {2} and len(grants) == 4


def test_unit_caches_and_pages_die_with_the_room():
    rooms = DecodeRooms(2)
    rooms.open(7, {P5})
    rooms.grant(7, np.array([3, 4]), P5)
    assert (
        rooms.cache_units(7, (0, -1, 1), "units") and rooms.cached_units(7, (0, -1, 1)) == "units"
    )
    problem, pages = rooms.piece_target(7, 0)
    assert problem == "" and list(pages) == [3, 4]
    assert "not granted" in rooms.piece_target(7, 1)[0] or rooms.slots.slots[1].room == 7
    rooms.close(7, ok=True)
    assert rooms.cached_units(7, (0, -1, 1)) is None and not rooms.cache_units(7, (0, -1, 1), "x")
    assert "not granted" in rooms.piece_target(7, 0)[0]


def test_a_room_timeline_orders_its_steps_and_keeps_the_first_piece():
    rooms = DecodeRooms(4)
    rooms.open(7, {P5})
    rooms.start_requests(7, [P5])
    rec = rooms.get(7)
    rooms.mark(7, "first_piece", first=True)
    first = rec.times["first_piece"]
    rooms.mark(7, "first_piece", first=True)  # a later piece does not move it
    rooms.mark(7, "status")
    rooms.mark(7, "applied")
    assert rec.times["first_piece"] == first
    t = rec.timeline(rec.times["applied"] + 0.002)
    assert t["applied_to_clear_ms"] == 2.0
    assert 0 <= t["to_first_piece_ms"] <= t["to_status_ms"] <= t["wall_ms"]
    assert t["status_to_applied_ms"] >= 0
    rooms.mark(99, "status")  # an unknown room: nothing to mark, nothing raised
    rooms.close(7, ok=True)
    _drained(rooms)


def _host_room(rooms: DecodeRooms, room: int, prefills: list[tuple[str, int]]) -> None:
    """A room whose transfer requests went to ``prefills``, into the host pool."""
    rooms.open(room, set(prefills))
    rooms.start_requests(room, prefills)
    rooms.set_host(room)
    for _ in prefills:
        rooms.next_target(room)
    rooms.end_requests(room)


def test_host_pages_are_safe_only_once_every_prefill_rank_acked_the_abort():
    """SGLang holds a failed host room's pages until the receiver says nothing more can
    land (no timeout of its own): each rank the room was sent to must ack, and the drain
    state outlives SGLang's clear(), which it calls before it asks."""
    now = [0.0]
    rooms = DecodeRooms(0, quarantine_s=5.0, clock=lambda: now[0])
    _host_room(rooms, 7, [P5, P6])
    assert rooms.is_host(7) and not rooms.is_host(8)
    assert not rooms.release_safe(7)
    assert rooms.drain_endpoints() == set()  # not aborted: liveness follows its data
    rooms.aborted(7)
    assert rooms.drain_endpoints() == {P5, P6}
    rooms.abort_acked(7, P5)
    assert not rooms.release_safe(7) and rooms.drain_endpoints() == {P6}
    rooms.close(7, ok=False)  # SGLang's failure_exception() clears the receiver first
    assert rooms.sizes()["host_draining"] == 1 and 7 not in rooms
    assert rooms.is_host(7)  # 0.5.21 asks the manager, which must still route it here
    now[0] = 1e6  # no timeout releases them while the rank is alive
    assert not rooms.release_safe(7)
    rooms.abort_acked(7, P6)  # an ACK after the clear still counts
    assert rooms.release_safe(7)
    _drained(rooms)
    assert rooms.release_safe(7)  # a forgotten room stays safe


def test_a_lost_prefill_frees_host_pages_a_quarantine_after_its_loss():
    now = [0.0]
    rooms = DecodeRooms(0, quarantine_s=5.0, clock=lambda: now[0])
    _host_room(rooms, 7, [P5, P6])
    _host_room(rooms, 8, [P5])
    rooms.aborted(7)
    rooms.abort_acked(7, P6)
    now[0] = 10.0
    rooms.peer_lost(P5)
    assert rooms.drain_endpoints() == set()  # nothing left to watch: P5 is gone
    rooms.close(7, ok=False)
    now[0] = 14.9  # a WRITE posted before the loss may still land
    assert not rooms.release_safe(7) and not rooms.release_safe(8)
    now[0] = 15.0
    assert rooms.release_safe(7) and rooms.release_safe(8)
    # a cleared room nobody asks about again is dropped at the next liveness check
    rooms.close(8, ok=False)
    _drained(rooms)


def test_device_rooms_and_successful_host_rooms_leave_no_drain_state():
    rooms = DecodeRooms(0)
    rooms.open(5, {P5})
    rooms.start_requests(5, [P5])
    rooms.next_target(5)
    rooms.aborted(5)
    rooms.close(5, ok=False)  # device pages: SGLang's own ACK count and timeout hold them
    _host_room(rooms, 6, [P5])
    rooms.close(6, ok=True)
    _host_room(rooms, 9, [P9])  # sent, failed and acked before the clear
    rooms.aborted(9)
    rooms.abort_acked(9, P9)
    rooms.close(9, ok=False)
    _drained(rooms)
    # a host room whose requests never went out has nothing to wait for
    rooms.open(4, {P5})
    rooms.set_host(4)
    rooms.aborted(4)
    assert rooms.release_safe(4)
    rooms.close(4, ok=False)
    _drained(rooms)


def test_a_status_after_the_outcome_was_decided_leaves_the_rooms_stamps_alone():
    """Timeline stamps come from the event that decides: "status" from each outcome that
    arrives while the room is open, "applied" as the decided outcome goes to SGLang. A
    prefill's status message that comes after the notes on its WRITEs decided the room
    (a no-op) stamps nothing, so "status" never lands after "applied"."""
    rooms = DecodeRooms()
    rec = rooms.open(7, {P5, P6})
    rooms.start_requests(7, [P5, P6])
    rooms.end_requests(7)
    assert rooms.feed(7, StatusIn(0, True, "", 2), received=10.0) == []  # rank 0 of 2
    assert rec.times["status"] == 10.0 and "applied" not in rec.times
    effects = rooms.feed(7, StatusIn(1, True, "", 2), received=11.0)  # by notes: decides
    assert [type(e).__name__ for e in effects] == ["ApplyStatus"]
    assert rec.times["status"] == 11.0 and rec.times["applied"] > 11.0
    stamped = dict(rec.times)
    assert rooms.feed(7, StatusIn(1, True, "", 2), received=12.0) == []  # its message
    rooms.mark(7, "status", open_only=True)  # a staged room's message, as the listener
    assert rec.times == stamped
