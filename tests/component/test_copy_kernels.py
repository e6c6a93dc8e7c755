"""Gather/scatter copy kernels of the staging path (``engine.copy_kernels``).

CPU: the numpy copier against a per-unit reference (whole pages and head slices, pieces of
regions, bytes outside the named units untouched), argument checks, the copier choice, and
the Triton kernels' index arithmetic (gather/scatter and the one-pass pair copy) run by
Triton's interpreter on host memory.
GPU (skipped without CUDA): the Triton and torch copiers byte-exact against the numpy
copier, with bf16 data, page sizes 1 and 16, head slices, 4-byte-only alignment, device
units, and two pieces on two streams at once; the one-pass pair copy likewise.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from sgl_nixl_plugin.engine import copy_kernels as ck
from sgl_nixl_plugin.engine.copy_kernels import NumpyCopier, make_copier
from sgl_nixl_plugin.engine.layout import Geometry

REPO = Path(__file__).resolve().parents[2]
ROW = 256  # bytes of one token's KV row in one region (e.g. 1 head x 128 x bf16)

# whole pages; the sender's and the receiver's side of per-token head slices
GEOMETRIES = ["whole", "head-slice-src", "head-slice-dst"]


def geometry(kind: str, page: int) -> tuple[int, int, int, int]:
    """(unit_len, stride, offset, units_per_page) of one side of a transfer."""
    if kind == "whole":
        return page * ROW, page * ROW, 0, 1
    # 4 heads of 64 bytes on the source, 2 on the destination (decode TP twice prefill TP)
    g = Geometry.head_slice(
        tokens_per_item=page, head_bytes=64, src_heads=4, dst_heads=2, src_tp_rank=0, dst_tp_rank=3
    )
    if kind == "head-slice-src":  # the sender reads the destination rank's heads
        return g.unit_len, g.src_stride, g.src_offset, g.units_per_item
    g = Geometry.head_slice(
        tokens_per_item=page, head_bytes=64, src_heads=1, dst_heads=4, src_tp_rank=2, dst_tp_rank=0
    )
    return g.unit_len, g.dst_stride, g.dst_offset, g.units_per_item  # the receiver's slice


class Regions:
    """``count`` host regions of ``items`` units of ``stride`` bytes (+ offset), random bytes,
    allocated separately (different sizes of padding, so the bases are unrelated)."""

    def __init__(self, count: int, items: int, stride: int, offset: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.bufs = [
            rng.integers(0, 256, offset + items * stride + 97 * (r + 1), dtype=np.uint8)
            for r in range(count)
        ]
        self.bases = np.array([b.ctypes.data for b in self.bufs], dtype=np.uint64)

    def snapshot(self) -> list[np.ndarray]:
        return [b.copy() for b in self.bufs]


def reference_gather(bufs, units, unit_len, stride, offset) -> np.ndarray:
    """Region-major staging bytes, one unit at a time (the slow, obvious way)."""
    out = []
    for b in bufs:
        for k in units:
            start = offset + int(k) * stride
            out.append(b[start : start + unit_len])
    return np.concatenate(out) if out else np.zeros(0, np.uint8)


def reference_scatter(bufs, units, unit_len, stride, offset, stage: np.ndarray) -> None:
    n = len(units)
    for i, b in enumerate(bufs):
        for j, k in enumerate(units):
            start = offset + int(k) * stride
            b[start : start + unit_len] = stage[(i * n + j) * unit_len : (i * n + j + 1) * unit_len]


def request_units(rng: np.random.Generator, pages_in_pool: int, pages: int, upp: int) -> np.ndarray:
    """Unit numbers of ``pages`` random distinct pages (per-token units when upp > 1)."""
    p = rng.choice(pages_in_pool, pages, replace=False).astype(np.int64)
    return (p[:, None] * upp + np.arange(upp)).ravel() if upp > 1 else p


# -- numpy copier ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", GEOMETRIES)
@pytest.mark.parametrize("page", [1, 16, 64])
def test_numpy_round_trip_is_byte_exact(kind: str, page: int) -> None:
    unit_len, stride, offset, upp = geometry(kind, page)
    pool_pages, req_pages = 40, 13
    rng = np.random.default_rng(page)
    regs = Regions(5, pool_pages * upp, stride, offset, seed=page)
    units = request_units(rng, pool_pages, req_pages, upp)
    n = len(units)
    stage = np.zeros(len(regs.bufs) * n * unit_len, dtype=np.uint8)
    c = NumpyCopier()

    c.gather(regs.bases, units, unit_len, stride, offset, stage.ctypes.data)
    assert np.array_equal(stage, reference_gather(regs.bufs, units, unit_len, stride, offset))

    # scatter the staged bytes into a second set of regions and compare whole buffers
    other = Regions(5, pool_pages * upp, stride, offset, seed=page + 1000)
    want = other.snapshot()
    reference_scatter(want, units, unit_len, stride, offset, stage)
    c.scatter(other.bases, units, unit_len, stride, offset, stage.ctypes.data)
    c.synchronize()
    for got, exp in zip(other.bufs, want, strict=True):
        assert np.array_equal(got, exp)
    # ... and back: gathering the scattered regions gives the same staging bytes
    again = np.zeros_like(stage)
    c.gather(other.bases, units, unit_len, stride, offset, again.ctypes.data)
    assert np.array_equal(again, stage)


@pytest.mark.parametrize("kind", GEOMETRIES)
def test_numpy_scatter_leaves_other_bytes_alone(kind: str) -> None:
    unit_len, stride, offset, upp = geometry(kind, 16)
    regs = Regions(3, 20 * upp, stride, offset, seed=7)
    before = regs.snapshot()
    units = request_units(np.random.default_rng(3), 20, 6, upp)
    n = len(units)
    stage = np.full(3 * n * unit_len, 0xA5, dtype=np.uint8)
    NumpyCopier().scatter(regs.bases, units, unit_len, stride, offset, stage.ctypes.data)
    for b, old in zip(regs.bufs, before, strict=True):
        named = np.zeros(len(b), dtype=bool)
        for k in units:
            named[offset + k * stride : offset + k * stride + unit_len] = True
        assert (b[named] == 0xA5).all()
        assert np.array_equal(b[~named], old[~named])  # neighbours, other heads, padding
    # a gather writes exactly the piece's staging bytes and reads without writing
    canary = np.full(3 * n * unit_len + 64, 0x5A, dtype=np.uint8)
    snap = regs.snapshot()
    NumpyCopier().gather(regs.bases, units, unit_len, stride, offset, canary.ctypes.data + 32)
    assert (canary[:32] == 0x5A).all() and (canary[-32:] == 0x5A).all()
    for b, old in zip(regs.bufs, snap, strict=True):
        assert np.array_equal(b, old)


@pytest.mark.parametrize("kind", ["whole", "head-slice-src"])
def test_numpy_pieces_land_in_their_staging_range(kind: str) -> None:
    """Gather regions [2, 5) of 7 at the piece's staging address; scatter it back alone."""
    unit_len, stride, offset, upp = geometry(kind, 16)
    regs = Regions(7, 12 * upp, stride, offset, seed=11)
    units = request_units(np.random.default_rng(5), 12, 5, upp)
    n = len(units)
    piece_bytes = 3 * n * unit_len
    lead = 2 * n * unit_len  # pieces [0, 2) would sit before
    stage = np.full(lead + piece_bytes + 4096, 0xEE, dtype=np.uint8)
    c = NumpyCopier()
    c.gather(regs.bases[2:5], units, unit_len, stride, offset, stage.ctypes.data + lead)
    assert (stage[:lead] == 0xEE).all() and (stage[lead + piece_bytes :] == 0xEE).all()
    want = reference_gather(regs.bufs[2:5], units, unit_len, stride, offset)
    assert np.array_equal(stage[lead : lead + piece_bytes], want)

    # the piece scattered into other regions touches only regions 2..4
    other = Regions(7, 12 * upp, stride, offset, seed=12)
    before = other.snapshot()
    c.scatter(other.bases[2:5], units, unit_len, stride, offset, stage.ctypes.data + lead)
    for r in (0, 1, 5, 6):
        assert np.array_equal(other.bufs[r], before[r])
    for r in (2, 3, 4):
        exp = before[r].copy()
        reference_scatter(
            [exp], units, unit_len, stride, offset, stage[lead + (r - 2) * n * unit_len :]
        )
        assert np.array_equal(other.bufs[r], exp)


