"""Pay UCX's protocol selection at start-up instead of on a peer's first request.

UCX (its protocols v2, the default of the UCX that NIXL's wheels carry) chooses its
protocols per endpoint configuration the first time a worker meets that configuration: a few tables (active messages in six
variants, the RMA write) at ~0.5 ms of CPU each, 3.5-4 ms in all on a 2-core host, and again
on the target when the initiator's wire-up creates the reverse endpoint there. A decode
learned from its first request paid that inside the request: in NIXL's ``add_remote_agent``
on the prefill, then in the first WRITE on both sides.

Two throwaway agents in this process give the worker both configurations a same-host peer
will bring: one WRITEs into us (we are the target), we WRITE into the other (we are the
initiator). The selections stay cached in our worker after the throwaway agents go. A peer
on another host has another configuration (its transports differ) and still selects at
its first contact. Costs ~10 ms per throwaway agent (UCX shares the process's loaded
transports) plus the selections themselves.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Bytes each throwaway WRITE moves (its own buffers: nothing of ours is touched).
PROBE_BYTES = 64


@dataclass(frozen=True)
class Prewarm:
    """What the start-up selection came to: ``ok`` once both WRITEs landed byte-exact;
    ``error`` says why not (the first peer then pays the selection itself)."""

    ok: bool
    ms: float
    error: str = ""
    peers: tuple[str, ...] = ()  # the throwaway agents' names (none is left as our peer)


def wanted(setting: str, mem_kind: str) -> bool:
    """``SGLANG_NIXL_PLUGIN_UCX_PREWARM``: "1" always, "0" never, "auto" for a DRAM KV pool
    (measured there; a GPU host's UCX loads its CUDA transports in each throwaway agent,
    not measured yet)."""
    return setting == "1" or (setting == "auto" and mem_kind == "DRAM")


def prewarm(agent: Any, backend: str, mem_kind: str = "DRAM", timeout_s: float = 2.0) -> Prewarm:
    """Run the two throwaway WRITEs against ``agent`` (a ``nixl_agent`` with ``backend``
    created); never raises. Leaves ``agent`` as it found it: no peer, no registration."""
    started = time.monotonic()
    tag = uuid.uuid4().hex[:8]
    names = tuple(f"{agent.name}-ucx-{role}-{tag}" for role in ROLES)
    nixl_log = logging.getLogger("nixl")  # its INFO lines would name the throwaway agents
    level = nixl_log.level
    nixl_log.setLevel(max(level, logging.WARNING))
    try:
        _run(agent, backend, mem_kind, timeout_s, names)
    except Exception as exc:  # only a cost is at stake: the peers' set-up still works
        ms = (time.monotonic() - started) * 1e3
        return Prewarm(False, ms, f"{type(exc).__name__}: {exc}", names)
    finally:
        nixl_log.setLevel(level)
    return Prewarm(True, (time.monotonic() - started) * 1e3, peers=names)


#: We are the target of the first throwaway WRITE, the initiator of the second.
ROLES = ("target", "initiator")


def _run(ours: Any, backend: str, mem_kind: str, timeout_s: float, names: tuple[str, ...]) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    deadline = time.monotonic() + timeout_s
    cleanup: list[Any] = []
    try:
        mine = _Buffer(ours, mem_kind, cleanup)
        for role, name in zip(ROLES, names, strict=True):
            other = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
            try:
                other.create_backend(backend, {})
            except Exception as exc:
                raise RuntimeError(f"a throwaway agent has no {backend} backend: {exc}") from exc
            theirs = _Buffer(other, mem_kind, cleanup)
            src, dst = (theirs, mine) if role == "target" else (mine, theirs)
            src.agent.add_remote_agent(dst.agent.get_agent_metadata())
            cleanup.append(lambda a=src.agent, n=dst.agent.name: a.remove_remote_agent(n))
            _write(src, dst, deadline, role)
    finally:
        for undo in reversed(cleanup):
            try:
                undo()
            except Exception:  # best effort: the throwaway agent goes with its references
                pass


class _Buffer:
    """``PROBE_BYTES`` registered with ``agent``, deregistered by ``cleanup``."""

    def __init__(self, agent: Any, mem_kind: str, cleanup: list[Any]) -> None:
        if mem_kind != "DRAM":
            raise ValueError(f"no throwaway {mem_kind} buffer here: DRAM only")
        self.agent = agent
        self.data = np.zeros(PROBE_BYTES, dtype=np.uint8)
        descs = agent.register_memory([(self.data.ctypes.data, PROBE_BYTES, 0, "")], mem_kind)
        cleanup.append(lambda: self._kept() or agent.deregister_memory(descs))

    def _kept(self) -> bool:
        return any(self in kept for kept in _KEPT)

    def descs(self) -> Any:
        return self.agent.get_xfer_descs([(self.data.ctypes.data, PROBE_BYTES, 0)], "DRAM")


def _write(src: _Buffer, dst: _Buffer, deadline: float, role: str) -> None:
    """One WRITE ``src`` -> ``dst``, progressing the target (a two-sided transport needs
    it), checked byte for byte. One that does not end in time keeps both buffers (and its
    handle) for the process's life: it may still land."""
    pattern = np.arange(1, PROBE_BYTES + 1, dtype=np.uint8)
    src.data[:] = pattern
    handle = src.agent.initialize_xfer("WRITE", src.descs(), dst.descs(), dst.agent.name)
    state = src.agent.transfer(handle)
    while state == "PROC":
        if time.monotonic() > deadline:
            _KEPT.append((src, dst, handle))
            raise TimeoutError(f"the {role} WRITE did not complete in time")
        dst.agent.get_new_notifs()
        state = src.agent.check_xfer_state(handle)
    src.agent.release_xfer_handle(handle)
    if state != "DONE":
        raise RuntimeError(f"the {role} WRITE ended {state}")
    if not np.array_equal(dst.data, pattern):
        raise RuntimeError(f"the {role} WRITE completed but its bytes did not land")


#: What a WRITE that did not end in time may still write into (never freed).
_KEPT: list[Any] = []
