"""Gather/scatter copy kernels for the staging path.

The sender gathers a request's scattered KV units into one contiguous staging buffer (one
large NIXL WRITE moves it) and the receiver scatters the staging bytes into its pages.

Layout (see ``layout.Geometry``): unit ``k`` of region ``r`` is ``unit_len`` bytes at
``bases[r] + offset + k * stride`` (whole pages: ``unit_len == stride``, offset 0; head
slices: ``unit_len < stride``). The staging bytes of a *piece* (a contiguous range of
regions) are region-major: unit ``j`` of the piece's ``i``-th region lives at
``stage + (i * n + j) * unit_len`` where ``n = len(units)``.

Every address is a raw integer, so the same code serves memory from any allocator. Three
implementations share one protocol (``Copier``):

- ``NumpyCopier`` (DRAM): numpy views over raw addresses, one vectorised copy per region.
- ``TritonCopier`` (VRAM): one Triton launch per call covering every region and unit of the
  piece; 16-byte accesses when every address, stride and length allows it.
- ``TorchCopier`` (VRAM, fallback without Triton): ``index_select`` / ``index_copy_`` per
  region on tensors wrapped around raw device pointers.

Importing this module imports neither torch nor triton (SGLang imports our entry point in
every process); the VRAM copiers import them when built.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

logger = logging.getLogger(__name__)

PREFERENCES = ("auto", "triton", "torch", "numpy")

# Triton tiles: each program copies about TILE_BYTES, in rows of at most MAX_BLOCK_WORDS
# 4-byte words (a unit larger than that is split over several programs).
TILE_BYTES = 16384
MAX_BLOCK_WORDS = 2048
NUM_WARPS = 4
AUTO_CHECK_UNIT = 2048  # make_copier("VRAM") compiles and checks this unit size up front


class CopierUnavailable(RuntimeError):
    """The requested copier cannot run here (missing torch, CUDA or triton)."""


class Copier(Protocol):
    mem_kind: str  # "DRAM" | "VRAM"

    def gather(
        self, bases: np.ndarray, units: np.ndarray, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None: ...

    def scatter(
        self, bases: np.ndarray, units: np.ndarray, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None: ...

    def synchronize(self, stream: Any = None) -> None: ...

    def prepare_units(self, units: Any, stream: Any = None) -> Any:
        """``units`` in the form this copier reads fastest (a device tensor on GPUs),
        uploaded once per request; slices of it are valid ``units`` for later calls."""
        ...

    def prepare_bases(self, bases: Any, stream: Any = None) -> Any:
        """``bases`` likewise (uploaded once per set); slices are valid ``bases``."""
        ...

    def bind(self, stream: Any) -> None:
        """Called once by a thread that will copy on ``stream`` (lets GPU copiers skip
        switching stream per call)."""
        ...


# -- argument checks shared by every copier -----------------------------------------------


def _check_geometry(unit_len: int, stride: int, offset: int, stage: int) -> None:
    if unit_len <= 0:
        raise ValueError(f"unit_len must be positive, got {unit_len}")
    if stride < unit_len:
        raise ValueError(f"stride {stride} is shorter than unit_len {unit_len}: units overlap")
    if offset < 0:
        raise ValueError(f"offset must be non-negative, got {offset}")
    if stage <= 0:
        raise ValueError(f"staging address must be a positive integer, got {stage}")


def _as_bases(bases: Any) -> np.ndarray:
    """Region base addresses as a 1-D uint64 array."""
    b = np.asarray(bases)
    if b.ndim != 1:
        raise ValueError(f"bases must be 1-D, got shape {b.shape}")
    if b.size and b.dtype.kind not in "iu":
        raise ValueError(f"bases must be integer addresses, got {b.dtype}")
    b = b.astype(np.uint64, copy=False)
    if b.size and int(b.max()) >= 1 << 63:
        raise ValueError("base address beyond 2**63")
    return b


def _as_units(units: Any) -> np.ndarray:
    """Unit indices as a contiguous 1-D int64 array (non-negative)."""
    u = np.asarray(units)
    if u.ndim != 1:
        raise ValueError(f"units must be 1-D, got shape {u.shape}")
    if u.size and u.dtype.kind not in "iu":
        raise ValueError(f"units must be integers, got {u.dtype}")
    u = np.ascontiguousarray(u, dtype=np.int64)
    if u.size and int(u.min()) < 0:
        raise ValueError("negative unit index")
    return u


def _low_bit(x: int) -> int:
    """Largest power of two dividing ``x`` (``1 << 62`` for 0)."""
    return x & -x if x else 1 << 62


def _alignment(bases: np.ndarray, unit_len: int, stride: int, offset: int, stage: int) -> int:
    """The largest power of two (capped at 16) that divides every address the copy touches."""
    acc = int(np.bitwise_or.reduce(bases)) if bases.size else 0
    return _align_of(acc, unit_len, stride, offset, stage)


def _align_of(bases_or: int, unit_len: int, stride: int, offset: int, stage: int) -> int:
    """``_alignment`` from the OR of the base addresses (cached per set of bases)."""
    return min(16, _low_bit(bases_or | offset | unit_len | stride | stage))


# -- DRAM: numpy ---------------------------------------------------------------------------


class _HostBuf:
    """An ``__array_interface__`` over raw host memory (no ctypes type per size: no leak)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> None:
        self.__array_interface__ = {
            "data": (int(addr), False), "shape": shape, "strides": strides,
            "typestr": "|u1", "version": 3,
        }


