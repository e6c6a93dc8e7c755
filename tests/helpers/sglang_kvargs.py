"""Capture the ``KVArgs`` SGLang's own ``_init_kv_manager`` builds, next to the bench's.

Run in a fresh subprocess (``python tests/helpers/sglang_kvargs.py prefill|decode [CASE...]``);
it prints one JSON line after ``RESULT_MARKER``. For every case of ``CASES`` asked for:

* the bench side: ``Pools(spec).kv_args(...)`` (sgl_nixl_plugin/bench/pools.py), after the
  bench's own ``setup(spec)`` has published SGLang's runtime context for the rank;
* the SGLang side: SGLang 0.5.23's real ``PrefillBootstrapQueue._init_kv_manager`` or
  ``DecodePreallocQueue._init_kv_manager``, on a queue made with ``object.__new__`` that
  holds only what the method reads: a real CPU pool of the same geometry
  (``MHATokenToKVPool`` / ``MLATokenToKVPool`` / ``HybridLinearKVPool`` over a
  ``MambaPool``), real ``MetadataBuffers``, and a namespace for the scheduler. The
  module's ``get_kv_class`` is replaced so the manager class is ``CapturingManager``,
  which records ``vars(kv_args)`` as it is when the constructor runs (and the method's
  result shows what SGLang set on the same object afterwards).

``prefill.py`` and ``decode.py`` import more at module level than the light dependency set
holds (openai, partial_json_parser, einops): ci/requirements-sglang-server.txt brings them.
"""

from __future__ import annotations

import copy
import enum
import json
import sys
import types
from dataclasses import dataclass
from typing import Any

RESULT_MARKER = "@@KVARGS@@"


@dataclass(frozen=True)
class Case:
    name: str
    shape: str  # a preset of sgl_nixl_plugin.bench.workload, or "tiny-fp8"
    page_size: int
    tp_size: int = 1
    tp_rank: int = 0
    state: bool = False  # True: a hybrid pool (attention layers + one Mamba layer)
    staging: bool = False  # decode only: the queue runs with SGLANG_DISAGG_STAGING_BUFFER
    roles: tuple[str, ...] = ("prefill", "decode")
    pp_size: int = 1  # a pipeline stage's pool: its layers only
    pp_rank: int = 0
    dp_size: int = 1  # DP attention: attention DP groups of the server


CASES = (
    Case("mha-p1", "tiny", 1),
    Case("mha-p16", "tiny", 16),
    Case("mla-p1", "tiny-mla", 1),
    Case("mla-p16", "tiny-mla", 16),
    Case("mha-p16-tp2-rank1", "tiny", 16, tp_size=2, tp_rank=1),
    Case("mha-fp8-p16", "tiny-fp8", 16),
    Case("hybrid-mha-p16", "tiny", 16, state=True),
    Case("hybrid-mla-p16", "tiny-mla", 16, state=True),
    Case("mha-p16-staging", "tiny", 16, staging=True, roles=("decode",)),
    # pipeline stages: the tiny shapes' 4 layers at PP 3 split 1 + 1 + 2 (SGLang's
    # get_pp_indices), so stage 2 holds layers 2 and 3
    Case("mha-p16-pp3-stage2", "tiny", 16, pp_size=3, pp_rank=2),
    Case("mla-p16-pp2-stage1", "tiny-mla", 16, pp_size=2, pp_rank=1),
    # DP attention: TP 4 in two attention DP groups; rank 3 is attention TP rank 1 of DP
    # group 1 (a prefill's engine_rank is its TP rank, a decode's its attention TP rank)
    Case("mha-p16-tp4dp2-rank3", "tiny", 16, tp_size=4, tp_rank=3, dp_size=2),
)


CASE_BY_NAME = {c.name: c for c in CASES}


def case_groups(role: str) -> list[list[str]]:
    """The cases of ``role``, one list per subprocess: a process publishes one TP layout
    (SGLang keeps a rank it was given once: republishing a smaller TP size fails)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for c in CASES:
        if role in c.roles:
            key = (c.tp_size, c.tp_rank, c.pp_size, c.pp_rank, c.dp_size)
            groups.setdefault(key, []).append(c.name)
    return list(groups.values())


def _plain(value: Any) -> Any:
    """JSON-able form of a KVArgs value (enums by name)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _snapshot(kv_args: Any) -> dict[str, Any]:
    return {k: _plain(v) for k, v in vars(kv_args).items()}


