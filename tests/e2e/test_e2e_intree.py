"""The same PD harness against SGLang's own in-tree nixl backend.

With ``backend="in-tree"`` the session sets ``SGLANG_PLUGINS=__none__``, so SGLang's
``get_kv_class`` returns its in-tree nixl classes. Those meeting every byte check shows the
harness checks the contract SGLang's own backend meets, not one made up for our plugin.
``state=False``: the in-tree backend registers state buffers as VRAM, which fails on a
CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from helpers.pd import (
    assert_clean,
    describe,
    leaked_tables,
    room_tables,
    run_pd,
    session_problems,
    workload,
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shape", ["tiny", "tiny-mla"])
def test_intree_backend_meets_the_harness_contract(
    shape: str, record_property: Callable[[str, object], None]
) -> None:
    w = workload(shape, 16, requests=12, state=False)
    intree = run_pd(w, backend="in-tree")
    # Every request ok and byte-exact; tables are compared below, not required to drain.
    problems = session_problems(intree, check_tables=False)
    assert not problems, describe(intree) + "\n" + "\n".join(problems)

    ours = run_pd(w, backend="plugin")
    assert_clean(ours)  # includes: every per-room table of every rank is 0, nixl.xfer == 0

    # Known in-tree fault (SGLang 0.5.23, nixl/conn.py transfer_worker): after the last
    # chunk it decrements ``_staging_outstanding[room]`` to 0 and concludes Success, then
    # drops the entry only if ``check_status(room)`` still reads Success. The scheduler
    # thread can poll Success in between and call ``sender.clear()``, which pops
    # ``request_status`` (not ``_staging_outstanding``); ``check_status`` then falls back to
    # WaitingForInput and the 0 entry stays forever -- one per successful room that lost the
    # race. How many rooms leak varies from run to run (seen: 1-9 of 12) and may be none, so
    # it is asserted only when it shows. Our plugin leaves no per-room state on any rank.
    leaked = sum(
        room_tables(r["tables"]).get("_staging_outstanding", 0) for r in intree.prefill.values()
    )
    record_property("intree_prefill_staging_outstanding_leaked", leaked)
    assert all(r["tables"].get("_staging_outstanding", 0) == 0 for r in ours.prefill.values())
    if leaked:
        # The leaked entries belong to rooms that all succeeded (no failure path involved).
        assert leaked <= len(w.make_requests())
        assert all(r["ok"] for r in intree.decode_results().values())
    # Apart from that one table, the in-tree backend drains every per-room table too.
    others = {
        rank: {
            k: v
            for k, v in t.items()
            if not (rank.startswith("prefill") and k == "_staging_outstanding")
        }
        for rank, t in leaked_tables(intree).items()
    }
    assert {rank: t for rank, t in others.items() if t} == {}, describe(intree)
