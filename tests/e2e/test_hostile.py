"""Hostile peers: the bootstrap server's HTTP routes and the live ZMQ control sockets.

HTTP: a real ``NixlPluginKVBootstrapServer`` in this process takes hypothesis-generated and
randomly fuzzed requests (truncated, oversized and wrong-typed JSON, wrong methods, huge
query values). It never answers 500 or with a traceback, answers every refusal with a
4xx that says what is wrong, counts every refusal in ``sgl_nixl_rejected_messages_total``
and still answers ``/health`` afterwards.

ZMQ: a real PD session (prefill and decode rank processes from ``sgl_nixl_plugin.bench``)
is held back at the bootstrap server (in this process) while ``FakeDecode``, a decode rank
made of a real NIXL agent and our wire codec, attacks both control sockets: garbage
frames, mutated valid frames, unknown tags, replayed and out-of-range transfer requests,
credits for slots never granted, forged statuses and staging pieces. Then the session runs
and every room arrives byte-exact, which proves both control threads survived. Counters
come from the rank processes through ``PROMETHEUS_MULTIPROC_DIR``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import random
import re
import socket
import sys
import threading
import time
import types
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
import requests
import zmq
from helpers.hostile import garbage, mutate
from helpers.hostile import random_request as _random_request
from helpers.hostile import raw_garbage as _raw_garbage
from helpers.hostile import route_body as _route_body
from helpers.pd import E2E_ENV, hermetic_environ, session_problems, workload
from helpers.prom import multiproc_registry, rejected_counts
from helpers.waiting import poll_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_nixl_plugin.bench.session import (
    Session,
    SessionConfig,
    SessionResult,
    free_port,
)
from sgl_nixl_plugin.bench.workload import Workload
from sgl_nixl_plugin.transport import bootstrap_client
from sgl_nixl_plugin.wire.codec import MAGIC, Codec, ForeignReply, index_specs
from sgl_nixl_plugin.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    PeerRegistration,
    PieceDone,
    PieceReady,
    Ping,
    Pong,
    RegistrationReply,
    SlotAsk,
    SlotGrant,
    SlotRecall,
    SlotReturn,
    TransferRequest,
    TransferStatus,
)

#: Seconds any single wait in these tests may take (a rank process imports SGLang first).
WAIT_S = 90.0
#: KVPoll values on the wire.
FAILED, SUCCESS = 0, 4


# =========================================================================== helpers


def wait_for(what: str, fn: Callable[[], Any], timeout: float = WAIT_S, every: float = 0.02) -> Any:
    """``fn()`` once it is truthy; fails the test naming ``what``."""
    try:
        return poll_until(fn, bool, timeout, every, what=what)[0]
    except TimeoutError as exc:
        raise AssertionError(str(exc)) from None


# --------------------------------------------------------------------- PD sessions


class LiveSession:
    """A bench session whose rank processes the test starts selectively; always reaped."""

    def __init__(self, cfg: SessionConfig) -> None:
        self.session = Session(cfg)
        self.specs = {(s.role, s.instance, s.tp_rank): s for s in self.session.specs}

    def start(self, *keys: tuple[str, int, int]) -> None:
        with hermetic_environ():
            for key in keys:
                self.session.start_rank(self.specs[key])

    def wait(self) -> SessionResult:
        return self.session.wait()

    def kill(self) -> None:
        """Stop every rank now (used when the test fails before ``wait``)."""
        self.session.done.set()
        if getattr(self.session, "release", None) is not None:
            self.session.release.set()
        for p in self.session.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.session.procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class GatedBootstrap:
    """Our bootstrap server in this process; ``GET /route`` waits for ``open()``.

    Prefill ranks register at once, so their control sockets are live and known; decode
    ranks cannot learn any route (so start no transfer) until the test opens the gate.
    """

    def __init__(self, port: int) -> None:
        from aiohttp import web

        from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer

        self.port = port
        self.gate = threading.Event()
        self.server = NixlPluginKVBootstrapServer(host="127.0.0.1", port=port)
        original = self.server._handle_route_get
        gate = self.gate

        async def gated(request: Any) -> Any:
            if not gate.is_set():
                await asyncio.get_running_loop().run_in_executor(None, gate.wait, 3.0)
            if not gate.is_set():
                return web.Response(status=503, text="held back by the test")
            return await original(request)

        self.server._handle_route_get = gated
        wait_for("the bootstrap server", self._healthy, 30)

    def _healthy(self) -> bool:
        try:
            return (
                requests.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
            )
        except requests.RequestException:
            return False

    def prefill_endpoint(
        self, dp: int = 0, cp: int = 0, tp: int = 0, pp: int = 0
    ) -> tuple[str, int]:
        def lookup() -> tuple[str, int] | None:
            info = self.server.prefill_port_table.get(dp, {}).get(cp, {}).get(tp, {}).get(pp)
            return (info.rank_ip, int(info.rank_port)) if info is not None else None

        return wait_for("the prefill rank's registration", lookup)

    def open(self) -> None:
        self.gate.set()

    def close(self) -> None:
        self.gate.set()
        self.server.close()


# --------------------------------------------------------------------- a fake decode


class FakeDecode:
    """A decode rank made in this process: a real NIXL agent over the same pools a bench
    decode rank allocates, our codec, a ZMQ PULL socket (a pump thread answers pings,
    progresses the agent and queues every other message) and PUSH sockets to peers.

    Set ``UCX_NET_DEVICES=lo`` before creating one (the fixtures do)."""

    def __init__(self, w: Workload, *, instance: int = 0, secret: bytes | None = None) -> None:
        from sgl_nixl_plugin.bench.pools import Pools
        from sgl_nixl_plugin.bench.rank import RankSpec
        from sgl_nixl_plugin.engine.engine import TransferEngine
        from sgl_nixl_plugin.registry import manager as registry
        from sgl_nixl_plugin.sides.memory import compat_of, memory_from_kv_args, to_regions
        from sgl_nixl_plugin.wire.compat import compat_hash

        self.spec = RankSpec("decode", instance, 1, 0, w, bootstrap_port=0)
        self.pools = Pools(self.spec)
        args = self.pools.kv_args(types.SimpleNamespace, self.spec)
        self.compat = compat_of(args, w.shape.mla)
        self.engine = TransferEngine(
            registry.resolve_agent_config(), memory_from_kv_args(args, "DRAM")
        )
        self.name = self.engine.name
        self.codec = Codec(secret)
        self.ctx = zmq.Context()
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self.port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = ("127.0.0.1", self.port)
        mem = self.engine.memory
        self.registration = PeerRegistration(
            compat=self.compat,
            compat_hash=compat_hash(self.compat),
            agent_name=self.name,
            agent_metadata=self.engine.metadata,
            ip="127.0.0.1",
            port=self.port,
            tp_rank=0,
            tp_size=1,
            kv=to_regions(mem.kv),
            aux=to_regions(mem.aux),
            state=[to_regions(s) for s in mem.state],
        )
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.received: list[Any] = []
        self._push: dict[tuple[str, int], Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="fake-decode", daemon=True)
        self._thread.start()

    # -- the pump thread (owns the PULL socket and the sockets that carry pongs) ------
    def _pump(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        replies: dict[tuple[str, int], Any] = {}
        try:
            while not self._stop.is_set():
                if poller.poll(2):
                    while True:
                        try:
                            frames = self._pull.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        decoded = self.codec.decode(frames)
                        if decoded is None:
                            continue
                        msg = decoded.msg
                        if isinstance(msg, Ping):
                            ep = (msg.ip, msg.port)
                            if ep not in replies:
                                replies[ep] = self._socket(ep)
                            pong = Pong(self.name, msg.seq, *self.endpoint)
                            replies[ep].send_multipart(self.codec.encode(pong), zmq.NOBLOCK)
                        self.inbox.put(msg)
                self.engine.agent.progress()  # UCX over TCP needs the target to progress
        finally:
            for s in replies.values():
                s.close(0)

    def _socket(self, ep: tuple[str, int]) -> Any:
        s = self.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.SNDTIMEO, 20000)
        s.setsockopt(zmq.SNDHWM, 100000)
        s.connect(f"tcp://{ep[0]}:{ep[1]}")
        return s

    # -- sending (test thread) ---------------------------------------------------------
    def send_frames(self, ep: tuple[str, int], frames: list[Any]) -> None:
        if ep not in self._push:
            self._push[ep] = self._socket(ep)
        self._push[ep].send_multipart(frames)

    def send(self, ep: tuple[str, int], msg: Any, arrays: tuple = ()) -> list[Any]:
        frames = self.codec.encode(msg, arrays)
        self.send_frames(ep, frames)
        return frames

    def request(
        self,
        ep: tuple[str, int],
        room: int,
        pages: np.ndarray,
        *,
        aux_index: int = -1,
        state: tuple[np.ndarray, ...] = (),
        required: int = 1,
        slots: tuple[int, ...] = (),
        agent: str | None = None,
    ) -> list[Any]:
        kv = np.asarray(pages, dtype=np.int32)
        req = TransferRequest(
            room=room,
            agent_name=agent or self.name,
            ip=self.endpoint[0],
            port=self.port,
            aux_index=aux_index,
            required_dst_info_num=required,
            indices=index_specs(kv, state),
            staged=bool(slots),
            staging_slots=list(slots),
        )
        return self.send(ep, req, (kv, *state))

    # -- receiving (test thread) -------------------------------------------------------
    def wait_for(self, what: str, pred: Callable[[Any], bool], timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        for msg in self.received:
            if pred(msg):
                return msg
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{what}: not received within {timeout:.0f}s; got {self.received[-10:]}"
                )
            try:
                msg = self.inbox.get(timeout=left)
            except queue.Empty:
                continue
            self.received.append(msg)
            if pred(msg):
                return msg

    def drain(self) -> list[Any]:
        while True:
            try:
                self.received.append(self.inbox.get_nowait())
            except queue.Empty:
                return self.received

    def register(self, ep: tuple[str, int]) -> RegistrationReply:
        self.send(ep, self.registration)
        return self.wait_for(
            "a registration reply",
            lambda m: isinstance(m, RegistrationReply) and m.agent_name == self.name,
        )

    def sync(self, ep: tuple[str, int], seq: int) -> None:
        """Ping ``ep`` and wait for its pong: every message sent before has been handled."""
        self.send(ep, Ping(self.name, self.endpoint[0], self.port, seq))
        self.wait_for(f"a pong from {ep}", lambda m: isinstance(m, Pong) and m.seq == seq)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self._push.values():
            s.close(0)
        self._pull.close(0)
        self.ctx.term()
        self.engine.close()


# =========================================================================== HTTP


@dataclass
class Bootstrap:
    url: str
    server: Any
    http: requests.Session = field(default_factory=requests.Session)

    def call(
        self, method: str, path: str, body: bytes | None = None, **kw: Any
    ) -> requests.Response:
        return self.http.request(method, self.url + path, data=body, timeout=10, **kw)


@pytest.fixture
def bootstrap(monkeypatch: pytest.MonkeyPatch) -> Iterator[Bootstrap]:
    """A fresh bootstrap server (no shared secret) in this process."""
    from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer

    monkeypatch.delenv("SGLANG_NIXL_PLUGIN_SECRET", raising=False)
    monkeypatch.delenv("SGLANG_NIXL_PLUGIN_SECRET_FILE", raising=False)
    port = free_port()
    server = NixlPluginKVBootstrapServer(host="127.0.0.1", port=port)
    b = Bootstrap(f"http://127.0.0.1:{port}", server)
    try:
        wait_for("the bootstrap server", lambda: _health(b), 30)
        yield b
    finally:
        b.http.close()
        server.close()


def _health(b: Bootstrap) -> bool:
    try:
        return b.call("GET", "/health").status_code == 200
    except requests.RequestException:
        return False


ALLOWED = {200, 400, 401, 404, 405, 413, 503}


class HttpTally:
    """Checks every answer and tallies the refusals the server must have counted."""

    def __init__(self) -> None:
        self.refusals = 0
        self.by_status: Counter[int] = Counter()

    def check(self, r: requests.Response, what: str) -> None:
        text = r.text
        assert r.status_code in ALLOWED, f"{what} -> {r.status_code}: {text[:300]}"
        assert "Traceback" not in text and 'File "' not in text, (
            f"{what} leaked a traceback: {text[:300]}"
        )
        self.by_status[r.status_code] += 1
        if r.status_code >= 400:
            assert text.strip(), f"{what} -> {r.status_code} without a message"
        if 400 <= r.status_code < 500:
            self.refusals += 1
        if r.status_code == 413:
            assert "larger than" in text
        if r.status_code == 405:
            assert "not allowed" in text.lower()
        if r.status_code == 503:
            assert "not fully registered" in text or "held back" in text


def _http_requests() -> st.SearchStrategy[tuple[str, str, bytes | None]]:
    json_leaf = (
        st.none()
        | st.booleans()
        | st.integers(-(10**30), 10**30)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=12)
    )
    json_value = st.recursive(
        json_leaf,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
        max_leaves=8,
    )
    keys = ["prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank", "junk"]
    query_value = (
        st.sampled_from(["-1", "0", "1", "", "-0", " 1", "1.5", "0x1", "nan"])
        | st.integers(-(10**40), 10**40).map(str)
        | st.text(max_size=20)
    )
    # At most one huge value (5000 digits: beyond int()'s limit), so the request line
    # stays under aiohttp's 8 KiB limit and reaches the application.
    huge = st.one_of(st.none(), st.sampled_from(keys))
    query = st.tuples(st.dictionaries(st.sampled_from(keys), query_value, max_size=5), huge).map(
        lambda t: (
            ("?" + urllib.parse.urlencode({**t[0], **({t[1]: "9" * 5000} if t[1] else {})}))
            if t[0] or t[1]
            else ""
        )
    )
    fields = list(_route_body())

    @st.composite
    def route_body(draw: Any) -> bytes:
        body = _route_body(attn_tp_rank=draw(st.integers(0, 1)))
        action = draw(st.sampled_from(["drop", "retype", "range", "extra", "none"]))
        name = draw(st.sampled_from(fields))
        if action == "drop":
            body.pop(name)
        elif action == "retype":
            body[name] = draw(json_value)
        elif action == "range":
            body[name] = draw(st.integers(-(10**25), 10**25))
        elif action == "extra":
            body[draw(st.sampled_from(["prefill_http_port", "kv_layout", "zz"]))] = draw(json_value)
        raw = json.dumps(body).encode()
        if draw(st.booleans()) and action == "extra":  # JSON numbers no int can hold
            raw = raw[:-1] + b', "prefill_http_port": 1e400}'
        return raw

    @st.composite
    def body(draw: Any) -> bytes | None:
        kind = draw(
            st.sampled_from(["none", "bytes", "json", "route", "truncated", "dp", "rooms", "huge"])
        )
        if kind == "none":
            return None
        if kind == "bytes":
            return draw(st.binary(max_size=300))
        if kind == "json":
            return json.dumps(draw(json_value)).encode()
        if kind == "route":
            return draw(route_body())
        if kind == "truncated":
            raw = json.dumps(_route_body()).encode()
            return raw[: draw(st.integers(0, len(raw) - 1))]
        if kind == "dp":
            return json.dumps(
                {"bootstrap_room": draw(json_value), "dp_rank": draw(json_value)}
            ).encode()
        if kind == "rooms":
            return json.dumps({"bootstrap_rooms": draw(st.lists(json_value, max_size=5))}).encode()
        return b"[" + b"1," * (40 << 10) + b"1]"  # 80 KiB: over the 64 KiB cap

    # Mostly the routes' real methods (so bodies reach the schemas), sometimes anything.
    routes = st.sampled_from(
        [
            ("PUT", "/route"),
            ("GET", "/route"),
            ("POST", "/register_dp_rank"),
            ("POST", "/query_dp_ranks"),
        ]
    ) | st.tuples(
        st.sampled_from(["GET", "PUT", "POST", "DELETE", "PATCH", "OPTIONS"]),
        st.sampled_from(
            ["/route", "/register_dp_rank", "/query_dp_ranks", "/health", "/nope", "/route/x"]
        ),
    )
    return st.tuples(routes, query, body()).map(lambda t: (t[0][0], t[0][1] + t[1], t[2]))


def test_bootstrap_http_fuzz_hypothesis(bootstrap: Bootstrap) -> None:
    tally = HttpTally()
    before = rejected_counts()

    @settings(
        max_examples=250,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(_http_requests())
    def one(req: tuple[str, str, bytes | None]) -> None:
        method, path, body = req
        tally.check(
            bootstrap.call(method, path, body),
            f"{method} {path[:80]} {body[:80] if body else body!r}",
        )

    one()
    after = rejected_counts()
    counted = sum(v - before[k] for k, v in after.items() if k.startswith("http_"))
    assert counted == tally.refusals, (tally.by_status, after - before)
    assert {400, 404, 405, 413} <= set(tally.by_status), tally.by_status
    assert _health(bootstrap)


def test_bootstrap_http_random_fuzz_time_bounded(bootstrap: Bootstrap) -> None:
    rng = random.Random(20241129)
    tally = HttpTally()
    before = rejected_counts()
    deadline = time.monotonic() + 6.0
    sent = 0
    while sent < 1500 and time.monotonic() < deadline:
        method, path, body = _random_request(rng)
        tally.check(
            bootstrap.call(method, path, body),
            f"{method} {path[:80]} {body[:80] if body else body!r}",
        )
        sent += 1
    after = rejected_counts()
    assert sent >= 100
    assert sum(v - before[k] for k, v in after.items() if k.startswith("http_")) == tally.refusals
    assert after["http_malformed"] > before["http_malformed"]
    assert after["http_too_large"] > before["http_too_large"]
    assert _health(bootstrap)


def test_bootstrap_refusals_say_what_is_wrong(bootstrap: Bootstrap) -> None:
    before = rejected_counts()
    cases = [
        (
            "PUT",
            "/route",
            b'{"attn_tp_size": 2, "attn_tp_rank"',
            400,
            "invalid body",
            "http_malformed",
        ),
        (
            "PUT",
            "/route",
            json.dumps(_route_body(attn_tp_size="two")).encode(),
            400,
            "attn_tp_size",
            "http_malformed",
        ),
        (
            "PUT",
            "/route",
            json.dumps(_route_body(rank_port=70000)).encode(),
            400,
            "rank_port",
            "http_malformed",
        ),
        (
            "PUT",
            "/route",
            json.dumps(_route_body()).encode()[:-1] + b', "prefill_http_port": 1e400}',
            400,
            "prefill_http_port",
            "http_malformed",
        ),
        (
            "POST",
            "/register_dp_rank",
            b'{"bootstrap_room": "x", "dp_rank": 0}',
            400,
            "bootstrap_room",
            "http_malformed",
        ),
        (
            "POST",
            "/query_dp_ranks",
            b'{"bootstrap_rooms": [1, null]}',
            400,
            "bootstrap_rooms",
            "http_malformed",
        ),
        (
            "POST",
            "/register_dp_rank",
            b"x" * (70 << 10),
            413,
            "larger than 65536 bytes",
            "http_too_large",
        ),
        (
            "GET",
            "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank="
            + "9" * 5000,
            None,
            503,
            "not fully registered",
            None,
        ),
        ("POST", "/route", None, 405, "not allowed", "http_405"),
        ("GET", "/register_dp_rank", None, 405, "Method Not Allowed", "http_405"),
        ("GET", "/nowhere", None, 404, "Not Found", "http_404"),
        ("GET", "/route?prefill_dp_rank=0", None, 400, "Missing inputs", "http_400"),
    ]
    expected: Counter[str] = Counter()
    for method, path, body, status, words, reason in cases:
        r = bootstrap.call(method, path, body)
        assert (r.status_code, words in r.text) == (status, True), (
            method,
            path[:60],
            r.status_code,
            r.text,
        )
        if reason:
            expected[reason] += 1
    after = rejected_counts()
    for reason, n in expected.items():
        assert after[reason] - before[reason] == n, reason
    # Once ready, a huge rank value is an unknown rank (404), a non-number is a 400.
    for tp in (0, 1):
        assert (
            bootstrap.call(
                "PUT", "/route", json.dumps(_route_body(attn_tp_rank=tp)).encode()
            ).status_code
            == 200
        )
    q = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_pp_rank=0&target_tp_rank="
    assert bootstrap.call("GET", q + "9" * 4000).status_code == 404
    r = bootstrap.call("GET", q + "9" * 5000)
    assert r.status_code == 400 and "digits" in r.text
    r = bootstrap.call("GET", q + "one")
    assert r.status_code == 400 and "'one'" in r.text
    assert bootstrap.call("GET", q + "1").json() == {"rank_ip": "127.0.0.1", "rank_port": 4242}
    assert _health(bootstrap)


def test_bootstrap_readiness_counts_distinct_ranks(bootstrap: Bootstrap) -> None:
    agg = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    rank0 = json.dumps(_route_body(attn_tp_rank=0)).encode()
    for _ in range(5):  # the same rank again and again: still one of two
        assert bootstrap.call("PUT", "/route", rank0).status_code == 200
        assert not bootstrap.server._is_ready()
    r = bootstrap.call("GET", agg)
    assert r.status_code == 503 and "not fully registered" in r.text
    before = rejected_counts()
    # A rank outside its size, or another DP group than the topology has, can't fill the gap.
    for bad, field_name in (
        (dict(attn_dp_rank=3), "attn_dp_rank"),
        (dict(pp_rank=1), "pp_rank"),
        (dict(system_dp_size=2, system_dp_rank=2), "system_dp_rank"),
    ):
        r = bootstrap.call("PUT", "/route", json.dumps(_route_body(attn_tp_rank=1, **bad)).encode())
        assert r.status_code == 400 and field_name in r.text, r.text
        assert not bootstrap.server._is_ready()
    # A rank of another topology gets a 400 naming the field and both values.
    r = bootstrap.call(
        "PUT", "/route", json.dumps(_route_body(attn_tp_size=4, attn_tp_rank=1)).encode()
    )
    assert r.status_code == 400 and "attn_tp_size=4 (registered: 2)" in r.text, r.text
    r = bootstrap.call(
        "PUT", "/route", json.dumps(_route_body(attn_tp_rank=1, attn_dp_size=2)).encode()
    )
    assert r.status_code == 400 and "dp_size=2 (registered: 1)" in r.text, r.text
    assert rejected_counts()["http_inconsistent"] - before["http_inconsistent"] == 5
    assert not bootstrap.server._is_ready()
    assert (
        bootstrap.call(
            "PUT", "/route", json.dumps(_route_body(attn_tp_rank=1)).encode()
        ).status_code
        == 200
    )
    assert bootstrap.server._is_ready()
    r = bootstrap.call("GET", agg)
    assert r.status_code == 200 and r.json()["attn_tp_size"] == 2


def test_bootstrap_files_dp_attention_ranks_as_sglang_sends_them(
    bootstrap: Bootstrap, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--enable-dp-attention --dp-size 2 --tp-size 2``: SGLang 0.5.23's prefill ranks
    register with ``system_dp_size`` 1 and ``system_dp_rank`` = their attention DP rank (the
    DP controller starts each scheduler with it). SGLang files them by attention DP rank;
    refusing rank 1 left the decode waiting for a prefill that never got ready."""
    agg = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    r = bootstrap.call("GET", "/nixl/routes")
    assert r.status_code == 503 and "not fully registered" in r.text, r.text
    for dp in (0, 1):
        body = _route_body(
            attn_tp_size=1,
            attn_dp_size=2,
            attn_dp_rank=dp,
            system_dp_rank=dp,
            rank_port=4242 + dp,
        )
        r = bootstrap.call("PUT", "/route", json.dumps(body).encode())
        assert r.status_code == 200, r.text
    assert bootstrap.server._is_ready()
    r = bootstrap.call("GET", agg)
    assert r.status_code == 200 and r.json()["dp_size"] == 2, r.text
    for dp in (0, 1):
        q = f"/route?prefill_dp_rank={dp}&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        assert bootstrap.call("GET", q).json()["rank_port"] == 4242 + dp
    # Every rank's route in one answer: what the per-rank queries answer, keyed the same way.
    server = bootstrap.url.removeprefix("http://")
    table = bootstrap_client.get_routes(server, None)
    assert table is not None and table.routes == {
        bootstrap_client.route_query(dp, 0, 0, 0): {"rank_ip": "127.0.0.1", "rank_port": 4242 + dp}
        for dp in (0, 1)
    }
    q = bootstrap_client.route_query(1, 0, 0, 0)
    assert bootstrap_client.get_route(server, q, None) == table.routes[q]
    # with the prefill's parallel info as SGLang's topology query gets it (no page size)
    assert table.info == bootstrap.call("GET", agg).json()
    assert table.info["dp_size"] == 2 and table.info["page_size"] is None, table.info
    # a release whose topology handler fails on our call: the routes still, no info (the
    # decode's warm-up then waits for SGLang's own query)
    monkeypatch.setattr(bootstrap.server, "_handle_route_get", _no_topology)
    again = bootstrap_client.get_routes(server, None)
    assert again == bootstrap_client.RouteTable(table.routes, None)


