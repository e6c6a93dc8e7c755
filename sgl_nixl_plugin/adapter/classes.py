"""Where the bridge finds our four SGLang classes: those of the installed SGLang release."""

from sgl_nixl_plugin.adapter import release_gate, releases

_name = release_gate.contract_for(release_gate.installed_sglang_version())
if _name is None:  # the bridge checks the version first; this is a direct import
    raise ImportError(" ".join(release_gate.check_version()))
_release = releases.load(_name)
NixlPluginKVBootstrapServer = _release.NixlPluginKVBootstrapServer
NixlPluginKVManager = _release.NixlPluginKVManager
NixlPluginKVReceiver = _release.NixlPluginKVReceiver
NixlPluginKVSender = _release.NixlPluginKVSender

__all__ = [
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
