"""Translate SGLang's ``KVArgs`` into engine memory, wire regions and the compat record."""

from __future__ import annotations

from typing import Any

from sgl_nixl_plugin.engine.engine import Memory
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.wire.messages import PROTOCOL_VERSION, Compat, Region


def kv_mem_kind(kv_args: Any, device: str, override: str = "") -> str:
    """DRAM or VRAM for the KV pool: the override, SGLang's list, else by device."""
    if override:
        return override
    kinds = set(getattr(kv_args, "kv_data_mem_kinds", None) or [])
    if len(kinds) > 1:
        raise ValueError(
            f"KV buffers of mixed memory kinds {sorted(kinds)} are not supported by "
            "sgl-nixl-plugin yet (e.g. HiSparse host pools); use one kind"
        )
    if kinds:
        return kinds.pop()
    return "DRAM" if device == "cpu" else "VRAM"


def memory_from_kv_args(kv_args: Any, kind: str) -> Memory:
    dev = int(getattr(kv_args, "gpu_id", 0) or 0) if kind == "VRAM" else 0
    kv = RegionSet.of(
        list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens),
        kind, dev,
    )
    aux = RegionSet.of(
        list(kv_args.aux_data_ptrs), list(kv_args.aux_data_lens), list(kv_args.aux_item_lens),
        "DRAM", 0,
    )
    state = tuple(
        RegionSet.of(list(p), list(n), list(i), kind, dev)
        for p, n, i in zip(
            getattr(kv_args, "state_data_ptrs", None) or [],
            getattr(kv_args, "state_data_lens", None) or [],
            getattr(kv_args, "state_item_lens", None) or [], strict=False,
        )
    )
    return Memory(kv, aux, state)


def to_regions(regions: RegionSet) -> list[Region]:
    return [
        Region(p, n, i, d, regions.mem_kind)
        for p, n, i, d in zip(regions.ptrs, regions.lens, regions.item_lens, regions.devices, strict=False)
    ]


def from_regions(regions: list[Region], default_kind: str = "VRAM") -> RegionSet:
    kinds = {r.mem_kind for r in regions} or {default_kind}
    if len(kinds) > 1:
        raise ValueError(f"peer registered regions of mixed kinds {sorted(kinds)}")
    return RegionSet(
        tuple(r.ptr for r in regions),
        tuple(r.length for r in regions),
        tuple(r.item_len for r in regions),
        tuple(r.device for r in regions),
        kinds.pop(),
    )


def remote_memory(kv: list[Region], aux: list[Region], state: list[list[Region]]) -> Memory:
    return Memory(from_regions(kv), from_regions(aux, "DRAM"), tuple(from_regions(s) for s in state))


def head_bytes(kv_args: Any, is_mla: bool) -> int:
    """Bytes of one KV head of one token (0 for MLA, whose KV is not split by heads)."""
    heads = int(getattr(kv_args, "kv_head_num", 0) or 0)
    if is_mla or heads <= 0 or not kv_args.kv_item_lens:
        return 0
    return int(kv_args.kv_item_lens[0]) // (int(kv_args.page_size) * heads)


def compat_of(kv_args: Any, is_mla: bool, tp_size: int) -> Compat:
    heads = int(getattr(kv_args, "kv_head_num", 0) or 0)
    total = int(getattr(kv_args, "total_kv_head_num", 0) or heads * tp_size)
    return Compat(
        protocol_version=PROTOCOL_VERSION,
        kv_dtype=str(kv_args.kv_cache_dtype_str),
        page_size=int(kv_args.page_size),
        num_layers=len(kv_args.kv_data_ptrs),
        total_kv_heads=0 if is_mla else total,
        head_bytes=head_bytes(kv_args, is_mla),
        is_mla=bool(is_mla),
    )


def kv_geometry(
    *,
    is_mla: bool,
    page_size: int,
    head_bytes_: int,
    src_heads: int,
    dst_heads: int,
    src_tp_rank: int,
    dst_tp_rank: int,
) -> Geometry:
    """Whole pages when both ranks hold the same heads (or MLA), else head slices."""
    if is_mla or src_heads == dst_heads or src_heads <= 0 or dst_heads <= 0:
        return Geometry.whole_items()
    return Geometry.head_slice(
        tokens_per_item=page_size,
        head_bytes=head_bytes_,
        src_heads=src_heads,
        dst_heads=dst_heads,
        src_tp_rank=src_tp_rank,
        dst_tp_rank=dst_tp_rank,
    )
