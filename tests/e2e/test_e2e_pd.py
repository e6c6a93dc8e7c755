"""End-to-end PD transfers through our plugin, in local processes over real NIXL (UCX, DRAM).

Each session starts a bootstrap server, every prefill rank and every decode rank in its
own process; the classes come only from SGLang's ``load_plugins()`` + ``get_kv_class``.
Prefill fills pages with a (room, region, page, token, head, word) pattern and decode
checks every byte of every page, aux row and state row (``sgl_nixl_plugin.bench``).

A session costs ~10-25 s on a 2-core machine (each rank imports SGLang), so the matrix is
combined: one session per (TP pair x shape), page size alternating so every TP pair and
every shape sees page size 1 and 16; inside a session requests cycle through chunks 1 and 3
and contiguous and random pages (all four combinations).
"""

from __future__ import annotations

import pytest
from helpers.pd import assert_clean, run_pd, timeline_problems, workload

# (prefill_tp, decode_tp, shape, page_size)
MATRIX = [
    (1, 1, "tiny", 16),
    (1, 1, "tiny-mla", 1),
    (2, 1, "tiny", 1),
    (2, 1, "tiny-mla", 16),
    (1, 2, "tiny", 16),
    (1, 2, "tiny-mla", 1),
]


def test_matrix_covers_the_grid() -> None:
    """The combined matrix still covers every TP pair x page size and shape x page size."""
    assert {(p, d, ps) for p, d, _, ps in MATRIX} == {
        (p, d, ps) for p, d in ((1, 1), (2, 1), (1, 2)) for ps in (1, 16)
    }
    assert {(s, ps) for _, _, s, ps in MATRIX} == {
        (s, ps) for s in ("tiny", "tiny-mla") for ps in (1, 16)
    }
    reqs = workload("tiny", 16).make_requests()
    assert {(r.chunks, r.contiguous) for r in reqs} == {
        (c, k) for c in (1, 3) for k in (False, True)
    }
    assert all(r.with_state for r in reqs)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "shape", "page_size"),
    MATRIX,
    ids=[f"tp{p}to{d}-{s}-ps{ps}" for p, d, s, ps in MATRIX],
)
def test_pd_matrix(prefill_tp: int, decode_tp: int, shape: str, page_size: int) -> None:
    w = workload(shape, page_size, requests=14)
    res = run_pd(w, prefill_tp=prefill_tp, decode_tp=decode_tp)
    assert_clean(res)
    # both sides' events reach the bench with their stamps, ordered on the one clock
    assert not timeline_problems(res), timeline_problems(res)[:10]
    # each decode rank registered with its prefill ranks before its first request, every
    # (decode rank, prefill rank) pair was set up once, and without a warm-up WRITE: the
    # decode's first request waited for it (the bench's decode learns its prefill then)
    warmed = [r["tables"].get("count.warmed_prefills") for r in res.decode.values()]
    assert warmed == [1] * decode_tp
    # and SGLang's first look at the prefill was answered from the warm-up's route table
    # (its own checks and rank mapping ran on it): one bootstrap query, not two
    answered = [r["tables"].get("count.topology_from_route_table") for r in res.decode.values()]
    assert answered == [1] * decode_tp
    tables = [r["tables"] for r in res.prefill.values()]
    light = [t.get("count.light_warmups", 0) for t in tables]
    assert sum(light) == max(prefill_tp, decode_tp) and all(light)
    assert [(t.get("count.warmups"), t.get("count.host_warmups")) for t in tables] == [
        (0, 0)
    ] * len(tables)


@pytest.mark.timeout(180)
def test_pd_200_concurrent_requests() -> None:
    w = workload("tiny", 16, requests=200, min_tokens=16, max_tokens=64, concurrency=200)
    res = run_pd(w)
    assert_clean(res)
    assert len(res.decode_results()) == 200


@pytest.mark.timeout(180)
def test_pd_one_prefill_two_decode_instances() -> None:
    w = workload("tiny", 16, requests=16)
    res = run_pd(w, n_decode=2)
    assert_clean(res)
    # both decode instances really took part
    assert {k[0] for k, r in res.decode.items() if r["results"]} == {0, 1}


