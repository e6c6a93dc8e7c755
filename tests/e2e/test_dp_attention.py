"""DP attention (``--enable-dp-attention --dp-size N``) on either side, in local processes
over real NIXL (UCX, DRAM), one process per rank.

Each server of TP ``T`` and DP ``N`` has ``N`` attention DP groups of ``T / N`` ranks; a
rank holds the KV heads of its attention TP rank. The ranks are published as SGLang's DP
controller launches them and register with their attention DP rank; a prefill's rooms go
to DP rank ``room % N`` (SGLang's ``follow_bootstrap_room``, checked by its sender), a
decode deals its requests round robin over its DP ranks and picks the prefill DP rank of a
room as SGLang's decode does. Every byte each decode rank receives is checked against the
pattern of the heads it holds.
"""

from __future__ import annotations

import pytest
from helpers.pd import assert_clean, run_pd, workload

STAGED = {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging"}
#: the prefill registers each room's DP rank at the bootstrap and the decode asks for it
QUERY = {"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"}


def _groups(results: dict[tuple[int, int], dict], tp: int, dp: int) -> dict[int, set[int]]:
    """Rooms per attention DP group of instance 0."""
    out: dict[int, set[int]] = {g: set() for g in range(dp)}
    for (_, rank), r in results.items():
        out[(rank % tp) // (tp // dp)] |= set(r.get("results", {}))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("prefill", "decode", "shape", "env"),
    [
        ((2, 1), (2, 2), "tiny", {}),
        ((2, 2), (2, 2), "tiny", {}),
        ((2, 2), (2, 2), "tiny", STAGED),
        ((2, 2), (2, 1), "tiny-mla", QUERY),
    ],
    ids=["tp2-to-tp2dp2", "tp2dp2-to-tp2dp2", "tp2dp2-to-tp2dp2-staged", "tp2dp2-to-tp2-mla-query"],
)
def test_dp_attention_arrives_byte_exact(
    prefill: tuple[int, int], decode: tuple[int, int], shape: str, env: dict[str, str]
) -> None:
    """Every room arrives byte-exact on the ranks of one decode DP group, from the prefill
    DP group that holds it; the rooms really spread over every DP group of each side; and
    nothing is left in any per-room table."""
    (ptp, pdp), (dtp, ddp) = prefill, decode
    w = workload(shape, 16, requests=12, state=False)
    res = run_pd(w, prefill_tp=ptp, prefill_dp=pdp, decode_tp=dtp, decode_dp=ddp, env=env)
    assert_clean(res)
    rooms = {r.room for r in w.make_requests()}
    pgroups, dgroups = _groups(res.prefill, ptp, pdp), _groups(res.decode, dtp, ddp)
    assert all(pgroups.values()) and all(dgroups.values()), (pgroups, dgroups)
    assert set().union(*dgroups.values()) == rooms
    for g, got in pgroups.items():
        assert got == {room for room in rooms if room % pdp == g}, (g, got)
    # the decode chose the prefill DP group that holds each room
    chosen = {
        room: x["prefill_dp_rank"] for r in res.decode.values() for room, x in r["results"].items()
    }
    assert chosen == {room: room % pdp for room in rooms}, chosen
    if pdp > 1 and ddp > 1:  # each decode DP group took rooms of both prefill DP groups
        for g, got in dgroups.items():
            assert {room % pdp for room in got} == set(range(pdp)), (g, got)
    if env is STAGED:  # the scattered rooms really went through the staging buffers
        paths = {x["path"] for r in res.prefill.values() for x in r["results"].values()}
        assert "staging" in paths, paths


def test_rooms_split_over_dp_groups_as_sglang_routes_them() -> None:
    """Without a session: a prefill DP group gets the rooms ``room % dp`` names, a decode's
    groups share its requests round robin; both partitions cover every room once, and the
    ranks of one group share its rooms. DP sizes SGLang would not run are refused."""
    from sgl_nixl_plugin.bench.session import SessionConfig

    w = workload("tiny", 16, requests=12, state=False)
    rooms = [r.room for r in w.make_requests()]
    cfg = SessionConfig(w, prefill_tp=4, prefill_dp=2, decode_tp=2, decode_dp=2)
    prefill = [cfg.rooms_of("prefill", 0, rank) for rank in range(4)]
    assert prefill[0] == prefill[1] == {r for r in rooms if r % 2 == 0}
    assert prefill[2] == prefill[3] == {r for r in rooms if r % 2 == 1}
    decode = [cfg.rooms_of("decode", 0, rank) for rank in range(2)]
    assert decode == [set(rooms[0::2]), set(rooms[1::2])]
    for bad in (
        dict(prefill_tp=2, prefill_dp=3),
        dict(decode_tp=2, decode_dp=0),
        dict(decode_tp=2, decode_dp=2, decode_pp=2),
    ):
        with pytest.raises(ValueError):
            SessionConfig(w, **bad)


@pytest.mark.timeout(180)
def test_a_prefill_dp_rank_killed_mid_transfer_fails_only_its_rooms_fast(tmp_path) -> None:
    """A prefill of TP 2 with DP attention 2 (two DP groups of attention TP 1, one process
    each, under one bootstrap server) and a TP 1 decode that takes rooms of both groups.
    Both prefill DP ranks hold each room's last chunk after its first landed; SIGKILL DP
    rank 1: each of its rooms fails on the decode within 2 s with a reason naming a prefill
    rank, while DP group 0's rooms, released, finish byte-exact; the decode's tables drain."""
    from dataclasses import replace

    from helpers.faults import FaultCluster, first_chunk_pages, make_requests
    from helpers.waiting import poll_until

    from sgl_nixl_plugin.bench.session import free_port
    from sgl_nixl_plugin.bench.workload import PRESETS, Workload

    env = {
        "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
        "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
    }
    w = Workload(PRESETS["tiny"], page_size=16, max_tokens=256, concurrency=16, state=False)
    reqs = [
        replace(r, with_state=False) for r in make_requests(16, 95, tokens=(200, 256), chunks=2)
    ]
    # the rooms each prefill DP group accepts (``room % 2``, checked by SGLang's sender)
    groups = [[r for r in reqs if r.room % 2 == g][:3] for g in range(2)]
    assert all(len(g) == 3 for g in groups), [len(g) for g in groups]
    rooms = [{r.room for r in g} for g in groups]
    with FaultCluster(w, tmp_path, env) as c:
        boot = free_port()
        c.bootstrap("boot0", boot)
        prefill = [
            c.add(
                f"prefill0.dp{g}",
                c.spec("prefill", bootstrap_port=boot, tp_size=2, tp_rank=g, dp_size=2),
            )
            for g in range(2)
        ]
        d = c.decode("decode0")
        c.ready()
        addr = f"127.0.0.1:{boot}"

        for p, g in zip(prefill, groups, strict=True):
            p.call("expect", reqs=g, plans={r.room: "hold" for r in g})
        assert d.call("submit", reqs=groups[0] + groups[1], addr=addr) == {}
        want = {r.room: first_chunk_pages(r, 16) for r in groups[0] + groups[1]}
        poll_until(
            lambda: d.call("landed", rooms=list(want)),
            lambda got: all(got.get(room, 0) >= n for room, n in want.items()),
            30,
        )
        for p, mine in zip(prefill, rooms, strict=True):
            assert set(p.call("held")) == mine, c.logs()
        assert not d.done(), "a held room finished early"

        t_kill = prefill[1].kill()
        failed = d.wait_done(rooms[1], 20)
        assert not any(r["ok"] for r in failed.values()), failed
        slow = {room: r["t"] - t_kill for room, r in failed.items() if r["t"] - t_kill > 2.0}
        assert not slow, f"rooms failed later than 2 s after the kill: {slow}"
        # the reason names the killed rank (SGLang's ``failure_exception`` text)
        dead = f"prefill rank {prefill[1].info['ip']}:{prefill[1].info['port']}"
        assert all(dead in (r["reason"] or "") for r in failed.values()), (dead, failed)
        assert not d.done(rooms[0]), "a room of the surviving DP group failed with the other"

        assert prefill[0].call("release", rooms=sorted(rooms[0])) == sorted(rooms[0])
        ok = d.wait_done(rooms[0], 20)
        assert all(r["ok"] and not r["bad_pages"] and not r["bad_aux"] for r in ok.values()), ok
        sent = prefill[0].wait_done(rooms[0], 20)
        assert all(r["ok"] for r in sent.values()), sent
        assert d.call("state")["active"] == 0
        poll_until(
            lambda: {
                k: v for k, v in d.call("state")["tables"].items() if v and k.startswith("decode.")
            },
            lambda t: not t,
            10,
            what="the decode's per-room tables drain",
        )
