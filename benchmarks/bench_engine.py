"""Benchmark: the cost of building and submitting one KV WRITE, ours vs. the naive build.

Not a test: it prints figures and asserts nothing. Run it as ``python benchmarks/bench_engine.py``
(about 25-45 s on two CPU cores; DRAM only, two NIXL agents in this process, UCX on
loopback).

The request: 8,192 tokens at page size 1 over 32 layers x (K, V) = 64 regions, into a
pool of 16,384 pages per region (256 bytes per page per region: 256 MiB per side).

* ours -- ``TransferEngine.write``: strided descriptor lists prepared once per peer, so a
  request is numpy index arithmetic (``unit_indices``) + ``make_prepped_xfer`` +
  ``transfer``;
* naive -- what SGLang's in-tree non-prepped NIXL path does: a Python loop over layers
  builds one (address, length, device) row per page per layer into an Nx3 array, then
  ``get_xfer_descs`` (both sides) + ``initialize_xfer`` + ``transfer``.
  (SGLang first groups contiguous pages with ``group_concurrent_contiguous``; that costs
  extra Python time and is left out here, which flatters the naive figures.)

On one host NIXL's UCX backend copies the data inside ``transfer`` itself, and the copy
costs several seconds for half a million 256-byte descriptors. So the build-and-submit
figures are measured with the post deferred (``transfer`` timed but not issued, the
handle released unposted), over every iteration; posting and completing is measured
separately, for fewer iterations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ["UCX_NET_DEVICES"] = "lo"  # before NIXL loads UCX: loopback only
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

from sgl_nixl_plugin.engine.descriptors import (  # noqa: E402
    expected_descriptors,
    naive_descriptors,
    unit_indices,
)
from sgl_nixl_plugin.engine.engine import Memory, PeerLink, TransferEngine  # noqa: E402
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet  # noqa: E402
from sgl_nixl_plugin.registry.spec import AgentConfig  # noqa: E402

BUDGET_MS = 1.0
GAP = 4096  # bytes between regions: no two regions adjacent, so no merge across them


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=32, help="regions = 2 x layers (K and V)")
    p.add_argument("--bytes-per-page", type=int, default=256, help="per page per region")
    p.add_argument("--iters", type=int, default=20, help="build-and-submit iterations")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--complete-iters",
        type=int,
        default=1,
        help="post-and-complete iterations per path (random; naive contiguous)",
    )
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# -- set-up -------------------------------------------------------------------------------


def allocate(regions: int, pages: int, page_bytes: int, fill: int) -> tuple[np.ndarray, RegionSet]:
    """One allocation, regions ``GAP`` bytes apart: a (regions, pages, page_bytes) view."""
    stride = pages * page_bytes + GAP
    buf = np.full(regions * stride, fill, dtype=np.uint8)
    base = int(buf.ctypes.data)
    rs = RegionSet.of(
        [base + r * stride for r in range(regions)],
        [pages * page_bytes] * regions,
        [page_bytes] * regions,
        "DRAM",
    )
    view = buf.reshape(regions, stride)[:, : pages * page_bytes].reshape(regions, pages, page_bytes)
    return view, rs


def no_aux() -> RegionSet:
    return RegionSet.of([], [], [], "DRAM")


class NixlTimer:
    """Times ``make_prepped_xfer`` and ``transfer`` on one nixl_agent; can defer the post."""

    def __init__(self, nixl: Any) -> None:
        self.nixl = nixl
        self.make_s = 0.0
        self.post_s = 0.0
        self.post = True

    def _wrap(self, name: str, slot: str, deferred: Callable[..., Any] | None) -> None:
        real = getattr(self.nixl, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            fn = deferred if (deferred is not None and not self.post) else real
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, slot, getattr(self, slot) + time.perf_counter() - t0)

        setattr(self.nixl, name, timed)  # an instance attribute shadows the method

    @contextmanager
    def installed(self) -> Iterator[NixlTimer]:
        self._wrap("make_prepped_xfer", "make_s", None)
        self._wrap("transfer", "post_s", lambda *a, **k: "PROC")
        try:
            yield self
        finally:
            for name in ("make_prepped_xfer", "transfer"):
                self.nixl.__dict__.pop(name, None)

    def reset(self) -> None:
        self.make_s = self.post_s = 0.0


# -- the two ways to build one request ---------------------------------------------------------


def ours_index_arithmetic(link: PeerLink, src: np.ndarray, dst: np.ndarray) -> float:
    """Exactly the per-request numpy work ``TransferEngine.write`` does, timed alone."""
    g = link.groups["kv"]
    t0 = time.perf_counter()
    unit_indices(src, g.local.offsets[: g.num_regions], g.geometry.units_per_item)
    unit_indices(dst, g.remote.offsets[: g.num_regions], g.geometry.units_per_item)
    expected_descriptors(src, dst, g.num_regions, g.geometry)
    return time.perf_counter() - t0


def naive_build(
    src_rs: RegionSet, dst_rs: RegionSet, src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's non-prepped build: a Python loop over layers, one row per page per layer."""
    layers_params = list(zip(src_rs.ptrs, dst_rs.ptrs, src_rs.item_lens, strict=True))
    src_addrs, dst_addrs, lens = [], [], []
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    for src_ptr, dst_ptr, item_len in layers_params:
        src_addrs.append(src_ptr + src * item_len)
        dst_addrs.append(dst_ptr + dst * item_len)
        lens.append(np.full(len(src), item_len, dtype=np.int64))
    flat_src, flat_dst, flat_len = map(np.concatenate, (src_addrs, dst_addrs, lens))
    src_reqs = np.column_stack((flat_src, flat_len, np.zeros_like(flat_src)))
    dst_reqs = np.column_stack((flat_dst, flat_len, np.zeros_like(flat_dst)))
    return src_reqs, dst_reqs


