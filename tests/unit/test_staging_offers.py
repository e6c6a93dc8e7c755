"""A decode's staging area on request: allocated once when the first prefill rank asks,
offered to every rank that asked before any of its slots can be granted, and requests
staged to every rank that did not decline (none after a failed allocation)."""

from __future__ import annotations

import threading

import pytest

from sgl_nixl_plugin.engine.staging import StagingBuffer
from sgl_nixl_plugin.engine.staging_memory import LazyStaging
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.sides.staging_offers import StagingOffers
from sgl_nixl_plugin.wire.messages import StagingOffer

pytestmark = pytest.mark.timeout(60)

A, B = ("127.0.0.1", 5), ("127.0.0.1", 6)


class _Agent:
    def __init__(self) -> None:
        self.registered = 0

    def register(self, regions) -> None:
        self.registered += 1


def _offers(make=StagingBuffer, gate: threading.Event | None = None):
    agent, sent = _Agent(), []

    def build(*args):
        if gate is not None:
            assert gate.wait(10)
        return make(*args)

    memory = LazyStaging(agent, 4 << 20, 1 << 20, "DRAM", make=build)
    rooms = DecodeRooms()

    def send(ep, msg) -> bool:
        sent.append((ep, msg, len(rooms.slots)))  # the slots grantable when it went
        return True

    offers = StagingOffers(memory, rooms, send, ("d", "h", 9), lambda: b"md")
    return offers, memory, rooms, agent, sent


def test_nothing_is_allocated_until_a_prefill_asks():
    offers, memory, rooms, agent, sent = _offers()
    assert memory.held == 0 and memory.buffer is None and agent.registered == 0
    assert len(rooms.slots) == 0 and not offers.offered and not sent
    assert memory.describe() == (
        "0 MiB of host memory for staging (up to 4 MiB when a peer first stages)"
    )


def test_two_ranks_asking_during_the_allocation_get_one_buffer_and_the_area_after_it():
    gate = threading.Event()
    offers, memory, rooms, agent, sent = _offers(gate=gate)
    offers.offer(A)
    offers.offer(B)  # while the first allocation is still running
    assert not sent and not offers.offered  # nothing offered before the buffer is there
    assert offers.stages_to(A) and offers.stages_to(B)  # their rooms wait for slots
    gate.set()
    assert offers.wait(10)
    assert memory.allocations == 1 and agent.registered == 1 and len(rooms.slots) == 4
    assert memory.held == 4 << 20 and memory.describe() == "4 MiB of host memory for staging"
    # both offers went before a slot could be granted: no grant overtakes the area
    assert [(ep, slots) for ep, _, slots in sent] == [(A, 0), (B, 0)]
    assert offers.offered == {A, B}
    for _, msg, _ in sent:
        assert isinstance(msg, StagingOffer) and msg.staging is not None
        assert msg.agent_metadata == b"md" and (msg.ip, msg.port) == ("h", 9)
        assert msg.staging.region.ptr == memory.buffer.ptr
    offers.offer(A)  # asked again (it answered our registration sent again): it has it
    assert len(sent) == 2 and memory.allocations == 1 and offers.sent == 2


class _SlowLookup(set):
    """``offered`` whose lookup for ``A`` lets the allocation thread finish before the
    answer returns (up to ``bound``): the race of a rank asking again while the
    allocation ends. Checked under the offers' lock, the allocation cannot run meanwhile
    and the lookup gives up after ``bound``."""

    def __init__(self, done: threading.Event, bound: float) -> None:
        super().__init__()
        self.done, self.bound = done, bound

    def __contains__(self, item: object) -> bool:
        found = super().__contains__(item)
        if item == A:
            self.done.wait(self.bound)
        return found


def test_a_rank_asking_again_as_the_allocation_ends_gets_the_area_once():
    gate, done = threading.Event(), threading.Event()
    offers, memory, rooms, agent, sent = _offers(gate=gate)
    offers.offer(A)  # the allocation starts, A waits for it
    offers.offered = _SlowLookup(done, bound=0.5)
    real_send = offers._send

    def send(ep, msg) -> bool:
        ok = real_send(ep, msg)
        done.set()  # the allocation thread sent A its area
        return ok

    offers._send = send
    gate.set()
    offers.offer(A)  # A's reply to our registration sent again, as the allocation ends
    assert offers.wait(10)
    assert [ep for ep, _, _ in sent] == [A], sent  # one area, not two
    assert offers.sent == 1 and memory.allocations == 1


def test_a_failed_allocation_is_offered_as_a_reason_naming_the_setting():
    def fail(*args):
        raise MemoryError("out of memory")

    offers, memory, rooms, agent, sent = _offers(make=fail)
    offers.offer(A)
    assert offers.wait(10)
    ((ep, msg, _),) = sent
    assert ep == A and msg.staging is None and not offers.offered
    assert not offers.stages_to(A)  # its requests go direct
    assert "MemoryError: out of memory" in msg.reason
    assert "SGLANG_NIXL_PLUGIN_STAGING_BYTES" in msg.reason
    assert memory.held == 0 and memory.failures == 1 and len(rooms.slots) == 0
    offers.offer(B)  # no second try: the reason again
    assert len(sent) == 2 and sent[1][1].staging is None and memory.failures == 1


def test_a_rank_that_lost_our_area_gets_it_again_when_it_asks():
    offers, memory, rooms, agent, sent = _offers()
    offers.offer(A)
    assert offers.wait(10) and offers.offered == {A}
    offers.withdraw(A)  # it lost our registration: it asks again, its rooms stay staged
    assert not offers.offered and offers.stages_to(A)
    offers.offer(A)
    assert offers.offered == {A} and memory.allocations == 1 and len(sent) == 2


def test_a_rank_that_declines_gets_no_staged_requests_and_nothing_is_allocated():
    """Its first requests leave before its reply and are staged (they wait for slots or go
    direct); once it says it writes us one pass or direct, none is."""
    offers, memory, rooms, agent, sent = _offers()
    assert offers.stages_to(A)
    offers.withdraw(A, declined=True)
    assert not offers.stages_to(A) and offers.stages_to(B)
    assert memory.buffer is None and not sent
    offers.offer(A)  # it registered again and now stages (another layout, a restart)
    assert offers.wait(10) and offers.stages_to(A) and offers.offered == {A}
    offers.withdraw(B, declined=True)
    offers.withdraw(B)  # forgotten (lost, restarted): unknown again, its requests staged
    assert offers.stages_to(B)


def test_the_offers_say_when_a_prefill_may_be_writing_into_the_area():
    """From the first ask (the allocation runs) until a bound after the offer went (the
    prefill's warm-up WRITE into the area follows it): the listener progresses meanwhile."""
    gate = threading.Event()
    offers, memory, rooms, agent, sent = _offers(gate=gate)
    assert not offers.warming(60.0)  # nobody asked
    offers.offer(A)
    assert offers.warming(0.0)  # the allocation for A runs: its offer is on its way
    gate.set()
    assert offers.wait(10) and len(sent) == 1
    assert offers.warming(60.0)  # A may be WRITEing into the area now
    assert not offers.warming(0.0)  # past A's bound: nothing is due from it
