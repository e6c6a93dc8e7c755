"""A prefill room from first destination to its end, driven in process: the control
thread's and transfer worker's logic called directly, over a fake engine and a fake of
SGLang's tables (no SGLang, no sockets, no threads). Every terminal path must drain the
room's record, the worker's active set and the in-flight count SGLang holds Success on."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from sgl_nixl_plugin.engine.agent import Xfer
from sgl_nixl_plugin.engine.links import PeerLink
from sgl_nixl_plugin.engine.one_pass import KernelXfer
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.protocol.prefill_rooms import Chunk, TransferInfo
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides.context import Identity, PrefillContext
from sgl_nixl_plugin.sides.prefill_control import PrefillControl
from sgl_nixl_plugin.sides.staged_path import StagedJob
from sgl_nixl_plugin.sides.transfer_worker import TransferWorker
from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.messages import Abort
from sgl_nixl_plugin.wire.notes import Note, decode_note

ROOM, AGENT = 41, "decode-0"
OPEN, FAILED, SUCCESS = 2, 0, 4


class FakeSGLang:
    """The part of SGLang's manager ``SGLangRooms`` reaches, as plain tables."""

    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.infos: dict[int, dict[str, TransferInfo]] = {}
        self.outstanding: dict[int, int] = {}
        self.concluded: list[tuple[int, str]] = []
        self.acked: list[int] = []
        self.ack_targets: set[int] = set()

    def exists(self, room: int) -> bool:
        return room in self.status

    def is_open(self, room: int) -> bool:
        return self.status.get(room) not in (None, FAILED, SUCCESS)

    def is_failed_or_gone(self, room: int) -> bool:
        return self.status.get(room) in (None, FAILED)

    def fail(self, room: int, reason: str) -> bool:
        if not self.is_open(room):
            return False
        self.status[room] = FAILED
        return True

    def fail_unless_done(self, room: int, reason: str) -> None:
        if room in self.status and self.status[room] != SUCCESS:
            self.status[room] = FAILED

    def conclude_failure(self, room: int, reason: str, only_open: bool = False) -> bool:
        if self.status.get(room) == SUCCESS or (only_open and not self.is_open(room)):
            return False
        self.concluded.append((room, "failed: " + reason))
        if room in self.status:
            self.status[room] = FAILED
        return True

    def conclude_success(self, room: int) -> bool:
        self.concluded.append((room, "success"))
        self.status[room] = SUCCESS
        return True

    def destinations(self, room: int) -> dict[str, TransferInfo]:
        return self.infos.get(room) or {}

    def add_destination(self, info: TransferInfo) -> int | None:
        infos = self.infos.setdefault(info.room, {})
        if info.agent in infos:
            return None
        infos[info.agent] = info
        return len(infos)

    def rooms_with_destinations(self) -> list:
        return list(self.infos.items())

    def mirror_in_flight(self, room: int, n: int) -> None:
        assert n >= 0, n
        if n:
            self.outstanding[room] = n
            return
        self.outstanding.pop(room, None)
        if room in self.ack_targets:
            self.acked.append(room)

    def ack_abort_when_drained(self, room: int, ip: str, port: int, generation: int) -> None:
        self.ack_targets.add(room)
        if room not in self.outstanding:
            self.acked.append(room)

    def mark_ready(self, room: int) -> None:
        self.status[room] = OPEN

    def set_decode_prefix_len(self, room: int, n: int) -> None:
        pass

    def clear(self, room: int) -> None:
        """SGLang's sender.clear(): its tables forget the room."""
        self.status.pop(room, None)
        self.infos.pop(room, None)


class FakeEngine:
    """WRITEs that stay in flight until the test settles them."""

    def __init__(self) -> None:
        self.posted: list[Xfer] = []
        self.notes: list[bytes] = []  # each WRITE's notification, in posting order
        self.groups: list[list[str]] = []  # the groups in each WRITE, in posting order
        self.memory = SimpleNamespace(kv=SimpleNamespace(ptrs=[0], lens=[1 << 20]))
        self.agent = SimpleNamespace(telemetry=lambda x: None, abandon=lambda x: None)

    def write(
        self, link: Any, group: str, src: np.ndarray, dst: np.ndarray, notif: bytes = b""
    ) -> Xfer:
        x = Xfer(handle=None, peer=link.name, nbytes=64 * len(src), descriptors=1)
        self.posted.append(x)
        self.notes.append(notif)
        return x

    def write_parts(self, link: Any, parts: list, notif: bytes = b"") -> Xfer:
        """The worker posts through this: one WRITE of ``parts`` (groups in ``groups``)."""
        self.groups.append([p[0] for p in parts])
        if len(parts) == 1:
            return self.write(link, *parts[0], notif=notif)
        src = np.concatenate([p[1] for p in parts])
        return self.write(link, "+".join(p[0] for p in parts), src, src, notif=notif)

    def poll(self, x: Xfer) -> str:
        return x.state

    def release(self, x: Xfer) -> bool:
        return True


class Transport:
    def __init__(self) -> None:
        self.sent: list[tuple[tuple[str, int], Any]] = []

    def send(self, ep, msg, arrays=()) -> bool:
        self.sent.append((ep, msg))
        return True


@pytest.fixture
def side():
    sg, engine = FakeSGLang(), FakeEngine()
    ctx = PrefillContext(
        me=Identity("prefill-0", "127.0.0.1", 7000, 0),
        settings=Settings(),
        codec=Codec(),
        transport=Transport(),
        engine=engine,
        sglang=sg,
        zmq_ctx=None,
        server_socket=None,
        mem_kind="DRAM",
    )
    link = PeerLink(AGENT)
    ctx.peers.accepted[AGENT] = DecodePeer(AGENT, link, None, ("127.0.0.1", 7001))
    worker = TransferWorker(ctx, 0)
    return SimpleNamespace(ctx=ctx, sg=sg, engine=engine, worker=worker)


