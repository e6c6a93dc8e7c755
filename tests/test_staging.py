"""The staging path on DRAM: planning, the path rule, slot backpressure, byte-exact pipelined
transfers between two real NIXL agents, and a failure in the middle of a transfer."""

from __future__ import annotations

import os
import time
from collections import deque

import numpy as np
import pytest

from sgl_nixl_plugin.engine.copy_kernels import make_copier
from sgl_nixl_plugin.engine.engine import Memory, TransferEngine
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.staging import (
    RemoteStaging,
    StagedSend,
    StagingBuffer,
    choose_path,
    plan_pieces,
    unit_indices_of,
)
from sgl_nixl_plugin.registry.spec import AgentConfig

pytestmark = pytest.mark.timeout(120)
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.mark.parametrize(
    "regions,units,unit_len,slot",
    [(64, 100, 64, 64 * 100 * 3), (8, 1000, 32, 32 * 300), (5, 7, 16, 16 * 7), (3, 1, 8, 8)],
)
def test_plan_pieces_cover_every_unit_once_within_a_slot(regions, units, unit_len, slot):
    pieces = plan_pieces(regions, units, unit_len, slot)
    seen = np.zeros((regions, units), dtype=int)
    for i, p in enumerate(pieces):
        assert p.index == i
        assert 0 < p.nbytes <= slot
        seen[p.r0 : p.r1, p.j0 : p.j1] += 1
    assert (seen == 1).all()


def test_plan_pieces_empty():
    assert plan_pieces(4, 0, 64, 1024) == []


def test_path_rule():
    kw = dict(nbytes=1 << 30, slot_bytes=256 << 20, staging_possible=True)
    # 524,288 small descriptors on a GPU: descriptor cost (~7 s) dwarfs two extra copies
    assert choose_path(mode="auto", descriptors=524_288, mem_kind="VRAM", **kw) == "staging"
    # one descriptor per layer buffer (contiguous request): direct
    assert choose_path(mode="auto", descriptors=64, mem_kind="VRAM", **kw) == "direct"
    assert choose_path(mode="direct", descriptors=524_288, mem_kind="VRAM", **kw) == "direct"
    assert choose_path(mode="staging", descriptors=64, mem_kind="VRAM", **kw) == "staging"
    kw["staging_possible"] = False
    assert choose_path(mode="staging", descriptors=524_288, mem_kind="VRAM", **kw) == "direct"


R, P, L = 6, 64, 256  # regions, pages per region, bytes per page


def _memory(arrays: list[np.ndarray]) -> Memory:
    kv = RegionSet.of([a.ctypes.data for a in arrays], [a.nbytes for a in arrays], [L] * len(arrays), "DRAM")
    return Memory(kv, RegionSet.of([], [], [], "DRAM"))


@pytest.fixture()
def pair():
    rng = np.random.default_rng(7)
    src = [rng.integers(0, 256, P * L, dtype=np.uint8) for _ in range(R)]
    dst = [np.full(P * L, 0xAB, dtype=np.uint8) for _ in range(R)]
    a = TransferEngine(AgentConfig(), _memory(src))
    b = TransferEngine(AgentConfig(), _memory(dst))
    local = StagingBuffer(a.agent, 4 * L * 16, L * 16, "DRAM")  # 4 slots of 16 pages
    remote = StagingBuffer(b.agent, 2 * L * 16, L * 16, "DRAM")  # 2 receiver slots
    link = a.link(b.metadata, b.memory)
    yield a, b, src, dst, local, remote, link
    a.close()
    b.close()


def _send(a, local, remote, link, src_pages, credits, drain_timeout_s=5.0):
    units = unit_indices_of(src_pages, Geometry.whole_items())
    return StagedSend(
        agent=a.agent, copier=make_copier("DRAM"), local=local,
        remote=RemoteStaging(remote.ptr, remote.slot_bytes, 0, "DRAM"), peer=link.name,
        src_bases=np.asarray(a.memory.kv.ptrs, dtype=np.uint64), units=units,
        geometry=Geometry.whole_items(),
        pieces=plan_pieces(R, len(units), L, min(local.slot_bytes, remote.slot_bytes)),
        remote_free=credits,
        drain_timeout_s=drain_timeout_s,
    )


