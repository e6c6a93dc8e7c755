"""A prefill rank's room records, slot credits and early aborts, in process."""

from __future__ import annotations

import pytest

from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.prefill_machine import (
    Close,
    Concluded,
    ConcludeSuccess,
    Failure,
    Mirror,
    PrefillPhase,
    Settled,
)
from sgl_nixl_plugin.protocol.prefill_rooms import EarlyAborts, PrefillRooms


def test_success_closes_the_record_once_nothing_is_in_flight():
    rooms = PrefillRooms()
    rec = rooms.open(7)
    rec.credits["d"] = SlotCredits([0, 1])
    claimed, effects = rooms.claim(7, last=True)
    assert claimed is rec and rec.phase is PrefillPhase.LANDING and effects == [Mirror(1)]
    assert rooms.sizes() == {"rooms": 1, "rooms_busy": 1}
    assert rec.on(Settled()) == [Mirror(0), ConcludeSuccess()]
    assert rec.on(Concluded(True)) == [Close(PrefillPhase.SUCCEEDED)]
    rooms.close(rec)
    assert 7 not in rooms and not rec.credits
    assert rooms.sizes() == {"rooms": 0, "rooms_busy": 0}


def test_release_closes_an_unclaimed_room_and_marks_a_claimed_one():
    rooms = PrefillRooms()
    rooms.open(1).credits["d"] = SlotCredits([3])
    rooms.release(1)  # destinations came, no chunk ever: nothing in flight, gone now
    assert 1 not in rooms
    rec, _ = rooms.claim(2, last=False)
    rooms.release(2)  # a worker holds it with its chunk in flight: it closes it when drained
    assert 2 in rooms and rec.phase is PrefillPhase.DRAINING
    assert rec.on(Settled()) == [Mirror(0), Close(PrefillPhase.FAILED)]
    rooms.close(rec)
    assert 2 not in rooms
    rooms.release(99)  # unknown: nothing happens


def test_a_stale_closer_cannot_drop_a_newer_record_of_the_same_room_id():
    rooms = PrefillRooms()
    old, _ = rooms.claim(5, last=False)
    old.on(Failure("decode lost"))
    old.on(Settled())
    rooms.close(old)
    newer = rooms.open(5)  # the room id comes back with a new request
    rooms.close(old)
    assert rooms.get(5) is newer and newer.phase is PrefillPhase.AWAITING


def test_close_refuses_a_room_that_is_not_closed():
    rooms = PrefillRooms()
    with pytest.raises(ValueError):
        rooms.close(rooms.open(1))


def test_slot_credits_give_everything_back_only_when_every_slot_is_free():
    credits = SlotCredits([3, 4])
    slot = credits.popleft()  # a piece goes into slot 3
    seq = credits.issue(slot)
    assert seq == 1 and credits.take_all() == []  # slot 3 still holds an unscattered piece
    assert "not the one" in credits.give_back(3, seq + 1)  # a replayed credit of another use
    assert credits.give_back(3, seq) == ""
    assert "already free" in credits.give_back(3, seq)
    assert credits.grant(5) == "" and credits.grant(5) == "slot 5 was already granted"
    assert credits.take_all() == [3, 4, 5]
    assert not credits and not credits.granted and credits.take_all() == []
    assert "never granted" in credits.give_back(3, seq)  # a late credit


def test_early_aborts_are_claimed_once_and_forgotten_after_the_horizon():
    early = EarlyAborts(horizon_s=10.0, limit=2)
    early.note(1, "refused", now=0.0)
    early.note(2, "gone", now=1.0)
    early.note(3, "over the limit", now=2.0)
    assert len(early) == 2 and early.claim(3) is None
    assert early.claim(1) == "refused" and early.claim(1) is None
    early.note(4, "late", now=20.0)  # 2 is past the horizon now
    assert early.claim(2) is None and early.claim(4) == "late"


def test_a_room_that_left_the_table_is_remembered_with_its_phase(monkeypatch):
    import sgl_nixl_plugin.protocol.prefill_rooms as pr

    monkeypatch.setattr(pr, "ENDED_MEMORY", 2)
    rooms = pr.PrefillRooms()
    assert rooms.ended(1) is None
    for room in (1, 2, 3):
        rooms.open(room)
        rooms.release(room)  # SGLang cleared it before any chunk: it leaves the table
    assert 3 not in rooms and rooms.ended(3) == rooms.ended(2) is not None
    assert rooms.ended(1) is None  # the oldest, past the memory's bound


def test_early_aborts_expire_oldest_first_and_a_second_note_refreshes_a_room():
    early = EarlyAborts(horizon_s=10.0, limit=3)
    early.note(1, "first", now=0.0)
    early.note(2, "second", now=5.0)
    early.note(1, "again", now=8.0)  # refreshed: no longer the oldest
    early.note(3, "third", now=12.0)  # 2 is within the horizon; nothing expires yet
    assert len(early) == 3
    early.note(4, "fourth", now=16.0)  # 2 (t=5) expired; the limit then leaves room for 4
    assert early.claim(2) is None
    assert [early.claim(r) for r in (1, 3, 4)] == ["again", "third", "fourth"]
