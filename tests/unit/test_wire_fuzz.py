"""``Codec.decode`` on garbage and on mutated valid messages: it never raises, returns a
``Decoded`` of a known message type or ``None``, and counts every ``None`` once."""

from __future__ import annotations

import hashlib
import hmac
import logging
import random
import time
import types
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
    MAGIC,
    Codec,
    Decoded,
    Rejections,
    index_specs,
)
from sgl_nixl_plugin.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Compat,
    Message,
    PeerRegistration,
    Ping,
    Pong,
    Region,
    RegistrationReply,
    StagingArea,
    TransferRequest,
    TransferStatus,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"fuzz-secret"
MESSAGE_TYPES = typing.get_args(Message)
TAGS = ["reg", "reg_reply", "xfer", "status", "abort", "abort_ack", "ping", "pong"]
PROPERTY = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Tally:
    """Decodes with one codec and checks the accounting of every outcome."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.nones = 0
        self.accepted = 0

    def decode(self, frames) -> Decoded | None:
        before = sum(self.codec.rejections.counts().values())
        got = self.codec.decode(frames, peer="fuzzer")
        after = sum(self.codec.rejections.counts().values())
        if got is None:
            self.nones += 1
            assert after == before + 1  # exactly one reason per refused message
        else:
            self.accepted += 1
            assert after == before
            _check_decoded(got)
        return got

    def check(self) -> None:
        counts = self.codec.rejections.counts()
        assert "internal_error" not in counts, counts
        assert sum(counts.values()) == self.nones
        assert all(n > 0 for n in counts.values())


def _check_decoded(got: Decoded) -> None:
    assert isinstance(got, Decoded)
    assert isinstance(got.msg, MESSAGE_TYPES)
    specs = got.msg.indices if isinstance(got.msg, TransferRequest) else []
    arrays = ([] if got.kv is None else [got.kv]) + list(got.state)
    assert len(arrays) == len(specs)
    for arr in arrays:
        assert isinstance(arr, np.ndarray)
        assert arr.dtype == INDEX_DTYPE and arr.ndim == 1
        assert not arr.flags.writeable
    kv_specs = [s for s in specs if s.role == "kv"]
    assert len(kv_specs) == (got.kv is not None)
    if got.kv is not None:
        assert len(got.kv) == kv_specs[0].count
    assert [len(a) for a in got.state] == [s.count for s in specs if s.role == "state"]


# ---------------------------------------------------------------------------------------
# (a) random frames


def _msgpack_values():
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(1 << 63), (1 << 64) - 1)
        | st.floats(allow_nan=True)
        | st.text(max_size=20)
        | st.binary(max_size=20)
        | st.sampled_from(TAGS)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=5)
            | st.dictionaries(
                st.sampled_from(["type", "room", "ip", "port", "seq", "sender"])
                | st.text(max_size=5),
                inner,
                max_size=5,
            )
        ),
        max_leaves=20,
    )


@st.composite
def envelope_like_headers(draw) -> bytes:
    """msgpack that looks like an envelope: [version, sent_at, signed, {type: tag, ...}]."""
    body = draw(st.dictionaries(st.text(max_size=12), _msgpack_values(), max_size=6))
    if draw(st.booleans()):
        body["type"] = draw(st.sampled_from(TAGS))
    env = [
        draw(st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION + 1, 0, -1]) | _msgpack_values()),
        draw(st.floats() | _msgpack_values()),
        draw(st.booleans() | _msgpack_values()),
        body,
    ]
    env = env[: draw(st.integers(0, 5))]
    return msgspec.msgpack.encode(env)


headers = st.one_of(
    st.binary(max_size=64),
    envelope_like_headers(),
    _msgpack_values().map(msgspec.msgpack.encode),
)
any_frames = st.lists(st.binary(max_size=64), max_size=6)
magic_frames = st.tuples(
    st.just(MAGIC), headers, st.lists(st.binary(max_size=40) | st.just(b"\x00" * 32), max_size=4)
).map(lambda t: [t[0], t[1], *t[2]])


@PROPERTY
@given(st.lists(any_frames | magic_frames, min_size=1, max_size=8), st.booleans())
def test_random_frames(batches, with_secret):
    tally = Tally(Codec(secret=SECRET if with_secret else None))
    for frames in batches:
        tally.decode(frames)
    tally.check()


# ---------------------------------------------------------------------------------------
# (b) mutations of valid messages

_REGION = Region(ptr=0x7F0000000000, length=1 << 20, item_len=4096, device=1, mem_kind="VRAM")
_COMPAT = Compat(PROTOCOL_VERSION, "bfloat16", 64, 32, False)


def _samples() -> list[tuple[Message, list[np.ndarray]]]:
    kv = np.arange(40, dtype=np.int32) * 3
    s0 = np.arange(5, dtype=np.int32)
    s1 = np.array([-1, 0, 7], dtype=np.int32)
    return [
        (
            PeerRegistration(
                compat=_COMPAT,
                compat_hash="0" * 32,
                agent_name="decode-0",
                agent_metadata=b"\x01\x02nixl-metadata" * 4,
                ip="10.0.0.1",
                port=17000,
                tp_rank=1,
                tp_size=2,
                kv=[_REGION, _REGION],
                aux=[_REGION],
                state=[[_REGION]],
                staging=StagingArea(_REGION, slot_bytes=1 << 16),
            ),
            [],
        ),
        (RegistrationReply("prefill-0", 0, False, "page_size: prefill=64 decode=32"), []),
        (
            TransferRequest(
                7, "decode-0", "10.0.0.1", 17000, 3, 1, indices=index_specs(kv, [s0, s1])
            ),
            [kv, s0, s1],
        ),
        (TransferRequest(8, "decode-0", "10.0.0.1", 17000, -1, 2, 5, True, index_specs(kv)), [kv]),
        (TransferRequest(9, "d", "h", 1, 0, 1), []),
        (
            TransferStatus(
                room=7, status=2, prefill_rank=1, reason="ok", ip="10.0.0.2", port=17001
            ),
            [],
        ),
        (Abort(room=7, ip="10.0.0.1", port=17000, generation=3), []),
        (AbortAck(room=7, prefill_rank=0), []),
        (Ping(sender="decode-0", ip="10.0.0.1", port=17001, seq=42), []),
        (Pong(sender="prefill-0", seq=42, ip="10.0.0.2", port=17001), []),
    ]


def _as_bytes(frame) -> bytes:
    return bytes(memoryview(frame).cast("B"))


def _sign(frames: list[bytes]) -> list[bytes]:
    mac = hmac.new(SECRET, digestmod=hashlib.sha256)
    for f in frames:
        mac.update(f)
    return [*frames, mac.digest()]


_WRONG_VALUES = [
    None,
    True,
    -1,
    1 << 63,
    (1 << 64) - 1,
    -(1 << 63),
    1.5,
    float("nan"),
    "x",
    "y" * 300,
    b"\x00\xff",
    [],
    [1, 2, 3],
    {},
    {"type": "ping"},
    [[[[[]]]]],
    ["kv", 5],
    ["state", -1],
    [0, 0, 0],
    [0, 1, 0, 0, "DRAM"],
    [1, 1, 1, 1, "HBM"],
]


def _type_confused(rng: random.Random, msg: Message, arrays, signed: bool) -> list[bytes]:
    """An envelope whose body has the right tag but some field with a wrong-typed or
    out-of-range value (or a missing/extra field, or another message's tag)."""
    body = msgspec.to_builtins(msg, builtin_types=(bytes,))
    body["type"] = msg.__struct_config__.tag
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.7:
            body[rng.choice(list(body))] = rng.choice(_WRONG_VALUES)
        elif op < 0.8 and len(body) > 1:
            body.pop(rng.choice([k for k in body if k != "type"] or ["type"]))
        elif op < 0.9:
            body["type"] = rng.choice(TAGS)
        else:
            body[rng.choice(["extra", "indices", "kv", "generation"])] = rng.choice(_WRONG_VALUES)
    env = [PROTOCOL_VERSION, time.time(), signed, body]
    frames = [MAGIC, msgspec.msgpack.encode(env), *[_as_bytes(a) for a in arrays]]
    return _sign(frames) if signed else frames


def _pick(rng: random.Random, frames: list[bytes]) -> int:
    """A frame to damage, mostly past the magic one so that most mutants get further."""
    if len(frames) > 1 and rng.random() < 0.9:
        return rng.randrange(1, len(frames))
    return rng.randrange(len(frames))


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(9)
    if op == 0 or not frames:  # flip bits
        if frames:
            i = _pick(rng, frames)
            if frames[i]:
                b = bytearray(frames[i])
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                frames[i] = bytes(b)
    elif op == 1:  # truncate a frame
        i = _pick(rng, frames)
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif op == 2:  # insert bytes
        i = _pick(rng, frames)
        at = rng.randrange(len(frames[i]) + 1)
        junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        frames[i] = frames[i][:at] + junk + frames[i][at:]
    elif op == 3:  # drop a frame
        del frames[rng.randrange(len(frames))]
    elif op == 4:  # duplicate a frame
        i = _pick(rng, frames)
        frames.insert(rng.randrange(len(frames) + 1), frames[i])
    elif op == 5:  # reorder frames
        rng.shuffle(frames)
    elif op == 6:  # swap two frames
        i, j = rng.randrange(len(frames)), rng.randrange(len(frames))
        frames[i], frames[j] = frames[j], frames[i]
    elif op == 7:  # overwrite a byte with a msgpack marker
        i = _pick(rng, frames)
        if frames[i]:
            b = bytearray(frames[i])
            b[rng.randrange(len(b))] = rng.choice(
                [
                    0xC0,
                    0xC1,
                    0xC2,
                    0xC3,
                    0xDC,
                    0xDD,
                    0xDE,
                    0xDF,
                    0xD9,
                    0xDB,
                    0xCF,
                    0xD3,
                    0xCB,
                    0x90,
                    0x80,
                ]
            )
            frames[i] = bytes(b)
    else:  # replace a frame by random bytes of a plausible size
        i = _pick(rng, frames)
        frames[i] = bytes(rng.randrange(256) for _ in range(rng.choice([0, 4, 32, len(frames[i])])))
    return frames


ITERATIONS = 3000


@pytest.mark.parametrize("with_secret", [False, True], ids=["plain", "signed"])
def test_mutation_fuzz(with_secret):
    rng = random.Random(1234)
    secret = SECRET if with_secret else None
    sender = Codec(secret=secret)
    tally = Tally(Codec(secret=secret))
    seeds = []
    for msg, arrays in _samples():
        frames = [_as_bytes(f) for f in sender.encode(msg, arrays)]
        got = tally.decode(frames)
        assert got is not None and got.msg == msg  # the unmutated seeds are all valid
        seeds.append((msg, arrays, frames))
    started = time.monotonic()
    for _ in range(ITERATIONS):
        msg, arrays, frames = rng.choice(seeds)
        if rng.random() < 0.25:
            frames = _type_confused(rng, msg, arrays, signed=with_secret)
        for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
            frames = _mutate(rng, frames)
        wrap = rng.random()
        if wrap < 0.15:  # as a receiving socket hands them over
            frames = [zmq.Frame(f) for f in frames]
        elif wrap < 0.3:
            frames = [bytearray(f) for f in frames]
        tally.decode(frames)
    assert time.monotonic() - started < 10.0
    tally.check()
    # the fuzzer actually exercises the decoder past the first checks
    counts = tally.codec.rejections.counts()
    assert tally.accepted > len(seeds)
    assert {"malformed", "not_ours"} <= counts.keys()
    if with_secret:  # a signed message's frames are checked by the MAC before their count
        assert {"bad_mac", "unauthenticated"} <= counts.keys()
    else:
        assert {"frame_count", "index_frame_size"} <= counts.keys()


def test_type_confused_bodies_are_malformed():
    rng = random.Random(99)
    tally = Tally(Codec())
    for msg, arrays in _samples():
        for wrong in _WRONG_VALUES:
            for field in msg.__struct_fields__:
                body = msgspec.to_builtins(msg, builtin_types=(bytes,))
                body["type"] = msg.__struct_config__.tag
                if body.get(field) == wrong and type(body.get(field)) is type(wrong):
                    continue
                body[field] = wrong
                frames = [
                    MAGIC,
                    msgspec.msgpack.encode([PROTOCOL_VERSION, time.time(), False, body]),
                ]
                frames += [_as_bytes(a) for a in arrays]
                tally.decode(frames)
        tally.decode(_type_confused(rng, msg, arrays, signed=False))
    tally.check()
    assert tally.codec.rejections.counts().get("malformed", 0) > 0.5 * tally.nones


# ---------------------------------------------------------------------------------------
# (c) log throttling


def _warnings(caplog, reason: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == codec_mod.__name__
        and r.levelno == logging.WARNING
        and f": {reason}" in r.getMessage()
    ]


def test_log_one_line_per_reason_per_interval(caplog):
    codec = Codec(rejections=Rejections(log_interval_s=3600.0))
    with caplog.at_level(logging.WARNING, logger=codec_mod.__name__):
        for _ in range(500):
            assert codec.decode([b"junk", b"junk"]) is None
        for _ in range(500):
            assert codec.decode([MAGIC, b"\xc1"]) is None
    assert codec.rejections.counts() == {"not_ours": 500, "malformed": 500}
    assert len(_warnings(caplog, "not_ours")) == 1
    assert len(_warnings(caplog, "malformed")) == 1  # each reason is throttled on its own


def test_log_every_rejection_without_interval(caplog):
    codec = Codec(rejections=Rejections(log_interval_s=0.0))
    with caplog.at_level(logging.WARNING, logger=codec_mod.__name__):
        for _ in range(20):
            assert codec.decode([b"junk", b"junk"]) is None
    assert len(_warnings(caplog, "not_ours")) == 20
    assert "(20 so far)" in _warnings(caplog, "not_ours")[-1].getMessage()


def test_log_again_after_interval(caplog, monkeypatch):
    now = [1000.0]
    fake_time = types.SimpleNamespace(time=time.time, monotonic=lambda: now[0])
    monkeypatch.setattr(codec_mod, "time", fake_time)  # the codec's clock only
    codec = Codec(rejections=Rejections(log_interval_s=5.0))
    with caplog.at_level(logging.WARNING, logger=codec_mod.__name__):
        for step in range(40):  # 40 rejections, 0.5 s apart: 20 s in all
            now[0] = 1000.0 + 0.5 * step
            assert codec.decode([b"junk"]) is None
    # logged at t = 0, 5, 10, 15
    assert len(_warnings(caplog, "not_ours")) == 4
