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
