"""The signed HTTP calls to SGLang's bootstrap server (transport only: no policy).

Each request is signed with the shared secret when one is configured (``wire.http_auth``);
our bootstrap server refuses unsigned ones then. Failures are logged and reported to the
caller, never raised into a scheduler thread.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import requests

from sgl_nixl_plugin.wire.http_auth import sign

logger = logging.getLogger(__name__)

TIMEOUT_S = 5
ATTEMPTS = 5


def put_route(url: str, payload: dict, secret: bytes | None) -> bool:
    """Advertise a prefill rank (PUT /route), retried with backoff; whether it took."""
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
    headers = {
        "Content-Type": "application/json",
        **sign(secret, "POST", "/register_dp_rank", body),
    }
    try:
        r = requests.post(
            f"http://{server}/register_dp_rank", data=body, headers=headers, timeout=TIMEOUT_S
        )
    except requests.RequestException as exc:
        logger.error("sgl-nixl: room %s: register_dp_rank failed: %s", room, exc)
        return False
    if r.status_code != 200:
        logger.error("sgl-nixl: room %s: register_dp_rank refused: %s", room, r.text[:300])
        return False
    return True


#: SGLang's query for a prefill's parallel info: it answers once every prefill rank is up.
ALL_RANKS = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def prefill_up(server: str, secret: bytes | None, timeout_s: float = 1.0) -> bool:
    """Whether the bootstrap at ``server`` has every prefill rank; quiet (SGLang's own
    query logs an ERROR each time a prefill is not up yet)."""
    path = f"/route?{ALL_RANKS}"
    try:
        r = requests.get(
            f"http://{server}{path}", headers=sign(secret, "GET", path), timeout=timeout_s
        )
    except requests.RequestException:
        return False
    return r.status_code == 200


def route_query(dp: int, cp: int, tp: int, pp: int) -> str:
    """The query naming one prefill rank (the warm-up's and the receivers' alike)."""
    return f"prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"


def get_route(server: str, query: str, secret: bytes | None) -> dict[str, Any] | None:
    """A prefill rank's address (GET /route?...), or None (logged)."""
    path = f"/route?{query}"
    try:
        r = requests.get(
            f"http://{server}{path}", headers=sign(secret, "GET", path), timeout=TIMEOUT_S
        )
    except requests.RequestException as exc:
        logger.error("sgl-nixl: bootstrap %s unreachable: %s", server, exc)
        return None
    if r.status_code != 200:
        logger.error(
            "sgl-nixl: bootstrap %s refused the rank query (HTTP %d): %s",
            server,
            r.status_code,
            r.text[:300],
        )
        return None
    return r.json()
