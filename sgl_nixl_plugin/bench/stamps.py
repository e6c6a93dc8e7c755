"""Each room's steps on one clock, from what both sides of a bench session reported.

A prefill rank's per-room result carries its ``TransferEvent.timeline`` and a decode
rank's its ``ReceiveEvent.timeline`` (``*_at`` keys: ``time.perf_counter`` seconds,
CLOCK_MONOTONIC, one clock for every process of the machine), beside the bench loops' own
``stamps``. ``room_stamps`` merges them per room, ``p:`` and ``d:`` before each name (the
prefill's and the decode's), over the ranks of each side. The benchmarks read their
per-step figures from here (``benchmarks/product_timeline.py``, ``bench_staging.py``'s
"ours" row).
"""

from __future__ import annotations

from typing import Any

#: The bench's clock: it starts when the prefill loop sees WaitingForInput and stops when
#: the decode loop sees Success.
T0 = "p:waiting_seen_at"
T1 = "d:end_seen_at"


def _latest(key: str) -> bool:
    """Across the ranks of one side, the latest stamp counts for these (else the earliest)."""
    return "last" in key or "ended" in key or "end_seen" in key or key.startswith("d:status")


def room_stamps(result: Any) -> dict[int, dict[str, Any]]:
    """Per room of a ``SessionResult``: every stamp of both sides, whether every rank ended
    it ok, the bytes the decodes received, the prefill's path and staged pieces."""
    rooms: dict[int, dict[str, Any]] = {}
    for side, ranks in (("p", result.prefill), ("d", result.decode)):
        for rank in ranks.values():
            for room, r in rank.get("results", {}).items():
                out = rooms.setdefault(room, {"ok": True, "bytes": 0, "pieces": 0, "path": None})
                out["ok"] = out["ok"] and bool(r.get("ok"))
                timeline = r.get("timeline") or {}
                if side == "d":
                    out["bytes"] += r.get("bytes", 0)
                else:
                    out["path"] = out["path"] or r.get("path")
                    out["pieces"] += int(timeline.get("pieces", 0))
                for k, v in {**timeline, **r.get("stamps", {})}.items():
                    if not k.endswith("_at") or not v:
                        continue
                    key = f"{side}:{k}"
                    old = out.get(key)
                    out[key] = v if old is None else (max if _latest(key) else min)(old, v)
    return rooms
