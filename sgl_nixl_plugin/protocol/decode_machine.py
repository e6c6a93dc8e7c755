"""A decode room's transitions: the room takes an event and returns the effects to carry
out; its phase decides. Time comes in with the events (``now``): nothing here reads a
clock, sends, or touches SGLang.

``DecodeRooms`` feeds every event under its lock and carries out the effects:
``SentTo`` names the prefill rank the transfer request being built goes to,
``ReleaseSlots`` returns the room's staging slots (quarantined after a failure) and stops
its senders waiting, ``ApplyStatus`` is a prefill status SGLang is to see, ``FreeFlags``
returns the room's completion-flag words, and ``Close`` takes the record out of its table
(the one way out).

A room's outcome is decided once, here: a prefill rank's Failed applies while the room is
live and nothing failed it yet (an abort, SGLang's own Failed, an earlier Failed); a
Success applies once every expected sender reported one, by status or by completion flag,
and then for all of them at once (SGLang counts them again). After the outcome, or once
SGLang cleared the room, a status changes nothing.

Phases::

    CONNECTING --RequestsStart--> REQUESTING --RequestsEnd--> RECEIVING
    CONNECTING | REQUESTING | RECEIVING --Aborted--> ABORTED
    any live phase --Cleared(ok)--> SUCCEEDED
    any live phase --Cleared(failed), a host room not drained--> DRAINING
    any live phase --Cleared(failed), otherwise--> FAILED
    DRAINING --AbortAcked | PeerLost | Tick, drained--> FAILED

Live phases are those while SGLang holds the receiver (from its ``init`` to its
``_clear``). A host room's pages (the decode's host pool) stay SGLang's after a failure
until nothing more can land in them, and SGLang clears the receiver before it asks: the
record then stays in its table in DRAINING, and closes once every prefill rank the room's
requests went to acked the abort, or was lost at least ``quarantine_s`` ago (a WRITE
posted before the loss may still be in the network). A device room's pages are held by
SGLang's own ACK count; a successful room owes nothing. What a host room has in flight is
``undrained()``: the ranks that may still write into its pages.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

Endpoint = tuple[str, int]

#: ``KVPoll`` values as status messages carry them
SUCCESS = 4
FAILED = 0


class DecodePhase(enum.Enum):
    CONNECTING = "connecting"  # the prefill ranks are known; no transfer request built yet
    REQUESTING = "requesting"  # SGLang builds one transfer request per prefill rank
    RECEIVING = "receiving"  # the requests went out: data and statuses are due
    ABORTED = "aborted"  # its abort went to its prefill ranks: their ACKs are due
    DRAINING = "draining"  # a failed host room SGLang cleared: its pages wait for the drain
    SUCCEEDED = "succeeded"  # terminal: cleared after Success
    FAILED = "failed"  # terminal: cleared otherwise, and nothing more can land in its pages

    @property
    def live(self) -> bool:
        """SGLang holds the room's receiver (between its ``init`` and its ``_clear``)."""
        return self in _LIVE

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


_LIVE = frozenset(
    {DecodePhase.CONNECTING, DecodePhase.REQUESTING, DecodePhase.RECEIVING, DecodePhase.ABORTED}
)
TERMINAL = (DecodePhase.SUCCEEDED, DecodePhase.FAILED)


# -- events -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Opened:
    """The receiver learnt which prefill ranks serve the room (a repeat replaces them)."""

    endpoints: frozenset[Endpoint]


@dataclass(frozen=True)
class RequestsStart:
    """SGLang is about to build one transfer request per prefill rank, in this order."""

    targets: tuple[Endpoint, ...]


@dataclass(frozen=True)
class NextTarget:
    """The transfer request being built goes to the next target (answered by ``SentTo``)."""


@dataclass(frozen=True)
class RequestsEnd:
    """SGLang built (and sent) the room's transfer requests."""


@dataclass(frozen=True)
class HostPages:
    """The room's destination is the decode's host pool (before its requests go out)."""


@dataclass(frozen=True)
class Aborted:
    """An abort of the room went to its prefill ranks: their ACKs are due."""


@dataclass(frozen=True)
class AbortAcked:
    """``endpoint`` acked the room's abort: nothing of it lands in the room's pages any more."""

    endpoint: Endpoint
    now: float


