"""The decode's warm-up: which prefill ranks it registers with, and when a prefill is ready."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.waiting import poll_until

from sgl_nixl_plugin.settings import prefill_addrs
from sgl_nixl_plugin.sides import decode_warmup
from sgl_nixl_plugin.sides.decode_warmup import DecodeWarmup, StartupRegistration
from sgl_nixl_plugin.transport import bootstrap_client

ADDR = "127.0.0.1:8998"


def _info(tp: list[int], dp: int = 1) -> Any:
    return SimpleNamespace(
        target_tp_ranks=tp, target_tp_rank=tp[0], target_cp_ranks=[0], target_pp_ranks=[0],
        dp_size=dp,
    )  # fmt: skip


class Harness:
    """A warm-up whose bootstrap answers rank by rank (``table`` None: a bootstrap without
    the route table), or with ``table`` at once; ``gate``, when set, holds each rank query
    until the test lets it through."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        info: Any,
        send_ok: bool = True,
        table: dict | None = None,
        gate: threading.Event | None = None,
        table_info: dict | None = None,
        resolve: Any = None,
    ) -> None:
        """``info``: SGLang's parallel info (None: its query has not got it yet);
        ``table_info``: the topology copy in the route table; ``resolve``: SGLang's mapping
        of that copy."""
        self.queries: list[str] = []
        self.table_queries = 0
        self.sent: list[tuple[tuple[str, int], list[Any]]] = []
        self.waits: list[bool] = []  # each registration's ``request_waits``
        self.done = threading.Event()
        self.info = info

        def get_routes(addr: str, secret: bytes | None) -> Any:
            self.table_queries += 1
            return None if table is None else bootstrap_client.RouteTable(table, table_info)

        def registration(request_waits: bool) -> list[Any]:
            self.waits.append(request_waits)
            return [b"registration"]

        def get_route(addr: str, query: str, secret: bytes | None) -> dict | None:
            self.queries.append(query)
            if gate is not None:
                assert gate.wait(10), "the test never let the rank query through"
            tp = int(query.split("target_tp_rank=")[1].split("&")[0])
            dp = int(query.split("prefill_dp_rank=")[1].split("&")[0])
            return {"rank_ip": "127.0.0.1", "rank_port": 9000 + 10 * dp + tp}

        def send(ep: tuple[str, int], frames: list[Any]) -> bool:
            self.sent.append((ep, frames))
            if len(self.sent) == self.expected:
                self.done.set()
            return send_ok

        monkeypatch.setattr(decode_warmup.bootstrap_client, "get_route", get_route)
        monkeypatch.setattr(decode_warmup.bootstrap_client, "get_routes", get_routes)
        self.expected = 0
        self.warmup = DecodeWarmup(send, registration, lambda a: self.info, None, resolve)

    def start(self, expected: int) -> None:
        self.expected = expected
        self.warmup.start(ADDR)
        assert self.done.wait(10), f"{len(self.sent)} of {expected} registrations sent"


def test_every_rank_is_registered_with_and_the_prefill_is_ready_once_all_replied(monkeypatch):
    h = Harness(monkeypatch, _info([0, 1], dp=2))
    h.start(expected=4)
    assert sorted(ep for ep, _ in h.sent) == [("127.0.0.1", p) for p in (9000, 9001, 9010, 9011)]
    assert all(frames == [b"registration"] for _, frames in h.sent)
    h.warmup.start(ADDR)  # once per prefill
    assert len(h.queries) == 4
    for port in (9000, 9001, 9010):
        h.warmup.replied(("127.0.0.1", port), True)
    assert not h.warmup.ready(ADDR) and h.warmup.warmed() == 0
    h.warmup.replied(("127.0.0.1", 9011), False)  # a refusal ends the wait, links nothing
    assert h.warmup.ready(ADDR) and h.warmup.warmed() == 0
    h.warmup.forget(("127.0.0.1", 9011))
    h.done.clear()
    h.start(expected=8)
    for port in (9000, 9001, 9010):
        h.warmup.replied(("127.0.0.1", port), True)
    h.warmup.replied(("127.0.0.1", 9011), True)
    assert h.warmup.ready(ADDR) and h.warmup.warmed() == 1


