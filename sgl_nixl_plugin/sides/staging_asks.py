"""A prefill's staged path to one decode: our staging buffer and the decode's area, set up
at the first chunk the path rule would stage, off the path of any request.

Our buffer (hundreds of MiB, allocated, touched and NIXL-registered: tens to hundreds of ms
on a loaded host) and the decode's are taken only when a chunk to that decode would be
staged (``need``, from the transfer worker; that chunk goes direct), not when the decode is
set up: a pair whose chunks all go direct (large pages, one pass) holds none, and a pair
learned from a request does not allocate while its first requests run. With
``TRANSFER_PATH=staging`` every chunk is to be staged, so the buffer is taken during the
set-up. Once ours is there the decode is asked for its area (a second
``RegistrationReply``, ``wants_staging``), so a prefill that cannot allocate never makes a
decode allocate for nothing. The decode's area comes back in a ``StagingOffer``: its NIXL
metadata is loaded on the setup thread while the decode's messages wait, so that no slot
grant overtakes the area it names.

Everything here but the ``_prepare`` and ``_take`` jobs runs on the control thread, which
owns the peer tables.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.engine import PeerLink
from sgl_nixl_plugin.engine.staging import RemoteStaging, spare_of
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.peer_setup import SetupThread
from sgl_nixl_plugin.wire.messages import PeerRegistration, StagingArea, StagingOffer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnBuffer:
    """The setup-thread job that readies our buffer for a decode accepted without it."""

    reg: PeerRegistration


class StagingAsks:
    """The decodes we may stage into, their areas, and our buffer for them.

    ``setting_up`` is the registrations' table of decodes whose messages wait (a decode
    whose offer is being taken is in it too); ``ask(peer)`` sends the decode a reply that
    asks for its area.
    """

    def __init__(
        self,
        ctx: PrefillContext,
        setup: SetupThread,
        setting_up: dict[str, tuple[str, int]],
        ask: Callable[[DecodePeer], None],
    ) -> None:
        self.ctx = ctx
        self.setup = setup
        self.setting_up = setting_up
        self._ask = ask
        self.needs = 0  # decodes whose staging a chunk asked for (``count.staging.needs``)
        self._lock = threading.Lock()

    # -- while the decode is set up (setup thread) ------------------------------------------
    def may_stage(self, reg: PeerRegistration, link: PeerLink) -> bool:
        """Whether this decode may take staged transfers from us: we may stage, it has a
        staging area or allocates one on request, and not every chunk to it goes one pass
        (host-pool rooms never do)."""
        memory = self.ctx.staging_memory
        if memory is None or memory.error or (reg.staging is None and not reg.staging_slot_bytes):
            return False
        return link.one_pass is None or bool(reg.host_kv)

    def ready_now(self, reg: PeerRegistration) -> bool:
        """Our buffer for a decode we may stage into, if it is there already (another
        decode's chunk needed it), or now when every chunk is to be staged
        (``TRANSFER_PATH=staging``); else a chunk's ``need`` takes it later."""
        memory = self.ctx.staging_memory
        forced = self.ctx.settings.transfer_path == "staging"
        if self.ctx.staging is None and memory is not None and forced:
            self.ctx.staging = memory.ensure(f"decode {reg.agent_name} may take staged transfers")
        return self.ctx.staging is not None

    # -- at the first chunk the rule would stage ----------------------------------------------
    def need(self, peer: DecodePeer) -> None:
        """Transfer worker: the path rule would stage a chunk to ``peer``, which has no
        staging set up (the chunk goes direct). Ready our buffer on the setup thread and
        then ask the decode for its area; once per decode."""
        with self._lock:
            if not peer.may_stage:
                return
            peer.may_stage = False
            self.needs += 1
        reg, link = peer.reg, peer.link
        self.setup.submit(OwnBuffer(reg), lambda: self._prepare(reg, link))

    def _prepare(self, reg: PeerRegistration, link: PeerLink) -> bool:
        """Setup thread: our buffer, the gather compiled for this decode's unit shape, and
        (a decode that sent its area with its registration) the first WRITE into it."""
        ctx = self.ctx
        if ctx.staging is None and ctx.staging_memory is not None:
            ctx.staging = ctx.staging_memory.ensure(
                f"decode {reg.agent_name} may take staged transfers"
            )
        if ctx.staging is None:
            return False
        kv = link.groups.get("kv")
        if kv is not None and not kv.geometry.is_whole_items:
            g = kv.geometry
            ctx.warm_copier(g.unit_len, g.src_stride, g.src_offset)
        if reg.staging is not None and ctx.settings.warmup:
            try:
                ctx.engine.warm_staging(
                    link, ctx.staging, remote_staging(reg.staging), ctx.settings.warmup_timeout_s
                )
            except TransferError as exc:
                logger.warning("sgl-nixl: decode %s: staging %s", reg.agent_name, exc)
        return True

    def prepared(self, job: OwnBuffer, result: Any) -> None:
        """Control thread: our buffer for ``job``'s decode is ready (or failed: its rooms
        go on direct); ask the decode for its area, unless it sent it already."""
        reg = job.reg
        if result is not True:
            if isinstance(result, Exception):
                logger.error("sgl-nixl: staging for decode %s failed: %r", reg.agent_name, result)
            return
        with self.ctx.peers.lock:
            peer = self.ctx.peers.accepted.get(reg.agent_name)
            if peer is None or peer.reg != reg:
                return  # gone or registered again meanwhile
            if reg.staging is not None:
                return  # its area came with the registration: staged from now on
            peer.wants_staging = True
        self._ask(peer)

    # -- the decode's area ------------------------------------------------------------------
    def on_offer(self, msg: StagingOffer) -> None:
        """The decode we asked sent its staging area: take it on the setup thread (its
        messages meanwhile wait, so that no staged request overtakes it); or why it has
        none, and its rooms go direct."""
        peers = self.ctx.peers
        with peers.lock:
            peer = peers.accepted.get(msg.agent_name)
        if peer is None or not peer.wants_staging or peer.endpoint != (msg.ip, msg.port):
            self.ctx.reject("unexpected", f"StagingOffer not asked for from {msg.agent_name}")
            return
        if msg.staging is None:
            logger.warning(
                "sgl-nixl: decode %s has no staging area (%s); its rooms go direct",
                msg.agent_name,
                msg.reason,
            )
            with peers.lock:
                peer.wants_staging = False  # chunks that wait for its slots go at SLOT_WAIT
            return
        self.setting_up[msg.agent_name] = peer.endpoint
        self.setup.submit(msg, lambda: self._take(msg, peer))

    def _take(self, msg: StagingOffer, peer: DecodePeer) -> RemoteStaging:
        """Setup thread: the decode's NIXL metadata again (it now covers the staging
        buffer; the link's lists stay valid), and the warm-up WRITE into its spare."""
        ctx = self.ctx
        assert msg.staging is not None
        if ctx.engine.agent.add_peer(msg.agent_metadata) != peer.link.name:
            raise TransferError("its NIXL metadata names another agent")
        area = remote_staging(msg.staging)
        if ctx.settings.warmup and ctx.staging is not None:
            try:
                bound = ctx.settings.warmup_timeout_s
                ctx.engine.warm_staging(peer.link, ctx.staging, area, bound)
            except TransferError as exc:
                logger.warning("sgl-nixl: decode %s: staging %s", msg.agent_name, exc)
        return area

    def taken(self, msg: StagingOffer, result: Any) -> None:
        """Control thread: the decode's rooms may stage from now on (or still go direct)."""
        self.setting_up.pop(msg.agent_name, None)
        with self.ctx.peers.lock:
            peer = self.ctx.peers.accepted.get(msg.agent_name)
            if peer is None or peer.endpoint != (msg.ip, msg.port):
                return
            if isinstance(result, RemoteStaging):
                peer.staging = result
            else:
                peer.wants_staging = False
        if not isinstance(result, RemoteStaging):
            logger.warning(
                "sgl-nixl: decode %s: its staging area cannot be used (%r); its rooms go direct",
                msg.agent_name,
                result,
            )
            return
        logger.info(
            "sgl-nixl: decode %s: staged transfers into its %d MiB staging area",
            msg.agent_name,
            msg.staging.region.length >> 20 if msg.staging is not None else 0,
        )


def registered_staging(reg: PeerRegistration) -> RemoteStaging | None:
    """The staging area an older decode sends in its registration (None: none there)."""
    return remote_staging(reg.staging) if reg.staging is not None else None


def remote_staging(area: StagingArea) -> RemoteStaging:
    """A decode's staging area as this prefill writes it."""
    r = area.region
    return RemoteStaging(
        r.ptr,
        area.slot_bytes,
        r.device,
        r.mem_kind,
        area.device_uuid,
        spare_of(r.ptr, r.length, area.slot_bytes),
    )
