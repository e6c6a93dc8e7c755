"""Prefill side: the control thread that files decode requests, and the transfer workers.

The scheduler's ``send()`` only enqueues a chunk (O(1)). A worker thread submits the
chunk's WRITEs without waiting for them and polls every in-flight transfer it owns, so
many rooms bound for the same decode move at once. Rooms are sharded across workers by
room id, so one room's chunks stay in order on one worker. Nothing a peer sends can kill
the control thread: every message is handled inside its own ``try``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.adapter.liveness import PeerWatch, drain
from sgl_nixl_plugin.adapter.memory import kv_geometry, remote_memory
from sgl_nixl_plugin.engine.agent import TransferError, Xfer
from sgl_nixl_plugin.engine.descriptors import expected_descriptors, validate_items
from sgl_nixl_plugin.engine.engine import PeerLink
from sgl_nixl_plugin.engine.staging import (
    RemoteStaging,
    StagedSend,
    choose_path,
    plan_pieces,
    staging_unit_len,
    unit_indices_of,
)
from sgl_nixl_plugin.wire.compat import describe_mismatch
from sgl_nixl_plugin.wire.messages import (
    Abort,
    PeerRegistration,
    PieceDone,
    PieceReady,
    Ping,
    Pong,
    RegistrationReply,
    TransferRequest,
    TransferStatus,
)

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)

# KVPoll values (SGLang's enum is an int enum; kept numeric to keep this module SGLang-free)
FAILED, WAITING_FOR_INPUT, SUCCESS = 0, 2, 4


@dataclass
class DecodePeer:
    """A registered decode rank: its NIXL link and what it told us."""

    agent: str
    link: PeerLink
    reg: PeerRegistration
    endpoint: tuple[str, int]
    last_seen: float = field(default_factory=time.monotonic)
    staging: RemoteStaging | None = None


@dataclass
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


@dataclass
class Chunk:
    room: int
    pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None
    state: list[Any] | None
    events: tuple[Any, ...] = ()  # CUDA events the source pages wait on


@dataclass
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


@dataclass
class StagedJob:
    """One chunk's staged transfer to one decode rank, and what the decode must be told."""

    send: StagedSend
    info: TransferInfo
    peer: DecodePeer
    page_start: int
    page_count: int


class SlotCredits(deque):
    """Receiver staging slots this room may write now; ``granted`` bounds what credits accept."""

    def __init__(self, slots: list[int]) -> None:
        super().__init__(slots)
        self.granted = frozenset(slots)


