"""Round trips of every control message through ``Codec``, zero-copy receive, and each
reason ``Codec.decode`` gives for refusing a message."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
import typing

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_nixl_plugin.wire import codec as codec_mod
from sgl_nixl_plugin.wire.codec import (
    INDEX_DTYPE,
    MAC_LEN,
    MAGIC,
    MAX_INDEX_COUNT,
    Codec,
    Decoded,
    Envelope,
    ForeignRegistration,
    ForeignReply,
    Rejections,
    index_specs,
)
from sgl_nixl_plugin.wire.messages import (
    MAX_NAME,
    MAX_REASON,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Compat,
    CudaIpc,
    IndexSpec,
    IpcBlock,
    Message,
    PeerRegistration,
    PieceDone,
    PieceReady,
    Ping,
    Pong,
    Region,
    RegistrationReply,
    SlotAsk,
    SlotGrant,
    SlotRecall,
    SlotReturn,
    StagingArea,
    StagingOffer,
    TransferRequest,
    TransferStatus,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"shared-secret-for-tests"
MESSAGE_TYPES = typing.get_args(Message)
PROPERTY = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------------------------------
# Strategies: values msgspec accepts within each Annotated bound.

U64 = (1 << 64) - 1
I64_MIN = -(1 << 63)
I32 = st.integers(-(1 << 31), (1 << 31) - 1)

_chars = st.characters(codec="utf-8")  # no lone surrogates: they are not UTF-8
names = st.text(_chars, max_size=MAX_NAME)
reasons = st.text(_chars, max_size=64) | st.just("r" * MAX_REASON)
nonneg = st.integers(0, U64)
positive = st.integers(1, U64)
ports = st.integers(0, 65535)
rooms = st.integers(0, (1 << 63) - 1)
any_int = st.integers(I64_MIN, U64)
opt_int = st.none() | any_int

regions = st.builds(
    Region,
    ptr=nonneg,
    length=nonneg,
    item_len=positive,
    device=nonneg,
    mem_kind=st.sampled_from(["DRAM", "VRAM"]),
)
compats = st.builds(
    Compat,
    protocol_version=any_int,
    kv_dtype=names,
    page_size=positive,
    num_layers=nonneg,
    is_mla=st.booleans(),
)
stagings = st.none() | st.builds(
    StagingArea,
    region=regions,
    slot_bytes=positive,
    device_uuid=st.text(max_size=64),
)

peer_registrations = st.builds(
    PeerRegistration,
    compat=compats,
    compat_hash=names,
    agent_name=names,
    agent_metadata=st.binary(max_size=2048),
    ip=names,
    port=ports,
    tp_rank=nonneg,
    tp_size=positive,
    kv=st.lists(regions, max_size=8),
    aux=st.lists(regions, max_size=4),
    state=st.lists(st.lists(regions, max_size=3), max_size=3),
    staging=stagings,
    staging_slot_bytes=nonneg,
    scratch=st.none() | regions,
    ipc=st.none()
    | st.builds(
        CudaIpc,
        host=names,
        device_uuid=st.text(max_size=64),
        pid=nonneg,
        blocks=st.lists(
            st.builds(
                IpcBlock, handle=st.binary(min_size=64, max_size=64), base=nonneg, size=positive
            ),
            max_size=4,
        ),
    ),
)
registration_replies = st.builds(
    RegistrationReply,
    agent_name=names,
    prefill_rank=nonneg,
    accepted=st.booleans(),
    reason=reasons,
    ip=names,
    port=ports,
    retry=st.booleans(),
    wants_staging=st.booleans(),
)
staging_offers = st.builds(
    StagingOffer,
    agent_name=names,
    ip=names,
    port=ports,
    agent_metadata=st.binary(max_size=2048),
    staging=stagings,
    reason=reasons,
)
transfer_statuses = st.builds(
    TransferStatus,
    room=rooms,
    status=st.integers(0, 4),
    prefill_rank=nonneg,
    reason=reasons,
    ip=names,
    port=ports,
)
aborts = st.builds(Abort, room=rooms, ip=names, port=ports, generation=opt_int, reason=reasons)
abort_acks = st.builds(AbortAck, room=rooms, prefill_rank=nonneg, generation=opt_int)
pings = st.builds(Ping, sender=names, ip=names, port=ports, seq=nonneg)
pongs = st.builds(Pong, sender=names, seq=nonneg, ip=names, port=ports)
piece_readies = st.builds(
    PieceReady,
    room=rooms,
    prefill_rank=nonneg,
    ip=names,
    port=ports,
    slot=nonneg,
    r0=nonneg,
    r1=nonneg,
    j0=nonneg,
    j1=nonneg,
    page_start=nonneg,
    page_count=nonneg,
    unit_len=positive,
    units_per_item=positive,
    dst_stride=positive,
    dst_offset=nonneg,
    seq=positive,
)
piece_dones = st.builds(PieceDone, room=rooms, agent_name=names, slot=nonneg, seq=positive)
slot_asks = st.builds(SlotAsk, room=rooms, agent_name=names, ip=names, port=ports)
slot_grants = st.builds(SlotGrant, room=rooms, agent_name=names, slot=nonneg)
slot_returns = st.builds(
    SlotReturn,
    room=rooms,
    agent_name=names,
    ip=names,
    port=ports,
    slots=st.lists(nonneg, max_size=64),
)
slot_recalls = st.builds(SlotRecall, room=rooms, agent_name=names)


@st.composite
def index_arrays(draw) -> np.ndarray:
    """int32 page indices, given to ``encode`` as int32, a wider or narrower integer
    dtype, or a strided (non-contiguous) view."""
    values = draw(st.lists(I32, max_size=64))
    kind = draw(st.sampled_from(["int32", "int64", "strided"]))
    if kind == "int32":
        return np.array(values, dtype=np.int32)
    if kind == "int64":
        return np.array(values, dtype=np.int64)
    doubled = np.zeros(2 * len(values), dtype=np.int32)
    doubled[::2] = values
    return doubled[::2]


@st.composite
def transfer_requests(draw) -> tuple[TransferRequest, list[np.ndarray]]:
    """A TransferRequest with its index arrays, the kv frame (if any) anywhere among the
    state frames."""
    n_state = draw(st.integers(0, 4))
    roles = ["state"] * n_state
    if draw(st.booleans()):
        roles.insert(draw(st.integers(0, n_state)), "kv")
    arrays = [draw(index_arrays()) for _ in roles]
    msg = TransferRequest(
        room=draw(rooms),
        agent_name=draw(names),
        ip=draw(names),
        port=draw(ports),
        aux_index=draw(st.integers(-1, U64)),
        required_dst_info_num=draw(st.integers(1, 4096)),
        decode_prefix_len=draw(nonneg),
        is_dummy=draw(st.booleans()),
        indices=[IndexSpec(role, len(a)) for role, a in zip(roles, arrays, strict=True)],
        staged=draw(st.booleans()),
        staging_slots=draw(st.lists(nonneg, max_size=4)),
    )
    return msg, arrays


messages_with_arrays = st.one_of(
    transfer_requests(),
    st.one_of(
        peer_registrations,
        registration_replies,
        transfer_statuses,
        aborts,
        abort_acks,
        pings,
        pongs,
        piece_readies,
        piece_dones,
        slot_asks,
        slot_grants,
        slot_returns,
        slot_recalls,
        staging_offers,
    ).map(lambda m: (m, [])),
)


def test_strategies_cover_the_whole_union():
    covered = {
        PeerRegistration,
        RegistrationReply,
        TransferRequest,
        TransferStatus,
        Abort,
        AbortAck,
        Ping,
        Pong,
        PieceReady,
        PieceDone,
        SlotAsk,
        SlotGrant,
        SlotReturn,
        SlotRecall,
        StagingOffer,
    }
    assert covered == set(MESSAGE_TYPES)


# ---------------------------------------------------------------------------------------
# Helpers


def _expected_arrays(msg, arrays):
    kv, state = None, []
    if isinstance(msg, TransferRequest):
        for spec, arr in zip(msg.indices, arrays, strict=True):
            if spec.role == "kv":
                kv = arr
            else:
                state.append(arr)
    return kv, state


def _assert_same_indices(got: np.ndarray, want) -> None:
    assert got.dtype == INDEX_DTYPE
    assert got.ndim == 1
    assert not got.flags.writeable
    np.testing.assert_array_equal(got, np.asarray(want, dtype=np.int64))


def _check_round_trip(msg, arrays, secret):
    sender, receiver = Codec(secret=secret), Codec(secret=secret)
    frames = sender.encode(msg, arrays)
    assert frames[0] == MAGIC
    assert len(frames) == 2 + len(arrays) + (secret is not None)
    got = receiver.decode(frames, peer="test")
    assert isinstance(got, Decoded), receiver.rejections.counts()
    assert type(got.msg) is type(msg)
    assert got.msg == msg
    kv, state = _expected_arrays(msg, arrays)
    if kv is None:
        assert got.kv is None
    else:
        _assert_same_indices(got.kv, kv)
    assert len(got.state) == len(state)
    for g, w in zip(got.state, state, strict=True):
        _assert_same_indices(g, w)
    assert receiver.rejections.counts() == {}


def _sign(frames: list, secret: bytes) -> list:
    """Appends the HMAC-SHA256 of every frame, computed here independently of the codec."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(bytes(memoryview(f).cast("B")))
    return [*frames, mac.digest()]


