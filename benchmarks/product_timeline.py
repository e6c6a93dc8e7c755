"""Where one request's time goes through the product path, both processes on one clock.

``sgl-nixl-plugin bench`` reports a request's latency from the moment both sides are ready
(the prefill's sender saw WaitingForInput) to the moment the decode's poll loop sees
Success. ``benchmarks/bench_staging.py`` (row "ours") times the staged pipeline alone.
This script runs the bench's own session (``sgl_nixl_plugin.bench.session``: SGLang's real
classes, our plugin, the bench's prefill and decode drivers, nothing wrapped or patched)
and reads what the product reports for each room: the prefill's ``TransferEvent.timeline``
and the decode's ``ReceiveEvent.timeline`` (``sgl_nixl_receive_done``), whose ``*_at``
stamps are ``time.perf_counter`` seconds (CLOCK_MONOTONIC: one clock for every process of
the machine), beside the bench loops' own stamps (WaitingForInput seen, ``send()`` and
``send_metadata`` returned, Success seen). It prints per step the median over the steady
rooms (the first room of the fresh pair is left out), in ms after T0:

    decode: request sent -> prefill: room opened, ready
    T0 prefill bench sees WaitingForInput -> init()+send() returned
      -> the transfer worker claims the first chunk -> first WRITE posted
      -> (staged) the decode's scatter thread gets the first / last piece -> last scattered
      -> the prefill room ends (its status went out) -> the decode receives the status
      -> applies it (behind the scatters) -> T1 the decode bench sees Success

On the one-pass path (CUDA IPC; GPU only) there are no pieces: "first WRITE posted" is the
copy's launch returning, "first transfer seen done" the first copy or WRITE seen done, and
the decode's "status received" its completion flag seen. Rows no room reached are not
printed.

Rows the earlier, method-wrapping version printed and this one cannot: the staged job's
inner steps (index upload, gather launched / seen done, each WRITE done), the one-pass
launch's inner steps (units and bases prepared, ``pair_copy``, the fast launch taken, the
aux and state posts, the flag queued), the decode's first scatter launched and done, the
prefill's first PieceDone, the status message's encoding and hand-off to ZMQ, and the
decode listener taking its frames. The product stamps each room's steps, not each piece's
or call's: those live inside the engine (``bench_staging.py`` keeps the staged job's own
trace) and would cost the hot path a record per piece.

``--poll-wait-us`` sets the longest wait of the bench's poll loops between polls (500 us;
0 spins; ``SGLANG_NIXL_PLUGIN_BENCH_POLL_WAIT_US``), ``--no-bell`` makes them sleep that
long without waking on a status change (the loops before the bell; ``BENCH_BELL=0``).
``--switch-interval-us`` sets the plugin's ``SGLANG_NIXL_PLUGIN_SWITCH_INTERVAL_US`` (the
rank processes' GIL switch interval; Python's default is 5 ms). A rank still running
after ``--stack-dump-s`` seconds prints every thread's stack to its stderr.

    python3 benchmarks/product_timeline.py --mem VRAM --page-size 16 --requests 24 \\
        --min-tokens 4096 --max-tokens 8192 --concurrency 1 --no-verify --label p16_c1
    python3 benchmarks/product_timeline.py --mem DRAM --requests 8 --label dram   # CPU

Every other argument is ``sgl-nixl-plugin bench``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # the tree's package, before any installed wheel

import numpy as np  # noqa: E402

from sgl_nixl_plugin.bench.stamps import T0, T1  # noqa: E402

STEPS = [  # (label, stamp): medians over steady rooms, ms after T0
    ("decode: transfer requests going out", "d:requested_at"),
    ("decode request sent (send_metadata returned)", "d:request_sent_at"),
    ("prefill room opened (first destination filed)", "p:started_at"),
    ("prefill room ready (destinations filed)", "p:ready_at"),
    ("T0 prefill bench sees WaitingForInput", T0),
    ("prefill bench: init()+send() returned", "p:sent_at"),
    ("worker claimed the chunk", "p:claimed_at"),
    ("worker got the last chunk", "p:last_chunk_at"),
    ("first WRITE posted (one pass: copy launched)", "p:first_post_at"),
    ("decode: first piece at the scatter thread", "d:first_piece_at"),
    ("first transfer seen done (WRITE, piece, copy)", "p:first_done_at"),
    ("last WRITE posted (aux, state; one pass: flag)", "p:last_post_at"),
    ("decode: last piece at the scatter thread", "d:last_piece_at"),
    ("decode: last piece scattered", "d:scattered_at"),
    ("prefill room ended (its status went out before)", "p:ended_at"),
    ("decode: status received (one pass: flag seen)", "d:status_at"),
    ("decode: status applied (behind scatters)", "d:applied_at"),
    ("T1 decode bench sees Success", T1),
    ("decode: receiver cleared", "d:ended_at"),
    ("prefill bench sees Success", "p:end_seen_at"),
]


def analyse(result: Any, label: str) -> dict[str, Any]:
    from sgl_nixl_plugin.bench.stamps import room_stamps

    rooms = {k: v for k, v in room_stamps(result).items() if v["ok"] and T1 in v and T0 in v}
    order = sorted(rooms, key=lambda k: rooms[k].get("d:request_sent_at", 0.0))
    steady = order[1:]
    rows = []
    for name, key in STEPS:
        vals = [(rooms[k][key] - rooms[k][T0]) * 1e3 for k in steady if key in rooms[k]]
        first = float("nan")  # the fresh pair's first room, for the cold-start figure
        if order and key in rooms[order[0]]:
            first = (rooms[order[0]][key] - rooms[order[0]][T0]) * 1e3
        if vals:
            a = np.asarray(vals)
            rows.append((name, float(np.median(a)), float(np.percentile(a, 10)),
                         float(np.percentile(a, 90)), len(a), first))  # fmt: skip
    per_room = []
    for k in order:
        r = rooms[k]
        t0 = max(r[T0], r.get("d:request_sent_at", 0.0))
        rec = {"room": k, "bytes": r.get("bytes", 0), "pieces": r.get("pieces", 0)}
        rec.update(path=r.get("path"), product_ms=(r[T1] - t0) * 1e3)
        claim = r.get("p:claimed_at")
        # the engine's clock: from the worker's claim (its first gather or launch follows at
        # once) to the last piece scattered, or (no pieces) the prefill room's last
        # transfer settled
        done = r.get("d:scattered_at", r.get("p:ended_at"))
        if claim is not None and done is not None:
            rec["engine_like_ms"] = (done - claim) * 1e3
        if claim is not None and "d:applied_at" in r:
            rec["claim_to_applied_ms"] = (r["d:applied_at"] - claim) * 1e3
        if claim is not None:  # issue 19's clock
            rec["claim_to_success_ms"] = (r[T1] - claim) * 1e3
        if "d:request_sent_at" in r:
            rec["prefill_late_ms"] = (r[T0] - r["d:request_sent_at"]) * 1e3
        per_room.append(rec)

    def med(key: str, rows_: list[dict[str, Any]]) -> float:
        v = [x[key] for x in rows_ if key in x]
        return float(np.median(v)) if v else float("nan")

    def gbps(key: str, rows_: list[dict[str, Any]]) -> float:
        v = [x["bytes"] / (x[key] * 1e-3) / 1e9 for x in rows_ if x.get(key) and x["bytes"]]
        return float(np.median(v)) if v else float("nan")

    st = per_room[1:]
    summary = {
        "label": label,
        "rooms": len(per_room),
        "product_ms_p50": med("product_ms", st),
        "engine_like_ms_p50": med("engine_like_ms", st),
        "claim_to_applied_ms_p50": med("claim_to_applied_ms", st),
        "product_gbps_p50": gbps("product_ms", st),
        "engine_like_gbps_p50": gbps("engine_like_ms", st),
        "claim_to_applied_gbps_p50": gbps("claim_to_applied_ms", st),
        "claim_to_success_ms_p50": med("claim_to_success_ms", st),
        "claim_to_success_gbps_p50": gbps("claim_to_success_ms", st),
        "pieces_p50": med("pieces", st),
        "bytes_p50": med("bytes", st),
    }
    print(f"=== product timeline {label}: {len(per_room)} rooms, steady = all but the first")
    head = f"{'step (steady rooms, ms after T0)':50s} {'p50':>8s} {'p10':>8s} {'p90':>8s}"
    print(f"{head}  n  {'first':>8s}")
    for name, p50, p10, p90, n, first in rows:
        print(f"{name:50s} {p50:8.3f} {p10:8.3f} {p90:8.3f}  {n} {first:8.3f}")
    print(
        "per room p50: product (T0->T1) {product_ms_p50:.2f} ms = {product_gbps_p50:.1f} GB/s; "
        "worker's claim -> last piece scattered (or the room's end: the engine's clock) "
        "{engine_like_ms_p50:.2f} ms = {engine_like_gbps_p50:.1f} GB/s; claim -> status "
        "applied {claim_to_applied_ms_p50:.2f} ms = {claim_to_applied_gbps_p50:.1f} GB/s; "
        "claim -> decode sees Success {claim_to_success_ms_p50:.2f} ms = "
        "{claim_to_success_gbps_p50:.1f} GB/s; {pieces_p50:.0f} pieces, {bytes_p50:.3g} "
        "bytes".format(**summary)
    )
    print("SUMMARY " + json.dumps(summary))
    return {"summary": summary, "steps": rows, "rooms": per_room}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--label", default="run")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--poll-wait-us", type=float, default=500.0)
    p.add_argument("--no-bell", action="store_true")
    p.add_argument("--switch-interval-us", type=float, default=0.0)
    p.add_argument("--stack-dump-s", type=float, default=60.0)
    mine, rest = p.parse_known_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from sgl_nixl_plugin.bench import session as S
    from sgl_nixl_plugin.bench.report import summarize
    from sgl_nixl_plugin.cli.bench import build_parser, workload_of

    args = build_parser().parse_args(rest)
    env = {
        "SGLANG_NIXL_PLUGIN_BENCH_POLL_WAIT_US": f"{mine.poll_wait_us:g}",
        "SGLANG_NIXL_PLUGIN_BENCH_BELL": "0" if mine.no_bell else "1",
        "SGLANG_NIXL_PLUGIN_BENCH_STACK_DUMP_S": f"{mine.stack_dump_s:g}",
    }
    if mine.switch_interval_us > 0:
        env["SGLANG_NIXL_PLUGIN_SWITCH_INTERVAL_US"] = f"{mine.switch_interval_us:g}"
    cfg = S.SessionConfig(
        workload_of(args),
        mem_kind=args.mem,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
        timeout_s=args.timeout,
        verify=not args.no_verify,
        env=env,
    )
    result = S.run_session(cfg)
    s = summarize(result)
    print(
        f"=== bench figures {mine.label} (poll wait {mine.poll_wait_us:g} us, bell {not mine.no_bell}): "
        f"ok {s['ok']}/{s['requests']}, corrupt {s['corrupt_pages']}, per-request GB/s p50 "
        f"{s['per_request_gbps_p50']:.1f}, latency p50/p99 {s['latency_p50_ms']:.2f}/"
        f"{s['latency_p99_ms']:.2f} ms, first/steady {s['first_request_ms']:.2f}/"
        f"{s['steady_p50_ms']:.2f} ms, all-requests {s['gbps']:.1f} GB/s, errors {s['errors']}"
    )
    doc = analyse(result, mine.label)
    doc["bench"] = {k: v for k, v in s.items() if not isinstance(v, list | dict)}
    Path(mine.out).mkdir(parents=True, exist_ok=True)
    (Path(mine.out) / f"timeline_{mine.label}.json").write_text(json.dumps(doc, indent=1))
    return 0 if s["ok"] == s["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
