"""A loopback PULL socket with a PUSH connected to it, for tests that drive a control thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq


@contextmanager
def loopback_pair() -> Iterator[tuple[zmq.Context, Any, Any, int]]:
    """``(context, pull, push, port)``: ``pull`` bound on 127.0.0.1, everything closed after."""
    zctx = zmq.Context()
    pull = zctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield zctx, pull, push, port
    finally:
        push.close(0)
        pull.close(0)
        zctx.term()
