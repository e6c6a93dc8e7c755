"""Each test folder is a layer, and a marker of the same name (``pytest -m unit``)."""

from __future__ import annotations

from pathlib import Path

import pytest

LAYERS = ("unit", "component", "e2e", "realserver", "upstream")
TESTS = Path(__file__).resolve().parents[1]


def mark_layers(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(TESTS).parts
        if parts and parts[0] in LAYERS:
            item.add_marker(getattr(pytest.mark, parts[0]))


def pytest_report_header() -> str:
    """Which SGLang release (and contract module) this run tests: the CI matrix runs the
    suite once per supported release."""
    from sgl_nixl_plugin.adapter import release_gate

    found = release_gate.installed_sglang_version()
    return f"SGLang {found} (contract {release_gate.contract_for(found)})"
