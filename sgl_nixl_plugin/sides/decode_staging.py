"""Decode side of the staging path: the two threads that scatter landed pieces.

The launcher thread starts each landed piece's scatter at once (``ScatterQueue``); the
completer thread waits for them in order and frees each slot (``PieceDone``) as soon as its
scatter has finished on the copy stream. Statuses of a staged room pass through the same
queue as its pieces, so Success is only applied after every piece that arrived before it has
been scattered. Which slot belongs to whom is the ``DecodeRooms`` table's business; this
module moves bytes and messages.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.layout import Geometry
from sgl_nixl_plugin.engine.scatter_queue import ScatterQueue
from sgl_nixl_plugin.engine.staging import StagingBuffer, unit_indices_of
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms, Grant, Recall
from sgl_nixl_plugin.protocol.slot_table import Endpoint
from sgl_nixl_plugin.sides.staging_offers import StagingOffers
from sgl_nixl_plugin.wire.messages import (
    AbortAck,
    PieceDone,
    PieceReady,
    SlotGrant,
    SlotRecall,
    TransferStatus,
)

logger = logging.getLogger(__name__)

SUCCESS = 4  # KVPoll.Success


#: Copiers whose scatter writes any address the process can (the numpy one on host memory;
#: Triton through unified addressing: SGLang pins its host pool with cudaHostRegister, which
#: maps it for the GPU at the same address). The torch copier wraps device memory only.
HOST_SCATTER_COPIERS = ("NumpyCopier", "TritonCopier")


def _expand(pages: Any, upp: int) -> Any:
    """Unit numbers of ``pages`` with ``upp`` units a page (``unit_indices_of``), computed
    where ``pages`` lives: numpy, or torch on the calling thread's (bound) stream."""
    if upp == 1:
        return pages
    if isinstance(pages, np.ndarray):
        return (pages[:, None] * upp + np.arange(upp)).ravel()
    import torch

    step = torch.arange(upp, dtype=pages.dtype, device=pages.device)
    return (pages[:, None] * upp + step).reshape(-1)


class _Prepare:
    """Launcher task: upload a newly granted room's page indices."""

    __slots__ = ("room",)

    def __init__(self, room: int) -> None:
        self.room = room


class SlotMessenger:
    """Turns the table's grants and recalls into messages (the adapter's ``send``)."""

    def __init__(self, agent_name: str, send: Callable[[Endpoint, Any], object]) -> None:
        self.agent_name = agent_name
        self.send = send

    def __call__(self, grants: Sequence[Grant], recalls: Sequence[Recall] = ()) -> None:
        for ep, room, slot in grants:
            self.send(ep, SlotGrant(room, self.agent_name, slot))
        for ep, room in recalls:
            self.send(ep, SlotRecall(room, self.agent_name))


