"""Rank processes forked from the bench's preloaded forkserver (``bench.procs``)."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any

import pytest

from sgl_nixl_plugin.bench import procs

NAMES = ("SGLANG_NIXL_PLUGIN_TEST_PROCS_A", "SGLANG_NIXL_PLUGIN_TEST_PROCS_B")


def _report(conn: Connection, inherited: procs.Inherited, line: str) -> None:
    inherited.apply()
    os.write(2, line.encode())
    imported = sorted(m for m in ("torch", "sglang.srt.server_args") if m in sys.modules)
    conn.send(({n: os.environ.get(n) for n in NAMES}, imported))
    conn.close()


def _child_reports(ctx: Any, line: str = "") -> tuple[dict[str, str | None], list[str]]:
    """What a child started now reports: those variables, and which heavy modules it had
    before importing anything; it writes ``line`` to its stderr."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_report, args=(child, procs.Inherited(), line))
    p.start()
    child.close()
    try:
        assert parent.poll(120), "the forked child did not report"
        return parent.recv()
    finally:
        p.join(30)
        if p.exitcode is None:
            p.kill()
            p.join(5)


def test_forked_ranks_inherit_what_their_parent_has_when_they_start(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The forkserver keeps the environment and the stdout and stderr it started with; a
    rank must not. A variable set when the first rank starts (and the forkserver with it,
    if it was not running) is gone from a rank started after it was unset, one set since
    is there, and the later rank writes to this test's captured stderr."""
    ctx = procs.context("DRAM")
    assert ctx.get_start_method() == "forkserver"
    a, b = NAMES
    monkeypatch.setenv(a, "first")
    monkeypatch.delenv(b, raising=False)
    with capfd.disabled():
        seen, preloaded = _child_reports(ctx)
    assert seen == {a: "first", b: None}
    assert preloaded == ["sglang.srt.server_args", "torch"]  # imported once, by the forkserver

    monkeypatch.delenv(a)
    monkeypatch.setenv(b, "second")
    assert _child_reports(ctx, "written by the second rank\n")[0] == {a: None, b: "second"}
    assert "written by the second rank" in capfd.readouterr().err


def test_ranks_on_a_gpu_are_spawned_and_write_to_their_parents_stderr(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A spawned child is handed its parent's descriptors 1 and 2 under their own numbers:
    taking them over must not close them (the GPU host's bench ranks logged nothing)."""
    ctx = procs.context("VRAM")
    assert ctx.get_start_method() == "spawn"
    seen, _ = _child_reports(ctx, "written by a spawned rank\n")
    assert seen == {n: os.environ.get(n) for n in NAMES}
    assert "written by a spawned rank" in capfd.readouterr().err