class PrefillControl:
    """Receives registrations, transfer requests, aborts and pings from decode ranks."""

    def __init__(self, mgr: NixlPluginKVManager) -> None:
        self.mgr = mgr
        self.peers: dict[str, DecodePeer] = {}
        self.refused: dict[str, str] = {}  # agent -> reason its registration was refused
        self.lock = threading.Lock()
        self._stop = threading.Event()
        s = mgr.settings
        self.watch = PeerWatch(mgr._zmq_ctx, s.liveness_interval_s, s.liveness_misses)
        self._pending: dict[tuple[str, int], str] = {}
        self._next_check = 0.0
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-prefill-ctl", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    # -- loop -------------------------------------------------------------------------
    def _run(self) -> None:
        mgr = self.mgr
        sock = mgr.server_socket
        poller = self.watch.poller
        poller.register(sock, zmq.POLLIN)
        tick_ms = max(10, int(self.watch.interval * 1000 / 2))
        while not self._stop.is_set():
            try:
                for ready, _ in poller.poll(tick_ms):
                    if ready is sock:
                        for frames in drain(sock):
                            self._receive(frames)
                    elif self.watch.owns(ready):
                        for ep, why in self.watch.on_monitor(ready):
                            self._lost(ep, why, drop=True)
                self._check_liveness()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.error("sgl-nixl prefill control socket error: %s", exc)
                time.sleep(0.05)
            except Exception:
                logger.exception("sgl-nixl: prefill control error; the control thread goes on")
        self.watch.close()

    def _receive(self, frames: list[Any]) -> None:
        decoded = self.mgr.codec.decode(frames)
        if decoded is None:
            return
        try:
            self._dispatch(decoded.msg, decoded.kv, decoded.state)
        except Exception:
            logger.exception(
                "sgl-nixl: error handling %s; the control thread goes on", type(decoded.msg).__name__
            )

    def _pending_decodes(self) -> dict[tuple[str, int], str]:
        """Decode endpoints (-> agent) that still await data for some room."""
        mgr, out = self.mgr, {}
        for room, infos in list(mgr.transfer_infos.items()):
            if mgr.request_status.get(room) in (None, FAILED, SUCCESS):
                continue
            for info in list(infos.values()):
                if not info.is_dummy:
                    out[(info.endpoint, info.dst_port)] = info.agent
        return out

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.watch.interval / 4
        mgr = self.mgr
        self._pending = self._pending_decodes()
        self.watch.sync(set(self._pending))
        self.watch.ping(
            lambda seq: mgr.codec.encode(Ping(mgr.engine.name, mgr.local_ip, mgr.rank_port, seq))
        )
        for ep, silent in self.watch.silent():
            self._lost(ep, f"stopped answering (no reply for {silent:.1f}s)", drop=False)

    def _lost(self, endpoint: tuple[str, int], why: str, drop: bool) -> None:
        self.watch.forget(endpoint)
        agent = self._pending.get(endpoint)
        if agent is None:
            return
        reason = f"decode {agent} at {endpoint[0]}:{endpoint[1]} {why}"
        logger.error("sgl-nixl: %s", reason)
        if drop:
            self.drop_peer(agent, why)
        else:
            self.mgr.fail_rooms_of_peer(agent, reason)

    def _dispatch(self, msg: Any, kv: np.ndarray | None, state: list[np.ndarray]) -> None:
        if isinstance(msg, TransferRequest):
            self.on_request(msg, kv, state)
        elif isinstance(msg, PeerRegistration):
            self.on_registration(msg)
        elif isinstance(msg, PieceDone):
            free = self.mgr.remote_free.get(msg.room, {}).get(msg.agent_name)
            if free is None:
                return  # the room already ended: its last credits are not needed
            if msg.slot not in free.granted:
                self.mgr.codec.rejections.reject("bad_credit", f"room {msg.room} slot {msg.slot}")
            elif msg.slot in free:  # a repeated credit would let two pieces share the slot
                self.mgr.codec.rejections.reject(
                    "bad_credit", f"room {msg.room} slot {msg.slot} is already free"
                )
            else:
                free.append(msg.slot)
        elif isinstance(msg, Abort):
            self.on_abort(msg)
        elif isinstance(msg, Ping):
            mgr = self.mgr
            mgr.send_to((msg.ip, msg.port), Pong(mgr.engine.name, msg.seq, mgr.local_ip, mgr.rank_port))
        elif isinstance(msg, Pong):
            self.watch.replied((msg.ip, msg.port))  # a decode we ping for its pending rooms
        else:
            self.mgr.codec.rejections.reject("unexpected", type(msg).__name__)

    # -- registration -------------------------------------------------------------------
    def on_registration(self, reg: PeerRegistration) -> None:
        mgr = self.mgr
        endpoint = (reg.ip, reg.port)
        reason = describe_mismatch(mgr.compat, reg.compat, "prefill")
        if not reason and reg.compat_hash != mgr.compat_hash:
            reason = "compatibility hash differs although every field matches: upgrade both sides"
        link = None
        with self.lock:
            known = self.peers.get(reg.agent_name)
        if known is not None and known.reg == reg:
            # The same decode process registering again (its cache was reset): keep the link.
            known.last_seen = time.monotonic()
            mgr.send_to(
                endpoint,
                RegistrationReply(reg.agent_name, mgr.prefill_rank_id, True, "", mgr.local_ip, mgr.rank_port),
            )
            return
        if known is not None:
            self.drop_peer(reg.agent_name, "re-registered with a different layout")
        if not reason:
            try:
                geometry = kv_geometry(
                    is_mla=mgr.is_mla_backend,
                    page_size=mgr.compat.page_size,
                    head_bytes_=mgr.compat.head_bytes,
                    src_heads=int(mgr.kv_args.kv_head_num or 0),
                    dst_heads=reg.kv_heads,
                    src_tp_rank=mgr.attn_tp_rank,
                    dst_tp_rank=reg.tp_rank,
                )
                remote = remote_memory(reg.kv, reg.aux, reg.state)
                mgr.check_peer_aux_buffer_count(reg.agent_name, len(reg.aux))
                link = mgr.engine.link(reg.agent_metadata, remote, {"kv": geometry})
            except ValueError as exc:
                reason = f"cannot serve decode rank {reg.tp_rank}/{reg.tp_size} layout: {exc}"
            except TransferError as exc:
                # A transport problem (e.g. NIXL could not reach the peer) is not a verdict
                # on the layout: don't remember it, let the decode register again.
                logger.error("sgl-nixl: could not connect decode %s: %s", reg.agent_name, exc)
                mgr.send_to(
                    endpoint,
                    RegistrationReply(
                        reg.agent_name, mgr.prefill_rank_id, False, f"NIXL could not connect: {exc}",
                        mgr.local_ip, mgr.rank_port, retry=True,
                    ),
                )
                return
        old_link = None
        with self.lock:
            stale = [
                p for p in self.peers.values() if p.endpoint == endpoint and p.agent != reg.agent_name
            ]
            for gone in stale:
                self._drop_peer_locked(gone, "decode at this address restarted")
            if reason:
                self.refused[reg.agent_name] = reason
            else:
                previous = self.peers.pop(reg.agent_name, None)
                old_link = previous.link if previous is not None else None
                staging = None
                if reg.staging is not None:
                    r = reg.staging.region
                    staging = RemoteStaging(r.ptr, reg.staging.slot_bytes, r.device, r.mem_kind)
                self.peers[reg.agent_name] = DecodePeer(reg.agent_name, link, reg, endpoint, staging=staging)
                self.refused.pop(reg.agent_name, None)
        if old_link is not None:
            mgr.engine_unlink(old_link)
        if reason:
            logger.error("sgl-nixl: refused decode %s at %s:%s: %s", reg.agent_name, *endpoint, reason)
        else:
            logger.info(
                "sgl-nixl: decode %s (tp %d/%d) at %s:%s connected",
                reg.agent_name, reg.tp_rank, reg.tp_size, *endpoint,
            )
        mgr.send_to(
            endpoint,
            RegistrationReply(
                reg.agent_name, mgr.prefill_rank_id, not reason, reason, mgr.local_ip, mgr.rank_port
            ),
        )

    def _drop_peer_locked(self, peer: DecodePeer, why: str) -> None:
        self.peers.pop(peer.agent, None)
        self.mgr.engine_unlink(peer.link)
        self.mgr.fail_rooms_of_peer(peer.agent, f"decode {peer.agent} at {peer.endpoint[0]}:{peer.endpoint[1]}: {why}")

    def drop_peer(self, agent: str, why: str) -> None:
        with self.lock:
            peer = self.peers.get(agent)
            if peer is not None:
                self._drop_peer_locked(peer, why)

    # -- per-request metadata -------------------------------------------------------------
    def on_request(self, req: TransferRequest, kv: np.ndarray | None, state: list[np.ndarray]) -> None:
        mgr = self.mgr
        room, target = req.room, (req.ip, req.port)
        with self.lock:
            peer = self.peers.get(req.agent_name)
            refused = self.refused.get(req.agent_name)
        if peer is None:
            reason = refused or (
                f"prefill has no registration from decode agent {req.agent_name} "
                "(it restarted or was dropped); it re-registers on its next request"
            )
            mgr.send_to(target, TransferStatus(room, FAILED, mgr.prefill_rank_id, reason))
            self._fail_locally(room, reason)
            if refused is None:
                mgr.send_to(
                    target,
                    RegistrationReply(
                        req.agent_name, mgr.prefill_rank_id, False, reason,
                        mgr.local_ip, mgr.rank_port, retry=True,
                    ),
                )
            return
        peer.last_seen = time.monotonic()
        kv = np.empty(0, np.int32) if kv is None else kv
        problem = None
        if not req.is_dummy:
            kv_group = peer.link.groups.get("kv")
            problem = validate_items(kv, kv_group.remote_items if kv_group else 0, "destination page")
            aux_group = peer.link.groups.get("aux")
            if problem is None and req.aux_index >= 0 and aux_group is not None:
                problem = validate_items(np.array([req.aux_index]), aux_group.remote_items, "aux row")
            for i, s in enumerate(state):
                g = peer.link.groups.get(f"state{i}")
                if problem is None and len(s):
                    problem = validate_items(s, g.remote_items if g else 0, f"state[{i}]")
        if problem is not None:
            mgr.codec.rejections.reject("index_out_of_range", f"room {room}: {problem}", req.agent_name)
            # Only the sender of the bad request is told: a forged request must not be able
            # to fail a room that its real decode is about to claim.
            mgr.send_to(target, TransferStatus(room, FAILED, mgr.prefill_rank_id, problem))
            return
        infos = mgr.transfer_infos.setdefault(room, {})
        if req.agent_name in infos:
            mgr.codec.rejections.reject("duplicate_request", f"room {room}", req.agent_name)
            return
        infos[req.agent_name] = TransferInfo(
            room=room,
            agent=req.agent_name,
            endpoint=req.ip,
            dst_port=req.port,
            dst_pages=kv,
            aux_index=req.aux_index,
            state=list(state),
            required_dst_info_num=req.required_dst_info_num,
            is_dummy=req.is_dummy,
        )
        mgr.room_seen[room] = time.monotonic()
        if req.staging_slots and not req.is_dummy:
            mgr.remote_free.setdefault(room, {})[req.agent_name] = SlotCredits(req.staging_slots)
        if req.decode_prefix_len:
            mgr.req_to_decode_prefix_len[room] = req.decode_prefix_len
        if len(infos) >= req.required_dst_info_num:
            mgr.update_status(room, WAITING_FOR_INPUT)

    def _fail_locally(self, room: int, reason: str) -> None:
        """Fail this side's sender too, so it doesn't sit until the bootstrap timeout."""
        mgr = self.mgr
        if mgr.request_status.get(room) not in (None, SUCCESS, FAILED):
            mgr.record_failure(room, reason)
            mgr.update_status(room, FAILED)

    # -- aborts ---------------------------------------------------------------------------
    def on_abort(self, msg: Abort) -> None:
        mgr = self.mgr
        room = msg.room
        if room in mgr.request_status and mgr.request_status[room] != SUCCESS:
            mgr.record_failure(room, "Aborted by the decode side")
            mgr.update_status(room, FAILED)
        if msg.generation is not None and msg.ip:
            mgr.ack_abort_when_drained(room, msg.ip, msg.port, msg.generation)


