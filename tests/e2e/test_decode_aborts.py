"""Decode aborts at random moments of a transfer, through SGLang's classes: every aborted
room's pages stay as the decode left them once its abort was safe (deferred KV release:
``is_abort_release_safe`` after the prefill's ABORT_ACK), whatever path the prefill took.

The bench's decode aborts every third room at a random moment up to 8 ms after its
transfer request (``Workload.abort_every``), paints the room's pages once the abort is
safe, and reads them back after every room ended: a WRITE, scatter or one-pass copy that
landed after the ACK shows as a page no longer painted. The other rooms arrive
byte-exact. The one-pass (GPU) version is in ``test_one_pass.py``.
"""

from __future__ import annotations

import pytest
from helpers.pd import ABORT_ENV, abort_workload, assert_aborts_fenced, run_pd

from sgl_nixl_plugin.bench.workload import PRESETS, ModelShape

pytestmark = pytest.mark.timeout(240)

#: 512 KiB pages: a room's WRITEs take long enough for some aborts to land among them
BIG = ModelShape("abort-test", layers=8, kv_heads=8, head_dim=128)


@pytest.mark.parametrize("path", ["direct", "staging"])
def test_decode_aborts_at_random_moments_leave_no_write_after_the_ack(path: str) -> None:
    w = abort_workload(BIG)
    res = run_pd(w, env={**ABORT_ENV, "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": path})
    counts = assert_aborts_fenced(res)
    print(f"\n{path}: {counts}")


def test_the_abort_workload_aborts_every_third_room_from_the_second() -> None:
    reqs = abort_workload(PRESETS["tiny"], requests=9).make_requests()
    assert [r.abort_at_ms is not None for r in reqs] == [False, True, False] * 3
    assert all(0 <= r.abort_at_ms <= 8.0 for r in reqs if r.abort_at_ms is not None)
