"""The version gate: supported range, signature checks, and what SGLang does when we refuse."""

from __future__ import annotations

import enum
import importlib.metadata

import pytest
from helpers.scenarios import OLD_SGLANG, ScenarioResult, ScenarioRunner
from helpers.subproc import SCENARIO_TEST_TIMEOUT_S

from sgl_nixl_plugin import __version__
from sgl_nixl_plugin.adapter import contract, release_gate
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


@pytest.mark.parametrize(
    ("version", "module"),
    [
        ("0.5.21", "sglang_0_5_21"),
        ("0.5.22", "sglang_0_5_22"),
        ("0.5.22.post1", "sglang_0_5_22"),
        ("0.5.23", "sglang_0_5_23"),
        ("0.5.23.post1", "sglang_0_5_23"),
        ("0.5.23.post2.dev0", "sglang_0_5_23"),
    ],
)
def test_supported_versions_map_to_their_release_module(version: str, module: str) -> None:
    assert release_gate.check_version(version) == []
    assert release_gate.contract_for(version) == module


def test_every_supported_release_has_a_module_and_the_range_says_the_same() -> None:
    from packaging.version import Version

    for release, module in release_gate.CONTRACTS.items():
        assert module == "sglang_" + release.replace(".", "_")
        assert release_gate.SUPPORTED_SPECIFIER.contains(Version(release))
    newest = max(release_gate.CONTRACTS, key=Version)
    assert release_gate.TESTED_SGLANG == newest
    nxt = Version(newest).release
    assert not release_gate.SUPPORTED_SPECIFIER.contains(f"{nxt[0]}.{nxt[1]}.{nxt[2] + 1}")
    oldest = Version(min(release_gate.CONTRACTS, key=Version)).release
    assert not release_gate.SUPPORTED_SPECIFIER.contains(f"{oldest[0]}.{oldest[1]}.{oldest[2] - 1}")


def test_the_sglang_extra_and_the_readme_table_name_the_supported_releases() -> None:
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["sglang"] == [f"sglang{release_gate.SUPPORTED_SGLANG}"]
    lines = (root / "README.md").read_text().splitlines()
    header = lines.index("| sgl-nixl-plugin | SGLang | NIXL | Python | torch |")
    row = lines[header + 2]  # the compatibility table's first row: this release
    assert (
        ", ".join(release_gate.CONTRACTS) in row and f"(`{release_gate.SUPPORTED_SGLANG}`)" in row
    )


@pytest.mark.parametrize("version", ["0.5.20", "0.5.24", "0.5.24rc1", "0.6.0", "0.5.9"])
def test_unsupported_version_message_names_version_range_and_fix(version: str) -> None:
    (problem,) = release_gate.check_version(version)
    assert f"SGLang {version} " in problem
    assert release_gate.SUPPORTED_SGLANG in problem
    assert "pip install 'sgl-nixl-plugin[sglang]'" in problem
    assert "pip install 'sglang==0.5.23'" in problem


def test_invalid_and_missing_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    (problem,) = release_gate.check_version("not-a-version")
    assert "not a valid version" in problem and release_gate.SUPPORTED_SGLANG in problem

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv(release_gate.VERSION_OVERRIDE_ENV, raising=False)
    monkeypatch.setattr(release_gate.importlib.metadata, "version", missing)
    assert release_gate.installed_sglang_version() is None
    (problem,) = release_gate.check_version()
    assert "not installed" in problem and release_gate.FIX_HINT in problem


def test_version_override_is_a_test_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(release_gate.VERSION_OVERRIDE_ENV, "0.5.20")
    assert release_gate.installed_sglang_version() == "0.5.20"
    assert release_gate.check_sglang() != []  # decided without importing SGLang
    monkeypatch.setenv(release_gate.VERSION_OVERRIDE_ENV, "")
    assert release_gate.installed_sglang_version() == importlib.metadata.version("sglang")


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


@pytest.mark.parametrize("release", sorted(release_gate.CONTRACTS))
def test_relied_signatures_are_well_formed(release: str) -> None:
    from sgl_nixl_plugin.adapter import releases

    assert releases.load(release_gate.CONTRACTS[release]).RELEASE == release
    targets = [s.target for s in contract.SIGNATURES[release]]
    assert len(targets) == len(set(targets))
    for relied in contract.SIGNATURES[release]:
        module_name, _, qualname = relied.target.partition(":")
        assert module_name.startswith("sglang.") and qualname
        assert relied.expected.startswith("(") and relied.expected.endswith(")")


def test_the_installed_release_matches_its_module_and_no_other() -> None:
    """The installed SGLang passes its own release's check and fails every other one (so
    each release's signatures tell the releases apart)."""
    installed = release_gate.installed_sglang_version()
    own = release_gate.contract_for(installed)
    assert own is not None, installed
    assert set(contract.SIGNATURES) == set(release_gate.CONTRACTS)
    for release, module in release_gate.CONTRACTS.items():
        problems = contract.check_signatures(contract.SIGNATURES[release])
        assert (problems == []) is (module == own), (release, problems)


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
    assert release_gate.SUPPORTED_SGLANG in line
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
    assert release_gate.SUPPORTED_SGLANG in result.stderr


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("changed_signature")
def test_changed_signature_logs_one_error_and_registers_nothing(
    scenarios: ScenarioRunner,
) -> None:
    line = _assert_refused(scenarios.result("changed_signature"))
    assert "CommonKVSender.send changed" in line
    assert "token_position_offset" in line
    assert f"installed SGLang {importlib.metadata.version('sglang')} " in line
