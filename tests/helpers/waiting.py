"""The one bounded wait the tests use: poll a probe until a condition holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll_until(
    probe: Callable[[], Any],
    ok: Callable[[Any], bool] = bool,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "",
) -> tuple[Any, float]:
    """Call ``probe`` until ``ok(value)`` (bounded): returns (value, time.time() it held).

    Raises ``TimeoutError`` naming ``what`` (if given) and the last value. The sleep is the
    polling interval of a bounded wait, not synchronisation.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if ok(value):
            return value, time.time()
        if time.monotonic() > deadline:
            name = f" ({what})" if what else ""
            raise TimeoutError(f"condition{name} not met in {timeout:.1f}s; last value: {value!r}")
        time.sleep(interval)
