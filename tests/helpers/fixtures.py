"""Fixtures and pytest hooks shared by the test modules (re-exported by ``conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.scenarios import ScenarioRunner

__all__ = [
    "gather_scenarios",
    "pytest_configure",
    "scenarios",
    "_scenario_runner",
    "fresh_registry",
]

#: test module -> the scenarios its selected tests need, in the order they need them.
_WANTED = pytest.StashKey[dict[str, list[str]]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "scenarios(*names): subprocess scenarios (helpers.scenarios) a test reads"
    )


def gather_scenarios(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Remember which scenarios each module's selected tests need (after deselection:
    ``-m``/``-k`` leave the others unstarted)."""
    wanted: dict[str, dict[str, None]] = {}
    for item in items:
        for marker in item.iter_markers("scenarios"):
            wanted.setdefault(item.nodeid.split("::")[0], {}).update(dict.fromkeys(marker.args))
    config.stash[_WANTED] = {module: list(names) for module, names in wanted.items()}


@pytest.fixture(scope="session")
def _scenario_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScenarioRunner]:
    runner = ScenarioRunner(workdir=tmp_path_factory.mktemp("scenarios"))
    yield runner
    runner.close()


@pytest.fixture
def scenarios(request: pytest.FixtureRequest, _scenario_runner: ScenarioRunner) -> ScenarioRunner:
    """Runs the scenarios declared by ``@pytest.mark.scenarios``: a module's first test
    starts every scenario its module needs, in parallel. Per module, so that parallel
    test workers (``-n 2 --dist loadfile``: a module runs on one worker) start only their
    own modules' scenarios."""
    module = request.node.nodeid.split("::")[0]
    _scenario_runner.start(request.config.stash.get(_WANTED, {}).get(module, []))
    return _scenario_runner


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """An empty plugin-manager cache before and after the test (entry points rescanned)."""
    from sgl_nixl_plugin.registry import manager

    manager.reset_for_tests()
    yield
    manager.reset_for_tests()
