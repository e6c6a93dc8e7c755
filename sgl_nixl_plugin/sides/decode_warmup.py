"""Decode warm-up: register with a prefill's ranks as soon as the decode learns of it.

SGLang's decode registers with a prefill rank lazily, inside the first request's handshake,
so NIXL's wire-up (linking the peer, the first WRITE) lands on that request. Here the decode
registers with every rank it will talk to as SGLang's first look at the prefill
(``try_ensure_parallel_info``) begins: our bootstrap's route table (``/nixl/routes``) carries
every rank's route and the prefill's parallel info, which SGLang's own rank mapping turns
into the ranks to register with, so the prefill links this decode before SGLang's topology
query has even run (answered from that table). The calling thread does this itself; from a
bootstrap without the table (or its info) a thread waits for SGLang's query and asks rank
by rank. Each prefill rank
links and, for a decode registered ahead of its requests (``request_waits`` False: the
named prefills below), WRITEs the decode's padding page (``TransferEngine.warm``), then
replies. When SGLang's own registration follows, the prefill finds the same registration
and only replies. ``ready(addr)`` says when every rank has replied. Each route is kept for
the first receiver of that rank (``take_route``), which SGLang would otherwise ask the
bootstrap for again: a receiver that comes while the answer is on its way waits for it.

``StartupRegistration`` starts the warm-up of the prefills named in
``SGLANG_NIXL_PLUGIN_PREFILLS`` when the decode starts (as soon as each is up), so that a
static fleet's first user request finds the pair linked and warmed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgl_nixl_plugin.transport import bootstrap_client

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]

#: Route queries one warm-up may make (DP x CP x TP x PP ranks of one prefill).
MAX_RANKS = 64
#: A warm-up that has not heard from every rank by then is given up (the request path,
#: which registers again, reports what is wrong).
GIVE_UP_S = 10.0
#: The longest a receiver waits for the route the warm-up is asking for (its own query
#: would wait as long for the same answer), and the warm-up for SGLang's topology query.
ROUTE_WAIT_S = float(bootstrap_client.TIMEOUT_S)


#: ``_run``'s table argument when the route table is still to be asked for.
_UNASKED = object()


@dataclass
class _Warming:
    started: float
    endpoints: frozenset[Endpoint] = frozenset()
    waiting: set[Endpoint] = field(default_factory=set)
    linked: set[Endpoint] = field(default_factory=set)  # accepted this decode
    done_at: float | None = None
    routes: dict[str, dict[str, Any]] = field(default_factory=dict)  # query -> route, unused
    resolving: bool = True  # still asking the bootstrap for routes
    stale: bool = False  # a rank was lost, restarted or refused: warm again on next start
    request_waits: bool = True  # started for a request (not ahead of them): no warm-up WRITE
    info_done: bool = False  # SGLang's own topology query of the prefill ended
    table_done: bool = False  # the route table answered (or could not be had)
    topology: dict[str, Any] | None = None  # its copy of SGLang's topology answer, unused


class DecodeWarmup:
    def __init__(
        self,
        send_frames: Callable[[Endpoint, list[Any]], bool],
        registration: Callable[[bool], list[Any]],
        prefill_info: Callable[[str], Any],
        secret: bytes | None,
        resolve_info: Callable[[dict[str, Any]], Any] | None = None,
    ) -> None:
        """``registration(request_waits)``: this decode's registration frames;
        ``prefill_info(addr)``: SGLang's parallel info of a prefill, once its query got it;
        ``resolve_info(topology)``: SGLang's rank mapping applied to a copy of the
        prefill's topology answer (None when SGLang's code refuses it)."""
        self._send = send_frames
        self._registration = registration
        self._info = prefill_info
        self._resolve = resolve_info
        self._secret = secret
        self._lock = threading.Condition()  # notified as routes come in
        self._by_addr: dict[str, _Warming] = {}
        self.routes_reused = 0  # first receivers that took the warm-up's route

    def start(self, addr: str, request_waits: bool = True) -> bool:
        """Warm ``addr`` once (again after ``forget``, or when the prefill was not up): a
        daemon thread asks its routes. ``request_waits``: a request to it is waiting (the
        prefill then skips its warm-up WRITE). True when this call started a warm-up."""
        w = self._claim(addr, request_waits)
        if w is not None:
            self._spawn(addr, w, _UNASKED)
        return w is not None

    def ensure(
        self,
        addr: str,
        request_waits: bool,
        query: Callable[[str], bool],
        started: Callable[[], None],
    ) -> bool:
        """SGLang's topology query of ``addr`` (``query``), with the warm-up started before
        it and told when it ended; started again after it if the first found the prefill
        down. ``started`` runs whenever a warm-up starts.

        The calling thread asks for the route table itself, as SGLang's query waits for it
        anyway, and sends the registrations too when the table's copy of the topology gives
        the ranks (the rest, e.g. waiting for SGLang's own answer, goes to a thread): on a
        busy host a new thread took 1-4 ms to get the GIL before its first step."""
        for attempt in range(2):
            w = self._claim(addr, request_waits)
            if w is not None:
                started()
                self._begin(addr, w)
            if attempt:
                return True
            try:
                ok = query(addr)
            finally:
                self.info_fetched(addr)
            if not ok:
                return False
        return True

    def _claim(self, addr: str, request_waits: bool) -> _Warming | None:
        """A new warm-up of ``addr``, or None while one is current."""
        with self._lock:
            known = self._by_addr.get(addr)
            if known is not None and not known.stale:
                return None
            w = self._by_addr[addr] = _Warming(time.monotonic(), request_waits=request_waits)
            return w

    def _spawn(self, addr: str, w: _Warming, table: Any) -> None:
        threading.Thread(
            target=self._run, args=(addr, w, table), name="sgl-nixl-warmup", daemon=True
        ).start()

    def _begin(self, addr: str, w: _Warming) -> None:
        """The table asked for here; the ranks worked out and registered with here too if
        nothing needs waiting for, else in a thread."""
        try:
            table = self._ask_table(addr, w)
            info = self._parallel_info(addr, w, table, wait=False)
        except Exception as exc:  # a warm-up must never take the decode down
            logger.debug("sgl-nixl: warm-up of prefill %s: %s", addr, exc)
            table, info = None, None
        if info is None:
            self._spawn(addr, w, table)
            return
        try:
            self._run(addr, w, table, info)
        except Exception:  # SGLang's scheduler thread: its request goes on and registers
            logger.exception("sgl-nixl: warm-up of prefill %s failed", addr)

    def info_fetched(self, addr: str) -> None:
        """SGLang's topology query of ``addr`` ended, with its info or without: a warm-up
        waiting for it goes on, and the table's copy of the topology is dropped (it answers
        only the look it was fetched beside, never a later one)."""
        with self._lock:
            w = self._by_addr.get(addr)
            if w is not None:
                w.topology = None
            if w is not None and not w.info_done:
                w.info_done = True
                self._lock.notify_all()

    def topology(self, addr: str) -> dict[str, Any] | None:
        """The prefill's topology answer (SGLang's, as its own query would get it) that the
        warm-up's route table carried, once, or None (no warm-up, a table without it, or
        already taken). Waits for the table's answer while it is on its way (at most
        ``ROUTE_WAIT_S``): SGLang's query then needs no request of its own."""
        with self._lock:
            w = self._by_addr.get(addr)
            if w is None:
                return None
            self._lock.wait_for(lambda: w.table_done or w.stale, ROUTE_WAIT_S)
            info, w.topology = w.topology, None
        return info

    def take_route(self, addr: str, query: str) -> dict[str, Any] | None:
        """The route the warm-up got for ``query`` at ``addr``, once (a copy), or None: the
        first receiver to a prefill need not ask the bootstrap again; later ones use
        SGLang's own cache. While the warm-up still asks, this waits for its answer (at most
        ``ROUTE_WAIT_S``). None once the warm-up went stale (a rank was lost)."""
        deadline = time.monotonic() + ROUTE_WAIT_S
        with self._lock:
            while True:
                w = self._by_addr.get(addr)
                if w is None or w.stale:
                    return None
                route = w.routes.pop(query, None)
                left = deadline - time.monotonic()
                if route is not None or not w.resolving or left <= 0:
                    break
                self._lock.wait(left)
            self.routes_reused += route is not None
        return dict(route) if route is not None else None

    def ready(self, addr: str) -> bool:
        """Every rank of ``addr`` replied to the warm-up registration (or it was given up)."""
        with self._lock:
            w = self._by_addr.get(addr)
            if w is None:
                return False
            if w.done_at is None and time.monotonic() - w.started > GIVE_UP_S:
                w.done_at = time.monotonic()
                logger.warning("sgl-nixl: warm-up of prefill %s gave up after %ss", addr, GIVE_UP_S)
            return w.done_at is not None

    def waiting(self) -> bool:
        """Some warm-up still waits for a rank's reply (its WRITE needs this side's progress)."""
        now = time.monotonic()
        with self._lock:
            return any(
                w.done_at is None and now - w.started <= GIVE_UP_S for w in self._by_addr.values()
            )

    def warmed(self) -> int:
        """Prefills whose every rank accepted the warm-up registration (linked and warmed)."""
        with self._lock:
            return sum(
                1
                for w in self._by_addr.values()
                if w.endpoints and w.linked == w.endpoints and not w.stale
            )

    def linked(self) -> set[Endpoint]:
        """Prefill ranks a current warm-up linked: under DP attention that is every DP
        group, while SGLang caches routes only to the groups its requests went to so far."""
        with self._lock:
            return {ep for w in self._by_addr.values() if not w.stale for ep in w.linked}

    def replied(self, endpoint: Endpoint, accepted: bool) -> None:
        """A prefill rank answered a registration (accepted or not: either ends the wait;
        so does a registration that could not be sent)."""
        with self._lock:
            for addr, w in self._by_addr.items():
                if endpoint in w.waiting:
                    w.waiting.discard(endpoint)
                    if accepted:
                        w.linked.add(endpoint)
                    if not w.waiting and w.done_at is None:
                        w.done_at = time.monotonic()
                        logger.info(
                            "sgl-nixl: prefill %s: %d of %d ranks linked and warmed in %.0f ms",
                            addr,
                            len(w.linked),
                            len(w.endpoints),
                            (w.done_at - w.started) * 1e3,
                        )

    def forget(self, endpoint: Endpoint) -> None:
        """A prefill rank was lost, restarted or refused this decode: its prefill is warmed
        again at the next ``start``; until then its warm-up counts as ended (``ready``), so
        a caller waiting for it goes on and its requests report what happened."""
        now = time.monotonic()
        with self._lock:
            for w in self._by_addr.values():
                if endpoint in w.endpoints:
                    w.stale = True
                    w.waiting.clear()
                    w.done_at = w.done_at or now

    def _run(self, addr: str, w: _Warming, table: Any, info: Any = None) -> None:
        """``table``: the route table's answer, or ``_UNASKED``; ``info``: the prefill's
        parallel info, if already worked out."""
        try:
            if table is _UNASKED:
                table = self._ask_table(addr, w)
            endpoints = self._endpoints(addr, w, table, info)
        except Exception as exc:  # a warm-up must never take the decode down
            logger.debug("sgl-nixl: warm-up of prefill %s: %s", addr, exc)
            endpoints = None
        with self._lock:
            w.resolving = False
            w.table_done = True
            self._lock.notify_all()
            if not endpoints:
                w.done_at = time.monotonic()  # nothing to wait for: requests register
                # no parallel info yet (the prefill is not up): warm it at the next start
                w.stale = w.stale or self._info(addr) is None
                return
            w.endpoints, w.waiting = frozenset(endpoints), set(endpoints)
        frames = self._registration(w.request_waits)
        for ep in sorted(endpoints):
            if not self._send(ep, frames):
                self.replied(ep, False)  # logged by the transport; the requests try again

    def _ask_table(self, addr: str, w: _Warming) -> bootstrap_client.RouteTable | None:
        """The bootstrap's route table (None: it has none), its topology kept for SGLang's
        query."""
        table = None
        try:
            table = bootstrap_client.get_routes(addr, self._secret)
            return table
        finally:  # answered or not: SGLang's query stops waiting for it
            with self._lock:
                w.topology = table.info if table is not None else None
                w.table_done = True
                self._lock.notify_all()

    def _endpoints(
        self, addr: str, w: _Warming, table: bootstrap_client.RouteTable | None, info: Any
    ) -> set[Endpoint] | None:
        """The prefill ranks this decode's requests to ``addr`` can go to; each route is
        kept on ``w`` under its query as it comes in."""
        if info is None:
            info = self._parallel_info(addr, w, table)
        if info is None:
            return None
        tps = [t for t in (info.target_tp_ranks or [info.target_tp_rank]) if t is not None]
        cps = list(info.target_cp_ranks or [0])
        pps = list(info.target_pp_ranks or [0])
        dps = range(max(1, int(info.dp_size or 1)))
        if not tps or len(dps) * len(cps) * len(tps) * len(pps) > MAX_RANKS:
            return None
        queries = [
            bootstrap_client.route_query(dp, cp, tp, pp)
            for dp in dps
            for cp in cps
            for tp in tps
            for pp in pps
        ]
        if table is not None and not table.routes:
            return None  # refused or unreachable (logged): the requests ask for themselves
        routes = table.routes if table is not None else {}
        out: set[Endpoint] = set()
        for query in queries:
            route = routes.get(query) or bootstrap_client.get_route(addr, query, self._secret)
            if route is None:
                return None
            with self._lock:
                w.routes[query] = route
                self._lock.notify_all()
            out.add((str(route["rank_ip"]), int(route["rank_port"])))
        return out

    def _parallel_info(
        self,
        addr: str,
        w: _Warming,
        table: bootstrap_client.RouteTable | None,
        wait: bool = True,
    ) -> Any:
        """The prefill's parallel info with this decode's rank mapping: SGLang's, if it has
        it (a warm-up started again); else SGLang's mapping of the table's copy; else
        (a bootstrap without one) SGLang's, once its query ends (``wait``). None: no info."""
        info = self._info(addr)
        if info is None and table is not None and table.info is not None and self._resolve:
            info = self._resolve(table.info)
        if info is None and wait:
            with self._lock:
                self._lock.wait_for(lambda: w.info_done, ROUTE_WAIT_S + 1)
            info = self._info(addr)
        return info


