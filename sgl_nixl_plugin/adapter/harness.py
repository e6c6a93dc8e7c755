"""The calls into SGLang that the bench (``sgl_nixl_plugin.bench``) and the doctor make.

They drive SGLang's own classes the way a scheduler would, so they need SGLang; keeping the
calls here leaves ``bench`` and ``cli`` free of SGLang imports. Every function imports SGLang
when called, never at module import: the bench's parent process imports this module without
loading SGLang, and a rank sets its environment (``SGLANG_PLUGINS`` etc.) before it boots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: SGLang's modules a rank needs, which the bench's forkserver imports ahead of its ranks.
#: Their import reads none of the variables a rank sets (SGLang's settings are read when
#: used); plugins load in :func:`boot`, after the rank has its environment.
PRELOAD_MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.disaggregation.utils",
    "sglang.srt.disaggregation.common.conn",
)

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
    pp_size: int = 1,
    pp_group: Any = None,
    dp_size: int = 1,
) -> tuple[Any, dict[str, Any]]:
    """Publish SGLang's runtime context for one scheduler rank, load SGLang's plugins, and
    fetch the ``nixl`` transfer backend's classes.

    Returns ``(server_args, classes)``: the ``ServerArgs`` the rank runs with (a dummy model
    on 127.0.0.1, transfer backend ``nixl``) and one class per :data:`KV_CLASS_KINDS` entry,
    as ``get_kv_class`` answers after ``load_plugins()`` (our plugin's, or SGLang's in-tree
    backend's when ``SGLANG_PLUGINS`` leaves the plugin out).

    ``dp_size`` > 1: DP attention (``--enable-dp-attention --dp-size dp_size``, which SGLang
    0.5.23 resolves to ``--attn-dp-size``), ``tp_size // dp_size`` ranks per attention DP
    group. The rank is published as SGLang's DP controller launches it under DP attention
    (``SpawnRanks.dp_rank`` = its attention DP rank), and ``load_balance_method`` is the one
    SGLang resolves for a PD server (``follow_bootstrap_room`` on a prefill, ``round_robin``
    on a decode): with the dummy model the resolution stops before that step, which would
    leave ``auto`` in the bootstrap registration.
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    dp_args: dict[str, Any] = {}
    dp_rank = None
    if dp_size > 1:
        if tp_size % dp_size:
            raise ValueError(f"TP {tp_size} does not split into {dp_size} attention DP groups")
        fields = getattr(ServerArgs, "__dataclass_fields__", {})
        if "attn_dp_size" in fields:  # SGLang 0.5.23+: the deprecated pair resolves to it
            dp_args["attn_dp_size"] = dp_size
        else:
            dp_args.update(enable_dp_attention=True, dp_size=dp_size)
        dp_args["load_balance_method"] = (
            "follow_bootstrap_room" if disaggregation_mode == "prefill" else "round_robin"
        )
        # the DP controller's compute_dp_attention_world_info: tp_rank // attention TP size
        dp_rank = (world_rank % tp_size) // (tp_size // dp_size)
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
        pp_size=pp_size,
        **dp_args,
    )
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank, gpu_id=gpu_id),
    )
    get_parallel().override_permanently(pp_group=pp_group)
    load_plugins()  # before reading get_kv_class: the plugin rebinds it
    from sglang.srt.disaggregation import utils

    classes = {
        kind: utils.get_kv_class(
            utils.TransferBackend.NIXL, getattr(utils.KVClassType, kind.upper())
        )
        for kind in KV_CLASS_KINDS
    }
    return server_args, classes


def resolve_prefill_dp_rank(mgr: Any, bootstrap_addr: str, room: int) -> int | None:
    """The prefill DP rank a decode's receiver for ``room`` is initialised with, chosen as
    SGLang's ``DecodePreallocQueue`` chooses it (``_resolve_prefill_dp_rank``: 0 for a
    prefill without DP, ``room % dp_size`` for one that follows the bootstrap room), else
    asked of the bootstrap server (``/query_dp_ranks``, where the prefill rank that took the
    room registered it). None: not known yet (ask again later)."""
    from types import SimpleNamespace

    info = mgr.prefill_info_table.get(bootstrap_addr)
    if info is not None and info.dp_size == 1:
        # SGLang's answer too, without importing its scheduler's modules (on the GPU
        # machine those need packages the carried wheel set leaves out, e.g. openai)
        return 0
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    host, _, port = bootstrap_addr.rpartition(":")
    req = SimpleNamespace(
        disagg_prefill_dp_rank=None,
        bootstrap_room=room,
        bootstrap_host=host,
        bootstrap_port=int(port),
    )
    rank = DecodePreallocQueue._resolve_prefill_dp_rank(SimpleNamespace(kv_manager=mgr), req)
    if rank is not None:
        return int(rank)
    if bootstrap_addr not in mgr.prefill_info_table:
        return None
    got = CommonKVReceiver.query_prefill_dp_ranks(bootstrap_addr, [room])
    rank = got.get(str(room), got.get(room)) if isinstance(got, dict) else None
    return None if rank is None else int(rank)


def pp_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The ``[start, end)`` layers SGLang gives pipeline stage ``pp_rank`` of ``pp_size``
    (``get_pp_indices``: even, the remainder on the last stages, or
    ``SGLANG_PP_LAYER_PARTITION``)."""
    from sglang.srt.distributed.utils import get_pp_indices

    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    return int(start), int(end)


class GlooPPGroup:
    """Stands in for SGLang's PP ``GroupCoordinator`` where a scheduler would have one: the
    prefill's ``PPConsensusStore`` only broadcasts its rank 0's address through it. One gloo
    world per prefill instance (its TP x PP ranks, rendezvous on 127.0.0.1), one group per
    TP rank (that rank's PP stages), as SGLang groups them."""

    def __init__(self, port: int, tp_size: int, pp_size: int, tp_rank: int, pp_rank: int):
        import torch.distributed as dist

        self._dist = dist
        world = tp_size * pp_size
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            world_size=world,
            rank=pp_rank * tp_size + tp_rank,
        )
        groups = [dist.new_group([p * tp_size + t for p in range(pp_size)]) for t in range(tp_size)]
        self._group = groups[tp_rank]
        self._tp_size, self._tp_rank = tp_size, tp_rank
        self.world_size, self.rank_in_group = pp_size, pp_rank

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(
            box, src=src * self._tp_size + self._tp_rank, group=self._group
        )
        return box[0]

    def close(self) -> None:
        self._dist.destroy_process_group()


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
