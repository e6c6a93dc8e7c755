"""SGLang's first look at a prefill, answered from our route table.

A learned decode's first request waits for SGLang's topology query of the prefill
(``try_ensure_parallel_info``: one ``requests`` GET of ``/route`` with every rank -1). Our
warm-up asks the prefill's bootstrap for its route table at the same moment, and that table
carries SGLang's own answer to that query (``adapter.bootstrap``). Two GETs to one server
at once, on a busy host, cost the request 3-8 ms; here SGLang's query is answered from the
table instead, and SGLang's own code does everything else with the answer (its checks of
page size, KV dtype and layout, its rank mapping, its cache).

How: SGLang's conn module reaches ``requests`` through a module global; ``install`` puts a
stand-in there that forwards every call to ``requests`` except a GET the calling thread was
told the answer to (``AnsweredQuery``). Nothing changes for other threads, other URLs or a
release whose module no longer uses ``requests`` (then nothing is installed and SGLang asks
for itself).
"""

from __future__ import annotations

import inspect
import json
import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from sgl_nixl_plugin.adapter.bootstrap import TOPOLOGY_QUERY

logger = logging.getLogger(__name__)


class _Answer:
    """What SGLang's query reads of a ``requests.Response``."""

    status_code = 200
    ok = True

    def __init__(self, data: dict[str, Any]) -> None:
        self.text = json.dumps(data)

    def json(self) -> Any:
        return json.loads(self.text)  # a fresh copy, as a response would give

    def raise_for_status(self) -> None:
        return None


class _Requests:
    """Stands in for the ``requests`` module: every attribute is the module's, except
    ``get`` of a topology query this thread was given the answer to."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def get(self, url: Any, *args: Any, **kwargs: Any) -> Any:
        pending = getattr(self._local, "answer", None)
        if pending is not None and _is_topology_query(str(url), pending[0]):
            self._local.answer = None  # one query, one answer
            return _Answer(pending[1])
        return self._real.get(url, *args, **kwargs)

    def answering(self, addr: str, data: dict[str, Any]) -> None:
        self._local.answer = (addr, data)

    def done(self) -> bool:
        """Clear this thread's answer; whether SGLang's query used it."""
        used = getattr(self._local, "answer", None) is None
        self._local.answer = None
        return used


def _is_topology_query(url: str, addr: str) -> bool:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    return (
        parts.netloc == addr
        and parts.path == "/route"
        and all(query.get(k) == "-1" for k in TOPOLOGY_QUERY)
    )


def install(query: Callable[..., Any]) -> _Requests | None:
    """Put the stand-in into the module that defines SGLang's ``query`` (once per module);
    None when that module does not reach ``requests`` through a global of that name."""
    module = inspect.getmodule(inspect.unwrap(query))
    current = getattr(module, "requests", None)
    if isinstance(current, _Requests):
        return current
    if module is None or current is None or getattr(current, "__name__", "") != "requests":
        logger.debug("sgl-nixl: SGLang's topology query does not go through requests here")
        return None
    stand_in = _Requests(current)
    module.requests = stand_in  # type: ignore[attr-defined]
    return stand_in


class AnsweredQuery:
    """SGLang's ``try_ensure_parallel_info`` for one decode manager: when SGLang has no info
    on the prefill yet and the warm-up's route table carried its topology answer
    (``topology(addr)``, which waits for the table while it is on its way), SGLang's query
    runs with that answer in place of its GET; otherwise as SGLang wrote it."""

    def __init__(
        self,
        query: Callable[[str], bool],
        cached: Callable[[str], Any],
        topology: Callable[[str], dict[str, Any] | None],
    ) -> None:
        """``cached(addr)``: SGLang's info on that prefill, None before its query got it."""
        self._query, self._cached, self._topology = query, cached, topology
        self._stand_in = install(query)
        self.answered = 0  # SGLang's queries answered from a route table

    def __call__(self, addr: str) -> bool:
        if self._stand_in is None or self._cached(addr) is not None:
            return self._query(addr)
        data = self._topology(addr)
        if data is None:
            return self._query(addr)
        self._stand_in.answering(addr, data)
        try:
            return self._query(addr)
        finally:
            if self._stand_in.done():
                self.answered += 1
                logger.debug(
                    "sgl-nixl: prefill %s: SGLang's first look answered from the route table",
                    addr,
                )
