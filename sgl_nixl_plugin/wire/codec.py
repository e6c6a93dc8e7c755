"""Framing, authentication and validation of control messages on ZMQ.

A message is ``[MAGIC, header, *index_frames, mac?]``:

- ``header`` is msgpack of an ``Envelope`` (protocol version, send time, whether signed,
  and one ``Message`` of the tagged union);
- each index frame is a raw little-endian int32 array sent straight from its numpy buffer
  and read back with ``np.frombuffer`` over the received frame: no Python lists, no copy;
- ``mac`` (only when a shared secret is configured) is HMAC-SHA256 over every frame before it;
  a signed message is accepted once (``replay.ReplayGuard``) and only within ``max_skew_s`` of
  its send time.

``Codec.decode`` never raises on bad input: it returns ``None`` after counting the reason
and logging one line, so a receiving thread survives any garbage a peer sends.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from sgl_nixl_plugin.wire.messages import (
    MAX_INDEX_FRAMES,
    PROTOCOL_VERSION,
    IndexSpec,
    Message,
    RegistrationReply,
    TransferRequest,
)
from sgl_nixl_plugin.wire.replay import ReplayGuard

logger = logging.getLogger(__name__)

MAGIC = b"SGLNIXL"
INDEX_DTYPE = np.dtype("<i4")
MAC_LEN = 32
MAX_HEADER_BYTES = 72 << 20
MAX_INDEX_COUNT = 1 << 26


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    sent_at: float
    signed: bool
    body: Message


class _VersionProbe(msgspec.Struct, array_like=True):
    """Just the version of an ``Envelope`` (msgspec skips the trailing fields)."""

    version: int


class ForeignRegistration(msgspec.Struct, frozen=True, tag="reg"):
    """What every protocol version's ``PeerRegistration`` says: who to refuse, and where."""

    agent_name: str
    ip: str
    port: int
    version: int = 0  # filled in from the envelope


class ForeignReply(msgspec.Struct, frozen=True, tag="reg_reply"):
    """What every protocol version's ``RegistrationReply`` says."""

    agent_name: str
    prefill_rank: int
    accepted: bool
    reason: str = ""
    ip: str = ""
    port: int = 0
    version: int = 0


class _ForeignEnvelope(msgspec.Struct, array_like=True):
    version: int
    sent_at: float
    signed: bool
    body: ForeignRegistration | ForeignReply


@dataclass
class Decoded:
    """A validated message and the index arrays that came with it (read-only views)."""

    msg: Any
    kv: np.ndarray | None = None
    state: list[np.ndarray] = field(default_factory=list)


