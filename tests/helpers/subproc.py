"""Run Python in a fresh, hermetic subprocess (every call has a timeout)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from sgl_nixl_plugin import settings

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Multiplies every subprocess (and scenario-test) timeout; raise it on an overloaded machine,
#: where one SGLang import alone can take minutes (e.g. SGLANG_NIXL_PLUGIN_TEST_TIMEOUT_SCALE=3).
TIMEOUT_SCALE = max(1.0, settings.test_timeout_scale())
TIMEOUT_S = 120 * TIMEOUT_SCALE
#: pytest-timeout for a test that waits on scenarios queued behind others on a small pool.
SCENARIO_TEST_TIMEOUT_S = int(TIMEOUT_S * 5)

#: Variables that change the plugin's or SGLang's plugin behaviour: scrubbed so a developer's
#: shell cannot change test outcomes; tests set what they need explicitly.
_SCRUBBED = (
    "SGLANG_PLUGINS",
    "SGLANG_PLATFORM",
    "SGLANG_NIXL_PLUGIN_STRICT",
    "SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE",
    "SGLANG_DISAGGREGATION_NIXL_BACKEND",
    "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS",
)


def clean_env(
    overrides: Mapping[str, str | None] | None = None,
    extra_pythonpath: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, str]:
    """``os.environ`` minus plugin-affecting variables, plus ``overrides`` (None deletes)."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED}
    env["PYTHONWARNINGS"] = "ignore"
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    if extra_pythonpath:
        parts = [str(p) for p in extra_pythonpath]
        if env.get("PYTHONPATH"):
            parts.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def sglang_env_problems(env: Mapping[str, str]) -> list[str]:
    """The ``SGLANG_*`` values in ``env`` that SGLang would not read: it parses each variable
    it declares with that variable's type, and on a bad value warns (a warning our
    subprocesses ignore) and uses its own default instead, e.g. ``"10.0"`` for an integer
    timeout gave the process SGLang's 300 s."""
    from sglang.srt.environ import Envs

    problems = []
    for name, value in env.items():
        field = vars(Envs).get(name) if name.startswith("SGLANG_") else None
        if field is None or not hasattr(field, "parse"):
            continue
        try:
            field.parse(value)
        except ValueError as exc:
            problems.append(f"{name}={value!r}: {exc}")
    return problems


def run(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (captured text output) from a neutral directory with a timeout."""
    return subprocess.run(
        list(argv),
        env=dict(env) if env is not None else clean_env(),
        cwd=str(REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def python_argv(*args: str) -> list[str]:
    """``[sys.executable, *args]``: the interpreter running the tests."""
    return [sys.executable, *args]


def console_script(name: str) -> str:
    """Path of an installed console script next to the test interpreter."""
    candidate = Path(sys.executable).parent / name
    if not candidate.exists():
        raise FileNotFoundError(
            f"{candidate} not found: install the package (pip install -e .) first"
        )
    return str(candidate)