def naive_submit(
    nixl: Any, peer: str, src_reqs: np.ndarray, dst_reqs: np.ndarray, post: bool
) -> tuple[Any, float, float, float]:
    """get_xfer_descs (both sides) + initialize_xfer (+ transfer): (handle, descs, init, post)."""
    t0 = time.perf_counter()
    local = nixl.get_xfer_descs(src_reqs, "DRAM")
    remote = nixl.get_xfer_descs(dst_reqs, "DRAM")
    t1 = time.perf_counter()
    handle = nixl.initialize_xfer("WRITE", local, remote, peer, b"")
    t2 = time.perf_counter()
    if post:
        state = nixl.transfer(handle)
        if state == "ERR":
            print("naive: NIXL refused the post", file=sys.stderr)
    t3 = time.perf_counter()
    return handle, t1 - t0, t2 - t1, t3 - t2


def wait_nixl(nixl: Any, handle: Any, deadline_s: float = 120.0) -> str:
    state, end = nixl.check_xfer_state(handle), time.monotonic() + deadline_s
    while state == "PROC" and time.monotonic() < end:
        time.sleep(0.0002)
        state = nixl.check_xfer_state(handle)
    return state


def wait_ours(engine: TransferEngine, xfer: Any, deadline_s: float = 120.0) -> str:
    end = time.monotonic() + deadline_s
    while engine.poll(xfer) == "PROC" and time.monotonic() < end:
        time.sleep(0.0002)
    return xfer.state


# -- reporting --------------------------------------------------------------------------------


def ms(values: list[float]) -> tuple[float, float]:
    xs = [v * 1e3 for v in values]
    return statistics.median(xs), float(np.percentile(xs, 90))


def fmt_ms(v: float) -> str:
    return f"{v:10.3f}" if v < 100 else f"{v:10.1f}"


def row(label: str, ours: list[float] | None, naive: list[float] | None) -> str:
    cells = []
    for vals in (ours, naive):
        if vals:
            med, p90 = ms(vals)
            cells += [fmt_ms(med), fmt_ms(p90)]
        else:
            cells += [f"{'-':>10}", f"{'-':>10}"]
    ratio = ""
    if ours and naive and statistics.median(ours) > 0:
        ratio = f"{statistics.median(naive) / statistics.median(ours):9.1f}x"
    return f"  {label:<44}{''.join(cells)}  {ratio}"


def header(title: str) -> list[str]:
    return [
        "",
        title,
        f"  {'(milliseconds)':<44}{'ours med':>10}{'ours p90':>10}{'naive med':>10}"
        f"{'naive p90':>10}  naive/ours",
    ]


