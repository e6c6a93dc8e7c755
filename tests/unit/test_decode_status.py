"""A decode room's outcome through ``sides.decode_status``: statuses, completion flags and
local failures go to the room's machine, and only what it decides reaches SGLang's tables
(a recording stand-in here); the flag words come back to a real board at the room's end.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from sgl_nixl_plugin.engine.done_flags import FlagBoard
from sgl_nixl_plugin.protocol.decode_machine import FAILED, SUCCESS
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.wire.messages import Abort, TransferStatus

PREFILLS = [("10.0.0.1", 1), ("10.0.0.1", 2)]


class Tables:
    """SGLang's tables as the decode reaches them: what was applied, and its Failed."""

    def __init__(self, senders: int) -> None:
        self.senders = senders
        self.applied: list[tuple[int, int, int, str]] = []
        self.failed: set[int] = set()

    def apply_status(self, room: int, status: int, rank: int, reason: str) -> None:
        self.applied.append((room, status, rank, reason))

    def senders_of(self, room: int) -> int:
        return self.senders

    def fail(self, room: int, reason: str) -> bool:
        if room in self.failed:
            return False
        self.failed.add(room)
        return True


@pytest.fixture
def board() -> Iterator[FlagBoard]:
    b = FlagBoard(slots=4)
    yield b
    b.close()


def _ctx(board: FlagBoard | None, senders: int = 2) -> SimpleNamespace:
    rooms = DecodeRooms(0)
    if board is not None:
        rooms.free_flag = board.free
    flag_ranks = {ep: i for i, ep in enumerate(PREFILLS)}
    ctx = SimpleNamespace(rooms=rooms, sglang=Tables(senders), flags=board, flag_ranks=flag_ranks)
    ctx.flags_given = ctx.flag_hits = 0
    ctx.me, ctx.sent = SimpleNamespace(ip="10.0.0.9", port=9), []
    ctx.send = lambda ep, msg: ctx.sent.append((ep, msg))
    rooms.open(3, set(PREFILLS))
    return ctx


def _status(rank: int, ok: bool, reason: str = "") -> TransferStatus:
    return TransferStatus(3, SUCCESS if ok else FAILED, rank, reason, "10.0.0.1", 1 + rank)


def test_one_pass_flags_and_a_status_make_one_success_and_the_words_come_back(board):
    ctx = _ctx(board)
    words = [decode_status.take_flag(ctx, 3, ep) for ep in PREFILLS]
    assert all(words) and board.in_use == 2 and ctx.flags_given == 2
    decode_status.check_flags(ctx, 3)
    assert ctx.sglang.applied == [] and ctx.flag_hits == 0  # nothing stored yet
    board.words[words[0][0]] = words[0][1]  # rank 0's copy ended
    decode_status.check_flags(ctx, 3)
    assert ctx.sglang.applied == []  # one of two senders
    decode_status.status_in(ctx, _status(1, True))
    assert ctx.sglang.applied == [(3, SUCCESS, 0, ""), (3, SUCCESS, 1, "")]
    board.words[words[1][0]] = words[1][1]
    decode_status.check_flags(ctx, 3)
    decode_status.status_in(ctx, _status(0, True))
    assert len(ctx.sglang.applied) == 2 and ctx.flag_hits == 2  # no second Success
    assert board.in_use == 2  # the words stay the room's until its end
    ctx.rooms.close(3, ok=True)
    assert board.in_use == 0
    ctx.rooms.close(3, ok=True)
    assert board.in_use == 0


def test_no_word_for_a_room_that_ended(board):
    ctx = _ctx(board)
    ctx.rooms.close(3, ok=False)
    assert decode_status.take_flag(ctx, 3, PREFILLS[0]) is None and board.in_use == 0


def test_a_local_failure_stops_every_later_status():
    ctx = _ctx(None, senders=1)
    assert decode_status.fail(ctx, 3, "lost") and not decode_status.fail(ctx, 3, "again")
    decode_status.status_in(ctx, _status(0, False, "prefill failed"))
    decode_status.status_in(ctx, _status(0, True))
    assert ctx.sglang.applied == []


def test_the_first_failed_status_applies_and_nothing_after_it():
    ctx = _ctx(None)
    decode_status.status_in(ctx, _status(1, False, "oom"))
    decode_status.status_in(ctx, _status(0, False, "later"))
    decode_status.status_in(ctx, _status(0, True))
    assert ctx.sglang.applied == [(3, FAILED, 1, "oom")]
    decode_status.failed_here(ctx, 3)  # SGLang's poll then sees its Failed: no change
    assert ctx.sglang.applied == [(3, FAILED, 1, "oom")]
    # the other rank serving the room is told once, with the failing rank's reason
    assert ctx.sent == [
        (PREFILLS[0], Abort(3, "10.0.0.9", 9, None, "prefill rank 10.0.0.1:2 failed the room: oom"))
    ]


def test_the_other_ranks_are_told_though_sglang_clears_the_failed_room_at_once():
    """A pipeline stage that refused the decode fails the room by status: the stage that
    has no request of it yet learns only from this decode, whose scheduler may clear the
    room's record as soon as the Failed is set."""
    ctx = _ctx(None)
    cleared = ctx.sglang.apply_status

    def apply_and_clear(room: int, status: int, rank: int, reason: str) -> None:
        cleared(room, status, rank, reason)
        ctx.rooms.close(room, ok=False)

    ctx.sglang.apply_status = apply_and_clear
    decode_status.status_in(ctx, _status(0, False, "refused"))
    assert ctx.rooms.get(3) is None
    assert [(ep, m.room, m.reason) for ep, m in ctx.sent] == [
        (PREFILLS[1], 3, "prefill rank 10.0.0.1:1 failed the room: refused")
    ]


def test_a_failed_status_of_a_room_one_rank_serves_tells_no_one():
    ctx = _ctx(None, senders=1)
    ctx.rooms.open(3, {PREFILLS[0]})
    decode_status.status_in(ctx, _status(0, False, "oom"))
    assert ctx.sglang.applied == [(3, FAILED, 0, "oom")] and ctx.sent == []