async def _no_topology(request: Any) -> Any:
    raise AttributeError("'SimpleNamespace' object has no attribute 'remote'")


def test_a_bootstrap_without_the_route_table_is_asked_rank_by_rank() -> None:
    """SGLang's own server (and our releases before the table) answer 404: the decode's
    warm-up then asks for each rank's route as before."""
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

    port = free_port()
    server = CommonKVBootstrapServer(host="127.0.0.1", port=port)
    http = requests.Session()
    try:

        def healthy() -> bool:
            try:
                return http.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        wait_for("SGLang's bootstrap server", healthy, 30)
        assert bootstrap_client.get_routes(f"127.0.0.1:{port}", None) is None
    finally:
        http.close()
        server.close()


# =========================================================================== ZMQ


@dataclass
class HostileRun:
    """What one held-back session saw while its control sockets were attacked."""

    result: SessionResult
    metrics: Any
    fake: FakeDecode
    log: str
    rooms: dict[str, int]
    fake_pages: np.ndarray
    out_of_range_status: list[TransferStatus]
    ghost_replies: list[Any]
    garbage_sent: int
    piece_done_after_forgery: list[Any]
    forged_rooms: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    foreign_reply: Any = None


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileRun]:
    """Runs the held-back session and its attacks once for the tests below."""
    mp = pytest.MonkeyPatch()
    prom = tmp_path_factory.mktemp("prom")
    mp.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    mp.setenv("UCX_NET_DEVICES", "lo")
    mp.setenv("SGLANG_NIXL_PLUGIN_BENCH_LOG", "INFO")  # read before the rank applies its env
    for name in ("SGLANG_NIXL_PLUGIN_SECRET", "SGLANG_NIXL_PLUGIN_SECRET_FILE"):
        mp.delenv(name, raising=False)  # no shared secret anywhere in this session
    w = workload("tiny", 16, requests=6, min_tokens=40, max_tokens=120)
    env = {**E2E_ENV, "PROMETHEUS_MULTIPROC_DIR": str(prom), "SGLANG_NIXL_PLUGIN_BENCH_LOG": "INFO"}
    live = LiveSession(SessionConfig(w, timeout_s=100, env=env))
    prefill = live.specs[("prefill", 0, 0)]
    prefill.serve_bootstrap = False  # the gated server below is the bootstrap server
    boot = GatedBootstrap(prefill.bootstrap_port)
    fake = None
    capture = FdCapture()
    try:
        with capture:
            live.start(("prefill", 0, 0), ("decode", 0, 0))
            fake = FakeDecode(w)
            run = _attack(live, boot, fake, w, capture)
        run.log = capture.text
        run.metrics = multiproc_registry(prom)
        yield run
    finally:
        boot.close()
        live.kill()
        if fake is not None:
            fake.close()
        mp.undo()


