"""A prefill room's transitions: the room takes an event and returns the effects to carry
out; its phase decides, and the count of what it has in flight is a field of the record.

The owning transfer worker feeds every event but one (``Released``: SGLang's scheduler
thread, at ``clear()``) and carries out the effects. Nothing here sends, polls or touches
SGLang: a ``Mirror`` effect hands the count to the facade (``SGLangRooms.mirror_in_flight``,
the one place it reaches SGLang's ``_staging_outstanding``), a ``ConcludeFailure`` or
``ConcludeSuccess`` asks it to decide the outcome under its lock, and ``Close`` takes the
record out of its table. Every effect but those of ``Released`` is carried out by the owner.

Phases::

    AWAITING --ChunkIn--> SENDING --ChunkIn(last)--> LANDING --nothing in flight-->
    CONCLUDING --Concluded(ok)--> SUCCEEDED | FAILED
    AWAITING | SENDING | LANDING --Failure | StatusEnded | Released--> DRAINING
    DRAINING --nothing in flight--> FAILED
    AWAITING --Released, nothing in flight--> FAILED (no worker ever claimed it)

In flight: each chunk from ``ChunkIn`` until its posts are done (``Settled``), and each
WRITE, one-pass copy, staged job or owed completion flag from ``Posted`` to ``Settled``
(given up after the drain bound counts as settled). A chunk counts before the worker reads
SGLang's status, so an abort that marks the room Failed and then ACKs once nothing is in
flight either sees the chunk or is seen by the worker.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field


class PrefillPhase(enum.Enum):
    AWAITING = "awaiting"  # decode destinations arriving; no chunk yet
    SENDING = "sending"  # a worker owns it: chunks come, WRITEs may be in flight
    LANDING = "landing"  # the last chunk came: Success once nothing is in flight
    CONCLUDING = "concluding"  # nothing in flight: Success asked of SGLang
    DRAINING = "draining"  # failed, ended elsewhere or released: no new WRITE
    SUCCEEDED = "succeeded"  # terminal: Success concluded
    FAILED = "failed"  # terminal: nothing in flight, not a Success

    @property
    def sends(self) -> bool:
        """Whether a new WRITE may start."""
        return self in _SENDS

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


_SENDS = frozenset({PrefillPhase.AWAITING, PrefillPhase.SENDING, PrefillPhase.LANDING})
TERMINAL = (PrefillPhase.SUCCEEDED, PrefillPhase.FAILED)


# -- events -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkIn:
    """A chunk reached its worker; it counts as in flight until its posts are done."""

    last: bool


@dataclass(frozen=True)
class Posted:
    """``n`` WRITEs, one-pass copies, staged jobs or owed flags went out."""

    n: int = 1


@dataclass(frozen=True)
class Settled:
    """``n`` of what is in flight ended (done, failed or given up); ``error``: one failed."""

    n: int = 1
    error: str = ""


@dataclass(frozen=True)
class Failure:
    """Failed here (a post refused, no destination, a bug): this side concludes it."""

    reason: str


@dataclass(frozen=True)
class StatusEnded:
    """SGLang's status says Failed (an abort, a lost decode, a timeout, concluded on another
    thread) or the room is gone: whoever ended it told the decode."""


@dataclass(frozen=True)
class Released:
    """SGLang cleared the room's sender (scheduler thread)."""


@dataclass(frozen=True)
class Concluded:
    """What SGLang emitted for ``ConcludeSuccess``: Success or not (failed meanwhile)."""

    ok: bool


Event = ChunkIn | Posted | Settled | Failure | StatusEnded | Released | Concluded


# -- effects ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mirror:
    """The in-flight count changed: SGLang holds Success and an abort's ACK on it."""

    in_flight: int


@dataclass(frozen=True)
class ConcludeFailure:
    """Fail the room in SGLang and tell its decodes (once; never after a Success)."""

    reason: str


@dataclass(frozen=True)
class ConcludeSuccess:
    """Ask SGLang to conclude Success; answer with ``Concluded``."""


