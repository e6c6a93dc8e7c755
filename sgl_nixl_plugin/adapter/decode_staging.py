"""Decode side of the staging path: slot grants, and the thread that scatters pieces.

Statuses of a staged room pass through the same FIFO as its pieces, so Success is only
applied after every piece that arrived before it has been scattered (and, on GPUs, after
the scatter finished on its stream).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from sgl_nixl_plugin.engine.layout import Geometry
from sgl_nixl_plugin.engine.staging import StagingBuffer, unit_indices_of
from sgl_nixl_plugin.wire.messages import (
    AbortAck,
    PieceDone,
    PieceReady,
    Region,
    StagingArea,
    TransferStatus,
)

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)

SLOTS_PER_ROOM = 2  # double buffering: piece i lands while piece i-1 is scattered


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
        self.room_pages: dict[int, np.ndarray] = {}
        self._quarantine: deque[tuple[float, list[int]]] = deque()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-scatter", daemon=True)

    def start(self) -> None:
        from sgl_nixl_plugin.engine.copy_kernels import make_copier

        self.copier = make_copier(self.buffer.mem_kind, self.device)
        if self.buffer.mem_kind == "VRAM":
            import torch

            self.stream = torch.cuda.Stream(device=self.device)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)

    def area(self) -> StagingArea:
        b = self.buffer
        return StagingArea(Region(b.ptr, b.nbytes, b.slot_bytes, b.device, b.mem_kind), b.slot_bytes)

    # -- grants ---------------------------------------------------------------------------
    def grant(self, room: int, pages: np.ndarray) -> list[int]:
        """Receiver slots for one sender of ``room`` (none when the pool is exhausted)."""
        now = time.monotonic()
        with self._lock:
            while self._quarantine and self._quarantine[0][0] <= now:
                self.buffer.release(self._quarantine.popleft()[1])
        slots = self.buffer.acquire(SLOTS_PER_ROOM)
        with self._lock:
            self.room_slots.setdefault(room, []).extend(slots)
            self.room_pages[room] = np.array(pages, dtype=np.int64)
        return slots

    def room_done(self, room: int, ok: bool) -> None:
        """Return the room's slots; after a failure, only once late writes can't land."""
        with self._lock:
            slots = self.room_slots.pop(room, [])
            self.room_pages.pop(room, None)
            if slots and not ok:
                hold = self.mgr.settings.abort_drain_timeout_s
                self._quarantine.append((time.monotonic() + hold, slots))
                return
        if slots:
            self.buffer.release(slots)

    def is_staged(self, room: int) -> bool:
        with self._lock:
            return bool(self.room_slots.get(room))

    # -- the scatter thread -------------------------------------------------------------
    def submit(self, msg: PieceReady | TransferStatus | AbortAck) -> None:
        self._queue.put(msg)

    def _run(self) -> None:
        while not self._stop.is_set():
            msg = self._queue.get()
            if msg is None:
                continue
            try:
                if isinstance(msg, PieceReady):
                    self._scatter(msg)
                elif isinstance(msg, AbortAck):
                    self.mgr.note_abort_ack(msg.room, msg.prefill_rank, msg.generation)
                else:
                    self.mgr.apply_status(msg)
            except Exception:
                logger.exception("sgl-nixl: scatter thread error (room %s); it goes on", msg.room)

    def _scatter(self, m: PieceReady) -> None:
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
        geo = Geometry(m.unit_len, m.units_per_item, m.unit_len, m.dst_stride, 0, m.dst_offset)
        units = unit_indices_of(pages[m.page_start : m.page_start + m.page_count], geo)
        self.copier.scatter(
            self.bases[m.r0 : m.r1], units[m.j0 : m.j1], m.unit_len, m.dst_stride,
            m.dst_offset, self.buffer.addr(m.slot), self.stream,
        )
        self.copier.synchronize(self.stream)
        mgr.send_to((m.ip, m.port), PieceDone(m.room, mgr.engine.name, m.slot))

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
