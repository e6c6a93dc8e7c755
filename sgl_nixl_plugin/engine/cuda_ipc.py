"""CUDA IPC mappings of a peer's device memory, for the one-pass copy.

When a prefill and a decode run on one GPU, or on two GPUs that can map each other's
memory (NVLink peers), the prefill can write a request's KV straight into the decode's
pages with one kernel instead of gather -> WRITE -> scatter. For that the decode exports
the allocations holding its KV pool (``export_ranges``), the prefill checks it may open
them (``why_not``) and maps them (``open_export``), then translates the decode's page
addresses into its own mapping (``IpcMapping.translate``).

The exporter must keep the exported memory allocated while a peer has it open (a KV pool
lives as long as the process). Memory the legacy IPC API cannot export (torch's
expandable segments, VMM allocations) raises ``IpcError``: the caller then offers no IPC
and the staged/direct path carries the request.

Importing this module imports neither torch nor ``cuda.bindings`` (both are imported by
the functions that need them), so it loads in every process, GPU or not.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)

_OPEN_LOCK = threading.Lock()
_OPEN_BLOCKS = 0


class IpcError(RuntimeError):
    """A CUDA IPC step failed; the message says which. The transfer is not lost: the
    caller falls back to the staged/direct path."""

    def __init__(self, what: str) -> None:
        super().__init__(f"CUDA IPC: {what}; the staged/direct path is used instead")


@dataclass(frozen=True)
class IpcBlock:
    """One exported allocation."""

    handle: bytes  # the 64-byte cudaIpcMemHandle_t
    base: int  # the allocation's base address in the exporter
    size: int  # bytes


@dataclass(frozen=True)
class IpcExport:
    """What a peer needs to map our memory (picklable; plain fields for the wire)."""

    host: str  # host_identity() of the exporter
    device_uuid: str  # the exporter's GPU, as StagingBuffer.device_uuid
    pid: int  # the exporter's process id
    blocks: tuple[IpcBlock, ...]


# -- where we are -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """``boot id/pid namespace``: CUDA IPC needs the same kernel (the boot id); the
    namespace tells two processes of one pid in two containers apart (``why_not`` tries
    containers of one host: an open that fails falls back like any refusal)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            ident = f.read().strip()
    except OSError:
        ident = ""
    ident = ident or socket.gethostname()
    try:
        ident += "/" + os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return ident


def available() -> bool:
    """Whether CUDA IPC can be tried here: torch sees a GPU and ``cuda.bindings`` imports.
    Never raises."""
    try:
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            return False
        from cuda.bindings import driver, runtime  # noqa: F401
    except Exception:
        return False
    return True


# -- CUDA calls ----------------------------------------------------------------------------


def _cudart() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        raise IpcError(f"cuda.bindings (cuda-python) is not importable ({exc})") from exc
    return runtime


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise IpcError(f"cuda.bindings (cuda-python) is not importable ({exc})") from exc
    return driver


def _call(what: str, fn: Any, *args: Any) -> tuple[Any, ...]:
    """``fn(*args)`` of cuda.bindings, its error code checked: the values after it, or
    IpcError naming the call and the error (also when the driver library is missing)."""
    try:
        result = fn(*args)
    except Exception as exc:
        raise IpcError(f"{what} failed ({type(exc).__name__}: {exc})") from exc
    err = result[0]
    if int(getattr(err, "value", err)) != 0:
        raise IpcError(f"{what} failed: {getattr(err, 'name', err)}")
    return tuple(result[1:])


class _OnDevice:
    """Make ``device`` current for a few runtime calls, restore the previous one after."""

    def __init__(self, device: int) -> None:
        self.device = device

    def __enter__(self) -> Any:
        rt = _cudart()
        (self._prev,) = _call("cudaGetDevice", rt.cudaGetDevice)
        if self._prev != self.device:
            _call(f"cudaSetDevice({self.device})", rt.cudaSetDevice, self.device)
        return rt

    def __exit__(self, *exc: Any) -> None:
        if self._prev != self.device:
            _cudart().cudaSetDevice(self._prev)


