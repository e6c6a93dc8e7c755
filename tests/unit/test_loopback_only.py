"""The guard that keeps tests on this host (``helpers.loopback_only``)."""

from __future__ import annotations

import http.client
import socket

import pytest
from helpers.loopback_only import OffHostConnect, allowed


def test_a_connect_to_another_host_fails_before_any_packet():
    with socket.socket() as s, pytest.raises(OffHostConnect, match="10.0.0.1:9"):
        s.connect(("10.0.0.1", 9))
    with socket.socket() as s, pytest.raises(OffHostConnect):
        s.connect_ex(("192.0.2.7", 53))
    conn = http.client.HTTPConnection("10.0.0.1", 20884, timeout=1)
    with pytest.raises(OffHostConnect):
        conn.request("PUT", "/route", body=b"{}")


def test_a_udp_connect_which_sends_nothing_is_allowed():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.7", 80))  # TEST-NET-1, and a UDP connect sends nothing
        except OSError:
            pass  # a host without a route: refused by the kernel, not by the guard


def test_loopback_and_the_netns_test_hosts_are_allowed():
    assert allowed("127.0.0.1") and allowed("::1") and allowed("10.250.0.2")
    assert not allowed("10.0.0.1") and not allowed("10.250.1.1") and not allowed("fe80::1")
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.socket() as s:
        s.connect(srv.getsockname())
        conn, _ = srv.accept()
        conn.close()