def _envelope_frames(msg, *, version=PROTOCOL_VERSION, sent_at=None, signed=False, arrays=()):
    env = Envelope(version, time.time() if sent_at is None else sent_at, signed, msg)
    return [MAGIC, msgspec.msgpack.encode(env), *[np.asarray(a, dtype=INDEX_DTYPE) for a in arrays]]


def _xfer(kv=None, state=(), **overrides) -> TransferRequest:
    fields = dict(
        room=7,
        agent_name="decode-agent-0",
        ip="10.0.0.2",
        port=5555,
        aux_index=3,
        required_dst_info_num=1,
        indices=index_specs(kv, state),
    )
    fields.update(overrides)
    return TransferRequest(**fields)


PING = Ping(sender="agent-x", ip="127.0.0.1", port=4242, seq=1)


def _frame_bytes_for_test(frame):
    return memoryview(getattr(frame, "buffer", frame)).cast("B")


def _only_rejection(codec: Codec, frames, reason: str) -> None:
    assert codec.decode(frames, peer="peer-1") is None
    assert codec.rejections.counts() == {reason: 1}


# ---------------------------------------------------------------------------------------
# Round trips


@PROPERTY
@given(messages_with_arrays)
def test_round_trip_unsigned(case):
    msg, arrays = case
    _check_round_trip(msg, arrays, secret=None)


