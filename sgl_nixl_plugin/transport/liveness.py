"""Peer liveness: connection watch for every known peer, ping/pong while work is pending.

For every peer it knows (a prefill: each accepted decode; a decode: each prefill rank it
has a route to), the owning control thread keeps one PUSH socket with a ZMQ monitor. A
peer process that dies closes its sockets, the kernel resets the connection and the
monitor reports it at once: its rooms fail in milliseconds, with no timer that a busy
machine could trip, and an idle peer is forgotten.

A peer that vanishes without a reset (a network partition, a frozen host) is found by
ZMTP heartbeats: ZMQ's I/O threads exchange them every interval, so they keep flowing
while the peer's control thread is busy (a warm-up stuck in NIXL, a batch of messages on a
starved machine). A connection silent for ``misses`` intervals is closed by ZMQ; we then
judge the peer as silent since its last pong. Our own pings, answered by the peer's
control thread, still judge peers that owe us something, but a peer whose connection is
alive gets ``stall_s`` (a busy thread, not a lost process) before it is declared gone.

Not thread-safe: one control thread owns a ``PeerWatch`` and every socket in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

Endpoint = tuple[str, int]


@dataclass
class _Watched:
    sock: Any
    monitor: Any
    seq: int = 0
    connected: bool = False
    last_reply: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0
    pinged: bool = True
    timed_out: bool = False  # ZMQ closed it for missed heartbeats: silence, not an exit


class PeerWatch:
    def __init__(
        self, ctx: zmq.Context, interval_s: float, misses: int, stall_s: float = 30.0
    ) -> None:
        self.ctx = ctx
        self.interval = interval_s
        self.deadline = interval_s * misses
        self.stall = max(self.deadline, stall_s)
        # a connection closed after this much silence was closed by a heartbeat timeout
        # (a reset comes while pongs still flow): judged as silence, not as an exit
        self._quiet = min(2 * interval_s, self.deadline / 2)
        self._peers: dict[Endpoint, _Watched] = {}
        self._by_monitor: dict[Any, Endpoint] = {}
        self._last_check = time.monotonic()
        self.poller = zmq.Poller()

    def sync(self, endpoints: set[Endpoint], pinged: set[Endpoint] | None = None) -> None:
        """Watch exactly ``endpoints``; ping (and judge silence of) those in ``pinged``.

        A watched connection costs nothing while idle, and its loss is reported at once;
        pings are only for peers that owe us something.
        """
        pinged = endpoints if pinged is None else pinged
        endpoints = endpoints | pinged
        for ep in set(self._peers) - endpoints:
            self._close(ep)
        now = time.monotonic()
        for ep, w in self._peers.items():
            due = ep in pinged
            if due and not w.pinged:
                w.last_reply = now  # silence is only counted from when we start asking
            w.pinged = due
        for ep in endpoints - set(self._peers):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 16)
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.interval * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self.deadline * 1000)))
            monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
            )
            host = f"[{ep[0]}]" if ":" in ep[0] else ep[0]
            if ":" in ep[0]:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(f"tcp://{host}:{ep[1]}")
            self._peers[ep] = _Watched(sock, monitor, pinged=ep in pinged)
            self._by_monitor[monitor] = ep
            self.poller.register(monitor, zmq.POLLIN)

    def _close(self, ep: Endpoint) -> None:
        w = self._peers.pop(ep)
        self._by_monitor.pop(w.monitor, None)
        self.poller.unregister(w.monitor)
        w.sock.disable_monitor()
        w.monitor.close(linger=0)
        w.sock.close(linger=0)

    def close(self) -> None:
        for ep in list(self._peers):
            self._close(ep)

    def owns(self, sock: Any) -> bool:
        return sock in self._by_monitor

    def on_monitor(self, monitor: Any) -> list[tuple[Endpoint, str]]:
        """Drain one monitor socket; returns ``(endpoint, why)`` for peers found gone.

        Gone means an established connection was reset (the process died) or a connection
        attempt was refused (nothing listens there any more: a stale route). A connection
        ZMQ closed for missed heartbeats is not reported here while ``silent`` judges it
        (the peer is pinged); after that, its refused reconnections report it.
        """
        ep = self._by_monitor.get(monitor)
        lost: list[tuple[Endpoint, str]] = []
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            w = self._peers.get(ep) if ep else None
            if w is None:
                break
            if event["event"] == zmq.EVENT_CONNECTED:
                w.connected = True
                if not w.timed_out:  # after a heartbeat timeout, silence counts on
                    w.last_reply = time.monotonic()
            elif event["event"] == zmq.EVENT_DISCONNECTED and w.connected:
                w.connected = False
                w.timed_out = w.pinged and self._silence(w) > self._quiet
                if not w.timed_out:
                    lost.append((ep, "closed its connection (the process exited or restarted)"))
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED and not w.connected:
                if w.timed_out and w.pinged:
                    # ZMQ's retries after its own close say nothing while silence judges
                    # the peer; once it owes nothing, a refusal is the only verdict left
                    continue
                lost.append((ep, "refuses connections (nothing listens there: not running)"))
        return lost

    def _silence(self, w: _Watched) -> float:
        """How long ``w`` has gone unanswered while this thread was listening: a gap since
        the last check longer than an interval is this thread's own stall (CPU or GIL), as
        :meth:`silent` forgives it, and no sign of a heartbeat timeout."""
        now = time.monotonic()
        away = now - self._last_check
        return now - w.last_reply - (away if away > self.interval else 0.0)

    def ping(self, make_ping: Callable[[int], list[Any]]) -> None:
        """Send a ping to every watched peer that is due one."""
        now = time.monotonic()
        for w in self._peers.values():
            if not w.pinged or now - w.last_ping < self.interval:
                continue
            w.seq += 1
            w.last_ping = now
            try:
                w.sock.send_multipart(make_ping(w.seq), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass  # not connected yet, or the peer stopped reading: the deadline decides

    def replied(self, endpoint: Endpoint) -> None:
        w = self._peers.get(endpoint)
        if w is not None:
            w.last_reply = time.monotonic()
            w.timed_out = w.timed_out and not w.connected

    def silent(self) -> list[tuple[Endpoint, float]]:
        """Peers that have not answered past the deadline (``stall`` while their connection
        is up and has not missed heartbeats: the process lives), with how long they've been
        silent. A connection ZMQ re-made after missed heartbeats keeps the deadline until a
        pong comes: it may lead to a restarted process.

        If this thread itself was stalled (GIL, CPU starvation) since the last check, the
        stall is forgiven: a peer is only blamed for silence while we were listening.
        """
        now = time.monotonic()
        gap = now - self._last_check
        self._last_check = now
        if gap > self.interval:
            for w in self._peers.values():
                w.last_reply += gap
        return [
            (ep, now - w.last_reply)
            for ep, w in self._peers.items()
            if w.pinged
            and now - w.last_reply
            > (self.stall if w.connected and not w.timed_out else self.deadline)
        ]

    def forget(self, endpoint: Endpoint) -> None:
        if endpoint in self._peers:
            self._close(endpoint)


def drain(sock: Any, limit: int = 256) -> list[list[Any]]:
    """Every message already queued on ``sock`` (up to ``limit``), without blocking.

    Reading the whole backlog before judging silence matters: a pong may be waiting
    behind other messages.
    """
    out = []
    for _ in range(limit):
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.Again:
            break
    return out
