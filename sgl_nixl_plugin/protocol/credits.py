"""The receiver staging slots one sender may write for one room, as the prefill sees them."""

from __future__ import annotations

import threading
from collections import deque


class SlotCredits(deque):
    """Receiver slots this sender may write now (the deque), out of those the decode granted
    it (``granted``), with the sequence number of the piece in each slot in use (``in_use``,
    echoed by ``PieceDone.seq`` so a replayed credit cannot free a slot twice).

    Between chunks the sender returns every slot once each piece written there was credited
    (``take_all``) and asks again (``asked``) for its next chunk. The control thread adds
    credits (``give_back``, ``grant``); the transfer worker takes them."""

    def __init__(self, slots: list[int] | tuple[int, ...] = ()) -> None:
        super().__init__(slots)
        self.granted = set(slots)
        self.in_use: dict[int, int] = {}
        self.asked = False  # a SlotAsk is out and not yet answered by a grant
        self._seq = 0
        self._lock = threading.Lock()

    def held(self) -> int:
        """Receiver slots this sender holds now, free or in use."""
        return len(self.granted)

    def issue(self, slot: int) -> int:
        """The sequence number of the piece just told to the decode in ``slot`` (from 1)."""
        self._seq += 1
        self.in_use[slot] = self._seq
        return self._seq

    def give_back(self, slot: int, seq: int) -> str:
        """Take ``slot`` back from a PieceDone; returns why not ('' when taken)."""
        with self._lock:
            if slot not in self.granted:
                return f"slot {slot} was never granted"
            if slot in self:  # a repeated credit would let two pieces share the slot
                return f"slot {slot} is already free"
            if self.in_use.get(slot) != seq:
                return f"slot {slot}: piece {seq} is not the one in it (replayed?)"
            self.in_use.pop(slot, None)
            self.append(slot)
            return ""

    def grant(self, slot: int) -> str:
        """A SlotGrant: ``slot`` is ours; returns why not ('' when taken)."""
        with self._lock:
            if slot in self.granted:
                return f"slot {slot} was already granted"
            self.granted.add(slot)
            self.append(slot)
            self.asked = False
            return ""

    def take_all(self) -> list[int]:
        """Every granted slot, if all are free (no piece unscattered in any); they are no
        longer ours. Empty when some slot is still in use or none is granted."""
        with self._lock:
            if not self.granted or len(self) != len(self.granted):
                return []
            slots = sorted(self.granted)
            self.clear()
            self.granted.clear()
            self.in_use.clear()
            return slots
