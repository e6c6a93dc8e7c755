"""The signed HTTP calls to SGLang's bootstrap server (transport only: no policy).

Each request is signed with the shared secret when one is configured (``wire.http_auth``);
our bootstrap server refuses unsigned ones then. Failures are logged and reported to the
caller, never raised into a scheduler thread.

The queries use the standard library's ``http.client``, one connection each: a GET costs
~0.13 ms of CPU against ~0.7 ms through ``requests`` (its session, adapters and proxy
lookup). The decode's first request to a prefill waits for these queries, and a thread that
makes them holds the GIL from the scheduler meanwhile. A prefill rank's start-up
registration (``put_route``) stays on ``requests``.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any, NamedTuple

import requests

from sgl_nixl_plugin.wire.http_auth import sign

logger = logging.getLogger(__name__)

TIMEOUT_S = 5
ATTEMPTS = 5
#: The largest answer read (a route table of 64 ranks is ~5 KiB).
MAX_ANSWER = 1 << 20
#: Our bootstrap's answer with every rank's route at once (``adapter.bootstrap``).
ROUTES_PATH = "/nixl/routes"


class Answer:
    """An HTTP answer: its status and body."""

    __slots__ = ("status", "body")

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


def call(
    method: str,
    server: str,
    path: str,
    secret: bytes | None,
    body: bytes = b"",
    timeout_s: float = TIMEOUT_S,
) -> Answer:
    """One signed request to ``server`` (``host:port``; an IPv6 host in brackets). Raises
    ``OSError`` or ``http.client.HTTPException`` when there is no answer."""
    host, _, port = server.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    headers = sign(secret, method, path, body)
    if body:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body or None, headers=headers)
        r = conn.getresponse()
        return Answer(r.status, r.read(MAX_ANSWER))
    finally:
        conn.close()


NO_ANSWER = (OSError, http.client.HTTPException, ValueError)


def put_route(url: str, payload: dict, secret: bytes | None) -> bool:
    """Advertise a prefill rank (PUT /route), retried with backoff; whether it took. Once
    per rank at start-up: through ``requests``, as SGLang's own registration (its retry
    behaviour is tested against SGLang's, with ``requests.put`` replaced)."""
    body = json.dumps(payload).encode()
    path = "/" + url.split("/", 3)[3]
    headers = {"Content-Type": "application/json", **sign(secret, "PUT", path, body)}
    delay, problem = 0.5, ""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            r = requests.put(url, data=body, headers=headers, timeout=TIMEOUT_S)
            if r.status_code == 200:
                return True
            problem = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code in (400, 401, 413):
                break  # retrying a refused registration can't help
        except Exception as exc:  # never take the scheduler down: SGLang's own code doesn't
            problem = f"{type(exc).__name__}: {exc}"
        logger.warning(
            "sgl-nixl: bootstrap registration attempt %d/%d failed: %s", attempt, ATTEMPTS, problem
        )
        if attempt < ATTEMPTS:
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
    logger.error(
        "sgl-nixl: this prefill rank could not register with the bootstrap server at %s: %s",
        url,
        problem,
    )
    return False


def post_dp_rank(server: str, room: int, dp_rank: int, secret: bytes | None) -> bool:
    """Tell the bootstrap server which DP rank serves ``room`` (POST /register_dp_rank)."""
    body = json.dumps({"bootstrap_room": room, "dp_rank": dp_rank}).encode()
    try:
        r = call("POST", server, "/register_dp_rank", secret, body)
    except NO_ANSWER as exc:
        logger.error("sgl-nixl: room %s: register_dp_rank failed: %s", room, exc)
        return False
    if r.status != 200:
        logger.error("sgl-nixl: room %s: register_dp_rank refused: %s", room, r.text[:300])
        return False
    return True


#: SGLang's query for a prefill's parallel info: it answers once every prefill rank is up.
ALL_RANKS = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def prefill_up(server: str, secret: bytes | None, timeout_s: float = 1.0) -> bool:
    """Whether the bootstrap at ``server`` has every prefill rank; quiet (SGLang's own
    query logs an ERROR each time a prefill is not up yet)."""
    try:
        return call("GET", server, f"/route?{ALL_RANKS}", secret, timeout_s=timeout_s).status == 200
    except NO_ANSWER:
        return False


def route_query(dp: int, cp: int, tp: int, pp: int) -> str:
    """The query naming one prefill rank (the warm-up's and the receivers' alike)."""
    return f"prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"


def get_route(server: str, query: str, secret: bytes | None) -> dict[str, Any] | None:
    """A prefill rank's address (GET /route?...), or None (logged)."""
    try:
        r = call("GET", server, f"/route?{query}", secret)
    except NO_ANSWER as exc:
        logger.error("sgl-nixl: bootstrap %s unreachable: %s", server, exc)
        return None
    if r.status != 200:
        logger.error(
            "sgl-nixl: bootstrap %s refused the rank query (HTTP %d): %s",
            server,
            r.status,
            r.text[:300],
        )
        return None
    return _route(r)


class RouteTable(NamedTuple):
    """Our bootstrap's answer to ``ROUTES_PATH``: each rank's route under its
    ``route_query``, and the prefill's parallel info as SGLang's topology query gets it
    (None from a release that sends none)."""

    routes: dict[str, dict[str, Any]]
    info: dict[str, Any] | None = None


def get_routes(server: str, secret: bytes | None) -> RouteTable | None:
    """Every rank's route in one answer (GET /nixl/routes). None when the server has no
    such table (404: SGLang's, or an older release of ours): ask rank by rank. Any other
    failure is logged and gives a table without routes."""
    try:
        r = call("GET", server, ROUTES_PATH, secret)
    except NO_ANSWER as exc:
        logger.error("sgl-nixl: bootstrap %s unreachable: %s", server, exc)
        return RouteTable({})
    if r.status == 404:
        return None
    if r.status != 200:
        logger.error(
            "sgl-nixl: bootstrap %s refused the route table query (HTTP %d): %s",
            server,
            r.status,
            r.text[:300],
        )
        return RouteTable({})
    try:
        answer = r.json()
        routes = {
            route_query(int(x["dp"]), int(x["cp"]), int(x["tp"]), int(x["pp"])): {
                "rank_ip": str(x["rank_ip"]),
                "rank_port": int(x["rank_port"]),
            }
            for x in answer["ranks"]
        }
    except (ValueError, KeyError, TypeError) as exc:
        logger.error("sgl-nixl: bootstrap %s: malformed route table: %r", server, exc)
        return RouteTable({})
    info = answer.get("info")
    return RouteTable(routes, info if isinstance(info, dict) else None)


def _route(r: Answer) -> dict[str, Any] | None:
    try:
        route = r.json()
    except ValueError:
        route = None
    if not isinstance(route, dict):
        logger.error("sgl-nixl: the bootstrap's rank answer is not an object: %s", r.text[:300])
        return None
    return route
