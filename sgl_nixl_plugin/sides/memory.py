"""Translate SGLang's ``KVArgs`` into engine memory, wire regions and the compat record."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sgl_nixl_plugin.engine.engine import Memory
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.mem_kind import pointer_kind
from sgl_nixl_plugin.wire.messages import PROTOCOL_VERSION, Compat, Region

logger = logging.getLogger(__name__)


def kv_mem_kind(kv_args: Any, device: str, override: str = "") -> str:
    """DRAM or VRAM for the KV pool: the override, else what the pointers are, else
    SGLang's label (a decode labels its pool VRAM even on a CPU host), else by device."""
    if override:
        return override
    found = {pointer_kind(int(p)) for p in kv_args.kv_data_ptrs}
    labels = set(getattr(kv_args, "kv_data_mem_kinds", None) or [])
    if None in found:
        found = labels or {"DRAM" if device == "cpu" else "VRAM"}
    if len(found) > 1:
        raise ValueError(
            f"KV buffers of mixed memory kinds {sorted(found)} are not supported by "
            "sgl-nixl-plugin yet (e.g. HiSparse host pools); use one kind"
        )
    kind = found.pop()
    if labels and labels != {kind}:
        logger.info(
            "sgl-nixl: SGLang labels the KV pool %s, its memory is %s: registering it as %s",
            "/".join(sorted(labels)),
            kind,
            kind,
        )
    return kind


def memory_from_kv_args(kv_args: Any, kind: str) -> Memory:
    dev = int(getattr(kv_args, "gpu_id", 0) or 0) if kind == "VRAM" else 0
    kv = RegionSet.of(
        list(kv_args.kv_data_ptrs),
        list(kv_args.kv_data_lens),
        list(kv_args.kv_item_lens),
        kind,
        dev,
    )
    aux = RegionSet.of(
        list(kv_args.aux_data_ptrs),
        list(kv_args.aux_data_lens),
        list(kv_args.aux_item_lens),
        "DRAM",
        0,
    )
    state = _state_sets(kv_args, "state", kind, dev)
    host_kv, host_state = host_memory(kv_args)
    return Memory(kv, aux, state, host_kv, host_state)


def _state_sets(kv_args: Any, prefix: str, kind: str, dev: int) -> tuple[RegionSet, ...]:
    return tuple(
        RegionSet.of(list(p), list(n), list(i), kind, dev)
        for p, n, i in zip(
            getattr(kv_args, f"{prefix}_data_ptrs", None) or [],
            getattr(kv_args, f"{prefix}_data_lens", None) or [],
            getattr(kv_args, f"{prefix}_item_lens", None) or [],
            strict=False,
        )
    )


def host_memory(kv_args: Any) -> tuple[RegionSet | None, tuple[RegionSet, ...]]:
    """A decode's host pool, where SGLang receives KV when its device pool is full
    (``--disaggregation-decode-host-receive-threshold`` below 1): host memory with the
    device pool's items (SGLang checks that before it builds the manager). None when it
    has none."""
    ptrs = list(getattr(kv_args, "host_kv_data_ptrs", None) or [])
    if not ptrs:
        return None, ()
    kv = RegionSet.of(
        ptrs, list(kv_args.host_kv_data_lens), list(kv_args.host_kv_item_lens), "DRAM", 0
    )
    if list(kv.item_lens) != [int(i) for i in kv_args.kv_item_lens]:
        raise ValueError(
            "the decode's host KV pool has other item sizes than its device pool "
            f"({list(kv.item_lens[:2])} vs {list(kv_args.kv_item_lens[:2])}): "
            "sgl-nixl-plugin writes host pages with the device pool's layout"
        )
    return kv, _state_sets(kv_args, "host_state", "DRAM", 0)


