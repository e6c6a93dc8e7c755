"""Which memory a pointer is in, as NIXL must be told when the buffer is registered.

SGLang's labels are not reliable for this (its decode labels the KV pool VRAM even when the
server runs on a CPU), so both sides ask the pointer itself: no CUDA in this process means
host memory; otherwise the CUDA driver says (through ``cuda.bindings`` where installed).
"""

from __future__ import annotations

import functools
from typing import Any

#: cuPointerGetAttribute's memory-type attribute and the answers that mean device memory
_MEMORY_TYPE_ATTR = 2  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
_DEVICE_TYPES = (2, 4)  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED


@functools.cache
def _cuda_present() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@functools.cache
def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python before 12.6
        except ImportError:
            return None
    return driver


def pointer_kind(ptr: int) -> str | None:
    """The kind of ``ptr``: "VRAM" or "DRAM"; None when this process cannot tell (CUDA without a
    driver binding installed), so the caller falls back to what SGLang says."""
    if not _cuda_present():
        return "DRAM"
    driver = _driver()
    if driver is None:
        return None
    try:
        err, value = driver.cuPointerGetAttribute(
            driver.CUpointer_attribute(_MEMORY_TYPE_ATTR), ptr
        )
        if err == driver.CUresult.CUDA_SUCCESS:
            return "VRAM" if int(value) in _DEVICE_TYPES else "DRAM"
        unseen = (
            driver.CUresult.CUDA_ERROR_INVALID_VALUE,
            driver.CUresult.CUDA_ERROR_NOT_INITIALIZED,
        )
    except Exception:  # a binding of another shape: let SGLang's label decide
        return None
    return "DRAM" if err in unseen else None  # memory CUDA has never seen is plain host memory
