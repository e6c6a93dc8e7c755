"""Staging memory is taken when a peer first needs the staged path, not at start-up (issue
37): real NIXL on host memory (DRAM staging runs the same code as GPU staging), every rank
in its own process, every byte of every room checked by the decode.

Each rank reports what its staging buffer holds (``count.staging.held_bytes``), how often it
was allocated, and how often that failed; a decode also counts the staging areas it sent on
request (``count.staging.offers``), a prefill the decodes whose area it writes
(``count.staging.peers``).
"""

from __future__ import annotations

import pytest
from helpers.pd import assert_clean, run_pd, workload

from sgl_nixl_plugin.engine.staging_memory import planned_bytes

pytestmark = pytest.mark.timeout(180)

SLOT = 16 << 10
STAGED = {
    "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
    "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 10),  # 4 slots: one room's worth
    "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(SLOT),
}
HELD = planned_bytes(64 << 10, SLOT)
#: More host memory than a process can map: the allocation fails for real (MemoryError).
TOO_LARGE = str(1 << 50)


def _tables(res, role: str) -> list[dict[str, int]]:
    ranks = res.prefill if role == "prefill" else res.decode
    return [r["tables"] for _, r in sorted(ranks.items())]


def _staging(tables: dict[str, int]) -> tuple[int, int, int]:
    """(bytes held, allocations, failed allocations) of one rank (0s: staging off)."""
    return (
        tables.get("count.staging.held_bytes", 0),
        tables.get("count.staging.allocations", 0),
        tables.get("count.staging.alloc_failures", 0),
    )


def _assert_no_staging_memory(res) -> dict:
    """A clean session in which neither rank allocated, offered or took staging memory;
    the prefill's tables."""
    assert_clean(res)
    (decode,) = _tables(res, "decode")
    (prefill,) = _tables(res, "prefill")
    assert _staging(prefill) == (0, 0, 0), prefill
    assert _staging(decode) == (0, 0, 0), decode
    assert decode["count.staging.offers"] == 0 and prefill["count.staging.peers"] == 0
    return prefill


def test_a_pair_that_never_stages_holds_no_staging_memory() -> None:
    """The prefill writes direct only: neither rank holds a byte of staging memory, though
    the decode has staging on (before: 128 MiB of host memory from start-up)."""
    w = workload("tiny", 16, requests=8)
    res = run_pd(w, role_env={"prefill": {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "direct"}})
    _assert_no_staging_memory(res)


def test_a_pair_whose_chunks_all_go_direct_by_the_rule_holds_no_staging_memory() -> None:
    """The path rule (``TRANSFER_PATH=auto``) sends every chunk of contiguous pages direct: a
    pair learned from its first request allocates nothing on either side (before, both
    took 128 MiB of host memory at the pair's set-up, inside its first requests: the main
    job ran 12-15% slower)."""
    w = workload("tiny", 16, requests=8, fragmentation="contiguous")
    res = run_pd(w)
    prefill = _assert_no_staging_memory(res)
    assert prefill["count.staging.needs"] == 0, prefill


def test_the_first_chunk_the_rule_would_stage_sets_staging_up() -> None:
    """Pages of one token, scattered (``TRANSFER_PATH=auto``): the first chunk the rule
    would stage goes direct and has both buffers allocated, once each; later rooms are
    staged; every byte lands."""
    w = workload("tiny", 1, requests=12, min_tokens=64, max_tokens=160)
    res = run_pd(w, env={k: v for k, v in STAGED.items() if "PATH" not in k})
    assert_clean(res)
    (decode,) = _tables(res, "decode")
    (prefill,) = _tables(res, "prefill")
    assert prefill["count.staging.needs"] == 1, prefill
    assert _staging(prefill) == (HELD, 1, 0), prefill
    assert _staging(decode) == (HELD, 1, 0), decode
    assert decode["count.staging.offers"] == 1 and prefill["count.staging.peers"] == 1
    assert decode["count.staging.prepared"] > 0, decode  # later rooms were staged


def test_the_first_staged_room_allocates_once_on_each_side() -> None:
    """A decode that registers at start-up: the prefill takes its buffer when it sets the
    decode up, the decode when that prefill asks; every room is then staged, byte-exact,
    and neither side allocates again."""
    w = workload("tiny", 16, requests=8, concurrency=4)
    res = run_pd(w, env=STAGED, preconnect=True)
    assert_clean(res)
    (decode,) = _tables(res, "decode")
    (prefill,) = _tables(res, "prefill")
    assert _staging(prefill) == (HELD, 1, 0), prefill
    assert _staging(decode) == (HELD, 1, 0), decode
    assert decode["count.staging.offers"] == 1 and prefill["count.staging.peers"] == 1
    # every room's pages were granted staging slots (its first request already had them)
    assert decode["count.staging.prepared"] == len(w.make_requests()), decode
    assert prefill["count.staging.fell_back"] == 0


def test_rooms_sent_while_the_staging_area_is_allocated_all_land() -> None:
    """Two prefill ranks ask one decode rank for its staging area at once, while 16 rooms
    are already on their way: the decode allocates once and sends the area to both; rooms
    staged meanwhile wait for its slots, and every byte lands."""
    w = workload("tiny", 16, requests=24, concurrency=16, min_tokens=64, max_tokens=160)
    res = run_pd(w, env=STAGED, prefill_tp=2, decode_tp=1)
    assert_clean(res)
    (decode,) = _tables(res, "decode")
    assert _staging(decode) == (HELD, 1, 0), decode
    assert decode["count.staging.offers"] == 2, decode  # once to each
    prefills = _tables(res, "prefill")
    assert [_staging(t) for t in prefills] == [(HELD, 1, 0)] * 2, prefills
    assert [t["count.staging.peers"] for t in prefills] == [1, 1]
    # every room was staged (its slots granted with the request or on its ask)
    assert decode["count.staging.prepared"] == len(w.make_requests()), decode


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_staging_buffer_that_cannot_be_allocated_sends_direct(side: str) -> None:
    """A real out-of-memory on one side at its first staged peer: that side holds nothing
    and counts the failure, the other never allocates for this pair, every room goes
    direct and lands byte-exact."""
    w = workload("tiny", 16, requests=8)
    res = run_pd(
        w,
        env=STAGED,
        role_env={side: {"SGLANG_NIXL_PLUGIN_STAGING_BYTES": TOO_LARGE}},
        preconnect=True,
    )
    assert_clean(res)
    (decode,) = _tables(res, "decode")
    (prefill,) = _tables(res, "prefill")
    failed, other = (decode, prefill) if side == "decode" else (prefill, decode)
    assert _staging(failed) == (0, 0, 1), failed
    assert decode["count.staging.offers"] == 0
    assert prefill["count.staging.peers"] == 0
    if side == "prefill":  # it never asked: the decode took nothing
        assert _staging(other) == (0, 0, 0), other