@PROPERTY
@given(messages_with_arrays, st.binary(min_size=1, max_size=64))
def test_round_trip_signed(case, secret):
    msg, arrays = case
    _check_round_trip(msg, arrays, secret=secret)


@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip_extreme_values(secret):
    big_region = Region(ptr=U64, length=U64, item_len=U64, device=U64, mem_kind="DRAM")
    msgs = [
        PeerRegistration(
            compat=Compat(I64_MIN, "x" * MAX_NAME, U64, U64, True),
            compat_hash="é" * MAX_NAME,
            agent_name="",
            agent_metadata=bytes(range(256)) * 4,
            ip="::1",
            port=65535,
            tp_rank=U64,
            tp_size=1,
            kv=[big_region] * 100,
            aux=[],
            state=[[], [big_region]],
            staging=StagingArea(big_region, slot_bytes=1),
        ),
        RegistrationReply("a", 0, False, "r" * MAX_REASON),
        TransferStatus(room=(1 << 63) - 1, status=4, prefill_rank=U64, reason="", ip="", port=0),
        Abort(room=0, ip="", port=0, generation=I64_MIN),
        AbortAck(room=(1 << 63) - 1, prefill_rank=0, generation=U64),
        Ping(sender="", ip="", port=0, seq=U64),
        Pong(sender="\U0001f600" * MAX_NAME, seq=0, ip="", port=65535),
    ]
    for msg in msgs:
        _check_round_trip(msg, [], secret)
    extremes = np.array([-(1 << 31), -1, 0, 1, (1 << 31) - 1], dtype=np.int32)
    empty = np.zeros(0, dtype=np.int32)
    _check_round_trip(
        _xfer(extremes, [empty, extremes[::-1]], aux_index=-1),
        [extremes, empty, extremes[::-1]],
        secret,
    )
    _check_round_trip(_xfer(empty), [empty], secret)


