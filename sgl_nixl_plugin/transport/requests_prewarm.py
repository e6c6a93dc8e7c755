"""SGLang's first bootstrap query, paid at start-up.

SGLang's decode asks a prefill's bootstrap for its parallel info through ``requests``
(``try_ensure_parallel_info``), at the first request that names that prefill. The first
``requests`` call of a process costs ~2.5 ms more than later ones on the 2-core host
(imports, proxy and netrc lookups, code run for the first time), and that call sits inside
the user's first request. Here the decode makes one such call at start-up, to a one-shot
listener of its own on 127.0.0.1 (no proxy: nothing leaves the host).
"""

from __future__ import annotations

import logging
import socket
import threading
import time

logger = logging.getLogger(__name__)

TIMEOUT_S = 2.0
_ANSWER = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    b"Connection: close\r\n\r\n{}"
)


def pay_first_call() -> float | None:
    """One ``requests`` GET to a listener of this process; its milliseconds, or None when
    it failed (logged at DEBUG: nothing else depends on it)."""
    started = time.perf_counter()
    try:
        import requests

        with socket.create_server(("127.0.0.1", 0)) as srv:
            srv.settimeout(TIMEOUT_S)
            port = srv.getsockname()[1]
            answerer = threading.Thread(
                target=_answer_once, args=(srv,), name="sgl-nixl-http-prewarm", daemon=True
            )
            answerer.start()
            r = requests.get(
                f"http://127.0.0.1:{port}/route?prefill_dp_rank=-1",
                timeout=TIMEOUT_S,
                proxies={"http": None},  # an HTTP_PROXY must not see this
            )
            r.json()
            answerer.join(TIMEOUT_S)
    except Exception as exc:
        logger.debug("sgl-nixl: the start-up HTTP call failed: %r", exc)
        return None
    return (time.perf_counter() - started) * 1e3


def _answer_once(srv: socket.socket) -> None:
    try:
        conn, _ = srv.accept()
        with conn:
            conn.settimeout(TIMEOUT_S)
            conn.recv(1 << 16)
            conn.sendall(_ANSWER)
    except OSError as exc:
        logger.debug("sgl-nixl: the start-up HTTP listener: %r", exc)