def _handle_bytes(handle: Any) -> bytes:
    return ctypes.string_at(handle.getPtr(), HANDLE_BYTES)


def _handle_of(data: bytes) -> Any:
    if len(data) != HANDLE_BYTES:
        raise IpcError(f"an IPC handle has {len(data)} bytes, not {HANDLE_BYTES}")
    handle = _cudart().cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), data, HANDLE_BYTES)
    return handle


def _device_uuid(device: int) -> str:
    import torch

    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))[:64]


def _device_index(uuid: str) -> int | None:
    """The torch device index of the GPU with this uuid, if this process sees it."""
    import torch

    for d in range(torch.cuda.device_count()):
        if _device_uuid(d) == uuid:
            return d
    return None


# -- export ----------------------------------------------------------------------------------


def _allocation_of(ptr: int) -> tuple[int, int]:
    drv = _driver()
    base, size = _call(f"cuMemGetAddressRange({ptr:#x})", drv.cuMemGetAddressRange, ptr)
    return int(base), int(size)


def _check_within(ptr: int, length: int, base: int, size: int) -> None:
    if ptr + length > base + size:
        raise IpcError(
            f"range [{ptr:#x}, +{length}) runs past the end of its allocation [{base:#x}, +{size})"
        )


def export_ranges(ranges: Sequence[tuple[int, int]], device: int) -> IpcExport:
    """Handles for the allocations holding every ``[ptr, ptr + length)`` on ``device``,
    one block per allocation. IpcError when a range leaves its allocation or the memory
    cannot be exported (expandable segments, VMM): then offer no IPC."""
    blocks: dict[int, IpcBlock] = {}
    with _OnDevice(device) as rt:
        for ptr, length in ranges:
            ptr, length = int(ptr), int(length)
            if length < 0:
                raise ValueError(f"range at {ptr:#x} has negative length {length}")
            hit = next((b for b in blocks.values() if b.base <= ptr < b.base + b.size), None)
            if hit is None:
                base, size = _allocation_of(ptr)
                _check_within(ptr, length, base, size)
                (handle,) = _call(
                    f"cudaIpcGetMemHandle of the allocation at {base:#x} ({size} bytes; "
                    "expandable segments and VMM memory cannot be exported)",
                    rt.cudaIpcGetMemHandle,
                    base,
                )
                hit = blocks[base] = IpcBlock(_handle_bytes(handle), base, size)
            _check_within(ptr, length, hit.base, hit.size)
    return IpcExport(host_identity(), _device_uuid(device), os.getpid(), tuple(blocks.values()))


def why_not(export: IpcExport, local_device: int) -> str | None:
    """None when this process may open ``export`` on ``local_device``, else why not.
    Host and pid are compared before anything touches CUDA."""
    theirs_boot, _, theirs_ns = export.host.partition("/")
    mine_boot, _, mine_ns = host_identity().partition("/")
    if theirs_boot != mine_boot:
        return "another host"
    if export.pid == os.getpid() and theirs_ns == mine_ns:
        return "same process (CUDA IPC refuses one's own handles)"
    if not export.blocks:
        return "nothing exported"
    if not available():
        return "no CUDA device or no cuda.bindings here"
    try:
        theirs = _device_index(export.device_uuid)
        if theirs is None:
            return f"GPU {export.device_uuid or '(no uuid)'} not visible here"
        if theirs == local_device:
            return None
        (can,) = _call(
            "cudaDeviceCanAccessPeer", _cudart().cudaDeviceCanAccessPeer, local_device, theirs
        )
    except Exception as exc:  # a check must not raise: no IPC, and why
        return f"peer check failed ({exc})"
    return None if can else f"no peer access from GPU {local_device} to GPU {theirs}"


# -- mapping -----------------------------------------------------------------------------------


