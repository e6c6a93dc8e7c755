"""The decode's piece intake, without its threads: which landed pieces it scatters."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from sgl_nixl_plugin.engine.staging_memory import LazyStaging
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.sides.decode_staging import DecodeStaging, SlotMessenger
from sgl_nixl_plugin.sides.staging_offers import StagingOffers
from sgl_nixl_plugin.wire.messages import PieceReady

P5 = ("127.0.0.1", 5)


class _Agent:
    def register(self, regions):
        pass


class _Scatters:
    def __init__(self) -> None:
        self.launched: list[PieceReady] = []

    def launch(self, m, **_):
        self.launched.append(m)


def _staging():
    rooms = DecodeRooms()
    memory = LazyStaging(_Agent(), 4096, 1024, "DRAM")
    offers = StagingOffers(memory, rooms, lambda ep, m: True, ("decode", "h", 1), lambda: b"")
    offers.offer(P5)  # a prefill asked: allocated (4 slots) on the offers' thread
    assert offers.wait(10) and memory.buffer is not None and len(rooms.slots) == 4
    rejected, failed = [], []
    st = DecodeStaging(
        agent=_Agent(),
        kv=SimpleNamespace(ptrs=[1 << 20], lens=[1 << 20], item_lens=[4096]),
        rooms=rooms,
        offers=offers,
        device=0,
        messenger=SlotMessenger("decode", lambda ep, m: None),
        apply_status=lambda m: None,
        note_abort_ack=lambda *a: None,
        reject=lambda reason, detail="", peer="": rejected.append((reason, detail)),
        fail_room=lambda room, reason: failed.append((room, reason)),
    )
    st.scatters = _Scatters()
    st._bases_dev = np.asarray([1 << 20], dtype=np.uint64)
    st.rooms.cache_units(7, (0, -1, 1), None)
    return st, rooms, rejected, failed


def _piece(slot: int, seq: int) -> PieceReady:
    return PieceReady(
        room=7,
        prefill_rank=0,
        ip=P5[0],
        port=P5[1],
        slot=slot,
        r0=0,
        r1=1,
        j0=0,
        j1=1,
        page_start=0,
        page_count=1,
        unit_len=64,
        units_per_item=1,
        dst_stride=64,
        dst_offset=0,
        seq=seq,
    )


def test_a_second_piece_for_a_slot_whose_piece_is_not_scattered_is_refused():
    st, rooms, rejected, failed = _staging()
    rooms.open(7, {P5})
    slots = st.grant(7, np.arange(4), P5, 1)
    st._units_of = lambda m, pages: np.arange(4)  # no copier: the units are not the point
    st._launch(_piece(slots[0], 1))
    assert len(st.scatters.launched) == 1 and not rejected
    st._launch(_piece(slots[0], 2))  # the prefill reused the slot before its PieceDone
    assert len(st.scatters.launched) == 1
    assert rejected and rejected[0][0] == "bad_piece" and "unscattered" in rejected[0][1]
    assert failed and failed[0][0] == 7
    rooms.scattered(slots[0])  # scattered and credited: the slot takes a piece again
    st._launch(_piece(slots[0], 3))
    assert len(st.scatters.launched) == 2


def test_a_piece_outside_the_room_is_refused_before_it_occupies_a_slot():
    st, rooms, rejected, failed = _staging()
    rooms.open(7, {P5})
    slots = st.grant(7, np.arange(4), P5, 1)
    bad = _piece(slots[0], 1)
    st._launch(
        PieceReady(**{**{f: getattr(bad, f) for f in bad.__struct_fields__}, "page_count": 9})
    )
    assert rejected and "beyond the room" in rejected[0][1] and not st.scatters.launched
    assert rooms.slots.slots[slots[0]].state.value == "held"  # not left busy by a refusal
    st._launch(_piece(5, 1))  # never granted
    assert "not granted" in rejected[1][1]


def test_a_by_token_piece_numbers_the_rooms_token_rows_with_the_decodes_page_size():
    """Across page sizes a piece names token rows of the room's pages: the decode expands
    its own pages (16 tokens each here) and takes the piece's run of rows from them."""
    st, rooms, rejected, failed = _staging()
    st.page_size = 16
    rooms.open(7, {P5})
    pages = np.array([9, 2, 5])
    base = _piece(0, 1)
    m = PieceReady(
        **{
            **{f: getattr(base, f) for f in base.__struct_fields__},
            "page_start": 12,  # token rows 12..35: the end of page 9, all of 2, 4 rows of 5
            "page_count": 24,
            "j1": 16,  # the piece's first 16 of them (one 1 KiB slot)
            "by_token": True,
        }
    )
    rows = st._items(m, pages)
    want = [9 * 16 + t for t in range(12, 16)] + [2 * 16 + t for t in range(16)]
    assert rows.tolist() == want + [5 * 16 + t for t in range(4)]
    assert st.validate(m, pages) == ""
    # the same numbers as a page piece would name: units of the page view are not rows
    page_piece = PieceReady(
        **{**{f: getattr(m, f) for f in m.__struct_fields__}, "by_token": False}
    )
    assert "beyond the room's 3" in st.validate(page_piece, pages)
    past = PieceReady(**{**{f: getattr(m, f) for f in m.__struct_fields__}, "page_start": 40})
    assert "token rows [40, +24) beyond the room's 48" in st.validate(past, pages)
    assert not rejected and not failed


def test_a_by_token_piece_past_the_registered_region_is_refused():
    st, rooms, rejected, failed = _staging()
    st.page_size = 16
    rooms.open(7, {P5})
    base = _piece(0, 1)
    # the region holds 1 MiB = 16384 rows of 64 bytes: page 1024 is past it
    m = PieceReady(
        **{**{f: getattr(base, f) for f in base.__struct_fields__}, "page_count": 16, "j1": 16}
    )
    m = PieceReady(**{**{f: getattr(m, f) for f in m.__struct_fields__}, "by_token": True})
    assert st.validate(m, np.array([1023])) == ""
    assert "beyond the registered KV region" in st.validate(m, np.array([1024]))


def test_a_pipeline_stage_numbers_regions_within_its_window():
    """A prefill PP stage into a PP 1 decode numbers its pieces' regions within the window
    its registration reply named: bounds checked against the window, not our regions; a
    window naming a region we do not have refuses that rank's pieces."""
    st, rooms, rejected, failed = _staging()
    st.bases = np.asarray([1 << 20, 2 << 20, 3 << 20], dtype=np.uint64)
    rooms.open(7, {P5})
    base = _piece(0, 1)
    two = PieceReady(**{**{f: getattr(base, f) for f in base.__struct_fields__}, "r1": 2})
    pages = np.array([3])
    assert st.validate(two, pages) == ""
    st.set_window(P5, (2,))  # one layer of ours: region 2
    assert "regions [0, 2) outside [0, 1)" in st.validate(two, pages)
    assert st.validate(base, pages) == ""
    st.set_window(P5, (1, 3))
    assert "names region 3 of our 3" in st.validate(base, pages)
    st.set_window(P5, ())  # one to one again (a re-registration at equal PP sizes)
    assert st.validate(two, pages) == ""
    assert not rejected and not failed
