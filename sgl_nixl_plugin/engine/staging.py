"""Staged transfers for scattered pages: gather -> few large WRITEs -> scatter, pipelined.

When a request's pages are scattered, every page of every layer is its own NIXL
descriptor, and on cuda_ipc each costs ~13 µs whatever its size. The staged path copies
the request's units into a registered staging slot on the sender (one kernel per piece),
moves each slot with ONE descriptor, and the receiver copies the slot into its pages.
Pieces (groups of layers, or parts of one layer) flow through a few slots, so piece i+1
is gathered while piece i is on the wire and the receiver scatters piece i-1.

This module is SGLang-free: the adapter carries ``PieceReady``/``PieceDone`` between the
two sides, and the GPU benchmark drives the same classes with its own channel.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.agent import Agent, TransferError, Xfer
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet

logger = logging.getLogger(__name__)

# Cost model behind the automatic path choice (see ``choose_path``), per memory kind, from
# our measurements (docs/benchmarks.md): seconds per posted descriptor (cuda_ipc ~13 µs; UCX
# on host memory ~2.5 µs), bytes/s of one gather or scatter pass (Triton ~2 TB/s on an H200;
# numpy ~4 GB/s on a small host), the fixed host cost of one staged piece, and what a staged
# request costs beyond a direct one whatever its size: on host memory its slot grant, piece
# notices and the decode's scatter thread add ~1.4 ms of Python and wake-ups (page 1 on the
# 2-core CPU host: staged 2.6 ms against direct 1.4 ms at 16 tokens, 7.2 against 9.4 at 256).
DESCRIPTOR_COST_S = {"VRAM": 13e-6, "DRAM": 2.5e-6}
COPY_BYTES_PER_S = {"VRAM": 2.0e12, "DRAM": 4.0e9}
PIECE_OVERHEAD_S = {"VRAM": 100e-6, "DRAM": 100e-6}
STAGED_REQUEST_S = {"VRAM": 0.0, "DRAM": 1.4e-3}
# What a staged chunk waits for slots while the decode still allocates its staging area
# (asked at the pair's first chunk the rule would stage): 132 MiB of host memory took 0.3-0.5
# s on the 2-core CPU host with eight rooms in flight, and the rooms staged meanwhile waited
# that long. Not measured on GPUs: none charged there (unchanged).
AREA_WAIT_S = {"VRAM": 0.0, "DRAM": 0.3}
# Pipelining: a request is cut into about PIPELINE_PIECES pieces (so the WRITE of one overlaps
# the gather of the next and the scatter of the one before), but never below MIN_PIECE_BYTES,
# where the host's fixed cost per piece (~0.1 ms: launch, post, notice, tell) would dominate.
PIPELINE_PIECES = 6
MIN_PIECE_BYTES = {"VRAM": 48 << 20, "DRAM": 4 << 20}
# When both sides are the same GPU (two processes sharing it), their kernels and copies take
# turns unless both run under one MPS server, and every turn costs a switch between the
# processes: fewer, larger pieces are faster there (H200, side by side in one run: without
# MPS 2 pieces take 0.8x the time of 4, and 4 took 0.75x the time of 7; under MPS 2 and 4 tie).
# Slots bound a piece: with the default 256 MiB slots a 1 GiB request still goes in 4.
PIPELINE_PIECES_SAME_DEVICE = 2


@dataclass(frozen=True)
class Piece:
    """Regions ``[r0, r1)`` x request units ``[j0, j1)``, laid out region-major in a slot."""

    index: int
    r0: int
    r1: int
    j0: int
    j1: int
    unit_len: int

    @property
    def nbytes(self) -> int:
        return (self.r1 - self.r0) * (self.j1 - self.j0) * self.unit_len


def piece_bytes(nbytes: int, slot_bytes: int, mem_kind: str, same_device: bool = False) -> int:
    """How large the pieces of an ``nbytes`` transfer should be (see PIPELINE_PIECES)."""
    pieces = PIPELINE_PIECES_SAME_DEVICE if same_device else PIPELINE_PIECES
    target = max(MIN_PIECE_BYTES.get(mem_kind, 0), -(-nbytes // pieces))
    return max(1, min(slot_bytes, target))


def plan_request(
    num_regions: int,
    num_units: int,
    unit_len: int,
    slot_bytes: int,
    mem_kind: str,
    same_device: bool = False,
) -> list[Piece]:
    """The pieces of one staged transfer, sized for pipelining (``piece_bytes``)."""
    nbytes = num_regions * num_units * unit_len
    size = piece_bytes(nbytes, slot_bytes, mem_kind, same_device)
    return plan_pieces(num_regions, num_units, unit_len, size)


def plan_pieces(num_regions: int, num_units: int, unit_len: int, slot_bytes: int) -> list[Piece]:
    """Cut (regions x units) into pieces of at most ``slot_bytes``, region-major.

    (Smaller first and last pieces, to shorten the pipeline's fill and drain, were measured
    and rejected: on one H200 the extra pieces cost more than the shorter ends saved.)
    """
    if num_units == 0 or num_regions == 0:
        return []
    if unit_len > slot_bytes:
        raise ValueError(f"a {unit_len}-byte unit does not fit a {slot_bytes}-byte staging slot")
    region_bytes = num_units * unit_len
    pieces: list[Piece] = []
    if region_bytes <= slot_bytes:
        per = max(1, slot_bytes // region_bytes)
        for r0 in range(0, num_regions, per):
            pieces.append(
                Piece(len(pieces), r0, min(num_regions, r0 + per), 0, num_units, unit_len)
            )
        return pieces
    units_per_piece = max(1, slot_bytes // unit_len)
    for r in range(num_regions):
        for j0 in range(0, num_units, units_per_piece):
            pieces.append(
                Piece(len(pieces), r, r + 1, j0, min(num_units, j0 + units_per_piece), unit_len)
            )
    return pieces


def choose_path(
    *,
    mode: str,
    descriptors: int,
    nbytes: int,
    mem_kind: str,
    slot_bytes: int,
    staging_possible: bool,
    area_pending: bool = False,
) -> str:
    """``direct`` or ``staging`` for one transfer.

    Rule: estimate both and take the cheaper. The wire time is the same either way, so
    direct costs one charge per posted descriptor, and staging costs its two extra copy
    passes over the bytes plus a fixed charge per piece and one per request, and the wait
    for the receiver's staging area while it is allocated (``area_pending``). ``mode``
    ("direct"/"staging") overrides, when staging is possible at all.
    """
    if not staging_possible or mode == "direct":
        return "direct"
    if mode == "staging":
        return "staging"
    pieces = max(1, -(-nbytes // max(1, slot_bytes)))
    direct_s = descriptors * DESCRIPTOR_COST_S[mem_kind]
    staging_s = (
        2 * nbytes / COPY_BYTES_PER_S[mem_kind]
        + pieces * PIECE_OVERHEAD_S[mem_kind]
        + STAGED_REQUEST_S[mem_kind]
        + (AREA_WAIT_S[mem_kind] if area_pending else 0.0)
    )
    return "staging" if staging_s < direct_s else "direct"


#: Bytes after the last slot of a staging buffer (of slots larger than that), never handed
#: out: the warm-up WRITE between two peers' staging buffers (``spare_of``) goes from one's
#: spare into the other's.
SPARE_BYTES = 4 << 20  # large enough for the transport's large-message protocol


def spare_of(ptr: int, nbytes: int, slot_bytes: int) -> tuple[int, int]:
    """(address, length) of the spare tail of a staging area of ``nbytes`` cut into
    ``slot_bytes`` slots; length 0 when it has none."""
    tail = nbytes - (nbytes // slot_bytes) * slot_bytes if slot_bytes > 0 else 0
    return (ptr + nbytes - tail, tail) if tail > 0 else (0, 0)


def gpu_uuid(device: int) -> str:
    """The GPU's UUID (bounded as the wire field is), so that a peer can tell it shares it."""
    import torch

    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))[:64]


