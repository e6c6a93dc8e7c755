"""Settings read under both spellings: SGLANG_NIXL_PLUGIN_* (what SGLang asks for) and the
0.2.0 SGL_NIXL_PLUGIN_* (SGLang copies any SGL_* variable to SGLANG_* and warns)."""

from __future__ import annotations

import pytest

from sgl_nixl_plugin import env
from sgl_nixl_plugin.bridge.version_gate import strict_mode
from sgl_nixl_plugin.compat import installed_sglang_version
from sgl_nixl_plugin.settings import Settings, read_secret

NAMES = ("SECRET", "SECRET_FILE", "TRANSFER_PATH", "SLOT_WAIT", "WORKERS", "STRICT",
         "SGLANG_VERSION_OVERRIDE", "STAGING_BYTES", "MAP_INDICES", "SLOT_RETURNS")


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for n in NAMES:
        monkeypatch.delenv(env.PREFIX + n, raising=False)
        monkeypatch.delenv(env.LEGACY_PREFIX + n, raising=False)


def test_new_spelling_first_then_the_legacy_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.lookup("SLOT_WAIT") == ("SGLANG_NIXL_PLUGIN_SLOT_WAIT", "")
    assert env.get("SLOT_WAIT", "7") == "7"
    monkeypatch.setenv("SGL_NIXL_PLUGIN_SLOT_WAIT", "3")
    assert env.lookup("SLOT_WAIT") == ("SGL_NIXL_PLUGIN_SLOT_WAIT", "3")
    assert Settings.from_env().slot_wait_s == 3.0
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_SLOT_WAIT", "0.5")  # SGLang's rename of the above
    assert env.lookup("SLOT_WAIT") == ("SGLANG_NIXL_PLUGIN_SLOT_WAIT", "0.5")
    assert Settings.from_env().slot_wait_s == 0.5


def test_a_secret_under_the_name_sglang_suggests_is_used(monkeypatch, tmp_path) -> None:
    assert read_secret() is None
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_SECRET", "s3cret")
    assert read_secret() == b"s3cret" and Settings.from_env().secret == b"s3cret"
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    monkeypatch.setenv("SGL_NIXL_PLUGIN_SECRET_FILE", str(f))  # a file wins over the value
    assert read_secret() == b"from-file"
    monkeypatch.setenv("SGL_NIXL_PLUGIN_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="SGL_NIXL_PLUGIN_SECRET_FILE=.*unreadable"):
        read_secret()


def test_errors_name_the_variable_that_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_TRANSFER_PATH", "fast")
    with pytest.raises(ValueError, match="SGLANG_NIXL_PLUGIN_TRANSFER_PATH='fast'"):
        Settings.from_env()
    monkeypatch.delenv("SGLANG_NIXL_PLUGIN_TRANSFER_PATH")
    monkeypatch.setenv("SGL_NIXL_PLUGIN_WORKERS", "two")
    with pytest.raises(ValueError, match="SGL_NIXL_PLUGIN_WORKERS='two' is not an integer"):
        Settings.from_env()


def test_strict_mode_and_version_override_read_both(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not strict_mode()
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_STRICT", "1")
    assert strict_mode()
    monkeypatch.delenv("SGLANG_NIXL_PLUGIN_STRICT")
    monkeypatch.setenv("SGL_NIXL_PLUGIN_STRICT", "yes")
    assert strict_mode()
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE", "9.9.9")
    assert installed_sglang_version() == "9.9.9"


def test_map_indices_is_a_flag_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_env().map_indices is True
    for raw, want in (("0", False), ("off", False), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("SGLANG_NIXL_PLUGIN_MAP_INDICES", raw)
        assert Settings.from_env().map_indices is want
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_MAP_INDICES", "maybe")
    with pytest.raises(ValueError, match="SGLANG_NIXL_PLUGIN_MAP_INDICES='maybe': expected 1 or 0"):
        Settings.from_env()
