"""The staging path: planning, the path rule, slot backpressure, and, between two real NIXL
agents, byte-exact pipelined transfers (concurrent rooms sharing slots) and a failure in the
middle of a transfer. The transfer tests run on DRAM always and on VRAM (bf16 data, Triton
copier, copy streams) where a CUDA device exists; without one the VRAM cases skip."""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import numpy as np
import pytest

from sgl_nixl_plugin.engine.copy_kernels import make_copier
from sgl_nixl_plugin.engine.engine import Memory, TransferEngine
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.scatter_queue import ScatterQueue
from sgl_nixl_plugin.engine.staging import (
    MIN_PIECE_BYTES,
    PIPELINE_PIECES,
    PIPELINE_PIECES_SAME_DEVICE,
    RemoteStaging,
    StagedSend,
    StagingBuffer,
    choose_path,
    piece_bytes,
    plan_pieces,
    plan_request,
    unit_indices_of,
)
from sgl_nixl_plugin.protocol.credits import SlotCredits
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


def test_a_unit_larger_than_a_slot_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        plan_pieces(4, 10, 4096, 1024)


def test_piece_bytes_pipelines_large_requests_and_respects_slots():
    mib = 1 << 20
    # a large request is cut into about PIPELINE_PIECES pieces...
    assert piece_bytes(768 * mib, 512 * mib, "VRAM") == 128 * mib
    assert 768 * mib // piece_bytes(768 * mib, 512 * mib, "VRAM") == PIPELINE_PIECES
    # ...never larger than a slot...
    assert piece_bytes(768 * mib, 64 * mib, "VRAM") == 64 * mib
    # ...and not below the floor where fixed per-piece costs dominate
    assert piece_bytes(60 * mib, 512 * mib, "VRAM") == MIN_PIECE_BYTES["VRAM"]
    assert piece_bytes(60 * mib, 512 * mib, "DRAM") == 10 * mib
    assert piece_bytes(10, 1 << 30, "DRAM") == MIN_PIECE_BYTES["DRAM"]
    # both sides on one GPU: fewer, larger pieces (their copies take turns there)
    same = piece_bytes(768 * mib, 512 * mib, "VRAM", same_device=True)
    assert 768 * mib // same == PIPELINE_PIECES_SAME_DEVICE < PIPELINE_PIECES
    assert len(plan_request(64, 6144, 2048, 512 * mib, "VRAM", same_device=True)) == 2
    assert len(plan_request(64, 6144, 2048, 256 * mib, "VRAM", same_device=True)) == 4  # slots
    assert len(plan_request(64, 6144, 2048, 512 * mib, "VRAM")) >= PIPELINE_PIECES


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


def test_path_rule_on_host_memory_keeps_small_requests_direct():
    """Page 1 on host memory, 8 layers x 8 heads x 128 (2 KiB a token a region): a 16-token
    request (256 descriptors) went 1.4 ms direct against 2.6 ms staged on the CPU host, a
    256-token one (4,096) 9.4 ms direct against 7.2 staged; the rule picks the faster."""
    kw = dict(mem_kind="DRAM", slot_bytes=16 << 20, staging_possible=True)
    for tokens, path in ((16, "direct"), (32, "direct"), (256, "staging"), (1024, "staging")):
        got = choose_path(mode="auto", descriptors=tokens * 16, nbytes=tokens * 16 * 2048, **kw)
        assert got == path, (tokens, got)


def test_path_rule_goes_direct_while_the_receivers_area_is_allocated():
    """Staged rooms sent while the decode allocates its area wait for its slots (0.3-0.5 s
    for 132 MiB of host memory on the 2-core host with eight rooms in flight): on host
    memory the rule charges that wait, and 256 page-1 tokens (9 ms direct) go direct until
    the area is there. No wait is charged on GPUs (not measured there)."""
    kw = dict(descriptors=4096, nbytes=8 << 20, slot_bytes=16 << 20, staging_possible=True)
    assert choose_path(mode="auto", mem_kind="DRAM", **kw) == "staging"
    assert choose_path(mode="auto", mem_kind="DRAM", area_pending=True, **kw) == "direct"
    assert choose_path(mode="staging", mem_kind="DRAM", area_pending=True, **kw) == "staging"
    big = dict(kw, descriptors=524_288, nbytes=1 << 30, slot_bytes=256 << 20)
    assert choose_path(mode="auto", mem_kind="VRAM", area_pending=True, **big) == "staging"


