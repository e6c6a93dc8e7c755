"""Decode side: one listener thread for statuses, acks, registration replies and pongs.

It also pings the prefill ranks that hold this side's rooms in flight, and fails those
rooms with a reason when a rank stops answering, instead of waiting for the 300 s timeout.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sgl_nixl_plugin.adapter.control_loop import ControlLoop
from sgl_nixl_plugin.adapter.liveness import Endpoint
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

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)


class DecodeListener(ControlLoop):
    """Applies what prefills send; progresses the NIXL agent while data is due.

    A two-sided transport (UCX over TCP) needs the target to progress: while rooms await
    data or an ABORT_ACK it wakes every millisecond and progresses; idle, it wakes every
    20 ms and still progresses once (WRITEs for rooms that already ended here then drain
    instead of holding the prefill's handles), which costs well under 1 % of a core.
    """

    def __init__(self, mgr: NixlPluginKVManager) -> None:
        super().__init__(mgr, "sgl-nixl-decode-rx")
        self._busy = False

    def expect_data(self) -> None:
        """A transfer request just went out: progress from now on, not from the next check."""
        self._busy = True

    def poll_ms(self) -> int:
        return 1 if self._busy else 20

    def on_frames(self, frames: list[Any]) -> None:
        decoded = self.mgr.codec.decode(frames)
        if decoded is not None:
            self._dispatch(decoded.msg)

    def on_lost(self, endpoint: Endpoint, why: str) -> None:
        self.mgr.fail_endpoint(endpoint, f"prefill rank {endpoint[0]}:{endpoint[1]} {why}")

    def tick(self) -> None:
        self.mgr.engine.agent.progress()
        super().tick()

    def _dispatch(self, msg: Any) -> None:
        mgr = self.mgr
        if isinstance(msg, TransferStatus):
            if mgr.staging is not None and mgr.staging.is_staged(msg.room):
                mgr.staging.submit(msg)  # after the room's pieces already queued for scatter
            else:
                mgr.apply_status(msg)
        elif isinstance(msg, PieceReady):
            if mgr.staging is None:
                mgr.codec.rejections.reject("unexpected", "PieceReady without staging")
            else:
                mgr.staging.submit(msg)
        elif isinstance(msg, SlotAsk):
            if mgr.staging is None:
                mgr.codec.rejections.reject("unexpected", "SlotAsk without staging")
            else:
                mgr.staging.ask(msg)
        elif isinstance(msg, SlotReturn):
            if mgr.staging is None:
                mgr.codec.rejections.reject("unexpected", "SlotReturn without staging")
            else:
                mgr.staging.take_back(msg)
        elif isinstance(msg, Pong):
            self.watch.replied((msg.ip, msg.port))
        elif isinstance(msg, AbortAck):
            if mgr.enable_deferred_decode_kv_release and msg.generation is not None:
                if mgr.staging is not None and mgr.staging.is_staged(msg.room):
                    # Behind the room's pieces already queued for scatter: the pages are
                    # only released once nothing more will be written into them.
                    mgr.staging.submit(msg)
                else:
                    mgr.note_abort_ack(msg.room, msg.prefill_rank, msg.generation)
        elif isinstance(msg, RegistrationReply):
            if msg.retry:
                mgr.forget_endpoint((msg.ip, msg.port))  # it lost our registration: send it again
            elif not msg.accepted:
                mgr.on_refused((msg.ip, msg.port), msg.reason)
            elif msg.returns and mgr.staging is not None:
                mgr.staging.returners.add((msg.ip, msg.port))
        elif isinstance(msg, Ping):
            mgr.send_to((msg.ip, msg.port), Pong(mgr.engine.name, msg.seq, mgr.local_ip, mgr.rank_port))
        else:
            mgr.codec.rejections.reject("unexpected", type(msg).__name__)

    def check_liveness(self) -> None:
        mgr = self.mgr
        pending = mgr.pending_endpoints()
        self._busy = bool(pending) or bool(mgr._deferred_abort_ack_tracker)
        self.watch.sync(mgr.known_endpoints(), pending)
        self.watch.ping(
            lambda seq: mgr.codec.encode(Ping(mgr.engine.name, mgr.local_ip, mgr.rank_port, seq))
        )
        for (ip, port), silent in self.watch.silent():
            self.watch.forget((ip, port))
            mgr.fail_endpoint(
                (ip, port),
                f"prefill rank {ip}:{port} stopped answering (no reply for {silent:.1f}s); "
                "the host may be down or the network partitioned",
            )