def test_numpy_accepts_int32_units_lists_and_int64_bases() -> None:
    regs = Regions(2, 10, 64, 0, seed=1)
    stage = np.zeros(2 * 3 * 64, dtype=np.uint8)
    c = NumpyCopier()
    c.gather(regs.bases.astype(np.int64), [4, 0, 9], 64, 64, 0, stage.ctypes.data)
    assert np.array_equal(stage, reference_gather(regs.bufs, [4, 0, 9], 64, 64, 0))
    c.gather(list(regs.bases), np.array([4, 0, 9], np.int32), 64, 64, 0, stage.ctypes.data)
    assert np.array_equal(stage, reference_gather(regs.bufs, [4, 0, 9], 64, 64, 0))


def test_numpy_empty_requests_do_nothing() -> None:
    regs = Regions(2, 4, 64, 0)
    before = regs.snapshot()
    stage = np.full(128, 3, dtype=np.uint8)
    c = NumpyCopier()
    c.gather(regs.bases, np.zeros(0, np.int64), 64, 64, 0, stage.ctypes.data)
    c.scatter(regs.bases, np.zeros(0, np.int64), 64, 64, 0, stage.ctypes.data)
    c.scatter(regs.bases[:0], np.array([1]), 64, 64, 0, stage.ctypes.data)
    assert (stage == 3).all()
    assert all(np.array_equal(a, b) for a, b in zip(regs.bufs, before, strict=True))