def _destination(side, room: int = ROOM, pages: int = 4) -> None:
    info = TransferInfo(room, AGENT, "127.0.0.1", 7001, np.arange(pages), -1, [], 1, False)
    side.sg.add_destination(info)
    side.ctx.rooms.open(room)
    side.sg.mark_ready(room)


def _chunk(room: int = ROOM, start: int = 0, n: int = 4, last: bool = True) -> Chunk:
    return Chunk(room, np.arange(start, start + n), slice(start, start + n), last, None, None)


def _drained(side, room: int = ROOM) -> None:
    assert room not in side.ctx.rooms and not side.worker.active
    assert room not in side.sg.outstanding, side.sg.outstanding


def test_success_closes_the_record_after_the_last_write(side):
    _destination(side)
    side.worker.submit(_chunk(n=2, last=False))
    side.worker.submit(_chunk(start=2, n=2, last=True))
    assert side.sg.outstanding[ROOM] == 2 and ROOM in side.ctx.rooms
    side.engine.posted[0].state = "DONE"
    side.worker.poll()
    assert side.sg.concluded == [] and ROOM in side.ctx.rooms  # one WRITE still in flight
    side.engine.posted[1].state = "DONE"
    side.worker.poll()
    assert side.sg.concluded == [(ROOM, "success")]
    _drained(side)


def test_a_failed_write_fails_the_room_once_and_drains(side):
    _destination(side)
    side.worker.submit(_chunk(n=2, last=False))
    side.worker.submit(_chunk(start=2, n=2, last=True))
    side.engine.posted[0].state, side.engine.posted[0].error = "ERR", "remote hung up"
    side.worker.poll()
    assert side.sg.concluded == [(ROOM, "failed: remote hung up")]
    assert ROOM in side.ctx.rooms  # draining: the other WRITE is still in flight
    side.engine.posted[1].state = "DONE"
    side.worker.poll()
    assert side.sg.concluded == [(ROOM, "failed: remote hung up")]  # still once, no Success
    _drained(side)


def test_an_abort_mid_transfer_acks_only_after_the_write_drained(side):
    _destination(side)
    side.worker.submit(_chunk())
    control = PrefillControl(side.ctx, wake=lambda room: None, recall=lambda room: None)
    control.on_abort(Abort(ROOM, "127.0.0.1", 7001, generation=3))
    assert side.sg.status[ROOM] == FAILED and side.sg.acked == []  # the WRITE may still land
    side.worker.poll()
    assert ROOM in side.ctx.rooms and side.sg.acked == []
    side.engine.posted[0].state = "DONE"
    side.worker.poll()
    assert side.sg.acked == [ROOM] and not [c for c in side.sg.concluded if c[1] == "success"]
    _drained(side)


def test_a_lost_decode_fails_the_next_chunk_with_its_name(side):
    _destination(side)
    side.worker.submit(_chunk(n=2, last=False))
    side.engine.posted[0].state = "DONE"
    side.worker.poll()
    del side.ctx.peers.accepted[AGENT]  # the control thread dropped the peer
    side.worker.submit(_chunk(start=2, n=2, last=True))
    assert side.sg.concluded == [(ROOM, f"failed: decode {AGENT} is no longer connected")]
    _drained(side)


def test_a_sender_cleared_between_chunks_is_closed_by_its_worker(side):
    _destination(side)
    side.worker.submit(_chunk(n=2, last=False))
    side.engine.posted[0].state = "DONE"
    side.worker.poll()
    assert ROOM in side.ctx.rooms and ROOM in side.worker.active
    side.sg.clear(ROOM)  # SGLang gave up on the request and cleared its sender
    side.ctx.rooms.release(ROOM)
    side.worker.poll()
    assert side.sg.concluded == []
    _drained(side)


def test_a_room_whose_sender_never_sent_is_closed_at_release(side):
    _destination(side)
    side.sg.clear(ROOM)
    side.ctx.rooms.release(ROOM)
    _drained(side)


def test_a_chunk_for_a_room_with_no_destination_fails_it(side):
    side.sg.status[ROOM] = OPEN
    side.worker.submit(_chunk())
    assert side.sg.concluded == [(ROOM, "failed: no decode destination was received for this room")]
    _drained(side)


def test_an_abort_before_the_sender_exists_is_remembered_for_it(side):
    control = PrefillControl(side.ctx, wake=lambda room: None, recall=lambda room: None)
    control.on_abort(Abort(99, "127.0.0.1", 7001, None, "prefill refused this decode"))
    assert side.ctx.early.claim(99) == "decode 127.0.0.1:7001: prefill refused this decode"
    assert side.ctx.early.claim(99) is None


def test_an_abort_for_a_room_that_already_ended_here_is_not_noted_for_a_sender(side, caplog):
    """The decode's abort crossed the room's Success and SGLang cleared the sender: the
    room is over, not early. Nothing is kept for a sender that will never come, and the log
    does not say the decode gave the room up before it got here."""
    _destination(side)
    side.worker.submit(_chunk())
    side.engine.posted[0].state = "DONE"
    side.worker.poll()
    assert side.sg.concluded == [(ROOM, "success")]
    _drained(side)
    side.sg.clear(ROOM)
    control = PrefillControl(side.ctx, wake=lambda room: None, recall=lambda room: None)
    with caplog.at_level(logging.DEBUG, logger="sgl_nixl_plugin.sides.prefill_control"):
        control.on_abort(Abort(ROOM, "127.0.0.1", 7001, None, "client went away"))
    assert len(side.ctx.early) == 0 and side.ctx.early.claim(ROOM) is None
    lines = [r.getMessage() for r in caplog.records]
    assert not any("before it got here" in m for m in lines), lines
    assert any(f"room {ROOM}: abort after the room ended here (succeeded)" in m for m in lines)


