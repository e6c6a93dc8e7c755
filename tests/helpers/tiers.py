"""Which tests the gate runs and which only the full run adds (``ci/run_tests.sh``).

The gate (CI, ``bash ci/run_tests.sh``) deselects ``-m full``; ``--full`` runs everything.
A test leaves the gate only where another test in the gate still covers its feature end to
end: each entry below names that test. The real-server stage marks its own configurations
(``Config.full`` in tests/realserver/test_real_server.py).

The suite runs under pytest-xdist, ``-n 2 --dist loadfile``: a module runs on one worker, so
its module fixtures (a session's rank processes, the KVArgs capture) are built once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

#: node id prefix -> the gate test that still covers the feature.
FULL_ONLY: dict[str, str] = {}


def mark_full(items: list[pytest.Item]) -> None:
    """``full`` on the tests the gate leaves out."""
    for item in items:
        if any(item.nodeid.startswith(prefix) for prefix in FULL_ONLY):
            item.add_marker(pytest.mark.full)