def test_encode_passes_int32_arrays_through_without_copy():
    codec = Codec()
    kv = np.arange(1000, dtype=np.int32)
    state = np.arange(10, dtype=np.dtype("<i4"))
    frames = codec.encode(_xfer(kv, [state]), [kv, state])
    assert frames[2] is kv
    assert frames[3] is state

    wide = np.arange(1000, dtype=np.int64)
    frames = codec.encode(_xfer(wide), [wide])
    assert frames[2] is not wide
    assert frames[2].dtype == INDEX_DTYPE and frames[2].flags.c_contiguous
    np.testing.assert_array_equal(frames[2], wide)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([0, 1 << 31], dtype=np.int64),
        np.array([-(1 << 31) - 1], dtype=np.int64),
        np.array([U64], dtype=np.uint64),
        np.array([1.5], dtype=np.float64),
    ],
    ids=["above-int32", "below-int32", "uint64-max", "fraction"],
)
def test_encode_refuses_indices_that_do_not_fit_int32(bad):
    # numpy's cast would wrap these silently, sending indices of other pages.
    with pytest.raises(ValueError):
        Codec().encode(_xfer(bad), [bad])


# ---------------------------------------------------------------------------------------
# Zero-copy receive over real ZMQ sockets


@pytest.fixture
def push_pull():
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    pull.setsockopt(zmq.RCVTIMEO, 10_000)
    push.setsockopt(zmq.SNDTIMEO, 10_000)
    push.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.LINGER, 0)
    yield push, pull
    push.close()
    pull.close()
    ctx.term()