def test_an_abort_racing_the_senders_creation_still_fails_the_room(side):
    """SGLang's scheduler made the sender (and it found no abort to claim) between the
    control thread's first look and its note: the abort must still fail the room."""
    control = PrefillControl(side.ctx, wake=lambda room: None, recall=lambda room: None)
    note = side.ctx.early.note

    def sender_made_meanwhile(room, reason, now=None):
        side.sg.status[room] = OPEN  # made, in SGLang's table ...
        assert side.ctx.early.claim(room) is None  # ... and its claim found nothing yet
        note(room, reason, now)

    side.ctx.early.note = sender_made_meanwhile
    control.on_abort(Abort(98, "127.0.0.1", 7001, None, "prefill refused this decode"))
    assert side.sg.status[98] == FAILED
    assert side.ctx.early.claim(98) is None  # nothing left behind for a later sender


@pytest.mark.parametrize("made", [False, True], ids=["before-the-sender", "sender-made"])
def test_a_refused_decodes_request_fails_the_room_now_or_at_its_senders_creation(side, made):
    """A pipeline stage that refused the decode gets its request for a room whose sender
    SGLang has not made yet: the sender fails at its creation instead of waiting for the
    bootstrap timeout."""
    from sgl_nixl_plugin.sides.prefill_requests import file_request
    from sgl_nixl_plugin.wire.messages import TransferRequest, TransferStatus

    side.ctx.peers.refused["decode-1"] = "state buffers are per stage"
    if made:
        side.sg.status[97] = OPEN
    req = TransferRequest(97, "decode-1", "127.0.0.1", 7002, -1, 1)
    replies = SimpleNamespace(sent=[])
    registrations = SimpleNamespace(reply=lambda *a, **k: replies.sent.append(a))
    file_request(side.ctx, registrations, req, None, [])  # type: ignore[arg-type]
    ep, status = side.ctx.transport.sent[-1]
    assert ep == ("127.0.0.1", 7002) and isinstance(status, TransferStatus)
    assert (status.room, status.status, status.reason) == (
        97,
        FAILED,
        "state buffers are per stage",
    )
    assert replies.sent == []  # a refusal is final: no invitation to register again
    if made:
        assert side.sg.status[97] == FAILED and side.ctx.early.claim(97) is None
    else:
        assert 97 not in side.sg.status
        assert side.ctx.early.claim(97) == "state buffers are per stage"


def test_a_finished_room_reports_where_its_time_went(side, monkeypatch, caplog):
    """One DEBUG line per room and ``TransferEvent.timeline``: each step's milliseconds,
    in order (ready, first chunk, first WRITE, WRITEs), adding up to the wall time."""
    events: list[Any] = []
    monkeypatch.setattr("sgl_nixl_plugin.sides.context.registry.notify_transfer", events.append)
    _destination(side)
    rec = side.ctx.rooms.get(ROOM)
    rec.ready_at, rec.started = rec.started, rec.started - 1e-3  # filed 1 ms before ready
    side.worker.submit(_chunk(n=2, last=False))
    side.worker.submit(_chunk(start=2, n=2, last=True))
    rec.last_chunk_at -= 2e-3  # the last chunk came 2 ms before the end
    for x in side.engine.posted:
        x.state = "DONE"
    with caplog.at_level("DEBUG", logger="sgl_nixl_plugin.sides.context"):
        side.worker.poll()
    assert side.sg.concluded == [(ROOM, "success")]
    (event,) = events
    t = event.timeline
    steps = ("to_ready_ms", "to_chunk_ms", "to_post_ms", "writes_ms")
    assert set(steps) <= set(t) and t["to_ready_ms"] == 1.0
    assert all(t[k] >= 0 for k in steps) and t["wall_ms"] > 0
    assert abs(sum(t[k] for k in steps) - t["wall_ms"]) < 0.01
    # chunked prefill: what the request waited for after its last forward pass
    assert t["chunks"] == 2 and 2.0 <= t["after_last_ms"] < 2.0 + t["writes_ms"]
    (line,) = [r.getMessage() for r in caplog.records if "sgl-nixl room" in r.getMessage()]
    assert line.startswith(f"sgl-nixl room {ROOM}: ok peer={AGENT} path=direct bytes=256 ")
    assert "wall_ms=" in line and "to_post_ms=" in line and " chunks=2" in line


def test_a_decode_prefix_must_end_on_a_prefill_page_across_page_sizes():
    """SGLang's prefill sends from the decode's cached prefix on, in its own pages: with
    other page sizes that prefix (a whole number of decode pages) must also end on a
    prefill page, or the pairing would put the first page's tokens one offset off."""
    from sgl_nixl_plugin.sides.prefill_requests import _prefix_misaligned

    assert _prefix_misaligned(0, (16, 64)) is None
    assert _prefix_misaligned(None, (16, 64)) is None
    assert _prefix_misaligned(128, (16, 64)) is None  # 2 decode pages, 8 prefill pages
    why = _prefix_misaligned(64, (48, 64))
    assert why is not None and "64 tokens" in why and "prefill page of 48" in why


