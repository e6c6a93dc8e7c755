"""Port of SGLang's ZMQ reconnect test to our prefill manager's outbound control sockets.

Upstream: sgl-project/sglang ``test/registered/unit/disaggregation/test_common_zmq_reconnect.py``
at commit 3b64f4e22ef8c28ad364ac07f21e145a46f19e8a. Upstream checks, on a bare manager
with a mocked ZMQ context, that ``CommonKVManager._connect`` does not switch automatic
reconnection off (``ZMQ_RECONNECT_IVL = -1``). SGLang 0.5.23's ``_connect`` still sets
-1 (the test comes from a later version); our manager sends every prefill->decode message
(statuses, ABORT_ACKs, registration replies, pongs) through its own ``_connect``, which keeps
reconnecting. The first test asks the socket itself; the second shows what the option would
cost: a decode rank that comes back on the same address after the prefill messaged it while
it was down would never hear from that prefill again, although every send reported success.
"""

from __future__ import annotations

import socket

import pytest
import zmq

from ._harness import wait_for

pytestmark = pytest.mark.timeout(60)


def test_status_socket_keeps_automatic_reconnect_enabled(cluster):
    mgr = cluster.prefill
    endpoint = f"tcp://127.0.0.1:{cluster.free_port()}"
    sock = mgr._connect(endpoint)
    try:
        assert sock.getsockopt(zmq.RECONNECT_IVL) != -1
    finally:
        _drop_cached(mgr, endpoint)


def test_messages_reach_a_decode_that_came_back_on_the_same_address(cluster):
    from sgl_nixl_plugin.wire.messages import Pong

    mgr = cluster.prefill
    port = cluster.free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ctx = zmq.Context()
    seq = iter(range(1, 10_000))

    def pong() -> bool:
        return mgr.transport.send(
            ("127.0.0.1", port), Pong(mgr.engine.name, next(seq), mgr.local_ip, mgr.rank_port)
        )

    def listen() -> zmq.Socket:
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(endpoint)
        return pull

    try:
        pull = listen()
        assert pong()
        assert pull.poll(5000), "the first decode incarnation never got a message"
        pull.recv_multipart()
        pull.close(0)  # the decode process goes away ...
        # ... the prefill sees the disconnect, then has something to tell it (a Failed
        # status for its rooms, a pong): sent into a fresh socket, nothing listens yet
        wait_for(lambda: _disconnect_seen(mgr, endpoint), 5, "the prefill to see the disconnect")
        assert pong()
        _after_pending_connects(mgr)  # that socket's connect attempt was refused ...
        pull = listen()  # ... and then the decode is back on the same address

        def delivered() -> bool:
            assert pong(), "send_to reported a failure"
            return bool(pull.poll(50))

        wait_for(delivered, 3, "a message to reach the decode that came back")
    finally:
        _drop_cached(mgr, endpoint)
        ctx.destroy(linger=0)


def _disconnect_seen(mgr, endpoint: str) -> bool:
    """Whether the cached socket's monitor already holds its DISCONNECTED event."""
    monitor = mgr._monitor_cache.get(endpoint)
    return monitor is not None and bool(monitor.poll(0))


def _after_pending_connects(mgr) -> None:
    """Return once the connects the manager's ZMQ context had queued were attempted.

    The context's I/O thread runs connects in order, so when one queued after them has
    completed its TCP handshake (seen by accepting it here), their SYNs left before it:
    on loopback, one to a port nobody listens on has been refused by then.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(5)
        probe = mgr._zmq_ctx.socket(zmq.PUSH)
        probe.setsockopt(zmq.LINGER, 0)
        try:
            probe.connect(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
            conn, _ = listener.accept()
            conn.close()
        finally:
            probe.close(0)


def _drop_cached(mgr, endpoint: str) -> None:
    with mgr._socket_lock:
        sock = mgr._socket_cache.pop(endpoint, None)
        monitor = mgr._monitor_cache.pop(endpoint, None)
    if sock is not None:
        sock.close(linger=0)
    if monitor is not None:
        monitor.close()