class CapturingManager:
    """Stands in for the manager class: records the KVArgs at construction, does nothing."""

    supports_host_destination = False
    records: list[dict[str, Any]] = []

    def __init__(
        self, kv_args: Any, mode: Any, server_args: Any, is_mla_backend: Any = False, **kwargs: Any
    ) -> None:
        CapturingManager.records.append(
            {
                "fields": _snapshot(copy.deepcopy(kv_args)),
                "mode": getattr(mode, "value", str(mode)),
                "is_mla_backend": bool(is_mla_backend),
                "kwargs": sorted(kwargs),
                "server_args_is_published": server_args is not None,
            }
        )
        self.kv_args = kv_args


def _shape(name: str) -> Any:
    from sgl_nixl_plugin.bench.workload import PRESETS, ModelShape

    if name == "tiny-fp8":  # an fp8 KV cache of a bfloat16 model (--kv-cache-dtype fp8_e4m3)
        return ModelShape("tiny-fp8", 4, 4, 16, "fp8_e4m3")
    return PRESETS[name]


def _pool_dtype(shape: Any, server_args: Any) -> tuple[Any, str]:
    """The pool's torch dtype and ``kv_cache_dtype_str``, as SGLang resolves them.

    The dtype comes from SGLang's own ``configure_kv_cache_dtype``; the string follows
    ``ModelRunner.configure_kv_cache_dtype``: the resolved name if there is one, else the
    ``--kv-cache-dtype`` argument itself."""
    import torch
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    model_dtype = {"float16": torch.float16, "float32": torch.float32}.get(
        shape.dtype, torch.bfloat16
    )
    resolved, dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=server_args.kv_cache_dtype,
        model=None,
        model_dtype=model_dtype,
        is_draft_worker=False,
        is_dflash=False,
        speculative_draft_attention_backend=None,
    )
    return dtype, resolved if resolved is not None else server_args.kv_cache_dtype


def _sglang_pool(case: Case, shape: Any, pools: Any, dtype: Any) -> Any:
    """A real SGLang CPU pool holding as many bytes per region as the bench's pool."""
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
    )

    # SGLang allocates size + page_size rows per region (page 0 is padding)
    size = (pools.pages - 1) * case.page_size
    # a stage's pool as SGLang's KV cache configurator builds it: its layers, numbered from
    # start_layer, with end_layer the stage's end (exclusive)
    first, end = pools.layers
    stage = {"layer_num": end - first, "start_layer": first, "end_layer": end}
    layers = shape.layers
    rope = shape.head_dim // 2
    mla = {"kv_lora_rank": shape.head_dim - rope, "qk_rope_head_dim": rope}
    if case.state:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.memory_pool import MambaPool

        mamba_layers = [layers]  # one linear-attention layer after the attention layers
        params = Mamba2CacheParams(
            shape=Mamba2StateShape.create(
                tp_world_size=case.tp_size,
                intermediate_size=8,
                n_groups=1,
                num_heads=2,
                head_dim=4,
                state_size=4,
                conv_kernel=2,
            ),
            layers=mamba_layers,
        )
        mamba = MambaPool(
            size=pools.aux_rows,
            spec_state_size=pools.aux_rows,
            cache_params=params,
            mamba_layer_ids=mamba_layers,
            device="cpu",
        )
        return HybridLinearKVPool(
            size=size,
            dtype=dtype,
            page_size=case.page_size,
            head_num=pools.heads,
            head_dim=shape.head_dim,
            full_attention_layer_ids=list(range(layers)),
            device="cpu",
            mamba_pool=mamba,
            use_mla=shape.mla,
            **(mla if shape.mla else {}),
        )
    if shape.mla:
        return MLATokenToKVPool(
            size=size,
            page_size=case.page_size,
            dtype=dtype,
            device="cpu",
            enable_memory_saver=False,
            **stage,
            **mla,
        )
    return MHATokenToKVPool(
        size=size,
        page_size=case.page_size,
        dtype=dtype,
        head_num=pools.heads,
        head_dim=shape.head_dim,
        device="cpu",
        enable_memory_saver=False,
        **stage,
    )


def _metadata_buffers(rows: int, dtype: Any) -> Any:
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        size=rows, hidden_size=64, hidden_states_dtype=dtype, max_sampling_mask_tokens=16
    )


