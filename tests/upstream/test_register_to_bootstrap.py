"""Port of SGLang's register-to-bootstrap tests to our prefill manager.

Upstream: sgl-project/sglang ``test/registered/unit/disaggregation/test_register_to_bootstrap.py``
at commit 03712314bf098fbac339d4b281593306a6c8bb03 (the directory listing names
6bcff3531081f692488221252c2fe506622c7cb6). Upstream binds
``CommonKVManager.register_to_bootstrap`` to a mock manager and patches ``requests.put``
and the module's ``time``. Here the method runs on our live prefill manager (whose
``_register_topology_row`` replaces SGLang's retry loop); ``requests.put`` is patched the
same way upstream patches it (it is the same function object), and ``time.sleep`` is
recorded instead of slept, on this thread only. One more test lets the real HTTP request
fail because nothing listens yet, and brings our bootstrap server up during the backoff.

Our loop's constants differ from SGLang's by design (first delay 0.5 s, doubling, cap 8 s,
no jitter; SGLang: 1 s, doubling, cap 30 s, x[0.75, 1)), so the backoff tests assert the
shape (exponential, bounded by SGLang's cap) rather than SGLang's exact numbers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import requests

from ._harness import wait_for

pytestmark = pytest.mark.timeout(60)

REQUIRED_FIELDS = (
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_ip",
    "rank_port",
    "page_size",
    "kv_cache_dtype",
    # the HTTP port the decode derives the PD retract re-bootstrap /generate URL from
    "prefill_http_port",
)


def _response(status: int) -> requests.Response:
    r = requests.Response()
    r.status_code = status
    r._content = b"ok" if status == 200 else b"busy"
    return r


class Registration:
    """Scripted ``requests.put`` and recorded ``time.sleep`` around one registration."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mgr: Any) -> None:
        self.mgr = mgr
        self.monkeypatch = monkeypatch
        self.puts: list[tuple[str, dict[str, Any]]] = []
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[int], None] | None = None
        self._script: list[Any] = []
        real_sleep = time.sleep
        me = threading.current_thread()
        busy = threading.local()

        def sleep(seconds: float) -> None:
            if threading.current_thread() is not me or getattr(busy, "on", False):
                return real_sleep(seconds)
            self.sleeps.append(seconds)
            if self.on_sleep is not None:
                busy.on = True
                try:
                    self.on_sleep(len(self.sleeps))
                finally:
                    busy.on = False

        monkeypatch.setattr(time, "sleep", sleep)

    def script(self, *outcomes: Any) -> None:
        """HTTP statuses (ints) or exceptions, one per PUT; the last one repeats."""
        self._script = list(outcomes)

        def put(url: str, *args: Any, **kwargs: Any) -> requests.Response:
            self.puts.append((url, kwargs))
            outcome = self._script[min(len(self.puts), len(self._script)) - 1]
            if isinstance(outcome, BaseException):
                raise outcome
            return _response(outcome)

        self.monkeypatch.setattr(requests, "put", put)

    def payload(self, i: int = -1) -> dict[str, Any]:
        kwargs = self.puts[i][1]
        return kwargs["json"] if "json" in kwargs else json.loads(kwargs["data"])


@pytest.fixture
def registration(cluster, monkeypatch) -> Iterator[Registration]:
    mgr = cluster.prefill
    saved = {k: getattr(mgr, k) for k in ("bootstrap_host", "bootstrap_port", "dist_init_addr")}
    yield Registration(monkeypatch, mgr)
    for k, v in saved.items():
        setattr(mgr, k, v)


def test_registers_on_the_first_attempt_without_sleeping(registration):
    registration.script(200)
    registration.mgr.register_to_bootstrap()
    assert len(registration.puts) == 1
    assert registration.sleeps == []


def test_retries_until_the_bootstrap_server_accepts(registration):
    registration.script(503, 503, 200)
    registration.mgr.register_to_bootstrap()
    assert len(registration.puts) == 3
    assert len(registration.sleeps) == 2