def test_a_staged_chunk_gathers_before_the_aux_and_state_writes_are_posted(side, monkeypatch):
    """The gather starts the room's data path; the aux row and state WRITEs (NIXL calls
    of ~0.1 ms each) are posted after its launch, not ahead of it."""
    order: list[str] = []

    class Send:
        finished = in_flight = False
        remote_free: list[int] = []
        posted = settled = 0
        error = None
        needs_polling = True

        def step(self) -> list:
            order.append("gather")
            return []

        def abandon(self, reason: str = "") -> None:
            pass

    def staged(rec, info, peer, src, dst, first):
        return StagedJob(Send(), info, peer, first, len(src), src, dst)  # type: ignore[arg-type]

    real_write = side.engine.write

    def write(link: Any, group: str, src: np.ndarray, dst: np.ndarray, notif: bytes = b"") -> Xfer:
        order.append(group)
        return real_write(link, group, src, dst)

    monkeypatch.setattr(side.worker.staged, "job_for", staged)
    monkeypatch.setattr(side.engine, "write", write)
    info = TransferInfo(ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), 3, [np.array([5])], 1, False)
    side.sg.add_destination(info)
    side.ctx.rooms.open(ROOM)
    side.sg.mark_ready(ROOM)
    chunk = Chunk(ROOM, np.arange(4), slice(0, 4), True, 2, [np.array([6])])
    side.worker.submit(chunk)
    assert order == ["gather", "aux", "state0"], order


def test_the_path_rule_is_told_while_the_decodes_staging_area_is_not_here(side, monkeypatch):
    """Until the decode's staging area arrived (``DecodePeer.staging``), a staged chunk
    would wait for slots that come only after the decode allocated it: the path rule is
    told so (``area_pending``), and not once the area is there."""
    from sgl_nixl_plugin.sides import staged_path

    told: list[bool] = []
    real = staged_path.choose_path

    def choose_path(**kw: Any) -> str:
        told.append(kw["area_pending"])
        return real(**kw)

    monkeypatch.setattr(staged_path, "choose_path", choose_path)
    _destination(side, ROOM)
    side.worker.submit(_chunk(ROOM))
    side.ctx.peers.accepted[AGENT].staging = SimpleNamespace(slot_bytes=1 << 20)
    _destination(side, ROOM + 1)
    side.worker.submit(_chunk(ROOM + 1))
    assert told == [True, False]


def test_a_post_that_raises_after_the_kv_write_still_waits_for_it(side):
    """The state indices disagree (a decode's request, checked only once SGLang's send()
    brings the prefill's own): the room fails, but the KV and aux WRITEs posted before
    the check are in flight and count until they settle. Untracked, the room closed at
    once (an abort's ACK could precede bytes still landing) and their handles leaked."""
    info = TransferInfo(ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), 3, [np.arange(2)], 1, False)
    side.sg.add_destination(info)
    side.ctx.rooms.open(ROOM)
    side.sg.mark_ready(ROOM)
    released: list[Xfer] = []
    side.engine.release = lambda x: released.append(x) or True
    side.worker.submit(Chunk(ROOM, np.arange(4), slice(0, 4), True, 2, [np.arange(3)]))
    why = "failed: state[0]: prefill has 3 indices, decode 2"
    assert side.sg.concluded == [(ROOM, why)]
    assert len(side.engine.posted) == 2  # the KV pages and the aux row
    assert ROOM in side.ctx.rooms and side.sg.outstanding[ROOM] == 2  # draining
    for x in side.engine.posted:
        x.state = "DONE"
    side.worker.poll()
    assert released == side.engine.posted and side.sg.concluded == [(ROOM, why)]
    _drained(side)


def test_a_one_pass_copy_launched_before_a_refused_post_is_waited_for(side):
    """The one-pass copy writes into the decode's pages until it has run: when a later
    post of the chunk is refused, the room fails but holds (no abort ACK, no close) until
    the copy is seen done, and the worker's count of running copies comes back to 0."""
    launched: list[KernelXfer] = []

    class OnePass:
        flags = None  # no completion flags: the status ends the room

        def write(self, copier: Any, src: np.ndarray, dst: np.ndarray, stream: Any) -> KernelXfer:
            x = KernelXfer(handle=None, peer=AGENT, nbytes=64 * len(src), descriptors=0)
            launched.append(x)
            return x

    side.ctx.peers.accepted[AGENT].link.one_pass = OnePass()
    side.ctx.copier = object()  # a GPU copier (never called by the fake link)
    info = TransferInfo(ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), 3, [np.arange(2)], 1, False)
    side.sg.add_destination(info)
    side.ctx.rooms.open(ROOM)
    side.sg.mark_ready(ROOM)
    side.worker.submit(Chunk(ROOM, np.arange(4), slice(0, 4), True, 2, [np.arange(3)]))
    why = "failed: state[0]: prefill has 3 indices, decode 2"
    assert len(launched) == 1 and side.worker.kernels == 1
    assert side.sg.concluded == [(ROOM, why)]
    assert ROOM in side.ctx.rooms and side.sg.outstanding[ROOM] == 2  # the copy, the aux row
    (aux,) = side.engine.posted
    aux.state = "DONE"
    side.worker.poll()
    assert ROOM in side.ctx.rooms  # the copy still runs
    launched[0].state = "DONE"
    side.worker.poll()
    assert side.worker.kernels == 0 and side.sg.concluded == [(ROOM, why)]
    _drained(side)


# -- a decode dropped while a chunk of its room is submitted ------------------------------


class RecordingAgent:
    """The NIXL calls ``TransferEngine`` makes, recorded; WRITEs stay in flight."""

    def __init__(self) -> None:
        self.posted: list[Xfer] = []
        self.released_lists: list[str] = []
        self.removed: list[str] = []

    def write(
        self, local, lidx, remote, ridx, *, peer, nbytes, descriptors, notif=b"", warmup=False
    ):
        x = Xfer(handle=None, peer=peer, nbytes=nbytes, descriptors=descriptors)
        self.posted.append(x)
        return x

    def poll(self, x: Xfer) -> str:
        return x.state

    def release(self, x: Xfer) -> bool:
        return True

    def abandon(self, x: Xfer) -> None:
        pass

    def telemetry(self, x: Xfer) -> None:
        return None

    def release_dlist(self, handle: str) -> None:
        self.released_lists.append(handle)

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)


