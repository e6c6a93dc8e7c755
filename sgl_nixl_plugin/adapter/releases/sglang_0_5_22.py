"""SGLang 0.5.22: the abort-ACK API of 0.5.23, but each backend writes its own ``send``,
``poll``, ``failure_exception``, registration and ``send_metadata`` (``adapter.template``)."""

from __future__ import annotations

from sgl_nixl_plugin.adapter import manager, receiver, sender
from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
from sgl_nixl_plugin.adapter.contract import (
    GENERATION_ACKS,
    SHARED,
    TEMPLATE,
    ReliedSignature,
    relied,
)
from sgl_nixl_plugin.adapter.template import ManagerTemplate, ReceiverTemplate, SenderTemplate

RELEASE = "0.5.22"

SIGNATURES: tuple[ReliedSignature, ...] = (
    *SHARED,
    *GENERATION_ACKS,
    *TEMPLATE,
    relied(
        "CommonKVSender.__init__",
        "(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False)",
    ),
)


class NixlPluginKVManager(manager.NixlPluginKVManager, ManagerTemplate):
    pass


class NixlPluginKVSender(sender.NixlPluginKVSender, SenderTemplate):
    pass


class NixlPluginKVReceiver(receiver.NixlPluginKVReceiver, ReceiverTemplate):
    pass


__all__ = [
    "RELEASE",
    "SIGNATURES",
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
