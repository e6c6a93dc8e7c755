"""Fixtures and pytest hooks shared by the test modules (re-exported by ``conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.scenarios import ScenarioRunner

__all__ = ["pytest_collection_modifyitems", "pytest_configure", "scenarios", "fresh_registry"]

_WANTED = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "scenarios(*names): subprocess scenarios (helpers.scenarios) a test reads"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Remember which scenarios the selected tests need, so they can start together."""
    wanted: dict[str, None] = {}  # ordered: scenarios start in the order tests need them
    for item in items:
        for marker in item.iter_markers("scenarios"):
            wanted.update(dict.fromkeys(marker.args))
    config.stash[_WANTED] = list(wanted)


@pytest.fixture(scope="session")
def scenarios(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScenarioRunner]:
    """Runs the scenarios declared by ``@pytest.mark.scenarios`` (all at once, in parallel)."""
    runner = ScenarioRunner(
        workdir=tmp_path_factory.mktemp("scenarios"),
        wanted=list(request.config.stash.get(_WANTED, [])),
    )
    yield runner
    runner.close()


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """An empty plugin-manager cache before and after the test (entry points rescanned)."""
    from sgl_nixl_plugin.registry import manager

    manager.reset_for_tests()
    yield
    manager.reset_for_tests()