def _frame_address(frame: zmq.Frame) -> int:
    return np.frombuffer(frame.buffer, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("secret", [None, SECRET])
def test_zero_copy_decode_of_zmq_frames(push_pull, secret):
    push, pull = push_pull
    rng = np.random.default_rng(0)
    kv = rng.integers(-(1 << 31), 1 << 31, size=1 << 15, dtype=np.int32)  # 128 KiB
    state = rng.integers(0, 1 << 20, size=1 << 15, dtype=np.int32)
    msg = _xfer(kv, [state])
    sender, receiver = Codec(secret=secret), Codec(secret=secret)
    frames = sender.encode(msg, [kv, state])
    assert frames[2] is kv and frames[3] is state
    push.send_multipart(frames, copy=False)
    received = pull.recv_multipart(copy=False)
    assert all(isinstance(f, zmq.Frame) for f in received)

    got = receiver.decode(received, peer="tcp-peer")
    assert got is not None, receiver.rejections.counts()
    assert got.msg == msg
    for arr, frame, want in ((got.kv, received[2], kv), (got.state[0], received[3], state)):
        assert arr.base is not None
        assert arr.flags.owndata is False
        assert arr.flags.writeable is False
        assert arr.dtype == INDEX_DTYPE
        # the array's memory is the frame's own memory: nothing was copied
        assert arr.ctypes.data == _frame_address(frame)
        np.testing.assert_array_equal(arr, want)
        with pytest.raises(ValueError):
            arr[0] = 1


def test_decoded_arrays_are_read_only_even_over_writable_buffers():
    kv = np.arange(100, dtype=np.int32)
    frames = Codec().encode(_xfer(kv), [kv])
    frames[2] = bytearray(frames[2].tobytes())
    got = Codec().decode(frames)
    assert got is not None
    assert got.kv.flags.writeable is False
    np.testing.assert_array_equal(got.kv, kv)


# ---------------------------------------------------------------------------------------
# Each reason for refusing a message


def test_reject_protocol_version():
    frames = _envelope_frames(PING, version=PROTOCOL_VERSION + 1)
    _only_rejection(Codec(), frames, "protocol_version")


def test_reject_protocol_version_even_when_body_is_unreadable():
    # A newer peer's body may not fit this version's schema at all (an unknown message
    # type here); the version mismatch is still what gets named.
    header = msgspec.msgpack.encode(
        [PROTOCOL_VERSION + 1, time.time(), False, {"type": "from_the_future", "x": 1}]
    )
    _only_rejection(Codec(), [MAGIC, header], "protocol_version")
    # ... while the same body at our own version is simply malformed.
    header = msgspec.msgpack.encode(
        [PROTOCOL_VERSION, time.time(), False, {"type": "from_the_future", "x": 1}]
    )
    _only_rejection(Codec(), [MAGIC, header], "malformed")


def test_reject_unauthenticated():
    frames = Codec().encode(PING)
    _only_rejection(Codec(secret=SECRET), frames, "unauthenticated")


def test_reject_unauthenticated_signed_flag_without_mac_frame():
    frames = Codec(secret=SECRET).encode(PING)[:-1]
    _only_rejection(Codec(secret=SECRET), frames, "unauthenticated")


def test_reject_bad_mac_bit_flip_in_index_frame():
    kv = np.arange(64, dtype=np.int32)
    codec = Codec(secret=SECRET)
    frames = codec.encode(_xfer(kv), [kv])
    assert codec.decode(list(frames)) is not None  # the unmodified frames pass
    flipped = bytearray(frames[2].tobytes())
    flipped[17] ^= 0x04
    frames[2] = bytes(flipped)
    _only_rejection(codec, frames, "bad_mac")


def test_reject_bad_mac_bit_flip_in_header():
    codec = Codec(secret=SECRET)
    frames = codec.encode(PING)
    i = frames[1].index(b"agent-x")
    header = bytearray(frames[1])
    header[i + len("agent-")] ^= 0x01  # "agent-x" -> "agent-y": still a valid Ping
    frames[1] = bytes(header)
    assert msgspec.msgpack.decode(frames[1], type=Envelope).body.sender == "agent-y"
    _only_rejection(codec, frames, "bad_mac")


@pytest.mark.parametrize(
    "mac",
    [
        b"\x00" * MAC_LEN,
        b"",
        b"\x00" * (MAC_LEN - 1),
        b"\x00" * (MAC_LEN + 1),
    ],
    ids=["zeros", "empty", "short", "long"],
)
def test_reject_bad_mac_wrong_mac_frame(mac):
    frames = Codec(secret=SECRET).encode(PING)
    frames[-1] = mac
    _only_rejection(Codec(secret=SECRET), frames, "bad_mac")


def test_reject_bad_mac_other_secret():
    frames = Codec(secret=b"another secret").encode(PING)
    _only_rejection(Codec(secret=SECRET), frames, "bad_mac")


def test_hand_signed_frames_are_accepted():
    # The MAC is HMAC-SHA256 over every frame before it, as computed independently here.
    kv = np.arange(5, dtype=np.int32)
    msg = _xfer(kv)
    frames = _sign(_envelope_frames(msg, signed=True, arrays=[kv]), SECRET)
    got = Codec(secret=SECRET).decode(frames)
    assert got is not None and got.msg == msg
    np.testing.assert_array_equal(got.kv, kv)


@pytest.mark.parametrize("offset_s", [-3600.0, 3600.0, -31.0], ids=["past", "future", "just-past"])
def test_reject_stale(offset_s):
    frames = _sign(_envelope_frames(PING, sent_at=time.time() + offset_s, signed=True), SECRET)
    _only_rejection(Codec(secret=SECRET, max_skew_s=30.0), frames, "stale")


def test_not_stale_within_skew():
    frames = _sign(_envelope_frames(PING, sent_at=time.time() - 10.0, signed=True), SECRET)
    codec = Codec(secret=SECRET, max_skew_s=30.0)
    assert codec.decode(frames) is not None
    assert codec.rejections.counts() == {}


def test_reject_replayed_signed_message():
    """A captured signed message sent again within the skew window is refused; a fresh
    message with the same content (new send time, new MAC) is not."""
    codec = Codec(secret=SECRET)
    sender = Codec(secret=SECRET)
    frames = sender.encode(PING)
    assert codec.decode(frames, peer="peer-1") is not None
    assert codec.decode([bytes(_frame_bytes_for_test(f)) for f in frames], peer="peer-1") is None
    assert codec.rejections.counts() == {"replayed": 1}
    assert codec.decode(sender.encode(PING), peer="peer-1") is not None
    assert codec.rejections.counts() == {"replayed": 1}
    # without a shared secret there is no MAC to remember: nothing is refused
    plain = Codec()
    frames = Codec().encode(PING)
    assert plain.decode(frames) is not None and plain.decode(frames) is not None


def test_replay_guard_forgets_after_the_window_and_stays_bounded():
    from sgl_nixl_plugin.wire.replay import ReplayGuard

    g = ReplayGuard(window_s=10.0, max_entries=3)
    assert g.first_time(b"a", now=100.0) and not g.first_time(b"a", now=119.0)
    assert g.first_time(b"a", now=120.5)  # 2 windows later the stale check refuses copies
    for m in (b"b", b"c", b"d"):
        assert g.first_time(m, now=121.0)
    assert len(g) == 3  # bounded: the oldest went first
    assert not g.first_time(b"d", now=121.0)


@pytest.mark.parametrize("sent_at", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_reject_stale_non_finite_send_time(sent_at):
    frames = _sign(_envelope_frames(PING, sent_at=sent_at, signed=True), SECRET)
    _only_rejection(Codec(secret=SECRET, max_skew_s=30.0), frames, "stale")


def test_reject_unexpected_signature():
    frames = Codec(secret=SECRET).encode(PING)
    _only_rejection(Codec(), frames, "unexpected_signature")


def test_reject_frame_count_missing_index_frame():
    kv = np.arange(4, dtype=np.int32)
    frames = Codec().encode(_xfer(kv), [])
    _only_rejection(Codec(), frames, "frame_count")


def test_reject_frame_count_extra_frame_after_xfer():
    kv = np.arange(4, dtype=np.int32)
    frames = Codec().encode(_xfer(kv), [kv, kv])
    _only_rejection(Codec(), frames, "frame_count")


def test_reject_frame_count_index_frame_on_other_message():
    frames = [*Codec().encode(PING), np.arange(4, dtype=np.int32).tobytes()]
    _only_rejection(Codec(), frames, "frame_count")


def test_reject_frame_count_signed():
    frames = _sign([*_envelope_frames(PING, signed=True), b"\x00" * 8], SECRET)
    _only_rejection(Codec(secret=SECRET), frames, "frame_count")


@pytest.mark.parametrize("n_bytes", [0, 9 * 4, 10 * 4 + 1, 11 * 4])
def test_reject_index_frame_size(n_bytes):
    kv = np.arange(10, dtype=np.int32)
    frames = Codec().encode(_xfer(kv), [kv])
    frames[2] = b"\x01" * n_bytes
    _only_rejection(Codec(), frames, "index_frame_size")


def test_reject_index_frame_size_count_above_limit():
    msg = _xfer(indices=[IndexSpec("kv", MAX_INDEX_COUNT + 1)])
    frames = _envelope_frames(msg) + [b""]
    _only_rejection(Codec(), frames, "index_frame_size")


def test_reject_duplicate_kv_frame():
    kv = np.arange(3, dtype=np.int32)
    msg = _xfer(indices=[IndexSpec("kv", 3), IndexSpec("kv", 3)])
    _only_rejection(Codec(), Codec().encode(msg, [kv, kv]), "duplicate_kv_frame")


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [MAGIC],
        [b"SGLNIXM", b"\x90"],
        [b"", b""],
        [MAGIC + b"\x00", b"\x90"],
        [MAGIC[:-1], b"\x90"],
    ],
    ids=["none", "magic-only", "wrong-magic", "empty", "long-magic", "short-magic"],
)
def test_reject_not_ours(frames):
    _only_rejection(Codec(), frames, "not_ours")


