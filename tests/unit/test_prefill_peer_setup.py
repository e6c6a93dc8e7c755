"""A decode's setup (link, warm-up WRITE, mapping) runs beside the prefill's control loop.

On a loaded host a warm-up WRITE once took 18 s; on the control thread it kept every other
decode waiting: pings unanswered (the decode then calls the prefill lost), registrations and
requests of other decodes unfiled. The control loop below runs on its own thread over real
ZMQ sockets with our codec; only the engine is a stand-in whose warm-up WRITE lasts until
the test lets it end. What the setting-up decode sends meanwhile waits, in order.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from helpers.waiting import poll_until
from helpers.zmq_pair import loopback_pair

from sgl_nixl_plugin.engine.engine import GroupBounds
from sgl_nixl_plugin.engine.staging_memory import LazyStaging
from sgl_nixl_plugin.protocol.peers import DecodePeers
from sgl_nixl_plugin.protocol.prefill_rooms import PrefillRooms
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides.pipeline_stages import PrefillStage
from sgl_nixl_plugin.sides.prefill_control import PrefillControl
from sgl_nixl_plugin.wire.codec import Codec, index_specs
from sgl_nixl_plugin.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    Compat,
    PeerRegistration,
    Ping,
    Pong,
    Region,
    RegistrationReply,
    TransferRequest,
    TransferStatus,
)

BOUND_S = 10.0  # how long anything here may take; the warm-up waits at most this long
KV_PAGES = 64  # the pages each decode's KV pool has here
COMPAT = Compat(PROTOCOL_VERSION, "bf16", 16, 1, True)


class HeldWarmEngine:
    """``link`` returns a bare link; ``warm`` lasts until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.warming = threading.Event()
        self.warmed = threading.Event()
        self.warm_thread = ""
        self.warm_items: list[int | None] = []  # None: the request-sized warm-up
        self.linking = threading.Event()
        self.link_release = threading.Event()
        self.link_release.set()  # a test clears it to hold the link
        self.memory = types.SimpleNamespace(kv=types.SimpleNamespace(mem_kind="DRAM"))
        self.log: list[tuple[str, Any]] = []  # a test may give it the control loop's log
        #: (kind, decode, replies sent before it) of each warm-up WRITE, in order
        self.warms: list[tuple[str, str, int]] = []
        self.refuse = ""  # a test sets it: the link refuses the layout once released

    def bounds(self, remote: Any, page_tokens: Any) -> dict[str, GroupBounds]:
        return {"kv": GroupBounds(KV_PAGES)}

    def link(self, metadata: bytes, remote: Any, groups: Any, page_tokens: Any) -> Any:
        self.linking.set()
        self.link_release.wait(3 * BOUND_S)
        if self.refuse:
            raise ValueError(self.refuse)
        return types.SimpleNamespace(name=metadata.decode(), groups={}, one_pass=None)

    def _replies(self) -> int:
        return sum(isinstance(m, RegistrationReply) for _, m in list(self.log))

    def warm(self, link: Any, timeout_s: float = 1.0, items: int | None = None) -> float:
        self.warms.append(("kv", link.name, self._replies()))
        self.warm_thread = threading.current_thread().name
        self.warm_items.append(items)
        self.warming.set()
        started = time.monotonic()
        self.release.wait(3 * BOUND_S)  # past any wait of the test's
        self.warmed.set()
        return time.monotonic() - started

    def warm_host(self, link: Any, dst: int, dst_len: int, timeout_s: float = 1.0) -> float:
        self.warms.append(("host", link.name, self._replies()))
        return 0.001