@pytest.mark.timeout(180)
def test_pd_two_prefill_instances_one_decode() -> None:
    w = workload("tiny", 16, requests=16)
    res = run_pd(w, n_prefill=2)
    assert_clean(res)
    assert {k[0] for k, r in res.prefill.items() if r["results"]} == {0, 1}
    # the first room to each prefill waited for its handshake, the bench's first-request
    # clock counts it; no later room did
    shakes = [r["handshake_s"] for r in res.decode_results().values() if "handshake_s" in r]
    assert len(shakes) == 2 and all(s > 0 for s in shakes), shakes
    (decode,) = [r["tables"] for r in res.decode.values()]
    assert decode.get("count.topology_from_route_table") == 2


@pytest.mark.timeout(180)
def test_a_decode_that_names_its_prefills_registers_before_its_first_request() -> None:
    """``SGLANG_NIXL_PLUGIN_PREFILLS``: the decode registers with both prefills at start-up,
    each takes a whole warm-up WRITE (no request waited for it), and the first receiver to
    each found its route in what the start-up registration asked for."""
    w = workload("tiny", 16, requests=8)
    res = run_pd(w, n_prefill=2, preconnect=True)
    assert_clean(res)
    (decode,) = [r["tables"] for r in res.decode.values()]
    assert decode.get("count.warmed_prefills") == 2
    assert decode.get("count.warmup_routes_reused") == 2
    assert decode.get("count.topology_from_route_table") == 2
    # each took the whole warm-up, its host-to-host WRITE (aux rows) into the decode's
    # scratch buffer included
    prefill = [
        tuple(r["tables"].get(f"count.{k}") for k in ("warmups", "light_warmups", "host_warmups"))
        for r in res.prefill.values()
    ]
    assert prefill == [(1, 0, 1), (1, 0, 1)]


@pytest.mark.parametrize("slot_wait", ["5", "0.05", "0"])
def test_pd_rooms_wait_for_receiver_staging_slots(slot_wait: str) -> None:
    """The decode's staging holds one room's slots: the other rooms ask and are granted
    slots as they free, oldest room first (SlotAsk / SlotGrant), every byte lands, and nothing
    is left queued. With a short ``SLOT_WAIT`` chunks that find no slot in time go direct
    while other chunks of their rooms are staged (the grants they get later are freed
    when their sender is done); either way every byte lands and no room reports Success early."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 10),  # 4 slots: one room's worth
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(16 << 10),
        "SGLANG_NIXL_PLUGIN_SLOT_WAIT": slot_wait,
    }
    w = workload("tiny", 16, requests=16, concurrency=8, min_tokens=64, max_tokens=160)
    res = run_pd(w, env=env)
    assert_clean(res)
    decode = res.decode[(0, 0)]["tables"]
    assert decode["decode.waiting"] == 0
    assert decode["count.staging.asks"] > 0, decode  # rooms really had to wait
    # every room's page indices were uploaded when it was granted, none at a first piece
    assert decode["count.staging.prepared"] > 0 and decode["count.staging.late_uploads"] == 0
    if slot_wait == "5":
        # every waiting sender was served before SLOT_WAIT ran out: none went direct (before
        # 0.4.0 rooms that waited for a grant held the prefill's local slots, and 6-21 of
        # these chunks went direct after 5 s)
        assert decode["count.staging.late_grants"] >= decode["count.staging.asks"], decode
        assert res.prefill[(0, 0)]["tables"]["count.staging.fell_back"] == 0


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_pd_contended_staging_with_tp_mismatch_sends_nothing_direct(
    prefill_tp: int, decode_tp: int
) -> None:
    """One room's worth of receiver slots, 8 rooms at once, TP 2 -> 1 and 1 -> 2. Before
    0.4.0 rooms waited on each other until ``SLOT_WAIT`` (5 s) sent them direct: with two
    senders a room, one sender of room B held slots while the other waited behind room C,
    and C's likewise (5-13 chunks direct); with two decode ranks, each granted a different
    room first (16-30 chunks direct). Now a sender's slots are freed when its Success is
    applied, every decode rank serves rooms in request order, and a recall stands until the
    slots are idle: no chunk goes direct."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 10),
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(16 << 10),
        "SGLANG_NIXL_PLUGIN_SLOT_WAIT": "5",
    }
    w = workload("tiny", 16, requests=16, concurrency=8, min_tokens=64, max_tokens=160)
    res = run_pd(w, prefill_tp=prefill_tp, decode_tp=decode_tp, env=env)
    assert_clean(res)
    fell_back = {k: r["tables"]["count.staging.fell_back"] for k, r in res.prefill.items()}
    assert set(fell_back.values()) == {0}, fell_back
    # every room staged: the decode's events carry its pieces' stamps, in order
    assert not timeline_problems(res, staged=True), timeline_problems(res, staged=True)[:10]
    for key, r in res.decode.items():
        t = r["tables"]
        assert t["count.staging.asks"] > 0 and t["count.staging.freed_early"] > 0, (key, t)