def _real_engine(side) -> tuple[Any, Any]:
    """Swap the fake engine for the real ``TransferEngine`` (over a recording agent) with
    one prepared KV group to the decode."""
    from sgl_nixl_plugin.engine.engine import GroupLink, TransferEngine, _Side
    from sgl_nixl_plugin.engine.layout import Geometry

    engine = object.__new__(TransferEngine)
    engine.agent = RecordingAgent()
    engine.memory = side.engine.memory
    engine._local_lists = {}
    one = np.zeros(1, dtype=np.int64)
    link = PeerLink(AGENT)
    link.groups["kv"] = GroupLink(
        Geometry.whole_items(), _Side("local", one), _Side("remote", one), 64, 1, 16, 16
    )
    side.ctx.engine = engine
    side.ctx.peers.accepted[AGENT].link = link
    return engine, link


def test_a_write_on_a_closed_link_is_refused_not_skipped(side):
    """``unlink`` closes the link: a WRITE posted on it after raises (the room fails) where
    it returned None (nothing posted, and the room went on to Success)."""
    from sgl_nixl_plugin.engine.agent import TransferError

    engine, link = _real_engine(side)
    assert engine.write(link, "kv", np.arange(2), np.arange(2)) is not None
    engine.unlink(link)
    assert link.closed and engine.agent.released_lists == ["remote", "local"]
    with pytest.raises(TransferError, match=f"decode {AGENT} was dropped"):
        engine.write(link, "kv", np.arange(2), np.arange(2))


def test_a_chunk_submitted_while_its_decode_is_dropped_never_ends_in_success(side, monkeypatch):
    """Liveness drops the decode (its link is closed, its rooms failed) while the worker
    submits the room's last chunk, having looked its peer up just before: the room must
    not conclude Success with nothing written. It did when the chunk came between the
    unlink and the failing of the rooms: every WRITE on the emptied link was skipped, so
    nothing was in flight, and the room was not failed yet."""
    engine, link = _real_engine(side)
    _destination(side)
    control = PrefillControl(side.ctx, wake=lambda room: None, recall=lambda room: None)
    peer = side.ctx.peers.get(AGENT)
    real_unlink = engine.unlink

    def unlink_then_the_worker_runs(lnk: Any) -> None:
        real_unlink(lnk)
        # the worker thread, right after the link closed, with the peer it looked up
        # before the control thread took it out of the table
        monkeypatch.setattr(side.ctx.peers, "get", lambda agent: peer)
        side.worker.submit(_chunk())

    monkeypatch.setattr(engine, "unlink", unlink_then_the_worker_runs)
    control.registrations.drop(AGENT, "closed its connection")
    assert engine.agent.posted == []
    assert [c for c in side.sg.concluded if c[1] == "success"] == [], side.sg.concluded
    assert side.sg.concluded and side.sg.status[ROOM] == FAILED
    _drained(side)


# -- a WRITE stuck to a decode that is gone ------------------------------------------------


@pytest.mark.parametrize("how", ["liveness", "abort"])
def test_a_write_stuck_in_a_room_failed_elsewhere_is_given_up_within_the_drain_bound(side, how):
    """The decode is partitioned: the room's WRITE stays in flight. Liveness (or the
    decode's abort) fails the room on the control thread while SGLang's sender still
    exists. The worker must give that WRITE up once it is older than the drain bound, so
    the room closes, its in-flight count (and an abort's ACK) comes back, and its handle
    is freed. It polled it until SGLang cleared the sender, without a bound of its own."""
    abandoned: list[Xfer] = []
    side.engine.agent.abandon = abandoned.append
    _destination(side)
    side.worker.submit(_chunk())
    (x,) = side.engine.posted  # PROC for good: the link is cut
    if how == "liveness":
        side.ctx.fail_rooms_of_peer(AGENT, f"decode {AGENT} stopped answering")
    else:
        control = PrefillControl(side.ctx, wake=lambda room: None, recall=lambda room: None)
        control.on_abort(Abort(ROOM, "127.0.0.1", 7001, generation=3))
    assert side.sg.status[ROOM] == FAILED and ROOM in side.sg.status  # sender not cleared
    side.worker.poll()
    assert abandoned == [] and ROOM in side.ctx.rooms  # within the bound: it may land
    x.started -= side.ctx.settings.abort_drain_timeout_s + 1
    side.worker.poll()
    assert abandoned == [x]
    assert not [c for c in side.sg.concluded if c[1] == "success"]
    if how == "abort":
        assert side.sg.acked == [ROOM]
    _drained(side)


# -- one outcome per room, whichever thread decides it -------------------------------------


class SGLangManager:
    """SGLang's own conclusion logic (``CommonKVManager``'s methods) over plain tables;
    status messages to decodes are recorded. ``pause_success`` holds the thread that
    concludes Success between SGLang's check of the room and its update of the status."""

    def __init__(self) -> None:
        import threading

        from sglang.srt.disaggregation.common.conn import CommonKVManager as M

        for name in ("conclude_transfer", "conclude_failure", "record_failure"):
            setattr(self, name, getattr(M, name).__get__(self))
        self._update_status = M.update_status.__get__(self)
        self._room_notify_targets = M._room_notify_targets.__get__(self)
        self.request_status: dict[int, Any] = {}
        self.failure_records: dict[int, str] = {}
        self.failure_lock = threading.Lock()
        self.transfer_infos: dict[int, dict[str, TransferInfo]] = {}
        self._staging_outstanding: dict[int, int] = {}
        self._deferred_ack_targets: dict = {}
        self._deferred_ack_poisoned_rooms: set = set()
        self.deferred_bootstrap = None
        self.sent: list[tuple[int, Any]] = []
        self.checked, self.go = threading.Event(), threading.Event()
        self.pause_success = False

    def update_status(self, room: int, status: Any) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        if status == KVPoll.Success and self.pause_success:
            self.checked.set()
            assert self.go.wait(10), "the test never let the worker go on"
        self._update_status(room, status)

    def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
        self.sent.append((bootstrap_room, status))


