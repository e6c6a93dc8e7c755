"""Liveness tells a busy peer from a lost one (``PeerWatch``, real ZMQ on 127.0.0.1).

Pongs come from a peer's control thread, which can be away from its socket for seconds on a
starved machine (a warm-up inside NIXL, a batch of messages): that used to read as a lost
peer after ``misses`` intervals and fail every room it served. ZMTP heartbeats come from
ZMQ's I/O thread instead: while they flow, unanswered pings get ``stall_s``; when they stop
(a frozen process, a cut network) the peer is judged silent within the old deadline; a peer
that exits is still reported at once.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from sgl_nixl_plugin.transport.liveness import Endpoint, PeerWatch

INTERVAL_S, MISSES, STALL_S = 0.1, 3, 2.0
DEADLINE_S = INTERVAL_S * MISSES
MARGIN_S = 1.0  # scheduling slack on a loaded 2-core machine

# a peer that binds a PULL socket and never reads it: its I/O thread alone answers
_PEER = (
    "import sys, time, zmq\n"
    "s = zmq.Context().socket(zmq.PULL)\n"
    "print(s.bind_to_random_port('tcp://127.0.0.1'), flush=True)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


@pytest.fixture
def zctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def peer_process() -> Iterator[tuple[subprocess.Popen, Endpoint]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER, "60"], stdout=subprocess.PIPE, text=True
    )  # exits by itself after 60 s; stopped by its pid below
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the peer process did not print its port within 30 s"
        port = int(proc.stdout.readline())
        yield proc, ("127.0.0.1", port)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _watch(watch: PeerWatch, seconds: float, replies_from: Endpoint | None = None) -> tuple:
    """Run a control thread's liveness duties for up to ``seconds``: monitor events, pings,
    the silence check (and pongs from ``replies_from``); stop at the first verdict. Returns
    (losses, silences, seconds elapsed)."""
    started = time.monotonic()
    lost: list[Any] = []
    while time.monotonic() - started < seconds:
        for sock, _ in watch.poller.poll(20):
            lost += watch.on_monitor(sock)
        if replies_from is not None:
            watch.replied(replies_from)
        watch.ping(lambda seq: [b"ping", str(seq).encode()])
        silent = watch.silent()
        if lost or silent:
            return lost, silent, time.monotonic() - started
    return lost, [], time.monotonic() - started


@pytest.fixture
def watch(zctx) -> Iterator[PeerWatch]:
    w = PeerWatch(zctx, INTERVAL_S, MISSES, stall_s=STALL_S)
    yield w
    w.close()


def _connected(watch: PeerWatch, ep: Endpoint) -> None:
    """Watch and ping ``ep``, and wait (bounded) until its connection is up."""
    watch.sync({ep}, {ep})
    deadline = time.monotonic() + 10
    while not watch._peers[ep].connected:
        assert time.monotonic() < deadline, "never connected"
        for sock, _ in watch.poller.poll(20):
            assert not watch.on_monitor(sock)


def test_a_peer_whose_thread_does_not_answer_is_given_the_stall_bound(zctx, watch) -> None:
    pull = zctx.socket(zmq.PULL)  # never read: only ZMQ's I/O thread answers
    ep = ("127.0.0.1", pull.bind_to_random_port("tcp://127.0.0.1"))
    _connected(watch, ep)
    lost, silent, waited = _watch(watch, STALL_S + MARGIN_S)
    assert not lost
    assert [e for e, _ in silent] == [ep], f"no verdict in {waited:.1f}s"
    # not at the ping deadline (0.3 s): the heartbeats said the process lives. The silence
    # is counted from the watch's start (in ``_connected``), before ``waited``'s clock.
    ((_, quiet),) = silent
    assert quiet >= STALL_S and waited <= STALL_S + MARGIN_S, (quiet, waited)
    pull.close(linger=0)


def test_a_frozen_peer_is_judged_silent_within_the_deadline(watch, peer_process) -> None:
    proc, ep = peer_process
    _connected(watch, ep)
    assert _watch(watch, 3 * DEADLINE_S)[:2] == ([], [])  # alive: no verdict
    os.kill(proc.pid, signal.SIGSTOP)
    lost, silent, waited = _watch(watch, STALL_S)
    assert not lost, lost  # a heartbeat timeout is not an exit
    assert [e for e, _ in silent] == [ep], f"no verdict in {waited:.1f}s"
    assert waited <= DEADLINE_S + MARGIN_S, waited


def test_a_peer_that_exits_is_reported_at_once(watch, peer_process) -> None:
    proc, ep = peer_process
    _connected(watch, ep)
    os.kill(proc.pid, signal.SIGKILL)
    lost, silent, waited = _watch(watch, STALL_S, replies_from=ep)
    assert lost[0] == (ep, "closed its connection (the process exited or restarted)")
    assert not silent and waited < DEADLINE_S, waited


def test_a_peer_that_exits_while_this_thread_is_stalled_is_still_reported_at_once(
    watch, peer_process
) -> None:
    """The control thread is away (CPU or GIL starvation) when the peer dies: the reset
    waits in the monitor, and the last pong looks older than a heartbeat timeout's silence.
    That is the thread's stall, not the peer's: it is reported as an exit, not judged by
    the ping deadline (a killed prefill's rooms once took 3.6 s to fail so)."""
    proc, ep = peer_process
    _connected(watch, ep)
    watch.replied(ep)
    watch.silent()
    os.kill(proc.pid, signal.SIGKILL)
    time.sleep(5 * INTERVAL_S)  # the control thread's stall: nothing is polled meanwhile
    lost, silent, waited = _watch(watch, STALL_S)
    assert lost[:1] == [(ep, "closed its connection (the process exited or restarted)")], silent
    assert not silent and waited < DEADLINE_S, waited


class _Link:
    """A TCP relay on 127.0.0.1 that can be cut: ``cut()`` stops forwarding on open
    connections (no reset: a partition) and closes the listener, so every new connection
    is refused, as when the peer died behind a partition and the link then came back."""

    def __init__(self, target: Endpoint) -> None:
        self.target = target
        self.cut_now = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint: Endpoint = ("127.0.0.1", self.listener.getsockname()[1])
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed by cut()
            far = socket.create_connection(self.target, timeout=10)
            self.conns += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if not self.cut_now.is_set():
                dst.sendall(data)

    def cut(self) -> None:
        self.cut_now.set()
        try:  # wakes the blocked accept(); close() alone would leave the port listening
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut
        self.listener.close()

    def close(self) -> None:
        self.cut()
        for s in self.conns:
            s.close()


def test_a_peer_lost_behind_a_partition_is_reported_once_it_owes_nothing(zctx, watch) -> None:
    """Its connection was closed for missed heartbeats while it owed us data, and then its
    rooms ended some other way (a timeout, its own failure notice): nothing judges its
    silence any more, so refused reconnections must report it, or it is watched (and its
    NIXL peer kept) forever."""
    pull = zctx.socket(zmq.PULL)
    link = _Link(("127.0.0.1", pull.bind_to_random_port("tcp://127.0.0.1")))
    try:
        ep = link.endpoint
        _connected(watch, ep)
        watch._peers[ep].sock.send(b"hello")  # through the relay: the handshake is done
        assert pull.poll(10_000), "nothing came through the relay"
        link.cut()
        deadline = time.monotonic() + 10
        while watch._peers[ep].connected:  # ZMQ closes it once heartbeats stop
            assert time.monotonic() < deadline, "the heartbeat timeout never closed it"
            for sock, _ in watch.poller.poll(20):
                assert not watch.on_monitor(sock)  # silence, not an exit
            watch.silent()  # as a control thread checks, at least every interval
        assert watch._peers[ep].timed_out
        watch.sync({ep}, set())  # its rooms ended: watched, no longer pinged
        lost, silent, waited = _watch(watch, 5.0)
        assert lost == [(ep, "refuses connections (nothing listens there: not running)")], (
            f"no verdict in {waited:.1f}s"
        )
        assert not silent
    finally:
        link.close()
        pull.close(linger=0)
