"""The bootstrap server (in the prefill's main process): SGLang's routes, hardened.

Same routes and answers as SGLang's common server, plus: bodies are validated against a
schema (a malformed one is a 400 that says what is wrong, never a 500 with a traceback);
bodies are size-capped; readiness counts distinct ranks, so repeated registrations can't
fake it; and with a shared secret, registering a rank, learning a rank's address and
mapping rooms to DP ranks need a valid signature (``wire.http_auth``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Annotated, Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.settings import read_secret
from sgl_nixl_plugin.transport.bootstrap_client import ROUTES_PATH
from sgl_nixl_plugin.wire.http_auth import HEADER, verify

logger = logging.getLogger(__name__)

MAX_BODY = 64 << 10
#: The query keys of SGLang's topology query (each -1): its decode's first look at a prefill.
TOPOLOGY_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
Rank = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class RoutePut(msgspec.Struct):
    """The body of PUT /route (extra keys are accepted, as SGLang adds them over time)."""

    attn_tp_size: Size
    attn_tp_rank: Rank
    attn_cp_size: Size
    attn_cp_rank: Rank
    attn_dp_size: Size
    attn_dp_rank: Rank
    pp_size: Size
    pp_rank: Rank
    system_dp_size: Size
    system_dp_rank: Rank
    rank_ip: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    rank_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    page_size: Size
    kv_cache_dtype: str | None = None
    # Optional keys SGLang's handler converts with int(): typed, so a bad one is a 400.
    prefill_http_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None


class RegisterDpRank(msgspec.Struct):
    bootstrap_room: Annotated[int, msgspec.Meta(ge=0)]
    dp_rank: Rank


class QueryDpRanks(msgspec.Struct):
    bootstrap_rooms: Annotated[list[int], msgspec.Meta(max_length=65536)]


SCHEMAS: dict[tuple[str, str], type] = {
    ("PUT", "/route"): RoutePut,
    ("POST", "/register_dp_rank"): RegisterDpRank,
    ("POST", "/query_dp_ranks"): QueryDpRanks,
}


def _needs_auth(request: web.Request) -> bool:
    if request.path == ROUTES_PATH:
        return True  # it names every rank's address
    if request.path == "/route":
        if request.method != "GET":
            return True
        # The aggregate topology query (-1 everywhere) names no address: left open.
        return any(
            request.query.get(k) != "-1"
            for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        )
    return request.path == "/register_dp_rank"


def _is_topology_query(request: web.Request) -> bool:
    return request.path == "/route" and not _needs_auth(request)


def _without_page_size(response: web.StreamResponse) -> web.StreamResponse:
    """The topology answer without the prefill's page size. SGLang's decode refuses any
    page-size difference from it by raising in its scheduler (the whole decode server
    stops); our prefill pairs tokens across page sizes instead and checks the rest at
    registration, where a refusal fails requests, not servers. SGLang skips its check when
    the size is unknown (null)."""
    body = getattr(response, "body", None)
    if not isinstance(body, bytes | bytearray):
        return response
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return response
    if not isinstance(data, dict) or data.get("page_size") is None:
        return response
    data["page_size"] = None
    return web.json_response(data, status=response.status)


class ServerLog(logging.LoggerAdapter):
    """The logger of the bootstrap's aiohttp request handlers. aiohttp logs a request it
    cannot parse (broken framing, or not HTTP at all) from below our handlers: with a
    traceback, or, for bytes that are not HTTP at all, at DEBUG, which a server's INFO level
    never creates. Here each such refusal is counted and logged in one WARNING line, like
    every other refusal, whatever the level. Everything else goes to ``aiohttp.server``
    unchanged."""

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            metrics.rejected("http_bad_framing")
            peer = args[0] if args else "?"
            self.logger.warning(
                "sgl-nixl bootstrap: %d for a malformed HTTP request from %s: %s",
                exc.code,
                peer,
                str(exc.message).splitlines()[0][:200],
            )
            return
        super().log(level, msg, *args, **kwargs)


_SERVER_LOG = ServerLog(logging.getLogger("aiohttp.server"), {})


class NixlPluginKVBootstrapServer(CommonKVBootstrapServer):
    def _setup_routes(self) -> None:
        self.secret = read_secret()
        self.app = web.Application(
            client_max_size=MAX_BODY,
            middlewares=[self._guard],
            handler_args={"logger": _SERVER_LOG},
        )
        super()._setup_routes()
        self.app.router.add_get(ROUTES_PATH, self._handle_routes)

    async def _handle_routes(self, request: web.Request) -> web.Response:
        """Every rank's route in one answer, once all are registered, with the prefill's
        parallel info (``info``: SGLang's topology answer, as its decode gets it): a decode
        learning this prefill asks once instead of once per rank, and can register with the
        ranks its requests go to while SGLang's own topology query is still on its way
        (SGLang's per-rank ``/route`` queries stay for its decode and older releases of
        ours)."""
        if not self._is_ready():
            return web.Response(status=503, text="Prefill server not fully registered yet")
        info = await self._topology()
        async with self.lock:
            ranks = [
                {"dp": dp, "cp": cp, "tp": tp, "pp": pp, "rank_ip": r.rank_ip,
                 "rank_port": int(r.rank_port)}
                for dp, cps in self.prefill_port_table.items()
                for cp, tps in cps.items()
                for tp, pps in tps.items()
                for pp, r in pps.items()
            ]  # fmt: skip
        return web.json_response({"ranks": ranks, "info": info})

    async def _topology(self) -> dict[str, Any] | None:
        """SGLang's answer to its topology query (``/route`` with every rank -1), from its
        own handler, as the decode gets it (no page size); None if that handler is gone or
        fails here (the decode's warm-up then waits for SGLang's own query)."""
        handler = getattr(self, "_handle_route_get", None)
        if handler is None:
            return None
        query = dict.fromkeys(TOPOLOGY_QUERY, "-1")
        try:
            response = _without_page_size(await handler(SimpleNamespace(query=query)))
        except Exception as exc:  # another release's handler reads more of the request
            logger.debug("sgl-nixl bootstrap: topology for the route table: %r", exc)
            return None
        body = getattr(response, "body", None)
        if response.status != 200 or not isinstance(body, bytes | bytearray):
            return None
        data = msgspec.json.decode(body)
        return data if isinstance(data, dict) else None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(request, 413, "too_large", f"body larger than {MAX_BODY} bytes")
        if self.secret and _needs_auth(request):
            problem = verify(
                self.secret, request.method, request.path_qs, body, request.headers.get(HEADER)
            )
            if problem:
                return self._refuse(request, 401, "unauthenticated", problem)
        schema = SCHEMAS.get((request.method, request.path))
        if schema is not None:
            try:
                data = msgspec.json.decode(body, type=schema)
            except msgspec.DecodeError as exc:
                return self._refuse(request, 400, "malformed", f"invalid body: {exc}")
            if isinstance(data, RoutePut) and (problem := self._inconsistent(data)):
                return self._refuse(request, 400, "inconsistent", problem)
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if 400 <= exc.status < 500:  # unknown route or wrong method: count the probe too
                self._note_refusal(request, exc.status, str(exc.status), exc.text or exc.reason)
            raise
        except (KeyError, ValueError, TypeError) as exc:
            return self._refuse(request, 400, "malformed", f"invalid request: {exc!r}")
        except Exception:
            logger.exception(
                "sgl-nixl bootstrap: error serving %s %s", request.method, request.path
            )
            return web.Response(status=500, text="internal error (see the server log)")
        if 400 <= response.status < 500:  # SGLang's own refusals (missing inputs, unknown rank)
            text = getattr(response, "text", None) or response.reason
            self._note_refusal(request, response.status, str(response.status), text)
        if response.status == 200 and request.method == "GET" and _is_topology_query(request):
            return _without_page_size(response)
        return response

    def _refuse(self, request: web.Request, status: int, reason: str, text: str) -> web.Response:
        self._note_refusal(request, status, reason, text)
        return web.Response(status=status, text=text)

    @staticmethod
    def _note_refusal(request: web.Request, status: int, reason: str, text: str) -> None:
        """Every refused request is counted and leaves one line, whoever refused it."""
        metrics.rejected(f"http_{reason}")
        logger.warning(
            "sgl-nixl bootstrap: %d for %s %s from %s: %s",
            status,
            request.method,
            request.path,
            request.remote,
            text.splitlines()[0][:200] if text else "",
        )

    def _inconsistent(self, d: RoutePut) -> str:
        """A rank whose topology contradicts the ranks already registered."""
        dp_size = d.attn_dp_size if d.system_dp_size == 1 else d.system_dp_size
        checks = {
            "attn_tp_size": (self.attn_tp_size, d.attn_tp_size),
            "attn_cp_size": (self.attn_cp_size, d.attn_cp_size),
            "pp_size": (self.pp_size, d.pp_size),
            "page_size": (self.page_size, d.page_size),
            "dp_size": (self.dp_size, dp_size),
        }
        bad = [
            f"{k}={new} (registered: {old})"
            for k, (old, new) in checks.items()
            if old is not None and old != new
        ]
        # Readiness counts distinct ranks: one outside its size would fake a missing rank.
        ranks = {
            "attn_tp_rank": (d.attn_tp_rank, d.attn_tp_size),
            "attn_cp_rank": (d.attn_cp_rank, d.attn_cp_size),
            "attn_dp_rank": (d.attn_dp_rank, d.attn_dp_size),
            "pp_rank": (d.pp_rank, d.pp_size),
        }
        if d.system_dp_size > 1:
            # at one system DP rank SGLang files ranks by attention DP rank and ignores
            # this one, which DP attention sets to the attention DP rank
            ranks["system_dp_rank"] = (d.system_dp_rank, d.system_dp_size)
        bad += [
            f"{k}={rank} is not smaller than its size {size}"
            for k, (rank, size) in ranks.items()
            if rank >= size
        ]
        return (
            ("topology differs from the ranks already registered: " + ", ".join(bad)) if bad else ""
        )

    def close(self) -> None:
        """Stop the server thread; safe even before its event loop has started."""
        if getattr(self, "_loop", None) is None:
            self._loop = None  # SGLang's close() reads it; the thread will find no loop to run
        super().close()

    def _is_ready(self) -> bool:
        if None in (self.attn_tp_size, self.attn_cp_size, self.pp_size, self.dp_size):
            return False
        expected = self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size
        distinct = sum(
            len(pp)
            for dp in self.prefill_port_table.values()
            for cp in dp.values()
            for pp in cp.values()
        )
        return distinct >= expected
