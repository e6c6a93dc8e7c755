"""The bootstrap server (runs in the prefill's main process): SGLang's routes."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer


class NixlPluginKVBootstrapServer(CommonKVBootstrapServer):
    pass