class Tables:
    """SGLang's room tables as far as filing a request reaches them: a room marked ready
    is logged ``("ready", room)``."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log
        self.infos: dict[int, dict[str, Any]] = {}

    def check_aux_count(self, agent: str, n: int) -> None:
        pass

    def rooms_with_destinations(self) -> list[tuple[int, dict[str, Any]]]:
        return list(self.infos.items())

    def add_destination(self, info: Any) -> int | None:
        infos = self.infos.setdefault(info.room, {})
        if info.agent in infos:
            return None
        infos[info.agent] = info
        return len(infos)

    def mark_ready(self, room: int) -> None:
        self.log.append(("ready", room))

    def exists(self, room: int) -> bool:
        return room in self.infos

    def is_open(self, room: int) -> bool:
        return room in self.infos

    def set_decode_prefix_len(self, room: int, n: int) -> None:
        pass


def _registration(agent: str, port: int, compat: Compat = COMPAT) -> PeerRegistration:
    return PeerRegistration(
        compat=compat,
        compat_hash="h",
        agent_name=agent,
        agent_metadata=agent.encode(),
        ip="127.0.0.1",
        port=port,
        tp_rank=0,
        tp_size=1,
        kv=[],
        aux=[],
    )


@pytest.fixture
def prefill() -> Iterator[tuple[PrefillControl, Any, list[tuple[str, Any]], list[int]]]:
    with loopback_pair() as (zctx, pull, push, port):
        # the decodes' own control sockets: the prefill watches the ones it accepts
        decode_socks = [zctx.socket(zmq.PULL) for _ in range(2)]
        decode_ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in decode_socks]
        log: list[tuple[str, Any]] = []  # what the control loop did, in order
        ctx = types.SimpleNamespace(
            settings=replace(Settings(), warmup=True, warmup_timeout_s=BOUND_S),
            zmq_ctx=zctx,
            server_socket=pull,
            codec=Codec(),
            me=types.SimpleNamespace(name="prefill-0", ip="127.0.0.1", port=port, rank=0),
            send=lambda endpoint, msg, *a: log.append(("send", msg)) or True,
            reject=lambda reason, detail="", *a: log.append(("reject", f"{reason}: {detail}")),
            compat=COMPAT,
            compat_hash="h",
            peers=DecodePeers(),
            page_bound_states=(),
            head_layout=None,
            is_mla=True,
            kv_item_len=0,
            attn_tp_rank=0,
            stage=PrefillStage(),
            sglang=Tables(log),
            staging=None,
            staging_memory=None,
            device_uuid="",
            copier=None,
            copy_stream=None,
            gpu=0,
            warmups=0,
            host_warmups=0,
            light_warmups=0,
            late_warmups=0,
            rooms=PrefillRooms(),
            note_early_abort=lambda room, reason: log.append(("early_abort", room)) or False,
            fail_rooms_of_peer=lambda agent, reason: log.append(("fail_peer", reason)),
            unlink=lambda link: None,
        )
        ctx.engine = HeldWarmEngine()
        wake = lambda room: log.append(("wake", room))  # noqa: E731
        ctl = PrefillControl(ctx, wake=wake, recall=lambda room: None)
        ctl.start()
        try:
            yield ctl, push, log, decode_ports
        finally:
            ctx.engine.release.set()
            ctl.stop()
            ctl.thread.join(BOUND_S)
            if hasattr(ctl, "setup"):
                ctl.registrations.setup.thread.join(BOUND_S)
            for s in decode_socks:
                s.close(0)


def _until(log: list[tuple[str, Any]], what: str, pred: Any) -> None:
    deadline = time.monotonic() + BOUND_S
    while not any(pred(m) for _, m in log) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert any(pred(m) for _, m in log), f"{what} within {BOUND_S:.0f}s: {log}"


def _register_while_linking(
    ctl: PrefillControl, push: Any, log: list, reg: PeerRegistration, request_waits: bool
) -> None:
    """``reg`` arrives and its link is held (the test releases ``engine.link_release``);
    with ``request_waits`` a request of that decode arrives meanwhile and waits."""
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    engine.link_release.clear()
    engine.release.set()
    push.send_multipart(codec.encode(reg))
    assert engine.linking.wait(BOUND_S), log
    if request_waits:
        req = TransferRequest(7, reg.agent_name, "127.0.0.1", reg.port, -1, 1, is_dummy=True)
        push.send_multipart(codec.encode(req))
        poll_until(
            lambda: reg.agent_name in ctl.registrations.request_waits,
            timeout=BOUND_S,
            interval=0.002,
        )


def test_the_loop_answers_others_while_a_decode_is_set_up_and_its_messages_wait(prefill):
    ctl, push, log, (port_a, port_b) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    push.send_multipart(codec.encode(_registration("decode-a", port_a)))
    assert engine.warming.wait(BOUND_S), log
    # while decode-a's warm-up WRITE is in flight: its abort waits, others are served
    push.send_multipart(codec.encode(Abort(5, "127.0.0.1", port_a)))
    push.send_multipart(codec.encode(Ping("decode-c", "127.0.0.1", 1, 41)))
    mismatched = msgspec.structs.replace(COMPAT, kv_dtype="fp8_e4m3")
    push.send_multipart(codec.encode(_registration("decode-b", port_b, mismatched)))
    _until(log, "a pong during the setup", lambda m: isinstance(m, Pong) and m.seq == 41)
    _until(log, "decode-b's refusal", lambda m: isinstance(m, RegistrationReply))
    assert not engine.warmed.is_set() and engine.warm_thread == "sgl-nixl-prefill-setup"
    (refusal,) = [m for _, m in log if isinstance(m, RegistrationReply)]
    assert refusal.agent_name == "decode-b" and not refusal.accepted
    assert "fp8_e4m3" in refusal.reason
    assert not [m for k, m in log if k == "early_abort"], log  # decode-a's abort waits

    engine.release.set()
    _until(log, "decode-a's abort", lambda m: m == 5)
    replies = [m for _, m in log if isinstance(m, RegistrationReply)]
    assert [(r.agent_name, r.accepted) for r in replies] == [
        ("decode-b", False),
        ("decode-a", True),
    ]
    # decode-a's reply, then its abort: the order it sent them in
    order = [m.agent_name if isinstance(m, RegistrationReply) else m for k, m in log]
    assert order.index("decode-a") < order.index(5)
    assert "decode-a" in ctl.ctx.peers.accepted and ctl.ctx.warmups == 1


def test_a_registration_repeated_during_its_setup_is_answered_after_it(prefill):
    ctl, push, log, (port_a, _) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    push.send_multipart(codec.encode(_registration("decode-a", port_a)))
    assert engine.warming.wait(BOUND_S), log
    push.send_multipart(codec.encode(_registration("decode-a", port_a)))  # its retry
    push.send_multipart(codec.encode(Ping("decode-c", "127.0.0.1", 1, 7)))
    _until(log, "a pong", lambda m: isinstance(m, Pong))
    assert not engine.warmed.is_set()
    engine.release.set()
    _until(
        log,
        "two replies",
        lambda m: sum(isinstance(x, RegistrationReply) for _, x in log) == 2,
    )
    replies = [m for _, m in log if isinstance(m, RegistrationReply)]
    assert all(r.agent_name == "decode-a" and r.accepted for r in replies)
    assert ctl.registrations.setup.completed == 1  # the repeat kept the link: set up once


@pytest.mark.parametrize("waits", ["request", "flag", None])
def test_a_decode_whose_first_request_waits_gets_no_warm_up(prefill, waits):
    """A warm-up WRITE only delays a request that already waits for the setup (it waits
    for the wire-up, then pays the rest itself): a decode whose request arrived during the
    link, or whose registration says a request waits, gets none; one registered ahead of
    its requests (at start-up) gets the whole one."""
    ctl, push, log, (port_a, _) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    reg = _registration("decode-a", port_a)
    flagged = msgspec.structs.replace(reg, request_waits=True)
    _register_while_linking(ctl, push, log, flagged if waits == "flag" else reg, waits == "request")
    push.send_multipart(codec.encode(Ping("decode-c", "127.0.0.1", 1, 3)))
    _until(log, "a pong while linking", lambda m: isinstance(m, Pong))
    engine.link_release.set()
    _until(log, "decode-a's reply", lambda m: isinstance(m, RegistrationReply))
    assert engine.warm_items == ([] if waits else [None])
    assert (ctl.ctx.warmups, ctl.ctx.light_warmups) == (0, 1) if waits else (1, 0)
    assert not ctl.registrations.request_waits  # forgotten once the setup is done
    # the flag is not part of who the decode is: the same registration without it (SGLang's
    # own, or one sent ahead) keeps the link
    assert ctl.ctx.peers.accepted["decode-a"].reg == reg
    push.send_multipart(codec.encode(reg if waits == "flag" else flagged))
    _until(log, "the repeat's reply", lambda m: sum(
        isinstance(x, RegistrationReply) for _, x in log) == 2)  # fmt: skip
    assert ctl.registrations.setup.completed == 1


@pytest.mark.parametrize("kv", ["VRAM", "DRAM"])
def test_a_waited_for_decode_of_a_device_pool_is_warmed_up_after_the_reply(prefill, kv):
    """A decode whose first request waits gets no warm-up before the reply. Where our KV is
    device memory the room's state and aux rows still go by NIXL WRITEs that no copy wires
    up (its first room paid 10-16 ms for that on an H100), so the whole warm-up (padding
    page, host scratch) runs right after the reply, on the setup thread. With a host KV
    pool the first KV WRITE wires the path up: none."""
    ctl, push, log, (port_a, port_b) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    engine.memory.kv.mem_kind, engine.log = kv, log
    engine.release.set()
    scratch = Region(ptr=4096, length=1 << 16, item_len=1 << 16, mem_kind="DRAM")
    reg = _registration("decode-a", port_a)
    push.send_multipart(
        codec.encode(msgspec.structs.replace(reg, request_waits=True, scratch=scratch))
    )
    _until(log, "decode-a's reply", lambda m: isinstance(m, RegistrationReply))
    # the setup thread runs its jobs in order: decode-b's is set up after anything the
    # accept of decode-a queued there
    push.send_multipart(codec.encode(_registration("decode-b", port_b)))
    _until(
        log,
        "decode-b's reply",
        lambda m: isinstance(m, RegistrationReply) and m.agent_name == "decode-b",
    )
    assert ctl.ctx.light_warmups == 1 and ctl.ctx.warmups == 1  # decode-b: before its reply
    if kv == "VRAM":
        # decode-a's after its reply (one sent), before decode-b's setup
        assert engine.warms == [
            ("kv", "decode-a", 1),
            ("host", "decode-a", 1),
            ("kv", "decode-b", 1),
        ]
        assert ctl.ctx.late_warmups == 1 and ctl.ctx.host_warmups == 0
        assert ctl.registrations.setup.completed == 3
    else:
        assert engine.warms == [("kv", "decode-b", 1)] and ctl.ctx.late_warmups == 0
        assert ctl.registrations.setup.completed == 2


class HeldAllocation:
    """``LazyStaging``'s ``make``: the allocation lasts until ``release`` is set, then
    returns a buffer's figures, or raises ``fail``."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail = fail

    def __call__(self, agent: Any, nbytes: int, slot_bytes: int, *args: Any) -> Any:
        self.started.set()
        self.release.wait(3 * BOUND_S)
        if self.fail is not None:
            raise self.fail
        return types.SimpleNamespace(
            nbytes=nbytes, num_slots=nbytes // slot_bytes, slot_bytes=slot_bytes
        )


