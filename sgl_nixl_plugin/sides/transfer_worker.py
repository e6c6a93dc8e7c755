"""Prefill transfer workers: the scheduler's ``send()`` only enqueues a chunk (O(1)).

A worker submits each chunk's WRITEs (direct or staged) without waiting and polls every
transfer it has in flight with backoff, so many rooms bound for the same decode move at once.
Rooms are sharded across workers by room id, so one room's chunks stay in order; the worker
that owns a room is the only thread that changes its record's transfers, and the one that
closes it (``PrefillRooms.close``) once nothing is in flight.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.descriptors import expected_descriptors
from sgl_nixl_plugin.engine.one_pass import KernelXfer
from sgl_nixl_plugin.engine.staging import (
    StagedSend,
    choose_path,
    plan_request,
    staging_unit_len,
    unit_indices_of,
)
from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.protocol.prefill_rooms import (
    TERMINAL,
    Chunk,
    PrefillPhase,
    PrefillRoom,
    TransferInfo,
)
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.wire.messages import PieceReady, SlotAsk, SlotReturn

logger = logging.getLogger(__name__)


_WAKE = object()  # queued by the control thread when a receiver credit arrives
_MPS_HINTED = threading.Event()


def mps_server_seen() -> bool:
    """Whether an MPS server looks present (its pipe directory exists): a heuristic."""
    return os.path.isdir(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")


def _hint_mps(room: int) -> None:
    """Once per process: prefill and decode share this GPU. Without MPS their copies take
    turns on it; under one MPS server they overlap (measured ~1.25x faster staged transfers
    on an H200, docs/benchmarks.md)."""
    if _MPS_HINTED.is_set():
        return
    _MPS_HINTED.set()
    if not mps_server_seen():
        logger.info(
            "sgl-nixl: room %s: the decode shares this GPU; staged transfers run ~1.25x faster "
            "when both servers are clients of one MPS server (nvidia-cuda-mps-control -d)",
            room,
        )


@dataclass(eq=False)  # identity: holds arrays and live state
class StagedJob:
    """One chunk's staged transfer to one decode rank, and what the decode must be told."""

    send: StagedSend
    info: TransferInfo
    peer: DecodePeer
    page_start: int  # the first destination item's position in the request
    page_count: int
    src_pages: np.ndarray  # for the direct fallback when no receiver slot comes in time
    dst_pages: np.ndarray
    by_token: bool = False  # items are token rows (the sides' pages differ)
    created: float = field(default_factory=time.monotonic)
    slot_at: float | None = None  # when the decode's first staging slot was there
    fell_back: bool = False  # sent direct instead (no receiver slot in time)