def capture(role: str, case: Case) -> dict[str, Any]:
    import torch
    from sglang.srt.disaggregation import decode as decode_mod
    from sglang.srt.disaggregation import prefill as prefill_mod
    from sglang.srt.disaggregation import utils
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, is_mla_backend

    from sgl_nixl_plugin.bench.pools import Pools
    from sgl_nixl_plugin.bench.rank import RankSpec, setup
    from sgl_nixl_plugin.bench.workload import Workload

    shape = _shape(case.shape)
    w = Workload(
        shape,
        page_size=case.page_size,
        requests=1,
        min_tokens=16,
        max_tokens=64,
        concurrency=2,
        state=case.state,
        extra_pool_pages=4,
    )
    spec = RankSpec(
        role,
        0,
        case.tp_size,
        case.tp_rank,
        w,
        bootstrap_port=0,
        mem_kind="DRAM",
        pp_size=case.pp_size,
        pp_rank=case.pp_rank,
        dp_size=case.dp_size,
    )
    env = setup(spec)  # the bench's own publish of SGLang's runtime context

    # the bench side, with aux buffers laid out like SGLang's MetadataBuffers
    aux_item_lens = _metadata_buffers(1, torch.float16).get_buf_infos()[2]
    pools = Pools(spec, aux_item_bytes=aux_item_lens)
    bench = _snapshot(pools.kv_args(env["classes"]["kvargs"], spec))

    # the SGLang side
    dtype, dtype_str = _pool_dtype(shape, env["server_args"])
    pool = _sglang_pool(case, shape, pools, dtype)
    layers = shape.layers + (1 if case.state else 0)
    scheduler = types.SimpleNamespace(
        server_args=env["server_args"],
        rust_server=None,  # prefill: no Rust HTTP front end
        enable_hisparse=False,  # decode
        tp_worker=types.SimpleNamespace(
            model_runner=types.SimpleNamespace(kv_cache_dtype_str=dtype_str)
        ),
        model_config=types.SimpleNamespace(
            num_hidden_layers=layers,
            hf_text_config=types.SimpleNamespace(
                full_attention_layer_ids=list(range(shape.layers))
            ),
            get_total_num_kv_heads=lambda: shape.kv_heads,
        ),
    )
    module = prefill_mod if role == "prefill" else decode_mod
    queue_cls = (
        prefill_mod.PrefillBootstrapQueue if role == "prefill" else decode_mod.DecodePreallocQueue
    )
    queue = object.__new__(queue_cls)
    queue.transfer_backend = TransferBackend.NIXL
    queue.tp_rank = case.tp_rank
    queue.pp_rank = case.pp_rank
    queue.token_to_kv_pool = pool
    queue.draft_token_to_kv_pool = None
    queue.metadata_buffers = _metadata_buffers(pools.aux_rows, torch.float16)
    queue.is_mla_backend = is_mla_backend(pool)  # as the queue's __init__ sets it
    queue.scheduler = scheduler
    if role == "decode":
        queue.enable_staging = case.staging

    real_get_kv_class = utils.get_kv_class

    def get_kv_class(backend: Any, class_type: Any) -> Any:
        if class_type == KVClassType.MANAGER:
            return CapturingManager
        return real_get_kv_class(backend, class_type)

    CapturingManager.records.clear()
    saved = module.get_kv_class
    module.get_kv_class = get_kv_class
    try:
        mgr = queue._init_kv_manager()
    finally:
        module.get_kv_class = saved
    if len(CapturingManager.records) != 1:
        raise RuntimeError(f"{len(CapturingManager.records)} managers constructed, not 1")
    record = CapturingManager.records[0]
    return {
        "case": case.name,
        "role": role,
        "bench": bench,
        "sglang": record["fields"],
        "after": _snapshot(mgr.kv_args),
        "manager": {k: record[k] for k in ("mode", "is_mla_backend", "kwargs")},
        "pool": type(pool).__name__,
        "kvargs_class": f"{type(mgr.kv_args).__module__}.{type(mgr.kv_args).__qualname__}",
        "heads_per_rank": pools.heads,
    }


def _preload() -> None:
    """Import what ``capture`` needs once, before the per-group children fork from here."""
    import torch
    from sglang.srt.disaggregation import decode, prefill, utils  # noqa: F401
    from sglang.srt.mem_cache import memory_pool  # noqa: F401

    from sgl_nixl_plugin.bench import rank  # noqa: F401

    torch.set_num_threads(1)


def _capture_group(role: str, names: list[str]) -> dict[str, Any]:
    return {"role": role, "cases": [capture(role, CASE_BY_NAME[n]) for n in names]}


def main(argv: list[str]) -> None:
    """``ROLE [CASE ...]``: those cases (all of ROLE's by default), in one process;
    ``all``: every role's groups (``case_groups``), each in a child forked from this process
    after one SGLang import, a core's worth at a time (a group publishes one TP layout,
    which a process keeps once given)."""
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if argv == ["all"]:
        import multiprocessing
        import os

        _preload()
        groups = [(role, g) for role in ("prefill", "decode") for g in case_groups(role)]
        workers = max(1, min(len(groups), os.cpu_count() or 1))
        with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=1) as pool:
            results = pool.starmap(_capture_group, groups, chunksize=1)
        print(RESULT_MARKER + json.dumps(results), flush=True)
        return
    role, names = argv[0], set(argv[1:])
    cases = [capture(role, c) for c in CASES if role in c.roles and (not names or c.name in names)]
    out = {"role": role, "cases": cases}
    print(RESULT_MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