def to_regions(regions: RegionSet) -> list[Region]:
    return [
        Region(p, n, i, d, regions.mem_kind)
        for p, n, i, d in zip(
            regions.ptrs, regions.lens, regions.item_lens, regions.devices, strict=False
        )
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


def remote_memory(
    kv: list[Region],
    aux: list[Region],
    state: list[list[Region]],
    host_kv: list[Region] | None = None,
    host_state: list[list[Region]] | None = None,
) -> Memory:
    return Memory(
        from_regions(kv),
        from_regions(aux, "DRAM"),
        tuple(from_regions(s) for s in state),
        from_regions(host_kv, "DRAM") if host_kv else None,
        tuple(from_regions(s, "DRAM") for s in host_state or []),
    )


@dataclass(frozen=True)
class HeadLayout:
    """How the prefill's KV rows split into heads (MHA pools only)."""

    heads: int  # KV heads this rank holds
    total: int  # KV heads of the model
    head_bytes: int  # bytes of one head of one token (head_dim x dtype size)


def prefill_head_layout(kv_args: Any, is_mla: bool) -> HeadLayout | None:
    """The prefill's own head split, or None where it has none (MLA) or SGLang gave none.

    SGLang sets ``kv_head_num`` / ``total_kv_head_num`` on a prefill's ``KVArgs`` for MHA
    pools before it constructs the manager; a decode's never has them at that point.
    """
    heads = int(getattr(kv_args, "kv_head_num", 0) or 0)
    if is_mla or heads <= 0 or not kv_args.kv_item_lens:
        return None
    row = int(kv_args.page_size) * heads
    item = int(kv_args.kv_item_lens[0])
    if item % row:  # not rows of heads (e.g. latent rows of a hybrid pool): whole items only
        logger.warning(
            "sgl-nixl: KV item of %d bytes is not %d tokens x %d heads: decodes must hold "
            "the same items (no head slicing)",
            item,
            kv_args.page_size,
            heads,
        )
        return None
    total = int(getattr(kv_args, "total_kv_head_num", 0) or heads)
    return HeadLayout(heads=heads, total=max(total, heads), head_bytes=item // row)


def decode_heads(
    layout: HeadLayout | None,
    page_size: int,
    src_item_len: int,
    dst_item_len: int,
    dst_tp: int,
    dst_page_size: int | None = None,
) -> int:
    """KV heads a decode rank holds, from its item length, page size (the prefill's when
    not given) and TP size (ValueError if the two sides cannot be the same model): SGLang
    gives the decode no head counts."""
    dst_page = dst_page_size or page_size
    if layout is None:
        if dst_item_len * page_size != src_item_len * dst_page:
            sizes = (
                f"prefill {src_item_len} bytes, decode {dst_item_len}"
                if dst_page == page_size
                else f"prefill {src_item_len} bytes a page of {page_size} tokens, decode "
                f"{dst_item_len} a page of {dst_page}"
            )
            raise ValueError(
                f"KV item lengths differ ({sizes}) and the prefill has no head split to slice by"
            )
        return 0
    page_size = dst_page
    row = page_size * layout.head_bytes
    expected = max(1, layout.total // dst_tp)
    if dst_item_len % row or dst_item_len // row != expected:
        raise ValueError(
            f"decode KV item of {dst_item_len} bytes at TP {dst_tp} should be "
            f"{expected * row} ({page_size} tokens x {expected} of {layout.total} heads x "
            f"{layout.head_bytes} bytes, as on the prefill): same model and --kv-cache-dtype?"
        )
    return expected


#: SGLang state kinds addressed per request, not per page: served across page sizes.
PAGE_FREE_STATES = frozenset({"mamba", "dsa_tail", "swa_ring", "request_row", "c128_state"})


def page_bound_states(kv_args: Any) -> tuple[str, ...]:
    """The state kinds of ``kv_args`` whose indices are pages (SWA windows, DSA, block
    scales...): each side builds them at its own page size, so they pair only between
    equal page sizes."""
    kinds = [str(getattr(t, "value", t)) for t in getattr(kv_args, "state_types", None) or []]
    return tuple(k for k in kinds if k not in PAGE_FREE_STATES)


def compat_of(kv_args: Any, is_mla: bool) -> Compat:
    return Compat(
        protocol_version=PROTOCOL_VERSION,
        kv_dtype=str(kv_args.kv_cache_dtype_str),
        page_size=int(kv_args.page_size),
        num_layers=len(kv_args.kv_data_ptrs),
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