def test_reject_not_ours_real_message_in_wrong_order():
    frames = Codec().encode(PING)
    _only_rejection(Codec(), frames[::-1], "not_ours")


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x94\x01",  # truncated array
        msgspec.msgpack.encode({"version": 1}),
        msgspec.msgpack.encode([PROTOCOL_VERSION, 0.0, False]),
        msgspec.msgpack.encode([PROTOCOL_VERSION, 0.0, False, {"type": "ping"}]),
        msgspec.msgpack.encode(
            [
                PROTOCOL_VERSION,
                0.0,
                False,
                {"type": "ping", "sender": "a", "ip": "b", "port": 70000, "seq": 0},
            ]
        ),
        msgspec.msgpack.encode(
            [
                PROTOCOL_VERSION,
                0.0,
                False,
                {"type": "pong", "sender": "a" * (MAX_NAME + 1), "seq": 0},
            ]
        ),
        msgspec.msgpack.encode([PROTOCOL_VERSION, 0.0, False, {"type": "abort", "room": -1}]),
        msgspec.msgpack.encode([PROTOCOL_VERSION, 0.0, False, {"type": "abort", "room": 1 << 63}]),
        msgspec.msgpack.encode(
            [PROTOCOL_VERSION, 0.0, 1, {"type": "pong", "sender": "a", "seq": 0}]
        ),
        msgspec.msgpack.encode(
            [PROTOCOL_VERSION, 0.0, False, {"type": "pong", "sender": "a", "seq": 0}]
        )
        + b"\x00",
        msgspec.msgpack.encode(["1", 0.0, False, {"type": "pong", "sender": "a", "seq": 0}]),
    ],
    ids=[
        "empty",
        "reserved-byte",
        "truncated",
        "map-envelope",
        "no-body",
        "missing-fields",
        "port-out-of-range",
        "name-too-long",
        "negative-room",
        "room-too-big",
        "int-as-bool",
        "trailing-bytes",
        "string-version",
    ],
)
def test_reject_malformed(header):
    _only_rejection(Codec(), [MAGIC, header], "malformed")


