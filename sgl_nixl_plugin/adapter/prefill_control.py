"""Prefill control thread: files decode registrations, transfer requests, aborts and credits.

Nothing a peer sends can kill it: every message is handled inside its own ``try``. It also
watches the decode ranks that hold rooms in flight (``liveness``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from sgl_nixl_plugin.adapter.control_loop import ControlLoop
from sgl_nixl_plugin.adapter.memory import decode_heads, kv_geometry, remote_memory
from sgl_nixl_plugin.adapter.prefill_state import (
    FAILED,
    SUCCESS,
    WAITING_FOR_INPUT,
    DecodePeer,
    SlotCredits,
    TransferInfo,
)
from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.descriptors import validate_items
from sgl_nixl_plugin.engine.staging import (
    RemoteStaging,
)
from sgl_nixl_plugin.wire.compat import describe_mismatch
from sgl_nixl_plugin.wire.messages import (
    Abort,
    PeerRegistration,
    PieceDone,
    Ping,
    Pong,
    RegistrationReply,
    SlotAsk,
    SlotGrant,
    SlotRecall,
    TransferRequest,
    TransferStatus,
)

if TYPE_CHECKING:
    from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

logger = logging.getLogger(__name__)





class PrefillControl(ControlLoop):
    """Receives registrations, transfer requests, aborts and pings from decode ranks."""

    def __init__(self, mgr: NixlPluginKVManager) -> None:
        super().__init__(mgr, "sgl-nixl-prefill-ctl")
        self.peers: dict[str, DecodePeer] = {}
        self.refused: dict[str, str] = {}  # agent -> reason its registration was refused
        self.lock = threading.Lock()
        self._pending: dict[tuple[str, int], str] = {}

    def on_frames(self, frames: list[Any]) -> None:
        decoded = self.mgr.codec.decode(frames)
        if decoded is None:
            return
        try:
            self._dispatch(decoded.msg, decoded.kv, decoded.state)
        except Exception:
            logger.exception(
                "sgl-nixl: error handling %s; the control thread goes on", type(decoded.msg).__name__
            )

    def on_lost(self, endpoint: tuple[str, int], why: str) -> None:
        self._lost(endpoint, why, drop=True)  # the process is gone: drop its NIXL peer too

    def _pending_decodes(self) -> dict[tuple[str, int], str]:
        """Decode endpoints (-> agent) that still await data for some room."""
        mgr, out = self.mgr, {}
        for room, infos in list(mgr.transfer_infos.items()):
            if mgr.request_status.get(room) in (None, FAILED, SUCCESS):
                continue
            for info in list(infos.values()):
                if not info.is_dummy:
                    out[(info.endpoint, info.dst_port)] = info.agent
        return out

    def check_liveness(self) -> None:
        mgr = self.mgr
        self._pending = self._pending_decodes()
        self.watch.sync(set(self._pending))
        self.watch.ping(
            lambda seq: mgr.codec.encode(Ping(mgr.engine.name, mgr.local_ip, mgr.rank_port, seq))
        )
        for ep, silent in self.watch.silent():
            self._lost(ep, f"stopped answering (no reply for {silent:.1f}s)", drop=False)

    def _lost(self, endpoint: tuple[str, int], why: str, drop: bool) -> None:
        self.watch.forget(endpoint)  # idempotent: the loop may have forgotten it already
        agent = self._pending.get(endpoint)
        if agent is None:
            return
        reason = f"decode {agent} at {endpoint[0]}:{endpoint[1]} {why}"
        logger.error("sgl-nixl: %s", reason)
        if drop:
            self.drop_peer(agent, why)
        else:
            self.mgr.fail_rooms_of_peer(agent, reason)

    def _dispatch(self, msg: Any, kv: np.ndarray | None, state: list[np.ndarray]) -> None:
        if isinstance(msg, TransferRequest):
            self.on_request(msg, kv, state)
        elif isinstance(msg, PeerRegistration):
            self.on_registration(msg)
        elif isinstance(msg, PieceDone):
            free = self.mgr.remote_free.get(msg.room, {}).get(msg.agent_name)
            if free is None:
                return  # the room already ended: its last credits are not needed
            problem = free.give_back(msg.slot, msg.seq)
            if problem:
                self.mgr.codec.rejections.reject("bad_credit", f"room {msg.room} {problem}")
            else:
                self.mgr.wake_worker(msg.room)
        elif isinstance(msg, SlotGrant):
            free = self.mgr.remote_free.get(msg.room, {}).get(msg.agent_name)
            if free is None:
                return  # the room ended here: the decode takes the slot back at its end
            problem = free.grant(msg.slot)
            if problem:
                self.mgr.codec.rejections.reject("bad_credit", f"room {msg.room} {problem}")
            else:
                self.mgr.wake_worker(msg.room)
        elif isinstance(msg, SlotRecall):
            free = self.mgr.remote_free.get(msg.room, {}).get(msg.agent_name)
            if free is not None and free.returnable:  # else: ended, or nothing to give
                self.mgr.workers[msg.room % len(self.mgr.workers)].recall(msg.room, msg.agent_name)
        elif isinstance(msg, Abort):
            self.on_abort(msg)
        elif isinstance(msg, Ping):
            mgr = self.mgr
            mgr.send_to((msg.ip, msg.port), Pong(mgr.engine.name, msg.seq, mgr.local_ip, mgr.rank_port))
        elif isinstance(msg, Pong):
            self.watch.replied((msg.ip, msg.port))  # a decode we ping for its pending rooms
        else:
            self.mgr.codec.rejections.reject("unexpected", type(msg).__name__)

    # -- registration -------------------------------------------------------------------
    def on_registration(self, reg: PeerRegistration) -> None:
        mgr = self.mgr
        endpoint = (reg.ip, reg.port)
        reason = describe_mismatch(mgr.compat, reg.compat, "prefill")
        if not reason and reg.compat_hash != mgr.compat_hash:
            reason = "compatibility hash differs although every field matches: upgrade both sides"
        link = None
        with self.lock:
            known = self.peers.get(reg.agent_name)
        if known is not None and known.reg == reg:
            # The same decode process registering again (its cache was reset): keep the link.
            known.last_seen = time.monotonic()
            mgr.send_to(
                endpoint,
                RegistrationReply(reg.agent_name, mgr.prefill_rank_id, True, "", mgr.local_ip,
                                  mgr.rank_port, returns=mgr.settings.slot_returns),
            )
            return
        if known is not None:
            self.drop_peer(reg.agent_name, "re-registered with a different layout")
        if not reason:
            try:
                layout = mgr.head_layout
                dst_heads = decode_heads(
                    layout, mgr.compat.page_size, int(mgr.kv_args.kv_item_lens[0]),
                    reg.kv[0].item_len if reg.kv else 0, reg.tp_size,
                ) if not mgr.is_mla_backend else 0
                geometry = kv_geometry(
                    is_mla=mgr.is_mla_backend,
                    page_size=mgr.compat.page_size,
                    head_bytes_=layout.head_bytes if layout else 0,
                    src_heads=layout.heads if layout else 0,
                    dst_heads=dst_heads,
                    src_tp_rank=mgr.attn_tp_rank,
                    dst_tp_rank=reg.tp_rank,
                )
                remote = remote_memory(reg.kv, reg.aux, reg.state)
                mgr.check_peer_aux_buffer_count(reg.agent_name, len(reg.aux))
                link = mgr.engine.link(reg.agent_metadata, remote, {"kv": geometry})
            except ValueError as exc:
                reason = f"cannot serve decode rank {reg.tp_rank}/{reg.tp_size} layout: {exc}"
            except TransferError as exc:
                # A transport problem (e.g. NIXL could not reach the peer) is not a verdict
                # on the layout: don't remember it, let the decode register again.
                logger.error("sgl-nixl: could not connect decode %s: %s", reg.agent_name, exc)
                mgr.send_to(
                    endpoint,
                    RegistrationReply(
                        reg.agent_name, mgr.prefill_rank_id, False, f"NIXL could not connect: {exc}",
                        mgr.local_ip, mgr.rank_port, retry=True,
                    ),
                )
                return
        old_link = None
        with self.lock:
            stale = [
                p for p in self.peers.values() if p.endpoint == endpoint and p.agent != reg.agent_name
            ]
            for gone in stale:
                self._drop_peer_locked(gone, "decode at this address restarted")
            if reason:
                self.refused[reg.agent_name] = reason
            else:
                previous = self.peers.pop(reg.agent_name, None)
                old_link = previous.link if previous is not None else None
                staging = None
                if reg.staging is not None:
                    r = reg.staging.region
                    staging = RemoteStaging(
                        r.ptr, reg.staging.slot_bytes, r.device, r.mem_kind,
                        reg.staging.device_uuid, reg.staging.returns,
                    )
                self.peers[reg.agent_name] = DecodePeer(reg.agent_name, link, reg, endpoint, staging=staging)
                self.refused.pop(reg.agent_name, None)
        if old_link is not None:
            mgr.engine_unlink(old_link)
        if reason:
            logger.error("sgl-nixl: refused decode %s at %s:%s: %s", reg.agent_name, *endpoint, reason)
        else:
            logger.info(
                "sgl-nixl: decode %s (tp %d/%d) at %s:%s connected",
                reg.agent_name, reg.tp_rank, reg.tp_size, *endpoint,
            )
        mgr.send_to(
            endpoint,
            RegistrationReply(
                reg.agent_name, mgr.prefill_rank_id, not reason, reason, mgr.local_ip,
                mgr.rank_port, returns=not reason and mgr.settings.slot_returns,
            ),
        )

    def _drop_peer_locked(self, peer: DecodePeer, why: str) -> None:
        self.peers.pop(peer.agent, None)
        self.mgr.engine_unlink(peer.link)
        self.mgr.fail_rooms_of_peer(peer.agent, f"decode {peer.agent} at {peer.endpoint[0]}:{peer.endpoint[1]}: {why}")

    def drop_peer(self, agent: str, why: str) -> None:
        with self.lock:
            peer = self.peers.get(agent)
            if peer is not None:
                self._drop_peer_locked(peer, why)

    # -- per-request metadata -------------------------------------------------------------
    def on_request(self, req: TransferRequest, kv: np.ndarray | None, state: list[np.ndarray]) -> None:
        mgr = self.mgr
        room, target = req.room, (req.ip, req.port)
        with self.lock:
            peer = self.peers.get(req.agent_name)
            refused = self.refused.get(req.agent_name)
        if peer is None:
            reason = refused or (
                f"prefill has no registration from decode agent {req.agent_name} "
                "(it restarted or was dropped); it re-registers on its next request"
            )
            mgr.send_to(target, TransferStatus(room, FAILED, mgr.prefill_rank_id, reason))
            self._fail_locally(room, reason)
            if refused is None:
                mgr.send_to(
                    target,
                    RegistrationReply(
                        req.agent_name, mgr.prefill_rank_id, False, reason,
                        mgr.local_ip, mgr.rank_port, retry=True,
                    ),
                )
            return
        peer.last_seen = time.monotonic()
        kv = np.empty(0, np.int32) if kv is None else kv
        problem = None
        if not req.is_dummy:
            kv_group = peer.link.groups.get("kv")
            problem = validate_items(kv, kv_group.remote_items if kv_group else 0, "destination page")
            aux_group = peer.link.groups.get("aux")
            if problem is None and req.aux_index >= 0 and aux_group is not None:
                problem = validate_items(np.array([req.aux_index]), aux_group.remote_items, "aux row")
            for i, s in enumerate(state):
                g = peer.link.groups.get(f"state{i}")
                if problem is None and len(s):
                    problem = validate_items(s, g.remote_items if g else 0, f"state[{i}]")
        if problem is not None:
            mgr.codec.rejections.reject("index_out_of_range", f"room {room}: {problem}", req.agent_name)
            # Only the sender of the bad request is told: a forged request must not be able
            # to fail a room that its real decode is about to claim.
            mgr.send_to(target, TransferStatus(room, FAILED, mgr.prefill_rank_id, problem))
            return
        infos = mgr.transfer_infos.setdefault(room, {})
        if req.agent_name in infos:
            mgr.codec.rejections.reject("duplicate_request", f"room {room}", req.agent_name)
            return
        infos[req.agent_name] = TransferInfo(
            room=room,
            agent=req.agent_name,
            endpoint=req.ip,
            dst_port=req.port,
            dst_pages=kv,
            aux_index=req.aux_index,
            state=list(state),
            required_dst_info_num=req.required_dst_info_num,
            is_dummy=req.is_dummy,
        )
        mgr.room_seen[room] = time.monotonic()
        if (req.staging_slots or req.staging_wait) and not req.is_dummy:
            credits = SlotCredits(req.staging_slots, returnable=bool(
                peer.staging and peer.staging.returns and mgr.settings.slot_returns))
            mgr.remote_free.setdefault(room, {})[req.agent_name] = credits
            if not req.staging_slots and not credits.returnable:
                # the decode had none free: wait in its queue (a decode that takes slots
                # back is asked when the first chunk is ready instead, see TransferWorker)
                credits.asked = True
                mgr.send_to((req.ip, req.port),
                            SlotAsk(room, mgr.engine.name, mgr.local_ip, mgr.rank_port))
        if req.decode_prefix_len:
            mgr.req_to_decode_prefix_len[room] = req.decode_prefix_len
        if len(infos) >= req.required_dst_info_num:
            mgr.update_status(room, WAITING_FOR_INPUT)

    def _fail_locally(self, room: int, reason: str) -> None:
        """Fail this side's sender too, so it doesn't sit until the bootstrap timeout."""
        mgr = self.mgr
        if mgr.request_status.get(room) not in (None, SUCCESS, FAILED):
            mgr.record_failure(room, reason)
            mgr.update_status(room, FAILED)

    # -- aborts ---------------------------------------------------------------------------
    def on_abort(self, msg: Abort) -> None:
        mgr = self.mgr
        room = msg.room
        reason = f"decode {msg.ip}:{msg.port}: {msg.reason}" if msg.reason else "Aborted by the decode side"
        if not mgr.note_early_abort(room, reason):
            logger.info("sgl-nixl: room %s: the decode gave it up before it got here: %s", room, reason)
        if msg.generation is not None and msg.ip:
            mgr.ack_abort_when_drained(room, msg.ip, msg.port, msg.generation)