@dataclass(frozen=True)
class Close:
    """The one way out: the record leaves its table in ``phase``."""

    phase: PrefillPhase


Effect = Mirror | ConcludeFailure | ConcludeSuccess | Close


class RoomClosed(RuntimeError):
    """Something was started for a room that is already closed (a caller's bug)."""


@dataclass(eq=False)
class RoomMachine:
    """A room's phase, the count of what it has in flight and why it failed."""

    room: int
    phase: PrefillPhase = PrefillPhase.AWAITING
    in_flight: int = 0
    reason: str = ""  # why it failed ("room ended": elsewhere, or released)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def on(self, event: Event) -> list[Effect]:
        """Apply ``event``; the effects to carry out, in order."""
        with self._lock:
            if isinstance(event, ChunkIn):
                return self._chunk_in(event.last)
            if isinstance(event, Posted):
                return self._posted(event.n)
            if isinstance(event, Settled):
                return self._settled(event.n, event.error)
            if isinstance(event, Failure):
                return self._drain(event.reason or "failed", conclude=True)
            if isinstance(event, StatusEnded):
                return self._drain("room ended", conclude=False)
            if isinstance(event, Released):
                return self._released()
            if isinstance(event, Concluded):
                return self._concluded(event.ok)
            raise TypeError(f"not a prefill room event: {event!r}")

    def _chunk_in(self, last: bool) -> list[Effect]:
        self._count(1)
        if self.phase is PrefillPhase.AWAITING:
            self.phase = PrefillPhase.SENDING
        if last and self.phase is PrefillPhase.SENDING:
            self.phase = PrefillPhase.LANDING
        return [Mirror(self.in_flight)]

    def _posted(self, n: int) -> list[Effect]:
        self._count(n)
        return [Mirror(self.in_flight)]

    def _count(self, n: int) -> None:
        if self.phase.terminal:
            raise RoomClosed(f"room {self.room} is closed ({self.phase.value})")
        if n < 0:
            raise ValueError(f"room {self.room}: {n} in flight")
        self.in_flight += n

    def _settled(self, n: int, error: str) -> list[Effect]:
        if not 0 <= n <= self.in_flight:
            raise ValueError(f"room {self.room}: {n} settled, {self.in_flight} in flight")
        self.in_flight -= n
        out: list[Effect] = [Mirror(self.in_flight)]
        if error:
            return out + self._drain(error, conclude=True)
        return out + self._idle()

    def _drain(self, reason: str, conclude: bool) -> list[Effect]:
        """Stop sending; the first cause stands, and only a failure of ours is concluded
        here (an ended status was concluded by whoever ended it)."""
        if not self.phase.sends:
            return self._idle()
        self.reason = reason
        self.phase = PrefillPhase.DRAINING
        out: list[Effect] = [ConcludeFailure(reason)] if conclude else []
        return out + self._idle()

    def _released(self) -> list[Effect]:
        """A room no worker claimed closes now; a claimed one drains, and its worker closes
        it (it may be submitting a chunk right now)."""
        if self.phase is PrefillPhase.AWAITING and not self.in_flight:
            self.reason = "released before its first chunk"
            return self._close(PrefillPhase.FAILED)
        if self.phase.sends:
            self.reason = "room ended"
            self.phase = PrefillPhase.DRAINING
        return []

    def _concluded(self, ok: bool) -> list[Effect]:
        if self.phase is not PrefillPhase.CONCLUDING:
            raise RuntimeError(f"room {self.room}: Concluded in {self.phase.value}")
        return self._close(PrefillPhase.SUCCEEDED if ok else PrefillPhase.FAILED)

    def _idle(self) -> list[Effect]:
        """Nothing in flight: the phase decides what comes next."""
        if self.in_flight:
            return []
        if self.phase is PrefillPhase.LANDING:
            self.phase = PrefillPhase.CONCLUDING
            return [ConcludeSuccess()]
        if self.phase is PrefillPhase.DRAINING:
            return self._close(PrefillPhase.FAILED)
        return []

    def _close(self, phase: PrefillPhase) -> list[Effect]:
        self.phase = phase
        return [Close(phase)]