R, P, L = 6, 64, 256  # regions, pages per region, bytes per page


class Side:
    """One process's KV regions (separate allocations) and staging, on DRAM or a GPU."""

    def __init__(self, kind: str, fill: str, slots: int, seed: int) -> None:
        self.kind = kind
        if kind == "VRAM":
            import torch

            self.torch = torch
            g = torch.Generator(device="cpu").manual_seed(seed)
            if fill == "data":  # bf16 values (incl. negatives, tiny and huge), as bytes
                vals = torch.randn(R, P * L // 2, generator=g) * 1e3
                self.regions = [v.to(torch.bfloat16).view(torch.uint8).cuda() for v in vals]
            else:
                self.regions = [
                    torch.full((P * L,), 0xAB, dtype=torch.uint8, device="cuda") for _ in range(R)
                ]
            ptrs = [t.data_ptr() for t in self.regions]
            self.stream = torch.cuda.Stream()
        else:
            rng = np.random.default_rng(seed)
            if fill == "data":
                self.regions = [rng.integers(0, 256, P * L, dtype=np.uint8) for _ in range(R)]
            else:
                self.regions = [np.full(P * L, 0xAB, dtype=np.uint8) for _ in range(R)]
            ptrs = [a.ctypes.data for a in self.regions]
            self.stream = None
        kv = RegionSet.of(ptrs, [P * L] * R, [L] * R, kind)
        self.engine = TransferEngine(AgentConfig(), Memory(kv, RegionSet.of([], [], [], kind)))
        self.staging = StagingBuffer(
            self.engine.agent, slots * L * 16, L * 16, kind
        )  # 16 pages a slot
        self.copier = make_copier(kind)
        self.bases = np.asarray(ptrs, dtype=np.uint64)

    def pages(self, r: int) -> np.ndarray:
        if self.kind == "VRAM":
            self.torch.cuda.synchronize()
            return self.regions[r].cpu().numpy().reshape(P, L)
        return self.regions[r].reshape(P, L)


@pytest.fixture(params=["DRAM", "VRAM"])
def pair(request):
    if request.param == "VRAM":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    a = Side(request.param, "data", slots=4, seed=7)  # 4 sender slots
    b = Side(request.param, "sentinel", slots=2, seed=8)  # 2 receiver slots
    link = a.engine.link(b.engine.metadata, b.engine.memory)
    yield a, b, link
    a.engine.close()
    b.engine.close()


def _send(a, b, link, src_pages, credits, drain_timeout_s=5.0):
    units = unit_indices_of(src_pages, Geometry.whole_items())
    remote = b.staging
    return StagedSend(
        agent=a.engine.agent,
        copier=a.copier,
        local=a.staging,
        remote=RemoteStaging(remote.ptr, remote.slot_bytes, 0, remote.mem_kind),
        peer=link.name,
        src_bases=a.bases,
        units=units,
        geometry=Geometry.whole_items(),
        pieces=plan_pieces(R, len(units), L, min(a.staging.slot_bytes, remote.slot_bytes)),
        remote_free=credits,
        stream=a.stream,
        drain_timeout_s=drain_timeout_s,
        receiver_slots=credits.held if isinstance(credits, SlotCredits) else None,
    )


def _drive(jobs, b, dst_pages_of, deadline_s=60.0, stop_after=None, credit=None, each=None):
    """Run jobs, scattering each landed piece like a decode (through a ScatterQueue) and
    crediting its slot back (``credit(job, slot)``, by default to the job) only once its
    scatter has finished; ``each()`` runs after every round of steps. Returns pieces
    scattered."""
    scatters = ScatterQueue(b.copier, b.stream)
    end = time.monotonic() + deadline_s
    done = 0
    while any(not j.finished or j.in_flight for j in jobs) or len(scatters):
        assert time.monotonic() < end, "staged transfer did not finish"
        b.engine.agent.progress()  # the receiver progresses its agent, as the decode listener does
        for j in jobs:
            for piece, slot in j.step():
                dst = dst_pages_of[id(j)]
                scatters.launch(
                    (j, slot),
                    bases=b.bases[piece.r0 : piece.r1],
                    units=dst[piece.j0 : piece.j1],
                    unit_len=L,
                    stride=L,
                    offset=0,
                    stage=b.staging.addr(slot),
                )
        if each is not None:
            each()
        for j, slot in scatters.ready():
            if credit is None:
                j.remote_free.append(slot)
            else:
                credit(j, slot)
            done += 1
        if stop_after is not None and done >= stop_after:
            return done
    return done


def _assert_landed(a, b, placed):
    """Every destination page holds its source page; every other page its sentinel."""
    for r in range(R):
        got, want = b.pages(r), a.pages(r)
        for src, dst in placed:
            assert (got[dst] == want[src]).all(), f"region {r}: pages differ"
        untouched = np.setdiff1d(np.arange(P), np.concatenate([d for _, d in placed]))
        assert (got[untouched] == 0xAB).all(), f"region {r}: a page outside the request changed"


def test_staged_transfers_share_bounded_slots_and_land_byte_exact(pair):
    a, b, link = pair
    rng = np.random.default_rng(3)
    s1, s2, s3 = rng.permutation(P)[:40], rng.permutation(P)[:20], rng.permutation(P)[:9]
    free = rng.permutation(P)
    d1, d2, d3 = free[:40], free[40:60], free[60:]  # d3: 4 pages only (s3 cut below)
    s3 = s3[: len(d3)]
    # Three rooms, two receiver slots among them (one room starts with none, it gets a
    # credit only when another's piece was scattered) and four local slots for all: they
    # must wait for each other's slots (backpressure), never allocate more.
    credits = b.staging.acquire(2)
    j1 = _send(a, b, link, s1, deque(credits[:1]))
    j2 = _send(a, b, link, s2, deque(credits[1:]))
    j3 = _send(a, b, link, s3, deque())
    assert len(j1.pieces) > 2 and len(j2.pieces) > 2
    donor = []

    def credit(job, slot):
        if not donor:  # the first slot freed goes to the room that had none...
            donor.append(job)
            j3.remote_free.append(slot)
        elif job is j3 and j3.posted == len(j3.pieces):  # ...and back once it is done
            donor[0].remote_free.append(slot)
        else:
            job.remote_free.append(slot)

    _drive([j1, j2, j3], b, {id(j1): d1, id(j2): d2, id(j3): d3}, credit=credit)
    for j in (j1, j2, j3):
        assert not j.error and j.done_pieces == len(j.pieces)
    assert a.staging.free == a.staging.num_slots  # every local slot came back
    _assert_landed(a, b, [(s1, d1), (s2, d2), (s3, d3)])
    assert a.engine.agent.live["xfer"] == 0


def test_rooms_waiting_for_receiver_slots_hold_no_local_slot(pair):
    """Local slots serve every room. A room waiting for a grant gathers nothing: before,
    three waiting rooms filled all four local slots with pieces they could not send, and
    the room holding the receiver slots could not gather until ``SLOT_WAIT`` sent the
    waiting rooms direct. And a room keeps at most as many pieces gathered ahead as it
    holds receiver slots."""
    a, b, link = pair
    rng = np.random.default_rng(11)
    src, free = rng.permutation(P), rng.permutation(P)
    s_h, d_h = src[:40], free[:40]
    waiting = [SlotCredits([]) for _ in range(3)]
    waiters = [_send(a, b, link, src[40 + 8 * i : 48 + 8 * i], c) for i, c in enumerate(waiting)]
    holder_credits = SlotCredits(b.staging.acquire(1))
    holder = _send(a, b, link, s_h, holder_credits)
    assert len(holder.pieces) > 2 and all(len(w.pieces) >= 1 for w in waiters)
    for _ in range(5):
        for w in waiters:
            assert w.step() == [] and not w.needs_polling
    assert a.staging.free == a.staging.num_slots  # nothing gathered for the waiting rooms
    lowest = [a.staging.free]

    def each():
        for w in waiters:
            w.step()
        lowest[0] = min(lowest[0], a.staging.free)

    _drive([holder], b, {id(holder): d_h}, deadline_s=30.0, each=each)
    assert not holder.error and holder.done_pieces == len(holder.pieces)
    assert all(w.posted == 0 for w in waiters)
    # one receiver slot: one piece in its WRITE and one gathered behind it, never more
    assert lowest[0] == a.staging.num_slots - 2, lowest
    # the holder's room ends; its slot is granted to the first waiting room, which now runs
    slot = holder_credits.popleft()
    assert waiting[0].grant(slot) == "" and waiters[0].needs_polling
    d_w = free[40:48]
    _drive([waiters[0]], b, {id(waiters[0]): d_w}, deadline_s=30.0)
    assert not waiters[0].error and waiters[0].done_pieces == len(waiters[0].pieces)
    assert a.staging.free == a.staging.num_slots
    _assert_landed(a, b, [(s_h, d_h), (src[40:48], d_w)])
    assert a.engine.agent.live["xfer"] == 0


def test_scatter_queue_releases_statuses_only_after_earlier_pieces(pair):
    a, b, link = pair
    src, dst = np.arange(32), np.random.default_rng(5).permutation(P)[:32]
    job = _send(a, b, link, src, deque(b.staging.acquire(2)))
    scatters = ScatterQueue(b.copier, b.stream)
    out = []
    end = time.monotonic() + 60
    while not job.finished or job.in_flight or len(scatters):
        assert time.monotonic() < end
        b.engine.agent.progress()
        landed = job.step()
        for piece, slot in landed:
            scatters.launch(
                ("piece", piece.index, slot),
                bases=b.bases[piece.r0 : piece.r1],
                units=dst[piece.j0 : piece.j1],
                unit_len=L,
                stride=L,
                offset=0,
                stage=b.staging.addr(slot),
            )
        if landed and job.done_pieces == len(job.pieces):
            scatters.after(("status", "success"))
        # wait only on launched pieces: on an empty queue ``wait`` would sit out its timeout
        for item in scatters.wait(timeout=5) if len(scatters) else []:
            out.append(item)
            if item[0] == "piece":
                job.remote_free.append(item[2])
            if item[0] == "status":
                # Success comes out last, after every piece's scatter finished: the pages
                # already hold every byte when it is applied
                assert [o[1] for o in out[:-1]] == list(range(len(job.pieces)))
                _assert_landed(a, b, [(src, dst)])
    assert out[-1] == ("status", "success")


def test_slot_credits_refuse_replayed_and_stale_piece_done():
    """A PieceDone frees a receiver slot only for the piece that is in it: a replay of an
    earlier one (same or older sequence number) would let the next piece overwrite a piece
    the decode has not scattered yet."""
    credits = SlotCredits([3, 4])
    slot = credits.popleft()  # the sender writes piece 1 into slot 3
    seq1 = credits.issue(slot)
    assert credits.give_back(3, seq1) == "" and list(credits) == [4, 3]
    assert "already free" in credits.give_back(3, seq1)  # replayed at once
    credits.remove(3)
    seq2 = credits.issue(3)  # slot 3 reused for the next piece
    assert "replayed" in credits.give_back(3, seq1)  # an old PieceDone, replayed later
    assert 3 not in credits
    assert credits.give_back(3, seq2) == "" and 3 in credits
    assert "never granted" in credits.give_back(9, 1)


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
    a, b, link = pair
    pages = np.arange(48)
    job = _send(a, b, link, pages, deque(b.staging.acquire(1)), drain_timeout_s=1.0)
    assert _drive([job], b, {id(job): pages}, stop_after=1) == 1
    # the receiver goes away mid-transfer
    a.engine.unlink(link)
    end = time.monotonic() + 30
    while not job.finished or job.in_flight:
        assert time.monotonic() < end, "a failed staged transfer must end"
        b.engine.agent.progress()
        job.step()
    assert job.error, "a WRITE to a removed peer must fail the job"
    assert job.done_pieces < len(job.pieces)
    assert a.staging.free == a.staging.num_slots  # no local slot is lost to the failure
    assert a.engine.agent.live["xfer"] == 0  # nothing in flight is left counted as live


def test_a_rooms_receiver_slots_are_shared_by_its_senders():
    from sgl_nixl_plugin.protocol.decode_rooms import SLOTS_PER_ROOM, slots_per_sender

    assert slots_per_sender(1) == SLOTS_PER_ROOM
    assert slots_per_sender(0) == SLOTS_PER_ROOM  # unknown: one sender
    assert [slots_per_sender(k) for k in (2, 4, 8)] == [SLOTS_PER_ROOM // 2, 1, 1]


@pytest.mark.parametrize("upp", [1, 3, 16])
def test_decode_expands_uploaded_pages_into_units_like_the_sender(upp):
    """The decode uploads a room's page numbers once and derives each chunk's units from
    them (numpy, or torch where the copier keeps them): the same numbers the sender plans
    with (``unit_indices_of``)."""
    import torch

    from sgl_nixl_plugin.sides.decode_staging import _expand

    pages = np.random.default_rng(upp).permutation(500)[:37].astype(np.int64)
    want = unit_indices_of(pages, Geometry(8, upp, 8, 8))
    assert np.array_equal(_expand(pages, upp), want)
    assert np.array_equal(_expand(torch.from_numpy(pages), upp).numpy(), want)
    if torch.cuda.is_available():  # where the decode's GPU copier keeps them
        assert np.array_equal(_expand(torch.from_numpy(pages).cuda(), upp).cpu().numpy(), want)


class _RecordingCopier:
    """The side's copier, counting what ``StagedSend`` hands back through ``release_units``."""

    def __init__(self, inner) -> None:
        self.inner, self.released = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def release_units(self, units, stream=None) -> None:
        self.released.append(units)
        release = getattr(self.inner, "release_units", None)
        if release is not None:
            release(units, stream)


def test_a_staged_send_gives_its_indices_back_once_done_or_abandoned(pair):
    a, b, link = pair
    a.copier = rec = _RecordingCopier(a.copier)
    src, dst = np.arange(40), np.random.default_rng(9).permutation(P)[:40]
    job = _send(a, b, link, src, deque(b.staging.acquire(2)))
    _drive([job], b, {id(job): dst})
    assert job.done_pieces == len(job.pieces) and len(rec.released) == 1
    _assert_landed(a, b, [(src, dst)])
    job2 = _send(a, b, link, src, deque())  # no receiver slot: gathers, never posts
    job2.step()
    assert job2._units_dev is not None and len(rec.released) == 1
    job2.abandon("test")
    job2.abandon("again")
    assert len(rec.released) == 2  # once, however often it is abandoned
    assert a.staging.free == a.staging.num_slots


def test_mapped_units_are_read_in_place_byte_exact_and_their_buffers_reused(pair):
    """With ``map_units`` the Triton gathers of a bound thread (as in a prefill's transfer
    worker) read the request's indices from pinned host memory: nothing is uploaded, bytes
    land exactly, and a buffer is reused only after the gathers that read it have run."""
    a, b, link = pair
    if a.kind != "VRAM":
        pytest.skip("mapped indices are a GPU copier feature")
    if not hasattr(a.copier, "map_units"):
        pytest.skip("the VRAM copier here is not the Triton one")
    torch = a.torch
    a.copier.map_units = True
    assert a.copier.map_units, "the host-mapped self-test failed on this GPU"
    a.copier._index._units.clear()
    a.copier.bind(a.stream)  # this thread now launches on a.stream, like a transfer worker
    try:
        rng = np.random.default_rng(11)
        src, dst = rng.permutation(P)[:48], rng.permutation(P)[:48]
        job = _send(a, b, link, src, deque(b.staging.acquire(2)))
        _drive([job], b, {id(job): dst})
        assert not job.error and job.done_pieces == len(job.pieces)
        _assert_landed(a, b, [(src, dst)])
        from sgl_nixl_plugin.engine.copy_triton import MAPPED_RESERVE

        pool = a.copier._mapped
        assert pool.in_use == 0 and pool._count == MAPPED_RESERVE[0]  # reserved: none pinned
        assert a.copier._index._units == []  # read in place: no index upload happened
        dst2 = np.setdiff1d(np.arange(P), dst)  # the 16 pages the first request left alone
        src2 = rng.permutation(P)[: len(dst2)]
        job = _send(a, b, link, src2, job.remote_free)  # the receiver slots it handed back
        _drive([job], b, {id(job): dst2})
        assert pool._count == MAPPED_RESERVE[0]  # a reserved buffer, reused
        _assert_landed(a, b, [(src, dst), (src2, dst2)])
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream())
        a.copier.map_units = False


def test_a_prefill_sharing_its_gpu_with_the_decode_hints_at_mps_once(monkeypatch, tmp_path, caplog):
    from sgl_nixl_plugin.sides import staged_path as tw

    monkeypatch.setattr(tw, "_MPS_HINTED", threading.Event())
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    with caplog.at_level("INFO", logger=tw.logger.name):
        tw._hint_mps(41)
        tw._hint_mps(42)
    hints = [r.getMessage() for r in caplog.records if "MPS" in r.getMessage()]
    assert len(hints) == 1 and "room 41" in hints[0] and "nvidia-cuda-mps-control" in hints[0]
    monkeypatch.setattr(tw, "_MPS_HINTED", threading.Event())
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # a server's pipes are there
    caplog.clear()
    with caplog.at_level("INFO", logger=tw.logger.name):
        tw._hint_mps(43)
    assert not [r for r in caplog.records if "MPS" in r.getMessage()]


@pytest.mark.parametrize("kind", ["DRAM", "VRAM"])
def test_staging_warm_up_writes_from_spare_tail_to_spare_tail_only(kind):
    """The staged path's warm-up WRITE goes from our staging buffer's spare tail into the
    peer's, byte for byte: no slot on either side is read into or written."""
    from sgl_nixl_plugin.engine.staging import SPARE_BYTES, spare_of

    if kind == "VRAM":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    a, b = Side(kind, "data", slots=1, seed=3), Side(kind, "sentinel", slots=1, seed=4)
    slot = 2 * SPARE_BYTES
    mine = StagingBuffer(a.engine.agent, 2 * slot, slot, kind)
    theirs = StagingBuffer(b.engine.agent, 3 * slot, slot, kind)
    small = StagingBuffer(b.engine.agent, 4 * 1024, 1024, kind)
    try:
        assert mine.spare == (mine.ptr + 2 * slot, SPARE_BYTES)
        assert small.spare == (0, 0) and small.nbytes == 4 * 1024  # small slots: no spare
        mine._mem[:] = 0x5A
        theirs._mem[:] = 0
        link = a.engine.link(b.engine.metadata, b.engine.memory)
        remote = RemoteStaging(
            theirs.ptr, slot, 0, kind, spare=spare_of(theirs.ptr, theirs.nbytes, slot)
        )
        assert remote.spare == (theirs.ptr + 3 * slot, SPARE_BYTES)
        stop = threading.Event()

        def progress() -> None:  # the receiver progresses its agent, as the decode listener does
            while not stop.wait(0.0005):
                b.engine.agent.progress()

        target = threading.Thread(target=progress, daemon=True)
        target.start()
        try:
            assert a.engine.warm_staging(link, mine, remote) > 0
        finally:
            stop.set()
            target.join(5)
        got = theirs._mem.cpu().numpy() if kind == "VRAM" else theirs._mem
        assert (got[3 * slot :] == 0x5A).all(), "the spare tail did not receive the WRITE"
        assert (got[: 3 * slot] == 0).all(), "a slot of the peer's staging buffer was written"
        no_spare = RemoteStaging(small.ptr, 1024, 0, kind, spare=(0, 0))
        assert a.engine.warm_staging(link, mine, no_spare) == 0.0  # nothing to warm
        assert a.engine.agent.live["xfer"] == 0
    finally:
        a.engine.close()
        b.engine.close()