def test_reject_oversized(monkeypatch):
    frames = Codec().encode(PING)
    monkeypatch.setattr(codec_mod, "MAX_HEADER_BYTES", len(frames[1]) - 1)
    _only_rejection(Codec(), frames, "oversized")
    monkeypatch.setattr(codec_mod, "MAX_HEADER_BYTES", len(frames[1]))
    assert Codec().decode(frames) is not None  # a header of exactly the limit is fine


def test_rejection_reaches_listeners_and_logs_peer(caplog):
    seen = []
    codec = Codec(secret=SECRET)
    codec.rejections.listeners.append(seen.append)
    with caplog.at_level(logging.WARNING, logger=codec_mod.__name__):
        assert codec.decode(Codec().encode(PING), peer="10.1.2.3:999") is None
    assert seen == ["unauthenticated"]
    assert any(
        "10.1.2.3:999" in r.getMessage() and "unauthenticated" in r.getMessage()
        for r in caplog.records
    )


def test_failing_listener_does_not_make_decode_raise():
    def broken(reason: str) -> None:
        raise RuntimeError("metrics backend down")

    rejections = Rejections()
    rejections.listeners.append(broken)
    codec = Codec(rejections=rejections)
    assert codec.decode([b"junk"]) is None
    # still exactly one reason per refused message, and not an internal error
    assert codec.rejections.counts() == {"not_ours": 1}
    assert codec.decode(Codec().encode(PING)) is not None


def test_fields_older_releases_left_out_are_required_now():
    """Protocol v3 drops the optional fields kept for 0.1-0.3 peers: a status that does not
    name its sender, a piece or credit without a sequence number, a pong without an address
    are refused, not read with a default (both sides run the same release)."""
    old_status = msgspec.msgpack.encode(
        {"type": "status", "room": 3, "status": 4, "prefill_rank": 1}
    )
    with pytest.raises(msgspec.ValidationError, match="reason|ip"):
        msgspec.msgpack.decode(old_status, type=TransferStatus)
    with pytest.raises(msgspec.ValidationError, match="seq"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"type": "piece_done", "room": 1, "agent_name": "d", "slot": 0}),
            type=PieceDone,
        )
    with pytest.raises(msgspec.ValidationError, match=">= 1"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(
                {"type": "piece_done", "room": 1, "agent_name": "d", "slot": 0, "seq": 0}
            ),
            type=PieceDone,
        )
    with pytest.raises(msgspec.ValidationError, match="ip"):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode({"type": "pong", "sender": "p", "seq": 1}), type=Pong
        )
    assert not hasattr(StagingArea(Region(1, 2, 1), 1), "returns")
    assert "returns" not in RegistrationReply.__struct_fields__
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(SlotReturn(1, "p", "127.0.0.1", 5, list(range(65)))),
            type=SlotReturn,
        )


def _foreign_frames(body: dict, version: int, secret: bytes | None = None) -> list:
    header = msgspec.msgpack.encode([version, time.time(), secret is not None, body])
    frames = [MAGIC, header]
    if secret is not None:
        import hashlib
        import hmac

        frames.append(hmac.new(secret, MAGIC + header, hashlib.sha256).digest())
    return frames