@dataclass(frozen=True)
class PeerLost:
    """``endpoint`` stopped answering (at ``now``)."""

    endpoint: Endpoint
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed (a question about the drain, a liveness check): a lost rank's quarantine
    may have run out."""

    now: float


@dataclass(frozen=True)
class StatusIn:
    """Prefill rank ``rank``'s status message (behind the room's scatters); ``expected``:
    how many senders' Success make the room's (SGLang's count)."""

    rank: int
    ok: bool
    reason: str = ""
    expected: int = 1


@dataclass(frozen=True)
class FlagGiven:
    """Board word ``word`` (to hold ``value``) went to ``rank`` in a transfer request."""

    word: int
    value: int
    rank: int


@dataclass(frozen=True)
class FlagSeen:
    """``word`` holds its value: its rank's one-pass copy ended, which is its Success."""

    word: int
    expected: int = 1


@dataclass(frozen=True)
class FailedHere:
    """SGLang's status of the room became Failed on this side (an abort, its own timeouts,
    a lost or refusing prefill rank): no prefill status applies any more."""


@dataclass(frozen=True)
class Cleared:
    """SGLang cleared the receiver; ``ok``: its status was Success."""

    ok: bool
    now: float


Event = (
    Opened
    | RequestsStart
    | NextTarget
    | RequestsEnd
    | HostPages
    | Aborted
    | AbortAcked
    | PeerLost
    | Tick
    | StatusIn
    | FlagGiven
    | FlagSeen
    | FailedHere
    | Cleared
)


# -- effects ------------------------------------------------------------------------------
@dataclass(frozen=True)
class SentTo:
    """The transfer request being built goes to ``endpoint``."""

    endpoint: Endpoint


@dataclass(frozen=True)
class ReleaseSlots:
    """The room's staging slots return (quarantined when ``failed``: a late WRITE may still
    land), and its senders stop waiting for one."""

    failed: bool


@dataclass(frozen=True)
class Close:
    """The one way out: the record leaves its table in ``phase``."""

    phase: DecodePhase


@dataclass(frozen=True)
class ApplyStatus:
    """SGLang is to see ``ok`` (Success, else Failed with ``reason``) from each of
    ``ranks``: a room's Success names every sender, once all of them reported."""

    ok: bool
    ranks: tuple[int, ...]
    reason: str = ""


@dataclass(frozen=True)
class FreeFlags:
    """The room's completion-flag words return to the board (at its way out)."""

    words: tuple[int, ...]


Effect = SentTo | ReleaseSlots | ApplyStatus | FreeFlags | Close


@dataclass(eq=False)
class DecodeMachine:
    """A decode room's phase and what its pages wait for. Fed under its table's lock."""

    room: int
    endpoints: set[Endpoint]
    quarantine_s: float = 5.0
    phase: DecodePhase = DecodePhase.CONNECTING
    targets: deque[Endpoint] = field(default_factory=deque)  # while requests go out, in order
    # a host-pool destination: SGLang holds its pages after a failure until every prefill
    # rank the room was sent to acked the abort, or was lost a quarantine ago
    host: bool = False
    sent_to: set[Endpoint] = field(default_factory=set)
    acked: set[Endpoint] = field(default_factory=set)
    lost_at: dict[Endpoint, float] = field(default_factory=dict)
    # the room's outcome as SGLang saw it from here: None while open, else ok
    outcome: bool | None = None
    succeeded: set[int] = field(default_factory=set)  # ranks whose Success came
    # one-pass senders' completion flags (``engine.done_flags``): every board word taken
    # for the room (freed at its way out), and the (word, value, rank) not yet seen
    flag_words: list[int] = field(default_factory=list)
    flags_due: list[tuple[int, int, int]] = field(default_factory=list)

    def on(self, event: Event) -> list[Effect]:
        """Apply ``event``; the effects to carry out, in order. A closed room does nothing."""
        if self.phase.terminal:
            return []
        if isinstance(event, (AbortAcked, PeerLost, Tick)):
            return self._drain_event(event)
        if not self.phase.live:  # DRAINING: SGLang is done with the room, its pages are not
            return []
        if isinstance(event, (StatusIn, FlagSeen, FlagGiven, FailedHere)):
            return self._outcome_event(event)
        if isinstance(event, Opened):
            self.endpoints = set(event.endpoints)
        elif isinstance(event, RequestsStart):
            self.targets = deque(event.targets)
            if self.phase is DecodePhase.CONNECTING:
                self.phase = DecodePhase.REQUESTING
        elif isinstance(event, NextTarget):
            return self._next_target()
        elif isinstance(event, RequestsEnd):
            self.targets.clear()
            if self.phase in (DecodePhase.CONNECTING, DecodePhase.REQUESTING):
                self.phase = DecodePhase.RECEIVING
        elif isinstance(event, HostPages):
            self.host = True
        elif isinstance(event, Aborted):
            self.phase = DecodePhase.ABORTED
            self._failed()
        elif isinstance(event, Cleared):
            return self._cleared(event.ok, event.now)
        else:
            raise TypeError(f"not a decode room event: {event!r}")
        return []

    # -- what the phase and the drain say ---------------------------------------------------
    def owes_data(self) -> bool:
        """Its prefill ranks still owe it data: SGLang holds it, no abort went out, and no
        outcome is decided (liveness watches those ranks closely)."""
        return self.phase.live and self.phase is not DecodePhase.ABORTED and self.outcome is None

    def undrained(self) -> set[Endpoint]:
        """Prefill ranks that may still write into this room's pages."""
        return self.sent_to - self.acked

    def drained(self, now: float) -> bool:
        """Nothing more can land in the room's pages: every rank its requests went to acked
        the abort, or was lost at least ``quarantine_s`` before ``now``."""
        return all(
            ep in self.lost_at and now - self.lost_at[ep] >= self.quarantine_s
            for ep in self.undrained()
        )

    def acks_due(self) -> set[Endpoint]:
        """Prefill ranks whose abort ACK this host room's pages wait for and that are not
        known lost (watched for loss, so that a dead one cannot hold the pages for good)."""
        if not self.host or self.phase not in (DecodePhase.ABORTED, DecodePhase.DRAINING):
            return set()
        return self.undrained() - set(self.lost_at)

    # -- transitions ------------------------------------------------------------------------
    def _next_target(self) -> list[Effect]:
        if not self.targets:
            return []
        target = self.targets.popleft()
        self.sent_to.add(target)
        return [SentTo(target)]

    def _outcome_event(self, event: StatusIn | FlagSeen | FlagGiven | FailedHere) -> list[Effect]:
        if isinstance(event, FlagGiven):
            self.flag_words.append(event.word)
            self.flags_due.append((event.word, event.value, event.rank))
            return []
        if isinstance(event, FailedHere):
            self._failed()
            return []
        return self._status(event)

    def _failed(self) -> None:
        if self.outcome is None:
            self.outcome = False

    def _status(self, event: StatusIn | FlagSeen) -> list[Effect]:
        if isinstance(event, FlagSeen):
            seen = [f for f in self.flags_due if f[0] == event.word]
            if not seen:
                return []
            self.flags_due = [f for f in self.flags_due if f[0] != event.word]
            event = StatusIn(seen[0][2], True, "", event.expected)
        if self.outcome is not None:  # decided: an abort, a failure, or every Success
            return []
        if not event.ok:
            self.outcome = False
            return [ApplyStatus(False, (event.rank,), event.reason)]
        self.succeeded.add(event.rank)
        if len(self.succeeded) < event.expected:
            return []
        self.outcome = True
        return [ApplyStatus(True, tuple(sorted(self.succeeded)))]

    def _drain_event(self, event: AbortAcked | PeerLost | Tick) -> list[Effect]:
        if isinstance(event, AbortAcked):
            self.acked.add(event.endpoint)
        elif isinstance(event, PeerLost) and self.host and event.endpoint in self.sent_to:
            self.lost_at.setdefault(event.endpoint, event.now)
        if self.phase is DecodePhase.DRAINING and self.drained(event.now):
            return self._close(DecodePhase.FAILED)
        return []

    def _cleared(self, ok: bool, now: float) -> list[Effect]:
        self.targets.clear()
        out: list[Effect] = [ReleaseSlots(failed=not ok)]
        if ok:
            return out + self._close(DecodePhase.SUCCEEDED)
        if self.host and not self.drained(now):
            # SGLang clears a failed receiver before it asks whether its host pages may be
            # reused: the record stays, in the table, until they may
            self.phase = DecodePhase.DRAINING
            return out
        return out + self._close(DecodePhase.FAILED)

    def _close(self, phase: DecodePhase) -> list[Effect]:
        self.phase = phase
        words, self.flag_words, self.flags_due = tuple(self.flag_words), [], []
        return ([FreeFlags(words)] if words else []) + [Close(phase)]