@pytest.mark.parametrize(
    "units, unit_len, stride, offset, match",
    [
        ([1, -1], 64, 64, 0, "negative"),
        ([[1, 2]], 64, 64, 0, "1-D"),
        ([1.5], 64, 64, 0, "integers"),
        ([1], 0, 64, 0, "positive"),
        ([1], 128, 64, 0, "overlap"),
        ([1], 64, 64, -4, "non-negative"),
    ],
)
def test_bad_arguments_are_refused(units, unit_len, stride, offset, match) -> None:
    regs = Regions(1, 4, 128, 0)
    stage = np.zeros(1024, dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        NumpyCopier().gather(regs.bases, units, unit_len, stride, offset, stage.ctypes.data)


def test_alignment_and_tile_shapes() -> None:
    b = np.array([1 << 20, (1 << 20) + 4096], dtype=np.uint64)
    assert ck._alignment(b, 2048, 2048, 0, 1 << 30) == 16
    assert ck._alignment(b, 2048, 2048, 8, 1 << 30) == 8
    assert ck._alignment(b, 12, 16, 0, 1 << 30) == 4
    assert ck._alignment(b + np.uint64(2), 16, 16, 0, 1 << 30) == 2
    assert ck._alignment(b, 16, 16, 0, (1 << 30) + 4) == 4
    for words in [1, 3, 12, 48, 64, 256, 512, 768, 2048, 8192, 1 << 16, 3 << 12]:
        bu, bw, even = ck.tile_shape(words)
        assert bu >= 1 and bw & (bw - 1) == 0 and bu & (bu - 1) == 0  # powers of two
        assert bw <= ck.MAX_BLOCK_WORDS and even == (words % bw == 0)
        assert bu * bw <= max(ck.TILE_BYTES // 4, bw)
    assert ck.tile_shape(512) == (8, 512, True)  # 2 KiB units (page size 1)
    assert ck.tile_shape(8192) == (2, 2048, True)  # 32 KiB units (page size 16)


# -- the choice of copier, and the import boundary -------------------------------------------


def test_make_copier_for_dram_and_bad_choices() -> None:
    assert isinstance(make_copier("DRAM"), NumpyCopier)
    assert make_copier("DRAM", prefer="numpy").mem_kind == "DRAM"
    with pytest.raises(ValueError, match="VRAM"):
        make_copier("DRAM", prefer="triton")
    with pytest.raises(ValueError, match="unknown copier"):
        make_copier("DRAM", prefer="cupy")
    with pytest.raises(ValueError, match="memory kind"):
        make_copier("FILE")
    with pytest.raises(ValueError, match="numpy"):
        make_copier("VRAM", prefer="numpy")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("prefer", ["auto", "triton", "torch"])
def test_make_copier_for_vram_without_cuda_names_what_is_missing(prefer: str) -> None:
    if _cuda_available():
        pytest.skip("a CUDA device is present: the error path is for machines without one")
    with pytest.raises(ck.CopierUnavailable, match="CUDA|torch"):
        make_copier("VRAM", prefer=prefer)


def test_device_bases_slices_are_handed_out_16_byte_aligned() -> None:
    """Triton compiles one variant per pointer alignment: slices of prepared bases (and
    units) reach the kernel 16-byte aligned, copied once per misaligned slice. (CPU
    tensors stand in for device ones: only addresses and contents matter here.)"""
    torch = pytest.importorskip("torch")
    base = torch.arange(64, dtype=torch.int64) * 4096
    assert base.data_ptr() % 16 == 0
    b = ck.DeviceBases(base, 0)
    odd = b[5:12]
    assert odd.tensor.data_ptr() % 16 == 8
    got = odd.aligned()
    assert got.data_ptr() % 16 == 0 and got.tolist() == base[5:12].tolist()
    assert b[5:12].aligned() is got  # kept: one copy per slice, not per piece
    even = b[4:12]
    assert even.aligned() is even.tensor  # aligned already: no copy
    units = torch.arange(100, dtype=torch.int64)
    u = ck._aligned_units(units[7:40])
    assert u.data_ptr() % 16 == 0 and u.tolist() == list(range(7, 40))
    assert ck._aligned_units(units[8:40]).data_ptr() == units[8:40].data_ptr()


def test_importing_copy_kernels_imports_neither_torch_nor_triton() -> None:
    code = (
        "import sys, sgl_nixl_plugin.engine.copy_kernels as c; c.make_copier('DRAM'); "
        "bad = [m for m in ('torch', 'triton') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


# -- the Triton kernel on the CPU, through Triton's interpreter ------------------------------

_INTERPRETER_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from sgl_nixl_plugin.engine import copy_kernels as ck

    rng = np.random.default_rng(0)
    cases = [  # unit_len, stride, offset, units, regions, items, tile_bytes
        (2048, 2048, 0, 37, 3, 64, ck.TILE_BYTES),      # page size 1, 16-byte path
        (32768, 32768, 0, 5, 2, 9, ck.TILE_BYTES),      # page size 16: 4 word blocks per unit
        (256, 1024, 512, 20, 2, 50, ck.TILE_BYTES),     # head slice
        (48, 64, 4, 33, 2, 40, ck.TILE_BYTES),          # 4-byte alignment, masked words
        (12, 16, 4, 9, 3, 12, ck.TILE_BYTES),           # three words per unit
        (2048, 2048, 0, 37, 2, 64, 4096),               # a tile smaller than a unit row set
    ]
    for unit_len, stride, offset, n, R, items, tile in cases:
        regs = [rng.integers(0, 256, offset + items * stride + 64, dtype=np.uint8) for _ in range(R)]
        bases = np.array([r.ctypes.data for r in regs], dtype=np.uint64)
        units = rng.choice(items, n, replace=False).astype(np.int64)
        bases_t = torch.from_numpy(bases.view(np.int64))
        stage = np.zeros(R * n * unit_len + 64, dtype=np.uint8)
        want = np.zeros_like(stage)
        ck.NumpyCopier().gather(bases, units, unit_len, stride, offset, want.ctypes.data)
        align = ck._alignment(bases, unit_len, stride, offset, stage.ctypes.data)
        ck.launch_unit_copy(True, bases_t, torch.from_numpy(units), n, unit_len, stride,
                            offset, stage.ctypes.data, align, tile)
        assert np.array_equal(stage, want), ("gather", unit_len, stride, offset)

        stage[:] = rng.integers(0, 256, stage.size, dtype=np.uint8)
        expect = [r.copy() for r in regs]
        copies = np.array([e.ctypes.data for e in expect], dtype=np.uint64)
        ck.NumpyCopier().scatter(copies, units, unit_len, stride, offset, stage.ctypes.data)
        ck.launch_unit_copy(False, bases_t, torch.from_numpy(units.astype(np.int32)), n,
                            unit_len, stride, offset, stage.ctypes.data, align, tile)
        for got, exp in zip(regs, expect, strict=True):
            assert np.array_equal(got, exp), ("scatter", unit_len, stride, offset)

    # the one-pass kernel: source unit su[j] of region r -> destination unit du[j] of region r
    from sgl_nixl_plugin.engine.copy_triton_kernels import launch_pair_copy

    def pair_reference(srcs, dsts, su, du, unit_len, s_stride, s_off, d_stride, d_off):
        out = [d.copy() for d in dsts]
        cols = np.arange(unit_len)
        for o, s in zip(out, srcs, strict=True):
            o[d_off + du[:, None] * d_stride + cols] = s[s_off + su[:, None] * s_stride + cols]
        return out

    pair_cases = [  # unit_len, src stride, src offset, dst stride, dst offset, n, R, tile
        (2048, 2048, 0, 2048, 0, 37, 3, ck.TILE_BYTES),      # page size 1, whole rows
        (32768, 32768, 0, 32768, 0, 5, 2, ck.TILE_BYTES),    # page size 16: 4 word blocks
        (128, 256, 128, 512, 384, 20, 2, ck.TILE_BYTES),     # head slices, both sides
        (48, 64, 4, 56, 8, 33, 2, ck.TILE_BYTES),            # 4-byte alignment, masked words
        (12, 16, 4, 20, 8, 9, 3, ck.TILE_BYTES),             # three words per unit
        (2048, 2048, 0, 4096, 1024, 37, 2, 4096),            # a tile smaller than a row set
    ]
    for unit_len, s_stride, s_off, d_stride, d_off, n, R, tile in pair_cases:
        s_items, d_items = n + 11, n + 23  # different pool sizes on the two sides
        srcs = [rng.integers(0, 256, s_off + s_items * s_stride + 64, dtype=np.uint8)
                for _ in range(R)]
        dsts = [rng.integers(0, 256, d_off + d_items * d_stride + 64, dtype=np.uint8)
                for _ in range(R)]
        su = rng.choice(s_items, n, replace=False).astype(np.int64)
        du = rng.choice(d_items, n, replace=False).astype(np.int64)
        src_before = [a.copy() for a in srcs]
        geo = (unit_len, s_stride, s_off, d_stride, d_off)
        want = pair_reference(srcs, dsts, su, du, *geo)
        if d_off:  # the check can tell: a kernel ignoring dst_offset would write elsewhere
            wrong = pair_reference(srcs, dsts, su, du, unit_len, s_stride, s_off, d_stride, 0)
            assert not all(np.array_equal(a, b) for a, b in zip(want, wrong, strict=True))
        sb = np.array([a.ctypes.data for a in srcs], dtype=np.uint64)
        db = np.array([a.ctypes.data for a in dsts], dtype=np.uint64)
        align = ck._alignment(np.concatenate([sb, db]), unit_len, s_stride, s_off | d_off,
                              d_stride)
        assert align >= 4, align
        launch_pair_copy(torch.from_numpy(sb.view(np.int64)), torch.from_numpy(db.view(np.int64)),
                         torch.from_numpy(su), torch.from_numpy(du.astype(np.int32)), n,
                         unit_len, s_stride, s_off, d_stride, d_off, align, tile)
        for k, (got, exp) in enumerate(zip(dsts, want, strict=True)):
            assert np.array_equal(got, exp), ("pair", geo, "region", k)
        for got, old in zip(srcs, src_before, strict=True):
            assert np.array_equal(got, old), ("pair wrote its source", geo)
    print("pair ok", len(pair_cases))
    print("interpreter ok", len(cases))
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
    reason="needs triton and torch (Triton's interpreter runs the kernel on host memory)",
)
def test_triton_kernel_index_math_in_the_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "interp_check.py"
    script.write_text(_INTERPRETER_CHECK)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0 and "interpreter ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pair ok" in r.stdout


def test_pair_copy_refuses_misaligned_or_mismatched_arguments() -> None:
    """Checked before Triton is touched: 2-byte alignment, region counts that differ."""
    from sgl_nixl_plugin.engine.copy_triton_kernels import launch_pair_copy

    b2, b3 = np.zeros(2, np.int64), np.zeros(3, np.int64)
    u = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="4-byte alignment.*: 2"):
        launch_pair_copy(b2, b2, u, u, 4, 64, 64, 2, 64, 0, 2)
    with pytest.raises(ValueError, match="2 source regions but 3"):
        launch_pair_copy(b2, b3, u, u, 4, 64, 64, 0, 64, 0, 16)


def test_pair_copy_alignment_error_names_the_values() -> None:
    """``TritonCopier.pair_copy``'s own check, on CPU tensors (no GPU: the copier is built
    without its constructor, and the launch is never reached)."""
    torch = pytest.importorskip("torch")
    from sgl_nixl_plugin.engine.copy_device import _DeviceIndex
    from sgl_nixl_plugin.engine.copy_triton import TritonCopier

    c = TritonCopier.__new__(TritonCopier)
    c.torch, c.device = torch, torch.device("cpu")
    c._index = _DeviceIndex(torch, c.device)
    bases = ck.DeviceBases(torch.tensor([1 << 20, 1 << 21], dtype=torch.int64), 3 << 20)
    units = torch.arange(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"dst stride 64 offset 6.*share only 2"):
        c._pair_launch(bases, bases, units, units, 4, 64, 64, 0, 64, 6, None)
    with pytest.raises(ValueError, match="3 destination units"):
        c.pair_copy(bases, bases, units, units[:3], 64, 64, 0, 64, 0)
    with pytest.raises(ValueError, match="overlap"):
        c.pair_copy(bases, bases, units, units, 64, 64, 0, 32, 0)


# -- GPU ---------------------------------------------------------------------------------------

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    return torch


@pytest.fixture(scope="module", params=["triton", "torch"])
def gpu_copier(request, torch_cuda):
    if request.param == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return make_copier("VRAM", 0, prefer=request.param)


class DeviceRegions:
    """Regions on the GPU (separate allocations, bf16 data or random bytes) + host copies."""

    def __init__(self, torch, count: int, nbytes: int, pattern: str, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.bufs = []
        for r in range(count):
            if pattern == "bf16":
                t = torch.randn(nbytes // 2 + 8 * r, generator=g).to(torch.bfloat16)
                t = t.view(torch.uint8)
            else:
                t = torch.randint(0, 256, (nbytes + 16 * r,), dtype=torch.uint8, generator=g)
            self.bufs.append(t.cuda())
        self.bases = np.array([b.data_ptr() for b in self.bufs], dtype=np.uint64)

    def host(self) -> list[np.ndarray]:
        return [b.cpu().numpy().copy() for b in self.bufs]


def _host_bases(arrays: list[np.ndarray]) -> np.ndarray:
    return np.array([a.ctypes.data for a in arrays], dtype=np.uint64)


@gpu
@pytest.mark.parametrize("kind", GEOMETRIES)
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("pattern", ["bf16", "bytes"])
def test_gpu_copier_matches_numpy(torch_cuda, gpu_copier, kind, page, pattern) -> None:
    torch = torch_cuda
    unit_len, stride, offset, upp = geometry(kind, page)
    pool_pages = 96
    regs = DeviceRegions(torch, 6, offset + pool_pages * upp * stride, pattern, seed=page)
    units = request_units(np.random.default_rng(page), pool_pages, 41, upp)
    n = len(units)
    host = regs.host()
    want = np.zeros(6 * n * unit_len, dtype=np.uint8)
    NumpyCopier().gather(_host_bases(host), units, unit_len, stride, offset, want.ctypes.data)

    stage = torch.zeros(6 * n * unit_len, dtype=torch.uint8, device="cuda")
    gpu_copier.gather(regs.bases, units, unit_len, stride, offset, stage.data_ptr())
    gpu_copier.synchronize()
    assert np.array_equal(stage.cpu().numpy(), want)
    assert all(
        np.array_equal(a, b) for a, b in zip(regs.host(), host, strict=True)
    )  # gather only reads

    # scatter fresh bytes; every region must equal the numpy scatter of the same bytes
    new = torch.randint(0, 256, stage.shape, dtype=torch.uint8).cuda()
    new_host = new.cpu().numpy()
    NumpyCopier().scatter(_host_bases(host), units, unit_len, stride, offset, new_host.ctypes.data)
    gpu_copier.scatter(regs.bases, units, unit_len, stride, offset, new.data_ptr())
    gpu_copier.synchronize()
    for got, exp in zip(regs.host(), host, strict=True):
        assert np.array_equal(got, exp)


@gpu
@pytest.mark.parametrize("unit_len, stride, offset", [(48, 64, 4), (12, 16, 8), (2048, 2048, 4)])
def test_gpu_copier_four_byte_alignment(torch_cuda, gpu_copier, unit_len, stride, offset) -> None:
    torch = torch_cuda
    regs = DeviceRegions(torch, 3, offset + 50 * stride, "bytes", seed=3)
    units = np.random.default_rng(1).choice(50, 17, replace=False)
    host = regs.host()
    want = np.zeros(3 * 17 * unit_len, dtype=np.uint8)
    NumpyCopier().gather(_host_bases(host), units, unit_len, stride, offset, want.ctypes.data)
    stage = torch.zeros(3 * 17 * unit_len + 4, dtype=torch.uint8, device="cuda")
    addr = stage.data_ptr() + 4  # staging address only 4-byte aligned
    gpu_copier.gather(regs.bases, units, unit_len, stride, offset, addr)
    gpu_copier.synchronize()
    assert np.array_equal(stage[4:].cpu().numpy(), want)
    gpu_copier.scatter(regs.bases, units[::-1].copy(), unit_len, stride, offset, addr)
    NumpyCopier().scatter(
        _host_bases(host), units[::-1].copy(), unit_len, stride, offset, want.ctypes.data
    )
    gpu_copier.synchronize()
    for got, exp in zip(regs.host(), host, strict=True):
        assert np.array_equal(got, exp)


@gpu
def test_gpu_copier_takes_device_units_and_repeats_pieces(torch_cuda, gpu_copier) -> None:
    """Units already on the device (int32 and int64), and the per-piece bases cache."""
    torch = torch_cuda
    unit = 2048
    regs = DeviceRegions(torch, 8, 64 * unit, "bf16", seed=5)
    host = regs.host()
    units = np.random.default_rng(2).choice(64, 24, replace=False)
    for dtype in (torch.int64, torch.int32):
        dev_units = torch.as_tensor(units, dtype=dtype, device="cuda")
        stage = torch.zeros(8 * 24 * unit, dtype=torch.uint8, device="cuda")
        for r0 in (0, 4, 0, 4):  # the same two pieces again: cached bases
            gpu_copier.gather(
                regs.bases[r0 : r0 + 4], dev_units, unit, unit, 0, stage.data_ptr() + r0 * 24 * unit
            )
        gpu_copier.synchronize()
        want = np.zeros(8 * 24 * unit, dtype=np.uint8)
        NumpyCopier().gather(_host_bases(host), units, unit, unit, 0, want.ctypes.data)
        assert np.array_equal(stage.cpu().numpy(), want)


@gpu
def test_gpu_prepared_pieces_on_a_bound_stream(torch_cuda, gpu_copier) -> None:
    """The per-piece path of the staging threads: bases and units prepared once, the stream
    bound to the thread, pieces as slices; byte-exact both ways, fast launches stay on."""
    torch = torch_cuda
    unit = 2048
    regs = DeviceRegions(torch, 8, 64 * unit, "bf16", seed=6)
    host = regs.host()
    units = np.random.default_rng(3).choice(64, 40, replace=False)
    stream = torch.cuda.Stream()
    result: dict[str, object] = {}

    def worker() -> None:  # a thread of its own, like the transfer worker / scatter thread
        gpu_copier.bind(stream)
        b = gpu_copier.prepare_bases(regs.bases, stream)
        u = gpu_copier.prepare_units(units, stream)
        stage = torch.zeros(8 * 40 * unit, dtype=torch.uint8, device="cuda")
        for _ in range(3):  # first launch compiles/remembers, later ones reuse
            for r0, r1, j0, j1 in ((0, 3, 0, 40), (3, 8, 0, 17), (3, 8, 17, 40)):
                off = (r0 * 40 + (r1 - r0) * j0) * unit
                gpu_copier.gather(b[r0:r1], u[j0:j1], unit, unit, 0, stage.data_ptr() + off)
        stream.synchronize()
        result["stage"] = stage.cpu().numpy()
        for t in regs.bufs:
            t.zero_()
        torch.cuda.synchronize()
        for r0, r1, j0, j1 in ((0, 3, 0, 40), (3, 8, 0, 17), (3, 8, 17, 40)):
            off = (r0 * 40 + (r1 - r0) * j0) * unit
            gpu_copier.scatter(b[r0:r1], u[j0:j1], unit, unit, 0, stage.data_ptr() + off)
        stream.synchronize()

    t = threading.Thread(target=worker)
    t.start()
    t.join(120)
    assert not t.is_alive()
    want = np.zeros(8 * 40 * unit, dtype=np.uint8)
    hb = _host_bases(host)
    for r0, r1, j0, j1 in ((0, 3, 0, 40), (3, 8, 0, 17), (3, 8, 17, 40)):
        off = (r0 * 40 + (r1 - r0) * j0) * unit
        NumpyCopier().gather(hb[r0:r1], units[j0:j1], unit, unit, 0, want.ctypes.data + off)
    assert np.array_equal(result["stage"], want)
    for r, buf in enumerate(regs.bufs):  # scattered back: the request's units, zeros elsewhere
        got = buf.cpu().numpy()[: 64 * unit].reshape(64, unit)
        exp = np.zeros_like(got)
        exp[units] = host[r][: 64 * unit].reshape(64, unit)[units]
        assert np.array_equal(got, exp), f"region {r}"
    if isinstance(gpu_copier, ck.TritonCopier):
        assert gpu_copier._fast.enabled, "the fast launch path turned itself off"
        assert gpu_copier._fast._kernels, "the fast launch path was never used"


@gpu
def test_gpu_two_pieces_on_two_streams(torch_cuda, gpu_copier) -> None:
    torch = torch_cuda
    unit, R, n = 32768, 8, 48
    regs = DeviceRegions(torch, R, 128 * unit, "bf16", seed=9)
    host = regs.host()
    rng = np.random.default_rng(4)
    units_a = rng.choice(128, n, replace=False)
    units_b = rng.choice(128, n, replace=False)
    stage = torch.zeros(R * n * unit, dtype=torch.uint8, device="cuda")
    half = (R // 2) * n * unit
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):  # several rounds so the launches really overlap
        gpu_copier.gather(regs.bases[: R // 2], units_a, unit, unit, 0, stage.data_ptr(), s1)
        gpu_copier.gather(regs.bases[R // 2 :], units_b, unit, unit, 0, stage.data_ptr() + half, s2)
    gpu_copier.synchronize(s1)
    gpu_copier.synchronize(s2)
    want = np.zeros(R * n * unit, dtype=np.uint8)
    NumpyCopier().gather(_host_bases(host[: R // 2]), units_a, unit, unit, 0, want.ctypes.data)
    NumpyCopier().gather(
        _host_bases(host[R // 2 :]), units_b, unit, unit, 0, want.ctypes.data + half
    )
    assert np.array_equal(stage.cpu().numpy(), want)

    # scatter both pieces back into other regions, again on two streams
    other = DeviceRegions(torch, R, 128 * unit, "bytes", seed=10)
    exp = other.host()
    torch.cuda.synchronize()
    gpu_copier.scatter(other.bases[: R // 2], units_a, unit, unit, 0, stage.data_ptr(), s1)
    gpu_copier.scatter(other.bases[R // 2 :], units_b, unit, unit, 0, stage.data_ptr() + half, s2)
    gpu_copier.synchronize()
    NumpyCopier().scatter(_host_bases(exp[: R // 2]), units_a, unit, unit, 0, want.ctypes.data)
    NumpyCopier().scatter(
        _host_bases(exp[R // 2 :]), units_b, unit, unit, 0, want.ctypes.data + half
    )
    for got, e in zip(other.host(), exp, strict=True):
        assert np.array_equal(got, e)


@gpu
def test_gpu_make_copier_auto_and_alignment_errors(torch_cuda) -> None:
    c = make_copier("VRAM", 0)
    want = "TritonCopier" if importlib.util.find_spec("triton") else "TorchCopier"
    assert type(c).__name__ == want and c.mem_kind == "VRAM"
    if isinstance(c, ck.TritonCopier):
        c.warmup(32768)
        c.warmup(256, 1024, 512)
        buf = torch_cuda.zeros(4096, dtype=torch_cuda.uint8, device="cuda")
        with pytest.raises(ValueError, match="multiples of 4"):
            c.gather(np.array([buf.data_ptr()], np.uint64), [0], 64, 64, 2, buf.data_ptr() + 2048)


def test_mapped_units_slice_within_their_buffer():
    from sgl_nixl_plugin.engine.mapped_units import MappedUnits

    m = MappedUnits(object(), 4096, 10, "int64")
    assert m.shape == (10,) and len(m) == 10 and m.data_ptr() == 4096
    s = m[2:7]
    assert s.data_ptr() == 4096 + 16 and s.shape == (5,) and s.dtype == "int64"
    assert m[8:20].shape == (2,) and m[5:3].shape == (0,)
    with pytest.raises(ValueError, match="step"):
        m[::2]


def test_host_mapped_indices_stay_off_when_their_self_test_fails(monkeypatch):
    """``map_units`` turns on only if reading indices from host memory passed its check
    (run once); otherwise gathers keep uploading them."""
    from sgl_nixl_plugin.engine.copy_triton import MAPPED_RESERVE, TritonCopier

    class Pool:  # the pinned buffers' pool: what was reserved, when
        def __init__(self) -> None:
            self.reserved: list[tuple[int, int]] = []

        def reserve(self, count: int, capacity: int) -> None:
            self.reserved.append((count, capacity))
            calls.append("reserve")

    copier = TritonCopier.__new__(TritonCopier)  # no GPU here: only the switch is tested
    copier._map_units, copier._mapped_ok, copier._mapped = False, None, Pool()
    calls: list = []
    monkeypatch.setattr(TritonCopier, "_check_mapped", lambda self: calls.append(1) or False)
    copier.map_units = True
    # the reserve is pinned before the check, which reads one of its buffers
    assert copier.map_units is False and calls == ["reserve", 1]
    copier.map_units = True
    assert copier.map_units is False and calls == ["reserve", 1]  # checked once
    assert copier._mapped.reserved == [MAPPED_RESERVE]
    copier._mapped_ok = True
    copier.map_units = True
    assert copier.map_units is True
    copier.map_units = False
    assert copier.map_units is False


class _HostBuf:
    """A "pinned" int64 buffer in host memory, as MappedPool uses one."""

    def __init__(self, n: int) -> None:
        self.a = np.zeros(n, dtype=np.int64)
        self.shape = self.a.shape

    def numpy(self):
        return self.a

    def data_ptr(self):
        return self.a.ctypes.data


class _PinningTorch:
    """Only what MappedPool calls, on host memory; counts the pinned allocations. It has no
    ``cuda``: a pool that tried to record an event of its own would fail."""

    int64 = np.int64

    def __init__(self) -> None:
        self.pinned: list[int] = []

    def empty(self, n, dtype, pin_memory):
        assert pin_memory
        self.pinned.append(n)
        return _HostBuf(n)


def test_mapped_pool_reserves_pinned_buffers_that_later_requests_reuse():
    """``reserve`` pins its buffers up front (within ``max_buffers``); a request that fits
    takes one of them instead of pinning a new one."""
    from sgl_nixl_plugin.engine.mapped_units import MappedPool

    torch = _PinningTorch()
    pool = MappedPool(torch, max_buffers=3)
    pool.reserve(5, 4096)
    assert torch.pinned == [4096] * 3  # bounded by max_buffers
    units = np.arange(3000, dtype=np.int64)
    taken = [pool.take(units) for _ in range(3)]
    assert all(t is not None and np.array_equal(t._buf.a[:3000], units) for t in taken)
    assert torch.pinned == [4096] * 3 and pool.in_use == 3  # reused, none pinned
    assert pool.take(units) is None  # past max_buffers: the caller uploads instead


def test_mapped_pool_reuses_a_buffer_given_with_an_event_only_once_it_passed():
    """A one-pass launch gives its index buffer back with the copy's own completion event:
    the pool records no event of its own and hands the buffer out again only after that
    one passed."""
    from sgl_nixl_plugin.engine.mapped_units import MappedPool

    class Event:
        def __init__(self) -> None:
            self.done = False

        def query(self) -> bool:
            return self.done

    pool = MappedPool(_PinningTorch(), max_buffers=1)
    first = pool.take(np.arange(10, dtype=np.int64))
    copy_done = Event()
    pool.give(first, None, copy_done)
    assert pool.in_use == 0
    assert pool.take(np.arange(5, dtype=np.int64)) is None  # the copy may still read it
    copy_done.done = True
    again = pool.take(np.array([7, 8, 9], dtype=np.int64))
    assert again is not None and again._buf is first._buf
    assert list(again._buf.a[:3]) == [7, 8, 9]


@gpu
def test_gpu_copier_pins_its_index_buffers_at_start(torch_cuda) -> None:
    """Turning mapped indices on reserves their buffers: a first request of 8k pages takes
    a reserved one (nothing pinned on its path) and gathers the right bytes."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    c = make_copier("VRAM", 0, prefer="triton")
    c.warmup(2048)
    c.map_units = True
    if not c.map_units:
        pytest.skip("mapped indices are off on this machine")
    from sgl_nixl_plugin.engine.copy_triton import MAPPED_RESERVE

    count = c._mapped._count
    assert count >= MAPPED_RESERVE[0]
    regs = DeviceRegions(torch_cuda, 2, 9000 * 2048, "bytes", seed=7)
    units = np.random.default_rng(7).permutation(9000)[:8192]
    stage = torch_cuda.zeros(2 * 8192 * 2048, dtype=torch_cuda.uint8, device="cuda")
    u = c.prepare_units(units)
    c.gather(regs.bases, u, 2048, 2048, 0, stage.data_ptr())
    c.release_units(u)
    c.synchronize()
    assert c._mapped._count == count  # no buffer pinned for the request
    host = regs.host()
    want = np.zeros(2 * 8192 * 2048, dtype=np.uint8)
    NumpyCopier().gather(_host_bases(host), units, 2048, 2048, 0, want.ctypes.data)
    assert np.array_equal(stage.cpu().numpy(), want)


@pytest.fixture(scope="module")
def triton_copier(torch_cuda):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    return make_copier("VRAM", 0, prefer="triton")


def _pair_expected(src_host, dst_host, su, du, unit_len, s_stride, s_off, d_stride, d_off):
    out = [d.copy() for d in dst_host]
    cols = np.arange(unit_len)
    for o, a in zip(out, src_host, strict=True):
        o[d_off + du[:, None] * d_stride + cols] = a[s_off + su[:, None] * s_stride + cols]
    return out


@gpu
@pytest.mark.parametrize(
    "unit_len, s_stride, s_off, d_stride, d_off",
    [
        (ROW, ROW, 0, ROW, 0),  # page size 1
        (16 * ROW, 16 * ROW, 0, 16 * ROW, 0),  # page size 16
        (128, 256, 128, 512, 384),  # head slices on both sides
        (48, 64, 4, 56, 8),  # 4-byte alignment only
    ],
)
@pytest.mark.parametrize("units_as", ["numpy", "prepared", "int32"])
def test_gpu_pair_copy_matches_numpy(
    torch_cuda, triton_copier, unit_len, s_stride, s_off, d_stride, d_off, units_as
) -> None:
    torch, c = torch_cuda, triton_copier
    c.warmup_pair(unit_len, s_stride, s_off, d_stride, d_off)
    rng = np.random.default_rng(unit_len + d_off)
    n, s_items, d_items = 41, 96, 120
    src = DeviceRegions(torch, 6, s_off + s_items * s_stride, "bf16", seed=1)
    dst = DeviceRegions(torch, 6, d_off + d_items * d_stride, "bytes", seed=2)
    su = rng.choice(s_items, n, replace=False).astype(np.int64)
    du = rng.choice(d_items, n, replace=False).astype(np.int64)
    want = _pair_expected(
        src.host(), dst.host(), su, du, unit_len, s_stride, s_off, d_stride, d_off
    )
    if units_as == "numpy":
        args = (src.bases, dst.bases, su, du)
    elif units_as == "int32":
        args = (
            c.prepare_bases(src.bases),
            c.prepare_bases(dst.bases),
            torch.as_tensor(su, dtype=torch.int32, device="cuda"),
            torch.as_tensor(du, dtype=torch.int32, device="cuda"),
        )
    else:
        args = (c.prepare_bases(src.bases), c.prepare_bases(dst.bases))
        args += (c.prepare_units(su), c.prepare_units(du))
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # regions, bases and units were uploaded on the current stream
    c.pair_copy(*args, unit_len, s_stride, s_off, d_stride, d_off, stream=stream)
    stream.synchronize()
    for k, (got, exp) in enumerate(zip(dst.host(), want, strict=True)):
        assert np.array_equal(got, exp), f"region {k}"
    with pytest.raises(ValueError, match="multiples of 4"):
        c.pair_copy(src.bases, dst.bases, su, du, unit_len, s_stride, s_off, d_stride, d_off + 2)


@gpu
def test_gpu_pair_copy_takes_the_fast_launch_after_warmup(torch_cuda, triton_copier) -> None:
    """After ``warmup_pair`` a request's pair copy skips Triton's dispatch (the fast launch
    it checked) and still writes exactly the expected bytes; numbers the launches taken."""
    torch, c = torch_cuda, triton_copier
    unit_len = 16 * ROW
    c.warmup_pair(unit_len, unit_len, 0, unit_len, 0)
    assert c._fast_pair.enabled and c._fast_pair._kernels, "no fast pair launch remembered"
    taken = []
    real = c._fast_pair.launch
    c._fast_pair.launch = lambda *a: taken.append(real(*a)) or taken[-1]
    rng = np.random.default_rng(7)
    src = DeviceRegions(torch, 6, 64 * unit_len, "bf16", seed=3)
    dst = DeviceRegions(torch, 6, 80 * unit_len, "bytes", seed=4)
    su = rng.choice(64, 33, replace=False).astype(np.int64)
    du = rng.choice(80, 33, replace=False).astype(np.int64)
    want = _pair_expected(src.host(), dst.host(), su, du, unit_len, unit_len, 0, unit_len, 0)
    c.pair_copy(
        c.prepare_bases(src.bases),
        c.prepare_bases(dst.bases),
        c.prepare_units(su),
        c.prepare_units(du),
        unit_len,
        unit_len,
        0,
        unit_len,
        0,
    )
    torch.cuda.synchronize()
    assert taken == [True], taken
    for k, (got, exp) in enumerate(zip(dst.host(), want, strict=True)):
        assert np.array_equal(got, exp), f"region {k}"


@gpu
def test_gpu_pair_warmup_checks_each_geometry_once(torch_cuda, triton_copier) -> None:
    """A second decode of the same shape does not compile or self-test the one-pass copy
    again (its setup would wait for it): the second ``warmup_pair`` of a geometry launches
    nothing; another geometry is checked."""
    c = triton_copier
    launched = []
    real = c.pair_copy
    c.pair_copy = lambda *a, **k: launched.append(a[4:9]) or real(*a, **k)
    try:
        shape = (12 * ROW, 13 * ROW, 4, 14 * ROW, 8)  # no other test warms it
        c.warmup_pair(*shape)
        assert launched == [shape, shape], launched  # Triton's dispatch, then the fast launch
        c.warmup_pair(*shape)
        assert len(launched) == 2, launched
        other = (12 * ROW, 13 * ROW, 4, 14 * ROW, 12)
        c.warmup_pair(*other)
        assert launched[2:] == [other, other], launched
    finally:
        c.pair_copy = real
