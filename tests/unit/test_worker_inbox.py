"""A transfer worker's wait for work is bounded by its timeout.

The worker waits on its inbox with timeouts of 20 µs to 1 s. CPython 3.7-3.12's
``queue.SimpleQueue.get(timeout)`` recomputes its remaining time inside its wait loop and,
when the deadline has already passed there, waits with a negative timeout: forever, until
the next put. On a loaded host a worker preempted at that point slept until something else
was queued (in the e2e suite: the shutdown, ~110 s later) while its room waited to post a
WRITE. A signal whose handler outlasts the deadline reaches that point deterministically.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from helpers.subproc import python_argv, run

_SCRIPT = textwrap.dedent(
    """
    import queue, signal, time
    from sgl_nixl_plugin.sides.transfer_worker import TransferWorker

    inbox = TransferWorker(ctx=None, index=0).queue
    inbox.put(1)
    inbox.get()  # a successful get leaves the queue's internal lock free
    signal.signal(signal.SIGALRM, lambda *_: time.sleep(0.3))  # outlasts the deadline
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    t0 = time.monotonic()
    try:
        inbox.get(timeout=0.1)
        print("ITEM")
    except queue.Empty:
        print(f"EMPTY {time.monotonic() - t0:.3f}")
    """
)


def test_the_worker_inbox_wait_ends_when_its_deadline_passed_mid_wait() -> None:
    try:
        proc = run(python_argv("-c", _SCRIPT), timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("the inbox wait with a 0.1 s timeout never returned (killed after 20 s)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    word, elapsed = proc.stdout.split()
    assert word == "EMPTY"
    assert 0.3 <= float(elapsed) < 5.0, elapsed  # the handler's 0.3 s, then no more waiting
