"""A prefill rank's rooms: one ``PrefillRoom`` record each, from the first decode
destination to the end of its last WRITE.

Threads: the control thread opens a record and adds destinations' slot credits; the
transfer worker that owns the room (room id modulo workers) claims it at its first chunk,
is the only one that changes its transfers and feeds its machine (``prefill_machine``)
every event but ``Released``, which the scheduler thread feeds when SGLang clears the
sender. The record leaves the table in ``close`` only, on the machine's ``Close``: by the
worker once nothing is in flight, or at ``release`` when no worker ever claimed it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.prefill_machine import (
    ChunkIn,
    Close,
    Effect,
    Released,
    RoomMachine,
)


@dataclass(eq=False)  # identity: holds arrays and live state
class TransferInfo:
    """One decode rank's destination for one room (SGLang's common code reads these fields
    from its ``transfer_infos`` table: endpoint, dst_port, is_dummy, required_dst_info_num)."""

    room: int
    agent: str
    endpoint: str
    dst_port: int
    dst_pages: np.ndarray
    aux_index: int
    state: list[np.ndarray]
    required_dst_info_num: int
    is_dummy: bool
    host: bool = False  # the pages are in the decode's host pool
    # a one-pass room's completion flag on the decode's board (-1: none): the word and the
    # value to store there once every byte landed
    done_flag: int = -1
    done_value: int = 0
    notes: bool = False  # the decode counts the notes on this room's direct WRITEs

    @property
    def groups(self) -> str:
        """Prefix of the link groups this destination is written into ('' or 'host_')."""
        return "host_" if self.host else ""


@dataclass(eq=False)
class Chunk:
    """What SGLang's ``send()`` hands over: source pages of one chunk of a room."""

    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    state: list[Any] | None
    events: tuple[Any, ...] = ()  # CUDA events the source pages wait on
    tokens: int | None = None  # tokens in ``pages`` (SGLang's num_kv_tokens), if given


@dataclass(eq=False)
class PrefillRoom(RoomMachine):
    """Everything a room holds; its phase and in-flight count are its ``RoomMachine``'s."""

    credits: dict[str, SlotCredits] = field(default_factory=dict)  # decode agent -> slots
    recalls: set[str] = field(default_factory=set)  # decode agents that want slots back
    xfers: list[Any] = field(default_factory=list)  # direct WRITEs in flight
    jobs: list[Any] = field(default_factory=list)  # staged sends of this room's chunks
    started: float = field(default_factory=time.perf_counter)
    nbytes: int = 0
    descriptors: int = 0
    peers: set[str] = field(default_factory=set)
    path: str = "direct"
    # where the room's time went (perf_counter seconds; 0.0: not yet), for its one log line
    ready_at: float = 0.0  # every destination filed: SGLang's sender may send
    claimed_at: float = 0.0  # its first chunk reached the worker
    first_post_at: float = 0.0  # its first WRITE was posted
    last_post_at: float = 0.0  # its latest WRITE (or copy, or flag) was posted
    first_done_at: float = 0.0  # a WRITE, staged piece or copy of it was first seen done
    last_chunk_at: float = 0.0  # its last chunk reached the worker (after the last forward)
    chunks: int = 0  # chunks SGLang's sender handed over
    slot_wait_s: float = 0.0  # staged chunks waiting for the decode's first staging slot
    pieces: int = 0  # staged pieces that landed
    nixl_post_us: int = 0  # NIXL telemetry of its direct WRITEs, when captured
    nixl_xfer_us: int = 0
    # decode agents whose chunks did not all go in one pass: no completion flag for them
    not_one_pass: set[str] = field(default_factory=set)
    # decode agent -> (its one-pass link, flag word, value): stored once nothing but the
    # room's copies is in flight (its aux rows and state landed)
    flags_due: dict[str, tuple[Any, int, int]] = field(default_factory=dict)
    # decode agent -> direct WRITEs of the room posted to it with a note (``wire.notes``)
    notes: dict[str, int] = field(default_factory=dict)
    staged_to: set[str] = field(default_factory=set)  # decode agents sent a staged chunk

    def note_post(self) -> None:
        self.last_post_at = time.perf_counter()
        if not self.first_post_at:
            self.first_post_at = self.last_post_at

    def note_done(self) -> None:
        if not self.first_done_at:
            self.first_done_at = time.perf_counter()

    def stamps(self, ended: float) -> dict[str, float]:
        """When each step happened (``registry.spec.PREFILL_STAMPS``: perf_counter seconds,
        one clock for every process of the machine); steps not reached are left out."""
        at = {
            "started_at": self.started,
            "ready_at": self.ready_at,
            "claimed_at": self.claimed_at,
            "last_chunk_at": self.last_chunk_at,
            "first_post_at": self.first_post_at,
            "last_post_at": self.last_post_at,
            "first_done_at": self.first_done_at,
            "ended_at": ended,
        }
        return {k: v for k, v in at.items() if v}

    def timeline(self, ended: float) -> dict[str, float]:
        """Milliseconds: first destination filed to the last (ready), ready to first chunk,
        first chunk to first WRITE, waiting for staging slots, first WRITE to the end, the
        whole, and the last chunk to the end; and the chunks (``ended``: a perf_counter)."""

        def ms(a: float, b: float) -> float:
            return round((b - a) * 1e3, 3) if a and b else 0.0

        return {
            "to_ready_ms": ms(self.started, self.ready_at),
            "to_chunk_ms": ms(self.ready_at or self.started, self.claimed_at),
            "to_post_ms": ms(self.claimed_at, self.first_post_at),
            "slot_wait_ms": round(self.slot_wait_s * 1e3, 3),
            "writes_ms": ms(self.first_post_at, ended),
            "wall_ms": ms(self.started, ended),
            # what the request waits for after its last forward pass (within writes_ms
            # when the room came in several chunks)
            "after_last_ms": ms(self.last_chunk_at, ended),
            "chunks": self.chunks,
        }