def _staging_registration(agent: str, port: int) -> PeerRegistration:
    return msgspec.structs.replace(_registration(agent, port), staging_slot_bytes=1 << 20)


def _replies(log: list[tuple[str, Any]]) -> list[RegistrationReply]:
    return [m for _, m in log if isinstance(m, RegistrationReply)]


@pytest.mark.parametrize("request_waits", [True, False])
@pytest.mark.parametrize("fails", [False, True])
def test_staging_is_set_up_at_the_first_chunk_that_would_stage(prefill, fails, request_waits):
    """A decode that may take staged transfers is accepted without our staging buffer
    (hundreds of MiB, allocated, touched and registered: up to 0.4 s of CPU on a 2-core
    host, inside a learned pair's first requests when it was taken at the set-up), whether
    a request of it waits or not; its rooms go direct. The first chunk the path rule would
    stage (the worker's ``need``) has the buffer allocated on the setup thread, and only
    then is the decode asked for its area (a second reply), once. A buffer that cannot be
    allocated asks nothing: the decode never allocates for us."""
    ctl, push, log, (port_a, _) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    alloc = HeldAllocation(MemoryError("no host memory") if fails else None)
    ctl.ctx.staging_memory = LazyStaging(None, 4 << 20, 1 << 20, "DRAM", make=alloc)
    _register_while_linking(
        ctl, push, log, _staging_registration("decode-a", port_a), request_waits
    )
    engine.link_release.set()
    _until(log, "decode-a's reply", lambda m: isinstance(m, RegistrationReply))
    poll_until(lambda: ctl.registrations.setup.completed == 1, timeout=BOUND_S, interval=0.002)
    (first,) = _replies(log)
    assert first.accepted and not first.wants_staging, first
    peer = ctl.ctx.peers.accepted["decode-a"]
    assert peer.staging_slot_bytes == 0 and peer.may_stage  # its rooms go direct
    assert not alloc.started.is_set() and ctl.ctx.staging is None  # nothing allocated

    ctl.ctx.staging_need(peer)  # the worker: the rule would stage a chunk to it
    ctl.ctx.staging_need(peer)  # and another chunk: asked once
    assert alloc.started.wait(BOUND_S), "the first chunk that would stage allocates"
    assert ctl.ctx.staging is None and len(_replies(log)) == 1
    alloc.release.set()
    poll_until(lambda: ctl.registrations.setup.completed == 2, timeout=BOUND_S, interval=0.002)
    assert ctl.registrations.staging.needs == 1
    if fails:
        push.send_multipart(codec.encode(Ping("decode-c", "127.0.0.1", 1, 9)))
        _until(log, "a pong after the failed allocation", lambda m: isinstance(m, Pong))
        assert len(_replies(log)) == 1 and ctl.ctx.staging is None and not peer.wants_staging
        assert ctl.ctx.staging_memory.failures == 1
        return
    _until(
        log, "the ask for its area", lambda m: isinstance(m, RegistrationReply) and m.wants_staging
    )
    first, second = _replies(log)
    assert (
        second.accepted and second.agent_name == "decode-a" and second.kv_window == first.kv_window
    )
    assert ctl.ctx.staging is not None and peer.wants_staging
    assert peer.staging_slot_bytes == 1 << 20  # staged from now on, once its slots come


