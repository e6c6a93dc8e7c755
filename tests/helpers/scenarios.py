"""Named subprocess scenarios, run concurrently (SGLang's import costs seconds per process).

Tests declare what they need with ``@pytest.mark.scenarios("name", ...)``; the session
fixture ``scenarios`` starts every scenario the *selected* tests need in parallel on first
use, then each test waits only for its own. To add one, add an entry to :func:`catalogue`.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import subproc, thirdparty
from helpers.sglang_probe import RESULT_MARKER

PROBE = str(Path(__file__).with_name("sglang_probe.py"))
OLD_SGLANG = "0.5.20"  # the release before the oldest supported


@dataclass
class ScenarioResult:
    """A finished scenario: exit code, output, and the probe's JSON (if it printed one)."""

    name: str
    returncode: int
    stdout: str
    stderr: str
    data: dict[str, Any] | None = None

    def explain(self) -> str:
        return (
            f"scenario {self.name!r} rc={self.returncode}\n--- stdout (tail) ---\n"
            f"{self.stdout[-3000:]}\n--- stderr (tail) ---\n{self.stderr[-3000:]}"
        )


@dataclass(frozen=True)
class Scenario:
    argv: Callable[[], list[str]]
    env: Callable[[], dict[str, str]]


def catalogue(workdir: Path) -> dict[str, Scenario]:
    """All scenarios. ``workdir`` holds generated packages (the third-party backend)."""
    thirdparty_root = workdir / "nixl_test_backend_dist"

    def third_party_env() -> dict[str, str]:
        if not thirdparty_root.exists():
            thirdparty.write_nixl_test_backend(thirdparty_root)
        return subproc.clean_env(extra_pythonpath=[thirdparty_root])

    def probe(*args: str) -> Callable[[], list[str]]:
        return lambda: subproc.python_argv(PROBE, *args)

    def env(**overrides: str) -> Callable[[], dict[str, str]]:
        return lambda: subproc.clean_env(overrides)

    def cli(*args: str) -> Callable[[], list[str]]:
        return lambda: [subproc.console_script("sgl-nixl-plugin"), *args]

    return {
        # SGLang with our plugin, as installed.
        "plugin": Scenario(probe(), env()),
        # SGLang with our plugin filtered out by SGLang's own whitelist: the reference.
        "baseline": Scenario(probe("--parse", "nixl_test"), env(SGLANG_PLUGINS="other_plugin")),
        # A third-party package adds backend "nixl_test" through our entry-point group.
        "thirdparty": Scenario(
            probe("--parse", "nixl_test", "--parse", "nixl", "--extra-backend", "nixl_test"),
            third_party_env,
        ),
        "old_sglang": Scenario(probe(), env(SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE=OLD_SGLANG)),
        "old_sglang_strict": Scenario(
            probe(),
            env(
                SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE=OLD_SGLANG, SGLANG_NIXL_PLUGIN_STRICT="1"
            ),
        ),
        "changed_signature": Scenario(probe("--break-signature"), env()),
        "doctor": Scenario(cli("doctor"), env()),
        "doctor_json": Scenario(cli("doctor", "--json"), env()),
        "doctor_old_sglang": Scenario(
            cli("doctor"), env(SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE=OLD_SGLANG)
        ),
    }


def _run(name: str, scenario: Scenario) -> ScenarioResult:
    try:
        proc = subproc.run(scenario.argv(), env=scenario.env())
    except subprocess.TimeoutExpired as exc:
        return ScenarioResult(name, -1, str(exc.stdout or ""), f"TIMEOUT: {exc}")
    data = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            data = json.loads(line[len(RESULT_MARKER) :])
            break
    return ScenarioResult(name, proc.returncode, proc.stdout, proc.stderr, data)


@dataclass
class ScenarioRunner:
    """Starts scenarios on a small thread pool (one subprocess per thread)."""

    workdir: Path
    _pool: ThreadPoolExecutor | None = None
    _futures: dict[str, Future[ScenarioResult]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._catalogue = catalogue(self.workdir)

    def start(self, names: Iterable[str]) -> None:
        """Start these scenarios (those not started yet) without waiting for them."""
        names = list(names)
        unknown = set(names) - set(self._catalogue)
        if unknown:
            raise KeyError(f"unknown scenarios: {sorted(unknown)}")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2))
        for name in names:
            if name not in self._futures:
                self._futures[name] = self._pool.submit(_run, name, self._catalogue[name])

    def result(self, name: str) -> ScenarioResult:
        """Wait for scenario ``name`` (starting it if needed)."""
        self.start([name])
        return self._futures[name].result(timeout=subproc.TIMEOUT_S * 4)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
