"""Decode side of the staging path: slot grants, and the two threads that scatter pieces.

The launcher thread starts each landed piece's scatter at once (``ScatterQueue``); the
completer thread waits for them in order and frees each slot (``PieceDone``) as soon as its
scatter has finished on the copy stream. Statuses of a staged room pass through the same
queue as its pieces, so Success is only applied after every piece that arrived before it has
been scattered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from sgl_nixl_plugin.adapter.liveness import Endpoint
from sgl_nixl_plugin.adapter.prefill_state import SUCCESS
from sgl_nixl_plugin.engine.layout import Geometry
from sgl_nixl_plugin.engine.scatter_queue import ScatterQueue
from sgl_nixl_plugin.engine.staging import StagingBuffer, unit_indices_of
from sgl_nixl_plugin.wire.messages import (
    AbortAck,
    PieceDone,
    PieceReady,
    Region,
    SlotAsk,
    SlotGrant,
    SlotRecall,
    SlotReturn,
    StagingArea,
    TransferStatus,
)

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)

# Receiver slots one room may hold: pieces land in one while earlier ones are scattered and
# their PieceDone travels back (two would leave the sender waiting for that round trip).
SLOTS_PER_ROOM = 4


def slots_per_sender(senders: int) -> int:
    """A room's slots, shared by the prefill ranks that send to it (TP mismatch: several).

    Slots come back when their sender is done with the room (or between chunks,
    ``SlotReturn``), not when one of its chunks is done while other senders still send: giving each of k senders the whole
    SLOTS_PER_ROOM would let the first two of four fill the pool while the others wait
    (then go direct after SGLANG_NIXL_PLUGIN_SLOT_WAIT). One slot a sender still moves its
    bytes, one piece at a time.
    """
    return max(1, SLOTS_PER_ROOM // max(1, senders))


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


class DecodeStaging:
    def __init__(self, mgr: NixlPluginKVManager, device: int) -> None:
        self.mgr = mgr
        self.buffer = StagingBuffer(
            mgr.engine.agent, mgr.staging_bytes, mgr.slot_bytes, mgr.kv_mem_kind, device
        )
        self.device = device
        self.bases = np.asarray(mgr.engine.memory.kv.ptrs, dtype=np.uint64)
        self.region_len = min(mgr.engine.memory.kv.lens) if len(self.bases) else 0
        self.copier: Any = None
        self.stream: Any = None
        self.room_slots: dict[int, list[int]] = {}
        self._owner: dict[int, Endpoint | None] = {}  # held slot -> the sender it was granted to
        self.room_pages: dict[int, np.ndarray] = {}
        self._room_units: dict[tuple[int, int, int, int], Any] = {}  # prepared per chunk
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        # senders that found no free slot, in ask order: (room, their control endpoint)
        self._asks: deque[tuple[int, tuple[str, int]]] = deque()
        # rooms in the order this rank asked prefills for them: served in that order, which
        # every decode TP rank shares (in ask-arrival order, two ranks could each grant a
        # different room first, and each room would wait for the other on the other rank)
        self._order: dict[int, int] = {}
        self._next_order = 0
        self.asks = 0  # senders that had to wait for a slot (counted, for metrics and tests)
        self.late_grants = 0  # slots granted to them later
        self.returned = 0  # slots senders gave back before their room ended (SlotReturn)
        self._busy: set[int] = set()  # slots holding a piece not yet scattered and credited
        self._returned_rooms: set[int] = set()  # rooms that gave slots back mid-room
        self.returners: set[tuple[str, int]] = set()  # prefill endpoints that take SlotRecall
        self._recalled: set[int] = set()  # rooms asked to give their slots back (once each)
        self.recalls = 0
        self.freed_early = 0  # slots freed when their sender's Success was applied
        self.prepared = 0  # rooms whose page indices were uploaded before their first piece
        self.late_uploads = 0  # chunks whose indices had to be uploaded at their first piece
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.scatters: ScatterQueue | None = None
        self._bases_dev: Any = None
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-scatter", daemon=True)
        self.completer = threading.Thread(
            target=self._complete, name="sgl-nixl-scatter-done", daemon=True
        )

    def start(self) -> None:
        from sgl_nixl_plugin.engine.copy_kernels import make_copier

        self.copier = make_copier(self.buffer.mem_kind, self.device)
        if self.buffer.mem_kind == "VRAM":
            import torch

            self.stream = torch.cuda.Stream(device=self.device)
        self.scatters = ScatterQueue(self.copier, self.stream)
        self._bases_dev = self.copier.prepare_bases(self.bases, self.stream)
        self.thread.start()
        self.completer.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        if self.scatters is not None:
            self.scatters.wake()

    def area(self) -> StagingArea:
        b = self.buffer
        region = Region(b.ptr, b.nbytes, b.slot_bytes, b.device, b.mem_kind)
        return StagingArea(region, b.slot_bytes, b.device_uuid,
                           returns=self.mgr.settings.slot_returns)

    # -- grants ---------------------------------------------------------------------------
    def grant(self, room: int, pages: np.ndarray, sender: Endpoint | None = None) -> list[int]:
        """Receiver slots for one sender of ``room`` (``sender``: its endpoint, when known);
        none when the pool is exhausted, and then that sender asks (``SlotAsk``) and gets
        slots as they free up (``serve``)."""
        with self._lock:
            self._expire_quarantine()
            slots = self.buffer.acquire(self._per_sender(room)) if not self._asks else []
            self.room_slots.setdefault(room, []).extend(slots)
            self._owner.update(dict.fromkeys(slots, sender))
            fresh = room not in self.room_pages
            self.room_pages[room] = np.array(pages, dtype=np.int64)
            if fresh:
                self._order[room] = self._next_order
                self._next_order += 1
        if fresh:
            self._queue.put(_Prepare(room))  # upload its page indices before any piece lands
        return slots

    def ask(self, m: SlotAsk) -> None:
        """A sender of ``m.room`` waits for a slot: queue it (only a prefill rank of a room
        we stage may ask), then serve what is free."""
        ep = (m.ip, m.port)
        with self._lock:
            known = m.room in self.room_pages and ep in self.mgr.room_endpoints.get(m.room, ())
            if known and (m.room, ep) not in self._asks:
                self._asks.append((m.room, ep))
                self.asks += 1
        if not known:
            self.mgr.codec.rejections.reject("bad_ask", f"room {m.room} from {ep[0]}:{ep[1]}")
            return
        self.serve()
        self._recall_idle()

    def _recall_idle(self) -> None:
        """Senders still wait: ask rooms whose slots hold no piece (granted before their
        prefill was ready, or between chunks) to give them back. Each room once until it
        returns or ends; the prefill keeps slots a chunk is using."""
        recalls: list[tuple[tuple[str, int], SlotRecall]] = []
        with self._lock:
            if not self._asks:
                return
            waiting = set(self._asks)  # (room, sender): a sender that asks has none to give
            for room, slots in self.room_slots.items():
                if not slots or room in self._recalled or self._busy.intersection(slots):
                    continue
                eps = [e for e in self.mgr.room_endpoints.get(room, ())
                       if e in self.returners and (room, e) not in waiting]
                if eps:
                    self._recalled.add(room)
                    recalls += [(e, SlotRecall(room, self.mgr.engine.name)) for e in eps]
            self.recalls += len(recalls)
        for ep, msg in recalls:
            self.mgr.send_to(ep, msg)

    def take_back(self, m: SlotReturn) -> None:
        """A sender of ``m.room`` is done with ``m.slots`` for now: free them for the rooms
        that wait. Only slots the room holds and whose last piece was scattered and credited
        (a slot still busy could be overwritten by its next holder mid-scatter)."""
        ep = (m.ip, m.port)
        with self._lock:
            held = self.room_slots.get(m.room)
            known = held is not None and ep in self.mgr.room_endpoints.get(m.room, ())
            bad = [s for s in m.slots if not known or s not in held or s in self._busy]
            if len(set(m.slots)) != len(m.slots):
                bad = bad or sorted(m.slots)  # a slot named twice would be freed twice
            if not bad:
                for s in m.slots:
                    held.remove(s)
                    self._owner.pop(s, None)
                self.buffer.release(list(m.slots))
                self.returned += len(m.slots)
                self._returned_rooms.add(m.room)
                self._recalled.discard(m.room)
        if bad:
            self.mgr.codec.rejections.reject(
                "bad_return", f"room {m.room} slots {bad} from {ep[0]}:{ep[1]}"
            )
            return
        self.serve()

    def serve(self) -> None:
        """Grant free slots to waiting senders, oldest room first (backpressure across
        rooms; see ``_order``)."""
        grants: list[tuple[tuple[str, int], SlotGrant]] = []
        with self._lock:
            self._expire_quarantine()
            while self._asks and self.buffer.free:
                i = min(range(len(self._asks)), key=lambda k: self._order.get(self._asks[k][0], -1))
                room, ep = self._asks[i]
                del self._asks[i]
                if room not in self.room_pages:
                    continue  # ended while waiting
                slots = self.buffer.acquire(self._per_sender(room))
                self.room_slots.setdefault(room, []).extend(slots)
                self._owner.update(dict.fromkeys(slots, ep))
                grants += [(ep, SlotGrant(room, self.mgr.engine.name, s)) for s in slots]
                self.late_grants += len(slots)
        for ep, g in grants:
            self.mgr.send_to(ep, g)

    def _per_sender(self, room: int) -> int:
        """Slots for one sender of ``room``: SGLang records how many prefill ranks answer
        for it (``required_prefill_response_num_table``) before asking them."""
        senders = getattr(self.mgr, "required_prefill_response_num_table", {}).get(room, 1)
        return slots_per_sender(int(senders or 1))

    @property
    def waiting(self) -> int:
        return len(self._asks)

    def _expire_quarantine(self) -> None:
        now = time.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            self.buffer.release(self._quarantine.popleft()[1])

    def room_done(self, room: int, ok: bool) -> None:
        """Return the room's slots; after a failure, only once late writes can't land."""
        with self._lock:
            slots = self.room_slots.pop(room, [])
            self._busy.difference_update(slots)
            for s in slots:
                self._owner.pop(s, None)
            self._returned_rooms.discard(room)
            self._recalled.discard(room)
            self.room_pages.pop(room, None)
            self._order.pop(room, None)
            for key in [k for k in self._room_units if k[0] == room]:
                del self._room_units[key]
            if any(r == room for r, _ in self._asks):
                self._asks = deque(a for a in self._asks if a[0] != room)
            if slots and not ok:
                hold = self.mgr.settings.abort_drain_timeout_s
                self._quarantine.append((time.monotonic() + hold, slots))
                slots = []
            if slots:
                self.buffer.release(slots)
        self.serve()

    def sender_done(self, room: int, sender: Endpoint) -> None:
        """``sender``'s Success for ``room`` was applied (behind its scatters): it writes no
        more there, so the slots granted to it go to waiting rooms now. Slots freed only at
        the room's end would make rooms wait on each other when a room has several senders
        (TP mismatch: one sender of room B holds slots while another waits behind room C,
        and C's likewise) or when its decode ranks granted rooms in different orders."""
        with self._lock:
            held = self.room_slots.get(room)
            if not held:
                return
            mine = [s for s in held if self._owner.get(s) == sender and s not in self._busy]
            if not mine:
                return
            for s in mine:
                held.remove(s)
                del self._owner[s]
            self.buffer.release(mine)
            self.freed_early += len(mine)
            self._returned_rooms.add(room)  # statuses still queue behind its scatters
            if (room, sender) in self._asks:
                self._asks = deque(a for a in self._asks if a != (room, sender))
        self.serve()

    def is_staged(self, room: int) -> bool:
        """Whether the room's statuses must queue behind its scatters (it holds slots, or
        held some and gave them back between chunks)."""
        with self._lock:
            return bool(self.room_slots.get(room)) or room in self._returned_rooms

    # -- the scatter thread -------------------------------------------------------------
    def submit(self, msg: PieceReady | TransferStatus | AbortAck | _Prepare) -> None:
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
        mgr = self.mgr
        while not self._stop.is_set():
            if self._asks:
                self.serve()  # quarantined slots come back by time, not by an event
                self._recall_idle()  # and slots may sit idle in rooms granted since the asks
            for item in self.scatters.wait(timeout=0.1 if self._asks else 0.5):
                try:
                    if isinstance(item, PieceReady):
                        with self._lock:
                            self._busy.discard(item.slot)
                        mgr.send_to(
                            (item.ip, item.port),
                            PieceDone(item.room, mgr.engine.name, item.slot, item.seq),
                        )
                    elif isinstance(item, AbortAck):
                        mgr.note_abort_ack(item.room, item.prefill_rank, item.generation)
                    else:
                        mgr.apply_status(item)
                        if item.status == SUCCESS and item.port:
                            self.sender_done(item.room, (item.ip, item.port))
                except Exception:
                    logger.exception("sgl-nixl: scatter completion error (room %s)", item.room)

    def _prepare(self, room: int) -> None:
        """The room's page numbers on the copy stream's device, uploaded while the prefill
        still computes: a piece of a whole-page chunk then only slices them (an upload
        costs ~0.1-0.3 ms of host time, which would otherwise delay the first scatter)."""
        with self._lock:
            pages = self.room_pages.get(room)
        if pages is None:
            return
        units = self.copier.prepare_units(pages, self.stream)
        with self._lock:
            if room in self.room_pages:  # not if the room ended meanwhile
                self._room_units[(room, 0, -1, 1)] = units
                self.prepared += 1

    def _units_of(self, m: PieceReady, pages: np.ndarray) -> Any:
        """The chunk's unit numbers where the copier reads them: sliced (and, for several
        units a page, expanded on the copy stream) from the room's uploaded page numbers."""
        key = (m.room, m.page_start, m.page_count, m.units_per_item)
        with self._lock:
            units = self._room_units.get(key)
            whole = self._room_units.get((m.room, 0, -1, 1))
        if units is not None:
            return units
        if whole is not None:
            units = _expand(whole[m.page_start : m.page_start + m.page_count], m.units_per_item)
            with self._lock:
                if m.room in self.room_slots:
                    self._room_units[key] = units
            return units
        geo = Geometry(m.unit_len, m.units_per_item, m.unit_len, m.dst_stride, 0, m.dst_offset)
        host = unit_indices_of(pages[m.page_start : m.page_start + m.page_count], geo)
        units = self.copier.prepare_units(host, self.stream)
        with self._lock:
            self.late_uploads += 1
            if m.room in self.room_slots:  # not if the room ended meanwhile
                self._room_units[key] = units
        return units

    def _launch(self, m: PieceReady) -> None:
        mgr = self.mgr
        with self._lock:
            slots = self.room_slots.get(m.room, [])
            pages = self.room_pages.get(m.room)
        problem = self._validate(m, slots, pages)
        if problem:
            mgr.codec.rejections.reject("bad_piece", f"room {m.room}: {problem}", f"{m.ip}:{m.port}")
            if m.room in mgr.request_status:  # a room we don't hold must not gain a record
                mgr.record_failure(m.room, f"staging piece rejected: {problem}")
                mgr.update_status(m.room, 0)
            return
        assert pages is not None  # _validate said so
        with self._lock:
            self._busy.add(m.slot)  # until its PieceDone goes out (``_complete``)
        units = self._units_of(m, pages)
        assert self.scatters is not None
        self.scatters.launch(
            m, bases=self._bases_dev[m.r0 : m.r1], units=units[m.j0 : m.j1], unit_len=m.unit_len,
            stride=m.dst_stride, offset=m.dst_offset, stage=self.buffer.addr(m.slot),
        )

    def _validate(self, m: PieceReady, slots: list[int], pages: np.ndarray | None) -> str:
        if pages is None or m.slot not in slots:
            return f"slot {m.slot} was not granted to this room"
        if not (m.r0 < m.r1 <= len(self.bases)):
            return f"regions [{m.r0}, {m.r1}) outside [0, {len(self.bases)})"
        if m.page_start + m.page_count > len(pages):
            return f"pages [{m.page_start}, +{m.page_count}) beyond the room's {len(pages)}"
        if not (m.j0 < m.j1 <= m.page_count * m.units_per_item):
            return f"units [{m.j0}, {m.j1}) outside the chunk"
        if (m.r1 - m.r0) * (m.j1 - m.j0) * m.unit_len > self.buffer.slot_bytes:
            return "piece larger than a staging slot"
        chunk = pages[m.page_start : m.page_start + m.page_count]
        last = (int(chunk.max()) + 1) * m.units_per_item if len(chunk) else 0
        if m.dst_offset + last * m.dst_stride > self.region_len + (m.dst_stride - m.unit_len):
            return "destination beyond the registered KV region"
        return ""
