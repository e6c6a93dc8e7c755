"""HMAC signatures for the bootstrap server's HTTP routes.

A signed request carries ``X-SGL-NIXL-Auth: <unix time>:<hex HMAC-SHA256>`` over the
method, the path with its query, the time and the body. Requests older (or newer) than
``max_skew_s`` are refused, which bounds replays.
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "X-SGL-NIXL-Auth"


def _mac(secret: bytes, method: str, path_qs: str, stamp: str, body: bytes) -> str:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (method.upper().encode(), path_qs.encode(), stamp.encode(), body):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.hexdigest()


def sign(secret: bytes | None, method: str, path_qs: str, body: bytes = b"") -> dict[str, str]:
    """Headers to add to a request (none without a secret)."""
    if not secret:
        return {}
    stamp = f"{time.time():.3f}"
    return {HEADER: f"{stamp}:{_mac(secret, method, path_qs, stamp, body)}"}


def verify(
    secret: bytes,
    method: str,
    path_qs: str,
    body: bytes,
    header: str | None,
    max_skew_s: float = 300.0,
) -> str:
    """'' if the signature is valid, else why not (for a 401 body and the log)."""
    if not header or ":" not in header:
        return f"missing {HEADER} header: this bootstrap server requires the shared secret"
    stamp, _, got = header.partition(":")
    try:
        age = abs(time.time() - float(stamp))
    except ValueError:
        return "malformed signature timestamp"
    if not age <= max_skew_s:
        return "signature expired (clock skew or replay)"
    if not hmac.compare_digest(got, _mac(secret, method, path_qs, stamp, body)):
        return "bad signature: the shared secrets differ"
    return ""
