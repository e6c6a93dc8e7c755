"""The bench's decode rank, as SGLang's decode scheduler drives its receivers.

Each ``step()`` admits the rooms the concurrency allows (once their prefill is up and
its DP rank known), polls the active receivers, checks every byte of a room that ended,
and releases the pages of aborted or failed host rooms once the backend says that nothing
more can land in them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench.driver import FLAG_POLL_S, SideDriver
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
from sgl_nixl_plugin.transport import bootstrap_client


class Receipts:
    """A registry observer that keeps each room's ``ReceiveEvent`` (the decode's timeline)."""

    def __init__(self) -> None:
        self.events: dict[int, Any] = {}

    @hookimpl
    def sgl_nixl_receive_done(self, event: Any) -> None:
        self.events[event.room] = event


def _started_up(mgr: Any, addr: str) -> bool:
    """The decode's start-up registration with ``addr`` is done (always, for a backend
    without one): ``SGLANG_NIXL_PLUGIN_PREFILLS`` named it."""
    ready = getattr(mgr, "prefill_ready", None)
    return ready is None or bool(ready(addr))


class HandshakeClock:
    """When each prefill may first be sent a request, and the handshake its first room
    waited for (``handshake_s`` and its parts)."""

    PROBE_S = 0.05  # between two quiet "is it registered" queries to one bootstrap

    def __init__(self, mgr: Any, preconnect: bool) -> None:
        self.mgr = mgr
        self.preconnect = preconnect
        self.ready: set[str] = set()
        self.resolved: set[str] = set()
        self.probed: dict[str, float] = {}
        self.found: dict[str, float] = {}  # when each prefill was first seen up
        self.info_at: dict[str, float] = {}  # when its parallel info came

    def is_ready(self, addr: str) -> bool:
        """Whether a request to ``addr`` may go now; asks its bootstrap if not yet."""
        if addr in self.ready:
            return True
        if addr not in self.resolved and not self._resolve(addr):
            return False
        # as SGLang's decode scheduler, the request goes on at once: a backend's own
        # set-up of the pair (ours: registration, link, warm-up) is in its transfer
        self.ready.add(addr)
        return True

    def _resolve(self, addr: str) -> bool:
        # SGLang logs an ERROR for every query that finds the prefill not registered yet:
        # ask quietly (every 50 ms) until it is, then let SGLang fetch its info
        if time.monotonic() - self.probed.get(addr, 0.0) < self.PROBE_S:
            return False
        self.probed[addr] = time.monotonic()
        if not bootstrap_client.prefill_up(addr, None):  # the open aggregate query
            return False
        if self.preconnect and not _started_up(self.mgr, addr):
            return False
        # a user's first request reaches this decode now, at the earliest: its clock
        # starts here, handshake included (``handshake_s``); a decode that registered at
        # start-up is taken to have been up a while by then
        self.found.setdefault(addr, time.perf_counter())
        if not self.mgr.try_ensure_parallel_info(addr):
            return False
        self.resolved.add(addr)
        self.info_at[addr] = time.perf_counter()
        return True

    def first_room(self, addr: str, t0: float) -> tuple[float | None, dict[str, float] | None]:
        """The handshake the room sent at ``t0`` waited for, if it is the first to ``addr``:
        SGLang's bootstrap query (``info``); the room's route query and its receiver's
        start (``route``: SGLang's; ours registers there)."""
        if addr not in self.found:
            return None, None
        t_found = self.found.pop(addr)
        info = self.info_at.pop(addr, t_found)
        return t0 - t_found, {"info": info - t_found, "route": t0 - info}


@dataclass
class DecodeRoom:
    req: Request
    receiver: Any
    pages: np.ndarray
    slot: int
    prefill_dp_rank: int
    t0: float
    wall0: float
    sent_at: float = 0.0  # send_metadata returned (perf_counter)
    handshake_s: float | None = None
    handshake_parts: dict[str, float] | None = None
    abort_at: float | None = None
    aborted: bool = False
    acks: int = 0  # the abort ACKs its release waits for, one per prefill rank


class DecodeDriver(SideDriver):
    """A decode rank's rooms: pending (not sent yet), active (receiving), held (ended, pages
    kept until safe to reuse); ``results`` per room as the bench reports them."""

    role = "decode"

    def __init__(
        self,
        spec: RankSpec,
        env: dict[str, Any],
        progress: Any = None,
        requests: list[Request] | None = None,
        reports: bool = True,
    ) -> None:
        """``progress(n)``: called with the number of rooms done as each one ends;
        ``requests``: the rooms ``step()`` admits (None: the rank's share of the workload;
        a harness that starts its rooms itself passes none); ``reports``: keep each room's
        ``ReceiveEvent`` for ``report`` (a long-lived harness passes False)."""
        super().__init__(spec, env)
        self.receipts = Receipts()
        if reports:
            registry.get_plugin_manager().register(self.receipts)
        self.started = time.perf_counter()  # time to ready: from here to the first request
        self.ready_s: float | None = None
        mgr = self.open_manager()
        self.progress = progress
        # rooms that end through a completion flag ring no bell: poll them as SGLang's
        # decode scheduler does while transfers are pending (every loop)
        self.flags_pending = getattr(getattr(mgr, "decode", None), "flags_pending", None)
        w = spec.workload
        self.pool = PagePool(
            self.pools.pages, seed=w.seed + 31 * spec.instance + 7 * spec.tp_rank + 2
        )
        # SGLang's host allocator hands out page 0 too (only the device pools keep it back)
        self.host_pool = PagePool(
            self.pools.pages, seed=w.seed + 13 * spec.tp_rank + 5, padding_page=False
        )
        self.host_dst = harness.host_destination() if w.host_every else None
        if self.host_dst is not None and not mgr.supports_host_destination:
            raise RuntimeError("the decode manager does not support host KV destinations")
        # a room's index in the workload picks its prefill; a harness's rooms are its own
        whole = w.make_requests() if requests is None else requests
        self.index_of = {r.room: i for i, r in enumerate(whole)}
        self.pending = spec.my_requests() if requests is None else list(requests)
        self.active: dict[int, DecodeRoom] = {}
        self.results: dict[int, dict[str, Any]] = {}
        self.held: dict[int, tuple[DecodeRoom, float]] = {}  # failed host / aborted rooms
        self.painted: dict[int, np.ndarray] = {}  # aborted rooms' pages, painted once safe
        self.clock = HandshakeClock(mgr, spec.preconnect)
        self.dp_ranks: dict[int, int] = {}  # resolved for the next room, before its pages
        self.dp_probed: dict[int, float] = {}

    # -- the loop ------------------------------------------------------------------------
    def busy(self) -> bool:
        """Rooms left and time left."""
        return bool(self.pending or self.active or self.held) and (time.monotonic() < self.deadline)

    def step(self) -> None:
        """One pass of the scheduler: admit, poll, release."""
        while self.pending and len(self.active) < self.spec.workload.concurrency:
            if not self.admit(self.pending[0]):
                break
        for room, ctx in list(self.active.items()):
            self._poll(room, ctx)
        for room, (ctx, since) in list(self.held.items()):
            self._release_held(room, ctx, since)

    def wait(self) -> None:
        """Until a status changes (or a completion flag may have come)."""
        assert self.bell is not None
        flags = self.flags_pending is not None and self.flags_pending()
        self.bell.wait(FLAG_POLL_S if flags else None)

    # -- admission -----------------------------------------------------------------------
    def admit(self, r: Request) -> bool:
        """Send ``r``'s request if its prefill is up, its DP rank known and pages free."""
        addr = self.spec.prefill_addr_of(self.index_of[r.room])
        if not self.clock.is_ready(addr):
            return False
        dp_rank = self._dp_rank(addr, r.room)
        if dp_rank is None:
            return False
        pages = (self.host_pool if r.host else self.pool).alloc(
            r.pages(self.pools.page_size), r.contiguous
        )
        if pages is None:
            return False
        self.pending.pop(0)
        del self.dp_ranks[r.room]
        self._send(r, addr, dp_rank, pages)
        return True

    def _dp_rank(self, addr: str, room: int) -> int | None:
        """The prefill DP rank that holds the room, as SGLang's decode resolves it (the
        bootstrap is asked, at most every 20 ms, when the prefill does not follow rooms)."""
        dp_rank = self.dp_ranks.get(room)
        if dp_rank is not None:
            return dp_rank
        if time.monotonic() - self.dp_probed.get(room, 0.0) < 0.02:
            return None
        self.dp_probed[room] = time.monotonic()
        dp_rank = harness.resolve_prefill_dp_rank(self.mgr, addr, room)
        if dp_rank is not None:
            self.dp_ranks[room] = dp_rank
        return dp_rank

    def open_receiver(self, r: Request, addr: str, dp_rank: int) -> tuple[Any, int]:
        """A receiver for ``r`` from the prefill at ``addr`` (SGLang's ``init``), and the
        metadata slot it gets, its aux rows zeroed (the metadata gate reads them)."""
        slot = self.slots.pop()
        for buf, n in zip(self.pools.aux, AUX_ITEM_BYTES, strict=False):
            buf[slot * n : (slot + 1) * n] = 0
        receiver = self.cls["receiver"](mgr=self.mgr, bootstrap_addr=addr, bootstrap_room=r.room)
        receiver.init(dp_rank)
        return receiver, slot

    def send_metadata(self, receiver: Any, r: Request, pages: np.ndarray, slot: int) -> None:
        """The request's pages and slot, into the host pool for a host room."""
        state = [np.array([slot], dtype=np.int32)] if r.with_state else None
        if r.host:
            receiver.send_metadata(pages, slot, state, destination=self.host_dst)
        else:
            receiver.send_metadata(pages, slot, state)

    def _send(self, r: Request, addr: str, dp_rank: int, pages: np.ndarray) -> None:
        receiver, slot = self.open_receiver(r, addr, dp_rank)
        t0 = time.perf_counter()
        if self.ready_s is None:
            self.ready_s = t0 - self.started
        self.send_metadata(receiver, r, pages, slot)
        sent_at = time.perf_counter()
        # the first room to each prefill waited for the handshake before its clock
        handshake, parts = self.clock.first_room(addr, t0)
        self.active[r.room] = DecodeRoom(
            r, receiver, pages, slot, dp_rank, t0, time.time(), sent_at, handshake, parts,
            None if r.abort_at_ms is None else t0 + r.abort_at_ms * 1e-3,
        )  # fmt: skip

    # -- polling -------------------------------------------------------------------------
    def _status(self, ctx: DecodeRoom) -> Any:
        """The room's status, after its scheduled abort if that is due; None while it has
        not ended (SGLang's metadata gate: Success only counts once the bootstrap_room aux
        row landed)."""
        KVPoll = self.KVPoll
        status = ctx.receiver.poll()
        ended = status in (KVPoll.Success, KVPoll.Failed)
        if ctx.abort_at is not None and not ended and time.perf_counter() >= ctx.abort_at:
            ctx.receiver.abort()  # as SGLang's decode aborts a request it no longer serves
            ctx.abort_at, ctx.aborted = None, True
            # the ACKs its release waits for, one per prefill rank (SGLang's count)
            ctx.acks = len(getattr(ctx.receiver, "bootstrap_infos", None) or ())
            status = ctx.receiver.poll()
        if status == KVPoll.Success and not self.aux_landed(ctx.slot):
            return None
        return status if status in (KVPoll.Success, KVPoll.Failed) else None

    def aux_landed(self, slot: int) -> bool:
        """Whether the slot's bootstrap_room aux row landed (SGLang's metadata gate)."""
        n = AUX_ITEM_BYTES[1]
        return bool(self.pools.aux[1][slot * n : (slot + 1) * n].any())

    def _poll(self, room: int, ctx: DecodeRoom) -> None:
        status = self._status(ctx)
        if status is None:
            return
        seen_at = time.perf_counter()
        res: dict[str, Any] = {
            "ok": status == self.KVPoll.Success,
            "prefill_dp_rank": ctx.prefill_dp_rank,
            "latency_s": seen_at - ctx.t0,
            # the loop's own steps (perf_counter, the clock of the ReceiveEvent stamps):
            # send_metadata called and returned, the end seen (Success: the bench's T1)
            "stamps": {
                "request_at": ctx.t0,
                "request_sent_at": ctx.sent_at,
                "end_seen_at": seen_at,
            },
            "reason": None,
            "wall0": ctx.wall0,
            "wall1": time.time(),
        }
        if ctx.handshake_s is not None:
            res["handshake_s"] = ctx.handshake_s
            res["handshake_parts"] = ctx.handshake_parts
        if res["ok"]:
            self._succeeded(room, ctx, res)
        elif self._failed(ctx, res):
            # pages kept till nothing more can land in them (an aborted room's, then painted)
            self.held[room] = (ctx, time.perf_counter())
            self.results[room] = res
            del self.active[room]
            return
        self.results[room] = res
        if self.progress is not None:
            self.progress(len(self.results))
        (self.host_pool if ctx.req.host else self.pool).release(ctx.pages)
        self.slots.append(ctx.slot)
        del self.active[room]

    def _failed(self, ctx: DecodeRoom, res: dict[str, Any]) -> bool:
        """Record why the room failed; whether its pages must be held."""
        if ctx.req.host and not ctx.aborted:
            ctx.receiver.abort()  # as SGLang's decode does for a failed host receive
        try:
            ctx.receiver.failure_exception()
        except Exception as exc:
            res["reason"] = str(exc)
        if ctx.aborted:
            res["aborted"] = True
            return True
        if ctx.req.host:
            # SGLang keeps the host pages until the receiver says that nothing more can
            # land in them (no timeout: a remote WRITE may not have stopped)
            res["host"] = True
            return True
        return False

    def _succeeded(self, room: int, ctx: DecodeRoom, res: dict[str, Any]) -> None:
        r, pools = ctx.req, self.pools
        ctx.receiver.clear()
        res["bytes"] = len(ctx.pages) * pools.item_len * len(pools.kv_ptrs)
        if r.host:
            res["host"] = True
        if self.spec.verify:
            res.update(self.verify(r, ctx.pages, ctx.slot))

    def verify(self, r: Request, pages: np.ndarray, slot: int) -> dict[str, int]:
        """Bad pages (over every region), aux rows and state rows of a room that ended."""
        room, pools = r.room, self.pools
        # across page sizes only the request's tokens travel (SGLang's num_kv_tokens);
        # equal pages travel whole
        tokens = r.tokens if self.spec.workload.pages_differ else None
        out = {"bad_pages": pools.check(room, pages, r.host, tokens)}
        out["bad_aux"] = sum(
            int(not np.array_equal(buf[slot * n : (slot + 1) * n], aux_pattern(room, b, n)))
            for b, (buf, n) in enumerate(zip(pools.aux, AUX_ITEM_BYTES, strict=False))
        )
        if r.with_state:
            row = pools.state_row(slot)
            got = row.cpu().numpy() if self.spec.mem_kind == "VRAM" else row
            out["bad_state"] = int(not np.array_equal(got, state_pattern(room, STATE_ITEM_BYTES)))
        return out

    # -- release -------------------------------------------------------------------------
    def _release_held(self, room: int, ctx: DecodeRoom, since: float) -> None:
        if ctx.aborted:  # a device room: SGLang's decode counts the prefills' ACKs
            safe = self.mgr.is_abort_release_safe(room, ctx.acks)
        else:
            safe = ctx.receiver.is_abort_release_safe()
        if not safe:
            return
        if ctx.aborted:  # nothing may land from now on: paint, check at the end
            self.mgr.clear_deferred_abort_state(room)
            self.pools.paint(ctx.pages)
            self.painted[room] = ctx.pages
        ctx.receiver.clear()
        self.results[room]["held_s"] = time.perf_counter() - since
        if not ctx.aborted:
            self.host_pool.release(ctx.pages)
        self.slots.append(ctx.slot)
        del self.held[room]

    def report(self) -> dict[str, Any]:
        """The rank's result once the loop ended (rooms done, or the deadline)."""
        timed_out = [r.room for r in self.pending] + list(self.active)
        # checked once every room ended here: a write the prefill still made into an
        # aborted room after its ACK (a copy launched or left running past it) has landed
        # by now, the later rooms' transfers having gone through the same prefill workers
        for room, pages in self.painted.items():
            self.results[room]["written_after_ack"] = self.pools.unpainted(pages)
            self.pool.release(pages)
        for room, res in self.results.items():  # SGLang cleared each: its event is in
            ev = self.receipts.events.get(room)
            res["timeline"] = dict(ev.timeline) if ev is not None else {}
        return {
            "results": self.results,
            "timed_out": timed_out,
            "host_pages_held": sorted(self.held),  # failed host rooms never said safe
            "tables": self.tables(),
            "ready_s": self.ready_s,
            "cpu_s": self.cpu_s(),
        }


def run_decode(
    spec: RankSpec, env: dict[str, Any], progress: Any = None, before_close: Any = None
) -> dict[str, Any]:
    """Every room of this decode rank; ``before_close(result)`` runs before the manager
    closes (the rank reports there, then stays up while its prefills finish)."""
    driver = DecodeDriver(spec, env, progress)
    while driver.busy():
        driver.step()
        driver.wait()
    result = driver.report()
    if before_close is not None:
        before_close(result)
    driver.close_manager()
    return result