# -- the benchmark ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    regions, tokens, page_bytes = 2 * args.layers, args.tokens, args.bytes_per_page
    pool = 2 * tokens  # at least twice the request
    rng = np.random.default_rng(args.seed)

    src_pages, src_rs = allocate(regions, pool, page_bytes, fill=0)
    src_pages[:] = rng.integers(0, 256, src_pages.shape, dtype=np.uint8)
    dst_pages, dst_rs = allocate(regions, pool, page_bytes, fill=0)
    prefill = TransferEngine(AgentConfig(), Memory(src_rs, no_aux()))
    decode = TransferEngine(AgentConfig(), Memory(dst_rs, no_aux()))
    lines: list[str] = []
    try:
        link = prefill.link(decode.metadata, Memory(dst_rs, no_aux()))
        nixl = prefill.agent._nixl
        timer = NixlTimer(nixl)
        whole = Geometry.whole_items()
        naive_n = naive_descriptors(tokens, regions, whole)

        # ---- random pages: build and submit (post deferred), every iteration --------------
        r = {
            k: []
            for k in (
                "idx",
                "py",
                "make",
                "post",
                "total",
                "n_py",
                "n_descs",
                "n_init",
                "n_total",
                "n_nixl",
                "o_nixl",
            )
        }
        with timer.installed():
            timer.post = False
            for it in range(args.warmup + args.iters):
                src = rng.choice(pool, tokens, replace=False)
                dst = rng.choice(pool, tokens, replace=False)
                timer.reset()
                t0 = time.perf_counter()
                xfer = prefill.write(link, "kv", src, dst)
                total = time.perf_counter() - t0
                prefill.release(xfer)  # never posted: nothing to wait for
                idx_s = ours_index_arithmetic(link, src, dst)

                t0 = time.perf_counter()
                src_reqs, dst_reqs = naive_build(src_rs, dst_rs, src, dst)
                n_py = time.perf_counter() - t0
                handle, n_descs, n_init, _ = naive_submit(
                    nixl, link.name, src_reqs, dst_reqs, post=False
                )
                nixl.release_xfer_handle(handle)
                if it < args.warmup:
                    continue
                r["idx"].append(idx_s)
                r["make"].append(timer.make_s)
                r["post"].append(timer.post_s)
                r["py"].append(total - timer.make_s - timer.post_s)
                r["o_nixl"].append(timer.make_s + timer.post_s)
                r["total"].append(total)
                r["n_py"].append(n_py)
                r["n_descs"].append(n_descs)
                r["n_init"].append(n_init)
                r["n_nixl"].append(n_descs + n_init)
                r["n_total"].append(n_py + n_descs + n_init)
            ours_descs = xfer.descriptors

        # ---- random pages: post and complete, a few iterations ------------------------------
        o_done, n_done, o_posted, n_posted = [], [], 0, 0
        for _ in range(args.complete_iters):
            src = rng.choice(pool, tokens, replace=False)
            dst = rng.choice(pool, tokens, replace=False)
            t0 = time.perf_counter()
            xfer = prefill.write(link, "kv", src, dst)
            wait_ours(prefill, xfer)
            o_done.append(time.perf_counter() - t0)
            o_posted = (prefill.agent.telemetry(xfer) or {}).get("descriptors", -1)
            prefill.release(xfer)
            t0 = time.perf_counter()
            src_reqs, dst_reqs = naive_build(src_rs, dst_rs, src, dst)
            handle, *_ = naive_submit(nixl, link.name, src_reqs, dst_reqs, post=True)
            wait_nixl(nixl, handle)
            n_done.append(time.perf_counter() - t0)
            n_posted = int(nixl.get_xfer_telemetry(handle).descCount)
            nixl.release_xfer_handle(handle)

        budget_ok = statistics.median(r["py"]) * 1e3 <= BUDGET_MS
        lines += header(
            f"random pages: {tokens:,}-token request, page size 1, {args.layers} layers x K,V "
            f"= {regions} regions, pool {pool:,} pages, {page_bytes} B/page/region "
            f"({args.iters} iterations, post deferred)"
        )
        lines += [
            row("Python: index arithmetic (unit_indices x2)", r["idx"], None),
            row("Python: all of engine.write outside NIXL", r["py"], None),
            row("Python: naive per-layer loop -> Nx3 arrays", None, r["n_py"]),
            row("Python total (ours: engine.write - NIXL)", r["py"], r["n_py"]),
            row("NIXL: make_prepped_xfer", r["make"], None),
            row("NIXL: get_xfer_descs x2", None, r["n_descs"]),
            row("NIXL: initialize_xfer", None, r["n_init"]),
            row("NIXL C++ calls total", r["o_nixl"], r["n_nixl"]),
            row("build + submit total (post deferred)", r["total"], r["n_total"]),
            row(f"post + complete (n={args.complete_iters}, not deferred)", o_done, n_done),
            f"  descriptors: ours {ours_descs:,} predicted, {o_posted:,} posted by NIXL "
            f"(from {regions} prepared strided rows); naive {naive_n:,} built, "
            f"{n_posted:,} posted",
            f"  budget: <= {BUDGET_MS:g} ms Python time for the {tokens:,}-token random "
            f"request -> ours median {statistics.median(r['py']) * 1e3:.3f} ms: "
            + ("within budget" if budget_ok else "OVER BUDGET"),
        ]

        # ---- contiguous pages ------------------------------------------------------------------
        src, dst = np.arange(tokens), np.arange(pool - tokens, pool)
        c = {k: [] for k in ("total", "py", "n_total", "done", "n_done")}
        with timer.installed():
            timer.post = False
            for it in range(args.warmup + args.iters):
                timer.reset()
                t0 = time.perf_counter()
                xfer = prefill.write(link, "kv", src, dst)
                total = time.perf_counter() - t0
                prefill.release(xfer)
                t0 = time.perf_counter()
                src_reqs, dst_reqs = naive_build(src_rs, dst_rs, src, dst)
                handle, *_ = naive_submit(nixl, link.name, src_reqs, dst_reqs, post=False)
                n_total = time.perf_counter() - t0
                nixl.release_xfer_handle(handle)
                if it >= args.warmup:
                    c["total"].append(total)
                    c["py"].append(total - timer.make_s - timer.post_s)
                    c["n_total"].append(n_total)
        contig_descs = xfer.descriptors
        posted = -1
        dst_pages.fill(0)
        for _ in range(max(args.complete_iters, 5)):
            t0 = time.perf_counter()
            xfer = prefill.write(link, "kv", src, dst)
            wait_ours(prefill, xfer)
            c["done"].append(time.perf_counter() - t0)
            posted = (prefill.agent.telemetry(xfer) or {}).get("descriptors", -1)
            prefill.release(xfer)
        same = np.array_equal(dst_pages[:, pool - tokens :], src_pages[:, :tokens])
        n_posted = -1
        for _ in range(args.complete_iters):
            t0 = time.perf_counter()
            src_reqs, dst_reqs = naive_build(src_rs, dst_rs, src, dst)
            handle, *_ = naive_submit(nixl, link.name, src_reqs, dst_reqs, post=True)
            wait_nixl(nixl, handle)
            c["n_done"].append(time.perf_counter() - t0)
            n_posted = int(nixl.get_xfer_telemetry(handle).descCount)
            nixl.release_xfer_handle(handle)

        lines += header(f"contiguous pages: the same {tokens:,}-token request as one run")
        lines += [
            row("Python total (ours: engine.write - NIXL)", c["py"], None),
            row("build + submit total (post deferred)", c["total"], c["n_total"]),
            row(
                f"time to complete (n={len(c['done'])} / {len(c['n_done'])})",
                c["done"],
                c["n_done"],
            ),
            f"  descriptors: ours {contig_descs:,} predicted, {posted:,} posted by NIXL after "
            f"merging; naive {naive_n:,} built, {n_posted:,} posted",
            f"  bytes: {tokens * page_bytes * regions / 2**20:.0f} MiB per request; every "
            f"destination page byte-identical to its source: {'yes' if same else 'NO'}",
        ]
        prefill.unlink(link)
    finally:
        prefill.close()
        decode.close()
    lines.append("")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines.append(
        f"machine: {os.cpu_count()} CPU cores, 1-minute load average {load:.1f} at the "
        f"end (every NIXL agent's progress thread polls a core; other load skews these)"
    )
    lines.append(
        f"live handles after close: prefill {dict(prefill.agent.live) or 0}, "
        f"decode {dict(decode.agent.live) or 0}; run time "
        f"{time.perf_counter() - started:.1f} s"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
