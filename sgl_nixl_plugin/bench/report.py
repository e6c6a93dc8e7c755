"""Figures of a PD session (throughput, latency, descriptors, control-plane cost) and a table."""

from __future__ import annotations

from typing import Any

import numpy as np

from sgl_nixl_plugin.bench.session import SessionResult


def first_steps(
    result: SessionResult, rooms: dict[int, dict[str, Any]], first: dict[str, Any] | None
) -> dict[str, float]:
    """Where the first request's time after the handshake went: each stamp of its room, in
    ms after the decode's request left (``send_metadata``), the decode's (``decode.*``:
    its ``ReceiveEvent``) and the prefill's (``prefill.*``: the earliest of its ranks'
    ``TransferEvent.timeline``); empty when the room carries none."""
    room = next((k for k, r in rooms.items() if r is first), None)
    if room is None or first is None or "request_at" not in first.get("stamps", {}):
        return {}
    t0 = first["stamps"]["request_at"]
    out: dict[str, float] = {}
    sides = [("decode", r.get("results", {}).get(room)) for r in result.decode.values()]
    sides += [("prefill", r.get("results", {}).get(room)) for r in result.prefill.values()]
    for side, r in sides:
        for name, at in ((r or {}).get("timeline") or {}).items():
            if name.endswith("_at") and isinstance(at, float):
                key = f"{side}.{name.removesuffix('_at')}"
                out[key] = min(out.get(key, np.inf), (at - t0) * 1e3)
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def summarize(result: SessionResult) -> dict[str, Any]:
    rooms = result.decode_results()
    ok = [r for r in rooms.values() if r["ok"]]
    lat = np.array([r["latency_s"] for r in ok]) if ok else np.zeros(0)
    total = int(sum(r.get("bytes", 0) for r in ok))
    span = 0.0
    if ok:
        span = max(r["wall1"] for r in ok) - min(r["wall0"] for r in ok)
    prefill = [r for res in result.prefill.values() for r in res.get("results", {}).values()]
    desc = [r["descriptors"] for r in prefill if r.get("descriptors") is not None]
    ctl = [r["control_us"] for r in prefill if r.get("control_us")]
    paths = sorted({r["path"] for r in prefill if r.get("path")})
    expected = result.config.workload.requests
    bad = sum(r.get("bad_pages", 0) + r.get("bad_aux", 0) + r.get("bad_state", 0) for r in ok)
    reasons = sorted({str(r.get("reason")) for r in rooms.values() if not r["ok"]})
    # the first request of a fresh pair, apart from the steady state (every later request);
    # as a user sees it, its clock starts at the decode's request, once the prefill is up:
    # the handshake (bootstrap query, registration, link, warm-up WRITE) is part of it
    first = min(ok, key=lambda r: r["wall0"]) if ok else None
    later = [r for r in ok if r is not first]
    steady = np.array([r["latency_s"] for r in later])
    steady_p50 = float(np.percentile(steady, 50) * 1e3) if len(steady) else 0.0
    handshake_s = first.get("handshake_s", 0.0) if first is not None else 0.0
    parts = (first.get("handshake_parts") if first is not None else None) or {}
    after_ready_s = first["latency_s"] if first is not None else 0.0
    # requests differ in size: the ratios compare time per byte, first against steady p50
    per_byte = np.array([r["latency_s"] / r["bytes"] for r in later if r.get("bytes")])

    def vs_steady(seconds: float) -> float:
        if first is None or not first.get("bytes") or not len(per_byte):
            return 0.0
        return seconds / first["bytes"] / float(np.median(per_byte))

    ready = [r.get("ready_s") for r in result.decode.values() if r.get("ready_s") is not None]
    cpu_s = result.cpu_s()
    return {
        "backend": result.config.backend,
        "requests": expected,
        "ok": len(ok),
        "failed": expected - len(ok),
        "corrupt_pages": bad,
        "bytes": total,
        "gbps": total / span / 1e9 if span > 0 else 0.0,
        "per_request_gbps_p50": float(np.median([r["bytes"] / r["latency_s"] / 1e9 for r in ok]))
        if ok
        else 0.0,
        "latency_p50_ms": float(np.percentile(lat, 50) * 1e3) if len(lat) else 0.0,
        "latency_p99_ms": float(np.percentile(lat, 99) * 1e3) if len(lat) else 0.0,
        "first_request_ms": (handshake_s + after_ready_s) * 1e3,
        "handshake_ms": handshake_s * 1e3,
        # its steps: SGLang's bootstrap query (info), the room's route query and its
        # receiver's start (route); our set-up of the pair is inside the first transfer
        "handshake_parts_ms": {k: v * 1e3 for k, v in parts.items()},
        "steady_p50_ms": steady_p50,
        "first_vs_steady_p50": vs_steady(handshake_s + after_ready_s),
        "first_after_handshake_ms": after_ready_s * 1e3,
        "first_request_steps_ms": first_steps(result, rooms, first),
        "first_after_handshake_vs_steady_p50": vs_steady(after_ready_s),
        "time_to_ready_s": max(ready) if ready else None,
        # rooms whose prefill sent after the decode's request arrived (not transfer time)
        "prefill_late_rooms": sum(1 for r in ok if r.get("prefill_late_s")),
        "prefill_late_ms_max": max((r.get("prefill_late_s", 0.0) * 1e3 for r in ok), default=0.0),
        "descriptors_per_request": float(np.mean(desc)) if desc else None,
        "control_us_per_request": float(np.median(ctl)) if ctl else None,
        # both sides' processes while their rooms ran, the bench's own page work included
        "cpu_ms_per_request": cpu_s / len(rooms) * 1e3 if cpu_s is not None and rooms else None,
        "path": ",".join(paths) or "-",
        "wall_s": result.wall_s,
        "errors": [e.splitlines()[-1] if e else e for e in result.errors],
        "failure_reasons": reasons[:5],
    }