class FdCapture:
    """Sends what this process and the rank processes it starts write on fds 1 and 2 to a
    file that can be read while they run (a module fixture can't use ``capfd``)."""

    def __init__(self) -> None:
        self._final: str | None = None

    def __enter__(self) -> FdCapture:
        import tempfile

        sys.stdout.flush()
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile()
        self._saved = (os.dup(1), os.dup(2))
        os.dup2(self._file.fileno(), 1)
        os.dup2(self._file.fileno(), 2)
        return self

    @property
    def text(self) -> str:
        if self._final is not None:
            return self._final
        self._file.seek(0)
        return self._file.read().decode("utf-8", "replace")

    def wait_for(self, pattern: str, timeout: float = WAIT_S) -> re.Match[str]:
        rx = re.compile(pattern)
        try:
            return wait_for(
                f"a log line matching {pattern!r}", lambda: rx.search(self.text), timeout, 0.05
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; output so far ends with:\n{self.text[-3000:]}") from None

    def __exit__(self, *exc: Any) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        os.close(self._saved[0])
        os.close(self._saved[1])
        self._final = self.text
        self._file.close()


def _attack(
    live: LiveSession, boot: GatedBootstrap, fake: FakeDecode, w: Workload, log: Any
) -> HostileRun:
    rng = random.Random(7)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    reqs = w.make_requests()
    prefill_ep = boot.prefill_endpoint()
    m = log.wait_for(r"sgl-nixl: decode manager ready \(agent (\S+), .*control ([\d.]+):(\d+)\)")
    decode_ep = (m.group(2), int(m.group(3)))

    timings["ranks_up"] = time.monotonic() - t0
    reply = fake.register(prefill_ep)
    assert reply.accepted, reply.reason
    timings["registered"] = time.monotonic() - t0

    # A decode of another release (protocol v2, 0.4.x) registers: it is refused at once,
    # in its own version's envelope, with a reason naming both versions.
    older = {
        "type": "reg",
        "compat": {"protocol_version": 2},
        "compat_hash": "h",
        "agent_name": "decode-0.4",
        "agent_metadata": b"",
        "ip": "127.0.0.1",
        "port": fake.port,
        "tp_rank": 0,
        "tp_size": 1,
        "kv": [],
        "aux": [],
        "staging": None,
    }
    fake.send_frames(prefill_ep, [MAGIC, msgspec.msgpack.encode([2, time.time(), False, older])])
    foreign = fake.wait_for(
        "a refusal for the v2 decode",
        lambda m: isinstance(m, ForeignReply) and m.agent_name == "decode-0.4",
    )

    # A room the real decode will also fetch: the fake asks for a second copy of it.
    shared = reqs[0]
    fake_pages = np.arange(1, 1 + shared.pages(w.page_size), dtype=np.int32)
    first = fake.request(prefill_ep, shared.room, fake_pages, required=2, slots=(3, 4))
    fake.send_frames(prefill_ep, list(first))  # replayed: a duplicate request
    fake.send(prefill_ep, PieceDone(shared.room, fake.name, 9, 1))  # a slot never granted
    fake.send(prefill_ep, PieceDone(shared.room, fake.name, 3, 1))  # granted, but not in use
    fake.send(prefill_ep, SlotGrant(shared.room, fake.name, 4))  # granted already
    fake.send(prefill_ep, SlotGrant(4242 + 9, fake.name, 1))  # a room it has not: ignored
    # recalls: one for a room it has not, one for the fake's room (its staging takes no
    # returns): neither gives anything back
    fake.send(prefill_ep, SlotRecall(4242 + 10, fake.name))
    fake.send(prefill_ep, SlotRecall(shared.room, fake.name))

    # Out-of-range destinations for a room the real decode fetches later: refused, never stored.
    target = reqs[1]
    n = target.pages(w.page_size)
    pool = w.pool_pages()
    fake.request(prefill_ep, target.room, np.r_[np.arange(1, n), [pool + 5]])
    fake.request(prefill_ep, target.room, np.r_[[-3], np.arange(1, n)])
    fake.request(prefill_ep, target.room, np.arange(1, n + 1), aux_index=1 << 20)
    # A request from an agent that never registered is refused to the address it names.
    ghost_room = 4242
    fake.request(prefill_ep, ghost_room, np.arange(1, 3), agent="ghost-agent")

    garbage_sent = 0
    bases = [
        fake.codec.encode(PieceDone(ghost_room + 1, "ghost", 1, 1)),
        fake.codec.encode(Abort(ghost_room + 2, "127.0.0.1", 1)),
        fake.codec.encode(Pong("ghost", 1, "127.0.0.1", 1)),
        fake.codec.encode(TransferStatus(ghost_room + 3, FAILED, 0, "forged", "127.0.0.1", 1)),
        fake.codec.encode(AbortAck(ghost_room + 4, 0)),
    ]
    deadline = time.monotonic() + 10.0
    for i in range(1500):
        if time.monotonic() > deadline:
            break
        if i % 3 == 0:
            fake.send_frames(prefill_ep, garbage(rng))
            garbage_sent += 1
        else:
            fake.send_frames(prefill_ep, mutate(rng, list(rng.choice(bases))))
    fake.sync(prefill_ep, 1)  # the prefill's control thread handled all of it, and answers
    timings["prefill_fuzzed"] = time.monotonic() - t0

    statuses = [
        msg for msg in fake.drain() if isinstance(msg, TransferStatus) and msg.room == target.room
    ]
    ghost_replies = [
        msg
        for msg in fake.received
        if getattr(msg, "room", None) == ghost_room
        or getattr(msg, "agent_name", None) == "ghost-agent"
    ]

    # The decode's control socket: garbage, forged statuses and a forged staging piece.
    decode_bases = [
        fake.codec.encode(TransferStatus(ghost_room + 5, SUCCESS, 0, "", "127.0.0.1", 1)),
        fake.codec.encode(TransferStatus(ghost_room + 6, FAILED, 0, "forged", "127.0.0.1", 1)),
        fake.codec.encode(Pong("ghost", 2, "127.0.0.1", 1)),
        fake.codec.encode(AbortAck(ghost_room + 7, 0, 3)),
    ]
    forged_rooms = rng.sample(range(1, 1 << 62), 200)
    for room in forged_rooms:
        fake.send(
            decode_ep,
            TransferStatus(room, rng.choice([FAILED, SUCCESS, 1, 3]), 0, "forged", "127.0.0.1", 1),
        )
    forged_piece = PieceReady(
        room=ghost_room + 8,
        prefill_rank=0,
        ip=fake.endpoint[0],
        port=fake.port,
        slot=0,
        r0=0,
        r1=1,
        j0=0,
        j1=1,
        page_start=0,
        page_count=1,
        unit_len=64,
        units_per_item=1,
        dst_stride=64,
        dst_offset=0,
        seq=1,
    )
    fake.send(decode_ep, forged_piece)
    # a slot ask for a room this decode does not stage, from a rank that does not serve it
    fake.send(decode_ep, SlotAsk(ghost_room + 9, fake.name, fake.endpoint[0], fake.port))
    # slots given back for a room this decode does not stage: refused, nothing freed
    fake.send(
        decode_ep, SlotReturn(ghost_room + 11, fake.name, fake.endpoint[0], fake.port, [0, 1])
    )
    deadline = time.monotonic() + 8.0
    for i in range(900):
        if time.monotonic() > deadline:
            break
        if i % 3 == 0:
            fake.send_frames(decode_ep, garbage(rng))
            garbage_sent += 1
        else:
            fake.send_frames(decode_ep, mutate(rng, list(rng.choice(decode_bases))))
    fake.sync(decode_ep, 2)
    timings["decode_fuzzed"] = time.monotonic() - t0
    log.wait_for(r"dropped control message from 127\.0\.0\.1:\d+: bad_piece", 30)
    piece_done = [msg for msg in fake.drain() if isinstance(msg, PieceDone)]

    boot.open()  # now the real session runs on the same prefill and decode
    result = live.wait()
    fake.drain()
    timings["session_done"] = time.monotonic() - t0
    return HostileRun(
        result=result,
        metrics=None,
        fake=fake,
        log="",
        rooms={"shared": shared.room, "target": target.room, "ghost": ghost_room},
        fake_pages=fake_pages,
        out_of_range_status=statuses,
        ghost_replies=ghost_replies,
        garbage_sent=garbage_sent,
        piece_done_after_forgery=piece_done,
        timings=timings,
        forged_rooms=forged_rooms,
        foreign_reply=foreign,
    )


def test_session_after_attacks_is_byte_exact(hostile: HostileRun) -> None:
    """Both control threads survived: every room arrives byte-exact and every per-room
    table of both ranks drains (nothing the attacks sent was stored)."""
    print("phases (s since start):", hostile.timings)
    problems = session_problems(hostile.result)
    assert not problems, "\n".join(problems[:30]) + "\n" + hostile.log[-3000:]
    assert hostile.result.prefill[(0, 0)]["tables"]["nixl.xfer"] == 0


def test_garbage_is_counted_not_fatal(hostile: HostileRun) -> None:
    counts = rejected_counts(hostile.metrics)
    codec_level = sum(
        counts[k]
        for k in (
            "not_ours",
            "malformed",
            "protocol_version",
            "frame_count",
            "index_frame_size",
            "oversized",
            "duplicate_kv_frame",
            "unexpected",
        )
    )
    assert hostile.garbage_sent > 500
    assert codec_level >= hostile.garbage_sent, counts
    assert counts["not_ours"] > 0 and counts["malformed"] > 0 and counts["protocol_version"] > 0, (
        counts
    )
    assert counts["frame_count"] > 0, counts
    assert counts["internal_error"] == 0, counts
    # one log line per reason per second, not one per message
    assert hostile.log.count("dropped control message") < hostile.garbage_sent / 5


def test_replayed_request_and_bad_credits_are_refused(hostile: HostileRun) -> None:
    counts = rejected_counts(hostile.metrics)
    assert counts["duplicate_request"] == 1, counts
    # slot 9 never granted; slot 3 granted but free; slot 4 granted a second time
    assert counts["bad_credit"] == 3, counts
    # The fake's copy of the shared room still arrived whole and exactly once.
    fake = hostile.fake
    shared = hostile.rooms["shared"]
    done = [m for m in fake.received if isinstance(m, TransferStatus) and m.room == shared]
    assert [m.status for m in done] == [SUCCESS], done
    assert fake.pools.check(shared, hostile.fake_pages) == 0


def test_out_of_range_pages_fail_the_target_without_a_write(hostile: HostileRun) -> None:
    statuses = hostile.out_of_range_status
    assert len(statuses) == 3 and {s.status for s in statuses} == {FAILED}, statuses
    reasons = [s.reason for s in statuses]
    assert "destination page index out of range" in reasons[0] and "not within [0," in reasons[0]
    assert "[-3," in reasons[1]
    assert "aux row index out of range" in reasons[2]
    assert rejected_counts(hostile.metrics)["index_out_of_range"] == 3
    # No byte landed in the fake outside the shared room's pages ...
    pools, pages = hostile.fake.pools, hostile.fake_pages
    untouched = np.setdiff1d(np.arange(pools.pages), pages)
    for r in range(len(pools.kv)):
        assert not pools.region_words(r)[untouched].any(), (
            f"region {r} was written outside the room"
        )
    # ... and the refused room was then served to the real decode, byte-exact.
    d = hostile.result.decode_results()[hostile.rooms["target"]]
    assert d["ok"] and d["bad_pages"] == 0, d


def test_a_decode_of_another_release_is_refused_naming_both_versions(hostile: HostileRun) -> None:
    reply = hostile.foreign_reply
    assert reply.version == 2 and not reply.accepted, reply
    assert "decode speaks v2" in reply.reason and f"v{PROTOCOL_VERSION}" in reply.reason, (
        reply.reason
    )
    assert "same sgl-nixl-plugin release" in reply.reason
    assert "refused decode decode-0.4" in hostile.log


def test_unregistered_agent_is_told_to_register(hostile: HostileRun) -> None:
    status = [m for m in hostile.ghost_replies if isinstance(m, TransferStatus)]
    retry = [m for m in hostile.ghost_replies if isinstance(m, RegistrationReply)]
    assert len(status) == 1 and status[0].status == FAILED and "no registration" in status[0].reason
    assert len(retry) == 1 and retry[0].retry and not retry[0].accepted


def test_decode_drops_forged_statuses_and_pieces(hostile: HostileRun) -> None:
    counts = rejected_counts(hostile.metrics)
    assert counts["bad_piece"] == 1, counts
    assert counts["bad_ask"] == 1, counts  # and no slot was granted for it
    assert counts["bad_return"] == 1, counts
    assert not [m for m in hostile.fake.received if isinstance(m, SlotGrant)]
    assert not [m for m in hostile.fake.received if isinstance(m, SlotReturn)]  # recalls: none
    assert hostile.piece_done_after_forgery == []  # nothing was scattered
    assert not [m for m in hostile.fake.received if isinstance(m, PieceDone)]
    m = re.search(
        r"dropped control message from 127\.0\.0\.1:\d+: bad_piece \(room (\d+): ([^)]*)\)",
        hostile.log,
    )
    assert m and int(m.group(1)) == hostile.rooms["ghost"] + 8 and "not granted" in m.group(2), (
        hostile.log[-2000:]
    )
    # Forged statuses for rooms it never had were dropped quietly: no trace in the
    # decode's tables, nothing logged about those rooms.
    tables = hostile.result.decode[(0, 0)]["tables"]
    assert tables["request_status"] == tables["failure_records"] == 0, tables
    assert len(hostile.forged_rooms) == 200
    assert not [room for room in hostile.forged_rooms if str(room) in hostile.log]


def _send_raw(port: int, raw: bytes) -> None:
    """Send ``raw`` on a connection of its own, then read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass


def test_bootstrap_fuzz_leaves_no_traceback_in_the_log(
    bootstrap: Bootstrap, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """Garbage HTTP is refused in one log line per request, never with a traceback: neither
    our handlers nor aiohttp's request handling may log one (an operator's log must not fill
    with stack traces that look like bugs)."""
    rng = random.Random(20261201)
    tally = HttpTally()
    before = rejected_counts()
    port = int(bootstrap.url.rsplit(":", 1)[1])
    with caplog.at_level(logging.DEBUG):
        for _ in range(300):
            method, path, body = _random_request(rng)
            tally.check(bootstrap.call(method, path, body), f"{method} {path[:80]}")
        for raw in _raw_garbage(rng, 100):  # not HTTP at all, or broken framing
            _send_raw(port, raw)
        assert _health(bootstrap)
    out, err = capfd.readouterr()
    traced = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not traced, [(r.name, r.getMessage()[:200]) for r in traced[:5]]
    assert "Traceback" not in out + err, (out + err)[:2000]
    assert tally.refusals > 100
    # each unparsable request: one WARNING line, counted
    lines = [r for r in caplog.records if "malformed HTTP request from" in r.getMessage()]
    assert all(r.levelname == "WARNING" for r in lines)
    bad = rejected_counts()["http_bad_framing"] - before["http_bad_framing"]
    assert bad == len(lines) > 30, (bad, len(lines))


def test_non_http_bytes_at_the_bootstrap_are_counted_at_a_servers_log_level(
    bootstrap: Bootstrap, caplog: pytest.LogCaptureFixture
) -> None:
    """Bytes that are not HTTP at all (a bad method token as a connection's first request)
    are refused, counted and logged in one WARNING line at the level a server runs at:
    aiohttp reports them at DEBUG only, which a server's INFO level never creates, so
    the chaos soak once saw raw garbage neither counted nor logged."""
    port = int(bootstrap.url.rsplit(":", 1)[1])
    good = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    forms = [b"\x00\xff" + good, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"]
    before = rejected_counts()["http_bad_framing"]
    with caplog.at_level(logging.INFO):
        assert logging.getLogger("aiohttp.server").getEffectiveLevel() == logging.INFO
        for raw in forms:
            _send_raw(port, raw)
        assert _health(bootstrap)
    lines = [r for r in caplog.records if "malformed HTTP request from" in r.getMessage()]
    assert [r.levelname for r in lines] == ["WARNING"] * len(forms), [
        r.getMessage() for r in caplog.records
    ]
    assert rejected_counts()["http_bad_framing"] - before == len(forms)


def test_every_bootstrap_refusal_leaves_one_log_line(
    bootstrap: Bootstrap, caplog: pytest.LogCaptureFixture
) -> None:
    """Refusals from the routing layer (unknown route, wrong method) and SGLang's own
    handlers (missing inputs, unknown rank) are counted like ours, and each leaves one
    WARNING line naming the status, the request and the peer, as ours do."""
    before = rejected_counts()
    cases = [
        ("GET", "/nowhere", None, 404),
        ("POST", "/route", None, 405),
        ("GET", "/route?prefill_dp_rank=0", None, 400),  # SGLang: missing inputs
        ("PUT", "/route", b'{"attn_tp_size": 2', 400),  # ours: malformed body
    ]
    with caplog.at_level(logging.DEBUG):
        for method, path, body, status in cases:
            assert bootstrap.call(method, path, body).status_code == status, (method, path)
    after = rejected_counts()
    counted = sum(after[k] - before[k] for k in after if k.startswith("http_"))
    lines = [
        r
        for r in caplog.records
        if re.match(r"sgl-nixl bootstrap: 4\d\d for [A-Z]+ /\S* from 127\.0\.0\.1", r.getMessage())
    ]
    assert counted == len(cases), (before, after)
    assert [r.levelname for r in lines] == ["WARNING"] * len(cases), [r.getMessage() for r in lines]
    assert [int(r.getMessage().split()[2]) for r in lines] == [c[3] for c in cases]
