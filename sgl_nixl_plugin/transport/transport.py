"""Control-message transport: one cached PUSH socket per peer, never blocking, no policy.

SGLang's own socket cache turns reconnection off (``RECONNECT_IVL`` -1): a message sent
while a peer was briefly gone leaves a socket that never connects, is never replaced (its
monitor reports disconnects only) and swallows every later message. Ours reconnects, and
is replaced once its monitor saw a disconnect. A decode sends through SGLang's receiver
sockets instead (``via``): those carry its registrations and transfer requests, so an
abort can never overtake the request it cancels.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.messages import Message

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


class Transport:
    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        address: Callable[[Endpoint], tuple[str, bool]],
        via: Callable[[Endpoint], tuple[Any, Any]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.codec = codec
        self._address = address  # endpoint -> (tcp url, is_ipv6)
        self._via = via  # endpoint -> (socket, lock) owned by someone else
        self.sockets: dict[str, Any] = {}
        self.monitors: dict[str, Any] = {}
        self.send_locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()

    def connect(self, url: str, is_ipv6: bool = False) -> Any:
        with self.lock:
            sock = self.sockets.get(url)
            if sock is not None and not _saw_disconnect(self.monitors.get(url)):
                return sock
            if sock is not None:
                _close_monitored(sock, self.monitors.pop(url, None))
            sock = self.ctx.socket(zmq.PUSH)
            if is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
            self.sockets[url] = sock
            self.monitors[url] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.send_locks.setdefault(url, threading.Lock())
            return sock

    def send_frames(self, url: str, frames: list[Any], is_ipv6: bool = False) -> None:
        """Raises instead of waiting when the peer's queue is full (a slow or dead peer)."""
        sock = self.connect(url, is_ipv6=is_ipv6)
        with self.send_locks[url]:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def send(self, endpoint: Endpoint, msg: Message, arrays: Sequence[np.ndarray] = ()) -> bool:
        """Send one message without blocking; False (logged) if the peer can't take it."""
        return self._push(endpoint, self.codec.encode(msg, arrays), type(msg).__name__)

    def send_raw(self, endpoint: Endpoint, frames: list[Any]) -> bool:
        """Frames already encoded (a registration, a reply in a peer's protocol version)."""
        return self._push(endpoint, frames, "encoded frames")

    def _push(self, endpoint: Endpoint, frames: list[Any], what: str) -> bool:
        try:
            if self._via is not None:
                sock, lock = self._via(endpoint)
                with lock:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            else:
                url, ipv6 = self._address(endpoint)
                self.send_frames(url, frames, ipv6)
            return True
        except Exception as exc:
            logger.warning("sgl-nixl: could not send %s to %s:%s: %s", what, *endpoint, exc)
            return False

    def close(self) -> None:
        """Close every socket (monitors first) so that the context can end."""
        with self.lock:
            for url, sock in list(self.sockets.items()):
                _close_monitored(sock, self.monitors.pop(url, None))
            self.sockets.clear()


def _close_monitored(sock: Any, monitor: Any) -> None:
    """Close a socket and its monitor in the order libzmq needs to let the context end."""
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=0)


def _saw_disconnect(monitor: Any) -> bool:
    """Whether a socket's disconnect monitor reported since it was made (or is broken)."""
    if monitor is None:
        return False
    try:
        monitor.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError:
        pass
    return True
