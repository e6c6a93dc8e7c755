"""What each side derives from SGLang's ``KVArgs`` at construction: compat record, head split,
memory kind. ``KVArgs`` here is SGLang's own class with only the fields SGLang 0.5.23 sets on
that side before it constructs the manager (a decode's has no head counts; it labels its pool
VRAM even on a CPU host), so a read of a field SGLang leaves unset raises here as it would
in a server. tests/component/test_kvargs_contract.py checks those field sets against SGLang's code."""

from __future__ import annotations

import numpy as np
import pytest
from sglang.srt.disaggregation.base.conn import KVArgs

from sgl_nixl_plugin.sides.memory import (
    HeadLayout,
    compat_of,
    decode_heads,
    kv_mem_kind,
    prefill_head_layout,
)
from sgl_nixl_plugin.wire.compat import describe_mismatch

pytestmark = pytest.mark.timeout(60)

PAGE, HEAD_DIM, DTYPE_BYTES, LAYERS, TOTAL_HEADS = 16, 64, 2, 2, 4


def _kv_args(role: str, heads: int, buffers: list[np.ndarray]) -> KVArgs:
    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs = [b.ctypes.data for b in buffers]
    a.kv_data_lens = [b.nbytes for b in buffers]
    a.kv_item_lens = [PAGE * heads * HEAD_DIM * DTYPE_BYTES] * len(buffers)
    a.kv_cache_dtype_str = "bfloat16"
    a.page_size = PAGE
    if role == "prefill":
        a.kv_head_num = heads
        a.total_kv_head_num = TOTAL_HEADS
    else:
        a.kv_data_mem_kinds = ["VRAM"] * len(buffers)  # SGLang's label for NIXL, any host
    return a


def _buffers(heads: int) -> list[np.ndarray]:
    return [
        np.zeros(8 * PAGE * heads * HEAD_DIM * DTYPE_BYTES, np.uint8) for _ in range(2 * LAYERS)
    ]


