"""SGLang 0.5.22: the abort-ACK API of 0.5.23, but each backend writes its own ``send``,
``poll``, ``failure_exception``, registration and ``send_metadata`` (``adapter.template``)."""

from __future__ import annotations

from sgl_nixl_plugin.adapter import manager, receiver, sender
from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
from sgl_nixl_plugin.adapter.template import ManagerTemplate, ReceiverTemplate, SenderTemplate

RELEASE = "0.5.22"


class NixlPluginKVManager(manager.NixlPluginKVManager, ManagerTemplate):
    pass


class NixlPluginKVSender(sender.NixlPluginKVSender, SenderTemplate):
    pass


class NixlPluginKVReceiver(receiver.NixlPluginKVReceiver, ReceiverTemplate):
    pass


__all__ = [
    "RELEASE",
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
