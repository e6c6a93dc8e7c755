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
every process); the VRAM copiers import them when built. The implementations are split by
memory: ``copy_common`` (checks, alignment), ``copy_numpy``, ``copy_device`` (GPU-side
indices and bases), ``copy_triton`` (over ``copy_triton_kernels`` and
``copy_triton_fast_launch``), ``copy_torch``; this module chooses among them.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np

# The implementations live in copy_common / copy_numpy / copy_device / copy_triton (over
# copy_triton_kernels and copy_triton_fast_launch) / copy_torch; this module is the entry
# point and re-exports what callers and tests use.
from sgl_nixl_plugin.engine.copy_common import (  # noqa: F401  (re-exported)
    CopierUnavailable,
    _alignment,
    _require_torch_cuda,
)
from sgl_nixl_plugin.engine.copy_device import (  # noqa: F401  (re-exported)
    DeviceBases,
    _aligned_units,
    _StreamScope,
)
from sgl_nixl_plugin.engine.copy_numpy import NumpyCopier, host_view  # noqa: F401
from sgl_nixl_plugin.engine.copy_torch import TorchCopier  # noqa: F401
from sgl_nixl_plugin.engine.copy_triton import TritonCopier  # noqa: F401  (re-exported)
from sgl_nixl_plugin.engine.copy_triton_kernels import (  # noqa: F401  (re-exported)
    MAX_BLOCK_WORDS,
    NUM_WARPS,
    TILE_BYTES,
    launch_unit_copy,
    tile_shape,
)

logger = logging.getLogger(__name__)

PREFERENCES = ("auto", "triton", "torch", "numpy")
AUTO_CHECK_UNIT = 2048  # make_copier("VRAM") compiles and checks this unit size up front


class Copier(Protocol):
    mem_kind: str  # "DRAM" | "VRAM"

    def gather(
        self,
        bases: np.ndarray,
        units: np.ndarray,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any = None,
    ) -> None: ...

    def scatter(
        self,
        bases: np.ndarray,
        units: np.ndarray,
        unit_len: int,
        stride: int,
        offset: int,
        stage: int,
        stream: Any = None,
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
