"""Prometheus metrics (prometheus-client), registered lazily in the default registry.

SGLang serves the default registry on its ``/metrics`` route when started with
``--enable-metrics`` (its scheduler processes write to ``PROMETHEUS_MULTIPROC_DIR``, which
prometheus-client picks up for ours too). ``sgl-nixl-plugin bench --metrics-port`` serves
them for a bench session. Recording never raises: metrics must not break transfers.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_m: dict[str, Any] = {}

MAX_PEER_LABELS = 32  # bounded cardinality: decode agents are named anew at every restart
_peer_labels: set[str] = set()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
DESCRIPTOR_BUCKETS = (1, 8, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


def _metrics() -> dict[str, Any]:
    if _m:
        return _m
    with _lock:
        if _m:
            return _m
        from prometheus_client import Counter, Gauge, Histogram

        _m.update(
            transfers=Counter(
                "sgl_nixl_transfers", "Finished KV transfers (rooms)", ["outcome", "path"]
            ),
            bytes=Counter("sgl_nixl_transfer_bytes", "KV bytes moved", ["path"]),
            latency=Histogram(
                "sgl_nixl_transfer_seconds",
                "First WRITE to last completion, per room",
                ["path"],
                buckets=LATENCY_BUCKETS,
            ),
            descriptors=Histogram(
                "sgl_nixl_transfer_descriptors",
                "Descriptors posted per room",
                buckets=DESCRIPTOR_BUCKETS,
            ),
            failures=Counter("sgl_nixl_failures", "Failed rooms by reason", ["reason"]),
            rejected=Counter("sgl_nixl_rejected_messages", "Dropped control messages", ["reason"]),
            staging=Gauge("sgl_nixl_staging_slots_in_use", "Staging slots in use", ["side"]),
            room_by_peer=Histogram(
                "sgl_nixl_room_seconds",
                "Request filed to last completion, per room, by decode peer "
                f"(the first {MAX_PEER_LABELS} peers by name, the rest as 'other')",
                ["peer"],
                buckets=LATENCY_BUCKETS,
            ),
            nixl_post=Histogram(
                "sgl_nixl_nixl_post_seconds", "NIXL post time (telemetry)", buckets=LATENCY_BUCKETS
            ),
            nixl_xfer=Histogram(
                "sgl_nixl_nixl_xfer_seconds",
                "NIXL transfer time (telemetry)",
                buckets=LATENCY_BUCKETS,
            ),
        )
    return _m


def prepare() -> None:
    """Create the series now (at start-up), not inside the first room's transfer."""
    try:
        _metrics()
    except Exception as exc:
        logger.debug("sgl-nixl metrics: %s", exc)


def _safe(fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except Exception as exc:  # never let metrics break a transfer
            logger.debug("sgl-nixl metrics: %s", exc)

    return wrapper


@_safe
def transfer_done(
    ok: bool, path: str, nbytes: int, seconds: float, descriptors: int, reason: str | None
) -> None:
    m = _metrics()
    m["transfers"].labels("ok" if ok else "failed", path).inc()
    if ok:
        m["bytes"].labels(path).inc(nbytes)
        m["latency"].labels(path).observe(seconds)
        m["descriptors"].observe(descriptors)
    else:
        m["failures"].labels(failure_kind(reason)).inc()


@_safe
def failure(reason: str | None) -> None:
    """A failed room seen by a decode (the prefill counts its own in ``transfer_done``)."""
    _metrics()["failures"].labels(failure_kind(reason)).inc()


@_safe
def rejected(reason: str) -> None:
    _metrics()["rejected"].labels(reason).inc()


@_safe
def staging_in_use(side: str, slots: int) -> None:
    _metrics()["staging"].labels(side).set(slots)


def peer_label(peer: str) -> str:
    """``peer`` while fewer than :data:`MAX_PEER_LABELS` names were seen, else 'other'."""
    with _lock:
        if peer in _peer_labels:
            return peer
        if len(_peer_labels) < MAX_PEER_LABELS:
            _peer_labels.add(peer)
            return peer
    return "other"


@_safe
def room_done(peer: str, seconds: float) -> None:
    _metrics()["room_by_peer"].labels(peer_label(peer or "-")).observe(seconds)


@_safe
def telemetry(t: dict[str, int]) -> None:
    m = _metrics()
    m["nixl_post"].observe(t["post_us"] / 1e6)
    m["nixl_xfer"].observe(t["xfer_us"] / 1e6)


def failure_kind(reason: str | None) -> str:
    """A small, bounded label set for failure reasons (free text would explode cardinality)."""
    r = (reason or "").lower()
    for key, words in (
        ("aborted", ("abort",)),
        (
            "peer_lost",
            ("stopped answering", "closed its connection", "no longer connected", "restarted"),
        ),
        ("incompatible", ("incompatible", "refused", "cannot serve")),
        ("bad_request", ("out of range", "disagree", "rejected")),
        ("transport", ("nixl",)),
        ("timeout", ("timed out",)),
    ):
        if any(w in r for w in words):
            return key
    return "other"
