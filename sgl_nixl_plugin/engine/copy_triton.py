"""The VRAM copier on Triton: one launch per gather/scatter covering every region and unit
of a piece (kernels in ``copy_triton_kernels``), remembered specializations launched through
their compiled launcher (``copy_triton_fast_launch``), and the self-tests that decide which
of those paths a copier may use."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.copy_common import (
    _align_of,
    _as_bases,
    _as_units,
    _check_geometry,
    _require_torch_cuda,
    _require_triton,
)
from sgl_nixl_plugin.engine.copy_device import (
    DeviceBases,
    GpuCopier,
    _aligned_units,
    _DeviceIndex,
    _StreamScope,
)
from sgl_nixl_plugin.engine.copy_triton_fast_launch import _FastLaunch
from sgl_nixl_plugin.engine.copy_triton_kernels import (
    NUM_WARPS,
    TILE_BYTES,
    _triton_kernel,
    launch_pair_copy,
    launch_unit_copy,
)
from sgl_nixl_plugin.engine.mapped_units import MappedPool, MappedUnits

logger = logging.getLogger(__name__)

#: Mapped index buffers pinned up front (count, indices each): one per request in flight
#: at the default concurrency, each as large as an 8k-token request at page size 1 with
#: head slices to spare.
MAPPED_RESERVE = (8, 1 << 16)


class TritonCopier(GpuCopier):
    """GPU memory: one Triton launch per gather/scatter call (all regions, all units)."""

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
        self._fast_pair = _FastLaunch(torch)  # checked apart, by ``warmup_pair``
        self._prepared: dict[tuple[bytes, int], DeviceBases] = {}
        self._map_units = False
        self._mapped_ok: bool | None = None  # the self-test's verdict, once run
        self._mapped = MappedPool(torch)
        self._uploads_warm = False
        self._pairs_checked: set[tuple[int, int, int, int, int]] = set()
        _triton_kernel()

    @property
    def map_units(self) -> bool:
        """Whether ``prepare_units`` hands out indices in pinned host memory that the
        kernel reads in place (for a sender, whose indices arrive with each request)
        instead of uploading them. Turning it on runs a self-test once; if that fails it
        stays off (logged) and copies stay correct."""
        return self._map_units

    @map_units.setter
    def map_units(self, on: bool) -> None:
        if on and self._mapped_ok is None:
            # reserved first, so the self-test reads one of them instead of pinning a
            # buffer of its own beside the reserve (a GPU that fails it keeps them idle)
            self._mapped.reserve(*MAPPED_RESERVE)
            self._mapped_ok = self._check_mapped()
        self._map_units = bool(on) and bool(self._mapped_ok)

    def _check_mapped(self) -> bool:
        torch = self.torch
        try:
            with _StreamScope(torch, self.device, None):
                g = torch.Generator(device="cpu").manual_seed(1)
                region = torch.randint(0, 256, (4 * 64,), dtype=torch.uint8, generator=g)
                region = region.to(self.device)
                stage = torch.zeros(3 * 64, dtype=torch.uint8, device=self.device)
                units = self._mapped.take(np.array([3, 0, 2], dtype=np.int64))
                if units is None:
                    return False
                bases = self.prepare_bases(np.array([region.data_ptr()], dtype=np.uint64))
                self.gather(bases, units, 64, 64, 0, stage.data_ptr())
                self.release_units(units)
                want = torch.cat([region[k * 64 : (k + 1) * 64] for k in (3, 0, 2)])
                ok = bool(torch.equal(stage, want))
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            logger.warning(
                "sgl-nixl: gathers cannot read indices from host memory here (%s); "
                "they are uploaded first",
                exc,
            )
            return False
        if not ok:
            logger.warning(
                "sgl-nixl: reading indices from host memory copied wrong bytes in "
                "the self-test; they are uploaded first"
            )
        return ok

    def prepare_units(self, units: Any, stream: Any = None) -> Any:
        """Unit indices as the kernel reads them: with ``map_units``, in a pinned host
        buffer (no upload; give it back with ``release_units``), else uploaded."""
        if self.map_units and not isinstance(units, (self.torch.Tensor, MappedUnits)):
            mapped = self._mapped.take(_as_units(units))
            if mapped is not None:
                return mapped
        return super().prepare_units(units, stream)

    def release_units(self, units: Any, stream: Any = None, event: Any = None) -> None:
        """Done with ``units`` from ``prepare_units``: a mapped buffer is reused once the
        work queued on ``stream`` so far (the gathers that read it) has run, or once
        ``event`` (recorded after that work) has passed."""
        if isinstance(units, MappedUnits):
            if stream is None and event is None:
                stream = self.torch.cuda.current_stream(self.device)
            self._mapped.give(units, stream, event)

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

    def warmup(self, unit_len: int, stride: int | None = None, offset: int = 0) -> None:
        """Compile (and check) the gather and scatter kernels for this geometry now: the
        first launch of a new shape compiles for a second or so. Raises on a wrong copy."""
        stride = unit_len if stride is None else stride
        torch = self.torch
        if not self._uploads_warm:
            self._uploads_warm = True
            with _StreamScope(torch, self.device, None):
                self._index.warm_uploads()
        g = torch.Generator(device="cpu").manual_seed(0)
        region = torch.randint(0, 256, (offset + 3 * stride,), dtype=torch.uint8, generator=g)
        region = region.to(self.device)
        before = region.clone()
        stage = torch.zeros(2 * unit_len, dtype=torch.uint8, device=self.device)
        bases = np.array([region.data_ptr()], dtype=np.uint64)
        units = np.array([2, 0], dtype=np.int64)
        self.gather(bases, units, unit_len, stride, offset, stage.data_ptr())
        want = torch.cat([before[offset + k * stride :][:unit_len] for k in (2, 0)])
        ok = torch.equal(stage, want)
        region.zero_()
        self.scatter(bases, units, unit_len, stride, offset, stage.data_ptr())
        for k in (2, 0):
            ok = ok and torch.equal(
                region[offset + k * stride :][:unit_len], before[offset + k * stride :][:unit_len]
            )
        self.synchronize()
        if not ok:
            raise RuntimeError(
                f"the Triton copier copied wrong bytes in its self-test (unit_len {unit_len}, "
                f"stride {stride}, offset {offset})"
            )
        self._check_fast(region, before, bases, units, unit_len, stride, offset)

    def _check_fast(
        self,
        region: Any,
        before: Any,
        bases: np.ndarray,
        units: np.ndarray,
        unit_len: int,
        stride: int,
        offset: int,
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
                want = torch.cat([before[offset + k * stride :][:unit_len] for k in (2, 0)])
                ok = True
                for _ in range(2):  # the first call compiles and remembers, the second reuses
                    stage.zero_()
                    self.gather(b, u, unit_len, stride, offset, stage.data_ptr())
                    ok = ok and torch.equal(stage, want)
                    region.zero_()
                    self.scatter(b, u, unit_len, stride, offset, stage.data_ptr())
                    ok = (
                        ok
                        and torch.equal(region, before * (region != 0))
                        and all(
                            torch.equal(
                                region[offset + k * stride :][:unit_len],
                                before[offset + k * stride :][:unit_len],
                            )
                            for k in (2, 0)
                        )
                    )
                torch.cuda.synchronize(self.device)
        except Exception as exc:
            ok = False
            logger.warning("sgl-nixl: the fast Triton launch path failed its self-test: %s", exc)
        if not ok:
            self._fast.enabled = False
            logger.warning("sgl-nixl: fast Triton launches off (self-test); copies stay correct")

    def _copy(
        self,
        gather: bool,
        bases: Any,
        units: Any,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any,
    ) -> None:
        unit_len, stride, offset, stage = int(unit_len), int(stride), int(offset), int(stage)
        _check_geometry(unit_len, stride, offset, stage)
        n = int(units.shape[0]) if hasattr(units, "shape") else len(units)
        if n == 0 or len(bases) == 0:
            return
        mapped = isinstance(units, MappedUnits)
        if (
            isinstance(bases, DeviceBases)
            and self._is_current(stream)
            and (
                mapped
                or (isinstance(units, self.torch.Tensor) and units.is_cuda and units.dim() == 1)
            )
        ):
            # the per-piece path: everything already on the GPU, on the right stream
            align = _align_of(bases.bits, unit_len, stride, offset, stage)
            if align >= 4:
                launch_unit_copy(
                    gather,
                    bases.aligned(),
                    units if mapped else _aligned_units(units),
                    n,
                    unit_len,
                    stride,
                    offset,
                    stage,
                    align,
                    self.tile_bytes,
                    self.num_warps,
                    self._fast,
                )
                return
        if isinstance(bases, DeviceBases):
            bases = bases.tensor.cpu().numpy().view(np.uint64)  # rare: another thread/stream
        if mapped:
            units = np.ctypeslib.as_array(  # its host view: uploaded like any numpy array
                (np.ctypeslib.ctypes.c_int64 * n).from_address(units.data_ptr())
            )
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
                gather,
                bases_t,
                units_t,
                n,
                unit_len,
                stride,
                offset,
                stage,
                align,
                self.tile_bytes,
                self.num_warps,
                self._fast,
            )

    # -- the one-pass copy (source pages -> destination pages, no staging) ---------------

    def pair_copy(
        self,
        src_bases: DeviceBases,
        dst_bases: DeviceBases,
        src_units: Any,
        dst_units: Any,
        unit_len: int,
        src_stride: int,
        src_offset: int,
        dst_stride: int,
        dst_offset: int,
        stream: Any = None,
    ) -> None:
        """Copy unit ``src_units[j]`` of every source region to unit ``dst_units[j]`` of the
        destination region in the same slot, in one launch enqueued on ``stream`` (or the
        current one); never waits. The destination may be a peer's memory mapped by CUDA
        IPC. Bases: ``prepare_bases`` results (or address arrays); units: ``prepare_units``
        results (or int arrays, uploaded)."""
        unit_len, src_stride, src_offset = int(unit_len), int(src_stride), int(src_offset)
        dst_stride, dst_offset = int(dst_stride), int(dst_offset)
        _check_geometry(unit_len, src_stride, src_offset, 1)
        _check_geometry(unit_len, dst_stride, dst_offset, 1)
        n = _count(src_units)
        if _count(dst_units) != n:
            raise ValueError(f"{n} source units but {_count(dst_units)} destination units")
        if len(src_bases) != len(dst_bases):
            raise ValueError(f"{len(src_bases)} source regions but {len(dst_bases)} destinations")
        if n == 0 or len(src_bases) == 0:
            return
        args = (src_bases, dst_bases, src_units, dst_units, n, unit_len)
        geom = (src_stride, src_offset, dst_stride, dst_offset)
        if stream is not None and self._is_current(stream):  # a bound thread: no scope
            self._pair_launch(*args, *geom, stream)
            return
        with _StreamScope(self.torch, self.device, stream) as s:
            self._pair_launch(*args, *geom, s)

    def _pair_launch(
        self,
        src_bases: Any,
        dst_bases: Any,
        src_units: Any,
        dst_units: Any,
        n: int,
        unit_len: int,
        src_stride: int,
        src_offset: int,
        dst_stride: int,
        dst_offset: int,
        stream: Any,
    ) -> None:
        """``pair_copy`` with ``stream`` current: everything on the device, then launch."""
        src_t, src_bits = self._device_bases(src_bases, stream)
        dst_t, dst_bits = self._device_bases(dst_bases, stream)
        bits = src_bits | dst_bits | dst_stride | dst_offset
        align = _align_of(bits, unit_len, src_stride, src_offset, 0)
        if align < 4:
            raise ValueError(
                "the one-pass copy needs unit_len, both strides and offsets and every base "
                f"address to be multiples of 4 (unit_len {unit_len}, src stride {src_stride} "
                f"offset {src_offset}, dst stride {dst_stride} offset {dst_offset}; they "
                f"share only {align})"
            )
        launch_pair_copy(
            src_t,
            dst_t,
            self._device_units(src_units, stream),
            self._device_units(dst_units, stream),
            n,
            unit_len,
            src_stride,
            src_offset,
            dst_stride,
            dst_offset,
            align,
            self.tile_bytes,
            self.num_warps,
            self._fast_pair,
        )

    def _device_bases(self, bases: Any, stream: Any) -> tuple[Any, int]:
        """(int64 tensor the kernel reads, OR of the addresses) for bases of any form."""
        if isinstance(bases, DeviceBases):
            return bases.aligned(), bases.bits
        return self._index.bases(bases, stream)

    def _device_units(self, units: Any, stream: Any) -> Any:
        """Units the kernel can read: mapped host buffers as they are, device tensors at an
        aligned address, anything else uploaded (cached by content)."""
        if isinstance(units, MappedUnits):
            return units
        t = self._index.units(units, stream)
        return _aligned_units(t)

    def warmup_pair(
        self, unit_len: int, src_stride: int, src_offset: int, dst_stride: int, dst_offset: int
    ) -> None:
        """Compile the one-pass kernel for this geometry now (a first launch compiles for
        a second or so, which a request should not pay) and check the bytes it copies, by
        Triton's dispatch and then by the fast launch (which is turned off if it copies
        wrong). Raises RuntimeError on a wrong copy by Triton's dispatch. Once per
        geometry and process: each decode's link checks its own mapping with a copy of its
        own (``sides.one_pass``), so a second decode of the same shape pays neither again."""
        key = (unit_len, src_stride, src_offset, dst_stride, dst_offset)
        if key in self._pairs_checked:
            return
        torch = self.torch
        with _StreamScope(torch, self.device, None):
            g = torch.Generator(device="cpu").manual_seed(2)

            def region(nbytes: int) -> Any:
                r = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
                return r.to(self.device)

            src = [region(src_offset + 3 * src_stride) for _ in range(2)]
            dst = [region(dst_offset + 3 * dst_stride) for _ in range(2)]
            before = [d.clone() for d in dst]
            want = [d.cpu() for d in dst]
            su, du = np.array([2, 0], dtype=np.int64), np.array([1, 2], dtype=np.int64)
            for s, w in zip(src, want, strict=True):
                s_host = s.cpu()
                for a, b in zip(su, du, strict=True):
                    at = dst_offset + int(b) * dst_stride
                    w[at : at + unit_len] = s_host[src_offset + int(a) * src_stride :][:unit_len]
            bases = (
                self.prepare_bases(np.array([t.data_ptr() for t in src], dtype=np.uint64)),
                self.prepare_bases(np.array([t.data_ptr() for t in dst], dtype=np.uint64)),
            )
            verdicts = []
            for _ in range(2):  # the first launch compiles and remembers, the second reuses
                for d, b0 in zip(dst, before, strict=True):
                    d.copy_(b0)
                units = self.prepare_units(su), self.prepare_units(du)  # as a request's
                self.pair_copy(
                    *bases, *units, unit_len, src_stride, src_offset, dst_stride, dst_offset
                )
                for u in units:
                    self.release_units(u)
                verdicts.append(
                    all(torch.equal(d.cpu(), w) for d, w in zip(dst, want, strict=True))
                )
        if verdicts[0]:
            self._pairs_checked.add(key)
        else:
            raise RuntimeError(
                f"the one-pass Triton copy wrote wrong bytes in its self-test (unit_len "
                f"{unit_len}, src stride {src_stride} offset {src_offset}, dst stride "
                f"{dst_stride} offset {dst_offset})"
            )
        if not verdicts[1] and self._fast_pair.enabled:
            self._fast_pair.enabled = False
            logger.warning(
                "sgl-nixl: fast launches of the one-pass copy off (self-test); copies stay correct"
            )


def _count(units: Any) -> int:
    return int(units.shape[0]) if hasattr(units, "shape") else len(units)
