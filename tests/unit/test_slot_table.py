"""The decode's slot table: every slot in one state, and no path from BUSY to FREE."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_nixl_plugin.protocol.slot_table import SlotState, SlotTable

A, B = ("127.0.0.1", 5), ("127.0.0.1", 6)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_grant_occupy_scatter_and_give_back():
    t = SlotTable(4)
    assert t.grant(7, A, 3) == [0, 1, 2] and t.free == 1
    assert t.occupy(7, 0) == "" and t.busy_in(7)
    assert "not granted" in t.occupy(8, 1)  # another room's slot
    assert "not granted" in t.occupy(7, 0)  # already busy: a second piece would overwrite it
    assert t.give_back(7, A, [0, 1]) == [0]  # busy: refused, nothing freed
    assert t.free == 1
    t.scattered(0)
    assert t.give_back(7, A, [1, 1]) == [1, 1]  # named twice
    assert t.give_back(7, A, [0, 1]) == [] and t.free == 3
    assert t.of_room(7) == [2]


def test_a_sender_done_frees_only_its_idle_slots():
    t = SlotTable(4)
    a, b = t.grant(7, A, 2), t.grant(7, B, 2)
    t.occupy(7, a[1])
    assert t.release_sender(7, A) == 1  # a[1] still holds a piece
    assert sorted(t.of_room(7)) == sorted([a[1], *b])
    t.scattered(a[1])
    assert t.release_sender(7, A) == 1 and sorted(t.of_room(7)) == b


def test_a_room_that_ends_with_a_piece_mid_scatter_quarantines_that_slot_only():
    clock = Clock()
    t = SlotTable(3, clock)
    t.grant(7, A, 3)
    t.occupy(7, 1)
    assert t.release_room(7, failed=False, hold_s=5.0) == 3
    assert [s.state for s in t.slots] == [SlotState.FREE, SlotState.QUARANTINED, SlotState.FREE]
    t.scattered(1)  # the scatter's completion comes later: it must not free the slot early
    assert t.slots[1].state is SlotState.QUARANTINED
    clock.now += 5.0
    assert t.free == 3


def test_a_failed_room_quarantines_its_slots_until_late_writes_cannot_land():
    clock = Clock()
    t = SlotTable(2, clock)
    t.grant(7, A, 2)
    t.occupy(7, 0)
    assert t.release_room(7, failed=True, hold_s=5.0) == 2
    assert t.count(SlotState.QUARANTINED) == 2 and t.free == 0 and t.grant(8, B, 1) == []
    clock.now += 5.0
    assert t.free == 2 and t.grant(8, B, 1) == [0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("gosbrqe"), st.integers(0, 2), st.integers(0, 3)), max_size=60
    )
)
def test_no_operation_sequence_frees_a_busy_slot_or_loses_one(ops):
    clock = Clock()
    t = SlotTable(4, clock)
    senders = (A, B)
    for op, room, slot in ops:
        busy_before = {i for i, s in enumerate(t.slots) if s.state is SlotState.BUSY}
        if op == "g":
            t.grant(room, senders[room % 2], 2)
        elif op == "o":
            t.occupy(room, slot)
        elif op == "s":
            t.scattered(slot)
        elif op == "b":
            t.give_back(room, senders[room % 2], [slot])
        elif op == "r":
            t.release_sender(room, senders[room % 2])
        elif op == "q":
            t.release_room(room, failed=bool(slot % 2), hold_s=1.0)
        else:
            clock.now += 1.0
            t.expire()
        for i in busy_before:
            s = t.slots[i]
            # a busy slot only leaves BUSY by being scattered or quarantined with its room
            assert s.state in (SlotState.BUSY, SlotState.HELD, SlotState.QUARANTINED), (op, i, s)
            if op != "s" and not (op == "q" and s.state is SlotState.QUARANTINED):
                assert s.state is SlotState.BUSY
        assert sum(t.count(state) for state in SlotState) == len(t)
        for s in t.slots:
            assert (s.room is None) == (s.state in (SlotState.FREE, SlotState.QUARANTINED))
