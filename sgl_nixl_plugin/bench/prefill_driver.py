"""The bench's prefill rank, as SGLang's prefill scheduler drives its senders.

Each ``step()`` opens a sender for the rooms the concurrency allows (their pages filled
with the room's pattern), sends each room's chunks once its decode's request arrived
(``WaitingForInput``), a chunk gap apart, and ends the rooms whose transfer ended.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin.bench.driver import SideDriver
from sgl_nixl_plugin.bench.spec import RankSpec
from sgl_nixl_plugin.bench.workload import (
    AUX_ITEM_BYTES,
    STATE_ITEM_BYTES,
    PagePool,
    Request,
    aux_pattern,
    state_pattern,
)
from sgl_nixl_plugin.registry import hookimpl
from sgl_nixl_plugin.registry import manager as registry

logger = logging.getLogger("sgl_nixl_plugin.bench")
REPORT_WAIT_S = 10.0  # for the last rooms' TransferEvents, once every room was seen ended


class Collector:
    """A registry observer that keeps each room's TransferEvent (descriptors, path)."""

    def __init__(self) -> None:
        self.events: dict[int, Any] = {}
        self._arrived = threading.Condition()

    @hookimpl
    def sgl_nixl_transfer_done(self, event: Any) -> None:
        with self._arrived:
            self.events[event.room] = event
            self._arrived.notify_all()

    def wait_for(self, rooms: set[int], timeout_s: float) -> set[int]:
        """Wait until each of ``rooms`` has its event (the worker reports a room just after
        the status SGLang's poll showed, and a starved worker later still); the rooms still
        without one when ``timeout_s`` ran out."""
        with self._arrived:
            self._arrived.wait_for(lambda: rooms <= self.events.keys(), timeout_s)
            return rooms - self.events.keys()


@dataclass
class PrefillRoom:
    req: Request
    sender: Any
    pages: np.ndarray
    slot: int
    t0: float
    open_wall: float  # the sender made (wall clock): the room's "forward pass" is over
    hold: bool = False  # send every chunk but the last until ``release``
    sent: bool = False  # init() called: the decode's request arrived
    parts: list[np.ndarray] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    next: int = 0
    next_at: float = 0.0
    ready_seen: float | None = None
    send_wall: float | None = None
    sent_at: float = 0.0  # the first chunk's send() returned (perf_counter)
    control_us: float = 0.0