def test_gives_up_after_five_attempts_without_sleeping_after_the_last(registration):
    registration.script(503)
    registration.mgr.register_to_bootstrap()
    assert len(registration.puts) == 5
    assert len(registration.sleeps) == 4


def test_exception_with_a_nested_cause_is_retried(registration):
    root = ConnectionRefusedError("connection refused")
    inner = OSError("os error")
    inner.__cause__ = root
    outer = Exception("wrapped")
    outer.__cause__ = inner
    registration.script(outer, 200)
    registration.mgr.register_to_bootstrap()
    assert len(registration.puts) == 2


def test_exception_without_a_cause_is_retried(registration):
    registration.script(ConnectionError("plain connection error"), 200)
    registration.mgr.register_to_bootstrap()
    assert len(registration.puts) == 2


def test_backoff_doubles_between_attempts_and_stays_below_sglangs_cap(registration):
    registration.script(503)
    registration.mgr.register_to_bootstrap()
    between = registration.sleeps[: len(registration.puts) - 1]
    assert len(between) == 4
    assert between[0] > 0
    for earlier, later in zip(between, between[1:], strict=False):
        assert later == pytest.approx(2 * earlier)
    assert all(0 < d < 30.0 for d in registration.sleeps)  # SGLang's max_delay


def test_payload_carries_every_field_the_bootstrap_server_needs(registration):
    registration.script(200)
    registration.mgr.register_to_bootstrap()
    payload = registration.payload()
    for name in REQUIRED_FIELDS:
        assert name in payload, name
    assert payload["prefill_http_port"] == 30000  # the published --port of this rank
    assert payload["rank_ip"] == "127.0.0.1"
    assert payload["rank_port"] == registration.mgr.rank_port


def test_url_targets_dist_init_addr_when_set(registration):
    registration.script(200)
    registration.mgr.dist_init_addr = "10.0.0.1:12345"
    registration.mgr.register_to_bootstrap()
    assert "10.0.0.1" in registration.puts[0][0]


def test_ipv4_wildcard_host_registers_through_ipv4_loopback(registration):
    registration.script(200)
    registration.mgr.bootstrap_host = "0.0.0.0"
    registration.mgr.register_to_bootstrap()
    url = registration.puts[0][0]
    assert "0.0.0.0" not in url
    assert "127.0.0.1" in url


def test_ipv6_wildcard_host_registers_through_ipv6_loopback(registration):
    registration.script(200)
    registration.mgr.bootstrap_host = "::"
    registration.mgr.register_to_bootstrap()
    url = registration.puts[0][0]
    assert "[::]" not in url
    assert "[::1]" in url


def test_registration_reaches_a_bootstrap_server_that_comes_up_during_the_backoff(
    cluster, registration
):
    """The real failure the nested-cause cases stand for: connection refused, then up."""
    mgr = cluster.prefill
    port = cluster.free_port()
    mgr.bootstrap_port = port
    servers: list[Any] = []

    def start_server(nth_sleep: int) -> None:
        if servers:
            return
        servers.append(cluster.classes["bootstrap_server"](host="127.0.0.1", port=port))

        def healthy() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/health", timeout=0.5).ok
            except requests.RequestException:
                return False

        wait_for(healthy, 5, "the late bootstrap server")

    registration.on_sleep = start_server
    try:
        mgr.register_to_bootstrap()
        assert len(registration.sleeps) == 1  # one refused attempt, then registered
        base = f"http://127.0.0.1:{port}/route"
        ranks = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        everyone = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        assert requests.get(f"{base}?{everyone}", timeout=5).status_code == 200
        info = requests.get(f"{base}?{ranks}", timeout=5).json()
        assert (info["rank_ip"], int(info["rank_port"])) == (mgr.local_ip, mgr.rank_port)
    finally:
        for server in servers:
            server.close()
