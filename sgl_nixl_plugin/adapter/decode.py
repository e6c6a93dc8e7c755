"""Decode side: one listener thread for statuses, acks, registration replies and pongs.

It also pings the prefill ranks that hold this side's rooms in flight, and fails those
rooms with a reason when a rank stops answering, instead of waiting for the 300 s timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from sgl_nixl_plugin.adapter.liveness import PeerWatch, drain
from sgl_nixl_plugin.wire.messages import (
    AbortAck,
    PieceReady,
    Ping,
    Pong,
    RegistrationReply,
    TransferStatus,
)

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)


class DecodeListener:
    def __init__(self, mgr: NixlPluginKVManager) -> None:
        self.mgr = mgr
        s = mgr.settings
        self.watch = PeerWatch(mgr._zmq_ctx, s.liveness_interval_s, s.liveness_misses)
        self._stop = threading.Event()
        self._next_check = 0.0
        self._busy = False
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-decode-rx", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        sock = self.mgr.server_socket
        poller = self.watch.poller
        poller.register(sock, zmq.POLLIN)
        # Idle, wake every 20 ms (cheap) so a request that just became due gets its agent
        # progressed quickly; see ``expect_data``.
        tick_ms = 20
        while not self._stop.is_set():
            try:
                # While data is due, wake every millisecond to progress the NIXL agent (a
                # two-sided transport such as UCX over TCP needs the target to progress);
                # when nothing is pending, sleep in poll: an idle decode costs no CPU.
                # Data is also due while aborted rooms await their ABORT_ACK (the prefill
                # acks once its WRITEs drained, which needs our progress), and an idle tick
                # still progresses once: WRITEs for rooms that already ended here (a healed
                # partition) then drain instead of holding the prefill's handles forever.
                busy = self._busy
                for ready, _ in poller.poll(1 if busy else tick_ms):
                    if ready is sock:
                        for frames in drain(sock):
                            decoded = self.mgr.codec.decode(frames)
                            if decoded is not None:
                                self._dispatch(decoded.msg)
                    elif self.watch.owns(ready):
                        for (ip, port), why in self.watch.on_monitor(ready):
                            self._lost((ip, port), f"prefill rank {ip}:{port} {why}")
                self.mgr.engine.agent.progress()
                self._check_liveness()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.error("sgl-nixl decode control socket error: %s", exc)
                time.sleep(0.05)
            except Exception:
                logger.exception("sgl-nixl: decode listener error; it goes on")
        self.watch.close()

    def expect_data(self) -> None:
        """A transfer request just went out: start progressing the agent now, not at the
        next liveness check (a two-sided transport needs the target to progress)."""
        self._busy = True

    def _lost(self, endpoint: tuple[str, int], reason: str) -> None:
        self.watch.forget(endpoint)
        self.mgr.fail_endpoint(endpoint, reason)

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
        elif isinstance(msg, Ping):
            mgr.send_to((msg.ip, msg.port), Pong(mgr.engine.name, msg.seq, mgr.local_ip, mgr.rank_port))
        else:
            mgr.codec.rejections.reject("unexpected", type(msg).__name__)

    def _check_liveness(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.watch.interval / 4
        mgr = self.mgr
        pending = mgr.pending_endpoints()
        self._busy = bool(pending) or bool(mgr._deferred_abort_ack_tracker)
        self.watch.sync(mgr.known_endpoints(), pending)
        self.watch.ping(
            lambda seq: mgr.codec.encode(Ping(mgr.engine.name, mgr.local_ip, mgr.rank_port, seq))
        )
        for (ip, port), silent in self.watch.silent():
            self._lost(
                (ip, port),
                f"prefill rank {ip}:{port} stopped answering (no reply for {silent:.1f}s); "
                "the host may be down or the network partitioned",
            )