def test_a_lost_rank_makes_its_prefill_warm_again_next_time(monkeypatch):
    h = Harness(monkeypatch, _info([0]))
    h.start(expected=1)
    h.warmup.replied(("127.0.0.1", 9000), True)
    assert h.warmup.ready(ADDR)
    h.warmup.forget(("127.0.0.1", 9000))
    # the warm-up has ended (a caller waiting for it goes on) but warmed nothing now
    assert h.warmup.ready(ADDR) and h.warmup.warmed() == 0
    h.done.clear()
    h.start(expected=2)
    assert len(h.sent) == 2
    assert not h.warmup.ready(ADDR)  # the new warm-up waits for its reply
    h.warmup.replied(("127.0.0.1", 9000), True)
    assert h.warmup.ready(ADDR) and h.warmup.warmed() == 1


def test_a_prefill_that_refused_this_decode_counts_as_ready(monkeypatch):
    """The decode forgets a refusing rank (its next request registers again); a caller
    waiting for the warm-up (the bench) must not wait for it forever."""
    h = Harness(monkeypatch, _info([0]))
    h.start(expected=1)
    h.warmup.replied(("127.0.0.1", 9000), False)
    h.warmup.forget(("127.0.0.1", 9000))  # what the decode does on a refusal
    assert h.warmup.ready(ADDR) and h.warmup.warmed() == 0


def test_a_registration_that_cannot_be_sent_does_not_hold_the_prefill_back(monkeypatch):
    h = Harness(monkeypatch, _info([0]), send_ok=False)
    h.start(expected=1)
    # the request path registers again and reports the error
    poll_until(lambda: h.warmup.ready(ADDR), timeout=10, what="ready after a failed send")
    assert h.warmup.warmed() == 0


def test_a_prefill_beyond_the_rank_bound_is_left_to_the_requests(monkeypatch):
    h = Harness(monkeypatch, _info(list(range(decode_warmup.MAX_RANKS + 1))))
    h.warmup.start(ADDR)
    poll_until(lambda: h.warmup.ready(ADDR), timeout=10, what="a warm-up left to the requests")
    assert h.queries == [] and h.sent == []


def test_an_unknown_prefill_is_not_ready():
    w = DecodeWarmup(lambda ep, f: True, lambda waits: [], lambda a: None, None)
    assert not w.ready(ADDR)


def test_the_ranks_a_warm_up_linked_are_known_until_one_is_lost(monkeypatch):
    """Under DP attention the warm-up links every prefill DP group before SGLang has a
    route to more than one: the decode keeps (and watches) the other links, instead of
    closing them as sockets no route leads to."""
    h = Harness(monkeypatch, _info([0], dp=2))
    h.start(expected=2)
    assert h.warmup.linked() == set()
    h.warmup.replied(("127.0.0.1", 9000), True)
    h.warmup.replied(("127.0.0.1", 9010), True)
    assert h.warmup.linked() == {("127.0.0.1", 9000), ("127.0.0.1", 9010)}
    h.warmup.forget(("127.0.0.1", 9010))  # a lost rank: the warm-up is stale, warmed again
    assert h.warmup.linked() == set()


def test_a_decode_knows_the_warm_links_besides_sglangs_routes():
    from sgl_nixl_plugin.sides.decode_policy import DecodePolicy

    routes = {("127.0.0.1", 9000)}
    warm = {("127.0.0.1", 9000), ("127.0.0.1", 9010)}
    ctx = SimpleNamespace(
        sglang=SimpleNamespace(cached_prefill_endpoints=lambda: set(routes)),
        warmup=SimpleNamespace(linked=lambda: set(warm)),
    )
    policy = DecodePolicy(ctx)  # type: ignore[arg-type]
    assert policy.known_endpoints() == warm
    ctx.warmup = None
    assert policy.known_endpoints() == routes