class PrefillDriver(SideDriver):
    """A prefill rank's rooms: ``pending`` (no sender yet), ``active`` (a sender, its
    chunks going out), ``results`` per room as the bench reports them.

    ``on_bound(room)`` and ``on_done(room, result)``, when set, are told as a room's
    decode request arrives and as the room ends (the fault tests' events).
    """

    role = "prefill"

    def __init__(
        self,
        spec: RankSpec,
        env: dict[str, Any],
        requests: list[Request] | None = None,
        bootstrap_host: str = "127.0.0.1",
        reports: bool = True,
    ) -> None:
        """``requests``: the rooms ``step()`` opens (None: the rank's share of the workload;
        a harness that opens its rooms itself passes none); ``bootstrap_host``: where a
        rank that serves the bootstrap listens; ``reports``: keep each room's
        ``TransferEvent`` for ``attach_reports`` (a long-lived harness passes False: they
        would pile up over a soak's rooms)."""
        super().__init__(spec, env)
        self.server = None
        if spec.serve_bootstrap:
            self.server = self.cls["bootstrap_server"](
                host=bootstrap_host, port=spec.bootstrap_port
            )
        self.collector = Collector()
        if reports:
            registry.get_plugin_manager().register(self.collector)
        self.open_manager()
        w = spec.workload
        self.pool = PagePool(self.pools.pages, seed=w.seed + 17 * spec.instance + 1)
        self.bootstrap_addr = f"127.0.0.1:{spec.bootstrap_port}"
        self.pending = spec.my_requests() if requests is None else list(requests)
        self.active: dict[int, PrefillRoom] = {}
        self.results: dict[int, dict[str, Any]] = {}
        self.on_bound: Any = None
        self.on_done: Any = None

    # -- the loop ------------------------------------------------------------------------
    def busy(self) -> bool:
        """Rooms left and time left."""
        return bool(self.pending or self.active) and time.monotonic() < self.deadline

    def step(self) -> None:
        """One pass of the scheduler: open senders, send due chunks, end rooms."""
        while self.pending and len(self.active) < self.spec.workload.concurrency:
            r = self.pending[0]
            if self.open(r) is None:
                break
            self.pending.pop(0)
        for room, ctx in list(self.active.items()):
            self._poll(room, ctx)

    def wait(self) -> None:
        """Until a status changes (or the next chunk gap may be over)."""
        assert self.bell is not None
        self.bell.wait()

    # -- rooms ---------------------------------------------------------------------------
    def open(self, r: Request, hold: bool = False) -> PrefillRoom | None:
        """Fill ``r``'s pages and open its sender (as SGLang does when the request comes);
        None while the page pool has no room for it."""
        pages = self.pool.alloc(r.pages(self.spec.workload.page_size), r.contiguous)
        if pages is None:
            return None
        slot = self.slots.pop()
        if self.spec.verify:
            self.pools.fill(r.room, pages)
        self._fill_slot(r, slot)
        sender = self.cls["sender"](
            mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=r.room
        )
        ctx = PrefillRoom(r, sender, pages, slot, time.perf_counter(), time.time(), hold=hold)
        self.active[r.room] = ctx
        return ctx

    def _fill_slot(self, r: Request, slot: int) -> None:
        for b, buf in enumerate(self.pools.aux):
            n = AUX_ITEM_BYTES[b]
            buf[slot * n : (slot + 1) * n] = aux_pattern(r.room, b, n)
        if not r.with_state:
            return
        row = self.pools.state_row(slot)
        pat = state_pattern(r.room, STATE_ITEM_BYTES)
        if self.spec.mem_kind == "VRAM":
            import torch

            row.copy_(torch.from_numpy(pat))
        else:
            row[:] = pat

    def release(self, room: int) -> bool:
        """Let a held room send its last chunk; whether it was holding one. A room whose
        decode request has not come yet sends every chunk when it does."""
        ctx = self.active.get(room)
        if ctx is None:
            return False
        holding = ctx.hold and ctx.sent
        ctx.hold = False
        if holding:
            self._send_due(ctx)
        return holding

    def holding(self) -> list[int]:
        """Rooms that sent every chunk but their last."""
        return [room for room, c in self.active.items() if c.hold and c.sent]

    def _poll(self, room: int, ctx: PrefillRoom) -> None:
        KVPoll = self.KVPoll
        status = ctx.sender.poll()
        if status == KVPoll.WaitingForInput and not ctx.sent:
            self._start(ctx)
        if ctx.sent and ctx.next < len(ctx.parts) and status != KVPoll.Failed:
            self._send_due(ctx)
        elif status in (KVPoll.Success, KVPoll.Failed):
            self._finish(room, ctx, status == KVPoll.Success)

    def _start(self, ctx: PrefillRoom) -> None:
        """The decode's request arrived: ``init`` the sender, plan the chunks."""
        r, w = ctx.req, self.spec.workload
        ctx.sent = True
        t = time.perf_counter()
        ctx.ready_seen, ctx.send_wall = t, time.time()
        if self.on_bound is not None:
            self.on_bound(r.room)
        ctx.sender.init(len(ctx.pages), ctx.slot)
        ctx.parts = r.split(ctx.pages)
        ctx.tokens = r.chunk_tokens([len(p) for p in ctx.parts], w.page_size)
        ctx.next, ctx.next_at = 0, t + r.send_delay_ms * 1e-3
        ctx.control_us = (time.perf_counter() - t) * 1e6

    def _send_due(self, ctx: PrefillRoom) -> None:
        """Chunked prefill: each next chunk once its forward pass (the gap) is over; a held
        room's last chunk waits for ``release``."""
        r, gap_s = ctx.req, self.spec.workload.chunk_gap_ms * 1e-3
        end = len(ctx.parts) - 1 if ctx.hold else len(ctx.parts)
        while ctx.next < end and time.perf_counter() >= ctx.next_at:
            t = time.perf_counter()
            i = ctx.next
            last = i == len(ctx.parts) - 1
            state = [np.array([ctx.slot], dtype=np.int32)] if (last and r.with_state) else None
            ctx.sender.send(
                ctx.parts[i].astype(np.int32), state_indices=state, num_kv_tokens=ctx.tokens[i]
            )
            t1 = time.perf_counter()
            ctx.control_us += (t1 - t) * 1e6
            ctx.sent_at = ctx.sent_at or t1
            ctx.next, ctx.next_at = i + 1, t + gap_s

    def _finish(self, room: int, ctx: PrefillRoom, ok: bool) -> None:
        seen_at = time.perf_counter()
        reason = None
        if ok:
            ctx.sender.clear()
        else:
            try:
                ctx.sender.failure_exception()
            except Exception as exc:
                reason = str(exc)
        res = {
            "ok": ok,
            "send_wall": ctx.send_wall,
            "open_wall": ctx.open_wall,
            "reason": reason,
            "control_us": ctx.control_us,
            "ready_ms": ((ctx.ready_seen or ctx.t0) - ctx.t0) * 1e3,
            # the loop's own steps (perf_counter, the clock of the room's TransferEvent
            # stamps): sender made, WaitingForInput seen, first send() returned, end seen
            "stamps": {
                "sender_at": ctx.t0,
                "waiting_seen_at": ctx.ready_seen or 0.0,
                "sent_at": ctx.sent_at,
                "end_seen_at": seen_at,
            },
        }
        self.results[room] = res
        self.pool.release(ctx.pages)
        self.slots.append(ctx.slot)
        del self.active[room]
        if self.on_done is not None:
            self.on_done(room, res)

    # -- the end -------------------------------------------------------------------------
    def attach_reports(self) -> None:
        """Each room's report from the manager (it may come just after the status the
        loop saw): its descriptors, path and ``TransferEvent.timeline``."""
        ok = {room for room, res in self.results.items() if res.get("ok")}
        late = self.collector.wait_for(ok, REPORT_WAIT_S)
        if late:
            logger.warning(
                "bench: no TransferEvent for rooms %s after %ss", sorted(late), REPORT_WAIT_S
            )
        for room, res in self.results.items():
            ev = self.collector.events.get(room)
            res["descriptors"] = getattr(ev, "descriptors", None)
            res["path"] = getattr(ev, "path", None)
            res["timeline"] = dict(ev.timeline) if ev is not None else {}
            if ev is not None and ev.timeline:
                logger.debug(
                    "bench prefill room %s: WaitingForInput seen %.3f ms after the sender "
                    "was made, send() calls %.0f us; room timeline %s",
                    room,
                    res["ready_ms"],
                    res["control_us"],
                    ev.timeline,
                )

    def close(self) -> None:
        self.close_manager()
        if self.server is not None:
            self.server.close()


def run_prefill(spec: RankSpec, env: dict[str, Any], done: Any) -> dict[str, Any]:
    """Every room of this prefill rank; then serves until ``done`` (its decodes ended)."""
    driver = PrefillDriver(spec, env)
    while driver.busy():
        driver.step()
        driver.wait()
    timed_out = [r.room for r in driver.pending] + list(driver.active)
    cpu_s = driver.cpu_s()  # its rooms ended: not the wait for the decodes below
    done.wait(timeout=max(1.0, driver.deadline - time.monotonic()))
    driver.attach_reports()
    time.sleep(0.2)  # let the last status frames leave before the sockets close
    tables = driver.tables()
    driver.close()
    out = {"results": driver.results, "timed_out": timed_out, "tables": tables, "cpu_s": cpu_s}
    ipc = sys.modules.get("sgl_nixl_plugin.engine.cuda_ipc")
    if ipc is not None:  # CUDA IPC mappings still open after the manager closed: 0
        out["ipc_open"] = ipc.open_mappings()
    return out
