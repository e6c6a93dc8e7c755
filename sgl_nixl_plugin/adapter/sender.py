"""Prefill-side sender: SGLang's common sender, plus cleanup of our per-room entries."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVSender


class NixlPluginKVSender(CommonKVSender):
    def clear(self) -> None:
        super().clear()
        self.kv_mgr.room_seen.pop(self.bootstrap_room, None)
        self.kv_mgr.remote_free.pop(self.bootstrap_room, None)
