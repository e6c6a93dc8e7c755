"""Tests talk only to this host: a connect to any other address fails before a packet.

Tests start servers on 127.0.0.1 (or on the test hosts of network namespaces a test
creates, ``helpers.faults.netns_pair``) and must send nothing anywhere else. A code path
that stops honouring a test's stand-in (a mocked ``requests.put``, say) would otherwise
reach out to whatever address the test made up. This guard wraps Python's
``socket.connect`` of TCP sockets in the pytest process; the rank processes and C
libraries (ZMQ, UCX) are not covered.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

import pytest

#: The test hosts ``netns_pair`` puts inside its namespaces.
NETNS_TEST_NET = ipaddress.ip_network("10.250.0.0/24")


class OffHostConnect(AssertionError):
    """A test tried to connect to another host."""


def allowed(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    return ip.is_loopback or ip in NETNS_TEST_NET


def _check(sock: socket.socket, address: Any) -> None:
    # TCP only: connecting a UDP socket sends nothing (``doctor`` uses one to learn the
    # address outbound traffic would leave from)
    inet = sock.family in (socket.AF_INET, socket.AF_INET6)
    if inet and sock.type == socket.SOCK_STREAM and not allowed(str(address[0])):
        raise OffHostConnect(
            f"a test tried to connect to {address[0]}:{address[1]}: tests talk only to "
            "127.0.0.1 (or to netns test hosts)"
        )


@pytest.fixture(scope="session", autouse=True)
def _loopback_only() -> Iterator[None]:
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def connect(self: socket.socket, address: Any) -> None:
        _check(self, address)
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        _check(self, address)
        return real_connect_ex(self, address)

    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "connect", connect)
    mp.setattr(socket.socket, "connect_ex", connect_ex)
    try:
        yield
    finally:
        mp.undo()
