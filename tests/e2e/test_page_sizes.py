"""Prefill and decode with different page sizes, with real NIXL, one process per rank.

SGLang's decode refuses any page-size difference (its scheduler raises and the whole decode
server stops); our bootstrap leaves the prefill's page size out of its topology answer and
the prefill pairs the two sides' pages token by token: a prefill page of 16 tokens lands in
a quarter of a decode page of 64, or a decode page of 16 takes a quarter of a prefill page
of 64. Every token of every request must arrive in its place, whatever the pages, chunks,
TP sizes, destination pool (device or host) and path (direct or staged).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.pd import assert_clean, run_pd, workload
from helpers.waiting import poll_until

STAGED = {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging"}
DIRECT = {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "direct"}


def _paths(res) -> set[str]:
    return {
        r.get("path")
        for ranks in res.prefill.values()
        for r in ranks.get("results", {}).values()
        if r.get("ok")
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("prefill_page", "decode_page", "prefill_tp", "decode_tp", "shape", "env"),
    [
        (16, 64, 1, 1, "tiny", DIRECT),
        (64, 16, 1, 1, "tiny", STAGED),
        (1, 16, 1, 1, "tiny", DIRECT),
        (16, 64, 2, 1, "tiny", STAGED),
        (64, 16, 1, 2, "tiny", DIRECT),
        (16, 64, 2, 1, "tiny-mla", STAGED),
    ],
    ids=[
        "16to64-direct",
        "64to16-staged",
        "1to16-direct",
        "16to64-tp2to1-staged",
        "64to16-tp1to2-direct",
        "16to64-mla-tp2to1-staged",
    ],
)
def test_pages_of_different_sizes_arrive_token_exact(
    prefill_page: int, decode_page: int, prefill_tp: int, decode_tp: int, shape: str, env: dict
) -> None:
    """Random and contiguous pages, one and three chunks, lengths that end mid-page on
    either side, per-request state and aux rows: every token the request has arrives where
    the decode's pages put it (the tail of a last page past the request is nobody's)."""
    w = workload(
        shape, prefill_page, requests=12, min_tokens=1, max_tokens=200, decode_page_size=decode_page
    )
    res = run_pd(w, prefill_tp=prefill_tp, decode_tp=decode_tp, env=env)
    assert_clean(res)
    path = "staging" if env is STAGED else "direct"
    if shape.endswith("mla") and prefill_tp > decode_tp:
        # MLA: one prefill rank of two sends; the other's rooms carry nothing (dummy) and
        # keep the default path
        assert path in _paths(res)
    else:
        assert _paths(res) == {path}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("env", [DIRECT, STAGED], ids=["direct", "staged"])
def test_host_destinations_across_page_sizes_arrive_token_exact(env: dict) -> None:
    """Half of the requests go into the decode's host pool (its page 0 included), the
    others into its device pool, from prefill pages of 16 into decode pages of 64, with the
    decode at TP 2 (head slices of token rows into host pages)."""
    w = workload(
        "tiny", 16, requests=12, min_tokens=1, max_tokens=200, state=False, host_every=2,
        decode_page_size=64,
    )  # fmt: skip
    res = run_pd(w, decode_tp=2, env=env)
    assert_clean(res)
    got = res.decode_results()
    assert sum(bool(r.get("host")) for r in got.values()) == 6


@pytest.mark.timeout(180)
def test_a_page_indexed_state_across_page_sizes_is_refused_with_what_differs() -> None:
    """An SWA state is indexed by pages built at each side's own page size: it cannot be
    paired across page sizes. The prefill refuses the decode at registration, so every
    request fails at once with a reason that names both page sizes, the state kind and
    what to do; nothing hangs and nothing is left behind."""
    w = workload(
        "tiny", 16, requests=6, min_tokens=16, max_tokens=64, decode_page_size=64,
        state_kind="swa",
    )  # fmt: skip
    res = run_pd(w)
    got = res.decode_results()
    assert len(got) == 6 and not any(r["ok"] for r in got.values()), got
    for r in got.values():
        reason = r["reason"] or ""
        assert "page sizes differ (prefill 16, decode 64)" in reason, reason
        assert "swa state is indexed by pages" in reason and "--page-size" in reason, reason


@pytest.mark.timeout(60)
def test_the_bootstrap_topology_answer_leaves_the_page_size_to_the_prefill() -> None:
    """SGLang's decode raises in its scheduler (the whole decode server stops) when the
    topology answer names a page size other than its own: ours leaves it null, SGLang's
    documented "unknown". The bootstrap still holds each rank's page size and refuses a
    rank whose differs from the ranks already registered (one prefill, one page size)."""
    import requests

    from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
    from sgl_nixl_plugin.bench.session import free_port

    port = free_port()
    server = NixlPluginKVBootstrapServer(host="127.0.0.1", port=port)
    url = f"http://127.0.0.1:{port}/route"
    try:

        def healthy() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok
            except requests.RequestException:
                return False

        poll_until(healthy, bool, 30)
        rank = {
            "attn_tp_size": 2, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": 40001, "page_size": 16, "kv_cache_dtype": "auto",
        }  # fmt: skip
        assert requests.put(url, json=rank, timeout=5).status_code == 200
        other = {**rank, "attn_tp_rank": 1, "rank_port": 40002, "page_size": 64}
        refused = requests.put(url, json=other, timeout=5)
        assert refused.status_code == 400 and "page_size=64 (registered: 16)" in refused.text
        assert requests.put(url, json={**other, "page_size": 16}, timeout=5).status_code == 200
        query = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        info = requests.get(f"{url}?{query}", timeout=5).json()
        assert "page_size" in info and info["page_size"] is None, info
        assert (info["attn_tp_size"], info["dp_size"], info["kv_cache_dtype"]) == (2, 1, "auto")
        assert server.page_size == 16
    finally:
        server.close()


#: Pages of 16 into pages of 64; requests of 240-256 tokens in two chunks: 15-16 prefill
#: pages, the first chunk 8 of them = the first 2 decode pages, the last chunk the rest.
CROSS = dict(page_size=16, decode_page_size=64, max_tokens=256, concurrency=16)
FIRST_DECODE_PAGES = 2


@contextmanager
def _cross_cluster(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[Any, Any, Any, int]]:
    """A bootstrap, a prefill and a decode of the fault harness, with pages of 16 on the
    prefill and 64 on the decode: (cluster, prefill, decode, bootstrap port)."""
    from helpers.faults import FaultCluster

    from sgl_nixl_plugin.bench.session import free_port
    from sgl_nixl_plugin.bench.workload import PRESETS, Workload

    with FaultCluster(Workload(PRESETS["tiny"], **CROSS), tmp_path, env) as c:
        boot_port = free_port()
        c.bootstrap("boot0", boot_port)
        p = c.prefill("prefill0", boot_port, serve_bootstrap=False)
        d = c.decode("decode0")
        c.ready()
        yield c, p, d, boot_port


def _drained(d: Any) -> dict[str, int]:
    st = d.call("state")
    return {k: v for k, v in st["tables"].items() if v and k.startswith("decode.")}


@pytest.mark.timeout(180)
def test_prefill_killed_mid_transfer_across_page_sizes_fails_fast_and_drains(
    tmp_path: Path,
) -> None:
    """Staged: each room's first chunk landed (two whole decode pages) and its last held by
    the prefill: SIGKILL the prefill. Every room fails within 2 s with a reason naming the
    prefill, and the decode's tables drain. Then a new prefill on the same bootstrap serves
    new requests token-exact."""
    from helpers.faults import hold_mid_transfer, make_requests

    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
        "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
    }
    with _cross_cluster(tmp_path, env) as (c, p, d, boot_port):
        addr = f"127.0.0.1:{boot_port}"
        reqs = make_requests(6, 90, tokens=(240, 256), chunks=2)
        rooms = {r.room for r in reqs}
        hold_mid_transfer(p, d, reqs, addr, 64)
        t_kill = p.kill()
        failed = d.wait_done(rooms, 20)
        assert all(not r["ok"] for r in failed.values()), failed
        slow = {room: r["t"] - t_kill for room, r in failed.items() if r["t"] - t_kill > 2.0}
        assert not slow, f"rooms failed later than 2 s after the kill: {slow}"
        assert all("prefill" in (r["reason"] or "") for r in failed.values()), failed
        assert not _drained(d)

        again = c.prefill("prefill1", boot_port, serve_bootstrap=False)
        again.wait_ready()
        more = make_requests(6, 91, tokens=(1, 256), chunks=2)
        again.call("expect", reqs=more)
        assert d.call("submit", reqs=more, addr=addr) == {}
        done = d.wait_done({r.room for r in more}, 30)
        bad = {room: r for room, r in done.items() if not r["ok"] or r["bad_pages"]}
        assert not bad, bad


@pytest.mark.timeout(180)
def test_rooms_aborted_mid_transfer_across_page_sizes_are_acked_after_their_writes(
    tmp_path: Path,
) -> None:
    """Staged, with SGLang's deferred release: the decode aborts each room as soon as bytes
    of its last chunk land (its third decode page on), the last chunk's pieces in flight. Every abort is acked, and no byte of an acked room changes after its ACK, even
    once the prefill has finished everything."""
    from helpers.faults import (
        aborted_and_acked,
        changed_after_ack,
        hold_mid_transfer,
        make_requests,
    )

    env = {
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
    }
    with _cross_cluster(tmp_path, env) as (c, p, d, boot_port):
        reqs = make_requests(8, 92, tokens=(240, 256), chunks=2)
        rooms = {r.room for r in reqs}
        hold_mid_transfer(p, d, reqs, f"127.0.0.1:{boot_port}", 64)
        d.call("arm_abort", rooms=sorted(rooms), from_page=dict.fromkeys(rooms, FIRST_DECODE_PAGES))
        p.call("release", rooms=sorted(rooms))

        aborted, finished = aborted_and_acked(d, rooms)
        assert aborted, "no room could be aborted mid-transfer"
        p.wait_done(rooms, 20)
        touched = changed_after_ack(d, aborted)
        assert not touched, f"bytes changed after the ACK: {touched}\n{c.logs()}"
        ok = d.done(finished)
        assert all(r["ok"] and not r["bad_pages"] for r in ok.values()), ok
        assert not _drained(d)
