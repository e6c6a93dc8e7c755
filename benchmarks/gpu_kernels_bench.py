#!/usr/bin/env python
"""GPU bench of the staging path's gather/scatter kernels (prints; asserts nothing).

Llama-3.1-8B KV: 64 regions (32 layers x K,V), 8 heads x 128 x bf16 = 2 KiB per token and
region; an 8,192-token request is 1 GiB; the pool holds twice the request; random units.
Page size 1 (2 KiB units) and 16 (32 KiB units). For gather and scatter it reports our
Triton kernel (default tile, then a tile sweep), torch's index_select / index_copy_ over
the whole pool (the probe's baseline), the torch fallback copier (one call per region),
and a contiguous 1 GiB device copy (the ceiling); also the 64 regions in 8 pieces on one
stream, a head-slice geometry, and the cost of a 1-page request. Times are medians of
``--reps`` after warm-up, from CUDA events; each row checks its bytes against torch
(``ok`` / ``MISMATCH``). Effective GB/s = request bytes / time (one pass), as in
shared/reference/measurements.md. The goal: >= 1200 GB/s (<= ~0.9 ms per GiB).

    python benchmarks/gpu_kernels_bench.py                  # full run (~1-2 min on an H200)
    python benchmarks/gpu_kernels_bench.py --no-sweep       # skip the tile sweep
    python benchmarks/gpu_kernels_bench.py --tokens 1024    # a smaller request
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, uninstalled

REGIONS = 64
ROW = 8 * 128 * 2  # bytes per token per region
SWEEP = [(8192, 4), (16384, 4), (16384, 8), (32768, 4), (32768, 8), (65536, 8)]

results: list[dict] = []


def row(name: str, fn, nbytes: int, check=None, reps: int = 20) -> None:
    """Time ``fn`` (CUDA events, median of ``reps``), check its result, print one line."""
    import torch

    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        status = ""
        if check is not None:
            status = "ok" if check() else "MISMATCH"
        times = []
        sleep = getattr(torch.cuda, "_sleep", None)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep is not None:
                sleep(2_000_000)  # keep the GPU busy while the host enqueues: GPU time only
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        gbps = nbytes / (ms * 1e-3) / 1e9
        print(
            f"  {name:<44} {ms:8.3f} ms  {gbps:8.1f} GB/s  (min {min(times):.3f})  {status}",
            flush=True,
        )
        results.append(
            {
                "name": name,
                "ms": round(ms, 4),
                "GBps": round(gbps, 1),
                "min_ms": round(min(times), 4),
                "check": status,
            }
        )
    except Exception as exc:  # one bad row must not stop the others
        print(f"  {name:<44} ERROR {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=4, file=sys.stdout)
        results.append({"name": name, "error": f"{type(exc).__name__}: {exc}"})
        try:
            torch.cuda.synchronize()
        except Exception:
            pass


def bench_ceiling(args, torch) -> None:
    nbytes = REGIONS * args.tokens * ROW
    print(f"\nceiling: contiguous device copy of {nbytes / 2**20:.0f} MiB", flush=True)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    row(
        "device copy (dst.copy_(src))",
        lambda: dst.copy_(src),
        nbytes,
        lambda: (dst.zero_(), dst.copy_(src), torch.equal(dst, src))[-1],
        args.reps,
    )


def bench_page_size(args, torch, ck, page: int) -> None:
    dev = torch.device("cuda", 0)
    unit = page * ROW
    items = 2 * args.tokens // page
    n = args.tokens // page
    nbytes = REGIONS * n * unit
    print(
        f"\npage size {page}: unit {unit} B, {n} units x {REGIONS} regions = "
        f"{nbytes / 2**20:.0f} MiB, pool {2 * nbytes / 2**20:.0f} MiB",
        flush=True,
    )
    rng = np.random.default_rng(page)
    pool = torch.empty((REGIONS, items, unit), dtype=torch.uint8, device=dev).random_(0, 256)
    pool2 = torch.zeros_like(pool)
    bases = np.array([pool[r].data_ptr() for r in range(REGIONS)], dtype=np.uint64)
    bases2 = np.array([pool2[r].data_ptr() for r in range(REGIONS)], dtype=np.uint64)
    units = rng.choice(items, n, replace=False).astype(np.int64)
    units_t = torch.from_numpy(units).to(dev)
    stage = torch.empty((REGIONS, n, unit), dtype=torch.uint8, device=dev)
    want = torch.index_select(pool, 1, units_t)  # the reference staging bytes
    sp = stage.data_ptr()

    def gather_check(fn):
        def check() -> bool:
            stage.zero_()
            fn()
            return torch.equal(stage, want)

        return check

    def scatter_check(fn):
        """Named units get the staged bytes; every other byte of the pool stays zero."""

        def check() -> bool:
            stage.copy_(want)
            pool2.zero_()
            fn()
            ok = torch.equal(torch.index_select(pool2, 1, units_t), want)
            pool2.index_fill_(1, units_t, 0)
            return ok and not bool(pool2.any())

        return check

    def timed_gather(name: str, fn) -> None:
        row(name, fn, nbytes, gather_check(fn), args.reps)

    def timed_scatter(name: str, fn) -> None:
        row(name, fn, nbytes, scatter_check(fn), args.reps)

    copiers = {}
    for name in ("triton", "torch"):
        try:
            copiers[name] = ck.make_copier("VRAM", 0, prefer=name)
        except Exception as exc:
            print(f"  {name} copier unavailable: {type(exc).__name__}: {exc}", flush=True)
    tri = copiers.get("triton")

    # -- gather ---------------------------------------------------------------------------
    piece = REGIONS // 8
    stream = torch.cuda.Stream(dev)

    def in_pieces(copy, region_bases) -> None:
        """The 64 regions as 8 pieces of 8, one launch each, on one side stream."""
        cur = torch.cuda.current_stream(dev)
        stream.wait_stream(cur)  # start after the timer's start event
        for p in range(8):
            copy(
                region_bases[p * piece : (p + 1) * piece],
                units,
                unit,
                unit,
                0,
                sp + p * piece * n * unit,
                stream,
            )
        cur.wait_stream(stream)  # and end before its end event

    if tri is not None:
        timed_gather(
            f"gather  triton (tile {ck.TILE_BYTES // 1024}K, {ck.NUM_WARPS} warps)",
            lambda: tri.gather(bases, units, unit, unit, 0, sp),
        )
    timed_gather(
        "gather  torch index_select (one call, probe)",
        lambda: torch.index_select(pool, 1, units_t, out=stage),
    )
    if "torch" in copiers:
        tc = copiers["torch"]
        timed_gather(
            "gather  torch copier (per region)", lambda: tc.gather(bases, units, unit, unit, 0, sp)
        )
    if tri is not None:
        timed_gather("gather  triton, 8 pieces on one stream", lambda: in_pieces(tri.gather, bases))
        timed_gather(
            "gather  triton, units already on device",
            lambda: tri.gather(bases, units_t, unit, unit, 0, sp),
        )
    # -- scatter --------------------------------------------------------------------------
    if tri is not None:
        timed_scatter(
            f"scatter triton (tile {ck.TILE_BYTES // 1024}K, {ck.NUM_WARPS} warps)",
            lambda: tri.scatter(bases2, units, unit, unit, 0, sp),
        )
    timed_scatter(
        "scatter torch index_copy_ (one call, probe)", lambda: pool2.index_copy_(1, units_t, stage)
    )
    if "torch" in copiers:
        tc = copiers["torch"]
        timed_scatter(
            "scatter torch copier (per region)",
            lambda: tc.scatter(bases2, units, unit, unit, 0, sp),
        )
    if tri is not None:
        timed_scatter(
            "scatter triton, 8 pieces on one stream", lambda: in_pieces(tri.scatter, bases2)
        )
    # -- tile sweep -----------------------------------------------------------------------
    if tri is not None and not args.no_sweep:
        for tile, warps in SWEEP:
            try:
                c = ck.TritonCopier(0, tile_bytes=tile, num_warps=warps)
            except Exception as exc:
                print(f"  sweep tile {tile}: {exc}", flush=True)
                continue
            timed_gather(
                f"gather  triton tile {tile // 1024}K, {warps} warps",
                lambda c=c: c.gather(bases, units, unit, unit, 0, sp),
            )
            timed_scatter(
                f"scatter triton tile {tile // 1024}K, {warps} warps",
                lambda c=c: c.scatter(bases2, units, unit, unit, 0, sp),
            )
    # -- head slices (page size 1 only): the last 4 of the 8 heads of each token ----------
    if page == 1:
        half = unit // 2
        hs_bytes = REGIONS * n * half
        hs_stage = torch.empty((REGIONS, n, half), dtype=torch.uint8, device=dev)
        hs_want = want[:, :, half:]
        hp = hs_stage.data_ptr()
        for name, c in copiers.items():

            def hs_gather(c=c) -> None:
                c.gather(bases, units, half, unit, half, hp)

            def hs_gathered(fn=hs_gather) -> bool:
                hs_stage.zero_()
                fn()
                return torch.equal(hs_stage, hs_want)

            row(
                f"gather  {name} head slice (1 KiB of 2 KiB rows)",
                hs_gather,
                hs_bytes,
                hs_gathered,
                args.reps,
            )
        for name, c in copiers.items():

            def hs_scatter(c=c) -> None:
                c.scatter(bases2, units, half, unit, half, hp)

            def hs_scattered(fn=hs_scatter) -> bool:
                hs_stage.copy_(hs_want)
                pool2.zero_()
                fn()
                got = torch.index_select(pool2, 1, units_t)
                ok = torch.equal(got[:, :, half:], hs_want) and not bool(got[:, :, :half].any())
                pool2.index_fill_(1, units_t, 0)
                return ok and not bool(pool2.any())

            row(
                f"scatter {name} head slice (1 KiB of 2 KiB rows)",
                hs_scatter,
                hs_bytes,
                hs_scattered,
                args.reps,
            )
    # -- a 1-page request: launch cost ------------------------------------------------------
    if tri is not None:
        one = units[:1].copy()
        row(
            "gather  triton, 1 page x 64 regions (GPU time)",
            lambda: tri.gather(bases, one, unit, unit, 0, sp),
            REGIONS * unit,
            None,
            args.reps,
        )
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                tri.gather(bases, one, unit, unit, 0, sp)
            host_us = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
            print(f"  {'gather  triton, host time per call':<44} {host_us:8.1f} us", flush=True)
            results.append({"name": f"host us per call, page {page}", "us": round(host_us, 1)})
        except Exception as exc:
            print(f"  host time per call: ERROR {exc}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per request (8192: 1 GiB)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pages", default="1,16", help="page sizes, comma separated")
    ap.add_argument("--no-sweep", action="store_true", help="skip the tile/warps sweep")
    ap.add_argument(
        "--timeout",
        type=float,
        default=540.0,
        help="seconds before the bench dumps its stacks and exits (never hangs)",
    )
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    try:
        import torch
    except ImportError as exc:
        print(f"no torch: {exc}")
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to bench")
        return 0
    from sgl_nixl_plugin.engine import copy_kernels as ck

    try:
        import triton

        tv = triton.__version__
    except Exception as exc:
        tv = f"unavailable ({exc})"
    props = torch.cuda.get_device_properties(0)
    print(
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}); triton {tv}",
        flush=True,
    )

    try:
        bench_ceiling(args, torch)
    except Exception as exc:
        print(f"  ceiling: ERROR {exc}", flush=True)
    torch.cuda.empty_cache()

    for page in [int(p) for p in args.pages.split(",") if p]:
        try:
            bench_page_size(args, torch, ck, page)
        except Exception as exc:
            print(f"page size {page}: ERROR {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc(limit=6, file=sys.stdout)
        torch.cuda.empty_cache()
    print("\nJSON " + json.dumps({"tokens": args.tokens, "rows": results}), flush=True)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