def host_view(addr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None = None) -> np.ndarray:
    """A writable uint8 numpy view of host memory at ``addr`` (strides in bytes)."""
    return np.asarray(_HostBuf(addr, tuple(int(s) for s in shape),
                               None if strides is None else tuple(int(s) for s in strides)))


class NumpyCopier:
    """Host memory: one vectorised numpy copy per region of the piece."""

    mem_kind = "DRAM"

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        pass

    def gather(
        self, bases: np.ndarray, units: np.ndarray, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None:
        self._copy(True, bases, units, unit_len, stride, offset, stage)

    def scatter(
        self, bases: np.ndarray, units: np.ndarray, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None:
        self._copy(False, bases, units, unit_len, stride, offset, stage)

    def synchronize(self, stream: Any = None) -> None:
        pass  # numpy copies are synchronous

    def prepare_units(self, units: Any, stream: Any = None) -> np.ndarray:
        return _as_units(units)

    def prepare_bases(self, bases: Any, stream: Any = None) -> np.ndarray:
        return _as_bases(bases)

    def bind(self, stream: Any) -> None:
        pass

    @staticmethod
    def _copy(
        gather: bool, bases: Any, units: Any, unit_len: int, stride: int, offset: int, stage: int
    ) -> None:
        unit_len, stride, offset, stage = int(unit_len), int(stride), int(offset), int(stage)
        _check_geometry(unit_len, stride, offset, stage)
        b = _as_bases(bases)
        u = _as_units(units)
        n = len(u)
        if n == 0 or len(b) == 0:
            return
        rows = int(u.max()) + 1  # the region views end at the last unit the request names
        dense = stride == unit_len
        for i, base in enumerate(b.tolist()):
            region = host_view(base + offset, (rows, unit_len), (stride, 1))
            staged = host_view(stage + i * n * unit_len, (n, unit_len))
            if gather:
                if dense:
                    # take on a C-contiguous source writes straight into ``out``
                    # (mode="clip": "raise" would buffer ``out``; indices are in range).
                    np.take(region, u, axis=0, out=staged, mode="clip")
                else:
                    # take would copy a strided source whole; a fancy read copies only
                    # the named units (into a temporary).
                    staged[...] = region[u]
            else:
                region[u] = staged


# -- VRAM helpers --------------------------------------------------------------------------


def _require_torch_cuda(device: int) -> Any:
    try:
        import torch
    except ImportError as exc:
        raise CopierUnavailable(
            f"VRAM staging copies need torch with CUDA, and torch is not importable ({exc})"
        ) from exc
    if not torch.cuda.is_available():
        raise CopierUnavailable(
            f"VRAM staging copies need a CUDA device, and torch {torch.__version__} sees none "
            f"(torch.cuda.is_available() is False; torch built for CUDA {torch.version.cuda})"
        )
    if not 0 <= device < torch.cuda.device_count():
        raise CopierUnavailable(
            f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)"
        )
    return torch


def _require_triton() -> Any:
    try:
        import triton
        import triton.language  # noqa: F401
    except ImportError as exc:
        raise CopierUnavailable(f"the Triton copier needs triton, which is not importable ({exc})") from exc
    return triton


class _StreamScope:
    """``with torch.cuda.device(d), torch.cuda.stream(s)`` returning the stream."""

    def __init__(self, torch: Any, device: Any, stream: Any) -> None:
        self.torch, self.device, self.stream = torch, device, stream

    def __enter__(self) -> Any:
        t = self.torch
        self._dev = t.cuda.device(self.device)
        self._dev.__enter__()
        s = self.stream if self.stream is not None else t.cuda.current_stream(self.device)
        self._str = t.cuda.stream(s)
        self._str.__enter__()
        return s

    def __exit__(self, *exc: Any) -> None:
        self._str.__exit__(*exc)
        self._dev.__exit__(*exc)


class DeviceBases:
    """Region base addresses already on the GPU (``prepare_bases``). Slicing keeps them
    there, so the pieces of a request share one upload; ``bits`` is the OR of every
    address (a conservative alignment for any slice)."""

    __slots__ = ("tensor", "bits", "_aligned", "_key")

    def __init__(
        self, tensor: Any, bits: int, aligned: dict[Any, Any] | None = None, key: Any = None
    ) -> None:
        self.tensor, self.bits = tensor, bits
        self._aligned = {} if aligned is None else aligned  # shared by all slices
        self._key = key

    def __len__(self) -> int:
        return int(self.tensor.shape[0])

    def __getitem__(self, s: slice) -> DeviceBases:
        return DeviceBases(self.tensor[s], self.bits, self._aligned, (s.start, s.stop))

    def aligned(self) -> Any:
        """The tensor, at a 16-byte aligned address: Triton compiles one variant per
        pointer alignment, and a slice starting at an odd region would otherwise cost a
        compile (~0.1 s) the first time it occurs. A misaligned slice is copied once (on
        the current stream, where it is used) and the copy kept."""
        t = self.tensor
        if t.data_ptr() % 16 == 0:
            return t
        hit = self._aligned.get(self._key)
        if hit is None:
            if len(self._aligned) >= 4096:  # bounded: at most regions^2 slices exist
                self._aligned.clear()
            hit = self._aligned[self._key] = t.clone()
        return hit


def _aligned_units(units: Any) -> Any:
    """``units`` at a 16-byte aligned address (see ``DeviceBases.aligned``)."""
    return units if units.data_ptr() % 16 == 0 else units.clone()


class _DeviceIndex:
    """Device copies of ``bases`` (kept; they repeat across requests) and of ``units``
    (a few recent ones, compared by content), uploaded from pinned host memory."""

    BASES_CACHE = 1024
    UNITS_CACHE = 4

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch = torch
        self.device = device
        self._lock = threading.Lock()
        self._bases: OrderedDict[bytes, tuple[Any, Any]] = OrderedDict()
        self._units: list[tuple[np.ndarray, Any, Any]] = []  # (host copy, tensor, ready event)

    def bases(self, bases: Any, stream: Any) -> tuple[Any, int]:
        """The device copy of ``bases`` and the OR of all of them (for the alignment);
        validated and uploaded once per distinct set (they repeat for every piece)."""
        key = bases.tobytes() if isinstance(bases, np.ndarray) else bytes(np.asarray(bases))
        with self._lock:
            hit = self._bases.get(key)
            if hit is not None:
                self._bases.move_to_end(key)
        if hit is None:
            b = _as_bases(bases)
            acc = int(np.bitwise_or.reduce(b)) if b.size else 0
            dev, ev = self._upload(b.view(np.int64), stream)
            hit = (dev, ev, acc, len(b))
            with self._lock:
                self._bases[key] = hit
                while len(self._bases) > self.BASES_CACHE:
                    self._bases.popitem(last=False)
        return self._ready(hit[:2], stream), hit[2]

    def units(self, u: Any, stream: Any) -> Any:
        torch = self.torch
        if isinstance(u, torch.Tensor):
            if u.dim() != 1:
                raise ValueError(f"units must be 1-D, got shape {tuple(u.shape)}")
            if u.device != self.device:
                u = u.to(self.device, non_blocking=True)
            if u.dtype not in (torch.int64, torch.int32):
                u = u.long()
            return u.contiguous()  # the kernel reads units[j] at units_ptr + j
        u = _as_units(u)
        with self._lock:
            for i, (host, dev, ev) in enumerate(self._units):
                if host.shape == u.shape and np.array_equal(host, u):
                    if i:
                        self._units.insert(0, self._units.pop(i))
                    return self._ready((dev, ev), stream)
        dev, ev = self._upload(u, stream)
        with self._lock:
            self._units.insert(0, (u.copy(), dev, ev))
            del self._units[self.UNITS_CACHE:]
        return dev

    def _upload(self, host: np.ndarray, stream: Any) -> tuple[Any, Any]:
        """Enqueue an H2D copy on ``stream`` (from a pinned block; torch's host allocator
        keeps that block until the copy has run) and record an event after it."""
        torch = self.torch
        src = torch.from_numpy(np.ascontiguousarray(host)).pin_memory()
        dev = torch.empty(src.shape, dtype=src.dtype, device=self.device)
        dev.copy_(src, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        return dev, ev

    @staticmethod
    def _ready(entry: tuple[Any, Any], stream: Any) -> Any:
        """The cached tensor, usable on ``stream`` (waits for its upload, and tells the
        caching allocator the tensor is used there)."""
        dev, ev = entry
        stream.wait_event(ev)
        dev.record_stream(stream)
        return dev


# -- VRAM: Triton --------------------------------------------------------------------------

tl: Any = None  # triton.language, bound by _triton_kernel() (the kernel's global ``tl``)


def _unit_copy_kernel(
    bases_ptr, units_ptr, n_units, stage, unit_words, stride, offset,
    GATHER: tl.constexpr, ALIGN: tl.constexpr, BLOCK_U: tl.constexpr,
    BLOCK_W: tl.constexpr, EVEN_W: tl.constexpr,
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


_KERNEL: Any = None
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
    gather: bool, bases_t: Any, units_t: Any, n: int, unit_len: int, stride: int, offset: int,
    stage: int, align: int, tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS,
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
    args = (bases_t, units_t, n, stage, unit_words, stride, offset,
            bool(gather), align, block_u, block_w, even)
    if fast is not None and fast.launch((programs, regions), num_warps, args):
        return
    kernel = _triton_kernel()
    with _LAUNCH_LOCK:  # one compile per shape, even when several threads start at once
        compiled = kernel[(programs, regions)](
            bases_t, units_t, n, stage, unit_words, stride, offset,
            GATHER=bool(gather), ALIGN=align, BLOCK_U=block_u, BLOCK_W=block_w, EVEN_W=even,
            num_warps=num_warps,
        )
    if fast is not None:
        fast.remember(num_warps, args, compiled)


def _spec(x: int) -> tuple[bool, bool]:
    return x == 1, x % 16 == 0


class _FastLaunch:
    """Launches a kernel specialization Triton compiled before, through its compiled
    launcher: Triton's generic dispatch (argument binding, specialization key, cache lookup)
    costs tens of microseconds per call in Python, paid per staged piece.

    The key mirrors what Triton specializes on: the constexprs, 16-byte alignment of the
    two pointers, the index dtype, and (=1, %16) of the integer arguments it does not
    treat as ``do_not_specialize``. ``TritonCopier.warmup`` checks the bytes it copies;
    any failure turns it off for good (the generic path remains)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.enabled = True
        self._kernels: dict[tuple, Any] = {}
        try:
            from triton import knobs

            self._hooks: Any = knobs.runtime
        except Exception:  # older Triton: hooks live on CompiledKernel
            self._hooks = None

    @staticmethod
    def _key(num_warps: int, args: tuple) -> tuple:
        bases_t, units_t, _, _, unit_words, stride, offset = args[:7]
        return (num_warps, *args[7:], units_t.dtype, bases_t.data_ptr() % 16 == 0,
                units_t.data_ptr() % 16 == 0, _spec(unit_words), _spec(stride), _spec(offset))

    def remember(self, num_warps: int, args: tuple, compiled: Any) -> None:
        if self.enabled and compiled is not None and hasattr(compiled, "run"):
            self._kernels[self._key(num_warps, args)] = compiled

    def launch(self, grid: tuple[int, int], num_warps: int, args: tuple) -> bool:
        if not self.enabled:
            return False
        ck = self._kernels.get(self._key(num_warps, args))
        if ck is None:
            return False
        try:
            stream = self.torch._C._cuda_getCurrentRawStream(self.torch._C._cuda_getDevice())
            full = (grid[0], grid[1], 1)
            hooks = self._hooks
            enter = getattr(hooks, "launch_enter_hook", None) if hooks else None
            leave = getattr(hooks, "launch_exit_hook", None) if hooks else None
            meta = ck.launch_metadata(full, stream, *args)
            ck.run(full[0], full[1], full[2], stream, ck.function, ck.packed_metadata, meta,
                   enter, leave, *args)
            return True
        except Exception as exc:
            logger.warning("sgl-nixl: fast Triton launch failed (%s); using Triton's own", exc)
            self.enabled = False
            return False


class TritonCopier:
    """GPU memory: one Triton launch per gather/scatter call (all regions, all units)."""

    mem_kind = "VRAM"

    def __init__(
        self, device: int = 0, tile_bytes: int = TILE_BYTES, num_warps: int = NUM_WARPS
    ) -> None:
        torch = _require_torch_cuda(device)
        _require_triton()
        self.torch = torch
        self.device = torch.device("cuda", device)
        self.tile_bytes = tile_bytes
        self.num_warps = num_warps
        self._index = _DeviceIndex(torch, self.device)
        self._fast = _FastLaunch(torch)
        self._prepared: dict[tuple[bytes, int], DeviceBases] = {}
        _triton_kernel()

    def bind(self, stream: Any) -> None:
        """Make ``stream`` (on our device) the calling thread's current one, so that calls
        from this thread with that stream skip switching device and stream per call. For
        threads that only ever copy (the staging threads)."""
        torch = self.torch
        torch.cuda.set_device(self.device)
        if stream is not None:
            torch.cuda.set_stream(stream)

    def _is_current(self, stream: Any) -> bool:
        c = self.torch._C
        dev = c._cuda_getDevice()
        if dev != self.device.index:
            return False
        return stream is None or c._cuda_getCurrentRawStream(dev) == stream.cuda_stream

    def prepare_bases(self, bases: Any, stream: Any = None) -> DeviceBases:
        """``bases`` uploaded once per set and stream; slice the result per piece."""
        b = _as_bases(bases)
        key = (b.tobytes(), 0 if stream is None else stream.cuda_stream)
        hit = self._prepared.get(key)
        if hit is None:
            with _StreamScope(self.torch, self.device, stream) as s:
                dev, _ = self._index._upload(b.view(np.int64), s)
            hit = DeviceBases(dev, int(np.bitwise_or.reduce(b)) if b.size else 0)
            with self._index._lock:
                self._prepared[key] = hit
                while len(self._prepared) > _DeviceIndex.BASES_CACHE:
                    self._prepared.pop(next(iter(self._prepared)))
        return hit

    def gather(
        self, bases: np.ndarray, units: Any, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None:
        self._copy(True, bases, units, unit_len, stride, offset, stage, stream)

    def scatter(
        self, bases: np.ndarray, units: Any, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None:
        self._copy(False, bases, units, unit_len, stride, offset, stage, stream)

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream``, or for the whole device when no stream is given."""
        if stream is not None:
            stream.synchronize()
        else:
            self.torch.cuda.synchronize(self.device)

    def warmup(self, unit_len: int, stride: int | None = None, offset: int = 0) -> None:
        """Compile (and check) the gather and scatter kernels for this geometry now: the
        first launch of a new shape compiles for a second or so. Raises on a wrong copy."""
        stride = unit_len if stride is None else stride
        torch = self.torch
        g = torch.Generator(device="cpu").manual_seed(0)
        region = torch.randint(0, 256, (offset + 3 * stride,), dtype=torch.uint8, generator=g)
        region = region.to(self.device)
        before = region.clone()
        stage = torch.zeros(2 * unit_len, dtype=torch.uint8, device=self.device)
        bases = np.array([region.data_ptr()], dtype=np.uint64)
        units = np.array([2, 0], dtype=np.int64)
        self.gather(bases, units, unit_len, stride, offset, stage.data_ptr())
        want = torch.cat([before[offset + k * stride:][:unit_len] for k in (2, 0)])
        ok = torch.equal(stage, want)
        region.zero_()
        self.scatter(bases, units, unit_len, stride, offset, stage.data_ptr())
        for k in (2, 0):
            ok = ok and torch.equal(
                region[offset + k * stride:][:unit_len], before[offset + k * stride:][:unit_len]
            )
        self.synchronize()
        if not ok:
            raise RuntimeError(
                f"the Triton copier copied wrong bytes in its self-test (unit_len {unit_len}, "
                f"stride {stride}, offset {offset})"
            )
        self._check_fast(region, before, bases, units, unit_len, stride, offset)

    def _check_fast(
        self, region: Any, before: Any, bases: np.ndarray, units: np.ndarray, unit_len: int,
        stride: int, offset: int,
    ) -> None:
        """Run the per-piece path (prepared bases and units, fast launches) twice and compare
        bytes; on any failure keep only Triton's own dispatch."""
        torch = self.torch
        if not self._fast.enabled:
            return
        try:
            with _StreamScope(torch, self.device, None):
                b = self.prepare_bases(bases)
                u = self.prepare_units(units)
                stage = torch.zeros(2 * unit_len, dtype=torch.uint8, device=self.device)
                want = torch.cat([before[offset + k * stride:][:unit_len] for k in (2, 0)])
                ok = True
                for _ in range(2):  # the first call compiles and remembers, the second reuses
                    stage.zero_()
                    self.gather(b, u, unit_len, stride, offset, stage.data_ptr())
                    ok = ok and torch.equal(stage, want)
                    region.zero_()
                    self.scatter(b, u, unit_len, stride, offset, stage.data_ptr())
                    ok = ok and torch.equal(region, before * (region != 0)) and all(
                        torch.equal(region[offset + k * stride:][:unit_len],
                                    before[offset + k * stride:][:unit_len]) for k in (2, 0)
                    )
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            ok = False
            logger.warning("sgl-nixl: the fast Triton launch path failed its self-test: %s", exc)
        if not ok:
            self._fast.enabled = False
            logger.warning("sgl-nixl: fast Triton launches off (self-test); copies stay correct")

    def prepare_units(self, units: Any, stream: Any = None) -> Any:
        with _StreamScope(self.torch, self.device, stream) as s:
            return self._index.units(units, s)

    def _copy(
        self, gather: bool, bases: Any, units: Any, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any,
    ) -> None:
        unit_len, stride, offset, stage = int(unit_len), int(stride), int(offset), int(stage)
        _check_geometry(unit_len, stride, offset, stage)
        n = int(units.shape[0]) if hasattr(units, "shape") else len(units)
        if n == 0 or len(bases) == 0:
            return
        if (
            isinstance(bases, DeviceBases) and isinstance(units, self.torch.Tensor)
            and units.is_cuda and units.dim() == 1 and self._is_current(stream)
        ):
            # the per-piece path: everything already on the GPU, on the right stream
            align = _align_of(bases.bits, unit_len, stride, offset, stage)
            if align >= 4:
                launch_unit_copy(
                    gather, bases.aligned(), _aligned_units(units), n, unit_len, stride,
                    offset, stage, align, self.tile_bytes, self.num_warps, self._fast,
                )
                return
        if isinstance(bases, DeviceBases):
            bases = bases.tensor.cpu().numpy().view(np.uint64)  # rare: another thread/stream
        with _StreamScope(self.torch, self.device, stream) as s:
            bases_t, acc = self._index.bases(bases, s)
            align = _align_of(acc, unit_len, stride, offset, stage)
            if align < 4:
                raise ValueError(
                    "the Triton copier needs unit_len, stride, offset, every base address and "
                    f"the staging address to be multiples of 4 (they share only {align})"
                )
            units_t = self._index.units(units, s)
            launch_unit_copy(
                gather, bases_t, units_t, n, unit_len, stride, offset, stage, align,
                self.tile_bytes, self.num_warps, self._fast,
            )


# -- VRAM: torch fallback ------------------------------------------------------------------


class _CudaBuf:
    """A ``__cuda_array_interface__`` over raw device memory (no stream: no implicit sync)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, addr: int, shape: tuple[int, ...], strides: tuple[int, ...] | None) -> None:
        self.__cuda_array_interface__ = {
            "data": (int(addr), False), "shape": shape, "strides": strides,
            "typestr": "|u1", "version": 2,
        }


def device_view(
    torch: Any, device: Any, addr: int, shape: tuple[int, ...],
    strides: tuple[int, ...] | None = None,
) -> Any:
    """A uint8 CUDA tensor over device memory at ``addr`` (strides in bytes; no copy)."""
    buf = _CudaBuf(addr, tuple(int(s) for s in shape),
                   None if strides is None else tuple(int(s) for s in strides))
    t = torch.as_tensor(buf, device=device)
    if t.data_ptr() != int(addr):  # as_tensor must wrap, never copy
        raise RuntimeError("torch copied a device buffer instead of wrapping it")
    return t


class TorchCopier:
    """GPU memory without Triton: ``index_select`` / ``index_copy_`` once per region."""

    mem_kind = "VRAM"

    def __init__(self, device: int = 0) -> None:
        torch = _require_torch_cuda(device)
        self.torch = torch
        self.device = torch.device("cuda", device)
        self._index = _DeviceIndex(torch, self.device)

    def warmup(self, *args: Any, **kwargs: Any) -> None:
        pass

    def gather(
        self, bases: np.ndarray, units: Any, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None:
        self._copy(True, bases, units, unit_len, stride, offset, stage, stream)

    def scatter(
        self, bases: np.ndarray, units: Any, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any = None,
    ) -> None:
        self._copy(False, bases, units, unit_len, stride, offset, stage, stream)

    def synchronize(self, stream: Any = None) -> None:
        """Wait for ``stream``, or for the whole device when no stream is given."""
        if stream is not None:
            stream.synchronize()
        else:
            self.torch.cuda.synchronize(self.device)

    def prepare_units(self, units: Any, stream: Any = None) -> Any:
        with _StreamScope(self.torch, self.device, stream) as s:
            return self._index.units(units, s)

    def prepare_bases(self, bases: Any, stream: Any = None) -> np.ndarray:
        return _as_bases(bases)

    def bind(self, stream: Any) -> None:
        pass

    def _copy(
        self, gather: bool, bases: Any, units: Any, unit_len: int, stride: int, offset: int,
        stage: int, stream: Any,
    ) -> None:
        torch = self.torch
        unit_len, stride, offset, stage = int(unit_len), int(stride), int(offset), int(stage)
        _check_geometry(unit_len, stride, offset, stage)
        b = _as_bases(bases)
        if isinstance(units, torch.Tensor):
            n = int(units.shape[0])
            rows = int(units.max()) + 1 if n else 0  # syncs; the fallback may
        else:
            units = _as_units(units)
            n = len(units)
            rows = int(units.max()) + 1 if n else 0
        if n == 0 or len(b) == 0:
            return
        with _StreamScope(torch, self.device, stream) as s:
            idx = self._index.units(units, s)
            if idx.dtype != torch.int64:
                idx = idx.long()
            staged_all = device_view(torch, self.device, stage, (len(b), n, unit_len))
            for i, base in enumerate(b.tolist()):
                region = device_view(torch, self.device, base + offset, (rows, unit_len), (stride, 1))
                if gather:
                    torch.index_select(region, 0, idx, out=staged_all[i])
                else:
                    region.index_copy_(0, idx, staged_all[i])


# -- choice --------------------------------------------------------------------------------


def make_copier(mem_kind: str, device: int = 0, prefer: str = "auto") -> Copier:
    """The copier for memory of ``mem_kind`` ("DRAM" or "VRAM") on CUDA ``device``.

    ``prefer``: "auto" (DRAM: numpy; VRAM: Triton, else torch), or one of "triton",
    "torch", "numpy" to insist. Raises ``CopierUnavailable`` naming what is missing and
    ``ValueError`` for a combination that makes no sense (numpy on VRAM, a GPU copier on
    DRAM).
    """
    if prefer not in PREFERENCES:
        raise ValueError(f"unknown copier preference {prefer!r}; expected one of {PREFERENCES}")
    if mem_kind == "DRAM":
        if prefer in ("triton", "torch"):
            raise ValueError(f"the {prefer} copier is for VRAM; DRAM uses the numpy copier")
        return NumpyCopier()
    if mem_kind != "VRAM":
        raise ValueError(f"unknown memory kind {mem_kind!r}; expected DRAM or VRAM")
    if prefer == "numpy":
        raise ValueError("the numpy copier cannot reach VRAM; use triton or torch")
    if prefer == "torch":
        return TorchCopier(device)
    if prefer == "triton":
        return TritonCopier(device)
    _require_torch_cuda(device)  # a missing GPU is the error to report, not a missing triton
    try:
        copier = TritonCopier(device)
        copier.warmup(AUTO_CHECK_UNIT)  # a Triton that cannot compile or launch shows here
        return copier
    except Exception as exc:
        logger.warning("sgl-nixl: Triton copier unavailable (%s); using the torch copier", exc)
        return TorchCopier(device)
