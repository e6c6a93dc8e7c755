"""The prefill's side of a decode rank's registration: check its layout, set its link up
off the control thread (NIXL's connect and the warm-up WRITEs take a while), accept or
refuse it, and drop it when it goes.

Everything here but ``_set_up`` runs on the control thread (``PrefillControl``), which owns
the peer tables; ``_set_up`` runs on the setup thread and only reads the context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.engine import Memory, PeerLink
from sgl_nixl_plugin.engine.staging import RemoteStaging, spare_of
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.memory import decode_heads, kv_geometry, remote_memory
from sgl_nixl_plugin.sides.one_pass import attach as attach_one_pass
from sgl_nixl_plugin.sides.peer_setup import SetupThread
from sgl_nixl_plugin.sides.pipeline_stages import DecodeStage, PrefillStage, decode_kv_window
from sgl_nixl_plugin.wire.codec import ForeignRegistration
from sgl_nixl_plugin.wire.compat import describe_mismatch
from sgl_nixl_plugin.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    PeerRegistration,
    PieceDone,
    Region,
    RegistrationReply,
    SlotGrant,
    SlotRecall,
    StagingArea,
    StagingOffer,
    TransferRequest,
)

logger = logging.getLogger(__name__)

# messages that name the decode agent that sent them
_FROM_AGENT = (PeerRegistration, TransferRequest, PieceDone, SlotGrant, SlotRecall, StagingOffer)


@dataclass(frozen=True)
class Setup:
    """What setting a decode up came to: a link (accepted), a ``reason`` (refused: its
    layout cannot be served) or ``unreachable`` (a transport problem: it may retry)."""

    link: PeerLink | None = None
    warm_ms: float | None = None
    warm_light: bool = False  # one item: the decode's first request was already waiting
    window: tuple[int, ...] | None = None
    one_pass: str = ""
    wants_staging: bool = False  # ask the decode for its staging area (``StagingOffer``)
    reason: str = ""
    unreachable: str = ""


class DecodeRegistrations:
    """The decodes being set up, and the verdict on each: ``ctx.peers`` holds the result.

    ``interrupt`` wakes the control thread when a setup finishes.
    """

    def __init__(self, ctx: PrefillContext, interrupt: Callable[[], None]) -> None:
        self.ctx = ctx
        # decodes being set up: agent -> control endpoint
        self.setting_up: dict[str, tuple[str, int]] = {}
        # decodes being set up whose first request already waits: a warm-up would only
        # delay it (``_warm``); written by the control thread, read by the setup thread
        self.request_waits: set[str] = set()
        self.setup = SetupThread("sgl-nixl-prefill-setup", interrupt)

    def waits_for_setup(self, msg: Any) -> bool:
        """Whether ``msg`` comes from a decode whose registration is still being set up
        (its requests need the link; a second registration waits for the first)."""
        if not self.setting_up:
            return False
        if isinstance(msg, Abort):
            return (msg.ip, msg.port) in self.setting_up.values()
        return isinstance(msg, _FROM_AGENT) and msg.agent_name in self.setting_up

    def note_waiting(self, msg: Any) -> None:
        """``msg`` waits for its decode's setup: a request among them makes it light."""
        if isinstance(msg, TransferRequest):
            self.request_waits.add(msg.agent_name)  # read by the setup thread

    def reply(
        self,
        endpoint: tuple[str, int],
        agent: str,
        reason: str = "",
        retry: bool = False,
        window: tuple[int, ...] | None = None,
        one_pass: Any = None,
        wants_staging: bool = False,
    ) -> None:
        """``one_pass``: the decode's ``OnePassLink`` on this rank, if it has one."""
        me = self.ctx.me
        reply = RegistrationReply(
            agent,
            me.rank,
            not reason,
            reason,
            me.ip,
            me.port,
            retry,
            list(window or ()),
            one_pass is not None,
            one_pass is not None and one_pass.flags is not None,
            wants_staging,
        )
        self.ctx.send(endpoint, reply)

    def on_foreign(self, reg: ForeignRegistration) -> None:
        """A decode of another protocol version: refuse it in its own version's envelope,
        naming both, so that its requests fail now instead of at the bootstrap timeout."""
        reason = (
            f"protocol version mismatch: decode speaks v{reg.version}, this prefill "
            f"v{PROTOCOL_VERSION}: run the same sgl-nixl-plugin release on both sides"
        )
        logger.error(
            "sgl-nixl: refused decode %s at %s:%s: %s", reg.agent_name, reg.ip, reg.port, reason
        )
        me = self.ctx.me
        reply = RegistrationReply(reg.agent_name, me.rank, False, reason, me.ip, me.port)
        self.ctx.transport.send_raw(
            (reg.ip, reg.port), self.ctx.codec.encode_foreign(reply, reg.version)
        )

    def on_registration(self, reg: PeerRegistration) -> None:
        """Answer what needs no transport at once (a mismatch, the same registration
        again); set a new decode up on the setup thread, finished in ``finish``."""
        ctx = self.ctx
        peers = ctx.peers
        endpoint = (reg.ip, reg.port)
        assert ctx.compat is not None
        reason = describe_mismatch(ctx.compat, reg.compat, "prefill")
        if not reason and reg.compat_hash != ctx.compat_hash:
            reason = "compatibility hash differs although every field matches: upgrade both sides"
        with peers.lock:
            known = peers.accepted.get(reg.agent_name)
        if known is not None and known.reg == reg:
            # The same decode process registering again (its cache was reset): keep the link.
            self.reply(
                endpoint,
                reg.agent_name,
                window=known.window,
                one_pass=known.link.one_pass,
                wants_staging=known.wants_staging,
            )
            return
        if known is not None:
            self.drop(reg.agent_name, "re-registered with a different layout")
        pages = (ctx.compat.page_size, reg.compat.page_size)
        if not reason and pages[0] != pages[1] and ctx.page_bound_states:
            reason = (
                f"page sizes differ (prefill {pages[0]}, decode {pages[1]}) and this model's "
                f"{', '.join(ctx.page_bound_states)} state is indexed by pages: start both "
                "servers with the same --page-size"
            )
        if reason:
            self._accept(reg, Setup(reason=reason))
            return
        self.setting_up[reg.agent_name] = endpoint
        self.setup.submit(reg, lambda: self._set_up(reg, pages))

    def _set_up(self, reg: PeerRegistration, pages: tuple[int, int]) -> Setup:
        """On the setup thread: the decode's link, its warm-up WRITEs and (one pass) its
        mapped pool. Reads the context, changes no table."""
        ctx = self.ctx
        try:
            layout = ctx.head_layout
            dst_heads = (
                decode_heads(
                    layout,
                    pages[0],
                    ctx.kv_item_len,
                    reg.kv[0].item_len if reg.kv else 0,
                    reg.tp_size,
                    pages[1],
                )
                if not ctx.is_mla
                else 0
            )
            geometry = kv_geometry(
                is_mla=ctx.is_mla,
                # across page sizes the KV is addressed by token rows (one a "page")
                page_size=pages[0] if pages[0] == pages[1] else 1,
                head_bytes_=layout.head_bytes if layout else 0,
                src_heads=layout.heads if layout else 0,
                dst_heads=dst_heads,
                src_tp_rank=ctx.attn_tp_rank,
                dst_tp_rank=reg.tp_rank,
            )
            remote = remote_memory(reg.kv, reg.aux, reg.state, reg.host_kv, reg.host_state)
            window = decode_kv_window(
                ctx.stage, DecodeStage(reg.pp_rank, reg.pp_size, len(reg.kv), reg.draft_entries)
            )
            remote = in_window(remote, window)
            ctx.sglang.check_aux_count(reg.agent_name, len(reg.aux))
            link = ctx.engine.link(reg.agent_metadata, remote, {"kv": geometry}, page_tokens=pages)
        except ValueError as exc:
            return Setup(
                reason=f"cannot serve decode rank {reg.tp_rank}/{reg.tp_size} layout: {exc}"
            )
        except TransferError as exc:
            return Setup(unreachable=str(exc))
        light = reg.agent_name in self.request_waits
        one_pass = attach_one_pass(
            settings=ctx.settings,
            link=link,
            reg=reg,
            remote=remote,
            copier=ctx.copier,
            stream=ctx.copy_stream,
            gpu=ctx.gpu,
            local_uuid=ctx.device_uuid,
        )
        stages = self._stages_into(reg, link)
        area = _remote_staging(reg) if stages else None
        warm_ms = self._warm(link, reg.agent_name, area, reg.scratch, light)
        if stages and not geometry.is_whole_items:
            ctx.warm_copier(geometry.unit_len, geometry.src_stride, geometry.src_offset)
        return Setup(
            link=link,
            warm_ms=warm_ms,
            warm_light=light,
            window=window,
            one_pass=one_pass,
            wants_staging=stages and reg.staging is None,
        )

    def _stages_into(self, reg: PeerRegistration, link: PeerLink) -> bool:
        """Whether this decode may take staged transfers from us (it has a staging area,
        or allocates one on request, and not every chunk to it goes one pass: host-pool
        rooms never do); our own buffer is allocated now, on the setup thread, if so."""
        memory = self.ctx.staging_memory
        if memory is None or (reg.staging is None and not reg.staging_slot_bytes):
            return False
        if link.one_pass is not None and not reg.host_kv:
            return False
        self.ctx.staging = memory.ensure(f"decode {reg.agent_name} may take staged transfers")
        return self.ctx.staging is not None

    def finish(self) -> bool:
        """Accept or refuse the decodes whose setup came back; whether any did (their
        messages read meanwhile may go now)."""
        done = self.setup.finished()
        for reg, result in done:
            if isinstance(reg, StagingOffer):
                self._offer_taken(reg, result)
                continue
            self.setting_up.pop(reg.agent_name, None)
            self.request_waits.discard(reg.agent_name)
            if isinstance(result, Exception):
                logger.error("sgl-nixl: setting up decode %s failed: %r", reg.agent_name, result)
                result = Setup(unreachable=f"setup failed: {result!r}")
            self._accept(reg, result)
        return bool(done)

    def _accept(self, reg: PeerRegistration, setup: Setup) -> None:
        """Record the decode as accepted or refused, log it and reply (control thread)."""
        ctx, peers = self.ctx, self.ctx.peers
        endpoint = (reg.ip, reg.port)
        if setup.unreachable:
            # A transport problem (e.g. NIXL could not reach the peer) is not a verdict on
            # the layout: don't remember it, let the decode register again.
            logger.error(
                "sgl-nixl: could not connect decode %s: %s", reg.agent_name, setup.unreachable
            )
            self.reply(
                endpoint, reg.agent_name, f"NIXL could not connect: {setup.unreachable}", retry=True
            )
            return
        reason, link = setup.reason, setup.link
        old_link = None
        with peers.lock:
            stale = [
                p
                for p in peers.accepted.values()
                if p.endpoint == endpoint and p.agent != reg.agent_name
            ]
            for gone in stale:
                self._drop_locked(gone, "decode at this address restarted")
            if reason:
                peers.refused[reg.agent_name] = reason
            else:
                assert link is not None
                previous = peers.accepted.pop(reg.agent_name, None)
                old_link = previous.link if previous is not None else None
                peers.accepted[reg.agent_name] = DecodePeer(
                    reg.agent_name,
                    link,
                    reg,
                    endpoint,
                    staging=_remote_staging(reg),
                    window=setup.window,
                    wants_staging=setup.wants_staging,
                )
                peers.refused.pop(reg.agent_name, None)
        if old_link is not None:
            ctx.unlink(old_link)
        if reason:
            logger.error(
                "sgl-nixl: refused decode %s at %s:%s: %s", reg.agent_name, *endpoint, reason
            )
        else:
            pages = (ctx.compat.page_size, reg.compat.page_size) if ctx.compat else (0, 0)
            logger.info(
                "sgl-nixl: decode %s (tp %d/%d) at %s:%s connected%s%s%s%s",
                reg.agent_name,
                reg.tp_rank,
                reg.tp_size,
                *endpoint,
                _stage_note(ctx.stage, reg),
                f", pages of {pages[0]} tokens into pages of {pages[1]} (paired by token)"
                if pages[0] != pages[1]
                else "",
                f", warm-up WRITE {setup.warm_ms:.1f} ms"
                f"{' (one item: a request was waiting)' if setup.warm_light else ''}"
                if setup.warm_ms is not None
                else "",
                setup.one_pass,
            )
        self.reply(
            endpoint,
            reg.agent_name,
            reason,
            window=setup.window,
            one_pass=link.one_pass if not reason and link is not None else None,
            wants_staging=setup.wants_staging and not reason,
        )

    # -- a decode's staging area, allocated when we asked for it -------------------------
    def on_staging_offer(self, msg: StagingOffer) -> None:
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
        self.setup.submit(msg, lambda: self._take_offer(msg, peer))

    def _take_offer(self, msg: StagingOffer, peer: DecodePeer) -> RemoteStaging:
        """On the setup thread: the decode's NIXL metadata again (it now covers the staging
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

    def _offer_taken(self, msg: StagingOffer, result: Any) -> None:
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

    def _warm(
        self,
        link: PeerLink,
        agent: str,
        staging: RemoteStaging | None,
        scratch: Region | None,
        light: bool = False,
    ) -> float | None:
        """The first WRITEs to a new decode, into its padding page, (staged path) its
        staging buffer's spare tail and (host aux rows) its scratch buffer, before the
        reply. A decode that registered ahead of its requests (at start-up, or the warm-up
        thread winning the race) gets a request-sized KV WRITE, which takes the transport's
        wire-up off its first request; one whose first request already waits (``light``)
        gets one item: that request would wait for the whole warm-up and then pay little
        less itself. A failure is logged, not a refusal: the requests then report it."""
        if not self.ctx.settings.warmup:
            return None
        engine, local = self.ctx.engine, self.ctx.staging
        bound = self.ctx.settings.warmup_timeout_s
        self.ctx.light_warmups += light
        try:
            ms = engine.warm(link, bound, items=1 if light else None) * 1e3
            if local is not None and staging is not None:
                ms += engine.warm_staging(link, local, staging, bound) * 1e3
            if scratch is not None and scratch.mem_kind == "DRAM":
                host_s = engine.warm_host(link, scratch.ptr, scratch.length, bound)
                self.ctx.host_warmups += host_s > 0
                ms += host_s * 1e3
            self.ctx.warmups += 1
            return ms
        except TransferError as exc:
            logger.warning(
                "sgl-nixl: decode %s: %s; its first request pays the wire-up", agent, exc
            )
            return None

    def _drop_locked(self, peer: DecodePeer, why: str) -> None:
        self.ctx.peers.accepted.pop(peer.agent, None)
        # its rooms fail first, with this reason; a WRITE posted after on the closed link
        # is refused (``TransferEngine.write``): no room of it can end Success unwritten
        self.ctx.fail_rooms_of_peer(
            peer.agent, f"decode {peer.agent} at {peer.endpoint[0]}:{peer.endpoint[1]}: {why}"
        )
        self.ctx.unlink(peer.link)

    def drop(self, agent: str, why: str) -> None:
        with self.ctx.peers.lock:
            peer = self.ctx.peers.accepted.get(agent)
            if peer is not None:
                self._drop_locked(peer, why)


def in_window(remote: Memory, window: tuple[int, ...] | None) -> Memory:
    """The decode's memory as this pipeline stage writes it: its KV (and host KV) regions
    of this stage's layers (``pipeline_stages.decode_kv_window``); all when None."""
    if window is None:
        return remote
    host = remote.host_kv.pick(window) if remote.host_kv is not None else None
    return replace(remote, kv=remote.kv.pick(window), host_kv=host)


def _stage_note(stage: PrefillStage, reg: PeerRegistration) -> str:
    if stage.pp_size == 1 and reg.pp_size == 1:
        return ""
    where = "its own stage" if reg.pp_size == stage.pp_size else "its layers of this stage"
    return f", PP stage {stage.pp_rank}/{stage.pp_size} into decode PP {reg.pp_rank}/{reg.pp_size} ({where})"


def _remote_staging(reg: PeerRegistration) -> RemoteStaging | None:
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
