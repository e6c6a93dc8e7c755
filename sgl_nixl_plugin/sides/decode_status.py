"""A decode room's outcome: prefill statuses, completion flags and local failures go to the
room's machine (``protocol.decode_machine``), and what it decides reaches SGLang here only.

The machine decides from its phase whether a status still applies (not over an abort or a
failure already applied; a Success once every expected sender reported it); ``_apply``
carries out its ``ApplyStatus`` through the rooms facade. A failure SGLang sets itself (its
timeouts, a failed bootstrap) is told to the machine as ``FailedHere`` as SGLang sets it
(the manager's ``update_status``), and again, harmlessly, by the receiver's ``poll()``.
"""

from __future__ import annotations

import time

from sgl_nixl_plugin.protocol.decode_machine import (
    FAILED,
    SUCCESS,
    ApplyStatus,
    Effect,
    FailedHere,
    FlagGiven,
    FlagSeen,
    StatusIn,
)
from sgl_nixl_plugin.sides.context import DecodeContext
from sgl_nixl_plugin.wire.messages import Abort, TransferStatus

Endpoint = tuple[str, int]


def status_in(ctx: DecodeContext, msg: TransferStatus, received: float | None = None) -> None:
    """A prefill rank's status message for one of our rooms (behind its scatters);
    ``received``: when it came, if it was not held for them."""
    if msg.status not in (SUCCESS, FAILED) or ctx.rooms.get(msg.room) is None:
        # readiness, not an outcome; or a room with no live record of ours (a receiver
        # bootstrapped without our init, a room cleared): SGLang's own rules decide
        ctx.sglang.apply_status(msg.room, msg.status, msg.prefill_rank, msg.reason)
        return
    event = StatusIn(
        msg.prefill_rank, msg.status == SUCCESS, msg.reason, ctx.sglang.senders_of(msg.room)
    )
    # read before the failure applies: SGLang's scheduler may clear the record at once
    others = ctx.rooms.endpoints(msg.room) - {(msg.ip, msg.port)} if msg.status == FAILED else set()
    effects = ctx.rooms.feed(msg.room, event, received)
    _apply(ctx, msg.room, effects)
    if others and any(isinstance(e, ApplyStatus) and not e.ok for e in effects):
        _tell_others(ctx, msg, others)


def _tell_others(ctx: DecodeContext, msg: TransferStatus, others: set[Endpoint]) -> None:
    """One prefill rank failed a room that others serve too (pipeline stages, a TP
    mismatch): they are told at once, as SGLang's decode tells them only with its deferred
    release on, and one that has no request of the room yet would wait for its timeout."""
    me = ctx.me
    why = f"prefill rank {msg.ip}:{msg.port} failed the room: {msg.reason}"
    for ep in sorted(others):
        ctx.send(ep, Abort(msg.room, me.ip, me.port, None, why))


def success_in(ctx: DecodeContext, room: int, rank: int) -> None:
    """A prefill rank's Success learned before its status message (the notes on its
    WRITEs all landed); the message, when it comes, then changes nothing."""
    event = StatusIn(rank, True, "", ctx.sglang.senders_of(room))
    _apply(ctx, room, ctx.rooms.feed(room, event, time.perf_counter()))


def fail(ctx: DecodeContext, room: int, reason: str) -> bool:
    """Fail an open room here (SGLang's status), and tell its machine; whether it was open."""
    failed = bool(ctx.sglang.fail(room, reason))
    if failed:
        ctx.rooms.feed(room, FailedHere())
    return failed


def failed_here(ctx: DecodeContext, room: int) -> None:
    """SGLang's status of ``room`` became Failed (seen by its receiver's poll)."""
    ctx.rooms.feed(room, FailedHere())


def take_flag(ctx: DecodeContext, room: int, target: Endpoint | None) -> tuple[int, int] | None:
    """A board word and value for ``target``'s one-pass writes of ``room``, or None (no
    board, the rank did not map it, the room ended, or every word is taken). The word is
    the room's until its way out (the machine's ``FreeFlags``)."""
    board, rooms = ctx.flags, ctx.rooms
    rank = ctx.flag_ranks.get(target) if target is not None else None
    if board is None or rank is None:
        return None
    with rooms.lock:  # the room cannot end between the word's taking and its filing
        if room not in rooms:
            return None
        got = board.take()
        if got is not None:
            ctx.flags_given += 1
            rooms.feed(room, FlagGiven(got[0], got[1], rank))
    return got


def check_flags(ctx: DecodeContext, room: int) -> None:
    """Feed the room's machine every completion flag of its one-pass senders now stored:
    the scheduler calls this through the receiver's ``poll()``, so a room ends as its last
    copy ends, not after the status message's hop (which still comes, and is a no-op)."""
    rec, board = ctx.rooms.get(room), ctx.flags
    if rec is None or board is None or not rec.flags_due:
        return
    seen = [word for word, value, _ in rec.flags_due if board.seen(word, value)]
    if not seen:
        return
    rooms, expected, now = ctx.rooms, ctx.sglang.senders_of(room), time.perf_counter()
    for word in seen:
        ctx.flag_hits += 1
        _apply(ctx, room, rooms.feed(room, FlagSeen(word, expected), now))


def _apply(ctx: DecodeContext, room: int, effects: list[Effect]) -> None:
    """The one place a prefill status reaches SGLang: each rank's (SGLang counts a room's
    Success over its senders, and sets it at the last)."""
    for effect in effects:
        if isinstance(effect, ApplyStatus):
            status = SUCCESS if effect.ok else FAILED
            for rank in effect.ranks:
                ctx.sglang.apply_status(room, status, rank, effect.reason)