class StagingBuffer:
    """A registered buffer cut into equal slots, with a thread-safe free list, and a spare
    tail (:data:`SPARE_BYTES`) that no slot covers."""

    def __init__(
        self, agent: Agent, nbytes: int, slot_bytes: int, mem_kind: str, device: int = 0
    ) -> None:
        if slot_bytes <= 0 or nbytes < slot_bytes:
            raise ValueError(f"staging of {nbytes} bytes cannot hold a {slot_bytes}-byte slot")
        self.slot_bytes = slot_bytes
        self.num_slots = nbytes // slot_bytes
        self.mem_kind = mem_kind
        self.device = device
        self.device_uuid = ""  # the GPU's, so that a peer can tell it shares that GPU
        size = self.num_slots * slot_bytes + (SPARE_BYTES if slot_bytes > SPARE_BYTES else 0)
        if mem_kind == "VRAM":
            import torch

            self._mem: Any = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
            self.ptr = int(self._mem.data_ptr())
            self.device_uuid = gpu_uuid(device)
        else:
            self._mem = np.full(size, 0, dtype=np.uint8)  # touched now: no faults mid-transfer
            self.ptr = int(self._mem.ctypes.data)
        self.nbytes = size
        self.spare = spare_of(self.ptr, size, slot_bytes)
        self.regions = RegionSet((self.ptr,), (size,), (slot_bytes,), (device,), mem_kind)
        agent.register(self.regions)
        self._free = deque(range(self.num_slots))
        self._lock = threading.Lock()

    def acquire(self, n: int = 1) -> list[int]:
        """Up to ``n`` free slots (possibly none): callers wait and retry, never allocate more."""
        with self._lock:
            k = min(n, len(self._free))
            return [self._free.popleft() for _ in range(k)]

    def release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

    def addr(self, slot: int) -> int:
        return self.ptr + slot * self.slot_bytes


