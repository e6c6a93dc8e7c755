"""The Triton copy kernels and their launches: a gather/scatter through a staging buffer and
the one-pass pair copy, each one launch covering every region and unit of a piece, with
16-byte accesses where addresses allow.

Kept apart from ``TritonCopier``, which decides what to launch (uploads, streams, self-tests),
so the device code and its tiling read on their own. Triton is imported on first launch
(``_triton_kernel`` binds the kernels' global ``tl``): this module imports without a GPU."""

from __future__ import annotations

import threading
from typing import Any

from sgl_nixl_plugin.engine.copy_common import _require_triton
from sgl_nixl_plugin.engine.copy_triton_fast_launch import _FastLaunch

# Triton tiles: each program copies about TILE_BYTES, in rows of at most MAX_BLOCK_WORDS
# 4-byte words (a unit larger than that is split over several programs).
TILE_BYTES = 16384
MAX_BLOCK_WORDS = 2048
NUM_WARPS = 4


tl: Any = None  # triton.language, bound by _triton_kernel() (the kernel's global ``tl``)


def _unit_copy_kernel(
    bases_ptr,
    units_ptr,
    n_units,
    stage,
    unit_words,
    stride,
    offset,
    GATHER: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_W: tl.constexpr,
    EVEN_W: tl.constexpr,
):
    # Program (p, slot) copies BLOCK_U units x BLOCK_W words of region ``slot``; ``p``
    # enumerates (unit block, word block) pairs, word blocks fastest. Byte addresses are
    # int64 until the final cast to ``int32*``; ALIGN (a power of two, 4..16) divides every
    # row start, so the compiler may issue ALIGN-byte vector accesses.
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    n_wblocks = tl.cdiv(unit_words, BLOCK_W)
    ub = pid // n_wblocks
    wb = pid % n_wblocks
    j = ub * BLOCK_U + tl.arange(0, BLOCK_U)
    row_ok = j < n_units
    u = tl.load(units_ptr + j, mask=row_ok, other=0).to(tl.int64)
    base = tl.load(bases_ptr + slot).to(tl.int64)
    region_addr = base + offset + u * stride
    stage_addr = stage + (slot.to(tl.int64) * n_units + j) * (unit_words * 4)
    # the hint goes on the pointers: it does not survive the int -> pointer cast
    region_row = tl.multiple_of(region_addr.to(tl.pointer_type(tl.int32)), ALIGN)
    stage_row = tl.multiple_of(stage_addr.to(tl.pointer_type(tl.int32)), ALIGN)
    w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    rp = region_row[:, None] + w[None, :]
    sp = stage_row[:, None] + w[None, :]
    if EVEN_W:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (w[None, :] < unit_words)
    if GATHER:
        v = tl.load(rp, mask=mask)
        tl.store(sp, v, mask=mask)
    else:
        v = tl.load(sp, mask=mask)
        tl.store(rp, v, mask=mask)


def _pair_copy_kernel(
    src_bases_ptr,
    dst_bases_ptr,
    src_units_ptr,
    dst_units_ptr,
    n_units,
    unit_words,
    src_stride,
    src_offset,
    dst_stride,
    dst_offset,
    ALIGN: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_W: tl.constexpr,
    EVEN_W: tl.constexpr,
):
    # The one-pass copy (no staging): unit src_units[j] of source region ``slot`` goes to
    # unit dst_units[j] of destination region ``slot``. Tiling as in _unit_copy_kernel.
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    n_wblocks = tl.cdiv(unit_words, BLOCK_W)
    ub = pid // n_wblocks
    wb = pid % n_wblocks
    j = ub * BLOCK_U + tl.arange(0, BLOCK_U)
    row_ok = j < n_units
    su = tl.load(src_units_ptr + j, mask=row_ok, other=0).to(tl.int64)
    du = tl.load(dst_units_ptr + j, mask=row_ok, other=0).to(tl.int64)
    src_base = tl.load(src_bases_ptr + slot).to(tl.int64)
    dst_base = tl.load(dst_bases_ptr + slot).to(tl.int64)
    src_addr = src_base + src_offset + su * src_stride
    dst_addr = dst_base + dst_offset + du * dst_stride
    src_row = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), ALIGN)
    dst_row = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), ALIGN)
    w = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    if EVEN_W:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (w[None, :] < unit_words)
    v = tl.load(src_row[:, None] + w[None, :], mask=mask)
    tl.store(dst_row[:, None] + w[None, :], v, mask=mask)


_KERNEL: Any = None
_PAIR_KERNEL: Any = None
_KERNEL_LOCK = threading.Lock()
_LAUNCH_LOCK = threading.Lock()


def _triton_kernel() -> Any:
    """The jitted kernel (imports triton on first use)."""
    global _KERNEL, tl
    with _KERNEL_LOCK:
        if _KERNEL is None:
            triton = _require_triton()
            import triton.language as language

            tl = language
            # n_units and stage change per call: no recompile for n == 1 or for alignment.
            _KERNEL = triton.jit(do_not_specialize=["n_units", "stage"])(_unit_copy_kernel)
        return _KERNEL