def _drive(jobs, b, remote, dst_pages_of, deadline_s=30.0):
    """Run jobs to the end, scattering each landed piece like a decode and crediting its slot."""
    copier = make_copier("DRAM")
    bases = np.asarray(b.memory.kv.ptrs, dtype=np.uint64)
    end = time.monotonic() + deadline_s
    while any(not j.finished or j.in_flight for j in jobs):
        assert time.monotonic() < end, "staged transfer did not finish"
        b.agent.progress()  # the receiver progresses its agent, as the decode listener does
        for j in jobs:
            for piece, slot in j.step():
                dst = dst_pages_of[id(j)]
                copier.scatter(bases[piece.r0 : piece.r1], dst[piece.j0 : piece.j1], L, L, 0, remote.addr(slot))
                j.remote_free.append(slot)


def test_staged_transfers_share_bounded_slots_and_land_byte_exact(pair):
    a, b, src, dst, local, remote, link = pair
    rng = np.random.default_rng(3)
    s1, s2 = rng.permutation(P)[:40], rng.permutation(P)[:20]
    free = rng.permutation(P)
    d1, d2 = free[:40], free[40:60]
    # Two rooms, one receiver slot each, and four local slots for both: they must wait
    # for each other's slots (backpressure), never allocate more.
    credits = remote.acquire(2)
    j1 = _send(a, local, remote, link, s1, deque(credits[:1]))
    j2 = _send(a, local, remote, link, s2, deque(credits[1:]))
    assert len(j1.pieces) > 2 and len(j2.pieces) > 2
    _drive([j1, j2], b, remote, {id(j1): d1, id(j2): d2})
    assert not j1.error and not j2.error
    assert j1.done_pieces == len(j1.pieces) and j2.done_pieces == len(j2.pieces)
    assert local.free == local.num_slots  # every local slot came back
    for r in range(R):
        got, want = dst[r].reshape(P, L), src[r].reshape(P, L)
        assert (got[d1] == want[s1]).all() and (got[d2] == want[s2]).all()
        untouched = np.setdiff1d(np.arange(P), np.concatenate([d1, d2]))
        assert (got[untouched] == 0xAB).all()
    assert a.agent.live["xfer"] == 0


def test_staging_buffer_backpressure():
    class _Agent:
        def register(self, regions):
            self.regions = regions

    buf = StagingBuffer(_Agent(), 4096, 1024, "DRAM")
    got = buf.acquire(3)
    assert len(got) == 3 and buf.free == 1
    assert len(buf.acquire(3)) == 1 and buf.acquire(1) == []
    buf.release(got)
    assert buf.free == 3


def test_failure_in_the_middle_releases_slots_and_reports(pair):
    a, b, src, dst, local, remote, link = pair
    pages = np.arange(48)
    job = _send(a, local, remote, link, pages, deque(remote.acquire(1)), drain_timeout_s=1.0)
    copier = make_copier("DRAM")
    bases = np.asarray(b.memory.kv.ptrs, dtype=np.uint64)
    landed = 0
    end = time.monotonic() + 30
    while landed < 1:
        assert time.monotonic() < end
        b.agent.progress()
        for piece, slot in job.step():
            copier.scatter(bases[piece.r0 : piece.r1], pages[piece.j0 : piece.j1], L, L, 0, remote.addr(slot))
            landed += 1
            job.remote_free.append(slot)
    # the receiver goes away mid-transfer
    a.unlink(link)
    end = time.monotonic() + 30
    while not job.finished or job.in_flight:
        assert time.monotonic() < end, "a failed staged transfer must end"
        b.agent.progress()
        job.step()
    assert job.error, "a WRITE to a removed peer must fail the job"
    assert job.done_pieces < len(job.pieces)
    assert local.free == local.num_slots  # no local slot is lost to the failure
    assert a.agent.live["xfer"] == 0  # nothing in flight is left counted as live
