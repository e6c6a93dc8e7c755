"""Decode-side receiver: SGLang's common receiver speaking our wire, with fast failure.

It records which prefill ranks serve its room (for liveness), fails at once when one of
them refused this decode's layout, and sends aborts through the same socket as its
transfer request so an abort can never overtake the request it cancels.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import requests
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from sgl_nixl_plugin.wire.http_auth import sign
from sgl_nixl_plugin.wire.messages import Abort

logger = logging.getLogger(__name__)


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
                why = f"prefill {ep[0]}:{ep[1]} refused this decode: {refused[0]}"
                mgr.record_failure(self.bootstrap_room, why)
                mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                mgr.tell_prefills(self.bootstrap_room, endpoints, why)
                return

    def send_metadata(self, *args: Any, **kwargs: Any) -> None:
        """SGLang builds one transfer request per prefill rank, in ``bootstrap_infos``
        order: tell the manager which rank each goes to, so that the staging slots granted
        in it are known to be that rank's (they are freed when its Success is applied)."""
        mgr, room = self.kv_mgr, self.bootstrap_room
        infos = getattr(self, "bootstrap_infos", None) or []
        mgr.metadata_targets[room] = deque((i["rank_ip"], int(i["rank_port"])) for i in infos)
        try:
            super().send_metadata(*args, **kwargs)
        finally:
            mgr.metadata_targets.pop(room, None)

    def _get_bootstrap_info_from_server(
        self, prefill_dp_rank: int, prefill_cp_rank: int, target_tp_rank: int, target_pp_rank: int
    ) -> dict | None:
        """GET a prefill rank's address, signed when a shared secret is configured."""
        path = (
            f"/route?prefill_dp_rank={prefill_dp_rank}&prefill_cp_rank={prefill_cp_rank}"
            f"&target_tp_rank={target_tp_rank}&target_pp_rank={target_pp_rank}"
        )
        try:
            r = requests.get(
                f"http://{self.bootstrap_addr}{path}",
                headers=sign(self.kv_mgr.settings.secret, "GET", path),
                timeout=5,
            )
        except requests.RequestException as exc:
            logger.error("sgl-nixl: bootstrap %s unreachable: %s", self.bootstrap_addr, exc)
            return None
        if r.status_code != 200:
            logger.error(
                "sgl-nixl: bootstrap %s refused the rank query (HTTP %d): %s",
                self.bootstrap_addr, r.status_code, r.text[:300],
            )
            return None
        info = r.json()
        info["pp_rank"] = int(target_pp_rank)
        return info

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
