"""Is a copy after the GPU sat idle slower than one in a busy stream? (issue 16, item 1)

The bench's prefill runs no forward pass, so its first one-pass copy starts on an idle
GPU, and a server's starts right after the forward pass. This probe measures what idling
costs, apart from the product: one process, no IPC, the same bytes (Llama-3.1-8B KV, 64
regions, ~6k tokens of random pages) moved by ``TritonCopier.pair_copy`` and by a
contiguous ``copy_``; each copy timed with CUDA events (GPU time only), first back to back,
then after the host slept ``gap`` ms with the GPU idle. Measured on an H200: ~0.1 ms per
copy, not growing past 20 ms of idle (docs/benchmarks.md).

    python3 benchmarks/gpu_idle_probe.py [--tokens 6144] [--gaps 0 1 5 20 100 500]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import numpy as np
import torch

from sgl_nixl_plugin.engine.copy_triton import TritonCopier

REGIONS, TOKEN_BYTES = 64, 2048


def _once(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gaps", type=float, nargs="+", default=[0, 1, 5, 20, 100, 500])
    args = ap.parse_args()
    torch.cuda.set_device(0)
    rng = np.random.default_rng(0)
    item = TOKEN_BYTES * args.page
    pages = -(-args.tokens // args.page)
    pool_pages = 8 * pages
    src = [
        torch.randint(0, 255, (pool_pages * item,), dtype=torch.uint8, device="cuda")
        for _ in range(REGIONS)
    ]
    dst = [torch.zeros(pool_pages * item, dtype=torch.uint8, device="cuda") for _ in range(REGIONS)]
    nbytes = REGIONS * pages * item
    flat_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_b = torch.empty_like(flat_a)
    c = TritonCopier(0)
    bs = c.prepare_bases(np.array([t.data_ptr() for t in src], dtype=np.uint64))
    bd = c.prepare_bases(np.array([t.data_ptr() for t in dst], dtype=np.uint64))

    def pair() -> functools.partial:  # fresh random pages each time, as requests have
        sp = rng.choice(pool_pages, pages, replace=False).astype(np.int64)
        dp = rng.choice(pool_pages, pages, replace=False).astype(np.int64)
        su, du = c.prepare_units(sp), c.prepare_units(dp)
        return functools.partial(c.pair_copy, bs, bd, su, du, item, item, 0, item, 0)

    copy = functools.partial(flat_b.copy_, flat_a)
    kinds = {"pair": pair, "copy_": lambda: copy}  # each makes the launch, untimed
    for make in kinds.values():
        _once(make())  # compile / first launch
    print(
        f"== {nbytes / 2**20:.0f} MiB, page {args.page}; GPU ms per copy (median, min, max of {args.reps})"
    )
    for gap in args.gaps:
        for name, make in kinds.items():
            out = []
            for _ in range(args.reps):
                fn = make()
                torch.cuda.synchronize()
                if gap:
                    time.sleep(gap / 1e3)
                out.append(_once(fn))
            med = statistics.median(out)
            print(
                f"   gap {gap:6.1f} ms  {name:6s} {med:7.3f} {min(out):7.3f} {max(out):7.3f}"
                f"  {nbytes / med / 1e6:6.0f} GB/s"
            )


if __name__ == "__main__":
    main()
