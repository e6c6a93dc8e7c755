"""Kill the prefill rank in the middle of transfers and report how fast the decode fails.

Runs one prefill and one decode process through SGLang's classes (DRAM or VRAM), with the
bootstrap server in its own process so it stays up; SIGKILLs the prefill once the decode has
finished a few requests, then prints per-request outcomes and the detection delay. Prints
figures, asserts nothing (the CPU test suite asserts the same behaviour).
"""

from __future__ import annotations

import argparse
import json
import time

from sgl_nixl_plugin.bench.session import Session, SessionConfig
from sgl_nixl_plugin.bench.workload import PRESETS, Workload


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mem", default="DRAM", choices=["DRAM", "VRAM"])
    ap.add_argument("--decode-gpu", type=int, default=0)
    ap.add_argument("--after", type=int, default=3, help="kill after this many finished requests")
    args = ap.parse_args()
    w = Workload(
        PRESETS["llama-3.1-8b"],
        page_size=16,
        requests=40,
        min_tokens=2048,
        max_tokens=4096,
        concurrency=8,
        state=False,
    )
    session = Session(
        SessionConfig(
            w,
            mem_kind=args.mem,
            decode_gpu=args.decode_gpu,
            separate_bootstrap=True,
            timeout_s=150,
            verify=False,
        )
    )
    session.start()
    killed_at: list[float] = []

    def progress(n: int) -> None:
        if n >= args.after and not killed_at:
            session.kill("prefill", 0, 0)
            killed_at.append(time.time())

    result = session.wait(progress)
    rooms = result.decode_results()
    failed = [r for r in rooms.values() if not r["ok"]]
    delays = [r["wall1"] - killed_at[0] for r in failed if killed_at and "wall1" in r]
    print(
        json.dumps(
            {
                "killed": bool(killed_at),
                "ok": len(rooms) - len(failed),
                "failed": len(failed),
                "not_started_or_timed_out": sum(
                    len(v.get("timed_out", [])) for v in result.decode.values()
                ),
                "max_detection_s": round(max(delays), 3) if delays else None,
                "reasons": sorted({str(r["reason"])[:160] for r in failed})[:3],
                "errors": [e.splitlines()[-1] for e in result.errors][:3],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
