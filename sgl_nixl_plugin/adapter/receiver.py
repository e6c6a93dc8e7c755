"""Decode-side receiver: SGLang's common receiver speaking our wire, with fast failure.

It records which prefill ranks serve its room (for liveness), fails at once when one of
them refused this decode's layout, and sends aborts through the same socket as its
transfer request so an abort can never overtake the request it cancels.
"""

from __future__ import annotations

import time

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from sgl_nixl_plugin.wire.messages import Abort


class NixlPluginKVReceiver(CommonKVReceiver):
    def init(self, prefill_dp_rank: int) -> None:
        started = time.monotonic()
        super().init(prefill_dp_rank)
        infos = getattr(self, "bootstrap_infos", None)
        if self.conclude_state == KVPoll.Failed or not infos:
            return
        mgr = self.kv_mgr
        endpoints = {(i["rank_ip"], int(i["rank_port"])) for i in infos}
        mgr.room_endpoints[self.bootstrap_room] = endpoints
        for ep in endpoints:
            refused = mgr.refused_endpoints.get(ep)
            if refused is not None and refused[1] >= started:
                mgr.record_failure(self.bootstrap_room, refused[0])
                mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                return

    def _clear(self) -> None:
        mgr = self.kv_mgr
        ok = mgr.request_status.get(self.bootstrap_room) == KVPoll.Success
        super()._clear()
        mgr.room_endpoints.pop(self.bootstrap_room, None)
        if mgr.staging is not None:
            mgr.staging.room_done(self.bootstrap_room, ok)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        mgr = self.kv_mgr
        if mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
            self._abort_generation = mgr.register_deferred_abort_room(self.bootstrap_room)
        msg = Abort(self.bootstrap_room, mgr.local_ip, mgr.rank_port, self._abort_generation)
        for info in self.bootstrap_infos or []:
            mgr.send_to((info["rank_ip"], int(info["rank_port"])), msg)
