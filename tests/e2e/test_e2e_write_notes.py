"""Direct rooms end through their WRITEs' NIXL notifications (``wire.notes``) on a decode
that asks for them (the default; ``SGLANG_NIXL_PLUGIN_WRITE_NOTES=0`` asks none), over real
NIXL agents on DRAM: every room of a small workload is ended by its notes and lands
byte-exact, with the setting left at its default too; staged rooms and a decode with the
setting off end through the status."""

from __future__ import annotations

import pytest
from helpers.pd import assert_clean, run_pd, workload

pytestmark = pytest.mark.timeout(180)
NOTES = {"SGLANG_NIXL_PLUGIN_WRITE_NOTES": "1"}


def _hits(res) -> int:
    """Prefill ranks' Successes the decodes applied from notes."""
    return sum(r.get("tables", {}).get("count.note_hits", 0) for r in res.decode.values())


def _rooms(res) -> int:
    return sum(1 for ranks in res.decode.values() for r in ranks.get("results", {}).values())


@pytest.mark.parametrize(
    "prefill_tp, notes",
    [(1, NOTES), (2, NOTES), (1, {})],
    ids=["tp1", "tp2to1", "tp1-default"],
)
def test_direct_rooms_end_through_their_notes_not_the_status(prefill_tp: int, notes) -> None:
    """Chunked rooms with state rows: each prefill rank's last WRITE (the aux row or a
    state) carries the count; without notes every room waits for the status (0 hits)."""
    w = workload("tiny", 16, requests=10, chunks=(1, 3))
    env = {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "direct", **notes}
    res = run_pd(w, prefill_tp=prefill_tp, env=env)
    assert_clean(res)
    # a rank's status message may still beat its notes to the decode's poll (both leave
    # the prefill as the WRITE completes): most, not all, prefill ranks' Successes
    assert _rooms(res) == 10 and 10 * prefill_tp // 2 <= _hits(res) <= 10 * prefill_tp


@pytest.mark.parametrize(
    "env",
    [{"SGLANG_NIXL_PLUGIN_WRITE_NOTES": "0"}, {"SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging"}],
    ids=["notes-off", "staged"],
)
def test_rooms_without_a_note_count_end_through_the_status(env: dict) -> None:
    res = run_pd(workload("tiny", 16, requests=8), env=env)
    assert_clean(res)
    assert _hits(res) == 0
