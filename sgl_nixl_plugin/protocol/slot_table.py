"""A decode rank's receiver staging slots, each in exactly one state.

FREE -> HELD (granted to one sender of one room) -> BUSY (a piece landed and is not yet
scattered) -> HELD (scattered, credited back) -> FREE (returned, sender done, room done),
or QUARANTINED after a failed room until late WRITEs can no longer land. A slot never
moves from BUSY to FREE directly: its next holder could overwrite a piece mid-scatter.
Not thread-safe: ``DecodeRooms`` holds the lock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

Endpoint = tuple[str, int]


class SlotState(enum.Enum):
    FREE = "free"
    HELD = "held"
    BUSY = "busy"
    QUARANTINED = "quarantined"


@dataclass(slots=True)
class Slot:
    state: SlotState = SlotState.FREE
    room: int | None = None
    sender: Endpoint | None = None
    until: float = 0.0  # QUARANTINED: free again from this time on


class SlotTable:
    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = [Slot() for _ in range(num_slots)]
        self._clock = clock

    def __len__(self) -> int:
        return len(self.slots)

    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.slots if s.state is state)

    @property
    def free(self) -> int:
        self.expire()
        return self.count(SlotState.FREE)

    def of_room(self, room: int, sender: Endpoint | None = None) -> list[int]:
        """Slots ``room`` holds (HELD or BUSY), optionally only those granted to ``sender``."""
        return [
            i
            for i, s in enumerate(self.slots)
            if s.room == room
            and s.state in (SlotState.HELD, SlotState.BUSY)
            and (sender is None or s.sender == sender)
        ]

    def busy_in(self, room: int) -> bool:
        return any(s.room == room and s.state is SlotState.BUSY for s in self.slots)

    def grant(self, room: int, sender: Endpoint | None, n: int) -> list[int]:
        """Up to ``n`` free slots to ``sender`` of ``room``, lowest numbers first."""
        self.expire()
        out: list[int] = []
        for i, s in enumerate(self.slots):
            if len(out) == n:
                break
            if s.state is SlotState.FREE:
                s.state, s.room, s.sender = SlotState.HELD, room, sender
                out.append(i)
        return out

    def occupy(self, room: int, slot: int) -> str:
        """A piece of ``room`` landed in ``slot``: HELD -> BUSY; why not ('' when done)."""
        s = self.slots[slot] if 0 <= slot < len(self.slots) else None
        if s is None or s.room != room or s.state is not SlotState.HELD:
            return f"slot {slot} was not granted to this room"
        s.state = SlotState.BUSY
        return ""

    def scattered(self, slot: int) -> None:
        """The piece in ``slot`` was scattered (its credit goes back): BUSY -> HELD."""
        s = self.slots[slot]
        if s.state is SlotState.BUSY:
            s.state = SlotState.HELD

    def give_back(self, room: int, sender: Endpoint, slots: list[int]) -> list[int]:
        """``sender`` of ``room`` returns ``slots``; the ones refused (all, if any is: not
        the room's, busy, or named twice), else [] and they are FREE."""
        bad = [
            i
            for i in slots
            if not (0 <= i < len(self.slots))
            or self.slots[i].room != room
            or self.slots[i].state is not SlotState.HELD
        ]
        if len(set(slots)) != len(slots):
            bad = bad or sorted(slots)
        if not bad:
            self._free(slots)
        return bad

    def release_sender(self, room: int, sender: Endpoint) -> int:
        """``sender`` writes no more into ``room``: its HELD slots are FREE; how many."""
        mine = [i for i in self.of_room(room, sender) if self.slots[i].state is SlotState.HELD]
        self._free(mine)
        return len(mine)

    def release_room(self, room: int, failed: bool, hold_s: float) -> int:
        """Every slot of ``room`` leaves it; how many. Idle slots are FREE again, unless the
        room failed: then every slot is QUARANTINED for ``hold_s`` (a WRITE still in flight
        could land there). A BUSY slot is always quarantined: its scatter may still be
        reading it, and a new holder's piece would then land in this room's pages."""
        mine = self.of_room(room)
        until = self._clock() + hold_s
        for i in mine:
            s = self.slots[i]
            if failed or s.state is SlotState.BUSY:
                s.state, s.room, s.sender, s.until = SlotState.QUARANTINED, None, None, until
            else:
                s.state, s.room, s.sender = SlotState.FREE, None, None
        return len(mine)

    def expire(self) -> None:
        now = self._clock()
        for s in self.slots:
            if s.state is SlotState.QUARANTINED and s.until <= now:
                s.state, s.until = SlotState.FREE, 0.0

    def _free(self, slots: Iterable[int]) -> None:
        for i in slots:
            s = self.slots[i]
            s.state, s.room, s.sender = SlotState.FREE, None, None


#: Receiver slots one room may hold: pieces land in one while earlier ones are scattered and
#: their credit travels back (two would leave the sender waiting for that round trip).
SLOTS_PER_ROOM = 4


def slots_per_sender(senders: int) -> int:
    """A room's slots split among the prefill ranks that send it (TP mismatch: several);
    each keeps at least one, which still moves its bytes one piece at a time."""
    return max(1, SLOTS_PER_ROOM // max(1, senders))


@dataclass
class SlotCounters:
    """Events, not tables (they need not return to zero): for metrics and tests."""

    asks: int = 0  # senders that found no free slot
    late_grants: int = 0  # slots granted to waiting senders
    returned: int = 0  # slots given back mid-room (SlotReturn)
    recalls: int = 0  # SlotRecalls sent
    freed_early: int = 0  # slots freed at their sender's Success
    prepared: int = 0  # rooms whose page numbers were uploaded before their first piece
    late_uploads: int = 0  # chunks whose unit numbers had to be uploaded at their first piece


Grant = tuple[Endpoint, int, int]  # (sender, room, slot)
Recall = tuple[Endpoint, int]  # (sender, room)