class TransferWorker:
    """Submits chunks without blocking and completes every transfer it has in flight."""

    IDLE_WAIT_S = 1.0
    MIN_BACKOFF_S = 20e-6
    MAX_BACKOFF_S = 1e-3

    def __init__(self, ctx: PrefillContext, index: int) -> None:
        self.ctx = ctx
        # queue.Queue, not SimpleQueue: CPython 3.7-3.12's SimpleQueue.get(timeout) waits
        # forever once its deadline passes inside its wait loop (a preempted worker slept
        # until the next put while its room waited to post)
        self.queue: queue.Queue[Any] = queue.Queue()
        self.active: dict[int, PrefillRoom] = {}  # the rooms this worker claimed
        self.kernels = 0  # one-pass copies in flight (each ends in ~1 ms: poll at once)
        self._backoff = self.MIN_BACKOFF_S
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"sgl-nixl-xfer-{index}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.queue.put(None)

    def wake(self) -> None:
        """A receiver slot came for one of our rooms: step its jobs now."""
        self.queue.put(_WAKE)

    def recall(self, room: int) -> None:
        """A decode wants ``room``'s idle slots back (the room may have no chunk yet):
        served on this thread, the only one that starts staged jobs, so a slot is never
        returned while a job is about to write it."""
        self.queue.put(room)

    def _run(self) -> None:
        if self.ctx.copier is not None:
            self.ctx.copier.bind(self.ctx.copy_stream)  # this thread gathers on that stream
        while not self._stop.is_set():
            busy = any(r.busy for r in self.active.values())
            try:
                chunk = self.queue.get(timeout=self._backoff if busy else self.IDLE_WAIT_S)
            except queue.Empty:
                chunk = None
            try:
                while chunk is not None:
                    self._backoff = self.MIN_BACKOFF_S
                    if isinstance(chunk, int):
                        rec = self.active.get(chunk) or self.ctx.rooms.get(chunk)
                        if rec is not None:
                            self._serve_recalls(rec)
                    elif chunk is not _WAKE:
                        self._submit(chunk)
                    chunk = self.queue.get_nowait() if not self.queue.empty() else None
                quick = self.kernels > 0 or any(
                    j.send.needs_polling for r in self.active.values() for j in r.jobs
                )
                if self._poll() == 0 and busy and not quick:
                    # staged pieces move in ~0.1 ms steps (gather done, WRITE done, slot
                    # freed): keep the shortest wait while any is in flight
                    self._backoff = min(self._backoff * 2, self.MAX_BACKOFF_S)
                else:
                    self._backoff = self.MIN_BACKOFF_S
            except Exception:
                logger.exception("sgl-nixl: transfer worker error; it goes on")

    # -- submission ----------------------------------------------------------------------
    def _submit(self, chunk: Chunk) -> None:
        # Count this submission as outstanding *before* reading the room's status: an abort
        # marks the room Failed, then acks once nothing is outstanding, so either it sees
        # this reservation (and its ack waits for the WRITEs posted here) or we see Failed.
        sg, room = self.ctx.sglang, chunk.room
        sg.begin_transfer(room)
        try:
            self._submit_reserved(chunk)
        except Exception as exc:  # a bug must fail the room, never let it end as Success
            logger.exception("sgl-nixl: room %s: submitting a chunk failed", room)
            rec = self.active.get(room) or self.active.setdefault(room, self.ctx.rooms.claim(room))
            self._fail(rec, f"internal error while submitting a chunk: {exc!r}")
        finally:
            sg.end_transfer(room)

    def _submit_reserved(self, chunk: Chunk) -> None:
        sg, room = self.ctx.sglang, chunk.room
        rec = self.active.get(room)
        if rec is None:
            rec = self.active[room] = self.ctx.rooms.claim(room)
        rec.last_chunk_seen = rec.last_chunk_seen or chunk.is_last
        rec.chunks += 1
        if chunk.is_last:
            rec.last_chunk_at = time.perf_counter()
        if rec.stopping or sg.is_failed_or_gone(room):
            rec.fail(rec.reason or "room ended")
            self._maybe_finish(rec)
            return
        for ev in chunk.events:
            ev.synchronize()  # the forward pass must have written these pages
        infos = sg.destinations(room)
        if not infos:
            self._fail(rec, "no decode destination was received for this room")
            return
        try:
            for info in list(infos.values()):
                if not info.is_dummy:
                    self._submit_to(rec, chunk, info)
        except (TransferError, ValueError) as exc:
            self._fail(rec, str(exc))
            return
        self._maybe_finish(rec)

    def _submit_to(self, rec: PrefillRoom, chunk: Chunk, info: TransferInfo) -> None:
        ctx = self.ctx
        peer = ctx.peers.get(info.agent)
        if peer is None:
            raise TransferError(f"decode {info.agent} is no longer connected")
        engine, link = ctx.engine, peer.link
        group = f"{info.groups}kv"
        g = link.groups.get(group)
        src, dst, first = chunk.pages, info.dst_pages[chunk.index_slice], chunk.index_slice.start
        if g is not None:
            try:
                src, dst, first = g.items_of(
                    chunk.pages, info.dst_pages, chunk.index_slice, chunk.tokens
                )
            except TransferError as exc:
                raise TransferError(f"decode {info.agent} {exc}") from exc
        # each transfer is tracked as soon as it is posted: should a later post raise,
        # the room still waits for (and releases) what is in flight
        rec.peers.add(info.agent)
        if self._takes_one_pass(info, peer, src):
            self._track(rec, self._one_pass(rec, info, peer, src, dst))
            rec.path = "ipc"
        else:
            if len(src):
                rec.not_one_pass.add(info.agent)  # no completion flag: the status ends it
            job = self._staged(rec, info, peer, src, dst, first)
            if job is not None:
                rec.jobs.append(job)
                rec.path = "staging"
                self._step_jobs(rec)  # first gather now, ahead of the aux and state WRITEs
            else:
                self._track(rec, engine.write(link, group, src, dst))
        if chunk.is_last:
            self._post_tail(rec, chunk, info, link)
            op = link.one_pass
            if (
                info.done_flag >= 0
                and op is not None
                and op.flags is not None
                and info.agent not in rec.not_one_pass
            ):
                rec.flags_due[info.agent] = (op, info.done_flag, info.done_value)

    def _post_tail(self, rec: PrefillRoom, chunk: Chunk, info: TransferInfo, link: Any) -> None:
        """Post the room's aux row and state WRITEs (with its last chunk)."""
        engine = self.ctx.engine
        if chunk.aux_index is not None and info.aux_index >= 0:
            self._track(
                rec,
                engine.write(link, "aux", np.array([chunk.aux_index]), np.array([info.aux_index])),
            )
        for i, (src, dst_state) in enumerate(zip(chunk.state or [], info.state, strict=False)):
            if src is None or not len(dst_state):
                continue
            src = np.asarray(src, dtype=np.int64).ravel()
            if len(src) != len(dst_state):
                raise TransferError(
                    f"state[{i}]: prefill has {len(src)} indices, decode {len(dst_state)}"
                )
            self._track(rec, engine.write(link, f"{info.groups}state{i}", src, dst_state))

    def _track(self, rec: PrefillRoom, x: Any) -> None:
        if x is None:
            return
        rec.xfers.append(x)
        if isinstance(x, KernelXfer):
            self.kernels += 1
        rec.note_post()
        rec.nbytes += x.nbytes
        rec.descriptors += x.descriptors
        self.ctx.sglang.begin_transfer(rec.room)

    def _takes_one_pass(self, info: TransferInfo, peer: DecodePeer, src: np.ndarray) -> bool:
        """Whether the chunk goes by a one-pass copy: the link has one (mapped at
        registration where the settings allow it) and the destination is the decode's
        device pool."""
        return bool(
            peer.link.one_pass is not None
            and not info.groups
            and len(src)
            and self.ctx.copier is not None
        )

    def _one_pass(
        self,
        rec: PrefillRoom,
        info: TransferInfo,
        peer: DecodePeer,
        src: np.ndarray,
        dst: np.ndarray,
    ) -> KernelXfer:
        """Launch the chunk's one-pass copy into the decode's mapped pool."""
        ctx, op = self.ctx, peer.link.one_pass
        assert op is not None and ctx.copier is not None
        xfer = op.write(ctx.copier, src, dst, ctx.copy_stream)
        if not any(j.info.agent == info.agent for j in rec.jobs):
            self._give_back(rec, info.agent)  # granted with the request: not needed here
        return xfer

    def _staged(
        self,
        rec: PrefillRoom,
        info: TransferInfo,
        peer: DecodePeer,
        src: np.ndarray,
        dst: np.ndarray,
        first: int,
    ) -> StagedJob | None:
        """A staged job for this chunk's items (pages, or token rows across page sizes;
        ``first``: the first destination item's position in the request) if the rule in
        ``choose_path`` prefers it, else None."""
        ctx = self.ctx
        g = peer.link.groups.get("kv")
        credits = rec.credits.get(info.agent)
        staging = ctx.staging
        local = g.local_regions if g and g.local_regions else ctx.engine.memory.kv
        unit_len = staging_unit_len(local, g.geometry) if g else None
        slot = min(staging.slot_bytes, peer.staging.slot_bytes) if staging and peer.staging else 0
        possible = bool(g and credits is not None and unit_len and unit_len <= slot and len(src))
        n = len(src)
        mode = ctx.settings.transfer_path
        path = choose_path(
            mode=mode,
            # the estimate counts runs over every page: only the cost rule needs it
            descriptors=0
            if not g or mode in ("direct", "staging")
            else expected_descriptors(src, dst, g.num_regions, g.geometry),
            nbytes=0 if not g else g.unit_bytes * n,
            mem_kind=ctx.mem_kind,
            slot_bytes=staging.slot_bytes if staging is not None else 1,
            staging_possible=possible,
        )
        if path != "staging":
            return None
        assert g is not None and credits is not None and staging is not None and unit_len
        assert peer.staging is not None
        geo = g.geometry
        units = unit_indices_of(src, geo)
        self._ask_slots(rec.room, info, credits)
        same_device = bool(staging.device_uuid) and staging.device_uuid == peer.staging.device_uuid
        if same_device:
            _hint_mps(rec.room)
        send = StagedSend(
            agent=ctx.engine.agent,
            copier=ctx.copier,
            local=staging,
            remote=peer.staging,
            peer=peer.link.name,
            src_bases=np.asarray(ctx.engine.memory.kv.ptrs, dtype=np.uint64)[: g.num_regions],
            units=units,
            geometry=geo,
            pieces=plan_request(
                g.num_regions, len(units), unit_len, slot, ctx.mem_kind, same_device
            ),
            remote_free=credits,
            receiver_slots=credits.held,
            stream=ctx.copy_stream,
            drain_timeout_s=ctx.settings.abort_drain_timeout_s,
        )
        return StagedJob(send, info, peer, first, n, src, dst, by_token=g.by_token)

    def _step_jobs(self, rec: PrefillRoom) -> int:
        """Advance the room's staged jobs; tell decodes about landed pieces.

        Staged WRITEs count as outstanding like direct ones (an abort is acked only once
        they ended), reserved before the status check as in ``_submit``; a landed piece
        settles only after its PieceReady went out, so the ack can't overtake it.
        """
        sg = self.ctx.sglang
        sg.begin_transfer(rec.room)
        try:
            return self._step_jobs_reserved(rec)
        finally:
            sg.end_transfer(rec.room)

    def _step_jobs_reserved(self, rec: PrefillRoom) -> int:
        ctx, sg, room, settled = self.ctx, self.ctx.sglang, rec.room, 0
        if not rec.stopping and sg.is_failed_or_gone(room):
            rec.fail("room ended")  # aborted or cleared: stop sending, let WRITEs drain
        if rec.stopping:
            for job in rec.jobs:
                job.send.abandon("room ended")
        for job in list(rec.jobs):
            if job.send.finished and not job.send.in_flight:
                continue
            if self._slot_wait_over(job) and not rec.stopping:
                self._go_direct(rec, job)
                continue
            if job.slot_at is None and job.send.remote_free:
                job.slot_at = time.monotonic()
                rec.slot_wait_s += job.slot_at - job.created
            posted, ended = job.send.posted, job.send.settled
            landed = job.send.step()
            if job.send.posted > posted:
                rec.note_post()
                sg.begin_transfer(room, job.send.posted - posted)
            for piece, slot in landed:
                settled += 1
                geo = job.send.geometry
                me = ctx.me
                ctx.send(
                    job.peer.endpoint,
                    PieceReady(
                        room=room,
                        prefill_rank=me.rank,
                        ip=me.ip,
                        port=me.port,
                        slot=slot,
                        r0=piece.r0,
                        r1=piece.r1,
                        j0=piece.j0,
                        j1=piece.j1,
                        page_start=job.page_start,
                        page_count=job.page_count,
                        unit_len=piece.unit_len,
                        units_per_item=geo.units_per_item,
                        dst_stride=geo.dst_stride or piece.unit_len,
                        dst_offset=geo.dst_offset,
                        seq=job.send.remote_free.issue(slot),
                        by_token=job.by_token,
                    ),
                )
            for _ in range(job.send.settled - ended):
                sg.end_transfer(room)
            if job.send.error and not rec.stopping:
                job.send.abandon()
                self._fail(
                    rec,
                    f"staged transfer to {job.info.agent} failed: {job.send.error}",
                    finish=False,
                )
        if rec.jobs and not any(j.send.in_flight or not j.send.finished for j in rec.jobs):
            broken = next((j for j in rec.jobs if j.send.error and not j.fell_back), None)
            if broken is not None and not rec.stopping:
                # never conclude Success for a chunk whose pieces did not all land
                self._fail(
                    rec,
                    f"staged transfer to {broken.info.agent} failed: {broken.send.error}",
                    finish=False,
                )
            rec.nbytes += sum(j.send.nbytes for j in rec.jobs)
            rec.descriptors += sum(j.send.done_pieces for j in rec.jobs)
            rec.pieces += sum(j.send.done_pieces for j in rec.jobs)
            rec.jobs = []
        return settled

    def _slot_wait_over(self, job: StagedJob) -> bool:
        """Nothing posted yet and no receiver slot came within ``slot_wait_s``."""
        s = job.send
        return (
            s.posted == 0
            and not s.remote_free
            and not s.error
            and time.monotonic() - job.created > self.ctx.settings.slot_wait_s
        )

    def _go_direct(self, rec: PrefillRoom, job: StagedJob) -> None:
        """The decode's staging stayed busy: send this chunk with direct descriptors."""
        ctx = self.ctx
        job.fell_back = True
        ctx.fallbacks += 1
        job.send.abandon("no receiver staging slot")  # gives back gathered local slots
        rec.jobs = [j for j in rec.jobs if j is not job]
        logger.info(
            "sgl-nixl: room %s: no staging slot from decode %s within %.1fs; chunk goes direct",
            rec.room,
            job.info.agent,
            ctx.settings.slot_wait_s,
        )
        try:
            self._track(
                rec,
                ctx.engine.write(
                    job.peer.link, f"{job.info.groups}kv", job.src_pages, job.dst_pages
                ),
            )
        except (TransferError, ValueError) as exc:
            self._fail(rec, str(exc), finish=False)

    # -- receiver slots ------------------------------------------------------------------
    def _ask_slots(self, room: int, info: TransferInfo, credits: SlotCredits) -> None:
        """A staged chunk found no receiver slot: join the decode's queue (once until granted)."""
        if credits or credits.granted or credits.asked:  # free, in use by a chunk, or asked
            return
        credits.asked = True
        me = self.ctx.me
        self.ctx.send((info.endpoint, info.dst_port), SlotAsk(room, me.name, me.ip, me.port))

    def _give_back(self, rec: PrefillRoom, agent: str) -> bool:
        """Return ``agent``'s slots of the room if every one is free; whether it did."""
        credits = rec.credits.get(agent)
        info = self.ctx.sglang.destinations(rec.room).get(agent)
        slots = credits.take_all() if credits is not None and info is not None else []
        if slots:
            me = self.ctx.me
            self.ctx.send(
                (info.endpoint, info.dst_port), SlotReturn(rec.room, me.name, me.ip, me.port, slots)
            )
        return bool(slots)

    def _serve_recalls(self, rec: PrefillRoom) -> None:
        """A recall means a ready room waits for slots on that decode. Its slots go back
        once no unfinished chunk of the room writes there, also after the room's last
        chunk: with several decode ranks, one that granted room B before room A would
        otherwise hold A's last chunk while A holds B's slots on another rank, until
        ``SLOT_WAIT``. A recall stands until served or the room ends (pieces in flight
        when it arrives are usually scattered a moment later)."""
        for agent in list(rec.recalls):
            credits = rec.credits.get(agent)
            if credits is None or not credits.granted or rec.stopping:
                rec.recalls.discard(agent)  # ended, nothing held, or failing: nothing to do
                continue
            if any(
                j.info.agent == agent and (j.send.in_flight or not j.send.finished)
                for j in rec.jobs
            ):
                continue  # a chunk writes there now: once it is done
            if self._give_back(rec, agent):
                rec.recalls.discard(agent)

    # -- completion ----------------------------------------------------------------------
    def _poll(self) -> int:
        """Poll every transfer in flight; returns how many settled."""
        ctx, settled = self.ctx, 0
        for rec in list(self.active.values()):
            if not rec.stopping and ctx.sglang.is_failed_or_gone(rec.room):
                # failed by another thread (liveness, an abort) or cleared: stop here too,
                # so a WRITE stuck to a lost decode is given up after the drain bound below
                # instead of when (if ever) SGLang clears the sender
                rec.fail("room ended")
            if rec.jobs:
                try:
                    settled += self._step_jobs(rec)
                except Exception as exc:  # as in _submit: fail the room, keep the worker
                    logger.exception("sgl-nixl: room %s: staged transfer step failed", rec.room)
                    self._fail(rec, f"internal error in a staged transfer: {exc!r}", finish=False)
            if rec.recalls:
                self._serve_recalls(rec)
            if not (rec.jobs or rec.stopping or rec.last_chunk_seen):
                for agent in list(rec.credits):  # between chunks: let other rooms use them
                    self._give_back(rec, agent)
            if rec.xfers:
                remaining = []
                stuck_after = ctx.settings.abort_drain_timeout_s
                for x in rec.xfers:
                    state = ctx.engine.poll(x)
                    if (
                        state == "PROC"
                        and rec.stopping
                        and not isinstance(x, KernelXfer)  # a kernel ends; until then it writes
                        and time.perf_counter() - x.started > stuck_after
                    ):
                        ctx.engine.agent.abandon(x)  # its peer is gone: it will never settle
                        ctx.sglang.end_transfer(rec.room)
                        settled += 1
                        continue
                    if state == "PROC":
                        remaining.append(x)
                        continue
                    settled += 1
                    if isinstance(x, KernelXfer):
                        self.kernels -= 1
                    if state == "DONE" and (t := ctx.engine.agent.telemetry(x)):
                        metrics.telemetry(t)
                        rec.nixl_post_us += t["post_us"]
                        rec.nixl_xfer_us += t["xfer_us"]
                    ctx.engine.release(x)
                    ctx.sglang.end_transfer(rec.room)
                    if state == "ERR" and not rec.stopping:
                        self._fail(rec, x.error, finish=False)
                rec.xfers = remaining
            self._maybe_finish(rec)
        return settled

    def _fail(self, rec: PrefillRoom, reason: str, finish: bool = True) -> None:
        for job in rec.jobs:
            job.send.abandon(reason)
        if rec.fail(reason):
            logger.error("sgl-nixl: room %s failed: %s", rec.room, reason)
            self.ctx.sglang.conclude_failure(rec.room, reason)
            self.ctx.observe(rec, ok=False, reason=reason)
        if finish:
            self._maybe_finish(rec)

    def _store_flags(self, rec: PrefillRoom) -> None:
        """Once only the room's copies are in flight (its aux rows and state landed, no
        staged job), queue each one-pass decode's completion flag behind them on the copy
        stream. A room that stops first stores none: its status message ends it."""
        if rec.stopping or self.ctx.sglang.is_failed_or_gone(rec.room):
            rec.flags_due.clear()
            return
        if rec.jobs or any(not isinstance(x, KernelXfer) for x in rec.xfers):
            return
        due, rec.flags_due = rec.flags_due, {}
        for agent, (op, word, value) in due.items():
            try:
                self._track(rec, op.signal(word, value, self.ctx.copy_stream))
            except Exception as exc:  # the flag only saves time: the status still goes
                logger.warning(
                    "sgl-nixl: room %s: no completion flag for decode %s: %s", rec.room, agent, exc
                )

    def _maybe_finish(self, rec: PrefillRoom) -> None:
        """Close the room once nothing is in flight: failed, aborted, released or gone, or
        its last chunk landed (Success; never for a room SGLang already marked Failed)."""
        if rec.flags_due:
            self._store_flags(rec)
        if rec.busy:
            return
        sg, rooms = self.ctx.sglang, self.ctx.rooms
        if rec.stopping or sg.is_failed_or_gone(rec.room):  # failed, aborted or cleared
            self.active.pop(rec.room, None)
            rooms.close(rec, PrefillPhase.FAILED)
        elif rec.last_chunk_seen:
            self.active.pop(rec.room, None)
            if rec.phase in TERMINAL:
                return
            # the decode's status first, then bookkeeping; another thread may have failed
            # the room since the check above: then SGLang concluded (and sent) the failure
            ok = sg.conclude_success(rec.room)
            rooms.close(rec, PrefillPhase.SUCCEEDED if ok else PrefillPhase.FAILED)
            if ok:
                self.ctx.observe(rec, ok=True)
