"""SGLang's topology query answered from the route table (``adapter.topology_answer``),
against the module SGLang's own ``try_ensure_parallel_info`` lives in."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang")

import requests  # noqa: E402
from sglang.srt.disaggregation.common import conn as sglang_conn  # noqa: E402
from sglang.srt.disaggregation.common.conn import CommonKVManager  # noqa: E402

from sgl_nixl_plugin.adapter import topology_answer  # noqa: E402
from sgl_nixl_plugin.adapter.topology_answer import AnsweredQuery  # noqa: E402

TOPOLOGY = {"attn_tp_size": 1, "dp_size": 1, "page_size": None}
QUERY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """A bootstrap stand-in on 127.0.0.1 that records each path it is asked for."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            asked.append(self.path)
            body = b'{"from": "the server"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{srv.server_address[1]}", asked
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)


@pytest.fixture
def stand_in() -> Iterator[Any]:
    before = sglang_conn.requests
    yield topology_answer.install(CommonKVManager.try_ensure_parallel_info)
    sglang_conn.requests = before


def _get(url: str) -> Any:
    """A GET as SGLang's conn module makes it (through its module global)."""
    return sglang_conn.requests.get(url, timeout=5)


def test_sglangs_conn_module_reaches_requests_through_the_stand_in(stand_in):
    """The release's ``try_ensure_parallel_info`` lives where ``install`` can answer it: a
    release that stops using ``requests`` there fails here (it would only be slower)."""
    assert stand_in is not None and sglang_conn.requests is stand_in
    assert topology_answer.install(CommonKVManager.try_ensure_parallel_info) is stand_in
    assert stand_in.put is requests.put and stand_in.exceptions is requests.exceptions


def test_the_topology_query_is_answered_once_and_nothing_else_is(stand_in, server):
    addr, asked = server
    stand_in.answering(addr, TOPOLOGY)
    assert _get(f"http://{addr}/route?prefill_dp_rank=0&prefill_cp_rank=0&"
                "target_tp_rank=0&target_pp_rank=0").json() == {"from": "the server"}  # fmt: skip
    other = f"127.0.0.1:{int(addr.rsplit(':', 1)[1]) + 1}"
    other_thread: list[Any] = []
    t = threading.Thread(target=lambda: other_thread.append(_get(f"http://{addr}{QUERY}").json()))
    t.start()
    t.join(10)
    assert other_thread == [{"from": "the server"}]  # another thread's query goes out
    with pytest.raises(requests.ConnectionError):
        _get(f"http://{other}{QUERY}")  # another prefill's: goes out (nothing listens there)
    r = _get(f"http://{addr}{QUERY}")
    assert r.status_code == 200 and r.json() == TOPOLOGY and stand_in.done()
    assert _get(f"http://{addr}{QUERY}").json() == {"from": "the server"}  # used up
    assert asked == [QUERY.replace("-1", "0"), QUERY, QUERY]


def test_sglangs_query_runs_with_the_answer_only_while_it_has_no_info(stand_in, server):
    addr, asked = server
    cached: dict[str, Any] = {}
    seen: list[Any] = []
    looks: list[str] = []

    def query(a: str) -> bool:  # SGLang's: its cache, else its GET
        if a in cached:
            return True
        seen.append(_get(f"http://{a}{QUERY}").json())
        cached[a] = seen[-1]
        return True

    def topology(a: str) -> dict[str, Any] | None:
        looks.append(a)
        return dict(TOPOLOGY)

    query.__module__ = sglang_conn.__name__  # installs where SGLang's query lives
    look = AnsweredQuery(query, cached.get, topology)
    assert look(addr) and seen == [TOPOLOGY] and look.answered == 1 and asked == []
    assert look(addr) and look.answered == 1 and looks == [addr]  # cached: SGLang's way
    cached.clear()
    looks_before = len(looks)

    def no_table(a: str) -> None:
        looks.append(a)
        return None

    look = AnsweredQuery(query, cached.get, no_table)
    assert look(addr) and seen[-1] == {"from": "the server"} and look.answered == 0
    assert len(looks) == looks_before + 1 and asked == [QUERY]


def test_an_answer_sglangs_query_did_not_use_is_dropped(stand_in, server):
    """A release whose query URL differs: the answer is not used, and it is not left for
    a later GET of this thread."""
    addr, asked = server

    def query(a: str) -> bool:
        _get(f"http://{a}/route?prefill_dp_rank=-1")
        return True

    query.__module__ = sglang_conn.__name__
    look = AnsweredQuery(query, lambda a: None, lambda a: dict(TOPOLOGY))
    assert look(addr) and look.answered == 0
    assert _get(f"http://{addr}{QUERY}").json() == {"from": "the server"}
    assert asked == ["/route?prefill_dp_rank=-1", QUERY]
