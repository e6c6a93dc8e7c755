"""A bench rank logs at ``BENCH_LOG`` even where an import configured logging first."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from sgl_nixl_plugin.bench.rank import configure_logging


@contextmanager
def bare_root_logger() -> Iterator[logging.Logger]:
    """The root logger without pytest's handlers (taken off, not closed: ``force=True``
    closes what it replaces), put back as it was afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for h in handlers:
        root.removeHandler(h)
    try:
        yield root
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
            h.close()
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)


def test_info_lines_reach_stderr_after_an_import_logged_through_the_root_logger(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with bare_root_logger() as root:
        root.setLevel(logging.WARNING)
        logging.warning("an import on a CUDA host")  # installs a WARNING-level stderr handler
        capsys.readouterr()
        configure_logging("INFO")
        logging.getLogger("sgl_nixl_plugin.sides.decode_registrations").info("set up in 1.0 ms")
        assert "set up in 1.0 ms" in capsys.readouterr().err
