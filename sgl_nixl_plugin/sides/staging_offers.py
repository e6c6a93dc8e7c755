"""A decode's staging area, allocated when a prefill rank first asks for it.

The decode registers with ``staging_slot_bytes``; a prefill rank that may stage into it
says so in its reply (``wants_staging``), and the decode then allocates its buffer, on a
thread of its own (never the listener's: a GPU allocation and its NIXL registration take
a while), and sends each rank that asked a ``StagingOffer`` with the area and its NIXL
metadata, which now covers the buffer. Only then do its slots enter the rooms table, so
every grant to a rank follows the offer on the socket that carries both. Requests are
staged to every rank that did not decline (a rank's first requests leave before its reply
says whether it stages): rooms staged while the buffer is allocated wait for slots like
any room that finds none (the prefill's ``SLOT_WAIT`` bounds it, then the chunk goes
direct). After a failed allocation no request is staged, and the ranks that asked get
the reason. A rank that takes the area WRITEs into its spare tail at once (its warm-up,
bounded by its ``WARMUP_TIMEOUT``): ``warming`` tells the listener to progress the
transport meanwhile, which UCX over TCP needs on the target too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sgl_nixl_plugin.engine.staging_memory import LazyStaging
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.wire.messages import MAX_REASON, Region, StagingArea, StagingOffer

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


class StagingOffers:
    """Which prefill ranks have our staging area, and the allocation they wait for.

    ``offer`` and ``withdraw`` run on the listener thread; ``stages_to`` on SGLang's
    scheduler thread as it builds requests.
    """

    def __init__(
        self,
        memory: LazyStaging,
        rooms: DecodeRooms,
        send: Callable[[Endpoint, Any], object],
        me: tuple[str, str, int],
        metadata: Callable[[], bytes],
    ) -> None:
        """``me``: (agent name, control ip, port); ``metadata``: our NIXL metadata now."""
        self.memory = memory
        self.rooms = rooms
        self._send = send
        self._me = me
        self._metadata = metadata
        self.offered: set[Endpoint] = set()  # ranks the area went to
        self.declined: set[Endpoint] = set()  # ranks that do not stage into us
        self.sent = 0  # StagingOffers sent with an area
        self.sent_at = float("-inf")  # monotonic time the latest of them went
        self._allocated = False  # the allocation is over (the buffer, or its error)
        # ranks waiting for the allocation, and what to run once their offer went
        self._askers: dict[Endpoint, Callable[[], None] | None] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def stages_to(self, endpoint: Endpoint | None) -> bool:
        """Whether requests to ``endpoint`` are staged: unless it declined (its reply did
        not ask for our area) or our buffer could not be allocated."""
        return endpoint is not None and endpoint not in self.declined and not self.memory.error

    def area(self) -> StagingArea | None:
        b = self.memory.buffer
        if b is None:
            return None
        region = Region(b.ptr, b.nbytes, b.slot_bytes, b.device, b.mem_kind)
        return StagingArea(region, b.slot_bytes, b.device_uuid)

    def offer(self, endpoint: Endpoint, then: Callable[[], None] | None = None) -> None:
        """Prefill rank ``endpoint`` may stage into us: send it the area now, or once it is
        allocated (the first ask starts the allocation), unless it has it (it answered a
        registration sent again); ``then`` runs once it went (or the reason it has none)."""
        self.declined.discard(endpoint)
        with self._lock:  # the allocation adds its askers to ``offered`` under it
            has_it = endpoint in self.offered
            if not has_it and not self._allocated:
                self._askers[endpoint] = then
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._allocate, name="sgl-nixl-staging-alloc", daemon=True
                    )
                    self._thread.start()
                return
        if has_it:
            if then is not None:
                then()
            return
        self._send_offer(endpoint, then)

    def withdraw(self, endpoint: Endpoint, declined: bool = False) -> None:
        """``endpoint`` no longer has our area (it lost our registration, or is gone): we
        know nothing of it until it answers again, and it gets the area when it asks;
        ``declined``: its reply did not ask (it writes us in one pass or direct), and its
        requests are not staged."""
        self.offered.discard(endpoint)
        if declined:
            self.declined.add(endpoint)
        else:
            self.declined.discard(endpoint)
        with self._lock:
            then = self._askers.pop(endpoint, None)
        if then is not None:
            then()

    def warming(self, bound_s: float) -> bool:
        """Whether a prefill rank may be WRITEing into our area now: an offer is being
        prepared (the allocation runs for ranks that asked), or one went less than
        ``bound_s`` ago (the rank's warm-up WRITE follows it at once)."""
        with self._lock:
            preparing = bool(self._askers) and not self._allocated
        return preparing or time.monotonic() - self.sent_at < bound_s

    def wait(self, timeout: float) -> bool:
        """Whether the allocation that started is over (tests and shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _allocate(self) -> None:
        with self._lock:
            askers = sorted(f"{ip}:{port}" for ip, port in self._askers)
        buffer = self.memory.ensure(f"prefill rank(s) {', '.join(askers)} may stage into us")
        with self._lock:
            self._allocated = True
            askers_now, self._askers = self._askers, {}
            if buffer is not None:  # no slot exists before they went: no grant overtakes
                self.offered |= set(askers_now)  # and a second ask meanwhile sends nothing
        for endpoint, then in sorted(askers_now.items(), key=lambda kv: kv[0]):
            self._send_offer(endpoint, then)
        if buffer is not None:  # after the offers: a grant never overtakes its rank's area
            self.rooms.add_slots(buffer.num_slots)

    def _send_offer(self, endpoint: Endpoint, then: Callable[[], None] | None = None) -> None:
        name, ip, port = self._me
        area = self.area()
        if area is None:
            msg = StagingOffer(name, ip, port, reason=self.memory.error[:MAX_REASON])
        else:
            msg = StagingOffer(name, ip, port, self._metadata(), area)
        if self._send(endpoint, msg) and area is not None:
            self.offered.add(endpoint)  # after it went: grants to that rank follow it
            self.sent += 1
            self.sent_at = time.monotonic()
        else:
            self.offered.discard(endpoint)
        if then is not None:
            then()
