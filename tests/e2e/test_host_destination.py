"""Decode host-pool destinations (SGLang's host receive), with real NIXL, one process per rank.

SGLang's decode receives a request into its host pool when its device pool is full
(``--disaggregation-decode-host-receive-threshold`` below 1): ``KVArgs.host_kv_*`` describe
that pool, the manager must say ``supports_host_destination``, and ``send_metadata`` gets
``destination=KVTransferDestination.HOST`` with host page ids (page 0 included). A failed
host room is held until the receiver's ``is_abort_release_safe()`` says nothing more can
land; SGLang has no timeout of its own there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.faults import (
    FaultCluster,
    RankProc,
    aborted_and_acked,
    changed_after_ack,
    first_chunk_pages,
    hold_mid_transfer,
    make_requests,
    poll_until,
)
from helpers.pd import assert_clean, run_pd, workload

from sgl_nixl_plugin.bench.session import free_port
from sgl_nixl_plugin.bench.workload import PRESETS, Request, Workload

PAGE = 16
#: Every request of these workloads may go to the host pool (``host=True`` requests).
HOSTED = Workload(
    PRESETS["tiny"], page_size=PAGE, max_tokens=256, concurrency=16, state=False, host_every=1
)
#: A lost prefill's host pages stay held this long after the loss (ABORT_DRAIN_TIMEOUT).
QUARANTINE_S = 1.0
SHORT_PINGS = {
    "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
    "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
    "SGLANG_NIXL_PLUGIN_ABORT_DRAIN_TIMEOUT": str(QUARANTINE_S),
}
PREFILL_DEATH_S = 2.0


def _rooms(reqs: list[Request]) -> set[int]:
    return {r.room for r in reqs}


def _first_chunk(r: Request) -> int:
    return first_chunk_pages(r, PAGE)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "shape", "page_size"),
    [(1, 1, "tiny", 16), (1, 2, "tiny", 1), (2, 1, "tiny-mla", 16)],
    ids=["tp1to1-tiny-ps16", "tp1to2-tiny-ps1", "tp2to1-tiny-mla-ps16"],
)
def test_host_and_device_destinations_in_one_session_arrive_byte_exact(
    prefill_tp: int, decode_tp: int, shape: str, page_size: int
) -> None:
    """Every third request goes to the decode's host pool (random and contiguous pages,
    the host pool's page 0 included, chunked and not), the others to its device pool:
    every byte of every page and aux row arrives where it was asked for, with TP
    mismatch in both directions (head slices into host pages too)."""
    w = workload(shape, page_size, requests=15, state=False, host_every=3)
    reqs = w.make_requests()
    assert sum(r.host for r in reqs) == 5 and {r.contiguous for r in reqs if r.host} == {
        False,
        True,
    }
    res = run_pd(w, prefill_tp=prefill_tp, decode_tp=decode_tp)
    assert_clean(res)  # checks each room landed in the pool it asked for
    got = res.decode_results()
    assert sum(bool(got[r.room].get("host")) for r in reqs) == 5


@pytest.mark.timeout(180)
def test_staged_host_rooms_scatter_into_the_host_pool_byte_exact() -> None:
    """The staging path into host pages: the prefill gathers, WRITEs staging slots, and the
    decode scatters each piece into the host pool (the device pool's for the others)."""
    w = workload("tiny", 16, requests=12, state=False, host_every=2)
    res = run_pd(w, env={"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging"})
    assert_clean(res)
    paths = {
        room: r.get("path")
        for ranks in res.prefill.values()
        for room, r in ranks.get("results", {}).items()
    }
    hosted = {r.room for r in w.make_requests() if r.host}
    assert len(hosted) == 6 and {paths[room] for room in hosted} == {"staging"}, paths


@pytest.mark.timeout(180)
def test_staged_host_chunks_that_find_no_slot_go_direct_into_the_host_pool() -> None:
    """The decode's staging holds one room's slots and chunks wait 0 s for one: host
    chunks that fall back to direct descriptors still land in the host pool."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 10),
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(16 << 10),
        "SGLANG_NIXL_PLUGIN_SLOT_WAIT": "0",
    }
    w = workload(
        "tiny", 16, requests=16, concurrency=8, min_tokens=64, max_tokens=160, state=False,
        host_every=1,
    )  # fmt: skip
    res = run_pd(w, env=env)
    assert_clean(res)
    assert res.prefill[(0, 0)]["tables"]["count.staging.fell_back"] > 0  # some went direct


def _hold(p: RankProc, d: RankProc, reqs: list[Request], addr: str) -> None:
    hold_mid_transfer(p, d, reqs, addr, PAGE)


@pytest.mark.timeout(180)
def test_aborted_host_rooms_are_released_after_the_ack_and_nothing_lands_later(
    tmp_path: Path,
) -> None:
    """Host rooms aborted while their last chunk's WRITEs are in flight, with SGLang's
    deferred release off (host rooms need the ACK regardless): the receiver says the pages
    are safe only after each prefill rank acked, and no byte changes after that."""
    env = {**SHORT_PINGS, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "0"}
    with FaultCluster(HOSTED, tmp_path, env) as c:
        port = free_port()
        p = c.prefill("prefill0", port, serve_bootstrap=True)
        d = c.decode("decode0")
        c.ready()
        addr = f"127.0.0.1:{port}"
        warm = make_requests(3, 60, tokens=(64, 256), chunks=2, host=True)
        p.call("expect", reqs=warm)
        assert d.call("submit", reqs=warm, addr=addr) == {}
        done = d.wait_done(_rooms(warm), 30)
        assert all(r["ok"] and r["bad_pages"] == 0 for r in done.values()), done

        reqs = make_requests(8, 61, tokens=(224, 256), chunks=2, host=True)
        rooms = _rooms(reqs)
        _hold(p, d, reqs, addr)
        d.call("arm_abort", rooms=sorted(rooms), from_page={r.room: _first_chunk(r) for r in reqs})
        p.call("release", rooms=sorted(rooms))

        aborted, _ = aborted_and_acked(d, rooms)
        assert aborted, "no host room could be aborted mid-transfer"
        p.wait_done(rooms, 20)
        touched = changed_after_ack(d, aborted)
        assert not touched, f"host pages changed after the ACK: {touched}\n{c.logs()}"
        st = d.call("state")
        assert not {k: v for k, v in st["tables"].items() if v and k.startswith("decode.")}


@pytest.mark.timeout(180)
def test_prefill_killed_mid_transfer_host_rooms_fail_fast_and_their_pages_come_back(
    tmp_path: Path,
) -> None:
    """SIGKILL the prefill while host rooms are mid-transfer: each fails within 2 s; its
    host pages stay held (no ACK can come) until the quarantine after the loss has passed,
    then the receiver releases them: none is held for good."""
    with FaultCluster(HOSTED, tmp_path, SHORT_PINGS) as c:
        boot_port = free_port()
        c.bootstrap("boot0", boot_port)
        p = c.prefill("prefill0", boot_port, serve_bootstrap=False)
        d = c.decode("decode0")
        c.ready()
        addr = f"127.0.0.1:{boot_port}"
        reqs = make_requests(6, 70, tokens=(96, 256), chunks=2, host=True)
        rooms = _rooms(reqs)
        _hold(p, d, reqs, addr)
        t_kill = p.kill()
        failed = d.wait_done(rooms, 20)
        assert all(not r["ok"] for r in failed.values()), failed
        slow = {
            room: r["t"] - t_kill for room, r in failed.items() if r["t"] - t_kill > PREFILL_DEATH_S
        }
        assert not slow, f"host rooms failed later than {PREFILL_DEATH_S}s after the kill: {slow}"
        (released, _) = poll_until(
            lambda: {e["room"]: e for e in d.events("host_released") if e["room"] in rooms},
            lambda got: set(got) >= rooms,
            15,
            what="host pages of the failed rooms released",
        )
        # the loss is seen after the kill, and the pages wait a quarantine after the loss
        early = {
            room: e["t"] - t_kill for room, e in released.items() if e["t"] - t_kill < QUARANTINE_S
        }
        assert not early, f"host pages released before the quarantine after the loss: {early}"
        late = {room: e["t"] - t_kill for room, e in released.items() if e["t"] - t_kill > 5.0}
        assert not late, f"host pages held long after the loss: {late}"
        st = d.call("state")
        assert not {k: v for k, v in st["tables"].items() if v and k.startswith("decode.")}, st
