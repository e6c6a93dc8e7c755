"""A decode rank's rooms: one ``DecodeRoom`` record each, and the slot table they share.

The record holds what this side knows about a room from SGLang's receiver ``init`` (the
prefill ranks that serve it) to its ``_clear`` (or, for a failed host room, to the end of
its drain): where its transfer requests go, its destination pages, the staging slots it
holds (in the ``SlotTable``), its place in the grant order, and cached device copies of its
page numbers. It is a room machine (``decode_machine``) fed every event under this table's
lock, which carries out the effects and drops the record on ``Close`` only. Queries about a
room's data and slots see live rooms only (a draining host room answers for its drain).

Slot policy (why no room waits for another forever):

- A room's slots are shared by its senders (``slots_per_sender``); a sender that finds none
  free waits in one queue, served oldest *room* first (the order this rank asked prefills
  for its rooms), which every decode TP rank shares.
- A sender's slots return as soon as it is done with the room (its Success applied),
  between its chunks (``SlotReturn``), or when a waiting sender makes this rank recall the
  idle slots of rooms that hold some without a piece in them (``SlotRecall``).
- A failed room's slots are quarantined, not freed: a late WRITE may still land.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    FreeFlags,
    HostPages,
    NextTarget,
    Opened,
    PeerLost,
    ReleaseSlots,
    RequestsEnd,
    RequestsStart,
    SentTo,
    Tick,
)
from sgl_nixl_plugin.protocol.slot_table import (
    SLOTS_PER_ROOM,
    Endpoint,
    Grant,
    Recall,
    SlotCounters,
    SlotState,
    SlotTable,
    slots_per_sender,
)

__all__ = ["SLOTS_PER_ROOM", "DecodeRoom", "DecodeRooms", "Grant", "Recall", "slots_per_sender"]


@dataclass(eq=False)
class DecodeRoom(DecodeMachine):
    """Everything a room holds; its phase and drain are its ``DecodeMachine``'s."""

    pages: np.ndarray | None = None  # destination pages of a staged room
    senders: int = 1
    order: int = -1  # grant order (staged rooms)
    staged: bool = False  # it held slots: its statuses queue behind its scatters
    recalled: bool = False  # a SlotRecall for it is out and not yet answered
    units: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)  # step -> perf_counter (timeline)
    # its direct senders put a note on each WRITE (``wire.notes``): prefill rank -> [notes
    # seen, how many it owes (0: not told yet)]; ``noting`` until one rank's notes add up
    noting: bool = False
    notes: dict[int, list[int]] = field(default_factory=dict)

    def timeline(self, ended: float) -> dict[str, float]:
        """Milliseconds: request sent to the first staged piece, to the last prefill status,
        that status to SGLang seeing it (behind the scatters), and to the room's clearing."""
        t = self.times

        def ms(a: str, b: str | None) -> float:
            end = ended if b is None else t.get(b, 0.0)
            return round((end - t[a]) * 1e3, 3) if a in t and end else 0.0

        return {
            "to_first_piece_ms": ms("requested", "first_piece"),
            "to_status_ms": ms("requested", "status"),
            "status_to_applied_ms": ms("status", "applied"),
            "applied_to_clear_ms": ms("applied", None),
            "wall_ms": ms("requested", None),
        }

    def stamps(self, ended: float) -> dict[str, float]:
        """When each step happened (``registry.spec.DECODE_STAMPS``: perf_counter seconds,
        one clock for every process of the machine); steps not reached are left out."""
        return {**{f"{k}_at": v for k, v in self.times.items()}, "ended_at": ended}


