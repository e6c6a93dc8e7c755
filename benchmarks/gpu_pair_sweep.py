"""Tile and warp sweep of the one-pass pair kernel on one GPU (issue 19), kernel time only.

Llama-3.1-8B KV (64 regions: 32 layers x K, V; 8 KV heads x 128 x bf16 = 2 KiB a token),
random source and destination pages in two pools, page size 1 and 16; per (tile bytes,
warps, indices uploaded or read from pinned host memory) the median of CUDA-event times of
``TritonCopier.pair_copy``, against a contiguous ``copy_`` of the same bytes. Every
configuration's copy is checked against torch's own gather/scatter once. Prints a table.

    python3 benchmarks/gpu_pair_sweep.py [--tokens 6144] [--reps 20]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import numpy as np
import torch

from sgl_nixl_plugin.engine.copy_triton import TritonCopier

REGIONS, TOKEN_BYTES = 64, 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args()
    torch.cuda.set_device(0)
    rng = np.random.default_rng(0)
    for page in (1, 16):
        item = TOKEN_BYTES * page
        pages = -(-args.tokens // page)
        pool_pages = max(4 * pages, 2048 // page * 16)
        src = [
            torch.randint(0, 255, (pool_pages * item,), dtype=torch.uint8, device="cuda")
            for _ in range(REGIONS)
        ]
        dst = [
            torch.zeros(pool_pages * item, dtype=torch.uint8, device="cuda") for _ in range(REGIONS)
        ]
        sp = rng.choice(pool_pages, pages, replace=False).astype(np.int64)
        dp = rng.choice(pool_pages, pages, replace=False).astype(np.int64)
        nbytes = REGIONS * pages * item
        flat_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        flat_b = torch.empty_like(flat_a)
        ceiling = _time(functools.partial(flat_b.copy_, flat_a), args.reps)
        print(
            f"== page {page}: {pages} pages x {REGIONS} regions = {nbytes / 2**20:.0f} MiB; "
            f"contiguous copy {ceiling:.3f} ms = {nbytes / ceiling / 1e6:.0f} GB/s"
        )
        sb = np.array([t.data_ptr() for t in src], dtype=np.uint64)
        db = np.array([t.data_ptr() for t in dst], dtype=np.uint64)
        want_rows = [s.view(pool_pages, item)[torch.from_numpy(sp).cuda()] for s in src[:2]]
        for mapped in (False, True):
            for tile in args.tiles:
                for warps in args.warps:
                    c = TritonCopier(0, tile_bytes=tile, num_warps=warps)
                    c.map_units = mapped
                    bs, bd = c.prepare_bases(sb), c.prepare_bases(db)
                    su, du = c.prepare_units(sp), c.prepare_units(dp)

                    run = functools.partial(c.pair_copy, bs, bd, su, du, item, item, 0, item, 0)

                    run()
                    torch.cuda.synchronize()
                    ok = all(
                        torch.equal(d.view(pool_pages, item)[torch.from_numpy(dp).cuda()], w)
                        for d, w in zip(dst[:2], want_rows, strict=True)
                    )
                    ms = _time(run, args.reps)
                    print(
                        f"   {'mapped' if mapped else 'device'} idx  tile {tile:>6}  warps "
                        f"{warps:>2}: {ms:.3f} ms  {nbytes / ms / 1e6:6.0f} GB/s  "
                        f"{ms / ceiling:.2f}x ceiling  {'OK' if ok else 'WRONG BYTES'}"
                    )
                    if mapped:
                        c.release_units(su)
                        c.release_units(du)
                    for d in dst:
                        d.zero_()


def _time(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


if __name__ == "__main__":
    main()
