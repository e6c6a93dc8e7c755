"""Where the bridge finds our four SGLang classes (one import for all of them)."""

from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager
from sgl_nixl_plugin.adapter.receiver import NixlPluginKVReceiver
from sgl_nixl_plugin.adapter.sender import NixlPluginKVSender

__all__ = [
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