ROWS = [
    ("requests ok / failed", lambda s: f"{s['ok']} / {s['failed']}"),
    ("corrupted pages", lambda s: f"{s['corrupt_pages']}"),
    ("bytes moved", lambda s: f"{s['bytes'] / 2**30:.2f} GiB"),
    ("throughput (all requests)", lambda s: f"{s['gbps']:.2f} GB/s"),
    ("per-request GB/s (p50)", lambda s: f"{s['per_request_gbps_p50']:.2f} GB/s"),
    (
        "transfer latency p50 / p99",
        lambda s: f"{s['latency_p50_ms']:.1f} / {s['latency_p99_ms']:.1f} ms",
    ),
    (
        "first request / steady p50",
        lambda s: (
            f"{s['first_request_ms']:.1f} / {s['steady_p50_ms']:.1f} ms "
            f"({s['first_vs_steady_p50']:.2f}x per byte)"
        ),
    ),
    (
        "  of which handshake",
        lambda s: (
            f"{s['handshake_ms']:.1f} ms"
            + "".join(f" {k} {v:.1f}" for k, v in s["handshake_parts_ms"].items())
            + f" (after it: {s['first_after_handshake_ms']:.1f} ms, "
            f"{s['first_after_handshake_vs_steady_p50']:.2f}x)"
        ),
    ),
    (
        "time to ready (decode)",
        lambda s: "-" if s["time_to_ready_s"] is None else f"{s['time_to_ready_s'] * 1e3:.0f} ms",
    ),
    (
        "descriptors per request",
        lambda s: (
            "-" if s["descriptors_per_request"] is None else f"{s['descriptors_per_request']:.0f}"
        ),
    ),
    (
        "control plane per request",
        lambda s: (
            "-" if s["control_us_per_request"] is None else f"{s['control_us_per_request']:.0f} µs"
        ),
    ),
    (
        "CPU per request (both sides)",
        lambda s: "-" if s["cpu_ms_per_request"] is None else f"{s['cpu_ms_per_request']:.1f} ms",
    ),
    ("transfer path", lambda s: s["path"]),
]


def table(summaries: list[dict[str, Any]]) -> str:
    """A plain aligned table, one column per backend, plus a ratio column for two."""
    head = ["", *(s["backend"] for s in summaries)]
    body = [[name, *(fmt(s) for s in summaries)] for name, fmt in ROWS]
    if len(summaries) == 2 and summaries[1]["gbps"] > 0:
        head.append("ratio")
        for row in body:
            row.append("")
        body[3][-1] = f"{summaries[0]['gbps'] / summaries[1]['gbps']:.2f}x"
        cpu = [s["cpu_ms_per_request"] for s in summaries]
        if cpu[0] and cpu[1]:
            body[-2][-1] = f"{cpu[1] / cpu[0]:.2f}x less"
        if summaries[1]["latency_p50_ms"] > 0:
            body[5][-1] = (
                f"{summaries[1]['latency_p50_ms'] / max(summaries[0]['latency_p50_ms'], 1e-9):.2f}x faster"
            )
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(head, widths, strict=False)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in body
    ]
    return "\n".join(lines)
