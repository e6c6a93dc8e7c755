"""Pipeline-parallel prefill servers, with real NIXL, one process per rank.

SGLang gives each PP stage of a prefill server its own layers; a decode runs at the
prefill's PP size (stage ``r`` to stage ``r``) or at PP 1 (every stage writes its layers into
the one decode, which waits for all of them). The ranks here are built the way SGLang builds
them: a stage's ``KVArgs`` hold its layers only, with SGLang's ``get_pp_indices`` split and
its ``prefill_start_layer``, and the prefill keeps its statuses in SGLang's
``PPConsensusStore`` over a PP group. Every token of every layer must arrive where the
decode's pages put it, whatever the stage split (even or not), TP sizes, page sizes,
destination pool and path.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from helpers.pd import assert_clean, run_pd, workload
from helpers.waiting import poll_until

STAGED = {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging"}
DIRECT = {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "direct"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("prefill_pp", "decode_pp", "shape", "tp", "pages", "state", "host", "env"),
    [
        (2, 1, "tiny", (1, 1), (16, 16), False, 2, DIRECT),
        (3, 1, "tiny-mla", (1, 1), (16, 16), False, 0, STAGED),
        (2, 2, "tiny", (1, 1), (16, 16), True, 0, STAGED),
        (2, 1, "tiny", (2, 1), (16, 64), False, 0, STAGED),
    ],
    ids=[
        "pp2to1-host-direct",
        "pp3to1-uneven-mla-staged",
        "pp2to2-state-staged",
        "pp2to1-tp2to1-16to64-staged",
    ],
)
def test_pipeline_stages_arrive_byte_exact(
    prefill_pp: int,
    decode_pp: int,
    shape: str,
    tp: tuple[int, int],
    pages: tuple[int, int],
    state: bool,
    host: int,
    env: dict[str, str],
) -> None:
    """Random and contiguous pages, one and three chunks, aux rows (every stage writes the
    same), per-request state at equal PP sizes, every other request into the decode's host
    pool where ``host``: each layer's bytes come from the stage that holds it."""
    w = workload(
        shape,
        pages[0],
        requests=10,
        min_tokens=1,
        max_tokens=160,
        state=state,
        host_every=host,
        decode_page_size=pages[1] if pages[1] != pages[0] else 0,
    )
    res = run_pd(
        w, prefill_pp=prefill_pp, decode_pp=decode_pp, prefill_tp=tp[0], decode_tp=tp[1], env=env
    )
    assert_clean(res)
    stages = {rank // tp[0] for (_, rank) in res.prefill}
    assert stages == set(range(prefill_pp)), sorted(res.prefill)


@pytest.mark.timeout(180)
def test_hybrid_state_into_a_pp1_decode_is_refused_on_both_sides() -> None:
    """A hybrid model's state buffers are per stage and a PP 1 decode holds them all in one
    list: the stages refuse the decode at registration, naming why, and every room fails on
    both sides with that reason instead of waiting for a timeout."""
    w = workload("tiny", 16, requests=4, state=True)
    res = run_pd(w, prefill_pp=2, decode_pp=1)
    decoded = res.decode_results()
    assert len(decoded) == 4, decoded
    for room, r in decoded.items():
        assert not r["ok"], (room, r)
        assert "state buffers" in (r.get("reason") or ""), r.get("reason")
    for key, ranks in res.prefill.items():
        results = ranks.get("results", {})
        assert len(results) == 4, (key, results)
        for r in results.values():
            assert not r["ok"] and "state buffers" in (r.get("reason") or ""), (key, r)


@pytest.mark.timeout(180)
def test_a_stage_killed_mid_transfer_fails_the_decodes_rooms_fast(tmp_path: Path) -> None:
    """Two prefill stages hold each room's last chunk after its first landed on a PP 1
    decode (both stages' layers). SIGKILL stage 1: every room fails on the decode within 2 s
    with a reason naming a prefill rank, and the decode's tables drain; stage 0, whose
    rooms the decode no longer waits for, is not killed."""
    from helpers.faults import FaultCluster, first_chunk_pages, make_requests

    from sgl_nixl_plugin.bench.session import free_port
    from sgl_nixl_plugin.bench.workload import PRESETS, Workload

    env = {
        "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
        "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
    }
    w = Workload(PRESETS["tiny"], page_size=16, max_tokens=256, concurrency=16, state=False)
    with FaultCluster(w, tmp_path, env) as c:
        boot, pp_port = free_port(), free_port()
        c.bootstrap("boot0", boot)
        stages = [
            c.add(
                f"prefill0.pp{r}",
                c.spec("prefill", bootstrap_port=boot, pp_size=2, pp_rank=r, pp_port=pp_port),
            )
            for r in range(2)
        ]
        d = c.decode("decode0")
        c.ready()
        addr = f"127.0.0.1:{boot}"
        # a PP 1 decode pairs with stages of a model without state buffers
        reqs = [
            replace(r, with_state=False) for r in make_requests(6, 93, tokens=(200, 256), chunks=2)
        ]
        rooms = {r.room for r in reqs}
        for p in stages:
            p.call("expect", reqs=reqs, plans={r.room: "hold" for r in reqs})
        assert d.call("submit", reqs=reqs, addr=addr) == {}
        want = {r.room: first_chunk_pages(r, 16) for r in reqs}
        poll_until(
            lambda: d.call("landed", rooms=list(want)),
            lambda got: all(got.get(room, 0) >= n for room, n in want.items()),
            30,
        )
        assert not d.done(rooms), "a held room finished early"
        t_kill = stages[1].kill()
        failed = d.wait_done(rooms, 20)
        assert set(failed) == rooms and not any(r["ok"] for r in failed.values()), failed
        slow = {room: r["t"] - t_kill for room, r in failed.items() if r["t"] - t_kill > 2.0}
        assert not slow, f"rooms failed later than 2 s after the kill: {slow}"
        assert all("prefill" in (r["reason"] or "") for r in failed.values()), failed
        st = d.call("state")
        left = {k: v for k, v in st["tables"].items() if v and k.startswith("decode.")}
        assert not left, left
