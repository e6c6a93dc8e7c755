"""Direct rooms that end through their WRITEs' NIXL notifications (``wire.notes``): the
prefill's notes, and the decode's count of them, driven in process with fakes (no NIXL, no
SGLang, no threads)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.sides.decode_side import NOTES_MAX_BYTES, DecodeSide
from sgl_nixl_plugin.wire.notes import Note, decode_note, encode_note

ROOM, OTHER, RANK = 7, 8, 3
EP = ("127.0.0.1", 7100)
PENDING, SUCCESS = 2, 4


def test_a_note_round_trips_and_anything_else_is_not_one() -> None:
    assert decode_note(encode_note(ROOM, RANK, 2, 2)) == Note(ROOM, RANK, 2, 2)
    assert decode_note(encode_note(ROOM, RANK, 1, 0)) == Note(ROOM, RANK, 1, 0)
    assert decode_note(b"") is None
    assert decode_note(b"warm-up") is None
    assert decode_note(encode_note(ROOM, RANK, 1, 0) + b"x") is None
    assert decode_note(encode_note(ROOM, RANK, 0, 0)) is None  # numbered from 1
    assert decode_note(encode_note(ROOM, RANK, 1, 2)) is None  # a total only on the last


class Agent:
    def __init__(self) -> None:
        self.inbox: list[bytes] = []

    def notifications(self) -> dict[str, list[bytes]]:
        got, self.inbox = self.inbox, []
        return {"prefill-0": got} if got else {}


class Tables:
    def __init__(self) -> None:
        self.status: dict[int, int] = {}
        self.applied: list[tuple[int, int, int]] = []

    def is_open(self, room: int) -> bool:
        return self.status.get(room) not in (None, 0, SUCCESS)

    def apply_status(self, room: int, status: int, rank: int, reason: str) -> None:
        self.applied.append((room, status, rank))
        self.status[room] = status

    def senders_of(self, room: int) -> int:
        return 1


@pytest.fixture
def decode():
    agent, sg = Agent(), Tables()
    ctx = SimpleNamespace(
        rooms=DecodeRooms(),
        sglang=sg,
        engine=SimpleNamespace(
            agent=agent, memory=SimpleNamespace(kv=SimpleNamespace(item_lens=(1 << 10,) * 2))
        ),
        settings=Settings(write_notes=True),
        one_pass=set(),
        flags=None,
        flag_ranks={},
        staging=None,
        note_hits=0,
    )
    side = object.__new__(DecodeSide)
    side.ctx = ctx
    side.listener = SimpleNamespace(expect_data=lambda warmup=False: None)
    return SimpleNamespace(side=side, agent=agent, sg=sg, ctx=ctx)


def _request(d, room: int, pages: int = 4) -> bool:
    d.ctx.rooms.start_requests(room, [EP])
    d.sg.status[room] = PENDING
    _, _, _, notes = d.side.request(room, np.arange(pages), staged=False)
    d.ctx.rooms.end_requests(room)
    return notes


def test_a_room_ends_once_every_write_of_its_rank_landed(decode) -> None:
    assert _request(decode, ROOM) and _request(decode, OTHER)
    assert decode.side.flags_pending()  # nothing rings when notes land: poll sooner
    decode.agent.inbox += [encode_note(ROOM, RANK, 1, 0), encode_note(OTHER, RANK, 1, 1)]
    decode.side.check_notes(ROOM)
    # the other room's single WRITE landed: its Success is applied on the same pass
    assert decode.sg.applied == [(OTHER, SUCCESS, RANK)]
    decode.agent.inbox += [encode_note(ROOM, RANK, 3, 3)]  # the last, but #2 not yet here
    decode.side.check_notes(ROOM)
    assert decode.sg.applied == [(OTHER, SUCCESS, RANK)]
    decode.agent.inbox += [encode_note(ROOM, RANK, 2, 0)]
    decode.side.check_notes(ROOM)
    assert decode.sg.applied == [(OTHER, SUCCESS, RANK), (ROOM, SUCCESS, RANK)]
    assert decode.ctx.note_hits == 2 and not decode.side.flags_pending()


def test_notes_do_not_override_a_room_that_already_ended(decode) -> None:
    assert _request(decode, ROOM)
    decode.sg.status[ROOM] = 0  # SGLang failed it (an abort) before its WRITE landed,
    decode_status.failed_here(decode.ctx, ROOM)  # which the receiver's poll tells the room
    decode.agent.inbox += [encode_note(ROOM, RANK, 1, 1), encode_note(99, RANK, 1, 1)]
    decode.side.check_notes(ROOM)
    assert decode.sg.applied == [] and not decode.side.flags_pending()


def test_no_notes_are_asked_when_off_for_large_rooms_or_when_the_rank_writes_in_one_pass(
    decode,
) -> None:
    decode.ctx.settings = Settings(write_notes=False)
    assert not _request(decode, ROOM)
    decode.ctx.settings = Settings()  # the default: on
    assert not _request(decode, ROOM + 10, pages=NOTES_MAX_BYTES // (2 << 10) + 1)  # large
    assert _request(decode, ROOM + 11, pages=NOTES_MAX_BYTES // (2 << 10))
    decode.ctx.one_pass.add(EP)
    assert not _request(decode, OTHER)
    decode.agent.inbox += [encode_note(OTHER, RANK, 1, 1)]
    decode.side.check_notes(OTHER)
    assert decode.sg.applied == []
