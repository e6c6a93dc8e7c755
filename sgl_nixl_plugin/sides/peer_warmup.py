"""The prefill's first WRITEs to a decode it has just linked: they take the transport's
wire-up off that decode's first request (``DecodeRegistrations`` decides when)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.engine import PeerLink
from sgl_nixl_plugin.engine.staging import RemoteStaging
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.peer_setup import SetupThread
from sgl_nixl_plugin.wire.messages import PeerRegistration, Region

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LateWarm:
    """The setup-thread job that warms a light decode up after the reply."""

    agent: str


class PeerWarmup:
    """Warm-up WRITEs to a decode, before its reply (on the setup thread, as part of its
    setup) or after it (a job of their own on that thread)."""

    def __init__(self, ctx: PrefillContext, setup: SetupThread) -> None:
        self.ctx = ctx
        self.setup = setup

    def after_reply(self, link: PeerLink, reg: PeerRegistration) -> None:
        """A light decode (its first request waited) got no warm-up before the reply. Where
        our KV is device memory, its KV may go by a copy (one pass, staged) while the
        room's state and aux rows go by NIXL WRITEs (device to device, host to host) whose
        transport paths nothing has wired up: the first room paid that, ~10 ms after its
        copy on an H100. The whole warm-up runs now, on the setup thread, while the first
        request's forward pass runs; its chunks do not wait for it. With a host KV pool the
        first request's own KV WRITE wires the same path up: none."""
        if not self.ctx.settings.warmup or self.ctx.engine.memory.kv.mem_kind == "DRAM":
            return
        scratch = reg.scratch

        def warm() -> str:
            ms = self.before_reply(link, reg.agent_name, None, scratch, late=True)
            if ms is None:
                return "failed; the first room pays the wire-up"
            self.ctx.late_warmups += 1
            return f"{ms:.1f} ms"

        self.setup.submit(LateWarm(reg.agent_name), warm)

    def before_reply(
        self,
        link: PeerLink,
        agent: str,
        staging: RemoteStaging | None,
        scratch: Region | None,
        light: bool = False,
        late: bool = False,
    ) -> float | None:
        """The first WRITEs to a new decode, into its padding page, (staged path) its
        staging buffer's spare tail and (host aux rows) its scratch buffer, before the
        reply: they take the transport's wire-up off its first request. Only for a decode
        that registered ahead of its requests (at start-up): one whose first request
        already waits (``light``: it said so, or the request came during the link) gets
        none, since that request would wait for the warm-up's wire-up and then pay the
        rest of it itself (a one-item WRITE left the CPU host's first request ~2.5 ms
        slower than none). A failure is logged, not a refusal: the requests then report it.
        ``late``: after the reply (:meth:`after_reply`), counted there."""
        if not self.ctx.settings.warmup:
            return None
        if light:
            self.ctx.light_warmups += 1
            return None
        engine, local = self.ctx.engine, self.ctx.staging
        bound = self.ctx.settings.warmup_timeout_s
        try:
            ms = engine.warm(link, bound) * 1e3
            if local is not None and staging is not None:
                ms += engine.warm_staging(link, local, staging, bound) * 1e3
            if scratch is not None and scratch.mem_kind == "DRAM":
                host_s = engine.warm_host(link, scratch.ptr, scratch.length, bound)
                self.ctx.host_warmups += host_s > 0 and not late
                ms += host_s * 1e3
            self.ctx.warmups += not late
            return ms
        except TransferError as exc:
            logger.warning(
                "sgl-nixl: decode %s: %s; its first request pays the wire-up", agent, exc
            )
            return None