def test_with_every_chunk_to_be_staged_the_buffer_is_taken_in_the_set_up(prefill):
    """``TRANSFER_PATH=staging``: our buffer is allocated during the decode's set-up and
    the one reply asks for its area, so its first requests carry staging slots."""
    ctl, push, log, (port_a, _) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    ctl.ctx.settings = replace(ctl.ctx.settings, transfer_path="staging")
    alloc = HeldAllocation()
    ctl.ctx.staging_memory = LazyStaging(None, 4 << 20, 1 << 20, "DRAM", make=alloc)
    engine.release.set()
    push.send_multipart(codec.encode(_staging_registration("decode-a", port_a)))
    assert alloc.started.wait(BOUND_S), log
    push.send_multipart(codec.encode(Ping("decode-c", "127.0.0.1", 1, 5)))
    _until(log, "a pong during the allocation", lambda m: isinstance(m, Pong))
    assert not _replies(log)
    alloc.release.set()
    _until(log, "decode-a's reply", lambda m: isinstance(m, RegistrationReply))
    poll_until(lambda: ctl.registrations.setup.completed == 1, timeout=BOUND_S, interval=0.002)
    (reply,) = _replies(log)
    assert reply.accepted and reply.wants_staging and ctl.ctx.staging is not None
    assert not ctl.ctx.peers.accepted["decode-a"].may_stage


