"""Ports for the processes a bench or test session starts, on 127.0.0.1.

A port is chosen here and bound only later by the process it is given to (a bench rank's
bootstrap server after its imports, a real server after a minute), so a pick must not be
one that something else takes meanwhile: picks come from below the kernel's ephemeral
range (where every ``bind(0)``, ZMQ's and NIXL's random ports included, lands) and outside
SGLang's own random range, and one process never hands out the same port twice.
"""

from __future__ import annotations

import os
import random
import socket
from contextlib import ExitStack
from pathlib import Path


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_SGLANG_RANDOM_PORTS = range(22000, 30000)
#: Ports this process handed out: a server binds its port only once it has started (a minute
#: on this host), so a later pick found the same port still free and two servers of one
#: stack were given it (seen in CI: the prefill's HTTP port was the decode's). Its own
#: generator, too: a library seeding Python's global one repeats the same picks.
_HANDED_OUT: set[int] = set()
_RNG = random.Random()


def _share() -> tuple[int, int]:
    """(index, count) of this process among the test workers pytest-xdist runs at once
    (inherited by the processes they start), else (0, 1). Each takes only ports of its own
    residue modulo ``count``: two workers' sessions picked the same bootstrap port in one
    CI run, and a decode of one registered with the other's prefill."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        index = int(worker.removeprefix("gw"))
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    except ValueError:
        return 0, 1
    return (index, count) if 0 <= index < count else (0, 1)


def free_port() -> int:
    """One port, as :func:`free_ports`."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago and were never
    handed out before in this process, from below the
    kernel's ephemeral range: the servers bind many random ports of their own (ZMQ, NIXL,
    gloo) while they start, and one of those taking a port chosen here made a server fail
    with "address already in use" (seen in CI). SGLang's own random range (its scheduler's
    TCPStore port, 22000-29999: ``get_free_port_below_ephemeral``) is left out: a server's
    TCPStore once took the HTTP port chosen here for that server."""
    low = _ephemeral_low()
    index, count = _share()
    ours = [
        p
        for p in range(max(1024, low - 12000), low)
        if p % count == index and p not in _SGLANG_RANDOM_PORTS and p not in _HANDED_OUT
    ]
    candidates = _RNG.sample(ours, min(2000, len(ours)))
    with ExitStack() as stack:
        ports = []
        for port in candidates:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                _HANDED_OUT.update(ports)
                return ports
    raise RuntimeError(f"no {n} free ports below {low}")
