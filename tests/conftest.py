"""Test configuration. Keep this file thin: reusable code lives in ``tests/helpers/``.

To add fixtures or hooks, put them in a module under ``tests/helpers/`` and import them
here (pytest only sees names defined in, or imported into, this module).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # makes ``helpers`` importable

# prometheus-client picks single- or multi-process mode once, when first imported, from
# PROMETHEUS_MULTIPROC_DIR. Some tests set that variable for the rank processes they start;
# import it now, unset, so this process's own metrics stay in the default registry.
import prometheus_client  # noqa: E402,F401
from helpers import fixtures, layers, tiers  # noqa: E402
from helpers.fixtures import (  # noqa: E402,F401
    _scenario_runner,
    fresh_registry,
    pytest_configure,
    scenarios,
)
from helpers.layers import pytest_report_header  # noqa: E402,F401
from helpers.loopback_only import _loopback_only  # noqa: E402,F401


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by the markers set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    layers.mark_layers(items)
    tiers.mark_full(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    fixtures.gather_scenarios(session.config, session.items)
