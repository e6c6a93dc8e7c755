"""Fixtures of the upstream ports: one in-process cluster for the session, fresh rooms and
fake peers per test (see ``_harness``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ._harness import OUR_PACKAGE, Cluster, FakeRank, wait_for


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        for kind in ("manager", "sender", "receiver", "bootstrap_server"):
            cls = c.classes[kind]
            assert cls.__module__.startswith(OUR_PACKAGE), (kind, cls.__module__)
        yield c
    finally:
        c.close()
    # Every thread the managers and the bootstrap server started has ended.
    wait_for(lambda: not c.leftover_threads(), 15, f"threads to end: {c.leftover_threads()}")


@pytest.fixture
def rooms(cluster: Cluster) -> Iterator[Callable[[], int]]:
    """Hands out fresh bootstrap rooms; afterwards wipes what they left in both managers."""
    taken: list[int] = []

    def take() -> int:
        taken.append(cluster.new_room())
        return taken[-1]

    yield take
    for room in taken:
        cluster.forget(room)


@pytest.fixture
def fake_rank() -> Iterator[Callable[[str], FakeRank]]:
    """Makes peers that speak our wire (closed after the test)."""
    made: list[FakeRank] = []

    def make(name: str = "fake") -> FakeRank:
        made.append(FakeRank(f"{name}-{len(made)}"))
        return made[-1]

    yield make
    for rank in made:
        rank.close()
