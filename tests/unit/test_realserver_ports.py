"""The real-server stage's port picks: one process never hands out a port twice.

A server binds its HTTP port only once it has started (about a minute on CI's host), so
a second pick made meanwhile found the first server's port still free; and a library that
seeds Python's global random generator made the picks repeat. In CI a prefill and its
decode were both given one port, and the prefill exited with "address already in use".
"""

from __future__ import annotations

import random

from realserver.procs import free_ports


def test_ports_are_never_handed_out_twice_even_with_the_global_generator_reseeded() -> None:
    picks = []
    for _ in range(5):
        random.seed(1234)  # as a library seeding the global generator between picks
        picks += free_ports(2)
    assert len(set(picks)) == len(picks), picks


def test_parallel_test_workers_pick_from_disjoint_ports(monkeypatch) -> None:
    """Each pytest-xdist worker (and what it starts) picks only its residue of ports: two
    workers' sessions once picked one bootstrap port, and a decode of one registered with
    the other's prefill."""
    picks: dict[int, set[int]] = {}
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
        picks[index] = set(free_ports(20))
    assert all(p % 3 == i for i, ports in picks.items() for p in ports), picks
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "master")  # not a worker: every port
    assert len(free_ports(5)) == 5
