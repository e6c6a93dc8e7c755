"""What the bench's prefill and decode drivers share: one rank's pools and manager, the
wake-up on status changes, and the per-room tables checked at the end.

A driver is steppable: ``step()`` does one pass of what SGLang's scheduler does for its
transfers, ``wait()`` sleeps until the next pass is worth doing. The bench loops over it
(``run_prefill``, ``run_decode``); the fault tests step it from their own command loop.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench.pools import Pools
from sgl_nixl_plugin.bench.spec import RankSpec

FLAG_POLL_S = 20e-6  # the decode loop's wait while a room waits for a completion flag


def room_tables(mgr: Any) -> dict[str, int]:
    """Sizes of every per-room table (they must all return to zero; ``count.*`` are
    counters, ``nixl.*`` live engine resources)."""
    if hasattr(mgr, "room_tables"):
        return mgr.room_tables()
    from sgl_nixl_plugin.adapter.sglang_rooms import sglang_table_sizes  # imports SGLang

    return sglang_table_sizes(mgr)


class StatusBell:
    """Wakes a bench loop when the manager records a status change.

    The loops otherwise sleep 0.5 ms between polls, which puts ~0.3 ms of the bench's own
    wait into every request's latency (spinning instead starves the plugin's threads of
    the GIL). The timeout keeps the timed steps (chunk gaps) and the abort checks going.
    A status concluded for the decode (``conclude_transfer``: local status, then the
    message) rings once the message left: rung before, the woken loop took the GIL from
    the thread about to send it (measured ~0.15 ms later at the decode).
    """

    def __init__(self, mgr: Any) -> None:
        # the longest wait between two polls; without the bell (``BENCH_BELL=0``) the
        # loops sleep it through, as they did before the bell
        self.WAIT_S = settings.value("BENCH_POLL_WAIT_US") * 1e-6
        self.rings = bool(settings.value("BENCH_BELL"))
        self._event = threading.Event()
        self._held = threading.local()  # inside conclude_transfer on this thread: ring after
        if not self.rings:
            return
        update = mgr.update_status

        def update_status(*args: Any, **kwargs: Any) -> Any:
            try:
                return update(*args, **kwargs)
            finally:
                if getattr(self._held, "depth", 0):
                    self._held.rang = True
                else:
                    self._event.set()

        mgr.update_status = update_status
        conclude = getattr(mgr, "conclude_transfer", None)
        if conclude is None:
            return

        def conclude_transfer(*args: Any, **kwargs: Any) -> Any:
            held = self._held
            held.depth = getattr(held, "depth", 0) + 1
            try:
                return conclude(*args, **kwargs)
            finally:
                held.depth -= 1
                if not held.depth and getattr(held, "rang", False):
                    held.rang = False
                    self._event.set()

        mgr.conclude_transfer = conclude_transfer

    def wait(self, timeout_s: float | None = None) -> None:
        wait_s = self.WAIT_S if timeout_s is None else timeout_s
        if not self.rings:
            time.sleep(wait_s)
            return
        self._event.wait(wait_s)
        self._event.clear()  # before the polls that follow: a later change rings again


class SideDriver:
    """One rank's pools, metadata slots and deadline; the subclass opens the manager
    (``open_manager``) once whatever SGLang starts before it (a bootstrap server) is up."""

    role = ""

    def __init__(self, spec: RankSpec, env: dict[str, Any]) -> None:
        """``env``: what ``rank.setup`` returned (SGLang's server args, the backend's classes)."""
        self.spec = spec
        self.env = env
        self.cls = env["classes"]
        self.KVPoll = harness.kv_poll()
        self.pools = Pools(spec)
        self.slots = list(range(1, self.pools.aux_rows))
        self.deadline = time.monotonic() + spec.deadline_s  # restarted once the manager is up
        self.mgr: Any = None
        self.bell: StatusBell | None = None
        self._cpu0 = 0.0

    def open_manager(self) -> Any:
        """The backend's KV manager, built as SGLang's queue builds it, with a bell on it."""
        self.mgr = self.cls["manager"](
            self.pools.kv_args(self.cls["kvargs"], self.spec),
            harness.disaggregation_mode(self.role),
            self.env["server_args"],
            self.spec.workload.shape.mla,
        )
        self.bell = StatusBell(self.mgr)
        self.deadline = time.monotonic() + self.spec.deadline_s
        self._cpu0 = time.process_time()
        return self.mgr

    def cpu_s(self) -> float:
        """CPU seconds this rank's process spent (every thread: the backend's and the
        bench loop's own work on pages) since its manager was up."""
        return time.process_time() - self._cpu0

    def tables(self) -> dict[str, int]:
        return room_tables(self.mgr)

    def close_manager(self) -> None:
        close = getattr(self.mgr, "close", None)
        if close is not None:
            close()
