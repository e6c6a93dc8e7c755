"""Environment variables: one spelling (SGLANG_NIXL_PLUGIN_*), one table (settings.VARS).

The SGL_NIXL_PLUGIN_* spelling of 0.4 and earlier is refused when it is set alone (ignoring it
would, for the secret, turn authentication off). Inside an SGLang server both are set, since
SGLang copies every SGL_* variable to SGLANG_*: that must keep working.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.settings import Settings, read_secret

NEW = "SGLANG_NIXL_PLUGIN_"
OLD = "SGL_NIXL_PLUGIN_"
NAMES = (
    "SECRET",
    "SECRET_FILE",
    "TRANSFER_PATH",
    "SLOT_WAIT",
    "WORKERS",
    "STRICT",
    "SGLANG_VERSION_OVERRIDE",
    "STAGING_BYTES",
    "MAP_INDICES",
    "KV_MEM_KIND",
    "TEST_TIMEOUT_SCALE",
    "PROGRESS_THREAD",
)
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for n in NAMES:
        monkeypatch.delenv(NEW + n, raising=False)
        monkeypatch.delenv(OLD + n, raising=False)


def test_only_the_sglang_spelling_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_env().slot_wait_s == 2.0
    monkeypatch.setenv(NEW + "SLOT_WAIT", "0.5")
    assert Settings.from_env().slot_wait_s == 0.5
    monkeypatch.setenv(NEW + "SECRET", "s3cret")
    assert read_secret() == b"s3cret" and Settings.from_env().secret == b"s3cret"
    assert settings.secret_vars_set() == [NEW + "SECRET"]


@pytest.mark.parametrize(
    ("name", "value", "call"),
    [
        ("SLOT_WAIT", "3", Settings.from_env),
        ("WORKERS", "4", Settings.from_env),
        ("SECRET", "s3cret", read_secret),  # ignoring it would turn authentication off
        ("SECRET_FILE", "/etc/secret", read_secret),
        ("STRICT", "1", lambda: settings.strict_mode()),
        ("SGLANG_VERSION_OVERRIDE", "9.9.9", lambda: settings.sglang_version_override()),
    ],
)
def test_the_legacy_spelling_alone_is_refused(monkeypatch, name, value, call) -> None:
    monkeypatch.setenv(OLD + name, value)
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert OLD + name in message and NEW + name in message and "rename" in message, message


def test_both_spellings_set_as_inside_an_sglang_server(monkeypatch, tmp_path) -> None:
    # SGLang copies SGL_* to SGLANG_* (overwriting): both hold the same value
    for name, value in (("SLOT_WAIT", "3"), ("STRICT", "1"), ("TRANSFER_PATH", "direct")):
        monkeypatch.setenv(OLD + name, value)
        monkeypatch.setenv(NEW + name, value)
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    monkeypatch.setenv(OLD + "SECRET_FILE", str(f))
    monkeypatch.setenv(NEW + "SECRET_FILE", str(f))
    s = Settings.from_env()
    assert (s.slot_wait_s, s.transfer_path, s.secret) == (3.0, "direct", b"from-file")
    assert settings.strict_mode() is True


def test_bad_values_name_the_variable(monkeypatch, tmp_path) -> None:
    cases = [
        ("TRANSFER_PATH", "fast", Settings.from_env, "TRANSFER_PATH='fast': expected one of"),
        ("WORKERS", "two", Settings.from_env, "WORKERS='two' is not an integer"),
        ("SLOT_WAIT", "soon", Settings.from_env, "SLOT_WAIT='soon' is not a number"),
        ("MAP_INDICES", "maybe", Settings.from_env, "MAP_INDICES='maybe': expected 1 or 0"),
        ("PROGRESS_THREAD", "2", Settings.from_env, "PROGRESS_THREAD='2': expected 1 or 0"),
        ("KV_MEM_KIND", "HBM", Settings.from_env, "KV_MEM_KIND='HBM': expected one of"),
        ("STRICT", "maybe", settings.strict_mode, "STRICT='maybe': expected 1 or 0"),
        (
            "TEST_TIMEOUT_SCALE",
            "x",
            settings.test_timeout_scale,
            "TEST_TIMEOUT_SCALE='x' is not a number",
        ),
        ("SECRET_FILE", str(tmp_path / "missing"), read_secret, "SECRET_FILE=.*unreadable"),
    ]
    for name, raw, call, match in cases:
        monkeypatch.setenv(NEW + name, raw)
        with pytest.raises(ValueError, match=re.escape(NEW) + match):
            call()
        monkeypatch.delenv(NEW + name)


def test_values_are_parsed_by_kind(monkeypatch, tmp_path) -> None:
    assert Settings.from_env() == Settings()  # the table's defaults are the dataclass's
    for raw, want in (("0", False), ("off", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv(NEW + "MAP_INDICES", raw)
        assert Settings.from_env().map_indices is want
    monkeypatch.setenv(NEW + "TRANSFER_PATH", "Staging")
    monkeypatch.setenv(NEW + "KV_MEM_KIND", "dram")
    monkeypatch.setenv(NEW + "WORKERS", "0")  # clamped to at least one
    s = Settings.from_env()
    assert (s.transfer_path, s.kv_mem_kind, s.workers) == ("staging", "DRAM", 1)
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    monkeypatch.setenv(NEW + "SECRET", "value")
    monkeypatch.setenv(NEW + "SECRET_FILE", str(f))  # a file wins over the value
    assert read_secret() == b"from-file"
    assert settings.secret_vars_set() == [NEW + "SECRET", NEW + "SECRET_FILE"]
    monkeypatch.setenv(NEW + "SGLANG_VERSION_OVERRIDE", " 9.9.9 ")
    assert settings.sglang_version_override() == "9.9.9"
    from sgl_nixl_plugin.adapter.release_gate import installed_sglang_version

    assert installed_sglang_version() == "9.9.9"
    monkeypatch.setenv(NEW + "TEST_TIMEOUT_SCALE", "3")
    assert settings.test_timeout_scale() == 3.0


def _readme_rows() -> tuple[set[str], set[str]]:
    """Variable names in the README's main table and in its tuning/test sub-table."""
    text = README.read_text()
    config = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    main, _, knobs = config.partition("### Tuning and test knobs")
    names = re.compile(r"`((?:SGLANG_NIXL_PLUGIN|SGLANG_DISAGGREGATION_NIXL)_[A-Z_]+)`")

    def rows(part: str) -> set[str]:
        return {
            n for line in part.splitlines() if line.startswith("| `") for n in names.findall(line)
        }

    return rows(main), rows(knobs)


def test_the_readme_lists_every_variable_with_its_audience() -> None:
    main, knobs = _readme_rows()
    user = {v.name for v in settings.VARS if v.audience == "user"}
    assert len(user) <= 6
    assert main == user | set(settings.SGLANG_VARS)
    assert knobs == {v.name for v in settings.VARS if v.audience != "user"}
    assert {v.audience for v in settings.VARS} <= {"user", "tuning", "test"}
    assert all(v.name.startswith(NEW) and v.doc for v in settings.VARS)
