"""Where a request's transfer time goes inside real SGLang servers (CPU, this machine).

Starts the real-server stage's PD stack (``sglang.launch_server`` prefill and decode with
the plugin, SGLang's router, the tiny random-weight Llama; tests/realserver/stack.py) once
per variant, sends the same greedy requests one at a time, and reads the plugin's per-room
lines (``SGLANG_NIXL_PLUGIN_LOG_LEVEL=DEBUG``) from both servers' logs. Prints, per variant,
the median and p90 of each timeline field: on the prefill ``to_post_ms`` (the worker's
claim of a chunk to its first WRITE: Python work, plus any wait for the GIL),
``after_last_ms`` (the last chunk's arrival to the last completion: what the request waits
for after its last forward pass) and ``writes_ms`` (first WRITE to the end, which spans the
forward passes between chunks); on the decode ``status_to_applied_ms`` (the status received
to SGLang's poll applying it).

A variant is a name and environment variables for both servers, e.g. to compare with the
worker count changed::

    python benchmarks/real_server_rooms.py --variant base \\
        --variant "w1:SGLANG_NIXL_PLUGIN_WORKERS=1" --rounds 3

Needs the real-server stage's packages (ci/setup_env.sh installs them). Every process is
stopped by its pid at the end; all of them bind to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # the stage's modules import the suite's helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from tests.realserver import stack as rs  # noqa: E402
from tests.realserver.procs import ProcessGroup  # noqa: E402
from tests.realserver.tiny_model import build_tiny_llama  # noqa: E402
from tests.realserver.workload import make_requests, run_sequential  # noqa: E402

PREFILL_FIELDS = ("to_post_ms", "writes_ms", "after_last_ms", "wall_ms", "chunks", "xfer_us")
DECODE_FIELDS = ("to_status_ms", "status_to_applied_ms", "applied_to_clear_ms", "wall_ms")
_LINE = re.compile(r"(sgl-nixl (?:decode )?room) (\d+): ok (.*)")


def room_fields(log: str, prefix: str) -> dict[str, list[float]]:
    """Every ``key=value`` of the ``<prefix> R: ok`` lines, per key (a room's first line
    only: with TP > 1 each rank logs its own)."""
    out: dict[str, list[float]] = {}
    seen: set[tuple[str, str]] = set()
    for m in _LINE.finditer(log):
        if m.group(1) != prefix or (m.group(1), m.group(2)) in seen:
            continue
        seen.add((m.group(1), m.group(2)))
        for key, value in re.findall(r"(\w+)=([-\d.e+]+)", m.group(3)):
            out.setdefault(key, []).append(float(value))
    return out


def _p(values: Sequence[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def run_variant(
    name: str, env: dict[str, str], args: argparse.Namespace, tmp: Path, model: Path
) -> dict[str, Any]:
    group = ProcessGroup(tmp / f"logs-{name}", tmp)
    (tmp / f"logs-{name}").mkdir()
    launcher = rs.Launcher(
        group, model, tmp, plugin_env={"SGLANG_NIXL_PLUGIN_LOG_LEVEL": "DEBUG", **env}
    )
    started = time.monotonic()
    try:
        stack = launcher.pd("plugin", args.tp, args.page)
        print(f"[{name}] servers up in {time.monotonic() - started:.0f}s", flush=True)
        reqs = [r for i in range(args.rounds) for r in make_requests(i, f"r{i}", with_text=False)]
        results = run_sequential(stack.url, reqs, rs.REQUEST_TIMEOUT_S)
        failed = [f"{r.req.name}: {r.error}" for r in results if r.error]
        pre = room_fields(stack.prefill.proc.log_text(), "sgl-nixl room")
        dec = room_fields(stack.decode.proc.log_text(), "sgl-nixl decode room")
    finally:
        group.stop()
    e2e = [r.e2e_s * 1e3 for r in results if not r.error]
    return {"name": name, "sent": len(reqs), "failed": failed, "pre": pre, "dec": dec, "e2e": e2e}


def report(res: dict[str, Any]) -> None:
    rooms = len(res["pre"].get("wall_ms", []))
    print(
        f"=== {res['name']}: {res['sent']} requests, {len(res['failed'])} failed, "
        f"{rooms} prefill rooms, {len(res['dec'].get('wall_ms', []))} decode rooms"
    )
    for f in res["failed"][:5]:
        print("  failed:", f)
    print(f"  {'field':34s} {'p50':>9s} {'p90':>9s} {'max':>9s}")
    for side, fields in (("prefill", PREFILL_FIELDS), ("decode", DECODE_FIELDS)):
        for key in fields:
            v = res["pre" if side == "prefill" else "dec"].get(key, [])
            if v:
                row = f"{side} {key}"
                print(f"  {row:34s} {_p(v, 0.5):9.3f} {_p(v, 0.9):9.3f} {max(v):9.3f}")
    if res["e2e"]:
        print(f"  {'request e2e (SGLang meta, ms)':34s} {_p(res['e2e'], 0.5):9.1f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME or NAME:KEY=VAL,KEY=VAL (environment of both servers); repeatable",
    )
    p.add_argument("--rounds", type=int, default=2, help="times the 11 prompt shapes are sent")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--page", type=int, default=16)
    args = p.parse_args(argv)
    variants = []
    for spec in args.variant or ["default"]:
        name, _, rest = spec.partition(":")
        env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        variants.append((name, env))
    with tempfile.TemporaryDirectory(prefix="sgl-nixl-rooms-") as d:
        tmp = Path(d)
        model = build_tiny_llama(tmp / "tiny-llama")
        results = [run_variant(n, e, args, tmp, model) for n, e in variants]
    for res in results:
        report(res)
    return 0 if all(not r["failed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
