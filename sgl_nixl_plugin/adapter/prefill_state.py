"""Prefill-side records: decode peers, their per-room destinations, chunks and progress."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.agent import Xfer
from sgl_nixl_plugin.engine.engine import PeerLink
from sgl_nixl_plugin.engine.staging import (
    RemoteStaging,
    StagedSend,
)
from sgl_nixl_plugin.wire.messages import (
    PeerRegistration,
)

# KVPoll values (SGLang's enum is an int enum; kept numeric to keep this module SGLang-free)
FAILED, WAITING_FOR_INPUT, SUCCESS = 0, 2, 4


@dataclass(eq=False)  # identity: holds arrays and live state
class DecodePeer:
    """A registered decode rank: its NIXL link and what it told us."""

    agent: str
    link: PeerLink
    reg: PeerRegistration
    endpoint: tuple[str, int]
    last_seen: float = field(default_factory=time.monotonic)
    staging: RemoteStaging | None = None


@dataclass(eq=False)  # identity: holds arrays and live state
class TransferInfo:
    """One decode rank's destination for one room (SGLang's common code reads these fields)."""

    room: int
    agent: str
    endpoint: str
    dst_port: int
    dst_pages: np.ndarray
    aux_index: int
    state: list[np.ndarray]
    required_dst_info_num: int
    is_dummy: bool


@dataclass(eq=False)  # identity: holds arrays and live state
class Chunk:
    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    state: list[Any] | None
    events: tuple[Any, ...] = ()  # CUDA events the source pages wait on


@dataclass(eq=False)  # identity: holds arrays and live state
class RoomProgress:
    xfers: list[Xfer] = field(default_factory=list)
    last_seen: bool = False
    failed: bool = False
    started: float = field(default_factory=time.perf_counter)
    nbytes: int = 0
    descriptors: int = 0
    peers: set[str] = field(default_factory=set)
    jobs: list[StagedJob] = field(default_factory=list)
    path: str = "direct"

    @property
    def busy(self) -> bool:
        return bool(self.xfers) or any(not j.send.finished or j.send.in_flight for j in self.jobs)


@dataclass(eq=False)  # identity: holds arrays and live state
class StagedJob:
    """One chunk's staged transfer to one decode rank, and what the decode must be told."""

    send: StagedSend
    info: TransferInfo
    peer: DecodePeer
    page_start: int
    page_count: int
    src_pages: np.ndarray  # for the direct fallback when no receiver slot comes in time
    dst_pages: np.ndarray
    created: float = field(default_factory=time.monotonic)
    fell_back: bool = False  # sent direct instead (no receiver slot in time)


class SlotCredits(deque):
    """Receiver staging slots this room may write now; ``granted`` (what the decode gave
    this sender, at the request or later by SlotGrant) bounds what credits accept, and
    ``in_use`` the sequence number of each slot's current piece (see ``PieceDone.seq``).

    With a decode that takes slots back (``returnable``), the transfer worker returns them
    all once every piece written there was credited and no chunk uses them (``take_all``),
    and asks again (``asked``) for its next chunk. The control thread adds credits
    (``give_back``, ``grant``), the worker takes them; the lock keeps ``take_all`` whole."""

    def __init__(self, slots: list[int], returnable: bool = False) -> None:
        super().__init__(slots)
        self.granted = set(slots)
        self.in_use: dict[int, int] = {}
        self.returnable = returnable
        self.asked = False  # a SlotAsk is out and not yet answered by a grant
        self._seq = 0
        self._lock = threading.Lock()

    def held(self) -> int:
        """Receiver slots this sender holds now, free or in use."""
        return len(self.granted)

    def issue(self, slot: int) -> int:
        """The sequence number of the piece just told to the decode in ``slot``."""
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
            if seq and self.in_use.get(slot) != seq:
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