def test_a_room_failed_while_its_success_is_concluded_keeps_one_outcome():
    """The worker concludes Success (SGLang checked the room: not failed) while liveness
    fails the room's decode on the control thread. Only one of them may decide: the
    decode is told Success and the prefill's room ends Success, or both are Failed.
    Without one lock over check and update the failure came between them: the prefill's
    room ended Failed (its poll reports Failed) while the decode was sent Success too."""
    import threading

    from sglang.srt.disaggregation.base.conn import KVPoll

    from sgl_nixl_plugin.adapter.sglang_rooms import SGLangRooms

    mgr = SGLangManager()
    sg = SGLangRooms(mgr)
    mgr.request_status[ROOM] = KVPoll.Transferring
    info = TransferInfo(ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), -1, [], 1, False)
    mgr.transfer_infos[ROOM] = {AGENT: info}
    ctx = SimpleNamespace(sglang=sg)
    mgr.pause_success = True
    worker = threading.Thread(target=sg.conclude_success, args=(ROOM,), daemon=True)
    worker.start()
    assert mgr.checked.wait(10)
    failer = threading.Thread(
        target=PrefillContext.fail_rooms_of_peer,
        args=(ctx, AGENT, f"decode {AGENT} stopped answering"),
        daemon=True,
    )
    failer.start()
    failer.join(0.5)  # without the lock it fails the room now; with it, it waits
    mgr.go.set()
    worker.join(10)
    failer.join(10)
    assert not worker.is_alive() and not failer.is_alive()
    assert mgr.sent == [(ROOM, KVPoll.Success)], mgr.sent
    assert mgr.request_status[ROOM] == KVPoll.Success and ROOM not in mgr.failure_records