@pytest.mark.parametrize("decode_tp", [1, 2, 4])
def test_a_decode_without_head_counts_is_compatible(decode_tp: int) -> None:
    """0.4.0 read the decode's head counts at construction, found none and refused every
    decode ("total_kv_heads: prefill=4 decode=0")."""
    pb, db = _buffers(TOTAL_HEADS), _buffers(TOTAL_HEADS // decode_tp)
    prefill = _kv_args("prefill", TOTAL_HEADS, pb)
    decode = _kv_args("decode", TOTAL_HEADS // decode_tp, db)
    assert not hasattr(decode, "kv_head_num")
    assert describe_mismatch(compat_of(prefill, False), compat_of(decode, False)) == ""
    layout = prefill_head_layout(prefill, False)
    assert layout == HeadLayout(
        heads=TOTAL_HEADS, total=TOTAL_HEADS, head_bytes=HEAD_DIM * DTYPE_BYTES
    )
    heads = decode_heads(layout, PAGE, prefill.kv_item_lens[0], decode.kv_item_lens[0], decode_tp)
    assert heads == TOTAL_HEADS // decode_tp


def test_replicated_heads_when_decode_tp_exceeds_them() -> None:
    """More decode ranks than KV heads: each rank holds one head (SGLang replicates)."""
    layout = HeadLayout(heads=2, total=2, head_bytes=128)
    assert decode_heads(layout, PAGE, PAGE * 2 * 128, PAGE * 1 * 128, 4) == 1


@pytest.mark.parametrize(
    ("dst_item", "tp", "match"),
    [
        (PAGE * 4 * 96, 1, r"should be 4096 \(16 tokens x 4 of 4 heads x 64 bytes"),
        (PAGE * 2 * 64, 1, "should be 4096"),
        (PAGE * 4 * 64, 2, "at TP 2 should be 2048"),
    ],
)
def test_a_decode_of_another_model_is_refused_with_both_sides_named(
    dst_item: int, tp: int, match: str
) -> None:
    layout = HeadLayout(heads=4, total=4, head_bytes=64)
    with pytest.raises(ValueError, match=match):
        decode_heads(layout, PAGE, PAGE * 4 * 64, dst_item, tp)


def test_mla_needs_equal_items_and_no_heads() -> None:
    a = _kv_args("prefill", 1, _buffers(1))
    assert prefill_head_layout(a, True) is None
    assert decode_heads(None, PAGE, 4096, 4096, 2) == 0
    with pytest.raises(ValueError, match="KV item lengths differ"):
        decode_heads(None, PAGE, 4096, 2048, 2)


def test_memory_kind_comes_from_the_pointer_on_both_sides() -> None:
    """On a host without CUDA both sides register their pools as DRAM, whatever SGLang's
    label says (0.4.0 believed the decode's "VRAM" and UCX refused the registration)."""
    bufs = _buffers(2)
    decode = _kv_args("decode", 2, bufs)
    prefill = _kv_args("prefill", 2, bufs)
    assert kv_mem_kind(decode, "cpu") == "DRAM"
    assert kv_mem_kind(decode, "cuda") == "DRAM"
    assert kv_mem_kind(prefill, "cuda") == "DRAM"
    assert kv_mem_kind(decode, "cpu", override="VRAM") == "VRAM"  # an explicit setting wins


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
def test_memory_kind_of_device_and_pinned_pointers() -> None:
    """On a GPU host the driver tells: device tensors are VRAM on both sides (a prefill has
    no label at all), pinned and plain host memory DRAM even under a VRAM label."""
    import torch

    from sgl_nixl_plugin.engine.mem_kind import pointer_kind

    torch.cuda.set_device(0)
    dev = [torch.zeros(4096, dtype=torch.uint8, device="cuda") for _ in range(2 * LAYERS)]
    pinned = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    assert pointer_kind(dev[0].data_ptr()) == "VRAM"
    assert pointer_kind(pinned.data_ptr()) == "DRAM"
    assert pointer_kind(np.zeros(4096, np.uint8).ctypes.data) == "DRAM"
    decode = _kv_args("decode", 2, _buffers(2))
    decode.kv_data_ptrs = [t.data_ptr() for t in dev]
    prefill = _kv_args("prefill", 2, _buffers(2))
    prefill.kv_data_ptrs = [t.data_ptr() for t in dev]
    assert kv_mem_kind(decode, "cuda") == "VRAM"
    assert kv_mem_kind(prefill, "cuda") == "VRAM"
    host = _kv_args("decode", 2, _buffers(2))  # numpy pools under SGLang's VRAM label
    assert kv_mem_kind(host, "cuda") == "DRAM"


def test_rows_that_are_not_heads_mean_whole_items_not_a_crash() -> None:
    """A pool whose item is no whole number of the stated heads (latent rows SGLang reports
    with head counts, as for hybrid pools) serves only decodes with the same items."""
    a = _kv_args("prefill", 3, _buffers(2))
    a.kv_item_lens = [PAGE * 2 * HEAD_DIM * DTYPE_BYTES] * len(a.kv_data_ptrs)  # rows of 2
    assert prefill_head_layout(a, False) is None
    assert decode_heads(None, PAGE, a.kv_item_lens[0], a.kv_item_lens[0], 1) == 0


@pytest.mark.parametrize(("decode_page", "decode_tp"), [(64, 1), (64, 2), (4, 4), (1, 2)])
def test_a_decode_of_another_page_size_has_its_heads_from_its_own_pages(
    decode_page: int, decode_tp: int
) -> None:
    """The decode's item holds its own page's tokens: its heads come from that, not from
    the prefill's page size (which would take a page of 64 for 4x the heads)."""
    layout = HeadLayout(heads=4, total=4, head_bytes=64)
    item = decode_page * (4 // decode_tp) * 64
    assert decode_heads(layout, PAGE, PAGE * 4 * 64, item, decode_tp, decode_page) == 4 // decode_tp
    with pytest.raises(ValueError, match=f"should be {item} \\({decode_page} tokens x"):
        decode_heads(layout, PAGE, PAGE * 4 * 64, 2 * item, decode_tp, decode_page)


def test_mla_across_page_sizes_compares_bytes_per_token() -> None:
    assert decode_heads(None, 16, 16 * 576, 64 * 576, 1, 64) == 0
    with pytest.raises(ValueError, match="prefill 9216 bytes a page of 16 tokens, decode 32768 a"):
        decode_heads(None, 16, 16 * 576, 64 * 512, 1, 64)


def test_states_indexed_by_pages_are_named_and_per_request_ones_are_not() -> None:
    from sglang.srt.disaggregation.base.conn import StateType

    from sgl_nixl_plugin.sides.memory import page_bound_states

    a = KVArgs()
    a.state_types = [StateType.MAMBA, StateType.SWA]
    assert page_bound_states(a) == ("swa",)
    a.state_types = [StateType.MAMBA]
    assert page_bound_states(a) == ()
    assert page_bound_states(KVArgs()) == ()  # a pool SGLang gives no state kinds
