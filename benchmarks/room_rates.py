"""Transfer rates from the prefill's per-room DEBUG lines (``sgl-nixl room ...``).

The bench's own end-to-end figures on a GPU are bound by its page fill on the host (~0.9 s
a request at page 16), so GPU runs compare transfers by the prefill's room timeline: bytes
over the time from the room's first chunk to its last WRITE completed
(``to_post_ms + slot_wait_ms + writes_ms``). Run a bench with
``SGLANG_NIXL_PLUGIN_BENCH_LOG=DEBUG`` and pass its stderr files:

    python3 benchmarks/room_rates.py err_pages_eq_p16.txt err_pages_16to64.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

LINE = re.compile(r"sgl-nixl room \d+: ok .*?bytes=(\d+) .*?to_post_ms=([\d.e+-]+) "
                  r"slot_wait_ms=([\d.e+-]+) writes_ms=([\d.e+-]+)")  # fmt: skip


def rates(text: str) -> np.ndarray:
    """GB/s of every successful room in ``text``."""
    out = []
    for m in LINE.finditer(text):
        nbytes, post, wait, writes = int(m[1]), float(m[2]), float(m[3]), float(m[4])
        ms = post + wait + writes
        if nbytes and ms > 0:
            out.append(nbytes / (ms * 1e-3) / 1e9)
    return np.asarray(out)


def main(paths: list[str]) -> int:
    for path in paths:
        r = rates(Path(path).read_text(errors="replace"))
        name = Path(path).stem.removeprefix("err_")
        if not len(r):
            print(f"{name}: no successful room lines (was the bench log at DEBUG?)")
            continue
        print(
            f"{name}: {len(r)} rooms, first chunk to last WRITE p50 {np.median(r):.1f} GB/s "
            f"({r.min():.1f}-{r.max():.1f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
