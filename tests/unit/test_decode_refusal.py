"""A prefill rank's refusal of this decode fails its rooms, and every prefill rank serving
each of them is told, though SGLang's scheduler may clear a failed room at once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.sides.decode_policy import DecodePolicy
from sgl_nixl_plugin.wire.messages import Abort

STAGE0, STAGE1 = ("127.0.0.1", 9000), ("127.0.0.1", 9100)


class Scheduler:
    """SGLang's table as its decode scheduler sees it: a failed room's receiver is polled
    and cleared (its record leaves) as soon as ``clears`` says so."""

    def __init__(self, rooms: DecodeRooms, clears: bool) -> None:
        self.rooms, self.clears = rooms, clears
        self.failed: dict[int, str] = {}
        self.forgotten: list[Any] = []

    def fail(self, room: int, reason: str) -> bool:
        if room in self.failed:
            return False
        self.failed[room] = reason
        if self.clears:
            self.rooms.close(room, ok=False)
        return True

    def forget_prefill_endpoint(self, endpoint: Any, disconnect: bool) -> None:
        self.forgotten.append((endpoint, disconnect))


def _policy(clears: bool) -> tuple[DecodePolicy, list[tuple[Any, Any]], Scheduler]:
    rooms = DecodeRooms()
    for room in (11, 12):  # a PP 1 decode's rooms are served by both stages
        rooms.open(room, {STAGE0, STAGE1})
    rooms.open(13, {STAGE1})  # one stage 0 does not serve
    sent: list[tuple[Any, Any]] = []
    sg = Scheduler(rooms, clears)
    ctx = SimpleNamespace(
        rooms=rooms,
        sglang=sg,
        me=SimpleNamespace(ip="127.0.0.1", port=9500),
        refused={},
        one_pass=set(),
        flag_ranks={},
        staging=None,
        warmup=None,
        send=lambda ep, msg: sent.append((ep, msg)),
    )
    return DecodePolicy(ctx), sent, sg  # type: ignore[arg-type]


def test_a_stage_refusing_the_decode_gets_every_stage_told_even_once_the_room_is_cleared():
    for clears in (False, True):
        policy, sent, sg = _policy(clears)
        policy.on_refused(STAGE0, "state buffers are per stage")
        assert sorted(sg.failed) == [11, 12], clears
        told = sorted((msg.room, ep) for ep, msg in sent)
        assert told == [(11, STAGE0), (11, STAGE1), (12, STAGE0), (12, STAGE1)], clears
        for _, msg in sent:
            assert isinstance(msg, Abort)
            assert msg.reason == (
                "prefill 127.0.0.1:9000 refused this decode: state buffers are per stage"
            )
        assert sg.forgotten == [(STAGE0, False)]  # alive: its socket stays for the aborts
        assert policy.ctx.refused[STAGE0][0] == "state buffers are per stage"


def test_the_second_stages_refusal_fails_nothing_more_and_tells_no_one_again():
    policy, sent, sg = _policy(clears=True)
    policy.on_refused(STAGE0, "why")
    sent.clear()
    policy.on_refused(STAGE1, "why")
    assert sorted(sg.failed) == [11, 12, 13]  # 13 was open still
    assert [(msg.room, ep) for ep, msg in sent] == [(13, STAGE1)]