class TransferWorker:
    """Submits chunks without blocking and completes every transfer it has in flight."""

    IDLE_WAIT_S = 1.0
    MIN_BACKOFF_S = 20e-6
    MAX_BACKOFF_S = 1e-3

    def __init__(self, mgr: NixlPluginKVManager, index: int) -> None:
        self.mgr = mgr
        self.queue: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        self.rooms: dict[int, RoomProgress] = {}
        self._backoff = self.MIN_BACKOFF_S
        self._stop = threading.Event()
        self._last_sweep = time.monotonic()
        self.thread = threading.Thread(
            target=self._run, name=f"sgl-nixl-xfer-{index}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.queue.put(None)

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = any(p.busy for p in self.rooms.values())
            try:
                chunk = self.queue.get(timeout=self._backoff if busy else self.IDLE_WAIT_S)
            except queue.Empty:
                chunk = None
            try:
                while chunk is not None:
                    self._backoff = self.MIN_BACKOFF_S
                    self._submit(chunk)
                    chunk = self.queue.get_nowait() if not self.queue.empty() else None
                if self._poll() == 0 and busy:
                    self._backoff = min(self._backoff * 2, self.MAX_BACKOFF_S)
                else:
                    self._backoff = self.MIN_BACKOFF_S
                self._sweep()
            except Exception:
                logger.exception("sgl-nixl: transfer worker error; it goes on")

    # -- submission ----------------------------------------------------------------------
    def _submit(self, chunk: Chunk) -> None:
        # Count this submission as outstanding *before* reading the room's status: an abort
        # marks the room Failed, then acks once nothing is outstanding, so either it sees
        # this reservation (and its ack waits for the WRITEs posted here) or we see Failed.
        mgr, room = self.mgr, chunk.room
        mgr._staging_outstanding[room] += 1
        try:
            self._submit_reserved(chunk)
        finally:
            mgr.transfer_settled(room)

    def _submit_reserved(self, chunk: Chunk) -> None:
        mgr, room = self.mgr, chunk.room
        prog = self.rooms.setdefault(room, RoomProgress())
        prog.last_seen = prog.last_seen or chunk.is_last
        status = mgr.request_status.get(room)
        if prog.failed or status is None or status == FAILED:
            prog.failed = True
            self._maybe_finish(room)
            return
        for ev in chunk.events:
            ev.synchronize()  # the forward pass must have written these pages
        infos = mgr.transfer_infos.get(room) or {}
        if not infos:
            self._fail(room, "no decode destination was received for this room")
            return
        try:
            for info in list(infos.values()):
                if not info.is_dummy:
                    self._submit_to(prog, chunk, info)
        except (TransferError, ValueError) as exc:
            self._fail(room, str(exc))
            return
        self._maybe_finish(room)

    def _submit_to(self, prog: RoomProgress, chunk: Chunk, info: TransferInfo) -> None:
        mgr = self.mgr
        peer = mgr.control.peers.get(info.agent)
        if peer is None:
            raise TransferError(f"decode {info.agent} is no longer connected")
        dst = info.dst_pages[chunk.index_slice]
        if len(dst) != len(chunk.pages):
            raise TransferError(
                f"decode {info.agent} gave {len(info.dst_pages)} pages, prefill sends "
                f"{chunk.index_slice.stop} (chunk {chunk.index_slice.start}:"
                f"{chunk.index_slice.stop}): page counts disagree"
            )
        engine, link = mgr.engine, peer.link
        xfers = []
        job = self._staged(prog, chunk, info, peer, dst)
        if job is not None:
            prog.jobs.append(job)
            prog.path = "staging"
        else:
            xfers.append(engine.write(link, "kv", chunk.pages, dst))
        if chunk.is_last:
            if chunk.aux_index is not None and info.aux_index >= 0:
                xfers.append(
                    engine.write(link, "aux", np.array([chunk.aux_index]), np.array([info.aux_index]))
                )
            for i, (src, dst_state) in enumerate(zip(chunk.state or [], info.state, strict=False)):
                if src is None or not len(dst_state):
                    continue
                src = np.asarray(src, dtype=np.int64).ravel()
                if len(src) != len(dst_state):
                    raise TransferError(
                        f"state[{i}]: prefill has {len(src)} indices, decode {len(dst_state)}"
                    )
                xfers.append(engine.write(link, f"state{i}", src, dst_state))
        prog.peers.add(info.agent)
        for x in xfers:
            if x is None:
                continue
            prog.xfers.append(x)
            prog.nbytes += x.nbytes
            prog.descriptors += x.descriptors
            mgr._staging_outstanding[chunk.room] += 1

    def _staged(
        self, prog: RoomProgress, chunk: Chunk, info: TransferInfo, peer: DecodePeer, dst: np.ndarray
    ) -> StagedJob | None:
        """A staged job for this chunk if the rule in ``choose_path`` prefers it, else None."""
        mgr = self.mgr
        g = peer.link.groups.get("kv")
        credits = mgr.remote_free.get(chunk.room, {}).get(info.agent)
        staging = mgr.staging
        unit_len = staging_unit_len(mgr.engine.memory.kv, g.geometry) if g else None
        possible = bool(
            g and staging is not None and peer.staging is not None and credits is not None
            and unit_len and len(chunk.pages)
        )
        n = len(chunk.pages)
        path = choose_path(
            mode=mgr.settings.transfer_path,
            descriptors=0 if not g else expected_descriptors(chunk.pages, dst, g.num_regions, g.geometry),
            nbytes=0 if not g else g.unit_bytes * n,
            mem_kind=mgr.kv_mem_kind,
            slot_bytes=staging.slot_bytes if staging is not None else 1,
            staging_possible=possible,
        )
        if path != "staging":
            return None
        geo = g.geometry
        units = unit_indices_of(chunk.pages, geo)
        send = StagedSend(
            agent=mgr.engine.agent,
            copier=mgr.copier,
            local=staging,
            remote=peer.staging,
            peer=peer.link.name,
            src_bases=np.asarray(mgr.engine.memory.kv.ptrs, dtype=np.uint64)[: g.num_regions],
            units=units,
            geometry=geo,
            pieces=plan_pieces(g.num_regions, len(units), unit_len, min(staging.slot_bytes, peer.staging.slot_bytes)),
            remote_free=credits,
            stream=mgr.copy_stream,
            drain_timeout_s=mgr.settings.abort_drain_timeout_s,
        )
        return StagedJob(send, info, peer, chunk.index_slice.start, n)

    def _step_jobs(self, room: int, prog: RoomProgress) -> int:
        """Advance the room's staged jobs; tell decodes about landed pieces.

        Staged WRITEs count as outstanding like direct ones (an abort is acked only once
        they ended), reserved before the status check as in ``_submit``; a landed piece
        settles only after its PieceReady went out, so the ack can't overtake it.
        """
        mgr = self.mgr
        mgr._staging_outstanding[room] += 1
        try:
            return self._step_jobs_reserved(room, prog)
        finally:
            mgr.transfer_settled(room)

    def _step_jobs_reserved(self, room: int, prog: RoomProgress) -> int:
        mgr, settled = self.mgr, 0
        if not prog.failed and mgr.request_status.get(room) in (None, FAILED):
            prog.failed = True  # aborted or cleared: stop sending, let WRITEs drain
        if prog.failed:
            for job in prog.jobs:
                job.send.abandon("room ended")
        for job in prog.jobs:
            if job.send.finished and not job.send.in_flight:
                continue
            posted, ended = job.send.posted, job.send.settled
            landed = job.send.step()
            if job.send.posted > posted:
                mgr._staging_outstanding[room] += job.send.posted - posted
            for piece, slot in landed:
                settled += 1
                geo = job.send.geometry
                mgr.send_to(
                    job.peer.endpoint,
                    PieceReady(
                        room=room, prefill_rank=mgr.prefill_rank_id, ip=mgr.local_ip,
                        port=mgr.rank_port, slot=slot, r0=piece.r0, r1=piece.r1,
                        j0=piece.j0, j1=piece.j1, page_start=job.page_start,
                        page_count=job.page_count, unit_len=piece.unit_len,
                        units_per_item=geo.units_per_item,
                        dst_stride=geo.dst_stride or piece.unit_len, dst_offset=geo.dst_offset,
                    ),
                )
            for _ in range(job.send.settled - ended):
                mgr.transfer_settled(room)
            if job.send.error and not prog.failed:
                job.send.abandon()
                self._fail(room, f"staged transfer to {job.info.agent} failed: {job.send.error}", finish=False)
        if prog.jobs and not any(j.send.in_flight or not j.send.finished for j in prog.jobs):
            prog.nbytes += sum(j.send.nbytes for j in prog.jobs)
            prog.descriptors += sum(j.send.done_pieces for j in prog.jobs)
            prog.jobs = []
        return settled

    # -- completion ----------------------------------------------------------------------
    def _poll(self) -> int:
        """Poll every transfer in flight; returns how many settled."""
        settled = 0
        for room in list(self.rooms):
            prog = self.rooms[room]
            if prog.jobs:
                settled += self._step_jobs(room, prog)
            if not prog.xfers:
                self._maybe_finish(room)
                continue
            remaining = []
            stuck_after = self.mgr.settings.abort_drain_timeout_s
            for x in prog.xfers:
                state = self.mgr.engine.poll(x)
                if state == "PROC" and prog.failed and time.perf_counter() - x.started > stuck_after:
                    self.mgr.engine.agent.abandon(x)  # its peer is gone: it will never settle
                    self.mgr.transfer_settled(room)
                    settled += 1
                    continue
                if state == "PROC":
                    remaining.append(x)
                    continue
                settled += 1
                if state == "DONE" and (t := self.mgr.engine.agent.telemetry(x)):
                    metrics.telemetry(t)
                self.mgr.engine.release(x)
                self.mgr.transfer_settled(room)
                if state == "ERR" and not prog.failed:
                    self._fail(room, x.error, finish=False)
            prog.xfers = remaining
            self._maybe_finish(room)
        return settled

    def _fail(self, room: int, reason: str, finish: bool = True) -> None:
        prog = self.rooms.setdefault(room, RoomProgress())
        for job in prog.jobs:
            job.send.abandon(reason)
        if not prog.failed:
            prog.failed = True
            logger.error("sgl-nixl: room %s failed: %s", room, reason)
            self.mgr.conclude_failure(bootstrap_room=room, failure_reason=reason)
            self.mgr.observe(room, prog, ok=False, reason=reason)
        if finish:
            self._maybe_finish(room)

    def _maybe_finish(self, room: int) -> None:
        prog = self.rooms.get(room)
        if prog is None or prog.busy:
            return
        if prog.failed or room not in self.mgr.request_status:
            del self.rooms[room]
            self.mgr.remote_free.pop(room, None)
            return
        if prog.last_seen:
            del self.rooms[room]
            self.mgr.remote_free.pop(room, None)
            self.mgr.observe(room, prog, ok=True)
            self.mgr.conclude_transfer(bootstrap_room=room, status=SUCCESS)

    def _sweep(self) -> None:
        """Forget rooms whose sender went away between chunks (nothing in flight)."""
        now = time.monotonic()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for room in [r for r, p in self.rooms.items() if not p.busy]:
            status = self.mgr.request_status.get(room)
            if status is None or status == FAILED:
                del self.rooms[room]
