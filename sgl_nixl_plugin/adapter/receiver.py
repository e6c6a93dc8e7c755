"""Decode-side receiver: SGLang's common receiver speaking our wire, with fast failure.

It opens the room's record with the prefill ranks that serve it (for liveness), fails at
once when one of them refused this decode's layout (or when the room id is that of a failed
host room whose pages still drain), and sends aborts through the same
socket as its transfer request so an abort can never overtake the request it cancels.
"""

from __future__ import annotations

import time
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.transport import bootstrap_client
from sgl_nixl_plugin.wire.messages import Abort


class NixlPluginKVReceiver(CommonKVReceiver):
    def init(self, prefill_dp_rank: int) -> None:
        started = time.monotonic()
        super().init(prefill_dp_rank)
        infos = getattr(self, "bootstrap_infos", None)
        if self.conclude_state == KVPoll.Failed or not infos:
            return
        side = self.kv_mgr.decode
        endpoints = {(i["rank_ip"], int(i["rank_port"])) for i in infos}
        rec = side.rooms.open(self.bootstrap_room, endpoints)
        why = side.policy.refusal_since(endpoints, started)
        if not rec.phase.live:  # SGLang's tables are keyed by room id too
            why = f"room {self.bootstrap_room} reused while its host pages still drain"
        if why is not None:
            decode_status.fail(side.ctx, self.bootstrap_room, why)
            self.conclude_state = KVPoll.Failed
            side.policy.tell_prefills(self.bootstrap_room, endpoints, why)

    def poll(self) -> KVPoll:
        """SGLang's poll, after applying completion flags its one-pass prefill ranks stored
        (``DecodeSide.check_flags``) and the notes on its direct WRITEs (``check_notes``):
        the scheduler polls every loop, so the room ends as its copy or last WRITE ends. A
        Failed that SGLang set itself reached the room's machine as it was set (the
        manager's ``update_status``); it is told again here, should a release set it
        another way: no prefill status applies after it."""
        open_ = self.conclude_state is None
        if open_:
            self.kv_mgr.decode.check_flags(self.bootstrap_room)
            self.kv_mgr.decode.check_notes(self.bootstrap_room)
        status = super().poll()
        if open_ and status == KVPoll.Failed:
            decode_status.failed_here(self.kv_mgr.decode.ctx, self.bootstrap_room)
        return status

    @property
    def supports_host_destination(self) -> bool:
        return bool(self.kv_mgr.supports_host_destination)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        **kwargs: Any,
    ) -> None:
        """SGLang builds one transfer request per prefill rank, in ``bootstrap_infos``
        order: the room's record learns which rank each goes to, so that the staging slots
        granted in it are known to be that rank's (freed when its Success is applied).

        A HOST destination (pages of the decode's host pool) is marked on the record, which
        the requests then carry; SGLang's common receiver refuses anything but DEVICE.
        """
        rooms, room = self.kv_mgr.decode.rooms, self.bootstrap_room
        infos = getattr(self, "bootstrap_infos", None) or []
        rooms.start_requests(room, [(i["rank_ip"], int(i["rank_port"])) for i in infos])
        if destination == KVTransferDestination.HOST:
            if not self.supports_host_destination:
                raise ValueError(
                    f"room {room}: a host KV destination, but this decode registered no "
                    "host pool (SGLang gave KVArgs no host_kv_data_ptrs)"
                )
            rooms.set_host(room)
        try:
            super().send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len, **kwargs)
        finally:
            rooms.end_requests(room)

    def is_abort_release_safe(self) -> bool:
        """Nothing more can land in this room's host pages (``DecodeRooms.release_safe``).
        SGLang asks after its ``failure_exception()`` cleared the receiver: the record
        stays in its table, DRAINING, until the answer is yes."""
        return self.kv_mgr.decode.rooms.release_safe(self.bootstrap_room)

    def _get_bootstrap_info_from_server(
        self, prefill_dp_rank: int, prefill_cp_rank: int, target_tp_rank: int, target_pp_rank: int
    ) -> dict | None:
        """The warm-up's answer for this rank if it is still unused, else the bootstrap's."""
        query = bootstrap_client.route_query(
            prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank
        )
        warmup = self.kv_mgr.decode.ctx.warmup
        info = warmup.take_route(self.bootstrap_addr, query) if warmup is not None else None
        if info is None:
            info = bootstrap_client.get_route(
                self.bootstrap_addr, query, self.kv_mgr.settings.secret
            )
        if info is not None:
            info["pp_rank"] = int(target_pp_rank)
        return info

    def _clear(self) -> None:
        ok = self._succeeded()
        super()._clear()
        self.kv_mgr.decode.close_room(self.bootstrap_room, ok)

    def _succeeded(self) -> bool:
        return self.kv_mgr.request_status.get(self.bootstrap_room) == KVPoll.Success

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        mgr, room = self.kv_mgr, self.bootstrap_room
        if mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
            self._abort_generation = mgr.decode.ctx.sglang.arm_abort(room)
        generation = mgr.decode.policy.abort_generation(room, self._abort_generation)
        msg = Abort(room, mgr.local_ip, int(mgr.rank_port), generation)
        for info in self.bootstrap_infos or []:
            mgr.transport.send((info["rank_ip"], int(info["rank_port"])), msg)
