"""The transfer engine against real NIXL: DRAM buffers, UCX on loopback, two processes.

The test process is the prefill side (random source bytes); decode-like peers run in their
own processes (``helpers.engine_peer``) with every byte set to a sentinel, so each test can
check that exactly the named destination pages changed, byte for byte, and nothing else.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from helpers.engine_peer import (
    UCX_ENV,
    Buffers,
    GroupSpec,
    PeerProcess,
    PeerSpec,
    allocate,
    peers,
)

from sgl_nixl_plugin.engine.agent import WARMUP, TransferError, Xfer
from sgl_nixl_plugin.engine.descriptors import (
    expected_descriptors,
    naive_descriptors,
)
from sgl_nixl_plugin.engine.engine import (
    SCRATCH_BYTES,
    WARM_DESCRIPTORS,
    WARM_MAX_BYTES,
    PeerLink,
    TransferEngine,
    warm_items,
)
from sgl_nixl_plugin.engine.layout import Geometry
from sgl_nixl_plugin.registry.spec import AgentConfig

pytestmark = pytest.mark.timeout(90)  # a hang guard; the file takes ~30 s

TOKEN_BYTES = 64  # one token of one region (e.g. one layer's K): 4 heads x 16 bytes
REGIONS = 4  # K and V of two layers
POOL = 64  # pages per region on both sides
PAGE_SIZES = (1, 16, 64)
AUX = GroupSpec(regions=2, items=8, item_bytes=96)
STATE = GroupSpec(regions=3, items=10, item_bytes=256)
DEADLINE_S = 10.0  # any single transfer (or failure) must resolve within this


def kv_spec(page_size: int, **kw: object) -> PeerSpec:
    return PeerSpec(GroupSpec(REGIONS, POOL, page_size * TOKEN_BYTES), **kw)  # type: ignore[arg-type]


@dataclass
class Pair:
    """Our engine over random source bytes, a peer full of sentinels, and the link."""

    engine: TransferEngine
    src: dict[str, Buffers]
    peer: PeerProcess
    link: PeerLink


@pytest.fixture(scope="module", autouse=True)
def loopback_only() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in UCX_ENV.items():
            mp.setenv(key, value)  # read by UCX when each agent in this process starts
        yield


@pytest.fixture(scope="module")
def pairs(loopback_only: None) -> Iterator[dict[int, Pair]]:
    """One peer per page size (started together); page size 16 also has aux and state."""
    specs = {
        ps: kv_spec(ps, aux=AUX, state=(STATE,)) if ps == 16 else kv_spec(ps) for ps in PAGE_SIZES
    }
    with peers(*specs.values()) as started, contextlib.ExitStack() as stack:
        out: dict[int, Pair] = {}
        for (ps, spec), peer in zip(specs.items(), started, strict=True):
            src, memory = allocate(spec, seed=ps)
            engine = TransferEngine(AgentConfig(), memory)
            stack.callback(engine.close)
            out[ps] = Pair(engine, src, peer, engine.link(peer.metadata, peer.memory))
        yield out


@pytest.fixture
def spawn() -> Iterator[Callable[[PeerSpec], PeerProcess]]:
    """Start extra peers inside a test; every one is stopped (killed if need be) after it."""
    started: list[PeerProcess] = []

    def start(spec: PeerSpec) -> PeerProcess:
        started.append(PeerProcess(spec))
        return started[-1].wait_ready()

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def engines() -> Iterator[list[TransferEngine]]:
    """Engines made inside a test are closed after it, even when it fails."""
    made: list[TransferEngine] = []
    yield made
    for e in made:
        e.close()


# -- helpers ------------------------------------------------------------------------------


def complete(engine: TransferEngine, xfers: Sequence[Xfer], timeout: float = DEADLINE_S) -> None:
    """Poll every transfer to DONE (bounded), then release each: release must succeed."""
    deadline = time.monotonic() + timeout
    while any(engine.poll(x) == "PROC" for x in xfers):
        assert time.monotonic() < deadline, "transfers still in progress after the deadline"
        time.sleep(0.0005)  # a poll interval: give the core to UCX's progress thread
    failed = [(x.state, x.error) for x in xfers if x.state != "DONE"]
    assert not failed, failed
    for x in xfers:
        assert engine.release(x) is True


def settle(engine: TransferEngine, xfer: Xfer, timeout: float = DEADLINE_S) -> str:
    """Poll one transfer until it leaves PROC; fails the test if that takes too long."""
    deadline = time.monotonic() + timeout
    while engine.poll(xfer) == "PROC":
        assert time.monotonic() < deadline, f"transfer still PROC after {timeout}s"
        time.sleep(0.0005)
    return xfer.state


def expected_pages(
    peer: PeerProcess, src: Buffers, src_items: np.ndarray, dst_items: np.ndarray
) -> np.ndarray:
    spec = src.spec
    out = np.full((spec.regions, spec.items, spec.item_bytes), peer.spec.sentinel, np.uint8)
    out[:, dst_items] = src.pages[:, src_items]
    return out


def assert_landed(pair: Pair, group: str, src_items: np.ndarray, dst_items: np.ndarray) -> None:
    """Every destination page holds its source page; every other byte the sentinel."""
    got = pair.peer.read(group)
    want = expected_pages(pair.peer, pair.src[group], src_items, dst_items)
    np.testing.assert_array_equal(got, want, err_msg=f"{group} pages differ")
    assert pair.peer.gaps_intact(group), f"bytes written between {group} regions"


def layout(kind: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if kind == "contiguous":  # one run on both sides, at different offsets
        return np.arange(5, 5 + n), np.arange(POOL - n - 3, POOL - 3)
    if kind == "alternating":  # every other page: no two pages adjacent on either side
        return np.arange(0, 2 * n, 2), np.arange(1, 2 * n + 1, 2)
    return rng.choice(POOL, n, replace=False), rng.choice(POOL, n, replace=False)


# -- whole pages ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["contiguous", "alternating", "random"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_write_is_byte_exact_with_predicted_descriptors(
    pairs: dict[int, Pair], page_size: int, kind: str
) -> None:
    pair = pairs[page_size]
    pair.peer.fill()
    n = 24
    src, dst = layout(kind, n, np.random.default_rng(page_size))
    xfer = pair.engine.write(pair.link, "kv", src, dst)
    complete(pair.engine, [xfer])
    assert_landed(pair, "kv", src, dst)

    tele = pair.engine.agent.telemetry(xfer)
    assert tele is not None
    item = page_size * TOKEN_BYTES
    assert xfer.nbytes == tele["bytes"] == n * item * REGIONS
    naive = naive_descriptors(n, REGIONS, Geometry.whole_items())
    if kind == "contiguous":
        want = REGIONS  # merged into one descriptor per region
    elif kind == "alternating":
        want = n * REGIONS  # nothing to merge
    else:
        want = expected_descriptors(src, dst, REGIONS, Geometry.whole_items())
        assert want <= naive
    assert xfer.descriptors == tele["descriptors"] == want


def test_chunked_send_lands_like_one_request(pairs: dict[int, Pair]) -> None:
    pair = pairs[16]
    pair.peer.fill()
    rng = np.random.default_rng(7)
    src, dst = rng.choice(POOL, 30, replace=False), rng.choice(POOL, 30, replace=False)
    notifs = [f"chunk-{i}-{uuid.uuid4().hex[:6]}".encode() for i in range(3)]
    xfers = [
        pair.engine.write(pair.link, "kv", s, d, notif=tag)  # all three in flight at once
        for s, d, tag in zip(np.array_split(src, 3), np.array_split(dst, 3), notifs, strict=True)
    ]
    assert [len(s) for s in np.array_split(src, 3)] == [10, 10, 10]
    complete(pair.engine, xfers)
    assert_landed(pair, "kv", src, dst)
    got = pair.peer.notifications(want=3, sender=pair.engine.name)
    assert sorted(got.get(pair.engine.name, [])) == sorted(notifs)


def test_aux_rows_and_state_group(pairs: dict[int, Pair]) -> None:
    pair = pairs[16]
    pair.peer.fill()
    assert set(pair.link.groups) == {"kv", "aux", "state0"}
    aux_src, aux_dst = np.array([1]), np.array([6])
    st_src, st_dst = np.array([0, 4, 5, 9]), np.array([9, 2, 3, 4])  # runs: 0 | 4,5 | 9
    xfers = [
        pair.engine.write(pair.link, "aux", aux_src, aux_dst),
        pair.engine.write(pair.link, "state0", st_src, st_dst),
    ]
    assert xfers[0].nbytes == AUX.regions * AUX.item_bytes
    assert xfers[1].nbytes == 4 * STATE.regions * STATE.item_bytes
    assert xfers[1].descriptors == STATE.regions * 3
    complete(pair.engine, xfers)
    assert_landed(pair, "aux", aux_src, aux_dst)
    assert_landed(pair, "state0", st_src, st_dst)
    assert_landed(pair, "kv", np.array([], np.int64), np.array([], np.int64))  # untouched


def test_kv_pages_and_an_aux_row_in_one_write_land_byte_exact_with_one_note(
    pairs: dict[int, Pair],
) -> None:
    """KV and aux rows both in DRAM on both sides: the link prepares them in one list per
    side, so a room's last KV chunk and its aux row go in one WRITE (one post, one note)."""
    pair = pairs[16]
    pair.peer.fill()
    assert pair.link.shares("kv", "aux") and not pair.link.shares("kv", "state0")
    rng = np.random.default_rng(21)
    src, dst = rng.choice(POOL, 5, replace=False), rng.choice(POOL, 5, replace=False)
    aux_src, aux_dst = np.array([3]), np.array([7])
    tag = f"joint-{uuid.uuid4().hex[:6]}".encode()
    live = pair.engine.agent.live
    before = live["xfer"]
    xfer = pair.engine.write_parts(pair.link, [("kv", src, dst), ("aux", aux_src, aux_dst)], tag)
    assert xfer is not None and live["xfer"] == before + 1  # one NIXL request in flight
    complete(pair.engine, [xfer])
    assert_landed(pair, "kv", src, dst)
    assert_landed(pair, "aux", aux_src, aux_dst)
    assert_landed(pair, "state0", np.array([], np.int64), np.array([], np.int64))  # untouched
    kv_item = 16 * TOKEN_BYTES
    assert xfer.nbytes == 5 * REGIONS * kv_item + AUX.regions * AUX.item_bytes
    want = expected_descriptors(src, dst, REGIONS, Geometry.whole_items()) + AUX.regions
    assert xfer.descriptors == pair.engine.agent.telemetry(xfer)["descriptors"] == want
    got = pair.peer.notifications(want=1, sender=pair.engine.name)
    assert got.get(pair.engine.name, []) == [tag]
    with pytest.raises(ValueError, match="does not share"):
        pair.engine.write_parts(pair.link, [("kv", src, dst), ("state0", aux_src, aux_dst)])