def test_a_success_the_scheduler_clears_at_once_still_counts_as_success():
    """SGLang's scheduler polls the Success the moment it is set and clears the room (its
    status entry goes) before the worker reads the table again. The worker must take the
    outcome from what it concluded: reading the table afterwards called the room failed,
    so it was closed FAILED and never observed (a room missing from the metrics and from
    ``sgl_nixl_transfer_done``, seen under load in the gate)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sgl_nixl_plugin.adapter.sglang_rooms import SGLangRooms

    class ClearedAtOnce(SGLangManager):
        def send_kv_status_message(self, *, targets, bootstrap_room, status, failure_reason=None):
            super().send_kv_status_message(
                targets=targets, bootstrap_room=bootstrap_room, status=status
            )
            self.request_status.pop(bootstrap_room, None)  # the scheduler's poll and clear

    mgr = ClearedAtOnce()
    sg = SGLangRooms(mgr)
    mgr.request_status[ROOM] = KVPoll.Transferring
    info = TransferInfo(ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), -1, [], 1, False)
    mgr.transfer_infos[ROOM] = {AGENT: info}
    assert sg.conclude_success(ROOM) is True
    assert mgr.sent == [(ROOM, KVPoll.Success)]


def test_staged_writes_given_up_after_the_drain_bound_count_as_ended():
    """A staged send whose WRITEs never settle (their decode is gone) abandons them after
    ``drain_timeout_s``; they must count as ended, or the worker's in-flight count for the
    room (``posted - settled``) never came back to 0 (no abort ACK, a table that leaks)."""
    import time

    from sgl_nixl_plugin.engine.layout import Geometry
    from sgl_nixl_plugin.engine.staging import Piece, StagedSend, _InFlight

    abandoned: list[Xfer] = []
    agent = SimpleNamespace(poll=lambda x: "PROC", abandon=abandoned.append)
    local = SimpleNamespace(release=lambda slots: None)
    piece = Piece(0, 0, 1, 0, 1, 64)
    send = StagedSend(
        agent,
        None,
        local,
        None,
        AGENT,
        np.zeros(1, np.uint64),
        np.arange(1),  # type: ignore[arg-type]
        Geometry.whole_items(),
        [piece],
        remote_free=[],
        drain_timeout_s=0.0,  # type: ignore[arg-type]
    )
    x = Xfer(handle=None, peer=AGENT, nbytes=64, descriptors=1)
    send._writing, send.posted = [_InFlight(piece, 0, 0, x)], 1
    send.error, send._error_at = "room ended", time.monotonic() - 1
    send.step()
    assert abandoned == [x] and not send.in_flight
    assert send.settled == send.posted


def test_a_one_pass_room_stores_its_completion_flag_before_it_concludes(side):
    """The flag owed to a one-pass decode counts as in flight: when the copy and the aux
    row settle in the same poll, the room stores the flag (behind the copy, on the copy
    stream) and concludes Success only once that store is done, never before it."""
    launched: list[KernelXfer] = []

    class OnePass:
        flags = object()  # the decode's flag board, mapped

        def write(self, copier: Any, src: np.ndarray, dst: np.ndarray, stream: Any) -> KernelXfer:
            launched.append(
                KernelXfer(handle=None, peer=AGENT, nbytes=64 * len(src), descriptors=0)
            )
            return launched[-1]

        def signal(self, word: int, value: int, stream: Any) -> KernelXfer:
            launched.append(KernelXfer(handle=None, peer=AGENT, nbytes=8, descriptors=0))
            return launched[-1]

    side.ctx.peers.accepted[AGENT].link.one_pass = OnePass()
    side.ctx.copier = object()
    info = TransferInfo(ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), 3, [], 1, False)
    info.done_flag, info.done_value = 5, 9
    side.sg.add_destination(info)
    side.ctx.rooms.open(ROOM)
    side.sg.mark_ready(ROOM)
    side.worker.submit(Chunk(ROOM, np.arange(4), slice(0, 4), True, 2, None))
    (aux,) = side.engine.posted
    assert side.sg.outstanding[ROOM] == 3  # the copy, the aux row, the flag owed
    launched[0].state = aux.state = "DONE"
    side.worker.poll()
    assert len(launched) == 2 and side.sg.concluded == []  # the flag's store is in flight
    assert side.sg.outstanding[ROOM] == 1
    launched[1].state = "DONE"
    side.worker.poll()
    assert side.sg.concluded == [(ROOM, "success")] and side.worker.kernels == 0
    _drained(side)


# -- notes on direct WRITEs (``wire.notes``) ------------------------------------------------


def _noted_room(side, notes: bool, room: int = ROOM) -> None:
    info = TransferInfo(room, AGENT, "127.0.0.1", 7001, np.arange(4), 3, [], 1, False, notes=notes)
    side.sg.add_destination(info)
    side.ctx.rooms.open(room)
    side.sg.mark_ready(room)


def test_a_decode_that_counts_notes_gets_one_per_write_and_the_total_on_the_last(side):
    """Without the total on the room's last WRITE (the aux row here) the decode would wait
    for the status message; with it on an earlier one, it would end the room too soon."""
    _noted_room(side, notes=True)
    side.worker.submit(_chunk(n=2, last=False))
    side.worker.submit(Chunk(ROOM, np.arange(2, 4), slice(2, 4), True, 2, None))
    notes = [decode_note(n) for n in side.engine.notes]
    assert notes == [Note(ROOM, 0, 1, 0), Note(ROOM, 0, 2, 0), Note(ROOM, 0, 3, 3)]


def test_no_notes_for_a_decode_that_does_not_count_them_nor_a_total_after_a_staged_chunk(side):
    _noted_room(side, notes=False)
    side.worker.submit(Chunk(ROOM, np.arange(4), slice(0, 4), True, 2, None))
    assert side.engine.notes == [b"", b""]
    side.engine.notes.clear()
    _noted_room(side, notes=True, room=ROOM + 1)
    side.ctx.rooms.get(ROOM + 1).staged_to.add(AGENT)  # an earlier chunk went staged
    side.worker.submit(Chunk(ROOM + 1, np.arange(4), slice(0, 4), True, 2, None))
    got = [decode_note(n) for n in side.engine.notes]
    assert got == [Note(ROOM + 1, 0, 1, 0), Note(ROOM + 1, 0, 2, 0)]


def test_a_rooms_last_chunk_and_aux_row_go_in_one_write_where_their_lists_are_shared(
    side, monkeypatch
):
    """On a host whose KV and aux rows are in one memory kind the link prepares them in one
    list per side (``PeerLink.shares``): the room's last KV chunk and its aux row are then
    one WRITE with one note, the total on it; a group in lists of its own goes apart."""
    from sgl_nixl_plugin.engine.engine import GroupLink, _Side
    from sgl_nixl_plugin.engine.layout import Geometry

    def group(local: object, remote: object) -> GroupLink:
        z = np.zeros(1, dtype=np.int64)
        return GroupLink(Geometry.whole_items(), _Side(local, z), _Side(remote, z), 64, 1, 8, 8)

    link = side.ctx.peers.accepted[AGENT].link
    kv_aux_local, kv_aux_remote = object(), object()
    link.groups["kv"] = group(kv_aux_local, kv_aux_remote)
    link.groups["aux"] = group(kv_aux_local, kv_aux_remote)
    link.groups["state0"] = group(object(), object())
    assert link.shares("kv", "aux") and not link.shares("kv", "state0")
    monkeypatch.setattr(side.worker.staged, "job_for", lambda *a: None)  # direct WRITEs
    info = TransferInfo(
        ROOM, AGENT, "127.0.0.1", 7001, np.arange(4), 3, [np.array([5])], 1, False, notes=True
    )
    side.sg.add_destination(info)
    side.ctx.rooms.open(ROOM)
    side.sg.mark_ready(ROOM)
    side.worker.submit(_chunk(n=2, last=False))
    side.worker.submit(Chunk(ROOM, np.arange(2, 4), slice(2, 4), True, 2, [np.array([6])]))
    notes = [decode_note(n) for n in side.engine.notes]
    assert notes == [Note(ROOM, 0, 1, 0), Note(ROOM, 0, 2, 0), Note(ROOM, 0, 3, 3)]
    assert side.engine.groups == [["kv"], ["kv", "aux"], ["state0"]]
    link.groups["aux"] = group(object(), kv_aux_remote)  # shares the decode's list only
    assert not link.shares("kv", "aux")


PENDING = "decode-p"


def _pending_request(side, room: int, pages: list[int]) -> None:
    """A request of ``PENDING`` (a decode whose link is being set up: 8 pages) filed."""
    from sgl_nixl_plugin.sides.prefill_requests import file_request
    from sgl_nixl_plugin.wire.messages import TransferRequest

    req = TransferRequest(room, PENDING, "127.0.0.1", 7003, -1, 1)
    registrations = SimpleNamespace(reply=lambda *a, **k: None)
    kv = np.array(pages, dtype=np.int32)
    file_request(side.ctx, registrations, req, kv, [])  # type: ignore[arg-type]


@pytest.fixture
def setting_up(side):
    """``side`` with decode ``PENDING`` being set up (its link not made yet)."""
    from sgl_nixl_plugin.engine.engine import GroupBounds
    from sgl_nixl_plugin.protocol.peers import PendingDecode

    side.ctx.peers.pending[PENDING] = PendingDecode(None, {"kv": GroupBounds(8)})  # type: ignore[arg-type]
    return side


def _end_setup(side, accepted: bool) -> None:
    """The control thread's verdict on ``PENDING`` (``DecodeRegistrations._accept``)."""
    with side.ctx.peers.lock:
        del side.ctx.peers.pending[PENDING]
        if accepted:
            link = PeerLink(PENDING)
            side.ctx.peers.accepted[PENDING] = DecodePeer(PENDING, link, None, ("127.0.0.1", 7003))
        else:
            side.ctx.peers.refused[PENDING] = "a layout this prefill cannot serve"