class DecodeStaging:
    """The decode's staging buffer (allocated when a prefill first asks: ``offers``), its
    copier and its scatter threads.

    ``apply_status`` and ``note_abort_ack`` are called on the completer thread once the
    pieces queued before the status have been scattered; ``reject(reason, detail, peer)``
    counts a bad piece; ``fail_room(room, reason)`` fails a room whose piece was refused.
    """

    def __init__(
        self,
        *,
        agent: Any,
        kv: Any,
        rooms: DecodeRooms,
        host_kv: Any = None,
        offers: StagingOffers,
        device: int,
        messenger: SlotMessenger,
        apply_status: Callable[[TransferStatus], None],
        note_abort_ack: Callable[[int, int, int | None], None],
        reject: Callable[..., None],
        fail_room: Callable[[int, str], None],
        page_size: int = 1,
    ) -> None:
        self.offers = offers
        self.memory = offers.memory
        self.page_size = page_size  # tokens a page: numbers token rows for by-token pieces
        self.rooms = rooms
        self.device = device
        self.agent_name = messenger.agent_name
        self.messenger = messenger
        self._apply_status = apply_status
        self._note_abort_ack = note_abort_ack
        self._reject = reject
        self._fail_room = fail_room
        self.bases = np.asarray(kv.ptrs, dtype=np.uint64)
        self.region_len = min(kv.lens) if len(self.bases) else 0
        self.item_len = int(kv.item_lens[0]) if len(self.bases) else 0
        # the host pool (SGLang's host receive): its rooms' pieces scatter there, where the
        # copier can write host memory (numpy; Triton through the pool's mapped pinning)
        self.host_bases = np.asarray(host_kv.ptrs, dtype=np.uint64) if host_kv is not None else None
        self.host_region_len = min(host_kv.lens) if host_kv is not None else 0
        self._host_bases_dev: Any = None
        self.copier: Any = None
        self.stream: Any = None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.scatters: ScatterQueue | None = None
        self._bases_dev: Any = None
        # per prefill rank that writes a window of our regions (a PP stage): the window, and
        # its base addresses where the copier reads them (made on the launcher thread)
        self._windows: dict[Endpoint, tuple[int, ...]] = {}
        self._window_bases: dict[tuple[Endpoint, bool], Any] = {}
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-scatter", daemon=True)
        self.completer = threading.Thread(
            target=self._complete, name="sgl-nixl-scatter-done", daemon=True
        )

    @property
    def buffer(self) -> StagingBuffer:
        """The allocated buffer: only pieces into granted slots use it, and slots are
        granted once it is there."""
        buffer = self.memory.buffer
        assert buffer is not None, "staging slot used before the buffer was allocated"
        return buffer

    @property
    def host_capable(self) -> bool:
        """Pieces of host rooms can be scattered into the host pool (after ``start``)."""
        return self._host_bases_dev is not None

    def start(self) -> None:
        from sgl_nixl_plugin.engine.copy_kernels import make_copier

        self.copier = make_copier(self.memory.mem_kind, self.device)
        if self.memory.mem_kind == "VRAM":
            import torch

            self.stream = torch.cuda.Stream(device=self.device)
        self.scatters = ScatterQueue(self.copier, self.stream)
        self._bases_dev = self.copier.prepare_bases(self.bases, self.stream)
        if self.host_bases is not None and type(self.copier).__name__ in HOST_SCATTER_COPIERS:
            self._host_bases_dev = self.copier.prepare_bases(self.host_bases, self.stream)
        warm = getattr(self.copier, "warmup", None)
        if warm is not None and self.item_len > 0:
            try:  # the equal-TP scatter shape, compiled now rather than in the first request
                warm(self.item_len)
            except Exception as exc:
                logger.warning("sgl-nixl: staging copier warm-up failed: %s", exc)
        self.thread.start()
        self.completer.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        if self.scatters is not None:
            self.scatters.wake()

    def grant(
        self, room: int, pages: np.ndarray, sender: Endpoint | None, senders: int
    ) -> list[int]:
        """Slots for one sender's transfer request (none to a rank our staging area has
        not gone to yet: a grant must not overtake it); the room's page numbers are
        uploaded while the prefill still computes."""
        now = sender is not None and sender in self.offers.offered
        slots, fresh = self.rooms.grant(room, pages, sender, senders, now)
        if fresh:
            self._queue.put(_Prepare(room))
        return slots

    def set_window(self, sender: Endpoint, window: tuple[int, ...]) -> None:
        """The regions prefill rank ``sender`` writes, numbered as its pieces number them
        (empty: all of ours, one to one)."""
        self._window_bases = {k: v for k, v in self._window_bases.items() if k[0] != sender}
        if window:
            self._windows[sender] = window
        else:
            self._windows.pop(sender, None)

    def _bases_of(self, sender: Endpoint, host: bool) -> Any:
        window = self._windows.get(sender)
        if window is None:
            return self._host_bases_dev if host else self._bases_dev
        bases = self._window_bases.get((sender, host))
        if bases is None:
            every = self.host_bases if host else self.bases
            assert every is not None
            bases = self.copier.prepare_bases(every[list(window)], self.stream)
            self._window_bases[(sender, host)] = bases
        return bases

    # -- the scatter threads ----------------------------------------------------------
    def submit(self, msg: PieceReady | TransferStatus | AbortAck) -> None:
        self._queue.put(msg)

    def _run(self) -> None:
        """Launcher: start each piece's scatter; queue statuses behind earlier pieces."""
        assert self.scatters is not None
        self.copier.bind(self.stream)  # this thread only launches scatters on that stream
        while not self._stop.is_set():
            msg = self._queue.get()
            if msg is None:
                continue
            try:
                if isinstance(msg, PieceReady):
                    self.rooms.mark(msg.room, "first_piece", first=True)
                    self.rooms.mark(msg.room, "last_piece")
                    self._launch(msg)
                elif isinstance(msg, _Prepare):
                    self._prepare(msg.room)
                else:
                    self.scatters.after(msg)
            except Exception:
                logger.exception("sgl-nixl: scatter thread error (room %s); it goes on", msg.room)

    def _complete(self) -> None:
        """Completer: in arrival order, free each scattered piece's slot, apply statuses."""
        assert self.scatters is not None
        while not self._stop.is_set():
            waiting = self.rooms.waiting
            if waiting:  # quarantined slots come back by time, idle ones by recall
                self.messenger(*self.rooms.serve())
            for item in self.scatters.wait(timeout=0.1 if waiting else 0.5):
                try:
                    if isinstance(item, PieceReady):
                        self.rooms.scattered(item.slot)
                        self.rooms.mark(item.room, "scattered")
                        self.messenger.send(
                            (item.ip, item.port),
                            PieceDone(item.room, self.agent_name, item.slot, item.seq),
                        )
                    elif isinstance(item, AbortAck):
                        if item.ip:  # a host room counts its ACKs by prefill rank
                            self.rooms.abort_acked(item.room, (item.ip, item.port))
                        self._note_abort_ack(item.room, item.prefill_rank, item.generation)
                    else:
                        self._apply_status(item)  # its outcome stamps "applied"
                        if item.status == SUCCESS:
                            self.messenger(self.rooms.sender_done(item.room, (item.ip, item.port)))
                except Exception:
                    logger.exception("sgl-nixl: scatter completion error (room %s)", item.room)

    def _prepare(self, room: int) -> None:
        """The room's page numbers on the copy stream's device, uploaded while the prefill
        still computes: a piece of a whole-page chunk then only slices them (an upload
        costs ~0.1-0.3 ms of host time, which would otherwise delay the first scatter)."""
        pages = self.rooms.pages_of(room)
        if pages is None:
            return
        units = self.copier.prepare_units(pages, self.stream)
        if self.rooms.cache_units(room, (0, -1, 1), units):
            self.rooms.counters.prepared += 1

    def _items(self, m: PieceReady, pages: Any) -> Any:
        """The piece's chunk of destination items, numpy or on the copy stream like
        ``pages``: the room's pages, or (``by_token``) its pages' token rows."""
        lo, n = m.page_start, m.page_count
        if not m.by_token:
            return pages[lo : lo + n]
        size = self.page_size
        first, last = lo // size, -(-(lo + n) // size)
        return _expand(pages[first:last], size)[lo - first * size :][:n]

    def _units_of(self, m: PieceReady, pages: np.ndarray) -> Any:
        """The chunk's unit numbers where the copier reads them: sliced (and, for several
        units a page, expanded on the copy stream) from the room's uploaded page numbers."""
        key = (m.page_start, m.page_count, -m.units_per_item if m.by_token else m.units_per_item)
        units = self.rooms.cached_units(m.room, key)
        if units is not None:
            return units
        whole = self.rooms.cached_units(m.room, (0, -1, 1))
        if whole is not None:
            units = _expand(self._items(m, whole), m.units_per_item)
        else:
            geo = Geometry(m.unit_len, m.units_per_item, m.unit_len, m.dst_stride, 0, m.dst_offset)
            host = unit_indices_of(self._items(m, pages), geo)
            units = self.copier.prepare_units(host, self.stream)
            self.rooms.counters.late_uploads += 1
        self.rooms.cache_units(m.room, key, units)
        return units

    def _launch(self, m: PieceReady) -> None:
        problem, pages = self.rooms.piece_target(m.room, m.slot)
        problem = problem or self.validate(m, pages)
        if not problem:
            problem = self.rooms.occupy(m.room, m.slot)  # BUSY until its PieceDone goes out
        if problem:
            self._reject("bad_piece", f"room {m.room}: {problem}", f"{m.ip}:{m.port}")
            self._fail_room(m.room, f"staging piece rejected: {problem}")
            return
        assert pages is not None and self.scatters is not None
        units = self._units_of(m, pages)
        bases = self._bases_of((m.ip, m.port), self.rooms.is_host(m.room))
        self.scatters.launch(
            m,
            bases=bases[m.r0 : m.r1],
            units=units[m.j0 : m.j1],
            unit_len=m.unit_len,
            stride=m.dst_stride,
            offset=m.dst_offset,
            stage=self.buffer.addr(m.slot),
        )

    def validate(self, m: PieceReady, pages: np.ndarray | None) -> str:
        """Why the piece cannot be scattered where it says ('' if it can)."""
        if pages is None:
            return f"slot {m.slot} was not granted to this room"
        host = self.rooms.is_host(m.room)
        if host and not self.host_capable:
            return "a piece of a host room, but this decode scatters into device pages only"
        region_len = self.host_region_len if host else self.region_len
        window = self._windows.get((m.ip, m.port))
        if window is not None and max(window) >= len(self.bases):
            return f"its registration names region {max(window)} of our {len(self.bases)}"
        regions = len(window or self.bases)
        if not (m.r0 < m.r1 <= regions):
            return f"regions [{m.r0}, {m.r1}) outside [0, {regions})"
        items, what = (
            (len(pages) * self.page_size, "token rows") if m.by_token else (len(pages), "pages")
        )
        if m.page_start + m.page_count > items:
            return f"{what} [{m.page_start}, +{m.page_count}) beyond the room's {items}"
        if not (m.j0 < m.j1 <= m.page_count * m.units_per_item):
            return f"units [{m.j0}, {m.j1}) outside the chunk"
        if (m.r1 - m.r0) * (m.j1 - m.j0) * m.unit_len > self.buffer.slot_bytes:
            return "piece larger than a staging slot"
        chunk = self._items(m, pages)
        last = (int(chunk.max()) + 1) * m.units_per_item if len(chunk) else 0
        if m.dst_offset + last * m.dst_stride > region_len + (m.dst_stride - m.unit_len):
            return "destination beyond the registered KV region"
        return ""