#: Rooms that left the table, remembered (the newest this many) with their last phase, so
#: that an abort for a room that already ended here is told from one that has not come yet.
ENDED_MEMORY = 4096


class PrefillRooms:
    """Every live room of one prefill rank; thread-safe."""

    def __init__(self) -> None:
        self._rooms: dict[int, PrefillRoom] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms

    def get(self, room: int) -> PrefillRoom | None:
        return self._rooms.get(room)

    def ended(self, room: int) -> str | None:
        """The phase ``room`` left the table in, if it did recently (``ENDED_MEMORY``)."""
        with self._lock:
            return self._ended.get(room)

    def open(self, room: int) -> PrefillRoom:
        """The room's record, created at its first destination (or chunk)."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                rec = self._rooms[room] = PrefillRoom(room)
            return rec

    def claim(self, room: int, last: bool) -> tuple[PrefillRoom, list[Effect]]:
        """The owning worker takes the room at its first chunk (``ChunkIn``: the chunk
        counts as in flight); under the table's lock, so a release cannot close it between
        the two."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is None:
                rec = self._rooms[room] = PrefillRoom(room)
            if not rec.claimed_at:
                rec.claimed_at = time.perf_counter()
            return rec, rec.on(ChunkIn(last))

    def release(self, room: int) -> None:
        """SGLang cleared the room's sender: the machine closes it now if no worker holds
        it, else its worker closes it once its WRITEs settled."""
        with self._lock:
            rec = self._rooms.get(room)
            if rec is not None and any(isinstance(e, Close) for e in rec.on(Released())):
                self._drop(rec)

    def close(self, rec: PrefillRoom) -> None:
        """The one way out, on the machine's ``Close``: ``rec`` leaves the table (unless a
        newer record of the same room id replaced it)."""
        if not rec.phase.terminal:
            raise ValueError(f"room {rec.room} is {rec.phase.value}, not closed")
        with self._lock:
            self._drop(rec)

    def _drop(self, rec: PrefillRoom) -> None:
        rec.credits.clear()
        rec.recalls.clear()
        if self._rooms.get(rec.room) is rec:
            del self._rooms[rec.room]
            self._ended[rec.room] = rec.phase.value
            if len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)

    def sizes(self) -> dict[str, int]:
        with self._lock:
            recs = list(self._rooms.values())
        return {
            "rooms": len(recs),
            "rooms_busy": sum(1 for r in recs if r.in_flight),
        }


class EarlyAborts:
    """Rooms a decode gave up before this prefill had a sender for them: remembered for
    ``horizon_s`` (at most ``limit``) so that the sender fails at its creation."""

    def __init__(self, horizon_s: float, limit: int = 100_000) -> None:
        self.horizon_s = horizon_s
        self.limit = limit
        # oldest first: expiry pops from the front, so a note costs O(1) however many wait
        self._reasons: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._reasons)

    def note(self, room: int, reason: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            horizon = now - self.horizon_s
            while self._reasons and next(iter(self._reasons.values()))[1] < horizon:
                self._reasons.popitem(last=False)
            if room in self._reasons:
                self._reasons.move_to_end(room)
            elif len(self._reasons) >= self.limit:
                return
            self._reasons[room] = (reason, now)

    def claim(self, room: int) -> str | None:
        with self._lock:
            hit = self._reasons.pop(room, None)
        return hit[0] if hit else None
