"""What every copier shares: argument checks, address alignment, and the errors that say
which of torch, CUDA or Triton is missing."""

from __future__ import annotations

from typing import Any

import numpy as np


class CopierUnavailable(RuntimeError):
    """The requested copier cannot run here (missing torch, CUDA or triton)."""


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
        raise CopierUnavailable(
            f"the Triton copier needs triton, which is not importable ({exc})"
        ) from exc
    return triton
