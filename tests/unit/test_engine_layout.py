"""Layouts, strided descriptor rows and per-request index arithmetic (numpy only, no NIXL).

The central property: the descriptor at index ``i`` of a strided list (``Geometry.strided``)
is exactly the unit ``Geometry``'s docstring promises, and ``unit_indices`` picks the
units of the requested items; merging the resulting address lists the way NIXL does
(adjacent on both sides) gives ``expected_descriptors``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_nixl_plugin.engine.descriptors import (
    count_runs,
    expected_descriptors,
    naive_descriptors,
    paired_tokens,
    region_offsets,
    unit_indices,
    validate_items,
)
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet

I32_MAX = np.iinfo(np.int32).max
GAP = 1 << 20  # between synthetic regions: never adjacent


def regions_of(n: int, items: int, item_len: int, base: int = 1 << 32) -> RegionSet:
    stride = items * item_len + GAP
    return RegionSet.of(
        [base + r * stride for r in range(n)],
        [items * item_len] * n,
        [item_len] * n,
        "DRAM",
        device=[r % 2 for r in range(n)],
    )


# -- RegionSet ------------------------------------------------------------------------------


def test_region_set_fields_and_registration_rows() -> None:
    rs = RegionSet.of([4096, 65536], [1000, 2048], [100, 512], "VRAM", device=3)
    assert len(rs) == 2 and rs.devices == (3, 3)
    assert rs.num_items.tolist() == [10, 4]  # partial items do not count
    reg = rs.reg_array()
    assert reg.dtype == np.uint64 and reg.shape == (2, 3) and reg.flags.c_contiguous
    assert reg.tolist() == [[4096, 1000, 3], [65536, 2048, 3]]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(ptrs=(1, 2), lens=(8,), item_lens=(4, 4), devices=(0, 0), mem_kind="DRAM"),
        dict(ptrs=(1,), lens=(8,), item_lens=(4,), devices=(0,), mem_kind="FILE"),
        dict(ptrs=(1,), lens=(8,), item_lens=(0,), devices=(0,), mem_kind="DRAM"),
    ],
    ids=["unequal-lengths", "unknown-kind", "zero-item"],
)
def test_region_set_rejects_bad_fields(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RegionSet(**kwargs)


# -- Geometry ---------------------------------------------------------------------------------


def test_whole_items_rows_one_per_region() -> None:
    rs = RegionSet.of(
        [1000, 50000, 90000], [4096, 8192, 4000], [1024, 2048, 1000], "DRAM", device=[0, 1, 2]
    )
    geo = Geometry.whole_items()
    assert geo.is_whole_items and geo.merges_across_items
    for side in ("src", "dst"):
        rows = geo.strided(rs, side)
        assert rows.dtype == np.uint64 and rows.shape == (3, 5)
        # (address, unit length, device, stride, count): dense items
        assert rows.tolist() == [
            [1000, 1024, 0, 1024, 4],
            [50000, 2048, 1, 2048, 4],
            [90000, 1000, 2, 1000, 4],
        ]
    assert geo.unit_counts(rs).tolist() == [4, 4, 4]


def test_head_slice_more_source_heads_sends_the_destination_ranks_share() -> None:
    # prefill holds 8 heads, decode ranks hold 2 each: decode rank 5 is slot 5 % 4 = 1
    geo = Geometry.head_slice(
        tokens_per_item=16, head_bytes=128, src_heads=8, dst_heads=2, src_tp_rank=0, dst_tp_rank=5
    )
    assert (geo.unit_len, geo.units_per_item, geo.src_stride, geo.dst_stride) == (
        256,
        16,
        1024,
        256,
    )
    assert (geo.src_offset, geo.dst_offset) == (256, 0)
    assert not geo.is_whole_items and not geo.merges_across_items
    src = RegionSet.of([1 << 20, 1 << 24], [3 * 16 * 1024] * 2, [16 * 1024] * 2, "VRAM", device=1)
    dst = RegionSet.of([1 << 28], [5 * 16 * 256], [16 * 256], "VRAM", device=2)
    assert geo.strided(src, "src").tolist() == [
        [(1 << 20) + 256, 256, 1, 1024, 48],
        [(1 << 24) + 256, 256, 1, 1024, 48],
    ]
    assert geo.strided(dst, "dst").tolist() == [[1 << 28, 256, 2, 256, 80]]
    assert geo.unit_counts(src).tolist() == [48, 48]


def test_head_slice_fewer_source_heads_fills_its_slot_of_the_row() -> None:
    # prefill ranks hold 1 head, decode holds 4: prefill rank 6 writes slot 6 % 4 = 2
    geo = Geometry.head_slice(
        tokens_per_item=4, head_bytes=64, src_heads=1, dst_heads=4, src_tp_rank=6, dst_tp_rank=0
    )
    assert (geo.unit_len, geo.units_per_item, geo.src_stride, geo.dst_stride) == (64, 4, 64, 256)
    assert (geo.src_offset, geo.dst_offset) == (0, 128)
    assert not geo.merges_across_items  # adjacent on the source side only
    src = RegionSet.of([4096], [10 * 4 * 64], [4 * 64], "DRAM")
    dst = RegionSet.of([1 << 16], [7 * 4 * 256], [4 * 256], "DRAM")
    assert geo.strided(src, "src").tolist() == [[4096, 64, 0, 64, 40]]
    assert geo.strided(dst, "dst").tolist() == [[(1 << 16) + 128, 64, 0, 256, 28]]


def test_head_slice_equal_heads_is_whole_items_and_uneven_splits_raise() -> None:
    kw = dict(tokens_per_item=8, head_bytes=64, src_tp_rank=0, dst_tp_rank=0)
    assert Geometry.head_slice(src_heads=4, dst_heads=4, **kw) == Geometry.whole_items()
    with pytest.raises(ValueError, match="do not split"):
        Geometry.head_slice(src_heads=6, dst_heads=4, **kw)
    with pytest.raises(ValueError, match="do not split"):
        Geometry.head_slice(src_heads=4, dst_heads=6, **kw)


# -- index arithmetic -----------------------------------------------------------------------------


def test_region_offsets() -> None:
    assert region_offsets(np.array([3, 5, 2])).tolist() == [0, 3, 8]
    assert region_offsets(np.array([7])).tolist() == [0]
    assert region_offsets(np.array([], dtype=np.int64)).tolist() == []


def test_unit_indices_examples() -> None:
    offsets = np.array([0, 10, 20])
    idx = unit_indices(np.array([2, 0, 7]), offsets, 1)
    assert idx.dtype == np.int32
    assert idx.tolist() == [2, 0, 7, 12, 10, 17, 22, 20, 27]  # region-major
    assert unit_indices(np.array([1]), np.array([0, 100]), 3).tolist() == [3, 4, 5, 103, 104, 105]
    assert unit_indices(np.array([4, 1]), offsets, 1, regions=np.array([2, 0])).tolist() == [
        24,
        21,
        4,
        1,
    ]
    assert unit_indices(np.array([], dtype=np.int64), offsets, 4).size == 0


@pytest.mark.parametrize(
    ("items", "offsets"),
    [
        ([0, I32_MAX - 5], [0, 10]),  # sorted: the last index overflows
        ([I32_MAX - 5, 0], [0, 10]),  # unsorted pages: the largest index is not the last one
        ([3], [I32_MAX - 1, 0]),  # regions whose largest offset comes first
    ],
    ids=["sorted", "unsorted-items", "unsorted-offsets"],
)
def test_unit_indices_refuses_int32_overflow(items: list[int], offsets: list[int]) -> None:
    with pytest.raises(OverflowError, match="int32"):
        unit_indices(np.array(items), np.array(offsets, dtype=np.int64), 1)


def test_unit_indices_overflow_through_units_per_item() -> None:
    items = np.array([(I32_MAX // 16) + 1])
    with pytest.raises(OverflowError):
        unit_indices(items, np.array([0]), 16)
    assert unit_indices(np.array([0, I32_MAX]), np.array([0]), 1).tolist() == [0, I32_MAX]


def test_count_runs_examples() -> None:
    assert count_runs(np.array([]), np.array([])) == 0
    assert count_runs(np.array([4]), np.array([9])) == 1
    assert count_runs(np.arange(10, 20), np.arange(0, 10)) == 1
    assert count_runs(np.arange(0, 20, 2), np.arange(0, 20, 2)) == 10
    assert count_runs(np.array([1, 2, 3, 7, 8]), np.array([5, 6, 9, 10, 11])) == 3
    assert count_runs(np.array([3, 2, 1]), np.array([1, 2, 3])) == 3  # descending: no run


def test_expected_and_naive_descriptors() -> None:
    src, dst = np.array([0, 1, 2, 9]), np.array([5, 6, 7, 1])
    whole = Geometry.whole_items()
    assert expected_descriptors(src, dst, 64, whole) == 128
    assert naive_descriptors(4, 64, whole) == 256
    geo = Geometry.head_slice(
        tokens_per_item=16, head_bytes=64, src_heads=4, dst_heads=2, src_tp_rank=0, dst_tp_rank=0
    )
    assert expected_descriptors(src, dst, 2, geo) == naive_descriptors(4, 2, geo) == 2 * 4 * 16


def test_validate_items() -> None:
    assert validate_items(np.array([], dtype=np.int64), 0, "page") is None
    assert validate_items(np.array([0, 9, 3]), 10, "page") is None
    msg = validate_items(np.array([0, 10]), 10, "destination page")
    assert msg is not None and "destination page" in msg and "[0, 10]" in msg and "[0, 10)" in msg
    assert validate_items(np.array([-1, 2]), 10, "aux row") is not None


# -- properties ---------------------------------------------------------------------------------


def brute_runs(src: list[int], dst: list[int]) -> int:
    runs = 0
    for i in range(len(src)):
        if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
    return runs


pages = st.lists(st.integers(0, 40), max_size=40)


@given(st.data())
def test_count_runs_matches_brute_force(data: st.DataObject) -> None:
    src = data.draw(pages)
    dst = data.draw(st.lists(st.integers(0, 40), min_size=len(src), max_size=len(src)))
    assert count_runs(np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)) == brute_runs(
        src, dst
    )


@given(
    items=pages,
    counts=st.lists(st.integers(41, 60), min_size=1, max_size=5),
    upp=st.integers(1, 5),
)
def test_unit_indices_matches_brute_force(items: list[int], counts: list[int], upp: int) -> None:
    offsets = region_offsets(np.array(counts) * upp)
    want = [
        int(offsets[r]) + i * upp + u for r in range(len(counts)) for i in items for u in range(upp)
    ]
    got = unit_indices(np.array(items, dtype=np.int64), offsets, upp)
    assert got.dtype == np.int32 and got.tolist() == want


def expand(rows: np.ndarray) -> np.ndarray:
    """Every descriptor of a strided list: (address, length), in list order."""
    out = []
    for addr, length, _dev, stride, count in rows.tolist():
        out.extend((addr + k * stride, length) for k in range(count))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def nixl_merge_count(src: np.ndarray, dst: np.ndarray) -> int:
    """Descriptors after merging neighbours adjacent on both sides, as NIXL does."""
    n = 0
    for i in range(len(src)):
        if not (
            i
            and src[i, 0] == src[i - 1, 0] + src[i - 1, 1]
            and dst[i, 0] == dst[i - 1, 0] + dst[i - 1, 1]
        ):
            n += 1
    return n


geometries = st.sampled_from(
    [
        ("whole", None),
        ("4to2", dict(src_heads=4, dst_heads=2, src_tp_rank=0, dst_tp_rank=1)),
        ("2to4", dict(src_heads=2, dst_heads=4, src_tp_rank=1, dst_tp_rank=0)),
        ("8to2", dict(src_heads=8, dst_heads=2, src_tp_rank=0, dst_tp_rank=2)),
    ]
)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), geo_case=geometries, regions=st.integers(1, 3), tokens=st.integers(1, 4))
def test_strided_lists_address_the_promised_bytes(
    data: st.DataObject, geo_case: tuple, regions: int, tokens: int
) -> None:
    name, heads = geo_case
    head_bytes = 8
    n_src, n_dst = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
    if heads is None:
        geo = Geometry.whole_items()
        src_item = dst_item = tokens * 4 * head_bytes
    else:
        geo = Geometry.head_slice(tokens_per_item=tokens, head_bytes=head_bytes, **heads)
        src_item = tokens * heads["src_heads"] * head_bytes
        dst_item = tokens * heads["dst_heads"] * head_bytes
    src_rs = regions_of(regions, n_src, src_item, base=1 << 32)
    dst_rs = regions_of(regions, n_dst, dst_item, base=1 << 40)
    n = data.draw(st.integers(0, min(n_src, n_dst)))
    src = np.array(data.draw(st.permutations(range(n_src)))[:n], dtype=np.int64)
    dst = np.array(data.draw(st.permutations(range(n_dst)))[:n], dtype=np.int64)

    upp = geo.units_per_item
    src_rows, dst_rows = geo.strided(src_rs, "src"), geo.strided(dst_rs, "dst")
    src_list, dst_list = expand(src_rows), expand(dst_rows)
    assert len(src_list) == geo.unit_counts(src_rs).sum()
    lidx = unit_indices(src, region_offsets(geo.unit_counts(src_rs)), upp)
    ridx = unit_indices(dst, region_offsets(geo.unit_counts(dst_rs)), upp)
    got_src, got_dst = src_list[lidx], dst_list[ridx]

    # what Geometry's docstring promises, unit by unit, region-major
    want_src, want_dst = [], []
    for r in range(regions):
        for p, q in zip(src.tolist(), dst.tolist(), strict=True):
            for u in range(upp):
                if geo.is_whole_items:
                    want_src.append((src_rs.ptrs[r] + p * src_item, src_item))
                    want_dst.append((dst_rs.ptrs[r] + q * dst_item, dst_item))
                    continue
                want_src.append(
                    (src_rs.ptrs[r] + geo.src_offset + (p * upp + u) * geo.src_stride, geo.unit_len)
                )
                want_dst.append(
                    (dst_rs.ptrs[r] + geo.dst_offset + (q * upp + u) * geo.dst_stride, geo.unit_len)
                )
    assert got_src.tolist() == [list(w) for w in want_src]
    assert got_dst.tolist() == [list(w) for w in want_dst]
    # both sides move the same bytes, and the last unit of an item ends inside that item
    assert (got_src[:, 1] == got_dst[:, 1]).all()
    if not geo.is_whole_items:
        assert geo.src_offset + (upp - 1) * geo.src_stride + geo.unit_len <= src_item
        assert geo.dst_offset + (upp - 1) * geo.dst_stride + geo.unit_len <= dst_item
        assert (
            upp * geo.unit_len == tokens * min(heads["src_heads"], heads["dst_heads"]) * head_bytes
        )
    if n:
        assert nixl_merge_count(got_src, got_dst) == expected_descriptors(src, dst, regions, geo)
    assert expected_descriptors(src, dst, regions, geo) <= naive_descriptors(n, regions, geo)


# -- pages of different sizes on the two sides: paired token by token ----------------------


def _reference_pairs(src_pages, ps, dst_pages, pd, first, n):
    """Token by token, the slow way: the chunk's token j sits at token ``first + j`` of
    the request on the destination side."""
    src = [int(src_pages[j // ps]) * ps + j % ps for j in range(n)]
    dst = [int(dst_pages[(first + j) // pd]) * pd + (first + j) % pd for j in range(n)]
    return src, dst


@settings(max_examples=300, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 16, 64]),
    pd=st.sampled_from([1, 4, 16, 64]),
    tokens=st.integers(1, 700),
    split=st.floats(0, 1),
    exact=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_paired_tokens_put_every_token_where_the_destination_pages_hold_it(
    ps, pd, tokens, split, exact, seed
):
    """A request of ``tokens`` tokens in random source and destination pages, sent in two
    chunks cut on a source page boundary: each chunk's pairs are exactly the per-token
    reference, and the two chunks together cover every token of the request once."""
    rng = np.random.default_rng(seed)
    src_all = rng.permutation(4 * (tokens // ps + 2))[: -(-tokens // ps)]
    dst_all = rng.permutation(4 * (tokens // pd + 2))[: -(-tokens // pd)]
    cut = int(split * (len(src_all) - 1))  # pages in the first chunk
    seen_src, seen_dst = [], []
    for lo, hi in ((0, cut), (cut, len(src_all))):
        n = min(hi * ps, tokens) - lo * ps
        src, dst = paired_tokens(src_all[lo:hi], dst_all, lo * ps, n if exact else None, (ps, pd))
        want_n = n if exact else min((hi - lo) * ps, len(dst_all) * pd - lo * ps)
        want = _reference_pairs(src_all[lo:hi], ps, dst_all, pd, lo * ps, want_n)
        assert (src.tolist(), dst.tolist()) == want
        seen_src += src.tolist()[: max(0, min(n, len(src)))]
        seen_dst += dst.tolist()[: max(0, min(n, len(dst)))]
    assert len(seen_dst) == tokens and len(set(seen_dst)) == tokens
    assert seen_dst == [int(dst_all[t // pd]) * pd + t % pd for t in range(tokens)]
    assert seen_src == [int(src_all[t // ps]) * ps + t % ps for t in range(tokens)]


def test_paired_tokens_refuse_a_destination_too_small_naming_both_sides():
    pages = np.arange(1, 5)  # 4 pages of 16: 64 tokens
    with pytest.raises(ValueError, match=r"1 pages of 64 tokens hold 64 tokens from token 0; "):
        paired_tokens(np.arange(1, 6), np.array([3]), 0, 64 + 1, (16, 64))
    with pytest.raises(ValueError, match="hold 16 tokens from token 48; the chunk has 64"):
        paired_tokens(pages, np.array([3]), 48, 64, (16, 64))
    with pytest.raises(ValueError, match="do not fit 4 source pages of 16"):
        paired_tokens(pages, np.array([3, 4]), 0, 65, (16, 64))
    # without a token count, a last source page running past the destination is cut...
    src, dst = paired_tokens(pages, np.array([3]), 0, None, (16, 64))
    assert len(src) == len(dst) == 64
    # ...but the destination must reach into that last page
    with pytest.raises(ValueError, match="hold 32 tokens"):
        paired_tokens(pages, np.array([7]), 32, None, (16, 64))
    empty = paired_tokens(pages[:0], np.array([3]), 64, 0, (16, 64))
    assert [len(a) for a in empty] == [0, 0]


def test_per_token_regions_split_items_into_token_rows():
    regions = regions_of(3, 10, 16 * 48)
    rows = regions.per_token(16)
    assert rows.item_lens == (48,) * 3 and rows.ptrs == regions.ptrs
    assert rows.num_items.tolist() == [160] * 3
    assert regions.per_token(1) is regions
    with pytest.raises(ValueError, match="do not split into 5 tokens"):
        regions.per_token(5)