def test_pd_tp_mismatch_senders_share_a_rooms_slots() -> None:
    """Four prefill ranks send to one decode rank (TP 4 -> 1) through staging with 8
    receiver slots. Slots return only when their sender is done, so each sender gets a share of the
    room's (``slots_per_sender``): all four start at once and no sender has to ask and wait
    (with a whole room's worth each, two would wait ``SLOT_WAIT`` and then go direct)."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(128 << 10),  # 8 slots
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(16 << 10),
    }
    w = workload("tiny", 16, requests=6, concurrency=1, min_tokens=64, max_tokens=160)
    # the decode names its prefills: its staging area is allocated and offered to each
    # rank before the first request (learned from a request, that room's senders ask)
    res = run_pd(w, prefill_tp=4, decode_tp=1, env=env, preconnect=True)
    assert_clean(res)
    decode = res.decode[(0, 0)]["tables"]
    assert decode["count.staging.asks"] == 0, decode
    assert decode["count.staging.prepared"] > 0 and decode["count.staging.late_uploads"] == 0


def test_pd_chunked_rooms_give_slots_back_between_chunks() -> None:
    """A room holds receiver slots only while a chunk uses them: between the chunks of a
    chunked prefill (30 ms apart here, like forward passes) its prefill gives them back
    once every piece there was scattered (SlotReturn) and asks again for the next chunk,
    so the rooms share one room's worth of slots chunk by chunk instead of waiting for
    whole rooms. Every byte lands; nothing stays held, busy or queued."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 10),  # 4 slots: one room's worth
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(16 << 10),
        "SGLANG_NIXL_PLUGIN_SLOT_WAIT": "10",  # each chunk waits its turn
    }
    w = workload(
        "tiny",
        16,
        requests=8,
        concurrency=4,
        min_tokens=96,
        max_tokens=160,
        chunks=(3,),
        chunk_gap_ms=30,
    )
    res = run_pd(w, env=env)
    assert_clean(res)
    decode = res.decode[(0, 0)]["tables"]
    assert decode["count.staging.returned"] > 0, decode
    assert decode["decode.waiting"] == decode["decode.slots_busy"] == 0, decode


def test_pd_slots_granted_to_a_room_not_ready_are_recalled_for_one_that_is() -> None:
    """The decode grants slots when it asks for a room, but that room's prefill may be ready
    late (here every other room waits 400 ms, like a later forward pass). A room that is
    ready and finds none makes the decode recall the idle holder's slots (SlotRecall); its
    prefill gives back what no chunk uses (SlotReturn) and asks again when ready. So no
    chunk waits out SLOT_WAIT (0.25 s here) and goes direct, and every byte lands."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 10),  # 4 slots: one room's worth
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(16 << 10),
        "SGLANG_NIXL_PLUGIN_SLOT_WAIT": "0.25",
    }
    w = workload(
        "tiny",
        16,
        requests=6,
        concurrency=6,
        min_tokens=96,
        max_tokens=160,
        chunks=(1,),
        send_delays_ms=(400.0, 0.0),
    )
    res = run_pd(w, env=env, preconnect=True)  # staging offered before the first room
    assert_clean(res)
    decode = res.decode[(0, 0)]["tables"]
    prefill = res.prefill[(0, 0)]["tables"]
    assert decode["count.staging.recalls"] > 0 and decode["count.staging.returned"] > 0, decode
    assert prefill["count.staging.fell_back"] == 0, prefill
    assert decode["decode.slots_held"] == decode["decode.waiting"] == 0, decode
