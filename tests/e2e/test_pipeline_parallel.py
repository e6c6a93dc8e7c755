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

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

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


@contextmanager
def _two_stages(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[Any, list[Any], Any, str]]:
    """A bootstrap, a prefill of two PP stages and a PP 1 decode of the fault harness, for a
    model without state buffers: (cluster, stages, decode, bootstrap address)."""
    from helpers.faults import FaultCluster

    from sgl_nixl_plugin.bench.session import free_port
    from sgl_nixl_plugin.bench.workload import PRESETS, Workload

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
        yield c, stages, d, f"127.0.0.1:{boot}"


def _held_mid_transfer(stages: list[Any], d: Any, seed: int, addr: str) -> list[Any]:
    """Six two-chunk requests whose last chunk both stages hold, returned once every room's
    first chunk landed on the decode (both stages' layers of it)."""
    from helpers.faults import first_chunk_pages, make_requests

    reqs = [
        replace(r, with_state=False) for r in make_requests(6, seed, tokens=(200, 256), chunks=2)
    ]
    for p in stages:
        p.call("expect", reqs=reqs, plans={r.room: "hold" for r in reqs})
    assert d.call("submit", reqs=reqs, addr=addr) == {}
    want = {r.room: first_chunk_pages(r, 16) for r in reqs}
    poll_until(
        lambda: d.call("landed", rooms=list(want)),
        lambda got: all(got.get(room, 0) >= n for room, n in want.items()),
        30,
    )
    assert not d.done(set(want)), "a held room finished early"
    return reqs


def _decode_tables(d: Any) -> dict[str, int]:
    st = d.call("state")
    return {k: v for k, v in st["tables"].items() if v and k.startswith("decode.")}


@pytest.mark.timeout(180)
def test_a_stage_killed_mid_transfer_fails_the_decodes_rooms_fast(tmp_path: Path) -> None:
    """Two prefill stages hold each room's last chunk after its first landed on a PP 1
    decode. SIGKILL stage 1: every room fails on the decode within 2 s with a reason naming
    a prefill rank, and the decode's tables drain."""
    env = {
        "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
        "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
    }
    with _two_stages(tmp_path, env) as (c, stages, d, addr):
        rooms = {r.room for r in _held_mid_transfer(stages, d, 93, addr)}
        t_kill = stages[1].kill()
        failed = d.wait_done(rooms, 20)
        assert set(failed) == rooms and not any(r["ok"] for r in failed.values()), failed
        slow = {room: r["t"] - t_kill for room, r in failed.items() if r["t"] - t_kill > 2.0}
        assert not slow, f"rooms failed later than 2 s after the kill: {slow}"
        assert all("prefill" in (r["reason"] or "") for r in failed.values()), failed
        assert not _decode_tables(d)


@pytest.mark.timeout(180)
def test_rooms_aborted_mid_transfer_are_acked_by_every_stage_after_its_writes(
    tmp_path: Path,
) -> None:
    """Staged, with SGLang's deferred release: the decode aborts each room as soon as bytes
    of its last chunk land, both stages' last chunks in flight. Every abort is acked (SGLang
    waits for each stage's ACK), and no byte of an acked room changes after its ACK, even
    once both stages have finished everything."""
    from helpers.faults import aborted_and_acked, changed_after_ack, first_chunk_pages

    env = {
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
    }
    with _two_stages(tmp_path, env) as (c, stages, d, addr):
        reqs = _held_mid_transfer(stages, d, 94, addr)
        rooms = {r.room for r in reqs}
        d.call(
            "arm_abort",
            rooms=sorted(rooms),
            from_page={r.room: first_chunk_pages(r, 16) for r in reqs},
        )
        for p in stages:
            p.call("release", rooms=sorted(rooms))

        aborted, finished = aborted_and_acked(d, rooms)
        assert aborted, "no room could be aborted mid-transfer"
        for p in stages:
            p.wait_done(rooms, 20)
        touched = changed_after_ack(d, aborted)
        assert not touched, f"bytes changed after the ACK: {touched}\n{c.logs()}"
        ok = d.done(finished)
        assert all(r["ok"] and not r["bad_pages"] for r in ok.values()), ok
        assert not _decode_tables(d)
