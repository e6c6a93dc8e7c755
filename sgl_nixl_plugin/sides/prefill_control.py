"""Prefill control thread: files decode registrations, transfer requests, aborts and credits.

Nothing a peer sends can kill it: every message is handled inside its own ``try``. It also
watches every accepted decode rank's connection and pings those that hold rooms in flight
(``liveness``): a decode that dies while idle is dropped too, with its NIXL peer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.descriptors import validate_items
from sgl_nixl_plugin.engine.engine import HOST, Memory, PeerLink
from sgl_nixl_plugin.engine.staging import RemoteStaging, spare_of
from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.peers import DecodePeer
from sgl_nixl_plugin.protocol.prefill_rooms import TransferInfo
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.memory import decode_heads, kv_geometry, remote_memory
from sgl_nixl_plugin.sides.one_pass import attach as attach_one_pass
from sgl_nixl_plugin.sides.peer_setup import SetupThread
from sgl_nixl_plugin.sides.pipeline_stages import DecodeStage, PrefillStage, decode_kv_window
from sgl_nixl_plugin.transport.control_loop import ControlLoop
from sgl_nixl_plugin.wire.codec import ForeignRegistration
from sgl_nixl_plugin.wire.compat import describe_mismatch
from sgl_nixl_plugin.wire.messages import (
    PROTOCOL_VERSION,
    Abort,
    PeerRegistration,
    PieceDone,
    Ping,
    Pong,
    Region,
    RegistrationReply,
    SlotGrant,
    SlotRecall,
    TransferRequest,
    TransferStatus,
)

logger = logging.getLogger(__name__)

FAILED = 0  # KVPoll.Failed, as the status message carries it

# messages that name the decode agent that sent them
_FROM_AGENT = (PeerRegistration, TransferRequest, PieceDone, SlotGrant, SlotRecall)


@dataclass(frozen=True)
class Setup:
    """What setting a decode up came to: a link (accepted), a ``reason`` (refused: its
    layout cannot be served) or ``unreachable`` (a transport problem: it may retry)."""

    link: PeerLink | None = None
    warm_ms: float | None = None
    window: tuple[int, ...] | None = None
    one_pass: str = ""
    reason: str = ""
    unreachable: str = ""


class PrefillControl(ControlLoop):
    """Receives registrations, transfer requests, aborts and pings from decode ranks.

    ``wake(room)`` tells the transfer worker that owns ``room`` that a slot credit or grant
    arrived for it, ``recall(room)`` that its decode wants idle slots back.
    """

    def __init__(
        self, ctx: PrefillContext, wake: Callable[[int], None], recall: Callable[[int], None]
    ) -> None:
        s = ctx.settings
        super().__init__(
            ctx.zmq_ctx,
            ctx.server_socket,
            s.liveness_interval_s,
            s.liveness_misses,
            "sgl-nixl-prefill-ctl",
            stall_s=s.liveness_stall_s,
        )
        self.ctx = ctx
        self.wake = wake
        self.recall = recall
        self._pending: dict[tuple[str, int], str] = {}
        self._accepted: dict[tuple[str, int], str] = {}
        # decodes being set up (agent -> control endpoint), and their messages read
        # meanwhile: handled in arrival order once their registration is finished
        self._setting_up: dict[str, tuple[str, int]] = {}
        self._deferred: list[Any] = []
        self.setup = SetupThread("sgl-nixl-prefill-setup", self.interrupt)

    def start(self) -> None:
        self.setup.start()
        super().start()

    def stop(self) -> None:
        self.setup.stop()
        super().stop()

    def on_frames(self, frames: list[Any]) -> None:
        decoded = self.ctx.codec.decode(frames)
        if decoded is not None:
            self._handle(decoded)

    def tick(self) -> None:
        self._finish_setups()
        super().tick()

    def _handle(self, decoded: Any) -> None:
        if self._waits_for_setup(decoded.msg):
            self._deferred.append(decoded)
            return
        try:
            self._dispatch(decoded.msg, decoded.kv, decoded.state)
        except Exception:
            logger.exception(
                "sgl-nixl: error handling %s; the control thread goes on",
                type(decoded.msg).__name__,
            )

    def _waits_for_setup(self, msg: Any) -> bool:
        """Whether ``msg`` comes from a decode whose registration is still being set up
        (its requests need the link; a second registration waits for the first)."""
        if not self._setting_up:
            return False
        if isinstance(msg, Abort):
            return (msg.ip, msg.port) in self._setting_up.values()
        return isinstance(msg, _FROM_AGENT) and msg.agent_name in self._setting_up

    def on_lost(self, endpoint: tuple[str, int], why: str) -> None:
        self._lost(endpoint, why, drop=True)  # the process is gone: drop its NIXL peer too

    def _pending_decodes(self) -> dict[tuple[str, int], str]:
        """Decode endpoints (-> agent) that still await data for some room."""
        sg, out = self.ctx.sglang, {}
        for room, infos in sg.rooms_with_destinations():
            if not sg.is_open(room):
                continue
            for info in list(infos.values()):
                if not info.is_dummy:
                    out[(info.endpoint, info.dst_port)] = info.agent
        return out

    def _accepted_decodes(self) -> dict[tuple[str, int], str]:
        """Control endpoints (-> agent) of every accepted decode, busy or idle."""
        with self.ctx.peers.lock:
            return {p.endpoint: p.agent for p in self.ctx.peers.accepted.values()}

    def check_liveness(self) -> None:
        me, codec = self.ctx.me, self.ctx.codec
        self._pending = self._pending_decodes()
        self._accepted = self._accepted_decodes()
        # Watch every accepted decode (an idle connection costs nothing), so one that dies
        # with nothing in flight does not keep its NIXL peer forever; ping only the busy.
        self.watch.sync(set(self._accepted) | set(self._pending), set(self._pending))
        self.watch.ping(lambda seq: codec.encode(Ping(me.name, me.ip, me.port, seq)))
        for ep, silent in self.watch.silent():
            self._lost(ep, f"stopped answering (no reply for {silent:.1f}s)", drop=False)

    def _lost(self, endpoint: tuple[str, int], why: str, drop: bool) -> None:
        self.watch.forget(endpoint)  # idempotent: the loop may have forgotten it already
        agent = self._pending.get(endpoint)
        if agent is None:
            idle = self._accepted.get(endpoint)
            if idle is not None and drop:
                logger.info("sgl-nixl: idle decode %s at %s:%s %s", idle, *endpoint, why)
                self.drop_peer(idle, why)
            return
        reason = f"decode {agent} at {endpoint[0]}:{endpoint[1]} {why}"
        logger.error("sgl-nixl: %s", reason)
        if drop:
            self.drop_peer(agent, why)
        else:
            self.ctx.fail_rooms_of_peer(agent, reason)

    def _dispatch(self, msg: Any, kv: np.ndarray | None, state: list[np.ndarray]) -> None:
        ctx = self.ctx
        if isinstance(msg, TransferRequest):
            self.on_request(msg, kv, state)
        elif isinstance(msg, PeerRegistration):
            self.on_registration(msg)
        elif isinstance(msg, PieceDone | SlotGrant):
            rec = ctx.rooms.get(msg.room)
            if rec is None:
                return  # the room ended here: its last credits are not needed
            credits = rec.credits.get(msg.agent_name)
            if credits is None:
                ctx.reject(
                    "bad_credit", f"room {msg.room}: no staging slots of {msg.agent_name} here"
                )
                return
            if isinstance(msg, PieceDone):
                problem = credits.give_back(msg.slot, msg.seq)
            else:
                problem = credits.grant(msg.slot)
            if problem:
                ctx.reject("bad_credit", f"room {msg.room} {problem}")
            else:
                self.wake(msg.room)
        elif isinstance(msg, SlotRecall):
            rec = ctx.rooms.get(msg.room)
            if rec is not None and msg.agent_name in rec.credits:  # else: ended, or nothing held
                rec.recalls.add(msg.agent_name)
                self.recall(msg.room)
        elif isinstance(msg, Abort):
            self.on_abort(msg)
        elif isinstance(msg, Ping):
            me = ctx.me
            ctx.send((msg.ip, msg.port), Pong(me.name, msg.seq, me.ip, me.port))
        elif isinstance(msg, Pong):
            self.watch.replied((msg.ip, msg.port))  # a decode we ping for its pending rooms
        elif isinstance(msg, ForeignRegistration):
            self.on_foreign_registration(msg)
        else:
            ctx.reject("unexpected", type(msg).__name__)

    # -- registration -------------------------------------------------------------------
    def _reply(
        self,
        endpoint: tuple[str, int],
        agent: str,
        reason: str = "",
        retry: bool = False,
        window: tuple[int, ...] | None = None,
        one_pass: Any = None,
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
        )
        self.ctx.send(endpoint, reply)

    def on_foreign_registration(self, reg: ForeignRegistration) -> None:
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
        again); set a new decode up on the setup thread, finished in ``_finish_setups``."""
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
            self._reply(
                endpoint,
                reg.agent_name,
                window=known.window,
                one_pass=known.link.one_pass,
            )
            return
        if known is not None:
            self.drop_peer(reg.agent_name, "re-registered with a different layout")
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
        self._setting_up[reg.agent_name] = endpoint
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
        warm_ms = self._warm(link, reg.agent_name, _remote_staging(reg), reg.scratch)
        one_pass = attach_one_pass(
            settings=ctx.settings,
            link=link,
            reg=reg,
            remote=remote,
            copier=ctx.copier,
            stream=ctx.copy_stream,
            gpu=ctx.gpu,
            local_uuid=ctx.staging.device_uuid if ctx.staging is not None else "",
        )
        if ctx.staging is not None and not geometry.is_whole_items:
            ctx.warm_copier(geometry.unit_len, geometry.src_stride, geometry.src_offset)
        return Setup(link=link, warm_ms=warm_ms, window=window, one_pass=one_pass)

    def _finish_setups(self) -> None:
        """Finish the registrations whose setup came back, then handle what their decodes
        sent meanwhile, in arrival order."""
        done = self.setup.finished()
        if not done:
            return
        for reg, result in done:
            self._setting_up.pop(reg.agent_name, None)
            if isinstance(result, Exception):
                logger.error("sgl-nixl: setting up decode %s failed: %r", reg.agent_name, result)
                result = Setup(unreachable=f"setup failed: {result!r}")
            self._accept(reg, result)
        deferred, self._deferred = self._deferred, []
        for decoded in deferred:
            self._handle(decoded)  # still waiting (another decode's setup): deferred again

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
            self._reply(
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
                self._drop_peer_locked(gone, "decode at this address restarted")
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
                f", warm-up WRITE {setup.warm_ms:.1f} ms" if setup.warm_ms is not None else "",
                setup.one_pass,
            )
        self._reply(
            endpoint,
            reg.agent_name,
            reason,
            window=setup.window,
            one_pass=link.one_pass if not reason and link is not None else None,
        )

    def _warm(
        self,
        link: PeerLink,
        agent: str,
        staging: RemoteStaging | None,
        scratch: Region | None,
    ) -> float | None:
        """The first WRITEs to a new decode, into its padding page, (staged path) its
        staging buffer's spare tail and (host aux rows) its scratch buffer, before the
        reply: the decode waits for the reply before its first request where it can (see
        ``DecodeWarmup``). A failure is logged, not a refusal: the requests then report it."""
        if not self.ctx.settings.warmup:
            return None
        engine, local = self.ctx.engine, self.ctx.staging
        bound = self.ctx.settings.warmup_timeout_s
        try:
            ms = engine.warm(link, bound) * 1e3
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

    def _drop_peer_locked(self, peer: DecodePeer, why: str) -> None:
        self.ctx.peers.accepted.pop(peer.agent, None)
        # its rooms fail first, with this reason; a WRITE posted after on the closed link
        # is refused (``TransferEngine.write``): no room of it can end Success unwritten
        self.ctx.fail_rooms_of_peer(
            peer.agent, f"decode {peer.agent} at {peer.endpoint[0]}:{peer.endpoint[1]}: {why}"
        )
        self.ctx.unlink(peer.link)

    def drop_peer(self, agent: str, why: str) -> None:
        with self.ctx.peers.lock:
            peer = self.ctx.peers.accepted.get(agent)
            if peer is not None:
                self._drop_peer_locked(peer, why)

    # -- per-request metadata -------------------------------------------------------------
    def on_request(
        self, req: TransferRequest, kv: np.ndarray | None, state: list[np.ndarray]
    ) -> None:
        ctx, sg = self.ctx, self.ctx.sglang
        room, target = req.room, (req.ip, req.port)
        peer, refused = ctx.peers.lookup(req.agent_name)
        if peer is None:
            reason = refused or (
                f"prefill has no registration from decode agent {req.agent_name} "
                "(it restarted or was dropped); it re-registers on its next request"
            )
            ctx.send(
                target, TransferStatus(room, FAILED, ctx.me.rank, reason, ctx.me.ip, ctx.me.port)
            )
            sg.fail(room, reason)  # this side's sender too: it must not sit until the timeout
            if refused is None:
                self._reply(target, req.agent_name, reason, retry=True)
            return
        kv = np.empty(0, np.int32) if kv is None else kv
        problem = None
        if not req.is_dummy:
            prefix, where = (HOST, "host ") if req.host else ("", "")
            kv_group = peer.link.groups.get(f"{prefix}kv")
            if kv_group is None and req.host:
                problem = "a host destination, but the decode registered no host KV pool"
            else:
                problem = validate_items(
                    kv, kv_group.remote_pages if kv_group else 0, f"{where}destination page"
                )
                if problem is None and kv_group is not None and kv_group.by_token:
                    problem = _prefix_misaligned(req.decode_prefix_len, kv_group.page_tokens)
            aux_group = peer.link.groups.get("aux")
            if problem is None and req.aux_index >= 0 and aux_group is not None:
                problem = validate_items(
                    np.array([req.aux_index]), aux_group.remote_items, "aux row"
                )
            for i, s in enumerate(state):
                g = peer.link.groups.get(f"{prefix}state{i}")
                if problem is None and len(s):
                    problem = validate_items(s, g.remote_items if g else 0, f"{where}state[{i}]")
        if problem is not None:
            ctx.reject("index_out_of_range", f"room {room}: {problem}", req.agent_name)
            # Only the sender of the bad request is told: a forged request must not be able
            # to fail a room that its real decode is about to claim.
            ctx.send(
                target, TransferStatus(room, FAILED, ctx.me.rank, problem, ctx.me.ip, ctx.me.port)
            )
            return
        count = sg.add_destination(
            TransferInfo(
                room=room,
                agent=req.agent_name,
                endpoint=req.ip,
                dst_port=req.port,
                dst_pages=kv,
                aux_index=req.aux_index,
                state=list(state),
                required_dst_info_num=req.required_dst_info_num,
                is_dummy=req.is_dummy,
                host=req.host,
                done_flag=req.done_flag,
                done_value=req.done_value,
            )
        )
        if count is None:
            ctx.reject("duplicate_request", f"room {room}", req.agent_name)
            return
        rec = ctx.rooms.open(room)  # the room's record: from its first destination
        if req.staged and not req.is_dummy and peer.staging is not None:
            rec.credits[req.agent_name] = SlotCredits(req.staging_slots)
        if req.decode_prefix_len:
            sg.set_decode_prefix_len(room, req.decode_prefix_len)
        if count >= req.required_dst_info_num:
            rec.ready_at = time.perf_counter()
            sg.mark_ready(room)

    # -- aborts ---------------------------------------------------------------------------
    def on_abort(self, msg: Abort) -> None:
        room = msg.room
        reason = (
            f"decode {msg.ip}:{msg.port}: {msg.reason}"
            if msg.reason
            else "Aborted by the decode side"
        )
        if not self.ctx.note_early_abort(room, reason):
            logger.info(
                "sgl-nixl: room %s: the decode gave it up before it got here: %s", room, reason
            )
        if msg.generation is not None and msg.ip:
            self.ctx.sglang.ack_abort_when_drained(room, msg.ip, msg.port, msg.generation)


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


def _prefix_misaligned(prefix: int | None, page_tokens: tuple[int, int]) -> str | None:
    """SGLang's prefill sends a request from the decode's cached prefix on, in its own
    pages: across page sizes that prefix must end on a prefill page too, or the first
    page's tokens are not where the pairing puts them."""
    if prefix and prefix % page_tokens[0]:
        return (
            f"the decode's cached prefix of {prefix} tokens does not end on a prefill page of "
            f"{page_tokens[0]} tokens (decode pages of {page_tokens[1]})"
        )
    return None


def _remote_staging(reg: PeerRegistration) -> RemoteStaging | None:
    """The decode's staging area as this prefill writes it (None: it has none)."""
    if reg.staging is None:
        return None
    r = reg.staging.region
    return RemoteStaging(
        r.ptr,
        reg.staging.slot_bytes,
        r.device,
        r.mem_kind,
        reg.staging.device_uuid,
        spare_of(r.ptr, r.length, reg.staging.slot_bytes),
    )
