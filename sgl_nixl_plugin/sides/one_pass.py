"""One-pass transfers through CUDA IPC, both halves: the decode offers its KV pool in its
registration; a prefill whose GPU can map it maps it and writes pages with one kernel
(``engine.one_pass``). Anything that rules it out leaves the other paths as they were."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.done_flags import FlagBoard, FlagError, FlagWriter
from sgl_nixl_plugin.engine.engine import Memory, PeerLink
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.wire.messages import CudaIpc, IpcBlock, PeerRegistration

logger = logging.getLogger(__name__)


def allowed(settings: Settings) -> bool:
    """Whether the settings leave one-pass transfers on (``direct``/``staging`` forbid)."""
    return settings.cuda_ipc and settings.transfer_path in ("auto", "ipc")


def offer(settings: Settings, memory: Memory, gpu: int) -> tuple[CudaIpc | None, Any]:
    """The decode's KV pool exported for CUDA IPC, or None (host memory, turned off, or
    not exportable: e.g. allocations of CUDA's virtual memory API); with it, the flag
    board its one-pass rooms end through (a ``FlagBoard``, or None)."""
    if not allowed(settings) or memory.kv.mem_kind != "VRAM" or not len(memory.kv):
        return None, None
    from sgl_nixl_plugin.engine import cuda_ipc

    if not cuda_ipc.available():
        return None, None
    try:
        export = cuda_ipc.export_ranges(list(zip(memory.kv.ptrs, memory.kv.lens, strict=True)), gpu)
    except cuda_ipc.IpcError as exc:
        logger.info("sgl-nixl: KV pool not offered for one-pass transfers: %s", exc)
        return None, None
    board = None
    if settings.done_flags:
        try:
            board = FlagBoard()
        except FlagError as exc:
            logger.info("sgl-nixl: no completion flags for one-pass rooms: %s", exc)
    offer = CudaIpc(
        host=export.host,
        device_uuid=export.device_uuid,
        pid=export.pid,
        blocks=[IpcBlock(b.handle, b.base, b.size) for b in export.blocks],
        flag_board=board.path if board is not None else "",
        flag_slots=board.slots if board is not None else 0,
    )
    return offer, board


def attach(
    *,
    settings: Settings,
    link: PeerLink,
    reg: PeerRegistration,
    remote: Memory,
    copier: Any,
    stream: Any,
    gpu: int,
    local_uuid: str,
) -> str:
    """Map a registering decode's KV pool onto ``link`` when this prefill can use it; what
    to add to the "connected" log line ("" when the decode offered nothing)."""
    g = link.groups.get("kv")
    if reg.ipc is None or g is None or g.local_regions is None or not allowed(settings):
        return ""
    if g.local_regions.mem_kind != "VRAM" or not hasattr(copier, "pair_copy"):
        return ", one-pass off (needs the Triton copier on GPU memory)"
    from sgl_nixl_plugin.engine.one_pass import open_link

    t0 = time.monotonic()
    try:
        link.one_pass = open_link(
            reg.ipc,
            peer=link.name,
            local=g.local_regions,
            remote_ptrs=remote.kv.ptrs,
            geometry=g.geometry,
            device=gpu,
            local_uuid=local_uuid,
        )
    except ValueError as exc:
        return f", one-pass off ({exc})"
    op, map_ms = link.one_pass, (time.monotonic() - t0) * 1e3
    try:
        ms = _warm(op, copier, stream, settings.warmup_timeout_s)
    except Exception as exc:  # the mapping or the kernel does not work here: not offered
        link.one_pass = None
        op.close()
        logger.warning("sgl-nixl: decode %s: one-pass warm-up failed: %s", reg.agent_name, exc)
        return f", one-pass off (warm-up failed: {exc})"
    where = "this GPU" if op.same_device else "a peer GPU"
    t1 = time.monotonic()
    flags = _open_flags(settings, reg.ipc, gpu)
    op.flags = flags if isinstance(flags, FlagWriter) else None
    note = ", completion flags" if op.flags is not None else f", no completion flags ({flags})"
    note += f" in {(time.monotonic() - t1) * 1e3:.1f} ms"
    return (
        f", one-pass writes into its pool on {where} (CUDA IPC mapped in {map_ms:.1f} ms, "
        f"warm-up {ms:.1f} ms{note})"
    )


def warm_kernel(settings: Settings, copier: Any, unit_len: int) -> None:
    """Compile (and check) the one-pass copy at start-up for the shape two equal layouts
    pair in (whole pages, no offset): otherwise the first decode's setup pays Triton's
    compile, or its load from Triton's cache, while that decode's first requests wait."""
    warm = getattr(copier, "warmup_pair", None)
    if warm is None or unit_len <= 0 or not allowed(settings):
        return
    started = time.monotonic()
    try:
        warm(unit_len, unit_len, 0, unit_len, 0)
    except Exception as exc:  # each decode's link checks the copy again
        logger.warning("sgl-nixl: one-pass copy not compiled at start-up: %s", exc)
        return
    ms = (time.monotonic() - started) * 1e3
    logger.debug("sgl-nixl: one-pass copy of %d B pages compiled in %.1f ms", unit_len, ms)


def _open_flags(settings: Settings, ipc: CudaIpc, gpu: int) -> FlagWriter | str:
    """The decode's flag board mapped here, or why not (its rooms then end with the
    status message only)."""
    if not settings.done_flags:
        return "SGLANG_NIXL_PLUGIN_DONE_FLAGS=0"
    if not ipc.flag_board:
        return "the decode offers none"
    try:
        return FlagWriter(ipc.flag_board, ipc.flag_slots, gpu)
    except Exception as exc:  # FlagError, or CUDA refusing to register it
        logger.info("sgl-nixl: decode's flag board %s not used: %s", ipc.flag_board, exc)
        return str(exc)


def _warm(op: Any, copier: Any, stream: Any, timeout_s: float) -> float:
    """Compile the kernel for this link's shape (checked on local buffers), then copy our
    padding page into the decode's (item 0 on both sides: SGLang's allocators start at 1)
    through the mapping: the first request pays neither; milliseconds."""
    started = time.monotonic()
    geo = op.geometry
    warm = getattr(copier, "warmup_pair", None)
    if warm is not None:
        warm(
            op.unit_len,
            geo.src_stride or op.unit_len,
            geo.src_offset,
            geo.dst_stride or op.unit_len,
            geo.dst_offset,
        )
    zero = np.zeros(1, dtype=np.int64)
    xfer = op.write(copier, zero, zero, stream)
    deadline = time.monotonic() + max(timeout_s, 1.0)
    while xfer.poll() == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError(f"padding-page copy still running after {timeout_s:.1f}s")
        time.sleep(0.0002)
    if xfer.state != "DONE":
        raise RuntimeError(xfer.error)
    return (time.monotonic() - started) * 1e3