def test_the_first_receiver_takes_the_warm_up_route_once_and_none_once_stale(monkeypatch):
    """SGLang's first receiver to a prefill asks the bootstrap for the same route the
    warm-up asked for a moment before: it takes that answer (once; later receivers use
    SGLang's cache), never one from a warm-up whose rank was lost since."""
    h = Harness(monkeypatch, _info([0, 1]))
    h.start(expected=2)
    q0, q1 = (bootstrap_client.route_query(0, 0, tp, 0) for tp in (0, 1))
    got = h.warmup.take_route(ADDR, q0)
    assert got == {"rank_ip": "127.0.0.1", "rank_port": 9000}
    got["pp_rank"] = 0  # the receiver's copy is its own
    assert h.warmup.take_route(ADDR, q0) is None
    assert h.warmup.take_route("127.0.0.1:1", q1) is None  # another prefill
    h.warmup.forget(("127.0.0.1", 9001))
    assert h.warmup.take_route(ADDR, q1) is None
    assert h.warmup.routes_reused == 1


def _table(ports: dict[tuple[int, int], int]) -> dict[str, dict]:
    """A route table answer: (dp, tp) -> port."""
    return {
        bootstrap_client.route_query(dp, 0, tp, 0): {"rank_ip": "127.0.0.1", "rank_port": port}
        for (dp, tp), port in ports.items()
    }


def test_one_query_gives_the_warm_up_every_route_when_the_bootstrap_has_the_table(monkeypatch):
    table = _table({(0, 0): 7000, (0, 1): 7001, (1, 0): 7010, (1, 1): 7011})
    h = Harness(monkeypatch, _info([0, 1], dp=2), table=table)
    h.start(expected=4)
    assert h.table_queries == 1 and h.queries == []
    assert sorted(ep for ep, _ in h.sent) == [("127.0.0.1", p) for p in (7000, 7001, 7010, 7011)]
    q = bootstrap_client.route_query(1, 0, 1, 0)
    assert h.warmup.take_route(ADDR, q) == {"rank_ip": "127.0.0.1", "rank_port": 7011}


def test_a_rank_missing_from_the_table_is_asked_for_alone(monkeypatch):
    h = Harness(monkeypatch, _info([0, 1]), table=_table({(0, 0): 7000}))
    h.start(expected=2)
    assert h.queries == [bootstrap_client.route_query(0, 0, 1, 0)]
    assert sorted(ep for ep, _ in h.sent) == [("127.0.0.1", 7000), ("127.0.0.1", 9001)]


def test_a_refused_table_query_leaves_the_routes_to_the_requests(monkeypatch):
    """401 or no answer (``get_routes`` gives an empty table, logged): asking rank by rank
    would be refused the same way; the receivers ask and fail with the reason."""
    h = Harness(monkeypatch, _info([0]), table={})
    h.warmup.start(ADDR)
    poll_until(lambda: h.warmup.ready(ADDR), timeout=10, what="a warm-up left to the requests")
    assert h.queries == [] and h.sent == []
    assert h.warmup.take_route(ADDR, bootstrap_client.route_query(0, 0, 0, 0)) is None


TOPOLOGY = {"attn_tp_size": 2, "dp_size": 1, "page_size": None}


def test_the_warm_up_registers_from_the_tables_info_while_sglangs_query_is_on_its_way(
    monkeypatch,
):
    """The route table carries the prefill's topology: SGLang's own rank mapping of that
    copy gives the ranks, so the registrations leave before SGLang's query ends (here it
    never does)."""
    resolved: list[dict] = []

    def resolve(topology: dict) -> Any:
        resolved.append(topology)
        return _info([0, 1])

    table = _table({(0, 0): 7000, (0, 1): 7001})
    h = Harness(monkeypatch, None, table=table, table_info=TOPOLOGY, resolve=resolve)
    h.start(expected=2)
    assert resolved == [TOPOLOGY] and h.table_queries == 1 and h.queries == []
    assert sorted(ep for ep, _ in h.sent) == [("127.0.0.1", 7000), ("127.0.0.1", 7001)]
    assert h.waits == [True]  # started for a request: the prefill skips its warm-up WRITE


def test_without_the_tables_info_the_warm_up_waits_for_sglangs_query(monkeypatch):
    """A table without the topology (an older release of ours), or one SGLang's mapping
    refuses: the warm-up waits for SGLang's own query, then uses its info."""
    table = _table({(0, 0): 7000})
    h = Harness(monkeypatch, None, table=table, resolve=lambda topology: None)
    h.expected = 1
    h.warmup.start(ADDR)
    poll_until(lambda: h.table_queries == 1, timeout=10, what="the warm-up's table query")
    assert h.sent == [] and not h.warmup.ready(ADDR)
    h.info = _info([0])
    h.warmup.info_fetched(ADDR)
    assert h.done.wait(10), "no registration after SGLang's query ended"
    assert [ep for ep, _ in h.sent] == [("127.0.0.1", 7000)]


