"""Prefill-side sender: SGLang's common sender, signed DP-rank registration, and cleanup.

A sender created after its decode already gave the room up (the decode's abort can beat the
request to this prefill) fails at once with the decode's reason.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.disaggregation.common.conn import CommonKVSender

from sgl_nixl_plugin.transport import bootstrap_client

logger = logging.getLogger(__name__)


class NixlPluginKVSender(CommonKVSender):
    def __init__(
        self, mgr: Any, bootstrap_addr: str, bootstrap_room: int, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, *args, **kwargs)
        reason = mgr.prefill.claim_early_abort(bootstrap_room)
        if reason is not None and self.conclude_state is None:
            logger.error("sgl-nixl: room %s: %s", bootstrap_room, reason)
            mgr.prefill.ctx.sglang.fail(bootstrap_room, reason)

    def _register_prefill_dp_rank(self) -> None:
        bootstrap_client.post_dp_rank(
            self.bootstrap_server_url,
            self.bootstrap_room,
            self.kv_mgr.attn_dp_rank,
            self.kv_mgr.settings.secret,
        )

    def abort(self) -> None:
        """SGLang's abort, atomic with the transfer worker's conclusion (``SGLangRooms``)."""
        with self.kv_mgr.prefill.ctx.sglang.outcome_lock:
            super().abort()

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.prefill.release(self.bootstrap_room)
