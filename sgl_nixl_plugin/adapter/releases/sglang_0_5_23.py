"""SGLang 0.5.23: its common classes carry the backend template; ours plug in as they are."""

from __future__ import annotations

from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
from sgl_nixl_plugin.adapter.contract import GENERATION_ACKS, SHARED, ReliedSignature, relied
from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager
from sgl_nixl_plugin.adapter.receiver import NixlPluginKVReceiver
from sgl_nixl_plugin.adapter.sender import NixlPluginKVSender

RELEASE = "0.5.23"

SIGNATURES: tuple[ReliedSignature, ...] = (
    *SHARED,
    *GENERATION_ACKS,
    relied(
        "CommonKVSender.__init__",
        "(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False)",
    ),
    relied(
        "CommonKVSender.send",
        "(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None)",
    ),
    relied(
        "CommonKVReceiver.send_metadata",
        "(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, "
        "destination=KVTransferDestination.DEVICE, device_kv_indices=None)",
    ),
    relied(
        "CommonKVManager.build_receiver_metadata_message",
        "(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index, "
        "state_indices, decode_prefix_len, is_dummy, device_kv_indices=None)",
    ),
)

__all__ = [
    "RELEASE",
    "SIGNATURES",
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
