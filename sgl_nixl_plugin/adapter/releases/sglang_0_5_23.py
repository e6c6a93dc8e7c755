"""SGLang 0.5.23: its common classes carry the backend template; ours plug in as they are."""

from __future__ import annotations

from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager
from sgl_nixl_plugin.adapter.receiver import NixlPluginKVReceiver
from sgl_nixl_plugin.adapter.sender import NixlPluginKVSender

RELEASE = "0.5.23"


__all__ = [
    "RELEASE",
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