def test_the_warm_up_starts_beside_sglangs_query_and_again_if_the_prefill_was_down(
    monkeypatch,
):
    """``ensure``: the warm-up's table query runs while SGLang's query does; a warm-up that
    found no parallel info (the prefill not up: both answered 503) starts again with
    SGLang's next look, which gets it."""
    h = Harness(monkeypatch, None, table={})  # 503: a table without routes
    seen: list[int] = []

    def sglang_query_down(addr: str) -> bool:
        poll_until(lambda: h.table_queries == 1, timeout=10, what="a table query beside")
        seen.append(h.table_queries)
        return False

    started: list[str] = []
    assert not h.warmup.ensure(ADDR, True, sglang_query_down, lambda: started.append("a"))
    assert seen == [1] and started == ["a"]
    poll_until(lambda: h.warmup.ready(ADDR), timeout=10, what="the first warm-up's end")
    assert h.sent == []
    h.expected = 1
    h.info = _info([0])
    table_up = _table({(0, 0): 7000})
    monkeypatch.setattr(
        decode_warmup.bootstrap_client,
        "get_routes",
        lambda addr, secret: bootstrap_client.RouteTable(table_up),
    )
    assert h.warmup.ensure(ADDR, False, lambda addr: True, lambda: started.append("b"))
    assert h.done.wait(10) and started == ["a", "b"]
    assert [ep for ep, _ in h.sent] == [("127.0.0.1", 7000)]
    assert h.waits == [False]  # named at start-up: the prefill warms the path


