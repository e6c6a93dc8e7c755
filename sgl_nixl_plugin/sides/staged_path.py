"""The staged path of a prefill transfer worker: gather a chunk into staging slots, WRITE
the pieces into the decode's receiver slots, tell it where each landed, and hand the
decode's slots back when another room waits for them.

Runs on the worker thread that owns the room (``TransferWorker``), the only thread that
starts staged jobs, so a slot is never returned while a job is about to write it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.descriptors import expected_descriptors
from sgl_nixl_plugin.engine.staging import (
    StagedSend,
    choose_path,
    plan_request,
    staging_unit_len,
    unit_indices_of,
)
from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.protocol.prefill_machine import Event, Failure, Posted, Settled
from sgl_nixl_plugin.protocol.prefill_rooms import PrefillRoom, TransferInfo
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.wire.messages import PieceReady, SlotAsk, SlotReturn

logger = logging.getLogger(__name__)

_MPS_HINTED = threading.Event()  # the MPS hint below: once per process


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


class StagedPath:
    """One worker's staged jobs and the decode's receiver slots they use.

    ``track`` and ``feed`` are the worker's: a chunk that falls back to direct descriptors
    is tracked like any WRITE, and what happens to a job (pieces posted and settled, the
    job ended, a failure) goes to the room's machine, whose effects the worker carries out.
    Each job counts as in flight from its creation (the worker's ``Posted``) to its end.
    """

    def __init__(
        self,
        ctx: PrefillContext,
        track: Callable[[PrefillRoom, Any], None],
        feed: Callable[[PrefillRoom, Event], None],
    ) -> None:
        self.ctx = ctx
        self._track = track
        self._feed = feed

    def job_for(
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
        theirs = peer.staging_slot_bytes  # its area may still be on its way: slots come after
        slot = min(staging.slot_bytes, theirs) if staging and theirs else 0
        possible = bool(g and credits is not None and unit_len and unit_len <= slot and len(src))
        n = len(src)
        mode = ctx.settings.transfer_path
        # the estimate counts runs over every page: only the cost rule needs it
        descriptors = (
            0
            if not g or mode in ("direct", "staging")
            else expected_descriptors(src, dst, g.num_regions, g.geometry)
        )
        nbytes = 0 if not g else g.unit_bytes * n
        path = choose_path(
            mode=mode,
            descriptors=descriptors,
            nbytes=nbytes,
            mem_kind=ctx.mem_kind,
            slot_bytes=staging.slot_bytes if staging is not None else 1,
            staging_possible=possible,
            area_pending=peer.staging is None,  # its slots come once it is allocated
        )
        if path != "staging":
            if peer.may_stage and unit_len and len(src):
                self._need_if_due(peer, unit_len, descriptors, nbytes)
            return None
        assert g is not None and credits is not None and staging is not None and unit_len
        geo = g.geometry
        units = unit_indices_of(src, geo)
        self._ask_slots(rec.room, info, credits)
        theirs_uuid = peer.staging.device_uuid if peer.staging is not None else ""
        same_device = bool(staging.device_uuid) and staging.device_uuid == theirs_uuid
        if same_device:
            _hint_mps(rec.room)
        send = StagedSend(
            agent=ctx.engine.agent,
            copier=ctx.copier,
            local=staging,
            remote=peer.staging,
            remote_of=lambda: peer.staging,
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

    def _need_if_due(self, peer: DecodePeer, unit_len: int, descriptors: int, nbytes: int) -> None:
        """``peer`` may take staged transfers but nothing is set up for it: if the rule
        would stage this chunk with both buffers there, have them set up (the chunk goes
        direct)."""
        ctx, memory = self.ctx, self.ctx.staging_memory
        if memory is None or memory.error or ctx.staging_need is None:
            return
        reg = peer.reg
        theirs = reg.staging.slot_bytes if reg.staging is not None else reg.staging_slot_bytes
        slot = min(memory.slot_bytes, theirs) if theirs else 0
        would = choose_path(
            mode=ctx.settings.transfer_path,
            descriptors=descriptors,
            nbytes=nbytes,
            mem_kind=ctx.mem_kind,
            slot_bytes=memory.slot_bytes,
            staging_possible=0 < unit_len <= slot,
        )
        if would == "staging":
            ctx.staging_need(peer)

    def step(self, rec: PrefillRoom) -> int:
        """Advance the room's staged jobs; tell decodes about landed pieces.

        Staged WRITEs count as in flight like direct ones (an abort is acked only once they
        ended; the job itself counts until it ends, so the room never reads as idle between
        its pieces); a landed piece settles only after its PieceReady went out, so the ack
        can't overtake it.
        """
        settled = 0
        if not rec.phase.sends:
            for job in rec.jobs:
                job.send.abandon("room ended")
        for job in list(rec.jobs):
            if job.send.finished and not job.send.in_flight:
                continue
            if self._slot_wait_over(job) and rec.phase.sends:
                self._go_direct(rec, job)
                continue
            if job.slot_at is None and job.send.remote_free:
                job.slot_at = time.monotonic()
                rec.slot_wait_s += job.slot_at - job.created
            posted, ended = job.send.posted, job.send.settled
            landed = job.send.step()
            if job.send.posted > posted:
                rec.note_post()
                self._feed(rec, Posted(job.send.posted - posted))
            for piece, slot in landed:
                rec.note_done()
                settled += 1
                self._piece_ready(rec, job, piece, slot)
            if job.send.settled > ended:
                self._feed(rec, Settled(job.send.settled - ended))
            if job.send.error and rec.phase.sends:
                job.send.abandon()
                self._feed(
                    rec, Failure(f"staged transfer to {job.info.agent} failed: {job.send.error}")
                )
        if rec.jobs and not any(j.send.in_flight or not j.send.finished for j in rec.jobs):
            self._end_jobs(rec)
        return settled

    def _piece_ready(self, rec: PrefillRoom, job: StagedJob, piece: Any, slot: int) -> None:
        """Tell the decode where a piece landed."""
        geo, me = job.send.geometry, self.ctx.me
        self.ctx.send(
            job.peer.endpoint,
            PieceReady(
                room=rec.room,
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

    def _end_jobs(self, rec: PrefillRoom) -> None:
        """Every job of the room ended: count them, and they stop counting as in flight."""
        broken = next((j for j in rec.jobs if j.send.error and not j.fell_back), None)
        if broken is not None and rec.phase.sends:
            # never conclude Success for a chunk whose pieces did not all land
            self._feed(
                rec, Failure(f"staged transfer to {broken.info.agent} failed: {broken.send.error}")
            )
        rec.nbytes += sum(j.send.nbytes for j in rec.jobs)
        rec.descriptors += sum(j.send.done_pieces for j in rec.jobs)
        rec.pieces += sum(j.send.done_pieces for j in rec.jobs)
        ended, rec.jobs = len(rec.jobs), []
        self._feed(rec, Settled(ended))

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
            self._feed(rec, Failure(str(exc)))
        finally:  # the job ends after its direct WRITE counts: the room never reads as idle
            rec.jobs = [j for j in rec.jobs if j is not job]
            self._feed(rec, Settled())

    # -- receiver slots ------------------------------------------------------------------
    def _ask_slots(self, room: int, info: TransferInfo, credits: SlotCredits) -> None:
        """A staged chunk found no receiver slot: join the decode's queue (once until granted)."""
        if credits or credits.granted or credits.asked:  # free, in use by a chunk, or asked
            return
        credits.asked = True
        me = self.ctx.me
        self.ctx.send((info.endpoint, info.dst_port), SlotAsk(room, me.name, me.ip, me.port))

    def give_back(self, rec: PrefillRoom, agent: str) -> bool:
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

    def serve_recalls(self, rec: PrefillRoom) -> None:
        """A recall means a ready room waits for slots on that decode. Its slots go back
        once no unfinished chunk of the room writes there, also after the room's last
        chunk: with several decode ranks, one that granted room B before room A would
        otherwise hold A's last chunk while A holds B's slots on another rank, until
        ``SLOT_WAIT``. A recall stands until served or the room ends (pieces in flight
        when it arrives are usually scattered a moment later)."""
        for agent in list(rec.recalls):
            credits = rec.credits.get(agent)
            if credits is None or not credits.granted or not rec.phase.sends:
                rec.recalls.discard(agent)  # ended, nothing held, or failing: nothing to do
                continue
            if any(
                j.info.agent == agent and (j.send.in_flight or not j.send.finished)
                for j in rec.jobs
            ):
                continue  # a chunk writes there now: once it is done
            if self.give_back(rec, agent):
                rec.recalls.discard(agent)

    # -- completion ----------------------------------------------------------------------
