"""Prefill-side sender: SGLang's common sender, signed DP-rank registration, and cleanup.

A sender created after its decode already gave the room up (the decode's abort can beat the
request to this prefill) fails at once with the decode's reason.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import requests
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender

from sgl_nixl_plugin.wire.http_auth import sign

logger = logging.getLogger(__name__)


class NixlPluginKVSender(CommonKVSender):
    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        reason = mgr.claim_early_abort(bootstrap_room)
        if reason is not None and self.conclude_state is None:
            logger.error("sgl-nixl: room %s: %s", bootstrap_room, reason)
            mgr.record_failure(bootstrap_room, reason)
            mgr.update_status(bootstrap_room, KVPoll.Failed)

    def _register_prefill_dp_rank(self) -> None:
        """POST /register_dp_rank, signed when a shared secret is configured."""
        body = json.dumps({"bootstrap_room": self.bootstrap_room, "dp_rank": self.kv_mgr.attn_dp_rank}).encode()
        headers = {
            "Content-Type": "application/json",
            **sign(self.kv_mgr.settings.secret, "POST", "/register_dp_rank", body),
        }
        try:
            r = requests.post(
                f"http://{self.bootstrap_server_url}/register_dp_rank", data=body, headers=headers, timeout=5
            )
            if r.status_code != 200:
                logger.error("sgl-nixl: room %s: register_dp_rank refused: %s", self.bootstrap_room, r.text[:300])
        except requests.RequestException as exc:
            logger.error("sgl-nixl: room %s: register_dp_rank failed: %s", self.bootstrap_room, exc)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.room_seen.pop(self.bootstrap_room, None)
        self.kv_mgr.remote_free.pop(self.bootstrap_room, None)