def _asked_from(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """The threads the route table was asked from (the harness's answer, unchanged)."""
    asked: list[threading.Thread] = []
    answer = decode_warmup.bootstrap_client.get_routes

    def get_routes(addr: str, secret: bytes | None) -> Any:
        asked.append(threading.current_thread())
        return answer(addr, secret)

    monkeypatch.setattr(decode_warmup.bootstrap_client, "get_routes", get_routes)
    return asked


def test_sglangs_first_look_asks_the_table_and_registers_before_its_query_runs(monkeypatch):
    """SGLang's query waits for the table anyway: the calling thread asks for it, and with
    the table's topology it sends the registrations too, before SGLang's query runs (a
    thread of its own waited for the GIL 1-4 ms on a busy host before its first step)."""
    table = _table({(0, 0): 7000, (0, 1): 7001})
    h = Harness(
        monkeypatch, None, table=table, table_info=TOPOLOGY, resolve=lambda t: _info([0, 1])
    )
    asked = _asked_from(monkeypatch)
    seen: list[Any] = []

    def sglang_query(addr: str) -> bool:
        seen.append(sorted(ep for ep, _ in h.sent))
        seen.append(h.warmup.topology(addr))  # answered from the table, nothing to wait for
        return True

    started: list[int] = []
    assert h.warmup.ensure(ADDR, True, sglang_query, lambda: started.append(len(h.sent)))
    assert asked == [threading.current_thread()] and started == [0]
    assert seen == [[("127.0.0.1", 7000), ("127.0.0.1", 7001)], TOPOLOGY]
    assert h.waits == [True]


def test_a_table_without_the_topology_leaves_the_rest_to_a_thread_that_waits_for_sglang(
    monkeypatch,
):
    """A table without SGLang's topology (an older release of ours): the calling thread
    only asks for it; the registrations wait, in a thread, for SGLang's query, which the
    calling thread runs next."""
    h = Harness(monkeypatch, None, table=_table({(0, 0): 7000}), resolve=lambda t: None)
    asked = _asked_from(monkeypatch)
    h.expected = 1

    def sglang_query(addr: str) -> bool:
        assert h.sent == []
        h.info = _info([0])
        return True

    assert h.warmup.ensure(ADDR, True, sglang_query, lambda: None)
    assert asked == [threading.current_thread()]
    assert h.done.wait(10), "no registration after SGLang's query ended"
    assert [ep for ep, _ in h.sent] == [("127.0.0.1", 7000)]


@pytest.mark.timeout(30)
def test_a_table_query_that_raises_does_not_hold_sglangs_query(monkeypatch):
    """An unexpected error asking for the table (not a refusal: those are answers) ends
    the table's wait at once: SGLang's query, which the calling thread runs next, asks for
    itself instead of waiting out ``ROUTE_WAIT_S``."""
    h = Harness(monkeypatch, None, table=_table({(0, 0): 7000}), resolve=lambda t: None)
    monkeypatch.setattr(decode_warmup, "ROUTE_WAIT_S", 600.0)  # a wait would hit the timeout

    def broken(addr: str, secret: bytes | None) -> Any:
        raise RuntimeError("a bug in the table's parsing")

    monkeypatch.setattr(decode_warmup.bootstrap_client, "get_routes", broken)
    looked: list[Any] = []

    def sglang_query(addr: str) -> bool:
        looked.append(h.warmup.topology(addr))
        return False

    assert not h.warmup.ensure(ADDR, True, sglang_query, lambda: None)
    assert looked == [None] and h.sent == []


def _release_when_a_receiver_waits(
    monkeypatch: pytest.MonkeyPatch, warmup: DecodeWarmup, gate: threading.Event
) -> None:
    """Lets the warm-up's held query through once a receiver waits for the answer (the
    warm-up's condition, a private: no other way to know the receiver is inside)."""
    cond = warmup._lock
    real_wait = cond.wait

    def wait(timeout: float | None = None) -> bool:
        gate.set()
        return real_wait(timeout)

    monkeypatch.setattr(cond, "wait", wait)


def test_a_receiver_asking_while_the_warm_up_asks_waits_for_that_answer(monkeypatch):
    """SGLang's first receiver to a prefill comes a moment after the warm-up started (both
    follow ``try_ensure_parallel_info``): it waits for the warm-up's answer instead of
    asking the bootstrap the same question again."""
    gate = threading.Event()
    h = Harness(monkeypatch, _info([0]), gate=gate)
    h.expected = 1
    _release_when_a_receiver_waits(monkeypatch, h.warmup, gate)
    q0 = bootstrap_client.route_query(0, 0, 0, 0)
    got: list[Any] = []
    h.warmup.start(ADDR)
    poll_until(lambda: h.queries == [q0], timeout=10, what="the warm-up's rank query")
    receiver = threading.Thread(target=lambda: got.append(h.warmup.take_route(ADDR, q0)))
    receiver.start()
    receiver.join(10)
    assert got == [{"rank_ip": "127.0.0.1", "rank_port": 9000}]
    assert h.queries == [q0] and h.warmup.routes_reused == 1
    assert h.done.wait(10)


def test_a_receiver_waiting_for_a_route_the_warm_up_could_not_get_asks_at_once(monkeypatch):
    def no_route(addr: str, query: str, secret: bytes | None) -> None:
        assert gate.wait(10)
        return None

    gate = threading.Event()
    h = Harness(monkeypatch, _info([0]))
    monkeypatch.setattr(decode_warmup.bootstrap_client, "get_route", no_route)
    monkeypatch.setattr(decode_warmup, "ROUTE_WAIT_S", 60.0)
    _release_when_a_receiver_waits(monkeypatch, h.warmup, gate)  # then the query fails
    got: list[Any] = []
    h.warmup.start(ADDR)
    receiver = threading.Thread(
        target=lambda: got.append(
            h.warmup.take_route(ADDR, bootstrap_client.route_query(0, 0, 0, 0))
        )
    )
    receiver.start()
    receiver.join(10)
    assert not receiver.is_alive() and got == [None]


class Prefills:
    """Named prefills that come up when a test says; ``ensure`` as SGLang's, which raises
    on a prefill whose parallel info does not match."""

    def __init__(self) -> None:
        self.up: set[str] = set()
        self.mismatched: set[str] = set()
        self.ensured: list[str] = []
        self.looked = threading.Semaphore(0)

    def is_up(self, addr: str) -> bool:
        self.looked.release()
        return addr in self.up

    def ensure(self, addr: str) -> bool:
        if addr in self.mismatched:
            raise RuntimeError("Page size mismatch: prefill server has page_size=1")
        self.ensured.append(addr)
        return True


def test_a_decode_registers_at_start_with_each_named_prefill_once_it_is_up(caplog):
    p = Prefills()
    a, b, bad = "127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"
    p.up, p.mismatched = {a, bad}, {bad}
    startup = StartupRegistration((a, b, bad), p.is_up, p.ensure)
    startup.start()
    try:
        poll_until(lambda: startup.registered == [a], timeout=10, what="a registered")
        for _ in range(3):  # b is looked at again while it is down
            assert p.looked.acquire(timeout=10)
        assert p.ensured == [a] and startup.registered == [a]
        p.up.add(b)
        poll_until(lambda: startup.registered == [a, b], timeout=10, what="b once up")
        assert list(startup.refused) == [bad] and "page_size=1" in startup.refused[bad]
        assert any(bad in r.message and "does not match" in r.message for r in caplog.records)
        startup.thread.join(10)  # nothing left to do: the thread ends
        assert not startup.thread.is_alive() and p.ensured == [a, b]
    finally:
        startup.stop()


def test_a_start_up_registration_stops_while_its_prefill_is_down():
    p = Prefills()
    startup = StartupRegistration(("127.0.0.1:1001",), p.is_up, p.ensure)
    startup.start()
    assert p.looked.acquire(timeout=10)
    startup.stop()
    startup.thread.join(decode_warmup.PROBE_MAX_S + 5)
    assert not startup.thread.is_alive() and startup.registered == []


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("", ()),
        ("10.0.0.5:8998", ("10.0.0.5:8998",)),
        (" a:1, b:2 ,a:1,", ("a:1", "b:2")),
        ("[::1]:8998", ("[::1]:8998",)),
    ],
)
def test_the_named_prefills_are_host_port_pairs(text, want):
    assert prefill_addrs(text) == want


