"""The control transport's cached sockets (``transport.transport``): kept while their peer
is there, replaced once their monitor saw it go, and the replacement reaches the peer's
next incarnation. Real ZMQ on 127.0.0.1."""

from __future__ import annotations

import zmq

from sgl_nixl_plugin.transport.transport import Transport
from sgl_nixl_plugin.wire.codec import Codec

WAIT_MS = 10_000  # any single event below must come within this


def _pull(ctx: zmq.Context, port: int | None = None) -> tuple[zmq.Socket, int]:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    if port is None:
        return sock, sock.bind_to_random_port("tcp://127.0.0.1")
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock, port


def test_a_socket_is_kept_while_its_peer_is_there_and_replaced_once_it_went() -> None:
    ctx = zmq.Context()
    pull, port = _pull(ctx)
    url = f"tcp://127.0.0.1:{port}"
    transport = Transport(ctx, Codec(), lambda ep: (url, False))
    try:
        first = transport.connect(url)
        transport.send_frames(url, [b"one"])
        assert pull.poll(WAIT_MS) and pull.recv_multipart() == [b"one"]
        assert transport.connect(url) is first  # connected, no disconnect seen: kept
        pull.close()
        assert transport.monitors[url].poll(WAIT_MS), "no disconnect event within 10 s"
        second = transport.connect(url)
        assert second is not first and first.closed
        assert transport.connect(url) is second  # the new one has seen no disconnect
        pull, _ = _pull(ctx, port)  # the peer back on its port
        transport.send_frames(url, [b"two"])
        assert pull.poll(WAIT_MS) and pull.recv_multipart() == [b"two"]
    finally:
        pull.close()
        transport.close()
        ctx.term()
