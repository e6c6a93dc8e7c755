"""Reading Prometheus metrics in tests: this process's registry, or the files rank
processes wrote in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

REJECTED = "sgl_nixl_rejected_messages_total"


def rejected_counts(registry: Any = None) -> Counter[str]:
    """``sgl_nixl_rejected_messages_total`` by reason, from ``registry`` (default: this process)."""
    if registry is None:
        from prometheus_client import REGISTRY as registry
    out: Counter[str] = Counter()
    for metric in registry.collect():
        for s in metric.samples:
            if s.name == REJECTED:
                out[s.labels["reason"]] += s.value
    return out


def multiproc_registry(path: Any) -> Any:
    """A registry over the metric files the rank processes wrote to ``path``."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    return registry


def sample_value(registry: Any, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
