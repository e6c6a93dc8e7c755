"""docs/grafana-dashboard.json names only series the plugin exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from sgl_nixl_plugin import metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _base(name: str) -> str:
    for s in SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def test_every_series_on_the_dashboard_is_exported_and_every_export_is_shown():
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    shown = {_base(n) for e in exprs for n in re.findall(r"\bsgl_nixl_\w+", e)}
    exported = {c.describe()[0].name for c in metrics._metrics().values()}
    assert shown == exported, {"not exported": shown - exported, "not shown": exported - shown}
