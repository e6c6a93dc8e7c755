"""One-pass transfers through CUDA IPC, end to end through SGLang's classes, on a GPU.

Prefill and decode ranks are separate processes on one GPU (or on GPUs 0 and 1 when two are
present): the decode offers its KV pool in its registration, the prefill maps it and writes
each chunk's pages with one kernel. Every byte is compared (bf16 patterns), the path each
room took is checked, and every mapping is closed when the prefill's manager closes. Skipped
without CUDA, Triton and cuda-python (CI); run on the lent GPU by ``ci/gpu_one_pass.sh``.
"""

from __future__ import annotations

import importlib.util
import time

import pytest
from helpers.pd import (
    ABORT_ENV,
    E2E_ENV,
    abort_workload,
    assert_aborts_fenced,
    assert_clean,
    hermetic_environ,
    run_pd,
    workload,
)

from sgl_nixl_plugin.bench.session import Session, SessionConfig
from sgl_nixl_plugin.bench.workload import PRESETS, Workload

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _gpus() -> int:
    if any(importlib.util.find_spec(m) is None for m in ("torch", "triton", "cuda.bindings")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = _gpus()
needs_gpu = pytest.mark.skipif(
    GPUS == 0, reason="needs a CUDA device, Triton and cuda-python (cuda.bindings)"
)
DECODE_GPU = 1 if GPUS > 1 else 0


def _paths(res) -> set[str]:
    return {
        r.get("path")
        for ranks in res.prefill.values()
        for r in ranks.get("results", {}).values()
        if r.get("ok")
    }


def _paths_by_destination(res) -> tuple[set[str], set[str]]:
    """The paths of the rooms the decode received into its host pool, and of the others."""
    host = {
        room
        for ranks in res.decode.values()
        for room, r in ranks.get("results", {}).items()
        if r.get("host")
    }
    paths: dict[bool, set[str]] = {True: set(), False: set()}
    for ranks in res.prefill.values():
        for room, r in ranks.get("results", {}).items():
            if r.get("ok"):
                paths[room in host].add(r.get("path"))
    return paths[True], paths[False]


def _mapped_peers(res) -> int:
    return sum(r.get("tables", {}).get("count.one_pass.peers", 0) for r in res.prefill.values())


def _flags(res, what: str = "hits") -> int:
    """Completion flags (``DONE_FLAGS``) the decodes handed out ("given") or saw stored
    and applied a sender's Success from ("hits")."""
    key = "count.flag_hits" if what == "hits" else "count.flags_given"
    return sum(r.get("tables", {}).get(key, 0) for r in res.decode.values())


def _staging_held(res) -> list[int]:
    """GPU bytes each rank's staging buffer holds (taken at a peer's first staged need)."""
    ranks = [*res.prefill.values(), *res.decode.values()]
    return [r.get("tables", {}).get("count.staging.held_bytes", 0) for r in ranks]


def _open_after_close(res) -> list[int]:
    return [r.get("ipc_open", 0) for r in res.prefill.values()]


def _run(shape: str, page: int, *, env: dict | None = None, **kw):
    w = workload(
        shape,
        page,
        requests=kw.pop("requests", 16),
        min_tokens=1,
        max_tokens=kw.pop("max_tokens", 600),
        host_every=kw.pop("host_every", 0),
        decode_page_size=kw.pop("decode_page_size", 0),
    )
    return run_pd(w, mem_kind="VRAM", prefill_gpu=0, decode_gpu=DECODE_GPU, env=env or {}, **kw)


def _kill_after_three_rooms(role: str, requests: int, timeout_s: float, env: dict):
    """Llama-3.1-8B rooms of 2-4k tokens, 8 in flight, one-pass path; ``role``'s rank is
    SIGKILLed once three rooms finished (copies in flight): (result, kill times)."""
    w = Workload(
        PRESETS["llama-3.1-8b"],
        page_size=16,
        requests=requests,
        min_tokens=2048,
        max_tokens=4096,
        concurrency=8,
        state=False,
    )
    cfg = SessionConfig(
        w,
        mem_kind="VRAM",
        prefill_gpu=0,
        decode_gpu=DECODE_GPU,
        timeout_s=timeout_s,
        env={**E2E_ENV, **env},
    )
    killed: list[float] = []
    with hermetic_environ():
        session = Session(cfg).start()

        def progress(n: int) -> None:
            if n >= 3 and not killed:
                session.kill(role, 0, 0)
                killed.append(time.time())

        return session.wait(progress), killed


@needs_gpu
@pytest.mark.parametrize(
    ("shape", "page", "prefill_tp", "decode_tp", "decode_page"),
    [
        ("tiny", 1, 1, 1, 0),
        ("tiny", 16, 1, 1, 0),
        ("tiny", 16, 2, 1, 0),
        ("tiny", 16, 1, 2, 0),
        ("tiny-mla", 16, 2, 1, 0),
        ("tiny", 16, 1, 1, 64),
        ("tiny", 64, 2, 1, 16),
    ],
    ids=["p1", "p16", "tp2to1", "tp1to2", "mla-tp2to1", "pages16to64", "pages64to16-tp2to1"],
)
def test_one_pass_writes_every_byte_into_the_decodes_pages(
    shape: str, page: int, prefill_tp: int, decode_tp: int, decode_page: int
) -> None:
    """Random and contiguous pages, one and three chunks, aux rows and state (those go by
    NIXL): byte-exact, every room in one pass, every mapping closed at the end."""
    res = _run(
        shape, page, prefill_tp=prefill_tp, decode_tp=decode_tp, decode_page_size=decode_page
    )
    assert_clean(res)
    if shape.endswith("mla") and prefill_tp > decode_tp:
        assert "ipc" in _paths(res)  # one MLA rank of two sends; the other's rooms are dummy
    else:
        assert _paths(res) == {"ipc"}
    assert _mapped_peers(res) >= prefill_tp
    assert _open_after_close(res) and set(_open_after_close(res)) == {0}
    # every flag handed out was stored once its room's bytes were there (checked above),
    # and each decode's board has every word back
    assert _flags(res) == _flags(res, "given") > 0, (_flags(res), _flags(res, "given"))
    # one pass only: no rank took a byte of staging memory
    assert set(_staging_held(res)) == {0}, _staging_held(res)


@needs_gpu
def test_without_completion_flags_rooms_end_through_the_status_message() -> None:
    res = _run("tiny", 16, env={"SGLANG_NIXL_PLUGIN_DONE_FLAGS": "0"}, requests=8)
    assert_clean(res)
    assert _paths(res) == {"ipc"} and _flags(res, "given") == _flags(res) == 0


@needs_gpu
def test_host_destinations_do_not_take_the_one_pass_path() -> None:
    """Rooms received into the decode's host pool go staged (or direct); the others of the
    same session in one pass."""
    w = workload("tiny", 16, requests=16, min_tokens=1, max_tokens=600, host_every=2, state=False)
    res = run_pd(w, mem_kind="VRAM", prefill_gpu=0, decode_gpu=DECODE_GPU)
    assert_clean(res)
    host, device = _paths_by_destination(res)
    # a host room goes direct until the first one the path rule would stage has set the
    # pair's staging up (that one goes direct too), then staged
    assert host and host <= {"staging", "direct"}, (host, device)
    assert device == {"ipc"}, (host, device)


@needs_gpu
@pytest.mark.parametrize(
    "env",
    [
        {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging"},
        {"SGLANG_NIXL_PLUGIN_CUDA_IPC": "0"},
    ],
    ids=["staging-forced", "ipc-off"],
)
def test_the_one_pass_path_can_be_forbidden(env: dict) -> None:
    res = _run("tiny", 16, env=env, requests=8)
    assert_clean(res)
    assert "ipc" not in _paths(res)
    assert _mapped_peers(res) == 0
    if "staging" in _paths(res):  # the staged path took its GPU buffers at first need
        assert min(_staging_held(res)) > 0, _staging_held(res)


@needs_gpu
def test_many_rooms_in_flight_at_once_arrive_byte_exact() -> None:
    """Concurrency: 48 rooms, up to 16 in flight, across two prefill workers. The decode
    names the prefill at start-up: rooms sent before a prefill rank's registration reply
    (as SGLang's scheduler sends a new prefill's first ones) are granted staging slots,
    which a one-pass prefill then returns unused."""
    w = workload("tiny", 16, requests=48, min_tokens=200, max_tokens=2000, concurrency=16)
    res = run_pd(w, mem_kind="VRAM", prefill_gpu=0, decode_gpu=DECODE_GPU, preconnect=True)
    assert_clean(res)
    assert _paths(res) == {"ipc"}
    # the prefill said it writes in one pass: the decode granted no staging slots (none
    # came back) and uploaded no page numbers for scatters
    slots = {
        k: sum(r.get("tables", {}).get(f"count.staging.{k}", 0) for r in res.decode.values())
        for k in ("returned", "prepared")
    }
    assert slots == {"returned": 0, "prepared": 0}, slots


@needs_gpu
def test_a_prefill_killed_mid_transfer_fails_the_decodes_rooms_within_2s() -> None:
    """Llama-3.1-8B rooms of 2-4k tokens, 8 in flight, one-pass path: the prefill is
    SIGKILLed once three rooms finished (kernels in flight); the rooms in flight fail within
    2 s of the kill with a reason, and the finished ones are byte-exact. (The bootstrap
    server lives in the prefill's process and dies with it: rooms not yet started there
    wait for it, as they would in SGLang.)"""
    res, killed = _kill_after_three_rooms(
        "prefill", 40, 120, {"SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "5"}
    )
    rooms = res.decode_results()
    assert killed, "the prefill was never killed: fewer than 3 rooms finished"
    failed = [r for r in rooms.values() if not r["ok"]]
    assert failed, f"no room failed: {len(rooms)} finished"
    late = [r["wall1"] - killed[0] for r in failed if r["wall1"] - killed[0] > 2.0]
    assert not late, f"rooms failed {late[:5]} s after the kill"
    assert all(r.get("reason") for r in failed)
    assert not any(r.get("bad_pages") for r in rooms.values())


@needs_gpu
def test_a_decode_killed_mid_transfer_fails_the_prefills_rooms_and_unmaps_its_pool() -> None:
    """The decode is SIGKILLed once three rooms finished, with one-pass copies into its
    pool in flight: the prefill survives, each of its rooms either succeeded or failed
    with a reason, it drops the lost decode's mapping while it still runs (no mapped
    peer left before its manager closes) and no mapping stays open after the close."""
    env = {
        "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
        "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "10",
    }
    res, killed = _kill_after_three_rooms("decode", 24, 45, env)
    assert killed, "the decode was never killed: fewer than 3 rooms finished"
    assert res.prefill, f"the prefill did not report: {res.errors}"
    rooms = {k: v for r in res.prefill.values() for k, v in r.get("results", {}).items()}
    failed = [r for r in rooms.values() if not r["ok"]]
    assert failed, f"no prefill room failed: {len(rooms)} ended"
    assert all(r.get("reason") for r in failed), failed[:3]
    assert _mapped_peers(res) == 0, "the lost decode's pool is still mapped"
    assert set(_open_after_close(res)) == {0}


@needs_gpu
def test_decode_aborts_during_one_pass_copies_leave_no_write_after_the_ack() -> None:
    """The decode aborts every third Llama-3.1-8B room (2-8k tokens) at a random moment up
    to 2 ms after its request (deferred KV release): once the prefill's ACK came, the
    room's pages are painted and stay so (a copy launched after the abort, or still
    running at the ACK, would overwrite them); the other rooms arrive byte-exact, in one
    pass."""
    w = abort_workload(
        PRESETS["llama-3.1-8b"], requests=30, min_tokens=2048, max_tokens=8192, abort_within_ms=2.0
    )
    res = run_pd(w, mem_kind="VRAM", prefill_gpu=0, decode_gpu=DECODE_GPU, env=ABORT_ENV)
    counts = assert_aborts_fenced(res)
    print(f"\none pass: {counts}")
    assert _paths(res) == {"ipc"}