OLD_REGISTRATION = {  # a 0.4 (protocol v2) decode's registration, with fields v3 dropped
    "type": "reg",
    "compat": {"protocol_version": 2},
    "compat_hash": "h",
    "agent_name": "dec",
    "agent_metadata": b"",
    "ip": "127.0.0.1",
    "port": 5555,
    "tp_rank": 0,
    "tp_size": 1,
    "kv": [],
    "aux": [],
    "staging": {"returns": True},
}


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_registration_of_another_protocol_version_is_read_as_foreign(secret):
    """A peer of another release is still rejected (counted as protocol_version), but its
    registration comes out as a ForeignRegistration, so that the prefill can refuse it with
    a reason instead of leaving the decode to time out."""
    codec = Codec(secret=secret)
    got = codec.decode(_foreign_frames(OLD_REGISTRATION, 2, secret))
    assert got is not None and isinstance(got.msg, ForeignRegistration)
    assert (got.msg.agent_name, got.msg.ip, got.msg.port, got.msg.version) == (
        "dec",
        "127.0.0.1",
        5555,
        2,
    )
    assert codec.rejections.counts() == {"protocol_version": 1}
    # other messages of another version stay plain rejections
    assert (
        codec.decode(
            _foreign_frames(
                {"type": "ping", "sender": "x", "ip": "h", "port": 1, "seq": 1}, 2, secret
            )
        )
        is None
    )
    if secret is not None:  # a forged (unsigned) foreign registration is not answered
        assert Codec(secret=secret).decode(_foreign_frames(OLD_REGISTRATION, 2)) is None


def test_a_refusal_in_the_peers_version_reads_as_a_refusal_there():
    """The prefill answers in the foreign peer's envelope: a codec of that version reads a
    RegistrationReply refusal (what a 0.4 decode does with it: fail its rooms with the
    reason), and this version reads a foreign refusal as a ForeignReply."""
    codec = Codec()
    reply = RegistrationReply(
        "dec", 0, False, "protocol version mismatch: decode speaks v2", "127.0.0.1", 7
    )
    frames = codec.encode_foreign(reply, 2)
    env = msgspec.msgpack.decode(frames[1])
    assert env[0] == 2 and env[3]["type"] == "reg_reply" and env[3]["accepted"] is False
    assert set(env[3]) <= {
        "type",
        "agent_name",
        "prefill_rank",
        "accepted",
        "reason",
        "ip",
        "port",
        "retry",
        "kv_window",  # optional, after the frozen fields: older releases ignore it
        "one_pass",  # likewise
        "done_flags",  # likewise
        "wants_staging",  # likewise
    }
    got = Codec().decode(frames)
    assert isinstance(got.msg, ForeignReply) and not got.msg.accepted and got.msg.version == 2
    assert "mismatch" in got.msg.reason and (got.msg.ip, got.msg.port) == ("127.0.0.1", 7)


@pytest.mark.parametrize("length", [0, 63, 65])
def test_an_ipc_handle_of_any_other_length_than_64_bytes_is_refused(length):
    """A CUDA IPC handle is 64 bytes: anything else never reaches cudaIpcOpenMemHandle."""
    reg = _small_registration(
        ipc=CudaIpc(host="h", device_uuid="u", pid=1, blocks=[IpcBlock(b"x" * length, 0, 1)]),
    )
    _only_rejection(Codec(), Codec().encode(reg), "malformed")


def _small_registration(**kw) -> PeerRegistration:
    return PeerRegistration(
        compat=Compat(PROTOCOL_VERSION, "bf16", 16, 2, False),
        compat_hash="h",
        agent_name="d",
        agent_metadata=b"m",
        ip="127.0.0.1",
        port=1,
        tp_rank=0,
        tp_size=1,
        kv=[],
        aux=[],
        **kw,
    )


def test_lazy_staging_fields_pass_between_releases():
    """Same protocol version, older release: a registration or reply without the lazy
    staging fields reads as "not on request" / "does not ask", and an older release's
    decoder (a struct without them: ``ForeignReply`` has a reply's frozen fields) reads
    ours, ignoring them."""
    reply = RegistrationReply("dec", 0, True, "", "127.0.0.1", 7, wants_staging=True)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(reply), type=ForeignReply)
    assert old.accepted and old.port == 7
    plain = msgspec.msgpack.encode(ForeignReply("dec", 0, True, "", "127.0.0.1"))
    assert msgspec.msgpack.decode(plain, type=RegistrationReply).wants_staging is False
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(_small_registration()))
    raw.pop("staging_slot_bytes")  # what an older release sends
    old_reg = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=PeerRegistration)
    assert old_reg.staging_slot_bytes == 0 and old_reg.staging is None
