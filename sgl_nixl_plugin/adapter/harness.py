"""The calls into SGLang that the bench (``sgl_nixl_plugin.bench``) and the doctor make.

They drive SGLang's own classes the way a scheduler would, so they need SGLang; keeping the
calls here leaves ``bench`` and ``cli`` free of SGLang imports. Every function imports SGLang
when called, never at module import: the bench's parent process imports this module without
loading SGLang, and a rank sets its environment (``SGLANG_PLUGINS`` etc.) before it boots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The classes :func:`boot` fetches through ``get_kv_class``, by ``KVClassType`` name (lower case).
KV_CLASS_KINDS = ("kvargs", "manager", "sender", "receiver", "bootstrap_server")


def boot(
    *,
    device: str,
    tp_size: int,
    port: int,
    page_size: int,
    disaggregation_mode: str,
    bootstrap_port: int,
    kv_cache_dtype: str,
    world_rank: int,
    gpu_id: int,
) -> tuple[Any, dict[str, Any]]:
    """Publish SGLang's runtime context for one scheduler rank, load SGLang's plugins, and
    fetch the ``nixl`` transfer backend's classes.

    Returns ``(server_args, classes)``: the ``ServerArgs`` the rank runs with (a dummy model
    on 127.0.0.1, transfer backend ``nixl``) and one class per :data:`KV_CLASS_KINDS` entry,
    as ``get_kv_class`` answers after ``load_plugins()`` (our plugin's, or SGLang's in-tree
    backend's when ``SGLANG_PLUGINS`` leaves the plugin out).
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",
        device=device,
        tp_size=tp_size,
        host="127.0.0.1",
        port=port,
        page_size=page_size,
        disaggregation_mode=disaggregation_mode,
        disaggregation_transfer_backend="nixl",
        disaggregation_bootstrap_port=bootstrap_port,
        kv_cache_dtype=kv_cache_dtype,
    )
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=gpu_id))
    get_parallel().override_permanently(pp_group=None)
    load_plugins()  # before reading get_kv_class: the plugin rebinds it
    from sglang.srt.disaggregation import utils

    classes = {
        kind: utils.get_kv_class(
            utils.TransferBackend.NIXL, getattr(utils.KVClassType, kind.upper())
        )
        for kind in KV_CLASS_KINDS
    }
    return server_args, classes


def kv_poll() -> Any:
    """SGLang's ``KVPoll`` (the status values ``poll()`` of a sender or receiver returns)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    return KVPoll


def disaggregation_mode(role: str) -> Any:
    """SGLang's ``DisaggregationMode`` member for ``role`` ("prefill", "decode" or "null")."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return DisaggregationMode(role)


def state_type(name: str) -> Any:
    """SGLang's ``StateType`` member of that name (e.g. "mamba")."""
    from sglang.srt.disaggregation.base.conn import StateType

    return StateType(name)


def host_destination() -> Any:
    """SGLang's ``KVTransferDestination.HOST``: ``send_metadata`` into the host pool."""
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    return KVTransferDestination.HOST


def local_ip_finder() -> Callable[[], str]:
    """SGLang's own local-address detection (``get_local_ip_auto``), the address its KV
    managers bind to when neither ``SGLANG_HOST_IP`` nor ``HOST_IP`` is set.

    Returned rather than called so a caller can tell "SGLang is not importable" (this raises)
    from "SGLang found no address" (the returned function raises).
    """
    from sglang.srt.utils.network import get_local_ip_auto

    return get_local_ip_auto