def test_a_link_that_fails_while_preparing_leaves_no_list_and_no_peer(
    pairs: dict[int, Pair], engines: list[TransferEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our own (joint) list cannot be prepared: the link fails and holds nothing of the
    peer's, neither a prepared list nor the NIXL peer."""
    peer = pairs[16].peer
    _, memory = allocate(kv_spec(16, aux=AUX, state=(STATE,)), seed=5)
    engine = TransferEngine(AgentConfig(), memory)
    engines.append(engine)
    real_prep = engine.agent.prep

    def prep(name: str | None, rows: np.ndarray, mem_kind: str) -> object:
        if name is None:
            raise TransferError("no memory for our list")
        return real_prep(name, rows, mem_kind)

    monkeypatch.setattr(engine.agent, "prep", prep)
    with pytest.raises(TransferError, match="no memory for our list"):
        engine.link(peer.metadata, peer.memory)
    assert engine.agent.live["dlist"] == 0 and engine.agent.live["peer"] == 0


# -- head slices (different tensor-parallel sizes) -------------------------------------------

TOKENS = 16  # the page-16 peer: 16 tokens x 64 bytes per page


@pytest.mark.parametrize(
    ("src_heads", "dst_heads", "head_bytes", "src_tp_rank", "dst_tp_rank"),
    [
        (4, 2, 32, 0, 1),  # decode TP 2x prefill TP: rank 1 takes source heads 2 and 3
        (2, 4, 16, 1, 0),  # prefill TP 2x decode TP: source rank 1 fills heads 2 and 3
    ],
    ids=["4to2-dst-rank1", "2to4-src-rank1"],
)
def test_head_slice_lands_in_its_slot(
    pairs: dict[int, Pair],
    engines: list[TransferEngine],
    src_heads: int,
    dst_heads: int,
    head_bytes: int,
    src_tp_rank: int,
    dst_tp_rank: int,
) -> None:
    peer = pairs[16].peer
    assert dst_heads * head_bytes == TOKEN_BYTES  # the peer's rows
    peer.fill()
    regions, items = 2, 8
    spec = PeerSpec(GroupSpec(regions, items, TOKENS * src_heads * head_bytes))
    src_bufs, memory = allocate(spec, seed=11)
    engine = TransferEngine(AgentConfig(), memory)
    engines.append(engine)
    geo = Geometry.head_slice(
        tokens_per_item=TOKENS,
        head_bytes=head_bytes,
        src_heads=src_heads,
        dst_heads=dst_heads,
        src_tp_rank=src_tp_rank,
        dst_tp_rank=dst_tp_rank,
    )
    link = engine.link(peer.metadata, peer.memory, {"kv": geo})
    src, dst = np.array([0, 3, 4, 5, 7]), np.array([10, 2, 33, 34, 63])
    xfer = engine.write(link, "kv", src, dst)
    moved = min(src_heads, dst_heads) * head_bytes  # bytes per token per region
    assert xfer.nbytes == regions * len(src) * TOKENS * moved
    complete(engine, [xfer])

    got = peer.read("kv")
    want = np.full_like(got, peer.spec.sentinel)
    src_rows = src_bufs["kv"].pages.reshape(regions, items, TOKENS, src_heads * head_bytes)
    want_rows = want.reshape(REGIONS, POOL, TOKENS, TOKEN_BYTES)
    if src_heads > dst_heads:  # our heads [slot*dst_heads, (slot+1)*dst_heads) -> whole row
        lo = dst_tp_rank % (src_heads // dst_heads) * moved
        want_rows[:regions, dst] = src_rows[:, src, :, lo : lo + moved]
    else:  # all our heads -> slot src_tp_rank of the row
        lo = src_tp_rank % (dst_heads // src_heads) * moved
        want_rows[:regions, dst, :, lo : lo + moved] = src_rows[:, src]
    np.testing.assert_array_equal(got, want)
    assert peer.gaps_intact("kv")

    # per-token slices are never adjacent on both sides: nothing merges
    want_descs = regions * len(src) * TOKENS
    assert expected_descriptors(src, dst, regions, geo) == want_descs
    assert xfer.descriptors == engine.agent.telemetry(xfer)["descriptors"] == want_descs
    engine.unlink(link)


def test_peer_with_fewer_regions_gets_a_prefix_list(
    pairs: dict[int, Pair], engines: list[TransferEngine]
) -> None:
    """We hold more regions of a group than the peer: only the common prefix is linked."""
    peer = pairs[16].peer
    peer.fill()
    spec = PeerSpec(GroupSpec(REGIONS + 2, POOL, 16 * TOKEN_BYTES), aux=GroupSpec(3, 8, 96))
    src_bufs, memory = allocate(spec, seed=12)
    engine = TransferEngine(AgentConfig(), memory)
    engines.append(engine)
    link = engine.link(peer.metadata, peer.memory)
    assert link.groups["kv"].num_regions == REGIONS and link.groups["aux"].num_regions == 2
    assert not link.shares("kv", "aux")  # prefixes of our lists: each in lists of its own
    src, dst = np.array([1, 2, 3, 9]), np.array([60, 61, 62, 0])
    xfers = [
        engine.write(link, "kv", src, dst),
        engine.write(link, "aux", np.array([7]), np.array([0])),
    ]
    assert xfers[0].nbytes == REGIONS * 4 * 16 * TOKEN_BYTES
    complete(engine, xfers)
    assert xfers[0].descriptors == engine.agent.telemetry(xfers[0])["descriptors"] == 2 * REGIONS
    got = peer.read("kv")
    want = np.full_like(got, peer.spec.sentinel)
    want[:, dst] = src_bufs["kv"].pages[:REGIONS, src]
    np.testing.assert_array_equal(got, want)
    aux = peer.read("aux")
    assert (aux[:, 0] == src_bufs["aux"].pages[:2, 7]).all()
    assert (aux[:, 1:] == peer.spec.sentinel).all()
    assert peer.gaps_intact("kv") and peer.gaps_intact("aux")
    engine.unlink(link)  # the prefix lists are ours to release, not shared
    assert engine.agent.live["dlist"] == 0 and engine.agent.live["peer"] == 0


# -- notifications ------------------------------------------------------------------------------


def test_each_notification_arrives_exactly_once(
    pairs: dict[int, Pair], engines: list[TransferEngine]
) -> None:
    peer = pairs[1].peer
    _, memory = allocate(kv_spec(1), seed=3)
    engine = TransferEngine(AgentConfig(), memory)  # a sender of its own: a clean mailbox
    engines.append(engine)
    link = engine.link(peer.metadata, peer.memory)
    rng = np.random.default_rng(5)
    tags = [f"room-{i}".encode() for i in range(8)]
    xfers = [
        engine.write(
            link,
            "kv",
            rng.choice(POOL, 4, replace=False),
            rng.choice(POOL, 4, replace=False),
            notif=tag,
        )
        for tag in tags
    ]
    complete(engine, xfers)
    got = peer.notifications(want=len(tags), timeout=DEADLINE_S, sender=engine.name)
    assert sorted(got.get(engine.name, [])) == sorted(tags)  # all of them, none twice
    later = peer.notifications(want=0, timeout=0.3, sender=engine.name)
    assert later.get(engine.name, []) == []  # and no duplicate turns up afterwards
    engine.unlink(link)


# -- peers that go away -------------------------------------------------------------------------


def small_spec(**kw: object) -> PeerSpec:
    return PeerSpec(GroupSpec(2, 32, 256), **kw)  # type: ignore[arg-type]


def small_pair(
    spawn: Callable[[PeerSpec], PeerProcess], engines: list[TransferEngine], seed: int
) -> Pair:
    """Our engine over random bytes, linked to a fresh small peer (closed after the test)."""
    spec = small_spec()
    src, memory = allocate(spec, seed=seed)
    engine = TransferEngine(AgentConfig(), memory)
    engines.append(engine)
    peer = spawn(spec)
    return Pair(engine, src, peer, engine.link(peer.metadata, peer.memory))


def test_write_to_killed_peer_ends_in_err(
    spawn: Callable[[PeerSpec], PeerProcess], engines: list[TransferEngine]
) -> None:
    pair = small_pair(spawn, engines, seed=1)
    engine, peer, link = pair.engine, pair.peer, pair.link
    peer.kill()  # gone before the first WRITE ever connects
    started = time.monotonic()
    try:
        xfer = engine.write(link, "kv", np.arange(4), np.arange(4), notif=b"lost")
    except TransferError as exc:  # refused while building: a failure, not a hang
        assert str(exc)
    else:
        assert settle(engine, xfer) == "ERR"
        assert xfer.error
        assert engine.release(xfer) is True
    assert time.monotonic() - started < DEADLINE_S
    engine.unlink(link)
    assert engine.agent.live["peer"] == 0 and engine.agent.live["xfer"] == 0


@pytest.mark.parametrize("same_name", [False, True], ids=["new-name", "same-name"])
def test_restarted_peer_is_relinked(
    spawn: Callable[[PeerSpec], PeerProcess], engines: list[TransferEngine], same_name: bool
) -> None:
    name = f"decode-{uuid.uuid4().hex[:8]}" if same_name else None
    spec = small_spec(name=name)
    src_bufs, memory = allocate(spec, seed=2)
    engine = TransferEngine(AgentConfig(), memory)
    engines.append(engine)

    old = spawn(spec)
    link = engine.link(old.metadata, old.memory)
    complete(engine, [engine.write(link, "kv", np.arange(8), np.arange(8))])
    old.kill()

    try:  # the stale link's WRITE fails: at build time, at post time or while polled
        xfer = engine.write(link, "kv", np.arange(8), np.arange(8))
    except TransferError:
        pass
    else:
        assert settle(engine, xfer) == "ERR" and xfer.error
        assert engine.release(xfer) is True

    new = spawn(spec)  # new buffers (another process), same or new agent name
    assert (new.name == old.name) == same_name
    if same_name:  # NIXL keeps the dead agent's metadata until it is removed
        before = dict(engine.agent.live)
        with pytest.raises(TransferError):
            engine.link(new.metadata, new.memory)
        assert dict(engine.agent.live) == before  # the failed link leaked nothing
    engine.unlink(link)
    assert engine.agent.live["peer"] == 0

    link = engine.link(new.metadata, new.memory)
    rng = np.random.default_rng(9)
    src, dst = rng.choice(32, 12, replace=False), rng.choice(32, 12, replace=False)
    complete(engine, [engine.write(link, "kv", src, dst)])
    pair = Pair(engine, src_bufs, new, link)
    assert_landed(pair, "kv", src, dst)
    np.testing.assert_array_equal(new.read("kv", dst), src_bufs["kv"].pages[:, src])
    assert engine.agent.live["peer"] == 1
    assert engine.agent.live["xfer"] == 0


# -- leaks --------------------------------------------------------------------------------------


def test_nothing_leaks_after_many_transfers(pairs: dict[int, Pair]) -> None:
    peer = pairs[16].peer
    spec = kv_spec(16, aux=AUX, state=(STATE,))
    _, memory = allocate(spec, seed=4)
    engine = TransferEngine(AgentConfig(), memory)
    try:
        link = engine.link(peer.metadata, peer.memory)
        live = engine.agent.live
        assert live["registration"] == 3 and live["peer"] == 1
        # a local and a remote list for state0, and for kv and aux together (one each)
        assert live["dlist"] == 4
        handles = set(engine.agent._dlists)
        rng = np.random.default_rng(1)
        for i in range(40):
            batch = [
                engine.write(
                    link,
                    "kv",
                    rng.choice(POOL, 8, replace=False),
                    rng.choice(POOL, 8, replace=False),
                    notif=b"" if i % 2 else b"n",
                ),
                engine.write(link, "aux", np.array([i % 8]), np.array([(i * 3) % 8])),
                engine.write(link, "state0", np.array([i % 10]), np.array([(i + 1) % 10])),
            ]
            assert live["xfer"] == 3
            handles.update(x.handle for x in batch)
            complete(engine, batch)  # each release returns True once DONE
            assert live["xfer"] == 0
        engine.unlink(link)
        assert live["peer"] == 0 and live["xfer"] == 0
        assert live["dlist"] == 2  # our own (shared) lists stay until close
        relinked = engine.link(peer.metadata, peer.memory)  # shared local lists are reused
        assert live["dlist"] == 4 and live["peer"] == 1
        handles.update(g.remote.dlist for g in relinked.groups.values())
        engine.unlink(relinked)
    finally:
        engine.close()
    assert all(v == 0 for v in engine.agent.live.values()), engine.agent.live
    assert all(h._released for h in handles)  # NIXL itself freed every handle
    got = peer.notifications(want=20, timeout=DEADLINE_S, sender=engine.name)
    assert got.get(engine.name) == [b"n"] * 20  # every non-empty notif, once; empty ones: none


def test_warm_up_writes_only_the_padding_page_and_a_dead_peer_fails_it(
    spawn: Callable[[PeerSpec], PeerProcess], engines: list[TransferEngine]
) -> None:
    """``warm`` WRITEs item 0 of every KV region into the peer's item 0 (SGLang's padding
    page), byte for byte and nothing else, as many times as a request has descriptors
    (within a byte bound); against a killed peer it raises within bounds."""
    pair = small_pair(spawn, engines, seed=5)
    engine, link = pair.engine, pair.link
    g = link.groups["kv"]
    items = warm_items(link)
    assert items * g.num_regions >= WARM_DESCRIPTORS or items == WARM_MAX_BYTES // g.unit_bytes
    assert items * g.unit_bytes <= max(WARM_MAX_BYTES, g.unit_bytes)
    assert engine.warm(link) > 0
    assert_landed(pair, "kv", np.array([0]), np.array([0]))
    assert engine.agent.live["xfer"] == 0

    gone = spawn(small_spec())
    dead = engine.link(gone.metadata, gone.memory)
    gone.kill()
    started = time.monotonic()
    with pytest.raises(TransferError, match="warm-up WRITE"):
        engine.warm(dead, timeout_s=2.0)
    assert time.monotonic() - started < DEADLINE_S
    engine.unlink(dead)
    engine.unlink(link)


def test_a_warm_up_in_flight_is_counted_apart_from_requests_writes(
    spawn: Callable[[PeerSpec], PeerProcess], engines: list[TransferEngine]
) -> None:
    """A peer's setup posts warm-ups in the background (a staging area offered after the
    last request, seen in the gate): while one is in flight, ``live["xfer"]``, the count
    that must read zero once every request settled, stays zero; it has its own count."""
    pair = small_pair(spawn, engines, seed=6)
    engine, link = pair.engine, pair.link
    zero = np.zeros(1, dtype=np.int64)
    warm = engine.write(link, "kv", zero, zero, warmup=True)
    req = engine.write(link, "kv", np.array([3]), np.array([4]))
    assert warm is not None and req is not None
    live = engine.agent.live
    assert (live[WARMUP], live["xfer"]) == (1, 1)  # counted when posted, done or not
    assert settle(engine, warm) == "DONE" and settle(engine, req) == "DONE", warm.error or req.error
    assert engine.release(req) and (live[WARMUP], live["xfer"]) == (1, 0)
    assert engine.release(warm) and (live[WARMUP], live["xfer"]) == (0, 0)
    assert_landed(pair, "kv", np.array([0, 3]), np.array([0, 4]))
    engine.unlink(link)


def test_host_warm_up_writes_the_first_aux_row_into_the_peers_scratch_only(
    spawn: Callable[[PeerSpec], PeerProcess], engines: list[TransferEngine]
) -> None:
    """``warm_host`` WRITEs the start of our first aux row into the peer's scratch buffer
    (host to host, as every request's aux rows go), byte for byte, and touches none of
    the peer's aux rows; a peer without host aux rows on our side gets nothing."""
    spec = PeerSpec(GroupSpec(2, 32, 256), aux=GroupSpec(2, 8, 96), scratch=True)
    src, memory = allocate(spec, seed=11)
    engine = TransferEngine(AgentConfig(), memory)
    engines.append(engine)
    peer = spawn(spec)
    link = engine.link(peer.metadata, peer.memory)
    assert peer.scratch is not None
    ptr, length = peer.scratch
    assert length == SCRATCH_BYTES and not peer.read_scratch().any()
    assert engine.warm_host(link, ptr, length) > 0
    got = peer.read_scratch()
    assert np.array_equal(got[:96], src["aux"].pages[0, 0])  # aux region 0, row 0
    assert not got[96:].any()
    assert np.all(peer.read("aux") == spec.sentinel) and peer.gaps_intact("aux")
    assert engine.agent.live["xfer"] == 0

    bare = TransferEngine(AgentConfig(), allocate(small_spec(), seed=12)[1])  # no aux rows
    engines.append(bare)
    assert bare.warm_host(bare.link(peer.metadata, peer.memory), ptr, length) == 0.0
    engine.unlink(link)
