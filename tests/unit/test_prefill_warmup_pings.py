"""A prefill stays answerable while it waits for a warm-up WRITE.

The control thread WRITEs to a newly registered decode before it replies. On a loaded host
that WRITE once took 7.9 s (the real-server stage, DP attention, two cores), longer than the
5 s a decode waits for a pong, so the decode took the prefill for dead. The control thread
now answers pings between its polls of the WRITE and holds every other message, handled in
arrival order once the registration is done.

The control thread runs on a real ZMQ socket with our codec; only the engine is a stand-in
whose warm-up takes as long as it takes a pong to go out (bounded at 5 s).
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import zmq
from helpers.zmq_pair import loopback_pair

from sgl_nixl_plugin.adapter.prefill_control import PrefillControl
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.messages import Ping, Pong, SlotAsk

WARM_BOUND_S = 5.0


class SlowWarmEngine:
    """``warm`` polls (calling ``idle``, as the real engine does) until a pong was sent."""

    def __init__(self, sent: list[tuple[str, Any]]) -> None:
        self.sent = sent
        self.pong_during_warm_up = False

    def warm(
        self, link: Any, timeout_s: float = 1.0, idle: Callable[[], object] | None = None
    ) -> float:
        started = time.monotonic()
        while time.monotonic() - started < WARM_BOUND_S:
            if idle is not None:
                idle()
            if any(isinstance(m, Pong) for _, m in self.sent):
                self.pong_during_warm_up = True
                break
            time.sleep(0.001)
        return time.monotonic() - started


@pytest.fixture
def control() -> Iterator[tuple[PrefillControl, Any, list[tuple[str, Any]], Codec]]:
    with loopback_pair() as (zctx, pull, push, port):
        codec = Codec()
        sent: list[tuple[str, Any]] = []  # ("send", msg) and ("reject", reason) in order
        ctx = types.SimpleNamespace(
            settings=replace(Settings(), warmup=True, warmup_timeout_s=30.0),
            zmq_ctx=zctx,
            server_socket=pull,
            codec=codec,
            me=types.SimpleNamespace(name="prefill-0", ip="127.0.0.1", port=port),
            send=lambda endpoint, msg, *a: sent.append(("send", msg)) or True,
            reject=lambda reason, detail="", *a: sent.append(("reject", f"{reason}: {detail}")),
            staging=None,
            warmups=0,
        )
        ctx.engine = SlowWarmEngine(sent)
        ctl = PrefillControl(ctx, wake=lambda room: None, recall=lambda room: None)
        try:
            yield ctl, push, sent, codec
        finally:
            ctl.watch.close()


def _until_readable(sock: Any) -> None:
    assert sock.poll(5000, zmq.POLLIN), "the test's frames never reached the socket"


def test_pings_are_answered_during_a_warm_up_and_the_rest_waits_in_order(control) -> None:
    ctl, push, sent, codec = control
    push.send_multipart(codec.encode(SlotAsk(7, "decode-a", "127.0.0.1", 1)))
    push.send_multipart(codec.encode(Ping("decode-a", "127.0.0.1", 2, 41)))
    push.send_multipart(codec.encode(SlotAsk(8, "decode-a", "127.0.0.1", 1)))
    _until_readable(ctl.sock)

    started = time.monotonic()
    ms = ctl._warm(link=None, agent="decode-a", staging=None, scratch=None)
    took = time.monotonic() - started

    assert ctl.ctx.engine.pong_during_warm_up, f"no pong while warming ({took:.1f}s): {sent}"
    assert ms is not None and took < WARM_BOUND_S
    pongs = [m for kind, m in sent if isinstance(m, Pong)]
    assert [p.seq for p in pongs] == [41] and pongs[0].sender == "prefill-0"
    assert [k for k, _ in sent] == ["send"], sent  # nothing else handled yet

    ctl.on_batch_end()  # after the registration's batch: the held messages, in order
    rejects = [m for kind, m in sent if kind == "reject"]
    assert len(rejects) == 2 and all("SlotAsk" in r for r in rejects), sent
    assert ctl.ctx.warmups == 1