@pytest.mark.parametrize("accepted", [True, False])
def test_a_room_filed_while_its_decode_is_set_up_waits_for_the_link(setting_up, accepted):
    """Its request is filed at once (SGLang's forward pass starts); its chunks wait,
    counting nothing in flight, until the setup ends: then they go, or fail the room with
    the refusal. A request beyond the pool it registered is refused to its sender."""
    side = setting_up
    _pending_request(side, 50, [1, 2, 7])
    _pending_request(side, 51, [8])
    assert side.sg.status[50] == OPEN and 51 not in side.sg.status
    ep, status = side.ctx.transport.sent[-1]
    assert status.room == 51 and "destination page" in status.reason
    assert side.ctx.peers.pending[PENDING].rooms == {50}
    side.worker.submit(_chunk(50, n=2, last=False))
    side.worker.submit(_chunk(50, start=2, n=1, last=True))
    assert side.engine.posted == [] and len(side.worker.parked) == 2
    assert 50 not in side.sg.outstanding and not side.worker.active
    side.worker._unpark()  # woken early: still set up, the chunks wait again, in order
    assert side.engine.posted == [] and [c.index_slice.start for c in side.worker.parked] == [0, 2]

    _end_setup(side, accepted)
    side.worker._unpark()
    assert side.worker.parked == []
    if not accepted:
        assert side.engine.posted == []
        assert side.sg.concluded == [
            (50, f"failed: decode {PENDING} was refused: a layout this prefill cannot serve")
        ]
        _drained(side, 50)
        return
    assert len(side.engine.posted) == 2 and side.sg.outstanding[50] == 2
    for x in side.engine.posted:
        x.state = "DONE"
    side.worker.poll()
    assert side.sg.concluded == [(50, "success")]
    _drained(side, 50)


def test_a_parked_chunk_of_a_room_cleared_meanwhile_is_dropped(setting_up):
    side = setting_up
    _pending_request(side, 50, [1])
    side.worker.submit(_chunk(50, n=1))
    side.sg.clear(50)  # SGLang gave the request up while the link was being set up
    side.ctx.rooms.release(50)
    _end_setup(side, accepted=True)
    side.worker._unpark()
    assert side.worker.parked == [] and side.engine.posted == [] and side.sg.concluded == []
    _drained(side, 50)


@pytest.mark.parametrize("stages", [True, False])
def test_a_staged_request_filed_during_the_setup_gets_its_credits_once_accepted(setting_up, stages):
    """A decode offers staging in its first requests before the prefill has said whether
    it stages to it: the slots a request granted become its room's credits when the setup
    accepts the decode for staged transfers (as a request filed after it), none otherwise."""
    from sgl_nixl_plugin.sides.decode_registrations import DecodeRegistrations
    from sgl_nixl_plugin.sides.prefill_requests import file_request
    from sgl_nixl_plugin.wire.messages import TransferRequest

    side = setting_up
    req = TransferRequest(52, PENDING, "127.0.0.1", 7003, -1, 1, staged=True, staging_slots=[3, 4])
    regs = DecodeRegistrations(side.ctx, lambda: None, wake=lambda room: woken.append(room))
    woken: list[int] = []
    file_request(side.ctx, regs, req, np.array([1, 2], dtype=np.int32), [])
    pending = side.ctx.peers.pending[PENDING]
    assert side.sg.status[52] == OPEN and pending.slots == {52: [3, 4]}
    assert side.ctx.rooms.get(52).credits == {}
    _end_setup(side, accepted=True)
    staging = SimpleNamespace(slot_bytes=1 << 20) if stages else None
    side.ctx.peers.accepted[PENDING].staging = staging
    regs._settle_early(PENDING, pending, "")
    credits = side.ctx.rooms.get(52).credits
    assert woken == [52]
    assert list(credits) == ([PENDING] if stages else [])


def test_a_decode_lost_during_its_setup_fails_the_rooms_filed_meanwhile(setting_up):
    """Its process closed its connection while its link was being set up: the rooms it
    got filed fail now with that reason, not once the setup ends and WRITEs go to it."""
    from sgl_nixl_plugin.sides.decode_registrations import DecodeRegistrations

    side = setting_up
    _pending_request(side, 50, [1])
    side.worker.submit(_chunk(50, n=1))
    regs = DecodeRegistrations(side.ctx, lambda: None)
    regs.drop(PENDING, "closed its connection")
    assert side.sg.concluded == [(50, f"failed: decode {PENDING}: closed its connection")]
    _end_setup(side, accepted=True)  # the setup's verdict comes after
    side.worker._unpark()
    assert side.engine.posted == [] and side.sg.concluded[1:] == []
    _drained(side, 50)