@pytest.mark.parametrize("refused", [False, True])
def test_a_request_during_the_link_is_filed_at_once_and_its_worker_woken_after(prefill, refused):
    """SGLang's prefill starts a request's forward pass only once it is filed. A learned
    decode's first requests come while its link is set up (NIXL's connect, the one-pass
    mapping: ~0.1 s on an H100): each is checked against the bounds the link will have
    and filed at once, its abort handled at once; a request out of those bounds is refused
    to its sender. When the setup ends the rooms' workers are woken (their chunks waited
    for the link); a setup that refuses the decode fails those rooms with its reason."""
    ctl, push, log, (port_a, _) = prefill
    codec, engine = ctl.ctx.codec, ctl.ctx.engine
    engine.refuse = "a layout this prefill cannot serve" if refused else ""
    engine.link_release.clear()
    engine.release.set()
    reg = _registration("decode-a", port_a)
    push.send_multipart(codec.encode(reg))
    assert engine.linking.wait(BOUND_S), log

    def request(room: int, pages: list[int]) -> list[Any]:
        kv = np.array(pages, dtype=np.int32)
        req = TransferRequest(room, "decode-a", "127.0.0.1", port_a, -1, 1, indices=index_specs(kv))
        return codec.encode(req, [kv])

    push.send_multipart(request(7, [1, 2, KV_PAGES - 1]))
    push.send_multipart(request(8, [KV_PAGES]))  # beyond its pool
    push.send_multipart(request(9, [3]))
    push.send_multipart(codec.encode(Abort(9, "127.0.0.1", port_a)))
    _until(log, "room 9's abort, at once", lambda m: m == 9)
    assert [m for k, m in log if k == "ready"] == [7, 9]  # filed before the reply
    assert not _replies(log) and "decode-a" in ctl.ctx.peers.pending
    (status,) = [m for _, m in log if isinstance(m, TransferStatus)]
    assert (status.room, status.status) == (8, 0) and "destination page" in status.reason
    assert [k for k, _ in log if k == "wake"] == []

    engine.link_release.set()
    _until(log, "decode-a's reply", lambda m: isinstance(m, RegistrationReply))
    _until(log, "the rooms' workers woken", lambda m: m == 9 and ("wake", 9) in log)
    assert [m for k, m in log if k == "wake"] == [7, 9]
    (reply,) = _replies(log)
    assert reply.accepted is not refused and not ctl.ctx.peers.pending
    failed = [m for k, m in log if k == "fail_peer"]
    if refused:
        assert "decode-a" in ctl.ctx.peers.refused
        assert failed == [f"decode decode-a: {reply.reason}"] and engine.refuse in reply.reason
    else:
        assert failed == [] and "decode-a" in ctl.ctx.peers.accepted
