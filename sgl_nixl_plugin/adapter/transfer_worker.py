"""Prefill transfer workers: the scheduler's ``send()`` only enqueues a chunk (O(1)).

A worker submits each chunk's WRITEs (direct or staged) without waiting and polls every
transfer it has in flight with backoff, so many rooms bound for the same decode move at once.
Rooms are sharded across workers by room id, so one room's chunks stay in order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.adapter.prefill_state import (
    FAILED,
    SUCCESS,
    Chunk,
    DecodePeer,
    RoomProgress,
    SlotCredits,
    StagedJob,
    TransferInfo,
)
from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.descriptors import expected_descriptors
from sgl_nixl_plugin.engine.staging import (
    StagedSend,
    choose_path,
    plan_request,
    staging_unit_len,
    unit_indices_of,
)
from sgl_nixl_plugin.wire.messages import (
    PieceReady,
    SlotAsk,
    SlotReturn,
)

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)


_WAKE = object()  # queued by the control thread when a receiver credit arrives


def _issue(credits: object, slot: int) -> int:
    """The piece sequence number the decode must echo in its PieceDone (0: untracked)."""
    return credits.issue(slot) if isinstance(credits, SlotCredits) else 0


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


class TransferWorker:
    """Submits chunks without blocking and completes every transfer it has in flight."""

    IDLE_WAIT_S = 1.0
    MIN_BACKOFF_S = 20e-6
    MAX_BACKOFF_S = 1e-3

    def __init__(self, mgr: NixlPluginKVManager, index: int) -> None:
        self.mgr = mgr
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.rooms: dict[int, RoomProgress] = {}
        self._backoff = self.MIN_BACKOFF_S
        self._stop = threading.Event()
        self._last_sweep = time.monotonic()
        # (room, decode agent): that decode asked for the room's slots back; a recall stands
        # until its slots are returned or the room ends
        self._recalls: set[tuple[int, str]] = set()
        self._recall_lock = threading.Lock()
        self.thread = threading.Thread(
            target=self._run, name=f"sgl-nixl-xfer-{index}", daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.queue.put(None)

    def wake(self) -> None:
        """A receiver slot came back for one of our rooms: step its staged job now."""
        self.queue.put(_WAKE)

    def recall(self, room: int, agent: str) -> None:
        """Decode ``agent`` asks for ``room``'s idle slots (SlotRecall): handled on this
        thread, the only one that starts staged jobs, so a slot is never returned while a
        job is about to write it."""
        with self._recall_lock:
            self._recalls.add((room, agent))
        self.queue.put(_WAKE)

    def _run(self) -> None:
        if self.mgr.copier is not None:
            self.mgr.copier.bind(self.mgr.copy_stream)  # this thread gathers on that stream
        while not self._stop.is_set():
            busy = any(p.busy for p in self.rooms.values())
            try:
                chunk = self.queue.get(timeout=self._backoff if busy else self.IDLE_WAIT_S)
            except queue.Empty:
                chunk = None
            try:
                while chunk is not None:
                    self._backoff = self.MIN_BACKOFF_S
                    if chunk is not _WAKE:
                        self._submit(chunk)
                    chunk = self.queue.get_nowait() if not self.queue.empty() else None
                staged = any(j.send.needs_polling for p in self.rooms.values() for j in p.jobs)
                if self._poll() == 0 and busy and not staged:
                    # staged pieces move in ~0.1 ms steps (gather done, WRITE done, slot
                    # freed): keep the shortest wait while any is in flight
                    self._backoff = min(self._backoff * 2, self.MAX_BACKOFF_S)
                else:
                    self._backoff = self.MIN_BACKOFF_S
                if self._recalls:
                    self._serve_recalls()
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
        except Exception as exc:  # a bug must fail the room, never let it end as Success
            logger.exception("sgl-nixl: room %s: submitting a chunk failed", room)
            self._fail(room, f"internal error while submitting a chunk: {exc!r}")
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
        slot = min(staging.slot_bytes, peer.staging.slot_bytes) if staging and peer.staging else 0
        possible = bool(
            g and credits is not None and unit_len and unit_len <= slot and len(chunk.pages)
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
        if credits.returnable:
            self._ask_slots(chunk.room, info, credits)
        same_device = bool(staging.device_uuid) and staging.device_uuid == peer.staging.device_uuid
        if same_device:
            _hint_mps(chunk.room)
        send = StagedSend(
            agent=mgr.engine.agent,
            copier=mgr.copier,
            local=staging,
            remote=peer.staging,
            peer=peer.link.name,
            src_bases=np.asarray(mgr.engine.memory.kv.ptrs, dtype=np.uint64)[: g.num_regions],
            units=units,
            geometry=geo,
            pieces=plan_request(
                g.num_regions, len(units), unit_len, slot, mgr.kv_mem_kind, same_device
            ),
            remote_free=credits,
            receiver_slots=credits.held,
            stream=mgr.copy_stream,
            drain_timeout_s=mgr.settings.abort_drain_timeout_s,
        )
        return StagedJob(send, info, peer, chunk.index_slice.start, n, chunk.pages, dst)

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
        for job in list(prog.jobs):
            if job.send.finished and not job.send.in_flight:
                continue
            if self._slot_wait_over(job) and not prog.failed:
                self._go_direct(room, prog, job)
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
                        seq=_issue(job.send.remote_free, slot),
                    ),
                )
            for _ in range(job.send.settled - ended):
                mgr.transfer_settled(room)
            if job.send.error and not prog.failed:
                job.send.abandon()
                self._fail(room, f"staged transfer to {job.info.agent} failed: {job.send.error}", finish=False)
        if prog.jobs and not any(j.send.in_flight or not j.send.finished for j in prog.jobs):
            broken = next((j for j in prog.jobs if j.send.error and not j.fell_back), None)
            if broken is not None and not prog.failed:
                # never conclude Success for a chunk whose pieces did not all land
                self._fail(room, f"staged transfer to {broken.info.agent} failed: "
                           f"{broken.send.error}", finish=False)
            prog.nbytes += sum(j.send.nbytes for j in prog.jobs)
            prog.descriptors += sum(j.send.done_pieces for j in prog.jobs)
            prog.jobs = []
        return settled

    def _slot_wait_over(self, job: StagedJob) -> bool:
        """Nothing posted yet and no receiver slot came within ``slot_wait_s``."""
        s = job.send
        return (
            s.posted == 0 and not s.remote_free and not s.error
            and time.monotonic() - job.created > self.mgr.settings.slot_wait_s
        )

    def _go_direct(self, room: int, prog: RoomProgress, job: StagedJob) -> None:
        """The decode's staging stayed busy: send this chunk with direct descriptors."""
        mgr = self.mgr
        job.fell_back = True
        mgr.staged_fallbacks += 1
        job.send.abandon("no receiver staging slot")  # gives back gathered local slots
        prog.jobs = [j for j in prog.jobs if j is not job]
        logger.info(
            "sgl-nixl: room %s: no staging slot from decode %s within %.1fs; chunk goes direct",
            room, job.info.agent, mgr.settings.slot_wait_s,
        )
        try:
            x = mgr.engine.write(job.peer.link, "kv", job.src_pages, job.dst_pages)
        except (TransferError, ValueError) as exc:
            self._fail(room, str(exc), finish=False)
            return
        if x is not None:
            prog.xfers.append(x)
            prog.nbytes += x.nbytes
            prog.descriptors += x.descriptors
            mgr._staging_outstanding[room] += 1

    # -- receiver slots ------------------------------------------------------------------
    def _ask_slots(self, room: int, info: TransferInfo, credits: SlotCredits) -> None:
        """A staged chunk found no receiver slot: join the decode's queue (once until
        granted). To decodes that take slots back this is the first ask of the room."""
        if credits or credits.granted or credits.asked:  # free, in use by a chunk, or asked
            return
        credits.asked = True
        mgr = self.mgr
        mgr.send_to((info.endpoint, info.dst_port),
                    SlotAsk(room, mgr.engine.name, mgr.local_ip, mgr.rank_port))

    def _return_slots(self, room: int) -> None:
        """Give every decode of ``room`` that takes slots back the ones no chunk uses (all
        pieces written there were scattered): between chunks."""
        for agent, credits in list(self.mgr.remote_free.get(room, {}).items()):
            if credits.returnable:
                self._give_back(room, agent, credits)

    def _give_back(self, room: int, agent: str, credits: SlotCredits) -> bool:
        """Return ``credits`` to decode ``agent`` if every slot is free; whether it did."""
        mgr = self.mgr
        info = (mgr.transfer_infos.get(room) or {}).get(agent)
        slots = credits.take_all() if info is not None else []
        if slots:
            mgr.send_to((info.endpoint, info.dst_port),
                        SlotReturn(room, mgr.engine.name, mgr.local_ip, mgr.rank_port, slots))
        return bool(slots)

    def _serve_recalls(self) -> None:
        """A recall means a ready room waits for slots on that decode. Its slots go back
        once no unfinished chunk of the room writes there, also after the room's last
        chunk: with several decode ranks, one that granted room B before room A would
        otherwise hold A's last chunk while A holds B's slots on another rank, until
        ``SLOT_WAIT``. A recall stands until served or the room ends (pieces in flight
        when it arrives are usually scattered a moment later)."""
        with self._recall_lock:
            recalls = set(self._recalls)
        served = set()
        for room, agent in recalls:
            prog = self.rooms.get(room)
            credits = self.mgr.remote_free.get(room, {}).get(agent)
            if credits is None or not credits.granted or (prog is not None and prog.failed):
                served.add((room, agent))  # ended, nothing held, or failing: nothing to do
                continue
            if prog is not None and any(
                j.info.agent == agent and (j.send.in_flight or not j.send.finished) for j in prog.jobs
            ):
                continue  # a chunk writes there now: once it is done
            if self._give_back(room, agent, credits):
                served.add((room, agent))
        with self._recall_lock:
            self._recalls -= served

    # -- completion ----------------------------------------------------------------------
    def _poll(self) -> int:
        """Poll every transfer in flight; returns how many settled."""
        settled = 0
        for room in list(self.rooms):
            prog = self.rooms[room]
            if prog.jobs:
                try:
                    settled += self._step_jobs(room, prog)
                except Exception as exc:  # as in _submit: fail the room, keep the worker
                    logger.exception("sgl-nixl: room %s: staged transfer step failed", room)
                    self._fail(room, f"internal error in a staged transfer: {exc!r}", finish=False)
            if not (prog.jobs or prog.failed or prog.last_seen):
                self._return_slots(room)  # between chunks: let other rooms use them
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
