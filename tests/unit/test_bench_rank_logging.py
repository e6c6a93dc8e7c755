"""A bench rank logs at ``BENCH_LOG`` even where an import configured logging first."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from sgl_nixl_plugin.bench.rank import configure_logging


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    for h in root.handlers[:]:
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_info_lines_reach_stderr_after_an_import_logged_through_the_root_logger(
    root_logging: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    for h in root_logging.handlers[:]:
        root_logging.removeHandler(h)
    root_logging.setLevel(logging.WARNING)
    logging.warning("an import on a CUDA host")  # installs a WARNING-level stderr handler
    capsys.readouterr()
    configure_logging("INFO")
    logging.getLogger("sgl_nixl_plugin.sides.decode_registrations").info("set up in 1.0 ms")
    assert "set up in 1.0 ms" in capsys.readouterr().err