#: Seconds between looks at a named prefill that is not up yet, at first and at most.
PROBE_FIRST_S = 0.05
PROBE_MAX_S = 2.0


class StartupRegistration:
    """Registers a decode with the prefills named at start-up, each once it is up.

    ``up(addr)`` is a quiet look at the prefill's bootstrap; ``ensure(addr)`` is SGLang's
    ``try_ensure_parallel_info`` through our manager, which starts that prefill's warm-up.
    A prefill SGLang refuses (its checks raise: page size, KV dtype, layout) is logged and
    left to the requests, which fail with SGLang's reason. One daemon thread; ``stop``
    ends it within one probe interval.
    """

    def __init__(
        self, addrs: tuple[str, ...], up: Callable[[str], bool], ensure: Callable[[str], bool]
    ) -> None:
        self.addrs = addrs
        self._up, self._ensure = up, ensure
        self._stop = threading.Event()
        self.registered: list[str] = []
        self.refused: dict[str, str] = {}
        self.thread = threading.Thread(target=self._run, name="sgl-nixl-startup", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        todo, delay = list(self.addrs), PROBE_FIRST_S
        started = time.monotonic()
        while todo and not self._stop.is_set():
            for addr in list(todo):
                outcome = self._try(addr)
                if outcome is not None:
                    todo.remove(addr)
                    if outcome:
                        self.registered.append(addr)
                        logger.info(
                            "sgl-nixl: prefill %s (named in SGLANG_NIXL_PLUGIN_PREFILLS) is up "
                            "%.1f s after start: registering with its ranks",
                            addr,
                            time.monotonic() - started,
                        )
            if todo:
                self._stop.wait(delay)
                delay = min(delay * 2, PROBE_MAX_S)

    def _try(self, addr: str) -> bool | None:
        """True: registering; False: refused (logged); None: not up yet."""
        try:
            if not self._up(addr) or not self._ensure(addr):
                return None
        except Exception as exc:  # SGLang's checks of the prefill's parallel info
            self.refused[addr] = str(exc)
            logger.error(
                "sgl-nixl: prefill %s (named in SGLANG_NIXL_PLUGIN_PREFILLS) does not match "
                "this decode: %s; its requests will fail the same way until both servers "
                "agree",
                addr,
                exc,
            )
            return False
        return True
