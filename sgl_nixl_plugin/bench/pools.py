"""A bench rank's KV, aux and state buffers, the byte patterns in them, and its ``KVArgs``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench.spec import INTREE_PLUGINS, RankSpec
from sgl_nixl_plugin.bench.workload import (
    AUX_ITEM_BYTES,
    STATE_ITEM_BYTES,
    ModelShape,
    pattern,
)


def _host_buffer(nbytes: int, mem_kind: str) -> np.ndarray:
    """A decode host pool's buffer: pinned next to a GPU pool, as SGLang pins its host pool
    (pageable memory would halve device-to-host copies), else plain touched pages."""
    if mem_kind == "VRAM":
        import torch

        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return np.full(nbytes, 0, dtype=np.uint8)


class Pools:
    """KV, aux and state buffers of one rank (numpy for DRAM, torch for VRAM)."""

    def __init__(self, spec: RankSpec, aux_item_bytes: Sequence[int] = AUX_ITEM_BYTES) -> None:
        """``aux_item_bytes``: one metadata buffer per entry, of that many bytes a row. The
        bench's loops use the default two (output ids, bootstrap_room); another layout
        (e.g. that of SGLang's ``MetadataBuffers``) is for checking the ``KVArgs`` only."""
        w = spec.workload
        self.shape = w.shape
        self.page_size = w.page_size_of(spec.role)
        self.pages_differ = w.pages_differ  # only the request's tokens travel, not whole pages
        # a rank holds the heads of its attention TP rank (all of TP without DP attention)
        self.heads = w.shape.heads_per_rank(spec.attn_tp_size)
        self.head_words = w.shape.head_bytes // 4
        self.pages = w.pool_pages(spec.role)
        self.item_len = self.page_size * self.heads * w.shape.head_bytes
        self.aux_rows = 4 * w.concurrency + 4
        self.mem_kind = spec.mem_kind
        # a pipeline stage holds its layers only: K then V regions (MLA: one) of each
        self.layers = (
            harness.pp_layers(w.shape.layers, spec.pp_rank, spec.pp_size)
            if spec.pp_size > 1
            else (0, w.shape.layers)
        )
        first, end = self.layers
        halves = 1 if w.shape.mla else 2
        #: each local region's index in the whole model's list (the byte pattern's ``r``)
        self.region_ids = [h * w.shape.layers + i for h in range(halves) for i in range(first, end)]
        nbytes = self.pages * self.item_len
        if spec.mem_kind == "VRAM":
            import torch

            torch.cuda.set_device(spec.gpu_id)
            self._t = [
                torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{spec.gpu_id}")
                for _ in self.region_ids
            ]
            self.kv_ptrs = [t.data_ptr() for t in self._t]
            self._st = torch.zeros(
                self.aux_rows * STATE_ITEM_BYTES, dtype=torch.uint8, device=f"cuda:{spec.gpu_id}"
            )
            self.state_ptr = self._st.data_ptr()
        else:
            # np.full touches every page now, so page faults don't land inside transfers
            self.kv = [np.full(nbytes, 0, dtype=np.uint8) for _ in self.region_ids]
            self.kv_ptrs = [a.ctypes.data for a in self.kv]
            self.state = np.zeros(self.aux_rows * STATE_ITEM_BYTES, dtype=np.uint8)
            self.state_ptr = self.state.ctypes.data
        self.kv_len = nbytes
        # a decode's host pool (SGLang's host receive): host memory, the device pool's items
        self.host: list[np.ndarray] = []
        if spec.role == "decode" and w.host_every:
            self.host = [_host_buffer(nbytes, spec.mem_kind) for _ in self.region_ids]
        self.aux_item_bytes = tuple(aux_item_bytes)
        self.aux = [np.zeros(self.aux_rows * n, dtype=np.uint8) for n in self.aux_item_bytes]
        self.global_heads = (
            np.zeros(1, np.int64)
            if w.shape.mla
            else spec.attn_tp_rank * self.heads + np.arange(self.heads)
        )

    def region_words(self, r: int, host: bool = False) -> Any:
        """Region ``r`` (of the host pool: ``host``) as (pages, tokens, heads, words)
        uint32: a numpy or torch view."""
        if host:
            return (
                self.host[r]
                .view(np.uint32)
                .reshape(self.pages, self.page_size, self.heads, self.head_words)
            )
        if self.mem_kind == "VRAM":
            import torch

            t = self._t[r].view(torch.int32)
            return t.view(self.pages, self.page_size, self.heads, self.head_words)
        return (
            self.kv[r]
            .view(np.uint32)
            .reshape(self.pages, self.page_size, self.heads, self.head_words)
        )

    def fill(self, room: int, pages: np.ndarray) -> None:
        n = np.arange(len(pages))
        for r, rid in enumerate(self.region_ids):
            pat = pattern(room, rid, n, self.page_size, self.global_heads, self.head_words)
            self._write(r, pages, pat)

    def _write(self, r: int, pages: np.ndarray, pat: np.ndarray) -> None:
        view = self.region_words(r)
        if self.mem_kind == "VRAM":
            import torch

            idx = torch.as_tensor(pages, device=view.device, dtype=torch.long)
            view[idx] = torch.from_numpy(pat.view(np.int32)).to(view.device)
        else:
            view[pages] = pat

    def check(
        self, room: int, pages: np.ndarray, host: bool = False, tokens: int | None = None
    ) -> int:
        """Number of pages (over all regions) whose bytes differ from the pattern, in the
        request's first ``tokens`` tokens (None: every token of its pages)."""
        n = np.arange(len(pages))
        bad = 0
        for r, rid in enumerate(self.region_ids):
            pat = pattern(room, rid, n, self.page_size, self.global_heads, self.head_words)
            view = self.region_words(r, host)
            if self.mem_kind == "VRAM" and not host:
                import torch

                got = (
                    view[torch.as_tensor(pages, device=view.device, dtype=torch.long)]
                    .cpu()
                    .numpy()
                    .view(np.uint32)
                )
            else:
                got = view[pages]
            wrong = (got != pat).reshape(len(pages) * self.page_size, -1).any(axis=1)
            if tokens is not None:
                wrong[tokens:] = False  # past the request: no side's data
            bad += int(np.count_nonzero(wrong.reshape(len(pages), -1).any(axis=1)))
        return bad

    PAINT = 0x5A5A5A5A  # what an aborted room's pages hold once the abort was safe

    def _pages_of(self, r: int, pages: np.ndarray) -> Any:
        view = self.region_words(r)
        if self.mem_kind == "VRAM":
            import torch

            return view, torch.as_tensor(pages, device=view.device, dtype=torch.long)
        return view, pages

    def paint(self, pages: np.ndarray) -> None:
        """Overwrite ``pages`` (device pool, every region) with ``PAINT``."""
        for r in range(len(self.region_ids)):
            view, idx = self._pages_of(r, pages)
            view[idx] = self.PAINT

    def unpainted(self, pages: np.ndarray) -> int:
        """Pages (over all regions) written since ``paint``."""
        bad = 0
        for r in range(len(self.region_ids)):
            view, idx = self._pages_of(r, pages)
            got = view[idx]
            got = got.cpu().numpy() if self.mem_kind == "VRAM" else got
            same = got.view(np.uint32) == self.PAINT
            bad += int(np.count_nonzero(~same.reshape(len(pages), -1).all(axis=1)))
        return bad

    def state_row(self, slot: int) -> Any:
        if self.mem_kind == "VRAM":
            return self._st[slot * STATE_ITEM_BYTES : (slot + 1) * STATE_ITEM_BYTES]
        return self.state[slot * STATE_ITEM_BYTES : (slot + 1) * STATE_ITEM_BYTES]

    def kv_args(self, kvargs_cls: Any, spec: RankSpec) -> Any:
        """SGLang's ``KVArgs`` for this rank, as SGLang hands it to the manager.

        Exactly the fields ``PrefillBootstrapQueue._init_kv_manager`` (prefill.py) or
        ``DecodePreallocQueue._init_kv_manager`` (decode.py) set before they construct the
        manager, with the values they compute for a pool like this one: a plain MHA/MLA
        pool, or, with ``workload.state``, a hybrid (linear-attention) pool whose attention
        layers are these regions and whose one state component is the per-request slot.
        A field SGLang does not set on that side stays unset: ``KVArgs`` only annotates it,
        so reading it raises ``AttributeError``, as it would in a real server.
        tests/component/test_kvargs_contract.py checks this against SGLang's own methods.
        """
        if spec.role not in ("prefill", "decode"):
            raise ValueError(f"a {spec.role} rank has no KV pool")
        w = spec.workload
        shape = w.shape
        prefill = spec.role == "prefill"
        hybrid = w.state  # SGLang reports a per-request state only for a hybrid pool
        # what SGLang's is_mla_backend(pool) answers: a hybrid pool is never MLA to it
        mla_pool = shape.mla and not hybrid
        n = len(self.kv_ptrs)
        a = kvargs_cls()
        # a prefill's is its TP rank, a decode's its attention TP rank (tp_rank % attn_tp_size)
        a.engine_rank = spec.tp_rank if prefill else spec.attn_tp_rank
        a.pp_rank = spec.pp_rank
        # get_parallel().dp_rank: None without a DP controller; under DP attention the
        # controller launches each rank with its attention DP rank
        a.system_dp_rank = spec.attn_dp_rank if spec.dp_size > 1 else None
        a.kv_cache_dtype_str = kv_cache_dtype_str(shape)
        declared = getattr(kvargs_cls, "__annotations__", {})  # fields differ by release
        if "kv_layout" in declared:  # SGLang 0.5.23+: only DeepSeek V4 pools name a layout
            a.kv_layout = None
        a.kv_data_ptrs = list(self.kv_ptrs)
        a.kv_data_lens = [self.kv_len] * n
        a.kv_item_lens = [self.item_len] * n
        a.num_draft_entries = 0
        # Layer ids come only from hybrid pools (K regions then V regions); plain pools: []
        first, end = self.layers
        a.kv_layer_ids = list(range(first, end)) * (n // (end - first)) if hybrid else []
        a.page_size = self.page_size
        a.aux_data_ptrs = [b.ctypes.data for b in self.aux]
        a.aux_data_lens = [b.nbytes for b in self.aux]
        a.aux_item_lens = list(self.aux_item_bytes)
        a.ib_device = None
        a.gpu_id = spec.gpu_id
        if prefill:
            a.rust_http_port = None
            # the stage's first layer (prefill._transfer_start_layer: pool.start_layer) and
            # KVCache.end_layer, which SGLang's pool configurator sets to the stage's end
            # (exclusive); a hybrid pool has none
            a.prefill_start_layer = first
            a.prefill_end_layer = None if hybrid else end
            if not mla_pool:  # head counts: a prefill's, of a pool SGLang does not call MLA
                a.kv_head_num = self.heads
                a.total_kv_head_num = shape.kv_heads
        else:
            # SGLang labels a decode's KV pool VRAM for NIXL whatever the device
            a.kv_data_mem_kinds = ["VRAM"] * n
            if self.host:
                # DecodePreallocQueue._init_kv_manager with host receive on: the host pool
                # group's buffers, checked equal in layout to the device pool's (no host
                # state: that is SWA only, and this pool has none)
                a.host_kv_data_ptrs = [h.ctypes.data for h in self.host]
                a.host_kv_data_lens = [h.nbytes for h in self.host]
                a.host_kv_item_lens = [self.item_len] * n
        if spec.mem_kind == "DRAM" and spec.env.get("SGLANG_PLUGINS") == INTREE_PLUGINS:
            # SGLang's in-tree backend believes the label (a prefill without one: VRAM) and
            # UCX refuses host memory as VRAM: it can only run on DRAM with the label fixed,
            # as the real-server stage's control run does (tests/realserver/shims).
            a.kv_data_mem_kinds = ["DRAM"] * n
        # setup_state_kv_args (disaggregation/utils.py)
        a.state_types, a.state_data_ptrs, a.state_data_lens = [], [], []
        a.state_item_lens, a.state_layer_ids, a.state_dim_per_tensor = [], [], []
        a.state_slice_outer_counts, a.state_conv_shard_groups = [], []
        a.is_hybrid_mla_backend = hybrid and shape.mla
        if "swa_kv_cache_layout" in declared:  # SGLang 0.5.22+
            a.swa_kv_cache_layout = None
        a.mla_compression_ratios = None
        if hybrid:
            # one replicated per-request state tensor (dim 0: not sliced across TP), of a
            # state layer numbered after the attention layers
            a.state_types.append(harness.state_type(w.state_kind))
            a.state_data_ptrs.append([self.state_ptr])
            a.state_data_lens.append([self.aux_rows * STATE_ITEM_BYTES])
            a.state_item_lens.append([STATE_ITEM_BYTES])
            a.state_dim_per_tensor.append([0])
            a.state_conv_shard_groups.append([None])
            a.state_slice_outer_counts.append([1])
            a.state_layer_ids.append([shape.layers])
        return a


def kv_cache_dtype_arg(shape: ModelShape) -> str:
    """The ``--kv-cache-dtype`` a server of ``shape`` runs with: ``auto`` keeps the model's
    dtype (a bfloat16/float16/float32 pool); an fp8 pool of an unquantized model asks."""
    return "fp8_e4m3" if shape.dtype == "fp8_e4m3" else "auto"


def kv_cache_dtype_str(shape: ModelShape) -> str:
    """SGLang's ``ModelRunner.kv_cache_dtype_str`` for that server: the dtype it resolved
    (fp8 for an FP8-quantized checkpoint under ``auto``), else the argument as given, so
    ``auto`` for a pool in the model's own dtype."""
    if shape.dtype in ("fp8_e4m3", "float8_e4m3fn"):
        return "fp8_e4m3"
    return kv_cache_dtype_arg(shape)