@pytest.mark.parametrize("bad", ["10.0.0.5", "10.0.0.5:", ":8998", "h:99999", "h:x"])
def test_a_named_prefill_that_is_not_host_port_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"SGLANG_NIXL_PLUGIN_PREFILLS: .* is not host:port"):
        prefill_addrs(f"a:1,{bad}")


def test_sglangs_query_takes_the_tables_topology_once_after_waiting_for_it(monkeypatch):
    """``topology``: SGLang's first look at the prefill waits for the warm-up's table
    (here held back until the look waits) and gets its copy of the topology once; the next
    look (or one from a table without it) gets None and asks for itself."""
    gate = threading.Event()
    table = _table({(0, 0): 7000, (0, 1): 7001})
    h = Harness(monkeypatch, None, table=table, table_info=TOPOLOGY, resolve=lambda t: None)
    real = decode_warmup.bootstrap_client.get_routes

    def held(addr: str, secret: bytes | None) -> Any:
        assert gate.wait(10), "the test never let the table query through"
        return real(addr, secret)

    monkeypatch.setattr(decode_warmup.bootstrap_client, "get_routes", held)
    h.warmup.start(ADDR)
    got: list[Any] = []
    look = threading.Thread(target=lambda: got.append(h.warmup.topology(ADDR)))
    look.start()
    look.join(0.2)  # a look that did not wait would have ended with None by now
    assert look.is_alive() and not got
    gate.set()
    look.join(10)
    assert got == [TOPOLOGY]
    assert h.warmup.topology(ADDR) is None  # taken: a second look asks SGLang's way
    h.warmup.info_fetched(ADDR)  # SGLang's query ended (without info here)


def test_the_tables_topology_answers_only_the_look_it_was_fetched_beside(monkeypatch):
    """A look that did not take the copy (SGLang had the info already: a warm-up started
    again after a rank was lost) ends with ``info_fetched``; a later look, once SGLang's
    cache is gone, must ask for itself, not take a copy fetched before."""
    h = Harness(monkeypatch, _info([0]), table=_table({(0, 0): 7000}), table_info=TOPOLOGY)
    h.start(expected=1)  # the table came (its copy kept), then the registration went
    h.warmup.info_fetched(ADDR)
    assert h.warmup.topology(ADDR) is None


def test_a_table_without_the_topology_gives_sglangs_query_nothing(monkeypatch):
    h = Harness(monkeypatch, _info([0]), table=_table({(0, 0): 7000}))
    h.start(expected=1)
    assert h.warmup.topology(ADDR) is None
    assert h.warmup.topology("127.0.0.1:1") is None  # no warm-up of that prefill