class DecodeRooms:
    """Every room of one decode rank; thread-safe (one lock for rooms and slots)."""

    def __init__(
        self,
        num_slots: int = 0,
        quarantine_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slots = SlotTable(num_slots, clock)
        self._clock = clock
        self.quarantine_s = quarantine_s
        self.counters = SlotCounters()
        self._rooms: dict[int, DecodeRoom] = {}  # live rooms, and failed host rooms draining
        self._waiting: deque[tuple[int, Endpoint]] = deque()  # senders without a slot
        self._next_order = 0
        self.lock = threading.RLock()
        #: returns a completion-flag word to the decode's board (set once it has one)
        self.free_flag: Callable[[int], None] | None = None

    # -- the machine's events and effects ---------------------------------------------
    def _feed(self, rec: DecodeRoom, event: Event) -> tuple[list[Effect], list[Grant]]:
        """Apply ``event`` to ``rec`` and carry out its effects (lock held): the effects,
        and the grants that released slots give waiting senders."""
        effects = rec.on(event)
        grants: list[Grant] = []
        for effect in effects:
            if isinstance(effect, ReleaseSlots):
                grants += self._release_slots(rec, effect.failed)
            elif isinstance(effect, FreeFlags) and self.free_flag is not None:
                for word in effect.words:  # reused only after every other word
                    self.free_flag(word)
            elif isinstance(effect, Close):
                self._close(rec)
        return effects, grants

    def feed(self, room: int, event: Event, received: float | None = None) -> list[Effect]:
        """Apply ``event`` to ``room`` while SGLang holds its receiver; ``ApplyStatus`` is the
        caller's. An outcome ``received`` then stamps "status" only while the room's is open
        (no-op after notes or a flag), "applied" as it goes to SGLang (before its poll can)."""
        with self.lock:
            if (rec := self._live(room)) is None:
                return []
            if received is not None and rec.outcome is None:
                rec.times["status"] = received
            effects = self._feed(rec, event)[0]
            if any(isinstance(e, ApplyStatus) for e in effects):
                rec.times["applied"] = time.perf_counter()
            return effects

    def _release_slots(self, rec: DecodeRoom, failed: bool) -> list[Grant]:
        room = rec.room
        self.slots.release_room(room, failed=failed, hold_s=self.quarantine_s)
        if any(r == room for r, _ in self._waiting):
            self._waiting = deque(w for w in self._waiting if w[0] != room)
        rec.units = {}  # device copies of its page numbers die with the room
        return self._serve_locked()

    def _close(self, rec: DecodeRoom) -> None:
        """The one way out of the table (the machine's ``Close``); never a newer record."""
        if self._rooms.get(rec.room) is rec:
            del self._rooms[rec.room]

    def _live(self, room: int) -> DecodeRoom | None:
        rec = self._rooms.get(room)
        return rec if rec is not None and rec.phase.live else None

    def add_slots(self, num_slots: int) -> None:
        """The staging buffer was allocated (lazily, after the rooms table was made): its
        slots, all free. Only into a table that has none yet."""
        with self.lock:
            if len(self.slots):
                raise ValueError(f"the slot table already has {len(self.slots)} slots")
            self.slots = SlotTable(num_slots, self._clock)

    # -- lifecycle --------------------------------------------------------------------
    def open(self, room: int, endpoints: set[Endpoint]) -> DecodeRoom:
        """The receiver learnt which prefill ranks serve ``room`` (a repeat replaces them).
        A room id whose previous room's host pages still drain gets that record back, not
        live (``phase.live`` is False): the caller fails the new room."""
        with self.lock:
            rec = self._rooms.get(room)
            if rec is None:
                rec = self._rooms[room] = DecodeRoom(
                    room, set(endpoints), quarantine_s=self.quarantine_s
                )
            else:
                self._feed(rec, Opened(frozenset(endpoints)))
            return rec

    def get(self, room: int) -> DecodeRoom | None:
        """``room``'s record while SGLang holds its receiver."""
        return self._live(room)

    def mark(self, room: int, step: str, first: bool = False, open_only: bool = False) -> None:
        """``step`` of ``room`` happened now (``first``: keep the earliest, else the latest)."""
        rec = self._live(room)
        decided = open_only and rec is not None and rec.outcome is not None
        if rec is not None and not (first and step in rec.times) and not decided:
            rec.times[step] = time.perf_counter()

    def records(self) -> list[DecodeRoom]:
        return [rec for rec in list(self._rooms.values()) if rec.phase.live]

    def __contains__(self, room: int) -> bool:
        return self._live(room) is not None

    def __len__(self) -> int:
        return len(self.records())

    def close(self, room: int, ok: bool) -> list[Grant]:
        """SGLang cleared the room: its slots return (quarantined after a failure), its
        senders stop waiting, and its record leaves (a failed host room's once drained);
        returns the grants this frees for others."""
        with self.lock:
            rec = self._live(room)
            if rec is None:
                return []
            return self._feed(rec, Cleared(ok, self._clock()))[1]

    # -- transfer requests ------------------------------------------------------------
    def start_requests(self, room: int, targets: list[Endpoint]) -> None:
        """SGLang is about to send one request per prefill rank, in this order."""
        with self.lock:
            rec = self._rooms.get(room) or self.open(room, set(targets))
            if rec.phase.live:
                rec.times.setdefault("requested", time.perf_counter())
            self._feed(rec, RequestsStart(tuple(targets)))

    def next_target(self, room: int) -> Endpoint | None:
        """The prefill rank the request being built goes to."""
        with self.lock:
            rec = self._live(room)
            if rec is None:
                return None
            sent = [e for e in self._feed(rec, NextTarget())[0] if isinstance(e, SentTo)]
            return sent[0].endpoint if sent else None

    def end_requests(self, room: int) -> None:
        with self.lock:
            rec = self._live(room)
            if rec is not None:
                self._feed(rec, RequestsEnd())

    def endpoints(self, room: int) -> set[Endpoint]:
        rec = self._live(room)
        return set(rec.endpoints) if rec is not None else set()

    def rooms_served_by(self, endpoint: Endpoint) -> list[int]:
        with self.lock:
            return [rec.room for rec in self.records() if endpoint in rec.endpoints]

    def pending_endpoints(self) -> set[Endpoint]:
        """Prefill ranks that serve a room whose data they still owe (``owes_data``)."""
        out: set[Endpoint] = set()
        with self.lock:
            for rec in self._rooms.values():
                if rec.owes_data():
                    out |= rec.endpoints
        return out

    # -- host-pool destinations ---------------------------------------------------------
    def set_host(self, room: int) -> None:
        """``room``'s pages are in the decode's host pool (set before its requests go out)."""
        with self.lock:
            rec = self._live(room)
            if rec is not None:
                self._feed(rec, HostPages())

    def is_host(self, room: int) -> bool:
        """A host-pool room, also once SGLang cleared it while its drain is due."""
        rec = self._rooms.get(room)
        return rec is not None and rec.host

    def aborted(self, room: int) -> None:
        """An abort of ``room`` went to its prefill ranks (a host room's ACKs are due):
        the room failed, and no prefill status applies any more."""
        with self.lock:
            rec = self._live(room)
            if rec is not None:
                self._feed(rec, Aborted())

    def abort_acked(self, room: int, endpoint: Endpoint) -> None:
        with self.lock:
            rec = self._rooms.get(room)
            if rec is not None:
                self._feed(rec, AbortAcked(endpoint, self._clock()))

    def peer_lost(self, endpoint: Endpoint) -> None:
        """``endpoint`` stopped answering: its host rooms' pages are safe a quarantine on."""
        with self.lock:
            event = PeerLost(endpoint, self._clock())
            for rec in list(self._rooms.values()):
                self._feed(rec, event)

    def release_safe(self, room: int) -> bool:
        """Nothing more can land in ``room``'s host pages: every prefill rank it was sent
        to acked the abort, or was lost at least ``quarantine_s`` ago (a WRITE posted before
        the loss may still be in the network). A room without a record is safe; a cleared
        one leaves its table once it is."""
        with self.lock:
            rec = self._rooms.get(room)
            if rec is None:
                return True
            now = self._clock()
            self._feed(rec, Tick(now))
            return rec.phase.terminal or rec.drained(now)

    def drain_endpoints(self) -> set[Endpoint]:
        """Prefill ranks whose abort ACK an aborted host room still waits for (watched for
        loss, so that a dead one cannot hold the host pages for good). Cleared rooms that
        drained meanwhile leave their table here."""
        with self.lock:
            tick = Tick(self._clock())
            out: set[Endpoint] = set()
            for rec in list(self._rooms.values()):
                if rec.phase is DecodePhase.DRAINING:
                    self._feed(rec, tick)
                out |= rec.acks_due()
            return out

    # -- staging slots ----------------------------------------------------------------
    def grant(
        self,
        room: int,
        pages: np.ndarray,
        sender: Endpoint | None,
        senders: int = 1,
        now: bool = True,
    ) -> tuple[list[int], bool]:
        """Slots for one sender of a staged ``room`` at its transfer request, and whether
        its page numbers are new (to be uploaded now). None while others wait, or not
        ``now`` (the sender does not have our staging area yet): the sender then asks and
        is served in room order; none for a room id whose previous room still drains."""
        with self.lock:
            rec = self._live(room) or self.open(room, {sender} if sender else set())
            if not rec.phase.live:
                return [], False
            fresh = rec.pages is None
            rec.pages = np.array(pages, dtype=np.int64)
            rec.senders = max(1, int(senders))
            rec.staged = True
            if rec.order < 0:
                rec.order, self._next_order = self._next_order, self._next_order + 1
            n = slots_per_sender(rec.senders)
            slots = self.slots.grant(room, sender, n) if now and not self._waiting else []
            return slots, fresh

    def ask(self, room: int, sender: Endpoint) -> tuple[bool, list[Grant], list[Recall]]:
        """``sender`` of ``room`` found no slot: queue it (once). False if it may not ask
        (not a staged room of ours, or not one of its prefill ranks)."""
        with self.lock:
            rec = self._live(room)
            if rec is None or rec.pages is None or sender not in rec.endpoints:
                return False, [], []
            if (room, sender) not in self._waiting:
                self._waiting.append((room, sender))
                self.counters.asks += 1
            return True, self._serve_locked(), self._recall_idle_locked()

    def take_back(
        self, room: int, sender: Endpoint, slots: list[int]
    ) -> tuple[list[int], list[Grant]]:
        """``sender`` returns ``slots`` of ``room`` (SlotReturn): (refused slots, grants)."""
        with self.lock:
            rec = self._live(room)
            if rec is None or sender not in rec.endpoints:
                return sorted(slots) or [-1], []
            bad = self.slots.give_back(room, sender, slots)
            if bad:
                return bad, []
            self.counters.returned += len(slots)
            if not self.slots.of_room(room):
                rec.recalled = False
            return [], self._serve_locked()

    def sender_done(self, room: int, sender: Endpoint) -> list[Grant]:
        """``sender``'s Success for ``room`` was applied behind its scatters: it writes no
        more there, so its idle slots go to waiting rooms now (freeing them only at the
        room's end would let rooms with several senders wait on each other)."""
        with self.lock:
            if room not in self:
                return []
            freed = self.slots.release_sender(room, sender)
            self.counters.freed_early += freed
            if (room, sender) in self._waiting:
                self._waiting = deque(w for w in self._waiting if w != (room, sender))
            return self._serve_locked() if freed else []

    def serve(self) -> tuple[list[Grant], list[Recall]]:
        """Grants for waiting senders (quarantined slots come back by time), and recalls
        of idle slots while senders still wait."""
        with self.lock:
            return self._serve_locked(), self._recall_idle_locked()

    def _serve_locked(self) -> list[Grant]:
        grants: list[Grant] = []
        while self._waiting and self.slots.free:
            i = min(range(len(self._waiting)), key=lambda k: self._order(self._waiting[k][0]))
            room, sender = self._waiting[i]
            del self._waiting[i]
            rec = self._live(room)
            if rec is None:
                continue
            slots = self.slots.grant(room, sender, slots_per_sender(rec.senders))
            grants += [(sender, room, s) for s in slots]
            self.counters.late_grants += len(slots)
        return grants

    def _order(self, room: int) -> int:
        rec = self._live(room)
        return rec.order if rec is not None else -1

    def _recall_idle_locked(self) -> list[Recall]:
        """Senders wait: ask each room that holds slots with no piece in them (granted
        before its prefill was ready, or between chunks) to give them back, once until it
        does or ends. A sender that waits itself has nothing to give."""
        if not self._waiting:
            return []
        waiting = set(self._waiting)
        out: list[Recall] = []
        for rec in self.records():
            room = rec.room
            held = self.slots.of_room(room)
            if not held or rec.recalled or self.slots.busy_in(room):
                continue
            holders = {self.slots.slots[i].sender for i in held}
            holders = rec.endpoints if None in holders else holders & rec.endpoints
            eps = sorted(e for e in holders if e is not None and (room, e) not in waiting)
            if eps:
                rec.recalled = True
                out += [(e, room) for e in eps]
        self.counters.recalls += len(out)
        return out

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def is_staged(self, room: int) -> bool:
        rec = self._live(room)
        return rec is not None and rec.staged

    # -- pieces -----------------------------------------------------------------------
    def piece_target(self, room: int, slot: int) -> tuple[str, np.ndarray | None]:
        """Where a piece announced in ``slot`` goes: (problem or '', destination pages)."""
        with self.lock:
            rec = self._live(room)
            s = self.slots.slots[slot] if 0 <= slot < len(self.slots) else None
            if rec is None or rec.pages is None or s is None or s.room != room:
                return f"slot {slot} was not granted to this room", None
            if s.state is not SlotState.HELD:
                return f"slot {slot} still holds an unscattered piece", None
            return "", rec.pages

    def occupy(self, room: int, slot: int) -> str:
        """A validated piece is being scattered from ``slot`` (HELD -> BUSY)."""
        with self.lock:
            return self.slots.occupy(room, slot)

    def scattered(self, slot: int) -> None:
        with self.lock:
            self.slots.scattered(slot)

    def cached_units(self, room: int, key: tuple[int, int, int]) -> Any:
        rec = self._live(room)
        return rec.units.get(key) if rec is not None else None

    def cache_units(self, room: int, key: tuple[int, int, int], units: Any) -> bool:
        """Keep a device copy of unit numbers, unless the room ended meanwhile."""
        with self.lock:
            rec = self._live(room)
            if rec is None:
                return False
            rec.units[key] = units
            return True

    def pages_of(self, room: int) -> np.ndarray | None:
        rec = self._live(room)
        return rec.pages if rec is not None else None

    # -- drain checks -----------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """What must return to zero once every room ended (bench and tests)."""
        with self.lock:
            held = len(self.slots) - self.slots.count(SlotState.FREE)
            draining = [r for r in self._rooms.values() if r.phase is DecodePhase.DRAINING]
            return {
                "rooms": len(self._rooms) - len(draining),
                "host_draining": len(draining),
                "waiting": len(self._waiting),
                "slots_held": held - self.slots.count(SlotState.QUARANTINED),
                "slots_busy": self.slots.count(SlotState.BUSY),
            }
