"""The settings that change SGLang's process: the plugin's log level and the GIL switch
interval, applied when a manager starts (``sides.process_knobs``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest

from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides.process_knobs import apply_process_knobs


@pytest.fixture
def restored() -> Iterator[None]:
    ours = logging.getLogger("sgl_nixl_plugin")
    level, interval = ours.level, sys.getswitchinterval()
    yield
    ours.setLevel(level)
    sys.setswitchinterval(interval)


def test_unset_changes_nothing(restored) -> None:
    before = (logging.getLogger("sgl_nixl_plugin").level, sys.getswitchinterval())
    assert apply_process_knobs(Settings()) == []
    assert (logging.getLogger("sgl_nixl_plugin").level, sys.getswitchinterval()) == before


def test_log_level_reaches_the_room_lines_and_no_other_logger(restored, monkeypatch) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.INFO)  # what SGLang's --log-level info sets
    room_logger = logging.getLogger("sgl_nixl_plugin.sides.context")
    assert not room_logger.isEnabledFor(logging.DEBUG)
    changed = apply_process_knobs(Settings(log_level="DEBUG"))
    assert changed == ["plugin log level DEBUG"]
    assert room_logger.isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("sglang.srt").isEnabledFor(logging.DEBUG)


def test_switch_interval_is_set_for_the_process(restored, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_SWITCH_INTERVAL_US", "200")
    changed = apply_process_knobs(Settings.from_env())
    assert changed == ["GIL switch interval 200 us"]
    assert sys.getswitchinterval() == pytest.approx(200e-6, rel=0.01)  # kept in whole µs
