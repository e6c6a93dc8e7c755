"""The version gate: supported range, signature checks, and what SGLang does when we refuse."""

from __future__ import annotations

import enum
import importlib.metadata

import pytest
from helpers.scenarios import OLD_SGLANG, ScenarioResult, ScenarioRunner
from helpers.subproc import SCENARIO_TEST_TIMEOUT_S

from sgl_nixl_plugin import __version__, compat
from sgl_nixl_plugin.adapter import contract
from sgl_nixl_plugin.bridge import version_gate
from sgl_nixl_plugin.registry.spec import CLASS_KINDS

IN_TREE_NIXL_PREFIX = "sglang.srt.disaggregation.nixl."
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def _our_errors(stderr: str) -> list[str]:
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("ERROR sgl_nixl_plugin")
        or f"sgl-nixl-plugin {__version__} is NOT" in line
    ]


def _assert_refused(result: ScenarioResult) -> str:
    """SGLang kept its in-tree nixl and we logged exactly one error; returns that line."""
    assert result.returncode == 0 and result.data is not None, result.explain()
    data = result.data
    assert data["plugin_state"] == "disabled"
    assert GET_KV_CLASS not in data["hooks"]
    for kind in CLASS_KINDS:
        assert data["kv"]["nixl"][kind].startswith(IN_TREE_NIXL_PREFIX), data["kv"]["nixl"]
    errors = _our_errors(result.stderr)
    assert len(errors) == 1, result.explain()
    return errors[0]


# ------------------------------------------------------------------ in-process


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23.post2.dev0"])
def test_supported_versions(version: str) -> None:
    assert compat.check_version(version) == []


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.5.24rc1", "0.6.0", "0.5.9"])
def test_unsupported_version_message_names_version_range_and_fix(version: str) -> None:
    (problem,) = compat.check_version(version)
    assert f"SGLang {version} " in problem
    assert compat.SUPPORTED_SGLANG in problem
    assert "pip install 'sgl-nixl-plugin[sglang]'" in problem
    assert "pip install 'sglang==0.5.23'" in problem


def test_invalid_and_missing_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    (problem,) = compat.check_version("not-a-version")
    assert "not a valid version" in problem and compat.SUPPORTED_SGLANG in problem

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv(compat.VERSION_OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(compat.importlib.metadata, "version", missing)
    assert compat.installed_sglang_version() is None
    (problem,) = compat.check_version()
    assert "not installed" in problem and compat.FIX_HINT in problem


def test_version_override_is_a_test_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compat.VERSION_OVERRIDE_ENV, "0.5.22")
    assert compat.installed_sglang_version() == "0.5.22"
    assert compat.check_sglang() != []  # decided without importing SGLang
    monkeypatch.setenv(compat.VERSION_OVERRIDE_ENV, "")
    assert compat.installed_sglang_version() == importlib.metadata.version("sglang")


class _Dest(enum.Enum):
    DEVICE = "device"


def test_render_signature_ignores_annotations_and_marks_kinds() -> None:
    import inspect

    def f(a: int, /, b: str, *, c: object = None, d: _Dest = _Dest.DEVICE, **kw: int) -> None:
        pass

    def g(self, *args, e=[1], f=True):  # noqa: B006 - the default's value is what we render
        pass

    assert contract.render_signature(inspect.signature(f)) == (
        "(a, /, b, *, c=None, d=_Dest.DEVICE, **kw)"
    )
    assert contract.render_signature(inspect.signature(g)) == "(self, *args, e=..., f=True)"


def test_relied_signatures_are_well_formed() -> None:
    targets = [s.target for s in contract.RELIED_SIGNATURES]
    assert len(targets) == len(set(targets))
    for relied in contract.RELIED_SIGNATURES:
        module, _, qualname = relied.target.partition(":")
        assert module.startswith("sglang.") and qualname
        assert relied.expected.startswith("(") and relied.expected.endswith(")")


@pytest.mark.parametrize(
    ("value", "strict"),
    [("1", True), ("true", True), ("YES", True), ("0", False), ("", False), ("no", False)],
)
def test_strict_mode_parsing(monkeypatch: pytest.MonkeyPatch, value: str, strict: bool) -> None:
    monkeypatch.setenv(version_gate.STRICT_ENV, value)
    assert version_gate.strict_mode() is strict


def test_gate_message_is_one_line_with_every_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(version_gate.STRICT_ENV, raising=False)
    gate = version_gate.GateResult(problems=("first problem", "second problem"))
    assert not gate.ok
    assert "\n" not in gate.message
    assert "first problem" in gate.message and "second problem" in gate.message
    assert "in-tree" in gate.message and version_gate.STRICT_ENV in gate.message
    assert version_gate.GateResult(problems=()).ok


# ------------------------------------------------------------------ real SGLang, subprocess


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("old_sglang")
def test_unsupported_sglang_logs_one_error_and_keeps_in_tree_nixl(
    scenarios: ScenarioRunner,
) -> None:
    line = _assert_refused(scenarios.result("old_sglang"))
    assert f"installed SGLang {OLD_SGLANG} " in line
    assert compat.SUPPORTED_SGLANG in line
    assert "pip install 'sgl-nixl-plugin[sglang]'" in line
    assert "pip install 'sglang==0.5.23'" in line


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("old_sglang_strict")
def test_strict_mode_fails_the_process_at_start_up(scenarios: ScenarioRunner) -> None:
    result = scenarios.result("old_sglang_strict")
    assert result.returncode != 0, result.explain()
    assert result.data is None, result.explain()  # never got past load_plugins()
    assert "refuses to start" in result.stderr, result.explain()
    assert f"installed SGLang {OLD_SGLANG} " in result.stderr
    assert compat.SUPPORTED_SGLANG in result.stderr


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("changed_signature")
def test_changed_signature_logs_one_error_and_registers_nothing(
    scenarios: ScenarioRunner,
) -> None:
    line = _assert_refused(scenarios.result("changed_signature"))
    assert "CommonKVSender.send changed" in line
    assert "token_position_offset" in line
    assert "installed SGLang 0.5.23 " in line and compat.SUPPORTED_SGLANG in line