def _translate(
    remote_bases: np.ndarray, sizes: np.ndarray, local_bases: np.ndarray, ptrs: Any
) -> np.ndarray:
    """Exporter addresses -> ours: ``local_bases[i] + (p - remote_bases[i])`` for the block
    ``i`` holding ``p`` (the bases sorted ascending, all uint64). IpcError outside them."""
    p = np.asarray(ptrs, dtype=np.uint64)
    flat = p.reshape(-1)  # 1-D: wrapped differences below stay silent
    if not remote_bases.size:
        if flat.size:
            raise IpcError("no blocks to translate addresses into")
        return p.copy()
    i = np.searchsorted(remote_bases, flat, side="right").astype(np.int64) - 1
    inside = i >= 0
    i = np.maximum(i, 0)
    delta = flat - remote_bases[i]  # wraps where i was -1: those are outside anyway
    inside &= delta < sizes[i]
    if not inside.all():
        bad = int(flat[np.flatnonzero(~inside)[0]])
        raise IpcError(f"address {bad:#x} lies outside every exported block")
    return (local_bases[i] + delta).reshape(p.shape)


class IpcMapping:
    """One peer's blocks opened in this process (on ``device``)."""

    def __init__(self, export: IpcExport, device: int, opened: Sequence[int]) -> None:
        self.export, self.device = export, device
        order = np.argsort([b.base for b in export.blocks], kind="stable")
        self._remote = np.array([export.blocks[k].base for k in order], dtype=np.uint64)
        self._sizes = np.array([export.blocks[k].size for k in order], dtype=np.uint64)
        self._local = np.array([opened[k] for k in order], dtype=np.uint64)
        self._opened = list(opened)
        self._closed = False
        self._lock = threading.Lock()
        _count_open(len(self._opened))

    @property
    def closed(self) -> bool:
        return self._closed

    def translate(self, ptrs: Sequence[int] | np.ndarray) -> np.ndarray:
        """The exporter's addresses as this process reaches them (uint64, same shape)."""
        if self.closed:
            raise IpcError("the mapping is closed")
        return _translate(self._remote, self._sizes, self._local, ptrs)

    def close(self) -> None:
        """Unmap every block (idempotent). Wait for the kernels using it first."""
        with self._lock:
            opened, self._opened, self._closed = self._opened, [], True
        if opened:
            try:
                _close_blocks(opened, self.device)
            finally:
                _count_open(-len(opened))

    def __enter__(self) -> IpcMapping:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _count_open(delta: int) -> None:
    global _OPEN_BLOCKS
    with _OPEN_LOCK:
        _OPEN_BLOCKS += delta


def _close_blocks(ptrs: Sequence[int], device: int) -> None:
    """cudaIpcCloseMemHandle each; a failure is logged (nothing else can be done)."""
    try:
        with _OnDevice(device) as rt:
            for ptr in ptrs:
                try:
                    _call("cudaIpcCloseMemHandle", rt.cudaIpcCloseMemHandle, ptr)
                except IpcError as exc:
                    logger.warning("sgl-nixl: %s", exc)
    except IpcError as exc:
        logger.warning("sgl-nixl: closing %d IPC blocks: %s", len(ptrs), exc)


def open_export(export: IpcExport, local_device: int) -> IpcMapping:
    """Map every block of ``export`` on ``local_device`` (peer access enabled lazily).
    All or nothing: on a failure the blocks opened so far are closed and IpcError raised."""
    reason = why_not(export, local_device)
    if reason is not None:
        raise IpcError(f"cannot open the peer's memory: {reason}")
    opened: list[int] = []
    try:
        with _OnDevice(local_device) as rt:
            for b in export.blocks:
                (ptr,) = _call(
                    f"cudaIpcOpenMemHandle of the block at {b.base:#x} ({b.size} bytes) on GPU "
                    f"{local_device}",
                    rt.cudaIpcOpenMemHandle,
                    _handle_of(b.handle),
                    rt.cudaIpcMemLazyEnablePeerAccess,
                )
                opened.append(int(ptr))
    except BaseException:
        if opened:
            _close_blocks(opened, local_device)
        raise
    return IpcMapping(export, local_device, opened)


def open_mappings() -> int:
    """How many blocks open ``IpcMapping``s of this process hold (tests check that it
    returns to 0)."""
    with _OPEN_LOCK:
        return _OPEN_BLOCKS
