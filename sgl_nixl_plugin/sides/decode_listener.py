"""Decode side: one listener thread for statuses, acks, registration replies and pongs.

It also pings the prefill ranks that hold this side's rooms in flight, and fails those
rooms with a reason when a rank stops answering, instead of waiting for the 300 s timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.sides.decode_policy import DecodePolicy
from sgl_nixl_plugin.transport.control_loop import ControlLoop
from sgl_nixl_plugin.transport.liveness import Endpoint
from sgl_nixl_plugin.wire.codec import ForeignReply
from sgl_nixl_plugin.wire.messages import (
    AbortAck,
    PieceReady,
    Ping,
    Pong,
    RegistrationReply,
    SlotAsk,
    SlotReturn,
    TransferStatus,
)

logger = logging.getLogger(__name__)

#: Wake-up periods: while a room awaits data or an ABORT_ACK; while only a warm-up awaits its
#: replies (its WRITE's wire-up needs this side's progress for each of a few rounds, and a
#: user's first request waits for it: at 20 ms a round the decode's handshake took 96-122
#: ms on a loaded 2-core host, at 1 ms 29-62 ms); idle, which bounds how late an ended
#: room's stray WRITE drains (10 wake-ups a second).
BUSY_POLL_MS = 1
WARMUP_POLL_MS = 1
IDLE_POLL_MS = 100
#: While not idle, how often to ask whether that is still so (the last room's end is seen
#: this soon, so the 1 ms polling stops with it).
BUSY_RECHECK_S = 0.02
#: How much longer than the prefill's warm-up bound to progress after a staging offer went.
STAGING_WARM_SLACK_S = 0.5


class DecodeListener(ControlLoop):
    """Applies what prefills send; progresses the NIXL agent while data is due.

    A two-sided transport (UCX over TCP) needs the target to progress: while rooms await
    data or an ABORT_ACK it wakes every millisecond and progresses; while a warm-up awaits
    its replies, every ``WARMUP_POLL_MS``. Idle, it wakes every ``IDLE_POLL_MS`` and still
    progresses once, so WRITEs for rooms that already ended here drain instead of holding
    the prefill's handles. The first request after an idle spell does not wait out that
    sleep: ``expect_data`` interrupts it; the 1 ms polling ends within ``BUSY_RECHECK_S`` of
    the last room's end.
    """

    def __init__(self, side: DecodePolicy) -> None:
        ctx = side.ctx
        s = ctx.settings
        super().__init__(
            ctx.zmq_ctx,
            ctx.server_socket,
            s.liveness_interval_s,
            s.liveness_misses,
            "sgl-nixl-decode-rx",
            stall_s=s.liveness_stall_s,
        )
        self.side = side
        self.ctx = ctx
        self._poll_ms = IDLE_POLL_MS
        self._recheck_at = 0.0  # when a loop that is not idle next asks whether it still is
        self._expected = 0  # bumped by every expect_data (another thread)
        #: message type -> handler, in the order ``_dispatch`` tries them
        self._handlers: tuple[tuple[type | tuple[type, ...], Callable[[Any], None]], ...] = (
            (TransferStatus, self._on_status),
            (PieceReady, self._on_piece),
            (SlotAsk, self._on_slot_ask),
            (SlotReturn, self._on_slot_return),
            (Pong, self._on_pong),
            (AbortAck, self._on_abort_ack),
            ((RegistrationReply, ForeignReply), self._on_reply),
            (Ping, self._on_ping),
        )

    def expect_data(self, warmup: bool = False) -> None:
        """Data is due (a transfer request went out, or a warm-up registration): progress
        at that rate from now on, not from the next check."""
        self._expected += 1
        want = WARMUP_POLL_MS if warmup else BUSY_POLL_MS
        if want < self._poll_ms:
            self._poll_ms = want
            self.interrupt()

    def poll_ms(self) -> int:
        return self._poll_ms

    def on_frames(self, frames: list[Any]) -> None:
        decoded = self.ctx.codec.decode(frames)
        if decoded is not None:
            self._dispatch(decoded.msg)

    def on_lost(self, endpoint: Endpoint, why: str) -> None:
        self.side.fail_endpoint(endpoint, f"prefill rank {endpoint[0]}:{endpoint[1]} {why}")

    def tick(self) -> None:
        self.ctx.engine.agent.progress()
        if self._poll_ms != IDLE_POLL_MS and time.monotonic() >= self._recheck_at:
            self._update_poll()
        super().tick()

    def _update_poll(self) -> set[Endpoint]:
        """The wake-up period for what is due now: 1 ms while some prefill owes data or an
        ABORT_ACK (or an ``expect_data`` raced with this check), ``WARMUP_POLL_MS`` while
        only a warm-up waits (ours, or a prefill's into our staging area); returns the
        prefill ranks that owe data."""
        ctx = self.ctx
        expected = self._expected  # before looking at the rooms: a later request shows here
        pending = self.side.pending_endpoints()
        if pending or ctx.sglang.abort_acks_pending() or expected != self._expected:
            self._poll_ms = BUSY_POLL_MS
        elif ctx.warmup is not None and ctx.warmup.waiting() or self._staging_warms():
            self._poll_ms = WARMUP_POLL_MS
        else:
            self._poll_ms = IDLE_POLL_MS
        self._recheck_at = time.monotonic() + BUSY_RECHECK_S
        return pending

    def _staging_warms(self) -> bool:
        """A prefill rank may be WRITEing into our staging area (its warm-up after our
        offer): its WRITE moves only as fast as we progress (UCX over TCP)."""
        staging, bound = self.ctx.staging, self.ctx.settings.warmup_timeout_s
        return staging is not None and staging.offers.warming(bound + STAGING_WARM_SLACK_S)

    def _dispatch(self, msg: Any) -> None:
        """Hand ``msg`` to its handler: the first of ``_handlers`` whose type it is."""
        for kind, handler in self._handlers:
            if isinstance(msg, kind):
                handler(msg)
                return
        self.ctx.reject("unexpected", type(msg).__name__)

    def _on_status(self, msg: TransferStatus) -> None:
        rooms, staging = self.ctx.rooms, self.ctx.staging
        if staging is not None and rooms.is_staged(msg.room):
            rooms.mark(msg.room, "status", open_only=True)
            staging.submit(msg)  # after the room's pieces already queued for scatter
        else:
            decode_status.status_in(self.ctx, msg, time.perf_counter())

    def _staging_for(self, msg: Any) -> Any:
        """This decode's staging, or None (and ``msg`` rejected) when it has none."""
        if self.ctx.staging is None:
            self.ctx.reject("unexpected", f"{type(msg).__name__} without staging")
        return self.ctx.staging

    def _on_piece(self, msg: PieceReady) -> None:
        staging = self._staging_for(msg)
        if staging is not None:
            staging.submit(msg)

    def _on_slot_ask(self, msg: SlotAsk) -> None:
        staging = self._staging_for(msg)
        if staging is None:
            return
        ok, grants, recalls = self.ctx.rooms.ask(msg.room, (msg.ip, msg.port))
        if not ok:
            self.ctx.reject("bad_ask", f"room {msg.room} from {msg.ip}:{msg.port}")
        staging.messenger(grants, recalls)

    def _on_slot_return(self, msg: SlotReturn) -> None:
        staging = self._staging_for(msg)
        if staging is None:
            return
        bad, grants = self.ctx.rooms.take_back(msg.room, (msg.ip, msg.port), list(msg.slots))
        if bad:
            self.ctx.reject("bad_return", f"room {msg.room} slots {bad} from {msg.ip}:{msg.port}")
        staging.messenger(grants)

    def _on_pong(self, msg: Pong) -> None:
        self.watch.replied((msg.ip, msg.port))

    def _on_ping(self, msg: Ping) -> None:
        me = self.ctx.me
        self.ctx.send((msg.ip, msg.port), Pong(me.name, msg.seq, me.ip, me.port))

    def _on_abort_ack(self, msg: AbortAck) -> None:
        ctx, rooms = self.ctx, self.ctx.rooms
        if ctx.staging is not None and rooms.is_staged(msg.room):
            # Behind the room's pieces already queued for scatter: the pages are only
            # released once nothing more will be written into them.
            ctx.staging.submit(msg)
            return
        if msg.ip:
            rooms.abort_acked(msg.room, (msg.ip, msg.port))
        ctx.sglang.note_abort_ack(msg.room, msg.prefill_rank, msg.generation)

    def _on_reply(self, msg: RegistrationReply | ForeignReply) -> None:
        """A prefill rank's answer to our registration (in another version's envelope:
        ``ForeignReply``, always a refusal)."""
        ctx = self.ctx
        reply = msg if isinstance(msg, RegistrationReply) else None
        accepted = reply is not None and reply.accepted and not reply.retry
        if ctx.warmup is not None and not (accepted and self._links_with_staging(reply)):
            ctx.warmup.replied((msg.ip, msg.port), accepted)
        if isinstance(msg, RegistrationReply) and msg.retry:
            self.side.forget_endpoint((msg.ip, msg.port))  # it lost our registration
        elif not msg.accepted:
            self.side.on_refused((msg.ip, msg.port), msg.reason)
        elif isinstance(msg, RegistrationReply):
            self._on_accepted(msg)

    def _links_with_staging(self, reply: RegistrationReply | None) -> bool:
        """Whether the warm-up counts this prefill rank as linked only once our staging
        area went to it: when this decode names its prefills (``PREFILLS``), so that
        their first requests carry staging slots; else at once (a request already waits,
        and asks for its slots)."""
        ctx = self.ctx
        return bool(
            reply is not None
            and reply.wants_staging
            and ctx.staging is not None
            and ctx.settings.prefills
        )

    def _on_accepted(self, msg: RegistrationReply) -> None:
        """Note how the prefill rank will write to us: one pass (with completion flags or
        not), and which of our layers (its pipeline window)."""
        ctx, endpoint = self.ctx, (msg.ip, msg.port)
        if msg.one_pass:
            ctx.one_pass.add(endpoint)
        else:
            ctx.one_pass.discard(endpoint)
        if msg.one_pass and msg.done_flags and ctx.flags is not None:
            ctx.flag_ranks[endpoint] = msg.prefill_rank
        else:
            ctx.flag_ranks.pop(endpoint, None)
        if ctx.staging is not None:
            # before any piece of that rank: its pieces come after this reply
            ctx.staging.set_window(endpoint, tuple(msg.kv_window))
            if msg.wants_staging:  # it may stage into us: our area (allocated now if not yet)
                warm = ctx.warmup
                then = (
                    (lambda: warm.replied(endpoint, True))
                    if warm is not None and self._links_with_staging(msg)
                    else None
                )
                ctx.staging.offers.offer(endpoint, then)
                self.expect_data(warmup=True)  # its warm-up WRITE into our area follows
            else:
                ctx.staging.offers.withdraw(endpoint, declined=True)

    def check_liveness(self) -> None:
        ctx, side = self.ctx, self.side
        pending = self._update_poll()
        known = side.known_endpoints()
        self.watch.sync(known, pending)
        side.close_unused_sockets(known | pending, self.watch.deadline)
        me = ctx.me
        self.watch.ping(lambda seq: ctx.codec.encode(Ping(me.name, me.ip, me.port, seq)))
        for (ip, port), silent in self.watch.silent():
            self.watch.forget((ip, port))
            side.fail_endpoint(
                (ip, port),
                f"prefill rank {ip}:{port} stopped answering (no reply for {silent:.1f}s); "
                "the host may be down or the network partitioned",
            )
