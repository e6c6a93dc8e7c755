"""Prefill control thread: reads what decode ranks send (registrations, transfer
requests, slot credits, aborts, pings) and hands each to its handler.

Nothing a peer sends can kill it: every message is handled inside its own ``try``. It also
watches every accepted decode rank's connection and pings those that hold rooms in flight
(``liveness``): a decode that dies while idle is dropped too, with its NIXL peer.
Registrations: ``decode_registrations``; transfer requests: ``prefill_requests``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.decode_registrations import DecodeRegistrations
from sgl_nixl_plugin.sides.prefill_requests import file_request
from sgl_nixl_plugin.transport.control_loop import ControlLoop
from sgl_nixl_plugin.wire.codec import ForeignRegistration
from sgl_nixl_plugin.wire.messages import (
    Abort,
    PeerRegistration,
    PieceDone,
    Ping,
    Pong,
    SlotGrant,
    SlotRecall,
    StagingOffer,
    TransferRequest,
)

logger = logging.getLogger(__name__)


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
        self.registrations = DecodeRegistrations(ctx, self.interrupt, wake)
        # messages of decodes being set up, read meanwhile: handled in arrival order once
        # their registration is finished
        self._deferred: list[Any] = []

    def start(self) -> None:
        self.registrations.setup.start()
        super().start()

    def stop(self) -> None:
        self.registrations.setup.stop()
        super().stop()

    def on_frames(self, frames: list[Any]) -> None:
        decoded = self.ctx.codec.decode(frames)
        if decoded is not None:
            self._handle(decoded)

    def tick(self) -> None:
        self._finish_setups()
        super().tick()

    def _handle(self, decoded: Any) -> None:
        regs = self.registrations
        if regs.waits_for_setup(decoded.msg):
            regs.note_waiting(decoded.msg)
            if not regs.files_early(decoded.msg):
                self._deferred.append(decoded)
                return
        try:
            self._dispatch(decoded.msg, decoded.kv, decoded.state)
        except Exception:
            logger.exception(
                "sgl-nixl: error handling %s; the control thread goes on",
                type(decoded.msg).__name__,
            )

    def _finish_setups(self) -> None:
        """Finish the registrations whose setup came back, then handle what their decodes
        sent meanwhile, in arrival order."""
        if not self.registrations.finish():
            return
        deferred, self._deferred = self._deferred, []
        for decoded in deferred:
            self._handle(decoded)  # still waiting (another decode's setup): deferred again

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
                self.registrations.drop(idle, why)
            return
        reason = f"decode {agent} at {endpoint[0]}:{endpoint[1]} {why}"
        logger.error("sgl-nixl: %s", reason)
        if drop:
            self.registrations.drop(agent, why)
        else:
            self.ctx.fail_rooms_of_peer(agent, reason)

    def _dispatch(self, msg: Any, kv: np.ndarray | None, state: list[np.ndarray]) -> None:
        ctx = self.ctx
        if isinstance(msg, TransferRequest):
            file_request(ctx, self.registrations, msg, kv, state)
        elif isinstance(msg, PeerRegistration):
            self.registrations.on_registration(msg)
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
            self.registrations.on_foreign(msg)
        elif isinstance(msg, StagingOffer):
            self.registrations.staging.on_offer(msg)
        else:
            ctx.reject("unexpected", type(msg).__name__)

    # -- aborts ---------------------------------------------------------------------------
    def on_abort(self, msg: Abort) -> None:
        room = msg.room
        reason = (
            f"decode {msg.ip}:{msg.port}: {msg.reason}"
            if msg.reason
            else "Aborted by the decode side"
        )
        ended = self.ctx.rooms.ended(room)
        if ended is not None and not self.ctx.sglang.exists(room):
            # SGLang cleared its sender too: nothing is left to fail, nothing to note
            logger.debug(
                "sgl-nixl: room %s: abort after the room ended here (%s): %s", room, ended, reason
            )
        elif not self.ctx.note_early_abort(room, reason):
            logger.info(
                "sgl-nixl: room %s: the decode gave it up before it got here: %s", room, reason
            )
        if msg.generation is not None and msg.ip:
            self.ctx.sglang.ack_abort_when_drained(room, msg.ip, msg.port, msg.generation)
