"""The prefill's side of a decode rank's registration: check its layout, set its link up
off the control thread (NIXL's connect and the warm-up WRITEs take a while), accept or
refuse it, and drop it when it goes.

Everything here but ``_set_up`` runs on the control thread (``PrefillControl``), which owns
the peer tables; ``_set_up`` runs on the setup thread and only reads the context.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.engine import Memory, PeerLink
from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.peers import DecodePeer, PendingDecode
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.memory import decode_heads, kv_geometry, remote_memory
from sgl_nixl_plugin.sides.one_pass import attach as attach_one_pass
from sgl_nixl_plugin.sides.peer_setup import SetupThread
from sgl_nixl_plugin.sides.peer_warmup import LateWarm, PeerWarmup
from sgl_nixl_plugin.sides.pipeline_stages import DecodeStage, PrefillStage, decode_kv_window
from sgl_nixl_plugin.sides.staging_asks import OwnBuffer, StagingAsks, registered_staging
from sgl_nixl_plugin.wire.codec import ForeignRegistration
from sgl_nixl_plugin.wire.compat import describe_mismatch
from sgl_nixl_plugin.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    PeerRegistration,
    PieceDone,
    RegistrationReply,
    SlotGrant,
    SlotRecall,
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
    warm_light: bool = False  # no warm-up: the decode's first request was already waiting
    window: tuple[int, ...] | None = None
    one_pass: str = ""
    wants_staging: bool = False  # ask the decode for its staging area (``StagingOffer``)
    stage_later: bool = False  # it may stage: set up at its first chunk the rule would stage
    reason: str = ""
    unreachable: str = ""
    took: str = ""  # for the log: where the setup's time went (a decode's request may wait)


class DecodeRegistrations:
    """The decodes being set up, and the verdict on each: ``ctx.peers`` holds the result.

    ``interrupt`` wakes the control thread when a setup finishes.
    """

    def __init__(
        self,
        ctx: PrefillContext,
        interrupt: Callable[[], None],
        wake: Callable[[int], None] = lambda room: None,
    ) -> None:
        """``wake(room)``: the room's transfer worker, whose chunks may wait for a link."""
        self.ctx = ctx
        self.wake = wake
        # decodes being set up: agent -> control endpoint
        self.setting_up: dict[str, tuple[str, int]] = {}
        # decodes being set up whose first request already waits: a warm-up would only
        # delay it (``PeerWarmup.before_reply``); written by the control thread, read by the setup thread
        self.request_waits: set[str] = set()
        self.setup = SetupThread("sgl-nixl-prefill-setup", interrupt)
        self.warmup = PeerWarmup(ctx, self.setup)
        self.staging = StagingAsks(ctx, self.setup, self.setting_up, self._ask_staging)
        ctx.staging_need = self.staging.need

    def waits_for_setup(self, msg: Any) -> bool:
        """Whether ``msg`` comes from a decode whose registration is still being set up
        (its requests need the link; a second registration waits for the first)."""
        if not self.setting_up:
            return False
        if isinstance(msg, Abort):
            return (msg.ip, msg.port) in self.setting_up.values()
        return isinstance(msg, _FROM_AGENT) and msg.agent_name in self.setting_up

    def files_early(self, msg: Any) -> bool:
        """Whether ``msg``, from a decode being set up, is handled now: a transfer request
        its registration can check (filed, so SGLang's prefill starts its forward pass
        while the link is set up; its chunks wait for the link), or an abort of a room
        filed here. Anything else waits for the setup, in arrival order."""
        if isinstance(msg, Abort):
            return self.ctx.rooms.get(msg.room) is not None
        if not isinstance(msg, TransferRequest):
            return False
        with self.ctx.peers.lock:
            return msg.agent_name in self.ctx.peers.pending

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
        waits = reg.request_waits
        if waits:  # not part of who the decode is: kept only as a note for its setup
            reg = msgspec.structs.replace(reg, request_waits=False)
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
        if waits:
            self.request_waits.add(reg.agent_name)  # read by the setup thread
        try:
            remote, _ = self._remote_of(reg, pages)
            bounds = ctx.engine.bounds(remote, pages)
        except Exception as exc:  # the setup will say what is wrong; till then they wait
            logger.debug("sgl-nixl: decode %s: no bounds before its link: %r", reg.agent_name, exc)
            bounds = None
        if bounds is not None:
            with peers.lock:
                peers.pending[reg.agent_name] = PendingDecode(reg, bounds)
        self.setup.submit(reg, lambda: self._set_up(reg, pages))

    def _remote_of(
        self, reg: PeerRegistration, pages: tuple[int, int]
    ) -> tuple[Memory, tuple[int, ...] | None]:
        """The decode's memory as this rank writes it, and its KV window (pipeline stage)."""
        remote = remote_memory(reg.kv, reg.aux, reg.state, reg.host_kv, reg.host_state)
        window = decode_kv_window(
            self.ctx.stage, DecodeStage(reg.pp_rank, reg.pp_size, len(reg.kv), reg.draft_entries)
        )
        return in_window(remote, window), window

    def _set_up(self, reg: PeerRegistration, pages: tuple[int, int]) -> Setup:
        """On the setup thread: the decode's link, its warm-up WRITEs and (one pass) its
        mapped pool. Reads the context, changes no table."""
        ctx, t0 = self.ctx, time.perf_counter()
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
            remote, window = self._remote_of(reg, pages)
            ctx.sglang.check_aux_count(reg.agent_name, len(reg.aux))
            link = ctx.engine.link(reg.agent_metadata, remote, {"kv": geometry}, page_tokens=pages)
        except ValueError as exc:
            return Setup(
                reason=f"cannot serve decode rank {reg.tp_rank}/{reg.tp_size} layout: {exc}"
            )
        except TransferError as exc:
            return Setup(unreachable=str(exc))
        light, t_link = reg.agent_name in self.request_waits, time.perf_counter()
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
        may_stage = self.staging.may_stage(reg, link)
        # our buffer is taken at the first chunk the rule would stage, not here (unless
        # every chunk is to be staged)
        stages = may_stage and self.staging.ready_now(reg)
        area = registered_staging(reg) if stages else None
        t_one_pass = time.perf_counter()
        warm_ms = self.warmup.before_reply(link, reg.agent_name, area, reg.scratch, light)
        if stages and not geometry.is_whole_items:
            ctx.warm_copier(geometry.unit_len, geometry.src_stride, geometry.src_offset)
        t1 = time.perf_counter()
        took = (
            f"; set up in {(t1 - t0) * 1e3:.1f} ms (link {(t_link - t0) * 1e3:.1f}, one pass "
            f"{(t_one_pass - t_link) * 1e3:.1f}, warm-up {(t1 - t_one_pass) * 1e3:.1f})"
        )
        return Setup(
            took=took,
            link=link,
            warm_ms=warm_ms,
            warm_light=light,
            window=window,
            one_pass=one_pass,
            wants_staging=stages and reg.staging is None,
            stage_later=may_stage and not stages,
        )

    def finish(self) -> bool:
        """Accept or refuse the decodes whose setup came back; whether any did (their
        messages read meanwhile may go now)."""
        done = self.setup.finished()
        for reg, result in done:
            if isinstance(reg, StagingOffer):
                self.staging.taken(reg, result)
                continue
            if isinstance(reg, OwnBuffer):
                self.staging.prepared(reg, result)
                continue
            if isinstance(reg, LateWarm):
                logger.info(
                    "sgl-nixl: decode %s: warm-up WRITEs after the reply: %s", reg.agent, result
                )
                continue
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
            with peers.lock:
                pending = self._end_setup(reg.agent_name)
            self._settle_early(
                reg.agent_name, pending, f"NIXL could not connect: {setup.unreachable}"
            )
            self.reply(
                endpoint, reg.agent_name, f"NIXL could not connect: {setup.unreachable}", retry=True
            )
            return
        reason, link = setup.reason, setup.link
        old_link = None
        with peers.lock:
            pending = self._end_setup(reg.agent_name)
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
                    staging=registered_staging(reg),
                    window=setup.window,
                    wants_staging=setup.wants_staging,
                    may_stage=setup.stage_later,
                )
                peers.refused.pop(reg.agent_name, None)
        if old_link is not None:
            ctx.unlink(old_link)
        self._settle_early(reg.agent_name, pending, reason)
        if reason:
            logger.error(
                "sgl-nixl: refused decode %s at %s:%s: %s", reg.agent_name, *endpoint, reason
            )
        else:
            pages = (ctx.compat.page_size, reg.compat.page_size) if ctx.compat else (0, 0)
            logger.info(
                "sgl-nixl: decode %s (tp %d/%d) at %s:%s connected%s%s%s%s%s",
                reg.agent_name,
                reg.tp_rank,
                reg.tp_size,
                *endpoint,
                _stage_note(ctx.stage, reg),
                f", pages of {pages[0]} tokens into pages of {pages[1]} (paired by token)"
                if pages[0] != pages[1]
                else "",
                f", warm-up WRITE {setup.warm_ms:.1f} ms"
                if setup.warm_ms is not None
                else ", no warm-up WRITE (a request was waiting)"
                if setup.warm_light
                else "",
                setup.one_pass,
                setup.took,
            )
        self.reply(
            endpoint,
            reg.agent_name,
            reason,
            window=setup.window,
            one_pass=link.one_pass if not reason and link is not None else None,
            wants_staging=setup.wants_staging and not reason,
        )
        if not reason and link is not None and setup.warm_light:
            self.warmup.after_reply(link, reg)

    def _end_setup(self, agent: str) -> PendingDecode | None:
        """The decode leaves the tables of those being set up (under ``peers.lock``, with
        its verdict: the workers never find it in neither)."""
        self.setting_up.pop(agent, None)
        return self.ctx.peers.pending.pop(agent, None)

    def _settle_early(self, agent: str, pending: PendingDecode | None, reason: str) -> None:
        """The rooms filed during the setup: failed with ``reason`` when it refused the
        decode (their chunks cannot go), and their workers woken to post or drop them."""
        if pending is None or not pending.rooms:
            return
        ctx = self.ctx
        if reason:
            ctx.fail_rooms_of_peer(agent, f"decode {agent}: {reason}")
        peer = ctx.peers.get(agent)
        if peer is not None and peer.staging_slot_bytes:  # staged: the slots it granted
            for room, slots in pending.slots.items():
                if (rec := ctx.rooms.get(room)) is not None:
                    rec.credits[agent] = SlotCredits(slots)
        for room in sorted(pending.rooms):
            self.wake(room)

    def _ask_staging(self, peer: DecodePeer) -> None:
        """Our buffer came after the accept: the same reply again, now asking the decode
        for its staging area."""
        one_pass = peer.link.one_pass
        self.reply(
            peer.endpoint, peer.agent, window=peer.window, one_pass=one_pass, wants_staging=True
        )

    def _drop_locked(self, peer: DecodePeer, why: str) -> None:
        self.ctx.peers.accepted.pop(peer.agent, None)
        # its rooms fail first, with this reason; a WRITE posted after on the closed link
        # is refused (``TransferEngine.write``): no room of it can end Success unwritten
        self.ctx.fail_rooms_of_peer(
            peer.agent, f"decode {peer.agent} at {peer.endpoint[0]}:{peer.endpoint[1]}: {why}"
        )
        self.ctx.unlink(peer.link)

    def drop(self, agent: str, why: str) -> None:
        """The decode is gone: its rooms fail and its link goes; one still being set up
        has only its rooms filed meanwhile to fail (its setup's verdict comes later)."""
        with self.ctx.peers.lock:
            peer = self.ctx.peers.accepted.get(agent)
            if peer is not None:
                self._drop_locked(peer, why)
                return
            pending = self.ctx.peers.pending.get(agent)
        if pending is not None and pending.rooms:
            self.ctx.fail_rooms_of_peer(agent, f"decode {agent}: {why}")


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
