"""Peer liveness by ping/pong over the control channel, only while work is pending.

A peer with rooms in flight is pinged every ``interval``; one that has not answered for
``misses`` intervals is declared dead, so its rooms fail in about a second and a half
(SGLang's HTTP heartbeat takes ten seconds and misses a dead rank behind a live
bootstrap server). Peers with nothing pending are not pinged at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

Endpoint = tuple[str, int]


@dataclass
class _Peer:
    seq: int = 0
    last_reply: float = field(default_factory=time.monotonic)
    last_ping: float = 0.0


class Liveness:
    def __init__(self, interval_s: float, misses: int) -> None:
        self.interval = interval_s
        self.deadline = interval_s * misses
        self._peers: dict[Endpoint, _Peer] = {}

    def watch(self, endpoints: set[Endpoint]) -> list[tuple[Endpoint, int]]:
        """Track exactly ``endpoints``; returns the (endpoint, seq) pings due now."""
        now = time.monotonic()
        for gone in set(self._peers) - endpoints:
            del self._peers[gone]
        due = []
        for ep in endpoints:
            peer = self._peers.setdefault(ep, _Peer(last_reply=now))
            if now - peer.last_ping >= self.interval:
                peer.seq += 1
                peer.last_ping = now
                due.append((ep, peer.seq))
        return due

    def replied(self, endpoint: Endpoint) -> None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            peer.last_reply = time.monotonic()

    def dead(self) -> list[tuple[Endpoint, float]]:
        """Endpoints silent past the deadline, with how long they have been silent."""
        now = time.monotonic()
        out = [(ep, now - p.last_reply) for ep, p in self._peers.items() if now - p.last_reply > self.deadline]
        for ep, _ in out:
            del self._peers[ep]
        return out
