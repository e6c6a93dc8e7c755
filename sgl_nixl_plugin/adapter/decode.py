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

from sgl_nixl_plugin.adapter.liveness import Liveness
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
        self.liveness = Liveness(s.liveness_interval_s, s.liveness_misses)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-decode-rx", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        sock = self.mgr.server_socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        tick_ms = max(10, int(self.liveness.interval * 1000 / 2))
        while not self._stop.is_set():
            try:
                if poller.poll(tick_ms):
                    frames = sock.recv_multipart(copy=False)
                    decoded = self.mgr.codec.decode(frames)
                    if decoded is not None:
                        self._dispatch(decoded.msg)
                self._check_liveness()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                logger.error("sgl-nixl decode control socket error: %s", exc)
                time.sleep(0.05)
            except Exception:
                logger.exception("sgl-nixl: decode listener error; it goes on")

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
            self.liveness.replied((msg.ip, msg.port))
        elif isinstance(msg, AbortAck):
            if mgr.enable_deferred_decode_kv_release and msg.generation is not None:
                mgr.note_abort_ack(msg.room, msg.prefill_rank, msg.generation)
        elif isinstance(msg, RegistrationReply):
            if not msg.accepted:
                mgr.on_refused((msg.ip, msg.port), msg.reason)
        elif isinstance(msg, Ping):
            mgr.send_to((msg.ip, msg.port), Pong(mgr.engine.name, msg.seq, mgr.local_ip, mgr.rank_port))
        else:
            mgr.codec.rejections.reject("unexpected", type(msg).__name__)

    def _check_liveness(self) -> None:
        mgr = self.mgr
        for endpoint, seq in self.liveness.watch(mgr.pending_endpoints()):
            mgr.send_to(endpoint, Ping(mgr.engine.name, mgr.local_ip, mgr.rank_port, seq))
        for (ip, port), silent in self.liveness.dead():
            mgr.fail_endpoint(
                (ip, port),
                f"prefill rank {ip}:{port} stopped answering (no reply for {silent:.1f}s); "
                "it may have crashed or the network is partitioned",
            )
