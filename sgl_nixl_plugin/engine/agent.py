"""One NIXL agent per process: creation, memory registration, peers, prepared lists, WRITEs.

Every handle this wrapper hands out is counted in ``live`` and released by ``close``, so
tests can prove that nothing leaks. NIXL is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sgl_nixl_plugin.engine import ucx_prewarm
from sgl_nixl_plugin.engine.layout import RegionSet

logger = logging.getLogger(__name__)

#: Notifications ``progress`` keeps per peer until ``notifications`` reads them.
MAX_KEPT_NOTIFS = 4096
#: Backends whose plugin accepts a ``num_threads`` init parameter.
_THREADED_BACKENDS = ("UCX", "LIBFABRIC", "OBJ")


class AgentSettings(Protocol):
    """How to create the agent: what the engine reads of the registry's ``AgentConfig``.

    A protocol, so the engine stays below the registry (deployers' hooks edit the
    registry's dataclass; the engine only reads these four fields).
    """

    @property
    def backend(self) -> str: ...

    @property
    def backend_params(self) -> Mapping[str, str]: ...

    @property
    def num_threads(self) -> int: ...

    @property
    def capture_telemetry(self) -> bool: ...


class TransferError(RuntimeError):
    """A NIXL call failed; the message carries NIXL's own error text."""


@dataclass
class Xfer:
    """A posted WRITE: what it carries, to whom, and since when."""

    handle: Any
    peer: str
    nbytes: int
    descriptors: int
    started: float = field(default_factory=time.perf_counter)
    state: str = "PROC"
    error: str = ""
    kind: str = "xfer"  # its ``live`` count: a request's WRITE, or WARMUP (see there)


#: The ``live`` count of warm-up WRITEs (``write(..., warmup=True)``). A peer's setup posts
#: them in the background, each bounded by its own timeout; counted apart from requests'
#: WRITEs so that ``live["xfer"]`` reads zero once every request settled, whatever setup
#: is still doing.
WARMUP = "warmup_xfer"


class Agent:
    """A NIXL agent with one backend, and an inventory of everything it created."""

    def __init__(
        self,
        config: AgentSettings,
        name: str | None = None,
        progress_thread: bool = False,
        prewarm: bool = False,
    ) -> None:
        """``progress_thread``: NIXL's own progress thread polls without pause (a full core
        per process, idle or not), so by default we progress the agent ourselves, only
        while transfers are pending (see ``progress``). ``prewarm``: have UCX select its
        protocols for same-host peers now, not at the first peer's set-up
        (``ucx_prewarm``)."""
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = name or f"sgl-nixl-{uuid.uuid4().hex[:16]}"
        self.config = config
        conf = nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=[],
            capture_telemetry=config.capture_telemetry,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._nixl = nixl_agent(self.name, conf)
        params = {str(k): str(v) for k, v in config.backend_params.items()}
        if config.num_threads > 0 and config.backend in _THREADED_BACKENDS:
            params.setdefault("num_threads", str(config.num_threads))
        try:
            self._nixl.create_backend(config.backend, params)
        except Exception as exc:
            raise TransferError(
                f"NIXL could not create its {config.backend} backend with {params}: {exc}. "
                "Check SGLANG_DISAGGREGATION_NIXL_BACKEND(_PARAMS) and run "
                "`sgl-nixl-plugin doctor`."
            ) from exc
        self.backend = config.backend
        #: the start-up protocol selection's outcome, when it ran
        self.prewarmed: ucx_prewarm.Prewarm | None = None
        if prewarm and config.backend == "UCX":
            done = self.prewarmed = ucx_prewarm.prewarm(self._nixl, config.backend)
            if done.ok:
                logger.debug("sgl-nixl: UCX protocols selected at start-up in %.1f ms", done.ms)
            else:
                logger.info(
                    "sgl-nixl: UCX protocols not selected at start-up (%s): the first peer "
                    "pays the selection",
                    done.error,
                )
        self.live: Counter[str] = Counter()
        self._regs: list[Any] = []
        self._dlists: set[Any] = set()
        self._xfers: set[Any] = set()
        self._peers: set[str] = set()
        self._pending_notifs: dict[str, list[bytes]] = {}
        self._notifs_lock = threading.Lock()  # the listener's progress, the scheduler's poll
        self._zombies: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- memory ---------------------------------------------------------------------
    def mem_types(self) -> list[str]:
        return list(self._nixl.get_backend_mem_types(self.backend))

    def register(self, regions: RegionSet) -> None:
        if not len(regions):
            return
        descs = self._nixl.register_memory(regions.reg_array(), regions.mem_kind)
        with self._lock:
            self._regs.append(descs)
            self.live["registration"] += 1

    @property
    def metadata(self) -> bytes:
        return bytes(self._nixl.get_agent_metadata())

    # -- peers ------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self._nixl.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError(f"NIXL rejected the peer's agent metadata: {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else str(name)
        with self._lock:
            if name not in self._peers:
                self._peers.add(name)
                self.live["peer"] += 1
        return name

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if name not in self._peers:
                return
            self._peers.discard(name)
            self.live["peer"] -= 1
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as exc:  # already gone on NIXL's side: nothing left to free
            logger.debug("sgl-nixl: removing peer %s: %s", name, exc)

    # -- prepared descriptor lists ----------------------------------------------------
    def prep(self, peer: str | None, rows: np.ndarray, mem_kind: str) -> Any:
        """Prepare a strided (Nx5) list, local when ``peer`` is None."""
        handle = self._nixl.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", rows, mem_kind)
        with self._lock:
            self._dlists.add(handle)
            self.live["dlist"] += 1
        return handle

    def release_dlist(self, handle: Any) -> None:
        with self._lock:
            if handle not in self._dlists:
                return
            self._dlists.discard(handle)
            self.live["dlist"] -= 1
        self._nixl.release_dlist_handle(handle)

    # -- transfers --------------------------------------------------------------------
    def write(
        self,
        local: Any,
        local_idx: np.ndarray,
        remote: Any,
        remote_idx: np.ndarray,
        *,
        peer: str,
        nbytes: int,
        descriptors: int,
        notif: bytes = b"",
        warmup: bool = False,
    ) -> Xfer:
        """Create and post one WRITE; raises ``TransferError`` with NIXL's reason."""
        try:
            handle = self._nixl.make_prepped_xfer(
                "WRITE", local, local_idx, remote, remote_idx, notif
            )
        except Exception as exc:
            raise TransferError(f"NIXL could not build the WRITE to {peer}: {exc}") from exc
        xfer = Xfer(handle, peer, nbytes, descriptors, kind=WARMUP if warmup else "xfer")
        with self._lock:
            self._xfers.add(handle)
            self.live[xfer.kind] += 1
        try:
            state = self._nixl.transfer(handle)
        except Exception as exc:
            state, xfer.error = "ERR", f"NIXL could not post the WRITE to {peer}: {exc}"
        xfer.state = state
        if state == "ERR" and not xfer.error:
            xfer.error = f"NIXL refused to post the WRITE to {peer}"
        return xfer

    def write_contiguous(
        self,
        src: int,
        dst: int,
        nbytes: int,
        *,
        peer: str,
        mem_kind: str,
        remote_mem_kind: str,
        local_device: int = 0,
        remote_device: int = 0,
        notif: bytes = b"",
        warmup: bool = False,
    ) -> Xfer:
        """One WRITE of ``nbytes`` between two registered addresses: a single descriptor."""
        nixl = self._nixl
        try:
            local = nixl.get_xfer_descs(
                np.array([[src, nbytes, local_device]], dtype=np.uint64), mem_kind
            )
            remote = nixl.get_xfer_descs(
                np.array([[dst, nbytes, remote_device]], dtype=np.uint64), remote_mem_kind
            )
            handle = nixl.initialize_xfer("WRITE", local, remote, peer, notif)
        except Exception as exc:
            raise TransferError(f"NIXL could not build the staged WRITE to {peer}: {exc}") from exc
        xfer = Xfer(handle, peer, nbytes, 1, kind=WARMUP if warmup else "xfer")
        with self._lock:
            self._xfers.add(handle)
            self.live[xfer.kind] += 1
        try:
            xfer.state = nixl.transfer(handle)
        except Exception as exc:
            xfer.state, xfer.error = "ERR", f"NIXL could not post the WRITE to {peer}: {exc}"
        if xfer.state == "ERR" and not xfer.error:
            xfer.error = f"NIXL refused to post the WRITE to {peer}"
        return xfer

    def poll(self, xfer: Xfer) -> str:
        """Refresh and return ``xfer.state``: PROC, DONE or ERR (reason in ``xfer.error``)."""
        if xfer.state != "PROC":
            return xfer.state
        try:
            xfer.state = self._nixl.check_xfer_state(xfer.handle)
        except Exception as exc:
            xfer.state, xfer.error = "ERR", f"NIXL transfer to {xfer.peer} failed: {exc}"
        if xfer.state == "ERR" and not xfer.error:
            xfer.error = f"NIXL transfer to {xfer.peer} failed"
        return xfer.state

    def telemetry(self, xfer: Xfer) -> dict[str, int] | None:
        """NIXL's own figures for a finished transfer, when telemetry is captured."""
        if not self.config.capture_telemetry:
            return None
        try:
            t = self._nixl.get_xfer_telemetry(xfer.handle)
        except Exception:
            return None
        return {
            "descriptors": int(t.descCount),
            "bytes": int(t.totalBytes),
            "post_us": int(t.postDuration),
            "xfer_us": int(t.xferDuration),
        }

    def release(self, xfer: Xfer) -> bool:
        """Free a transfer handle; False if NIXL cannot yet (still in flight)."""
        with self._lock:
            if xfer.handle not in self._xfers:
                return True
        try:
            self._nixl.release_xfer_handle(xfer.handle)
        except Exception as exc:
            logger.debug("sgl-nixl: release of a transfer to %s deferred: %s", xfer.peer, exc)
            return False
        with self._lock:
            self._xfers.discard(xfer.handle)
            self.live[xfer.kind] -= 1
        return True

    def abandon(self, xfer: Xfer) -> None:
        """Give up on a transfer that never settles (its peer is gone): free it if NIXL lets
        us, else park it to retry at ``close``. Either way it no longer counts as live."""
        if self.release(xfer):
            return
        with self._lock:
            if xfer.handle in self._xfers:
                self._xfers.discard(xfer.handle)
                self._zombies.append(xfer.handle)
                self.live[xfer.kind] -= 1
                self.live["abandoned"] += 1
        logger.warning("sgl-nixl: abandoned a transfer to %s that never completed", xfer.peer)

    # -- notifications ------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived (peer -> messages), those ``progress`` kept first."""
        with self._notifs_lock:
            new = self._nixl.get_new_notifs()
            if self._pending_notifs:
                held, self._pending_notifs = self._pending_notifs, {}
                for peer, msgs in new.items():
                    held.setdefault(peer, []).extend(msgs)
                return held
            return new

    def progress(self) -> None:
        """Drive the backend once (a target needs this for two-sided transports such as
        UCX over TCP). Notifications that arrive are kept for ``notifications``, the
        newest ``MAX_KEPT_NOTIFS`` of each peer (nobody may be reading them)."""
        try:
            with self._notifs_lock:
                for peer, msgs in self._nixl.get_new_notifs().items():
                    kept = self._pending_notifs.setdefault(peer, [])
                    kept.extend(msgs)
                    del kept[:-MAX_KEPT_NOTIFS]
        except Exception as exc:
            logger.debug("sgl-nixl: progress: %s", exc)

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Release every transfer, list, peer and registration this agent made."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            xfers, dlists = list(self._xfers) + self._zombies, list(self._dlists)
            peers, regs = list(self._peers), list(self._regs)
        for h in xfers:
            try:
                self._nixl.release_xfer_handle(h)
            except Exception as exc:
                logger.warning("sgl-nixl: could not release a transfer at shutdown: %s", exc)
        for d in dlists:
            self._nixl.release_dlist_handle(d)
        for p in peers:
            try:
                self._nixl.remove_remote_agent(p)
            except Exception:
                pass
        for r in regs:
            self._nixl.deregister_memory(r)
        with self._lock:
            self._xfers.clear()
            self._zombies.clear()
            self._dlists.clear()
            self._peers.clear()
            self._regs.clear()
            self.live.clear()
