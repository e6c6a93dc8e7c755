"""One-pass transfers: the prefill's GPU writes a request's KV rows straight into the
decode's pages through a CUDA-IPC mapping of the decode's pool.

Between GPUs that can map each other's memory (two processes on one GPU, or NVLink peers
of one host) the staged path's three passes (gather, WRITE, scatter) and its slot protocol
are not needed: one Triton launch per chunk reads the local pages and writes each unit
(page, token row or head slice, by the link's geometry) into the mapped destination pages.
A launch returns a ``KernelXfer``, polled and released like a NIXL transfer, so the worker's
accounting (outstanding transfers, abort ACKs, Success only after every byte landed) is the
one the other paths use.

Safety: ``OnePassLink`` launches under its lock and refuses once closed; ``close`` waits
for the last launch on the mapping before unmapping it, so no kernel writes through a
mapping that is gone, and a lost decode's memory is unmapped before it can be reused.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.agent import TransferError, Xfer
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.staging import staging_unit_len, unit_indices_of

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class KernelXfer(Xfer):
    """A launched one-pass copy: DONE once the event recorded after it has completed."""

    event: Any = None

    def poll(self) -> str:
        if self.state == "PROC":
            try:
                if self.event.query():
                    self.state = "DONE"
            except Exception as exc:  # a fault in the kernel: the CUDA context says why
                self.state, self.error = "ERR", f"one-pass copy to {self.peer} failed: {exc}"
        return self.state


class OnePassLink:
    """A decode's KV pool mapped into this process, and how our KV maps onto it."""

    def __init__(
        self,
        mapping: Any,
        peer: str,
        local: RegionSet,
        dst_ptrs: np.ndarray,
        geometry: Geometry,
        same_device: bool,
    ) -> None:
        unit_len = staging_unit_len(local, geometry)
        if unit_len is None:
            raise ValueError("the KV regions differ in item size: no one-pass copy")
        if len(dst_ptrs) != len(local):
            raise ValueError(f"{len(dst_ptrs)} destination regions for {len(local)} local ones")
        self.mapping = mapping
        self.peer = peer
        self.geometry = geometry
        self.unit_len = unit_len
        self.same_device = same_device
        self.src_ptrs = np.asarray(local.ptrs, dtype=np.uint64)
        self.dst_ptrs = np.asarray(dst_ptrs, dtype=np.uint64)
        self._lock = threading.Lock()
        self._closed = False
        self._last: Any = None  # the event after the latest launch
        self.flags: Any = None  # the decode's flag board, mapped (``done_flags.FlagWriter``)

    @property
    def closed(self) -> bool:
        return self._closed

    def write(self, copier: Any, src: np.ndarray, dst: np.ndarray, stream: Any) -> KernelXfer:
        """Launch the copy of local items ``src`` into the peer's items ``dst`` on
        ``stream`` (the calling thread's bound copy stream); never waits."""
        if len(src) != len(dst):
            raise TransferError(f"kv: {len(src)} source items for {len(dst)} destinations")
        geo = self.geometry
        src_units = unit_indices_of(src, geo)
        n = len(src_units)
        # both sides' indices in one buffer (one copy in, one release): the destination's
        # part starts 16-byte aligned, as the kernel was compiled for
        pad = -(-n // 4) * 4
        both = np.zeros(pad + n, dtype=np.int64)
        both[:n] = src_units
        both[pad:] = unit_indices_of(dst, geo)
        stride = self.unit_len
        import torch

        with self._lock:
            if self._closed:
                raise TransferError(f"decode {self.peer}: its mapped KV pool was released")
            units = copier.prepare_units(both, stream)
            copier.pair_copy(
                copier.prepare_bases(self.src_ptrs, stream),
                copier.prepare_bases(self.dst_ptrs, stream),
                units[:n],
                units[pad:],
                self.unit_len,
                geo.src_stride or stride,
                geo.src_offset,
                geo.dst_stride or stride,
                geo.dst_offset,
                stream,
            )
            event = torch.cuda.Event()
            event.record(stream)
            release = getattr(copier, "release_units", None)
            if release is not None:  # reused once the copy that reads it has run
                release(units, stream, event)
            self._last = event
        nbytes = n * self.unit_len * len(self.src_ptrs)
        return KernelXfer(handle=event, peer=self.peer, nbytes=nbytes, descriptors=0, event=event)

    def signal(self, slot: int, value: int, stream: Any) -> KernelXfer:
        """Store a room's completion flag on ``stream``, after the copies queued there;
        DONE once stored. Refused once closed, like a launch."""
        import torch

        with self._lock:
            if self._closed or self.flags is None:
                raise TransferError(f"decode {self.peer}: its flag board was released")
            self.flags.write(slot, value, stream)
            event = torch.cuda.Event()
            event.record(stream)
            self._last = event
        return KernelXfer(handle=event, peer=self.peer, nbytes=0, descriptors=0, event=event)

    def close(self, timeout_s: float = 10.0) -> None:
        """No launch after this; unmap once the last launch finished (bounded wait: a
        kernel runs for milliseconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            last, self._last = self._last, None
        deadline = time.monotonic() + timeout_s
        try:
            while last is not None and not last.query():
                if time.monotonic() > deadline:
                    logger.error(
                        "sgl-nixl: a one-pass copy to %s still runs after %.0fs; its "
                        "mapping is kept",
                        self.peer,
                        timeout_s,
                    )
                    return
                time.sleep(0.0005)
        except Exception as exc:
            logger.error("sgl-nixl: the last one-pass copy to %s failed: %s", self.peer, exc)
        if self.flags is not None:
            self.flags.close()
        self.mapping.close()


def open_link(
    export: Any,
    *,
    peer: str,
    local: RegionSet,
    remote_ptrs: tuple[int, ...],
    geometry: Geometry,
    device: int,
    local_uuid: str,
) -> OnePassLink:
    """Map ``export`` (the decode's ``CudaIpc``) and translate its KV region addresses.
    Raises ``ValueError`` with the reason when this process cannot use it."""
    from sgl_nixl_plugin.engine import cuda_ipc

    mine = cuda_ipc.IpcExport(
        host=export.host,
        device_uuid=export.device_uuid,
        pid=export.pid,
        blocks=tuple(cuda_ipc.IpcBlock(b.handle, b.base, b.size) for b in export.blocks),
    )
    why = cuda_ipc.why_not(mine, device)
    if why is not None:
        raise ValueError(why)
    try:
        mapping = cuda_ipc.open_export(mine, device)
    except cuda_ipc.IpcError as exc:
        raise ValueError(str(exc)) from exc
    try:
        dst = mapping.translate(np.asarray(remote_ptrs[: len(local)], dtype=np.uint64))
        return OnePassLink(
            mapping,
            peer,
            local,
            dst,
            geometry,
            same_device=bool(local_uuid) and local_uuid == export.device_uuid,
        )
    except Exception as exc:
        mapping.close()
        raise ValueError(str(exc)) from exc
