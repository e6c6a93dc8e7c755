"""A decode rank's transfer request, filed on the prefill: check its indices against the
decode's registered pools, record its destination with SGLang, and mark the room ready.

A forged or stale request is refused to its sender only: it must not be able to fail a room
that its real decode is about to claim.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.descriptors import validate_items
from sgl_nixl_plugin.engine.engine import HOST
from sgl_nixl_plugin.protocol.credits import SlotCredits
from sgl_nixl_plugin.protocol.prefill_rooms import TransferInfo
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.decode_registrations import DecodeRegistrations
from sgl_nixl_plugin.wire.messages import TransferRequest, TransferStatus

FAILED = 0  # KVPoll.Failed, as the status message carries it


def file_request(
    ctx: PrefillContext,
    registrations: DecodeRegistrations,
    req: TransferRequest,
    kv: np.ndarray | None,
    state: list[np.ndarray],
) -> None:
    """File a decode rank's destination for a room (control thread); the room is ready
    once every decode rank it waits for filed one."""
    sg = ctx.sglang
    room, target = req.room, (req.ip, req.port)
    with ctx.peers.lock:
        peer, refused = (
            ctx.peers.accepted.get(req.agent_name),
            ctx.peers.refused.get(req.agent_name),
        )
        pending = ctx.peers.pending.get(req.agent_name) if peer is None else None
    if peer is None and pending is None:
        reason = refused or (
            f"prefill has no registration from decode agent {req.agent_name} "
            "(it restarted or was dropped); it re-registers on its next request"
        )
        ctx.send(target, TransferStatus(room, FAILED, ctx.me.rank, reason, ctx.me.ip, ctx.me.port))
        # this side's sender too, now or at its creation: it must not sit until the timeout
        ctx.note_early_abort(room, reason)
        if refused is None:
            registrations.reply(target, req.agent_name, reason, retry=True)
        return
    # checked against the link, or, while it is set up, the bounds it will have
    groups: Mapping[str, Any] = peer.link.groups if peer is not None else pending.bounds  # type: ignore[union-attr]
    kv = np.empty(0, np.int32) if kv is None else kv
    problem = None if req.is_dummy else _out_of_bounds(req, groups, kv, state)
    if problem is not None:
        ctx.reject("index_out_of_range", f"room {room}: {problem}", req.agent_name)
        # Only the sender of the bad request is told: a forged request must not be able
        # to fail a room that its real decode is about to claim.
        ctx.send(target, TransferStatus(room, FAILED, ctx.me.rank, problem, ctx.me.ip, ctx.me.port))
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
            notes=req.notes,
        )
    )
    if count is None:
        ctx.reject("duplicate_request", f"room {room}", req.agent_name)
        return
    rec = ctx.rooms.open(room)  # the room's record: from its first destination
    if pending is not None:
        with ctx.peers.lock:
            pending.rooms.add(room)  # its chunks wait for the link; woken when it is set up
            if req.staged and not req.is_dummy:
                pending.slots[room] = list(req.staging_slots)
    elif req.staged and not req.is_dummy and peer is not None and peer.staging_slot_bytes:
        rec.credits[req.agent_name] = SlotCredits(req.staging_slots)
    if req.decode_prefix_len:
        sg.set_decode_prefix_len(room, req.decode_prefix_len)
    if count >= req.required_dst_info_num:
        rec.ready_at = time.perf_counter()
        sg.mark_ready(room)


def _out_of_bounds(
    req: TransferRequest, groups: Mapping[str, Any], kv: np.ndarray, state: list[np.ndarray]
) -> str | None:
    """What in the request lies outside the decode's pools (``groups``: each group's
    ``remote_pages``/``remote_items``, a link's or the bounds it will have), or None."""
    prefix, where = (HOST, "host ") if req.host else ("", "")
    kv_group = groups.get(f"{prefix}kv")
    if kv_group is None and req.host:
        return "a host destination, but the decode registered no host KV pool"
    problem = validate_items(
        kv, kv_group.remote_pages if kv_group else 0, f"{where}destination page"
    )
    if problem is None and kv_group is not None and kv_group.by_token:
        problem = _prefix_misaligned(req.decode_prefix_len, kv_group.page_tokens)
    aux_group = groups.get("aux")
    if problem is None and req.aux_index >= 0 and aux_group is not None:
        problem = validate_items(np.array([req.aux_index]), aux_group.remote_items, "aux row")
    for i, s in enumerate(state):
        g = groups.get(f"{prefix}state{i}")
        if problem is None and len(s):
            problem = validate_items(s, g.remote_items if g else 0, f"{where}state[{i}]")
    return problem


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