@dataclass
class RemoteStaging:
    """The receiver's staging area as the sender sees it."""

    ptr: int
    slot_bytes: int
    device: int
    mem_kind: str
    device_uuid: str = ""  # of its GPU ("" unknown): same as ours -> one GPU for both sides
    spare: tuple[int, int] = (0, 0)  # its spare tail (address, length): for the warm-up

    def addr(self, slot: int) -> int:
        return self.ptr + slot * self.slot_bytes


@dataclass(eq=False)
class _InFlight:
    piece: Piece
    local_slot: int
    remote_slot: int
    xfer: Xfer | None = None
    event: Any = None  # CUDA event recorded after the gather


@dataclass(eq=False)  # identity: holds arrays and live transfers
class StagedSend:
    """Sender-side state machine of one request through the staging path.

    ``step`` never blocks: it gathers pieces into free local slots, posts the WRITE of a
    gathered piece once a receiver slot is free, and reports finished pieces; the caller
    tells the receiver (``ready``) and hands back receiver slots the receiver freed
    (``credit``).
    """

    agent: Agent
    copier: Any
    local: StagingBuffer
    remote: RemoteStaging | None  # None: the receiver's area is on its way (``remote_of``)
    peer: str
    src_bases: np.ndarray
    units: np.ndarray
    geometry: Geometry
    pieces: list[Piece]
    remote_free: deque[int]  # receiver slots this room may write; shared by its chunks
    stream: Any = None
    #: The receiver's area once it is known, where ``remote`` was None: it comes before the
    #: first receiver slot (the receiver sends it first), so a WRITE is never without it.
    remote_of: Callable[[], RemoteStaging | None] | None = None
    #: How many receiver slots the room holds now (free or in use); None: a fixed pool.
    #: Gathered pieces that wait for a WRITE never outnumber them, and a room that holds
    #: none gathers nothing: local slots are shared by every room, and a room waiting for
    #: a grant must not fill them while the room that holds the receiver slots can't gather.
    receiver_slots: Callable[[], int] | None = None
    drain_timeout_s: float = 5.0  # after an error, how long in-flight WRITEs may take to settle
    ahead: int = 3  # pieces gathered but not yet posted, at most (bounded by free local slots)
    trace: list[tuple[int, str, float]] | None = None  # (piece, step, perf_counter) if kept
    _units_dev: Any = None  # ``units`` as the copier reads them (uploaded at the first gather)
    _bases_dev: Any = None  # ``src_bases`` likewise
    _next: int = 0
    _gathered: deque[_InFlight] = field(default_factory=deque)
    _writing: list[_InFlight] = field(default_factory=list)
    done_pieces: int = 0
    nbytes: int = 0
    error: str = ""
    _error_at: float = 0.0
    posted: int = 0  # WRITEs posted so far
    settled: int = 0  # WRITEs that ended (DONE or ERR) so far

    @property
    def finished(self) -> bool:
        return self.done_pieces == len(self.pieces) or bool(self.error)

    @property
    def in_flight(self) -> bool:
        return bool(self._writing or self._gathered)

    @property
    def needs_polling(self) -> bool:
        """Whether only polling moves it on (a WRITE or gather to finish, a piece it can
        gather or post now); False while it waits for a receiver credit, which the
        caller learns about by message."""
        return (
            bool(self._writing)
            or (bool(self._gathered) and bool(self.remote_free))
            or (not self.error and self._may_gather() and self.local.free > 0)
        )

    def _may_gather(self) -> bool:
        """Another piece may be gathered now (see ``receiver_slots``)."""
        ahead = (
            self.ahead if self.receiver_slots is None else min(self.ahead, self.receiver_slots())
        )
        return self._next < len(self.pieces) and len(self._gathered) < ahead

    def step(self) -> list[tuple[Piece, int]]:
        """Advance; returns ``(piece, remote_slot)`` for every piece that has landed."""
        # 1. completions (also after an error, so in-flight WRITEs drain and free slots)
        landed = self._settle_writes()
        if self.error:
            self.abandon()  # nothing more is posted: give back gathered pieces' slots
            return landed
        if self.done_pieces == len(self.pieces):
            self._release_units()
        # 2. post WRITEs for gathered pieces that have a receiver slot
        self._post_writes()
        if self.error:  # a WRITE could not be posted: everything was abandoned
            return landed
        # 3. gather the next piece into a free local slot (bounded by the buffer:
        # backpressure). One per call, after posting: a launch costs ~0.1 ms of host time,
        # which must not delay the WRITE of a piece that is ready
        self._gather_next()
        return landed

    def _settle_writes(self) -> list[tuple[Piece, int]]:
        """Poll the WRITEs in flight, releasing the settled ones' slots; the pieces that
        landed (none once an error is set)."""
        if self.error and self._writing:
            self._give_up_after_drain_timeout()
        landed: list[tuple[Piece, int]] = []
        still = []
        for f in self._writing:
            state = self.agent.poll(f.xfer)
            if state == "PROC":
                still.append(f)
                continue
            self.agent.release(f.xfer)
            self.local.release([f.local_slot])
            self.settled += 1
            if state == "ERR":
                self.error = self.error or f.xfer.error or "staging WRITE failed"
                continue
            if self.error:
                continue
            self.done_pieces += 1
            self.nbytes += f.piece.nbytes
            landed.append((f.piece, f.remote_slot))
            self._note(f.piece, "write done")
        self._writing = still
        return landed

    def _give_up_after_drain_timeout(self) -> None:
        """After an error, WRITEs still in flight past ``drain_timeout_s`` are abandoned:
        their peer is gone and they will never settle."""
        self._error_at = self._error_at or time.monotonic()
        if time.monotonic() - self._error_at <= self.drain_timeout_s:
            return
        for f in self._writing:
            self.agent.abandon(f.xfer)
            self.local.release([f.local_slot])
        # given up counts as ended: the caller's in-flight count must come back
        self.settled += len(self._writing)
        self._writing = []

    def _post_writes(self) -> None:
        """Post a WRITE for each gathered piece whose gather has run, while the receiver
        has slots; a WRITE that cannot be posted sets ``error`` and abandons the rest."""
        while self._gathered and self.remote_free:
            f = self._gathered[0]
            if f.event is not None and not f.event.query():
                break
            remote = self.remote or (self.remote_of() if self.remote_of is not None else None)
            if remote is None:
                self.error = "a receiver slot came before the receiver's staging area"
                self.abandon()
                return
            self.remote = remote
            self._note(f.piece, "gather done")
            self._gathered.popleft()
            f.remote_slot = self.remote_free.popleft()
            try:
                f.xfer = self.agent.write_contiguous(
                    self.local.addr(f.local_slot),
                    remote.addr(f.remote_slot),
                    f.piece.nbytes,
                    peer=self.peer,
                    mem_kind=self.local.mem_kind,
                    remote_mem_kind=remote.mem_kind,
                    local_device=self.local.device,
                    remote_device=remote.device,
                )
            except TransferError as exc:
                self.local.release([f.local_slot])
                self.remote_free.appendleft(f.remote_slot)
                self.error = str(exc)
                self.abandon()
                return
            self._writing.append(f)
            self.posted += 1
            self._note(f.piece, "write posted")

    def _gather_next(self) -> None:
        """Launch the gather of the next piece if the sender may run ahead and a local
        slot is free (the buffer bounds it: backpressure)."""
        slots = self.local.acquire(1) if self._may_gather() else []
        if not slots:
            return
        piece = self.pieces[self._next]
        self._next += 1
        g = self.geometry
        if self._units_dev is None:
            self._note(piece, "first gather")
            self._units_dev = self.copier.prepare_units(self.units, self.stream)
            self._note(piece, "units ready")
            self._bases_dev = self.copier.prepare_bases(self.src_bases, self.stream)
            self._note(piece, "indices ready")
        self.copier.gather(
            self._bases_dev[piece.r0 : piece.r1],
            self._units_dev[piece.j0 : piece.j1],
            piece.unit_len,
            g.src_stride or piece.unit_len,
            g.src_offset,
            self.local.addr(slots[0]),
            self.stream,
        )
        f = _InFlight(piece, slots[0], -1)
        if self.stream is not None:
            import torch

            f.event = torch.cuda.Event()
            f.event.record(self.stream)
        self._gathered.append(f)
        self._note(piece, "gather launched")

    def _note(self, piece: Piece, step: str) -> None:
        if self.trace is not None:
            self.trace.append((piece.index, step, time.perf_counter()))

    def abandon(self, reason: str = "abandoned") -> None:
        """Stop: give back local slots of pieces never posted; in-flight WRITEs still drain."""
        self.error = self.error or reason
        for f in self._gathered:
            self.local.release([f.local_slot])
        self._gathered.clear()
        self._release_units()

    def _release_units(self) -> None:
        """Hand the request's indices back to the copier (a kept host buffer is reused
        once the gathers queued on our stream have read it)."""
        units, self._units_dev = self._units_dev, None
        release = getattr(self.copier, "release_units", None)
        if units is not None and release is not None:
            release(units, self.stream)


def unit_indices_of(pages: np.ndarray, geometry: Geometry) -> np.ndarray:
    """Unit numbers of ``pages`` within each region (int64), in request order."""
    pages = np.asarray(pages, dtype=np.int64)
    upp = geometry.units_per_item
    if upp == 1:
        return pages
    return (pages[:, None] * upp + np.arange(upp)).ravel()


def staging_unit_len(regions: RegionSet, geometry: Geometry) -> int | None:
    """The unit length staging would use, or None when regions differ in item size."""
    if geometry.is_whole_items:
        sizes = set(regions.item_lens)
        return sizes.pop() if len(sizes) == 1 else None
    return geometry.unit_len
