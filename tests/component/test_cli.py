"""``sgl-nixl-plugin`` CLI: version, doctor (real SGLang, NIXL and torch), bench dispatch."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import types

import pytest
from helpers import subproc
from helpers.scenarios import OLD_SGLANG, ScenarioRunner
from helpers.subproc import SCENARIO_TEST_TIMEOUT_S

from sgl_nixl_plugin import __version__
from sgl_nixl_plugin.adapter import release_gate
from sgl_nixl_plugin.cli import doctor, main


def _row(text: str, name: str) -> str:
    """The table line whose first cell is ``name`` (rich box drawing or plain text)."""
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == name:
            return line
    raise AssertionError(f"no row {name!r} in:\n{text}")


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("doctor")
def test_doctor_table_on_this_machine(scenarios: ScenarioRunner) -> None:
    result = scenarios.result("doctor")
    assert result.returncode == 0, result.explain()
    out = result.stdout
    assert re.search(r"\bok\b", _row(out, "NIXL backend UCX")), out
    assert "DRAM usable" in _row(out, "memory kinds")
    assert "not visible" in _row(out, "CUDA")
    assert re.search(r"\bok\b", _row(out, "SGLang discovery"))
    assert "signatures match" in _row(out, "SGLang")
    assert out.strip().splitlines()[-1].startswith("OK:")


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("doctor_json")
def test_doctor_json_parses(scenarios: ScenarioRunner) -> None:
    result = scenarios.result("doctor_json")
    assert result.returncode == 0, result.explain()
    report = json.loads(result.stdout)  # nothing but JSON on stdout (NIXL's logs captured)
    assert report["ok"] is True and report["plugin_version"] == __version__
    facts = report["facts"]
    assert facts["memory_kinds"] == ["DRAM"]
    assert facts["nixl_probe"]["backends"]["UCX"]["ok"] is True
    assert facts["cuda"]["available"] is False
    assert facts["discoverable"] is True and facts["sglang_ok"] is True
    installed = importlib.metadata.version("sglang")
    assert facts["sglang_version"] == installed
    assert facts["sglang_contract"] == release_gate.contract_for(installed) is not None
    (line,) = [c["detail"] for c in report["checks"] if c["name"] == "SGLang"]
    assert f"contract {facts['sglang_contract']}, signatures match" in line
    assert {c["status"] for c in report["checks"]} <= {"ok", "info", "warn"}


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("doctor_old_sglang")
def test_doctor_fails_on_unsupported_sglang_and_says_why(scenarios: ScenarioRunner) -> None:
    result = scenarios.result("doctor_old_sglang")
    assert result.returncode != 0, result.explain()
    verdict = " ".join(result.stdout.split())  # undo table/line wrapping
    assert "NOT OK" in verdict
    assert f"SGLang {OLD_SGLANG} is not a supported release (supported: 0.5.21, 0.5.22" in verdict
    assert release_gate.SUPPORTED_SGLANG in verdict
    assert "pip install 'sgl-nixl-plugin[sglang]'" in verdict


@pytest.mark.timeout(int(subproc.TIMEOUT_S) + 30)
def test_python_m_version() -> None:
    proc = subproc.run(subproc.python_argv("-m", "sgl_nixl_plugin", "version"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"sgl-nixl-plugin {__version__}" == "sgl-nixl-plugin 0.5.0"
    installed = importlib.metadata.version("sglang")
    assert lines[1] == (
        f"SGLang {installed} (within the supported range {release_gate.SUPPORTED_SGLANG}; "
        f"contract {release_gate.contract_for(installed)})"
    )
    assert lines[2].startswith("NIXL 1.5")


# ------------------------------------------------------------------ in-process


def test_bench_missing_module_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, main.BENCH_MODULE, None)  # import raises
    assert main.main(["bench", "--anything"]) == 2
    assert "bench command is not available" in capsys.readouterr().err


def test_bench_gets_its_own_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType(main.BENCH_MODULE)
    fake.main = lambda argv: seen.append(argv) or 3  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, main.BENCH_MODULE, fake)
    assert main.main(["bench", "--help", "--size", "4k", "doctor"]) == 3
    assert seen == [["--help", "--size", "4k", "doctor"]]


def test_no_command_and_bad_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main.main([]) == 2
    assert main.main(["nonsense"]) == 2
    assert main.main(["--version"]) == 0
    assert f"sgl-nixl-plugin {__version__}" in capsys.readouterr().out


def _report(*results: doctor.CheckResult) -> doctor.DoctorReport:
    return doctor.run_checks([lambda ctx: list(results)])


def test_checks_list_is_the_extension_point(capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(doctor.CHECKS, list) and doctor.check_memory_kinds in doctor.CHECKS

    def crashes(ctx: doctor.DoctorContext) -> list[doctor.CheckResult]:
        raise RuntimeError("oops")

    def warns(ctx: doctor.DoctorContext) -> list[doctor.CheckResult]:
        ctx.facts["exposed"] = True
        return [doctor.CheckResult("listen address", "warn", "0.0.0.0 without a secret")]

    assert doctor.main(as_json=True, checks=[crashes, warns]) == 0  # warnings do not fail
    report = json.loads(capsys.readouterr().out)
    assert [c["status"] for c in report["checks"]] == ["warn", "warn"]
    assert "oops" in report["checks"][0]["detail"] and report["facts"]["exposed"] is True

    def fails(ctx: doctor.DoctorContext) -> list[doctor.CheckResult]:
        return [doctor.CheckResult("thing", "fail", "it is broken.", "repair it")]

    assert doctor.main(checks=[fails]) == 1
    out = capsys.readouterr().out
    assert "NOT OK" in out and "it is broken" in out and "repair it" in out


def test_plain_renderer_aligns_columns() -> None:
    text = doctor.render_plain(
        _report(
            doctor.CheckResult("a", "ok", "fine"),
            doctor.CheckResult("longer name", "fail", "bad", "fix it"),
        )
    )
    lines = text.splitlines()
    assert lines[0].index("STATUS") == lines[1].index("ok") == lines[2].index("fail")
    assert "-> fix: fix it" in lines[2]
    assert lines[-1].startswith("NOT OK")


@pytest.mark.parametrize(
    ("plugins", "discoverable"),
    [
        (None, True),
        ("", True),
        ("other, sgl_nixl_plugin", True),
        ("other_plugin", False),
        (",", False),
    ],
)
def test_discovery_applies_sglang_plugins_rule(
    monkeypatch: pytest.MonkeyPatch, plugins: str | None, discoverable: bool
) -> None:
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    if plugins is None:
        monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PLUGINS", plugins)
    ctx = doctor.DoctorContext()
    results = doctor.check_discovery(ctx)
    assert ctx.facts["discoverable"] is discoverable
    assert (results[0].status == "ok") is discoverable
    if not discoverable:
        assert "SGLANG_PLUGINS" in results[0].detail


@pytest.mark.parametrize(
    ("env", "vram", "dram"),
    [
        ({}, "2.00 GiB", "128 MiB"),
        ({"SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(512 << 20)}, "512 MiB", "512 MiB"),
    ],
)
def test_doctor_says_how_much_memory_staging_holds_per_rank(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], vram: str, dram: str
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (row,) = doctor.check_staging_memory(doctor.DoctorContext())
    assert row.status == "ok"
    assert row.detail.startswith("0 MiB at start-up; "), row.detail
    assert f"up to {vram} of GPU memory on each rank" in row.detail
    assert f"{dram} of host memory" in row.detail
    assert "when a peer first needs the staged path" in row.detail
    assert doctor.check_staging_memory in doctor.CHECKS


def test_doctor_says_when_staging_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_STAGING_BYTES", "0")
    ctx = doctor.DoctorContext()
    (row,) = doctor.check_staging_memory(ctx)
    assert (row.status, row.detail) == ("ok", "none: staging is off on every rank")
    assert ctx.facts["staging_bytes"] == {"VRAM": 0, "DRAM": 0}