class Rejections:
    """Counts rejected messages by reason; logs one line per rejection, throttled per reason."""

    def __init__(self, log_interval_s: float = 1.0) -> None:
        self._counts: Counter[str] = Counter()
        self._last_log: dict[str, float] = {}
        self._lock = threading.Lock()
        self._interval = log_interval_s
        self.listeners: list[Callable[[str], None]] = []

    def reject(self, reason: str, detail: str = "", peer: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            self._counts[reason] += 1
            n = self._counts[reason]
            due = now - self._last_log.get(reason, -1e9) >= self._interval
            if due:
                self._last_log[reason] = now
        if due:
            logger.warning(
                "sgl-nixl: dropped control message from %s: %s%s (%d so far)",
                peer or "unknown peer",
                reason,
                f" ({detail})" if detail else "",
                n,
            )
        for listener in self.listeners:
            try:
                listener(reason)
            except Exception:  # a faulty hook must not turn a rejection into a raise
                if due:
                    logger.exception("sgl-nixl: rejection listener %r failed", listener)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def _frame_bytes(frame: Any) -> memoryview:
    """A read-only view of a ZMQ frame, bytes or buffer, without copying."""
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B")


def index_specs(kv: np.ndarray | None, state: Sequence[np.ndarray] = ()) -> list[IndexSpec]:
    specs = [] if kv is None else [IndexSpec("kv", int(len(kv)))]
    return specs + [IndexSpec("state", int(len(s))) for s in state]


class Codec:
    """Encodes and decodes framed messages; one per socket owner, thread-safe."""

    def __init__(
        self,
        secret: bytes | None = None,
        max_skew_s: float = 300.0,
        rejections: Rejections | None = None,
    ) -> None:
        self.secret = secret or None
        self.max_skew_s = max_skew_s
        self.rejections = rejections or Rejections()
        self.replays = ReplayGuard(max_skew_s)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Envelope)
        self._probe = msgspec.msgpack.Decoder(_VersionProbe)
        self._foreign = msgspec.msgpack.Decoder(_ForeignEnvelope)

    def encode(self, msg: Message, arrays: Sequence[np.ndarray] = ()) -> list[Any]:
        """Frames for ``msg``; ``arrays`` are sent without a copy when already int32."""
        return self._encode(PROTOCOL_VERSION, msg, arrays)

    def encode_foreign(self, reply: RegistrationReply, version: int) -> list[Any]:
        """A registration refusal in the envelope of protocol ``version`` (a peer of another
        release reads it: the envelope, the MAC and the reply's fields are frozen)."""
        return self._encode(version, reply, ())

    def _encode(self, version: int, msg: Message, arrays: Sequence[np.ndarray]) -> list[Any]:
        header = self._encoder.encode(Envelope(version, time.time(), self.secret is not None, msg))
        frames: list[Any] = [MAGIC, header]
        for arr in arrays:
            frame = np.ascontiguousarray(arr, dtype=INDEX_DTYPE)
            if frame is not arr and not np.array_equal(frame, arr):
                # numpy's cast wraps silently: a wrapped page index would address the
                # wrong pages on the peer, so refuse instead of sending it.
                raise ValueError("index array has values that are not int32 page indices")
            frames.append(frame)
        if self.secret is not None:
            frames.append(self._mac(frames))
        return frames

    def _mac(self, frames: Sequence[Any]) -> bytes:
        mac = hmac.new(self.secret or b"", digestmod=hashlib.sha256)
        for f in frames:
            mac.update(_frame_bytes(f))
        return mac.digest()

    def decode(self, frames: Sequence[Any], peer: str = "") -> Decoded | None:
        """The message in ``frames``, or None (counted and logged) if it is not acceptable."""
        try:
            return self._decode(frames, peer)
        except Exception as exc:  # a bug here must not kill a receiving thread either
            self.rejections.reject("internal_error", repr(exc), peer)
            return None

    def _peer_version(self, header: memoryview) -> int | None:
        try:
            return self._probe.decode(header).version
        except msgspec.DecodeError:
            return None

    def _reject_version(self, version: int, peer: str) -> None:
        self.rejections.reject(
            "protocol_version",
            f"peer speaks v{version}, we speak v{PROTOCOL_VERSION}: upgrade both sides "
            "to the same sgl-nixl-plugin release",
            peer,
        )

    def _foreign_contact(
        self, frames: Sequence[Any], header: memoryview, version: int, peer: str
    ) -> Decoded | None:
        """A peer of another protocol version: rejected (counted, logged), except its
        registration or registration reply, read through the fields every version keeps
        so that both sides can fail fast with a reason instead of timing out."""
        self._reject_version(version, peer)
        try:
            env = self._foreign.decode(header)
        except msgspec.DecodeError:
            return None
        if self.secret is not None:
            mac = bytes(_frame_bytes(frames[-1])) if len(frames) > 2 else b""
            if (
                not env.signed
                or len(mac) != MAC_LEN
                or not hmac.compare_digest(mac, self._mac(frames[:-1]))
            ):
                return None
        return Decoded(msgspec.structs.replace(env.body, version=version))

    def _decode(self, frames: Sequence[Any], peer: str) -> Decoded | None:
        reject = self.rejections.reject
        if len(frames) < 2 or bytes(_frame_bytes(frames[0])) != MAGIC:
            reject("not_ours", f"{len(frames)} frames", peer)
            return None
        header = _frame_bytes(frames[1])
        if len(header) > MAX_HEADER_BYTES:
            reject("oversized", f"header {len(header)} bytes", peer)
            return None
        try:
            env = self._decoder.decode(header)
        except msgspec.DecodeError as exc:
            # A peer on another protocol version usually sends a body this version cannot
            # read at all: name the version mismatch rather than calling it malformed.
            version = self._peer_version(header)
            if version is not None and version != PROTOCOL_VERSION:
                return self._foreign_contact(frames, header, version, peer)
            reject("malformed", str(exc)[:200], peer)
            return None
        if env.version != PROTOCOL_VERSION:
            return self._foreign_contact(frames, header, env.version, peer)
        body_frames = self._authentic_body(env, frames, peer)
        if body_frames is None:
            return None
        return self._with_indices(env.body, body_frames, peer)

    def _authentic_body(self, env: Envelope, frames: Sequence[Any], peer: str) -> list[Any] | None:
        """The frames after the header, less the MAC, if the message is as authentic as
        this side demands: with a shared secret, signed, its MAC right, fresh and never
        seen before; without one, unsigned. None (rejected) otherwise."""
        reject = self.rejections.reject
        body_frames = list(frames[2:])
        if self.secret is None:
            if env.signed:
                reject("unexpected_signature", "peer has a shared secret, this side has none", peer)
                return None
            return body_frames
        if not env.signed or not body_frames:
            reject("unauthenticated", "a shared secret is configured here", peer)
            return None
        mac = bytes(_frame_bytes(body_frames.pop()))
        if len(mac) != MAC_LEN or not hmac.compare_digest(mac, self._mac(frames[:-1])):
            reject("bad_mac", "", peer)
            return None
        now = time.time()
        if not abs(now - env.sent_at) <= self.max_skew_s:  # NaN is stale too
            reject("stale", f"sent {now - env.sent_at:.0f}s ago", peer)
            return None
        if not self.replays.first_time(mac, now):
            reject("replayed", f"a copy of a {type(env.body).__name__} already accepted", peer)
            return None
        return body_frames

    def _with_indices(self, body: Any, body_frames: list[Any], peer: str) -> Decoded | None:
        """``body`` with its index frames as read-only int32 arrays, if they match the
        specs a ``TransferRequest`` declares (other messages carry none). None (rejected)
        otherwise."""
        reject = self.rejections.reject
        specs = body.indices if isinstance(body, TransferRequest) else []
        if len(specs) != len(body_frames) or len(specs) > MAX_INDEX_FRAMES:
            reject("frame_count", f"{len(body_frames)} index frames for {len(specs)} specs", peer)
            return None
        out = Decoded(body)
        for spec, frame in zip(specs, body_frames, strict=True):
            view = _frame_bytes(frame)
            if spec.count > MAX_INDEX_COUNT or len(view) != spec.count * INDEX_DTYPE.itemsize:
                reject("index_frame_size", f"{len(view)} bytes for {spec.count} indices", peer)
                return None
            arr = np.frombuffer(view, dtype=INDEX_DTYPE)
            arr.flags.writeable = False  # zmq frames are writable buffers; keep the view read-only
            if spec.role == "kv":
                if out.kv is not None:
                    reject("duplicate_kv_frame", "", peer)
                    return None
                out.kv = arr
            else:
                out.state.append(arr)
        return out