def _triton_pair_kernel() -> Any:
    """The jitted one-pass kernel (compiled on first launch, like ``_triton_kernel``)."""
    global _PAIR_KERNEL
    _triton_kernel()  # binds ``tl``
    with _KERNEL_LOCK:
        if _PAIR_KERNEL is None:
            import triton

            _PAIR_KERNEL = triton.jit(do_not_specialize=["n_units"])(_pair_copy_kernel)
        return _PAIR_KERNEL


def tile_shape(unit_words: int, tile_bytes: int = TILE_BYTES) -> tuple[int, int, bool]:
    """(BLOCK_U, BLOCK_W, EVEN_W) for units of ``unit_words`` 4-byte words."""
    p2 = unit_words & -unit_words
    if p2 >= 32:
        block_w, even = min(p2, MAX_BLOCK_WORDS), True
    else:
        block_w = min(1 << (unit_words - 1).bit_length(), MAX_BLOCK_WORDS)
        even = unit_words % block_w == 0
    block_u = max(1, (tile_bytes // 4) // block_w)
    return block_u, block_w, even


def launch_unit_copy(
    gather: bool,
    bases_t: Any,
    units_t: Any,
    n: int,
    unit_len: int,
    stride: int,
    offset: int,
    stage: int,
    align: int,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
    fast: _FastLaunch | None = None,
) -> None:
    """Launch the kernel on the current stream. ``bases_t`` (int64) and ``units_t`` (int64
    or int32) are tensors the kernel can read; ``align`` comes from ``_alignment``. With
    ``fast``, a specialization launched before skips Triton's Python dispatch."""
    if align < 4:
        raise ValueError(
            "the Triton copier needs 4-byte alignment of unit_len, stride, offset, every base "
            f"and the staging address (largest common power of two here: {align})"
        )
    regions = int(bases_t.shape[0])
    if regions > 65535:
        raise ValueError(f"{regions} regions in one piece: at most 65535")
    unit_words = unit_len // 4
    block_u, block_w, even = tile_shape(unit_words, tile_bytes)
    programs = -(-n // block_u) * -(-unit_words // block_w)
    if programs >= 1 << 31:
        raise ValueError("request too large for one launch")
    args = (
        bases_t,
        units_t,
        n,
        stage,
        unit_words,
        stride,
        offset,
        bool(gather),
        align,
        block_u,
        block_w,
        even,
    )
    if fast is not None and fast.launch("unit", (programs, regions), num_warps, args):
        return
    kernel = _triton_kernel()
    with _LAUNCH_LOCK:  # one compile per shape, even when several threads start at once
        compiled = kernel[(programs, regions)](
            bases_t,
            units_t,
            n,
            stage,
            unit_words,
            stride,
            offset,
            GATHER=bool(gather),
            ALIGN=align,
            BLOCK_U=block_u,
            BLOCK_W=block_w,
            EVEN_W=even,
            num_warps=num_warps,
        )
    if fast is not None:
        fast.remember("unit", num_warps, args, compiled)


def launch_pair_copy(
    src_bases_t: Any,
    dst_bases_t: Any,
    src_units_t: Any,
    dst_units_t: Any,
    n: int,
    unit_len: int,
    src_stride: int,
    src_offset: int,
    dst_stride: int,
    dst_offset: int,
    align: int,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
    fast: _FastLaunch | None = None,
) -> None:
    """Launch the one-pass kernel on the current stream: every region pair, ``n`` units.
    Tensors as for ``launch_unit_copy``; ``align`` divides every address, length, stride
    and offset (``_align_of``). With ``fast``, as there."""
    if align < 4:
        raise ValueError(
            "the one-pass copy needs 4-byte alignment of unit_len, both strides and offsets "
            f"and every base (largest common power of two here: {align})"
        )
    regions = int(src_bases_t.shape[0])
    if int(dst_bases_t.shape[0]) != regions:
        raise ValueError(f"{regions} source regions but {int(dst_bases_t.shape[0])} destinations")
    if regions > 65535:
        raise ValueError(f"{regions} regions in one launch: at most 65535")
    unit_words = unit_len // 4
    block_u, block_w, even = tile_shape(unit_words, tile_bytes)
    programs = -(-n // block_u) * -(-unit_words // block_w)
    if programs >= 1 << 31:
        raise ValueError("request too large for one launch")
    args = (
        src_bases_t,
        dst_bases_t,
        src_units_t,
        dst_units_t,
        n,
        unit_words,
        src_stride,
        src_offset,
        dst_stride,
        dst_offset,
        align,
        block_u,
        block_w,
        even,
    )
    if fast is not None and fast.launch("pair", (programs, regions), num_warps, args):
        return
    kernel = _triton_pair_kernel()
    with _LAUNCH_LOCK:  # one compile per shape, even when several threads start at once
        compiled = kernel[(programs, regions)](
            *args[:10], ALIGN=align, BLOCK_U=block_u, BLOCK_W=block_w, EVEN_W=even,
            num_warps=num_warps,
        )  # fmt: skip
    if fast is not None:
        fast.remember("pair", num_warps, args, compiled)
