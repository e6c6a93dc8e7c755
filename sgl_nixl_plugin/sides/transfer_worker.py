"""Prefill transfer workers: the scheduler's ``send()`` only enqueues a chunk (O(1)).

A worker submits each chunk's WRITEs (direct or staged) without waiting and polls every
transfer it has in flight with backoff, so many rooms bound for the same decode move at once.
Rooms are sharded across workers by room id, so one room's chunks stay in order; the worker
that owns a room is the only thread that changes its record's transfers. It feeds the room's
machine (``protocol.prefill_machine``) what happens (a chunk, a post, a settle, a failure,
SGLang's status) and carries out the effects it returns (``_apply``): the phase decides
whether to send, conclude or close.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.one_pass import KernelXfer
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.protocol.prefill_machine import (
    ChunkIn,
    Close,
    Concluded,
    ConcludeFailure,
    ConcludeSuccess,
    Effect,
    Event,
    Failure,
    Mirror,
    Posted,
    PrefillPhase,
    Settled,
    StatusEnded,
)
from sgl_nixl_plugin.protocol.prefill_rooms import Chunk, PrefillRoom, TransferInfo
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.staged_path import StagedPath
from sgl_nixl_plugin.wire.notes import encode_note

logger = logging.getLogger(__name__)


_WAKE = object()  # queued by the control thread when a receiver credit arrives


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
        # chunks of rooms filed while a decode's link was set up, in arrival order: they
        # go once the control thread has its verdict (``DecodeRegistrations``) and wakes us
        self.parked: list[Chunk] = []
        self.kernels = 0  # one-pass copies in flight (each ends in ~1 ms: poll at once)
        self._backoff = self.MIN_BACKOFF_S
        self._stop = threading.Event()
        self.staged = StagedPath(ctx, self._track, self._feed)
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
            busy = any(r.in_flight for r in self.active.values())
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
                            self.staged.serve_recalls(rec)
                    elif chunk is not _WAKE:
                        self.submit(chunk)
                    chunk = self.queue.get_nowait() if not self.queue.empty() else None
                if self.parked:
                    self._unpark()
                quick = self.kernels > 0 or any(
                    j.send.needs_polling for r in self.active.values() for j in r.jobs
                )
                if self.poll() == 0 and busy and not quick:
                    # staged pieces move in ~0.1 ms steps (gather done, WRITE done, slot
                    # freed): keep the shortest wait while any is in flight
                    self._backoff = min(self._backoff * 2, self.MAX_BACKOFF_S)
                else:
                    self._backoff = self.MIN_BACKOFF_S
            except Exception:
                logger.exception("sgl-nixl: transfer worker error; it goes on")

    # -- the room's machine -------------------------------------------------------------
    def _feed(self, rec: PrefillRoom, event: Event) -> None:
        self._apply(rec, rec.on(event))

    def _apply(self, rec: PrefillRoom, effects: list[Effect]) -> None:
        """Carry out what the room's machine decided, in order."""
        ctx, room = self.ctx, rec.room
        for effect in effects:
            if isinstance(effect, Mirror):
                ctx.sglang.mirror_in_flight(room, effect.in_flight)
            elif isinstance(effect, ConcludeFailure):
                for job in rec.jobs:
                    job.send.abandon(effect.reason)
                logger.error("sgl-nixl: room %s failed: %s", room, effect.reason)
                ctx.sglang.conclude_failure(room, effect.reason)
                ctx.observe(rec, ok=False, reason=effect.reason)
            elif isinstance(effect, ConcludeSuccess):
                # the decode's status first, then bookkeeping; Success is what SGLang emitted
                # (another thread may have failed the room since: it sent the failure)
                ok = not ctx.sglang.is_failed_or_gone(room) and ctx.sglang.conclude_success(room)
                self._feed(rec, Concluded(ok))
            elif isinstance(effect, Close):
                if self.active.get(room) is rec:
                    del self.active[room]
                ctx.rooms.close(rec)
                if effect.phase is PrefillPhase.SUCCEEDED:
                    ctx.observe(rec, ok=True)

    # -- submission ----------------------------------------------------------------------
    def submit(self, chunk: Chunk) -> None:
        """Post a chunk's WRITEs (the worker thread; tests call it in process). The chunk
        counts as in flight before the room's status is read: an abort marks the room
        Failed, then ACKs once nothing is in flight, so either it sees this chunk (and its
        ACK waits for the WRITEs posted here) or we see Failed. A chunk for a decode still
        being set up waits (``parked``) without counting: nothing of it is posted."""
        if self._waits_for_link(chunk):
            self.parked.append(chunk)
            return
        rec = self.active.get(chunk.room)
        if rec is None:
            rec, effects = self.ctx.rooms.claim(chunk.room, chunk.is_last)
            self.active[chunk.room] = rec
            self._apply(rec, effects)
        else:
            self._feed(rec, ChunkIn(chunk.is_last))
        try:
            self._submit_counted(rec, chunk)
        except Exception as exc:  # a bug must fail the room, never let it end as Success
            logger.exception("sgl-nixl: room %s: submitting a chunk failed", chunk.room)
            self._feed(rec, Failure(f"internal error while submitting a chunk: {exc!r}"))
        finally:
            self._feed(rec, Settled())  # the chunk's posts are done
            self._store_flags(rec)

    def _waits_for_link(self, chunk: Chunk) -> bool:
        """Whether a destination of the chunk's room is a decode still being set up (or an
        earlier chunk of the room waits: chunks go in order)."""
        peers = self.ctx.peers
        if not self.parked and not peers.pending:  # the steady state: no setup under way
            return False
        if any(c.room == chunk.room for c in self.parked):
            return True
        infos = self.ctx.sglang.destinations(chunk.room).values()
        return any(not i.is_dummy and peers.waits_for_link(i.agent) for i in infos)

    def _unpark(self) -> None:
        """Submit the parked chunks whose decodes' setup ended (those still set up wait
        again, in order); a room SGLang cleared meanwhile drops its chunks."""
        parked, self.parked = self.parked, []
        for chunk in parked:
            if self.ctx.sglang.exists(chunk.room):
                self.submit(chunk)

    def _submit_counted(self, rec: PrefillRoom, chunk: Chunk) -> None:
        sg, room = self.ctx.sglang, chunk.room
        rec.chunks += 1
        if chunk.is_last:
            rec.last_chunk_at = time.perf_counter()
        if sg.is_failed_or_gone(room):
            self._feed(rec, StatusEnded())
        if not rec.phase.sends:
            return
        for ev in chunk.events:
            ev.synchronize()  # the forward pass must have written these pages
        infos = sg.destinations(room)
        if not infos:
            self._feed(rec, Failure("no decode destination was received for this room"))
            return
        try:
            for info in list(infos.values()):
                if not info.is_dummy and rec.phase.sends:
                    self._submit_to(rec, chunk, info)
        except (TransferError, ValueError) as exc:
            self._feed(rec, Failure(str(exc)))

    def _submit_to(self, rec: PrefillRoom, chunk: Chunk, info: TransferInfo) -> None:
        ctx = self.ctx
        peer, refused = ctx.peers.lookup(info.agent)
        if peer is None:
            raise TransferError(
                f"decode {info.agent} was refused: {refused}"
                if refused
                else f"decode {info.agent} is no longer connected"
            )
        link = peer.link
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
        tail = self._tail_writes(chunk, info) if chunk.is_last and rec.phase.sends else []
        if self._takes_one_pass(info, peer, src):
            self._track(rec, self._one_pass(rec, info, peer, src, dst))
            rec.path = "ipc"
        else:
            if len(src):
                rec.not_one_pass.add(info.agent)  # no completion flag: the status ends it
            job = self.staged.job_for(rec, info, peer, src, dst, first)
            if job is not None:
                rec.jobs.append(job)
                rec.staged_to.add(info.agent)  # its pieces await a scatter: no note count
                self._feed(rec, Posted())  # the job, until it ends
                rec.path = "staging"
                self.staged.step(rec)  # first gather now, ahead of the aux and state WRITEs
            else:
                tail.insert(0, (group, src, dst))
        self._post(rec, info, link, tail, ends=chunk.is_last)
        if chunk.is_last and rec.phase.sends:
            op = link.one_pass
            if (
                info.done_flag >= 0
                and op is not None
                and op.flags is not None
                and info.agent not in rec.not_one_pass
            ):
                if not rec.flags_due:
                    self._feed(rec, Posted())  # the flags owed, until stored or dropped
                rec.flags_due[info.agent] = (op, info.done_flag, info.done_value)

    @staticmethod
    def _tail_writes(chunk: Chunk, info: TransferInfo) -> list[Any]:
        """The room's aux row and state WRITEs (with its last chunk): (group, src, dst)
        each, a ``TransferError`` in place of one whose indices disagree (raised when its
        turn to post comes: what went before is in flight and counts)."""
        writes: list[Any] = []
        if chunk.aux_index is not None and info.aux_index >= 0:
            writes.append(("aux", np.array([chunk.aux_index]), np.array([info.aux_index])))
        for i, (src, dst_state) in enumerate(zip(chunk.state or [], info.state, strict=False)):
            if src is None or not len(dst_state):
                continue
            src = np.asarray(src, dtype=np.int64).ravel()
            if len(src) != len(dst_state):
                writes.append(
                    TransferError(
                        f"state[{i}]: prefill has {len(src)} indices, decode {len(dst_state)}"
                    )
                )
                break
            writes.append((f"{info.groups}state{i}", src, dst_state))
        return writes

    def _post(
        self, rec: PrefillRoom, info: TransferInfo, link: Any, writes: list, ends: bool
    ) -> None:
        """Post ``writes`` ((group, src, dst) each) to ``info``'s decode. Where it counts
        notes (and no copy of the room goes by one pass), each WRITE carries one and, when
        ``ends`` (the room's last chunk), the last says how many the decode is owed: its
        scheduler then ends the room as that WRITE lands, not after the status message (a
        note that does not go, its WRITE not posted, leaves the room to the status)."""
        engine = self.ctx.engine
        posts = _joined([w for w in writes if isinstance(w, Exception) or len(w[1])], link)
        noted = info.notes and link.one_pass is None
        ends = ends and not any(isinstance(w, Exception) for w in posts)
        for i, w in enumerate(posts):
            if isinstance(w, Exception):
                raise w
            if not rec.phase.sends:
                return
            note = b""
            if noted:
                n = rec.notes[info.agent] = rec.notes.get(info.agent, 0) + 1
                last = ends and i == len(posts) - 1 and info.agent not in rec.staged_to
                note = encode_note(rec.room, self.ctx.me.rank, n, n if last else 0)
            self._track(rec, engine.write_parts(link, w, notif=note))

    def _track(self, rec: PrefillRoom, x: Any) -> None:
        if x is None:
            return
        rec.xfers.append(x)
        if isinstance(x, KernelXfer):
            self.kernels += 1
        rec.note_post()
        rec.nbytes += x.nbytes
        rec.descriptors += x.descriptors
        self._feed(rec, Posted())

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
            self.staged.give_back(rec, info.agent)  # granted with the request: not needed here
        return xfer

    def poll(self) -> int:
        """Poll every transfer in flight (the worker thread; tests call it in process);
        returns how many settled."""
        return sum(self._poll_room(rec) for rec in list(self.active.values()))

    def _poll_room(self, rec: PrefillRoom) -> int:
        settled = 0
        if not rec.phase.sends or self.ctx.sglang.is_failed_or_gone(rec.room):
            # failed by another thread (liveness, an abort), cleared or released: stop here
            # too, so a WRITE stuck to a lost decode is given up after the drain bound below
            # instead of when (if ever) SGLang clears the sender
            self._feed(rec, StatusEnded())
        if rec.jobs:
            try:
                settled += self.staged.step(rec)
            except Exception as exc:  # as in submit: fail the room, keep the worker
                logger.exception("sgl-nixl: room %s: staged transfer step failed", rec.room)
                self._feed(rec, Failure(f"internal error in a staged transfer: {exc!r}"))
        if rec.recalls:
            self.staged.serve_recalls(rec)
        if rec.phase is PrefillPhase.SENDING and not rec.jobs:
            for agent in list(rec.credits):  # between chunks: let other rooms use them
                self.staged.give_back(rec, agent)
        if rec.xfers:
            settled += self._poll_xfers(rec)
        self._store_flags(rec)
        return settled

    def _poll_xfers(self, rec: PrefillRoom) -> int:
        """Settle the room's WRITEs and copies that ended; once the room drains, give up a
        WRITE older than the drain bound (its peer is gone: it will never settle)."""
        ctx, settled, remaining = self.ctx, 0, []
        stuck_after = ctx.settings.abort_drain_timeout_s
        for x in list(rec.xfers):
            state = ctx.engine.poll(x)
            if state == "PROC":
                if (
                    rec.phase is PrefillPhase.DRAINING
                    and not isinstance(x, KernelXfer)  # a kernel ends; until then it writes
                    and time.perf_counter() - x.started > stuck_after
                ):
                    ctx.engine.agent.abandon(x)
                    settled += 1
                    self._feed(rec, Settled())
                else:
                    remaining.append(x)
                continue
            settled += 1
            if isinstance(x, KernelXfer):
                self.kernels -= 1
            if state == "DONE":
                rec.note_done()
            if state == "DONE" and (t := ctx.engine.agent.telemetry(x)):
                metrics.telemetry(t)
                rec.nixl_post_us += t["post_us"]
                rec.nixl_xfer_us += t["xfer_us"]
            ctx.engine.release(x)
            self._feed(rec, Settled(1, (x.error or "WRITE failed") if state == "ERR" else ""))
        rec.xfers = remaining
        return settled

    def _store_flags(self, rec: PrefillRoom) -> None:
        """Once only the room's copies are in flight (its aux rows and state landed, no
        staged job), queue each one-pass decode's completion flag behind them on the copy
        stream. A room that stops first stores none: its status message ends it."""
        if not rec.flags_due:
            return
        if rec.phase.sends and not self.ctx.sglang.is_failed_or_gone(rec.room):
            if rec.jobs or any(not isinstance(x, KernelXfer) for x in rec.xfers):
                return
            for agent, (op, word, value) in rec.flags_due.items():
                try:
                    self._track(rec, op.signal(word, value, self.ctx.copy_stream))
                except Exception as exc:  # the flag only saves time: the status still goes
                    logger.warning(
                        "sgl-nixl: room %s: no completion flag for decode %s: %s",
                        rec.room,
                        agent,
                        exc,
                    )
        rec.flags_due = {}
        self._feed(rec, Settled())  # the flags owed


def _joined(writes: list, link: Any) -> list:
    """``writes`` as posts: consecutive (group, src, dst) whose groups share their lists
    (``PeerLink.shares``: the KV chunk and aux row on a DRAM host) in one list, one WRITE
    each; an exception stays in its place."""
    posts: list = []
    for w in writes:
        last = posts[-1] if posts else None
        if (
            not isinstance(w, Exception)
            and isinstance(last, list)
            and link.shares(last[-1][0], w[0])
        ):
            last.append(w)
        else:
            posts.append(w if isinstance(w, Exception) else [w])
    return posts
