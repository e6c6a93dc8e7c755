"""One SGLang rank in its own process, driving the real KV classes like a scheduler would.

The classes come only from SGLang's ``load_plugins()`` + ``get_kv_class``, so the same
code drives our plugin or SGLang's in-tree backend (with ``SGLANG_PLUGINS`` excluding us).
Prefill fills each room's pages with a known pattern; decode checks every byte it got.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench.workload import (
    AUX_ITEM_BYTES,
    STATE_ITEM_BYTES,
    ModelShape,
    PagePool,
    Request,
    Workload,
    aux_pattern,
    pattern,
    state_pattern,
)
from sgl_nixl_plugin.registry import hookimpl
from sgl_nixl_plugin.registry import manager as registry

logger = logging.getLogger("sgl_nixl_plugin.bench")


@dataclass
class RankSpec:
    role: str  # prefill | decode | bootstrap
    instance: int
    tp_size: int
    tp_rank: int
    workload: Workload
    bootstrap_port: int  # the port this prefill instance registers to / serves
    prefill_addrs: list[str] = field(default_factory=list)  # decode: one per prefill instance
    n_prefill: int = 1
    n_decode: int = 1
    serve_bootstrap: bool = False
    mem_kind: str = "DRAM"
    gpu_id: int = 0
    env: dict[str, str] = field(default_factory=dict)
    deadline_s: float = 300.0
    verify: bool = True
    pp_size: int = 1  # pipeline stages of this rank's server
    pp_rank: int = 0
    pp_port: int = 0  # a PP prefill's gloo rendezvous (its instance's ranks), on 127.0.0.1
    dp_size: int = 1  # attention DP groups of this rank's server (DP attention when > 1)
    # decode: registers with its prefills at start-up (SGLANG_NIXL_PLUGIN_PREFILLS), and
    # sends its first request to each once that is done
    preconnect: bool = False

    @property
    def rank(self) -> int:
        """SGLang's world rank within the server: PP stage-major, TP rank within a stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def attn_tp_size(self) -> int:
        """Ranks of one attention DP group (SGLang: TP size // DP size)."""
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def attn_dp_rank(self) -> int:
        return self.tp_rank // self.attn_tp_size

    def my_requests(self) -> list[Request]:
        """This rank's requests (``requests_of``)."""
        return requests_of(
            self.workload.make_requests(),
            self.role,
            self.instance,
            self.n_prefill if self.role == "prefill" else self.n_decode,
            self.dp_size,
            self.attn_dp_rank,
        )

    def prefill_addr_of(self, index: int) -> str:
        return self.prefill_addrs[index % self.n_prefill]


def requests_of(
    reqs: Sequence[Request], role: str, instance: int, instances: int, dp_size: int, dp_rank: int
) -> list[Request]:
    """The requests of attention DP group ``dp_rank`` of server ``instance`` of ``role``.

    Request i goes to prefill instance i % n_prefill and decode instance i % n_decode. In a
    server with DP attention, as SGLang routes by default: a prefill's DP controller sends a
    room to DP rank ``room % dp_size`` (``follow_bootstrap_room``, which its sender checks), a
    decode's deals its requests round robin (``round_robin``), whatever their rooms.
    """
    mine = [r for i, r in enumerate(reqs) if i % instances == instance]
    if dp_size == 1:
        return mine
    if role == "prefill":
        return [r for r in mine if r.room % dp_size == dp_rank]
    return [r for j, r in enumerate(mine) if j % dp_size == dp_rank]


#: ``SGLANG_PLUGINS`` of an in-tree run: no general plugin loads, so SGLang's own nixl serves.
INTREE_PLUGINS = "__none__"


def _setup(spec: RankSpec) -> dict[str, Any]:
    """Publish SGLang's runtime config for this rank and fetch the backend's classes."""
    os.environ.update(spec.env)
    w = spec.workload
    pp_group = None
    if spec.role == "prefill" and spec.pp_size > 1 and spec.pp_port:
        # SGLang's prefill keeps its statuses in a PPConsensusStore, built over the PP group
        pp_group = harness.GlooPPGroup(
            spec.pp_port, spec.tp_size, spec.pp_size, spec.tp_rank, spec.pp_rank
        )
    sa, classes = harness.boot(
        device="cpu" if spec.mem_kind == "DRAM" else "cuda",
        tp_size=spec.tp_size,
        port=30000 + spec.instance,
        page_size=w.page_size_of(spec.role),
        disaggregation_mode=spec.role if spec.role != "bootstrap" else "prefill",
        bootstrap_port=spec.bootstrap_port,
        kv_cache_dtype=kv_cache_dtype_arg(w.shape),
        world_rank=spec.rank,
        gpu_id=spec.gpu_id,
        pp_size=spec.pp_size,
        pp_group=pp_group,
        dp_size=spec.dp_size,
    )
    return {"server_args": sa, "classes": classes}


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


def _tables(mgr: Any) -> dict[str, int]:
    """Sizes of every per-room table (they must all return to zero; ``count.*`` are
    counters, ``nixl.*`` live engine resources)."""
    if hasattr(mgr, "room_tables"):
        return mgr.room_tables()
    from sgl_nixl_plugin.adapter.sglang_rooms import sglang_table_sizes  # imports SGLang

    return sglang_table_sizes(mgr)


class _Collector:
    """A registry observer that keeps each room's TransferEvent (descriptors, path)."""

    def __init__(self) -> None:
        self.events: dict[int, Any] = {}

    @hookimpl
    def sgl_nixl_transfer_done(self, event: Any) -> None:
        self.events[event.room] = event


FLAG_POLL_S = 20e-6  # the decode loop's wait while a room waits for a completion flag


class _StatusBell:
    """Wakes a bench loop when the manager records a status change.

    The loops otherwise sleep 0.5 ms between polls, which puts ~0.3 ms of the bench's own
    wait into every request's latency (spinning instead starves the plugin's threads of
    the GIL). The timeout keeps the timed steps (chunk gaps) and the abort checks going.
    A status concluded for the decode (``conclude_transfer``: local status, then the
    message) rings once the message left: rung before, the woken loop took the GIL from
    the thread about to send it (measured ~0.15 ms later at the decode).
    """

    WAIT_S = 0.0005

    def __init__(self, mgr: Any) -> None:
        self._event = threading.Event()
        self._held = threading.local()  # inside conclude_transfer on this thread: ring after
        update = mgr.update_status

        def update_status(*args: Any, **kwargs: Any) -> Any:
            try:
                return update(*args, **kwargs)
            finally:
                if getattr(self._held, "depth", 0):
                    self._held.rang = True
                else:
                    self._event.set()

        mgr.update_status = update_status
        conclude = getattr(mgr, "conclude_transfer", None)
        if conclude is None:
            return

        def conclude_transfer(*args: Any, **kwargs: Any) -> Any:
            held = self._held
            held.depth = getattr(held, "depth", 0) + 1
            try:
                return conclude(*args, **kwargs)
            finally:
                held.depth -= 1
                if not held.depth and getattr(held, "rang", False):
                    held.rang = False
                    self._event.set()

        mgr.conclude_transfer = conclude_transfer

    def wait(self, timeout_s: float | None = None) -> None:
        self._event.wait(self.WAIT_S if timeout_s is None else timeout_s)
        self._event.clear()  # before the polls that follow: a later change rings again


def run_prefill(spec: RankSpec, env: dict[str, Any], done: Any) -> dict[str, Any]:
    KVPoll = harness.kv_poll()
    cls = env["classes"]
    pools = Pools(spec)
    server = None
    if spec.serve_bootstrap:
        server = cls["bootstrap_server"](host="127.0.0.1", port=spec.bootstrap_port)
    collector = _Collector()
    registry.get_plugin_manager().register(collector)
    is_mla = spec.workload.shape.mla
    mgr = cls["manager"](
        pools.kv_args(cls["kvargs"], spec),
        harness.disaggregation_mode("prefill"),
        env["server_args"],
        is_mla,
    )
    bell = _StatusBell(mgr)
    w = spec.workload
    pool = PagePool(pools.pages, seed=w.seed + 17 * spec.instance + 1)
    slots = list(range(1, pools.aux_rows))
    pending = spec.my_requests()
    active: dict[int, dict[str, Any]] = {}
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + spec.deadline_s
    while (pending or active) and time.monotonic() < deadline:
        while pending and len(active) < w.concurrency:
            r = pending[0]
            pages = pool.alloc(r.pages(w.page_size), r.contiguous)
            if pages is None:
                break
            pending.pop(0)
            slot = slots.pop()
            if spec.verify:
                pools.fill(r.room, pages)
            for b, buf in enumerate(pools.aux):
                n = AUX_ITEM_BYTES[b]
                buf[slot * n : (slot + 1) * n] = aux_pattern(r.room, b, n)
            if r.with_state:
                row = pools.state_row(slot)
                pat = state_pattern(r.room, STATE_ITEM_BYTES)
                if spec.mem_kind == "VRAM":
                    import torch

                    row.copy_(torch.from_numpy(pat))
                else:
                    row[:] = pat
            sender = cls["sender"](
                mgr=mgr, bootstrap_addr=f"127.0.0.1:{spec.bootstrap_port}", bootstrap_room=r.room
            )
            active[r.room] = {
                "req": r,
                "sender": sender,
                "pages": pages,
                "slot": slot,
                "sent": False,
                "t0": time.perf_counter(),
            }
        for room, ctx in list(active.items()):
            sender, r = ctx["sender"], ctx["req"]
            status = sender.poll()
            if status == KVPoll.WaitingForInput and not ctx["sent"]:
                ctx["sent"] = True
                t = time.perf_counter()
                ctx["ready_seen"], ctx["send_wall"] = t, time.time()
                sender.init(len(ctx["pages"]), ctx["slot"])
                ctx["parts"] = r.split(ctx["pages"])
                ctx["tokens"] = r.chunk_tokens([len(p) for p in ctx["parts"]], w.page_size)
                ctx["next"], ctx["next_at"] = 0, t + r.send_delay_ms * 1e-3
                ctx["control_us"] = (time.perf_counter() - t) * 1e6
            if ctx["sent"] and ctx["next"] < len(ctx["parts"]) and status != KVPoll.Failed:
                # chunked prefill: the next chunk once its forward pass (the gap) is over
                while ctx["next"] < len(ctx["parts"]) and time.perf_counter() >= ctx["next_at"]:
                    t = time.perf_counter()
                    i, parts = ctx["next"], ctx["parts"]
                    last = i == len(parts) - 1
                    state = (
                        [np.array([ctx["slot"]], dtype=np.int32)]
                        if (last and r.with_state)
                        else None
                    )
                    sender.send(
                        parts[i].astype(np.int32),
                        state_indices=state,
                        num_kv_tokens=ctx["tokens"][i],
                    )
                    ctx["control_us"] += (time.perf_counter() - t) * 1e6
                    ctx["next"], ctx["next_at"] = i + 1, t + w.chunk_gap_ms * 1e-3
            elif status in (KVPoll.Success, KVPoll.Failed):
                reason = None
                if status == KVPoll.Failed:
                    try:
                        sender.failure_exception()
                    except Exception as exc:
                        reason = str(exc)
                else:
                    sender.clear()
                results[room] = {
                    "ok": status == KVPoll.Success,
                    "send_wall": ctx.get("send_wall"),
                    "reason": reason,
                    "control_us": ctx.get("control_us", 0.0),
                    "ready_ms": (ctx.get("ready_seen", ctx["t0"]) - ctx["t0"]) * 1e3,
                }
                pool.release(ctx["pages"])
                slots.append(ctx["slot"])
                del active[room]
        bell.wait()
    timed_out = [r.room for r in pending] + list(active)
    done.wait(timeout=max(1.0, deadline - time.monotonic()))
    for room, res in results.items():  # the manager's report of each room (it may come
        ev = collector.events.get(room)  # just after the status the loop saw)
        res["descriptors"] = getattr(ev, "descriptors", None)
        res["path"] = getattr(ev, "path", None)
        if ev is not None and ev.timeline:
            logger.debug(
                "bench prefill room %s: WaitingForInput seen %.3f ms after the sender was "
                "made, send() calls %.0f us; room timeline %s",
                room,
                res["ready_ms"],
                res["control_us"],
                ev.timeline,
            )
    time.sleep(0.2)  # let the last status frames leave before the sockets close
    tables = _tables(mgr)
    close = getattr(mgr, "close", None)
    if close is not None:
        close()
    if server is not None:
        server.close()
    out = {"results": results, "timed_out": timed_out, "tables": tables}
    ipc = sys.modules.get("sgl_nixl_plugin.engine.cuda_ipc")
    if ipc is not None:  # CUDA IPC mappings still open after the manager closed: 0
        out["ipc_open"] = ipc.open_mappings()
    return out


def _prefill_registered(addr: str) -> bool:
    """Whether the bootstrap at ``addr`` has every prefill rank (the open aggregate query)."""
    import requests

    q = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
    try:
        return requests.get(f"http://{addr}/route?{q}", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _started_up(mgr: Any, addr: str) -> bool:
    """The decode's start-up registration with ``addr`` is done (always, for a backend
    without one): ``SGLANG_NIXL_PLUGIN_PREFILLS`` named it."""
    ready = getattr(mgr, "prefill_ready", None)
    return ready is None or bool(ready(addr))


def run_decode(
    spec: RankSpec, env: dict[str, Any], progress: Any = None, before_close: Any = None
) -> dict[str, Any]:
    KVPoll = harness.kv_poll()
    cls = env["classes"]
    pools = Pools(spec)
    is_mla = spec.workload.shape.mla
    started = time.perf_counter()  # time to ready: from here to the first request sent
    ready_s: float | None = None
    mgr = cls["manager"](
        pools.kv_args(cls["kvargs"], spec),
        harness.disaggregation_mode("decode"),
        env["server_args"],
        is_mla,
    )
    bell = _StatusBell(mgr)
    # rooms that end through a completion flag ring no bell: poll them as SGLang's decode
    # scheduler does while transfers are pending (every loop)
    flags_pending = getattr(getattr(mgr, "decode", None), "flags_pending", lambda: False)
    w = spec.workload
    pool = PagePool(pools.pages, seed=w.seed + 31 * spec.instance + 7 * spec.tp_rank + 2)
    # SGLang's host allocator hands out page 0 too (only the device pools keep it back)
    host_pool = PagePool(pools.pages, seed=w.seed + 13 * spec.tp_rank + 5, padding_page=False)
    host_dst = harness.host_destination() if w.host_every else None
    if host_dst is not None and not mgr.supports_host_destination:
        raise RuntimeError("the decode manager does not support host KV destinations")
    slots = list(range(1, pools.aux_rows))
    reqs = spec.workload.make_requests()
    index_of = {r.room: i for i, r in enumerate(reqs)}
    pending = spec.my_requests()
    active: dict[int, dict[str, Any]] = {}
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + spec.deadline_s
    ready: set[str] = set()
    resolved: set[str] = set()
    probed: dict[Any, float] = {}
    found: dict[str, float] = {}  # when each prefill was first seen up (its handshake starts)
    steps: dict[str, dict[str, float]] = {}  # when its parallel info came, when it was ready
    dp_ranks: dict[int, int] = {}  # resolved for the next room, before its pages are taken
    prefill_dp: dict[int, int] = {}  # the prefill DP rank each room was received from
    held: dict[int, tuple[dict[str, Any], float]] = {}  # failed host rooms, pages kept
    painted: dict[int, np.ndarray] = {}  # aborted rooms' pages, painted once safe
    while (pending or active or held) and time.monotonic() < deadline:
        while pending and len(active) < w.concurrency:
            r = pending[0]
            addr = spec.prefill_addr_of(index_of[r.room])
            if addr not in ready:
                if addr not in resolved:
                    # SGLang logs an ERROR for every query that finds the prefill not
                    # registered yet: ask quietly (every 50 ms) until it is, then let SGLang
                    # fetch its info
                    if time.monotonic() - probed.get(addr, 0.0) < 0.05:
                        break
                    probed[addr] = time.monotonic()
                    if not _prefill_registered(addr):
                        break
                    if spec.preconnect and not _started_up(mgr, addr):
                        break
                    # a user's first request reaches this decode now, at the earliest: its
                    # clock starts here, handshake included (``handshake_s``); a decode that
                    # registered at start-up is taken to have been up a while by then
                    found.setdefault(addr, time.perf_counter())
                    if not mgr.try_ensure_parallel_info(addr):
                        break
                    resolved.add(addr)
                    steps[addr] = {"info": time.perf_counter()}
                # as SGLang's decode scheduler, the request goes on at once: a backend's own
                # set-up of the pair (ours: registration, link, warm-up) is in its transfer
                ready.add(addr)
            # the prefill DP rank that holds the room, as SGLang's decode resolves it (the
            # bootstrap is asked, at most every 20 ms, when the prefill does not follow rooms)
            dp_rank = dp_ranks.get(r.room)
            if dp_rank is None:
                if time.monotonic() - probed.get(r.room, 0.0) < 0.02:
                    break
                probed[r.room] = time.monotonic()
                dp_rank = harness.resolve_prefill_dp_rank(mgr, addr, r.room)
                if dp_rank is None:
                    break
                dp_ranks[r.room] = dp_rank
            pages = (host_pool if r.host else pool).alloc(r.pages(pools.page_size), r.contiguous)
            if pages is None:
                break
            pending.pop(0)
            slot = slots.pop()
            for buf, n in zip(pools.aux, AUX_ITEM_BYTES, strict=False):
                buf[slot * n : (slot + 1) * n] = 0
            receiver = cls["receiver"](mgr=mgr, bootstrap_addr=addr, bootstrap_room=r.room)
            receiver.init(dp_ranks.pop(r.room))
            prefill_dp[r.room] = dp_rank
            state = [np.array([slot], dtype=np.int32)] if r.with_state else None
            t0 = time.perf_counter()
            if ready_s is None:
                ready_s = t0 - started
            if r.host:
                receiver.send_metadata(pages, slot, state, destination=host_dst)
            else:
                receiver.send_metadata(pages, slot, state)
            # the first room to each prefill waited for the handshake before its clock
            handshake = parts = None
            if addr in found:
                t_found, t = found.pop(addr), steps.pop(addr, {})
                handshake = t0 - t_found
                info = t.get("info", t_found)
                # SGLang's bootstrap query; the room's route query and its receiver's start
                # (SGLang's; ours registers there)
                parts = {"info": info - t_found, "route": t0 - info}
            active[r.room] = {
                "req": r,
                "receiver": receiver,
                "pages": pages,
                "slot": slot,
                "handshake_s": handshake,
                "handshake_parts": parts,
                "t0": t0,
                "wall0": time.time(),
                "abort_at": None if r.abort_at_ms is None else t0 + r.abort_at_ms * 1e-3,
            }
        for room, ctx in list(active.items()):
            receiver, r = ctx["receiver"], ctx["req"]
            status = receiver.poll()
            if (
                ctx["abort_at"] is not None
                and status not in (KVPoll.Success, KVPoll.Failed)
                and time.perf_counter() >= ctx["abort_at"]
            ):
                receiver.abort()  # as SGLang's decode aborts a request it no longer serves
                ctx["abort_at"], ctx["aborted"] = None, True
                # the ACKs its release waits for, one per prefill rank (SGLang's count)
                ctx["acks"] = len(getattr(receiver, "bootstrap_infos", None) or ())
                status = receiver.poll()
            # SGLang's metadata gate: Success only counts once the bootstrap_room aux row landed.
            if (
                status == KVPoll.Success
                and not pools.aux[1][
                    ctx["slot"] * AUX_ITEM_BYTES[1] : (ctx["slot"] + 1) * AUX_ITEM_BYTES[1]
                ].any()
            ):
                continue
            if status not in (KVPoll.Success, KVPoll.Failed):
                continue
            latency = time.perf_counter() - ctx["t0"]
            res: dict[str, Any] = {
                "ok": status == KVPoll.Success,
                "prefill_dp_rank": prefill_dp.pop(room, None),
                "latency_s": latency,
                "reason": None,
                "wall0": ctx["wall0"],
                "wall1": time.time(),
            }
            if ctx["handshake_s"] is not None:
                res["handshake_s"] = ctx["handshake_s"]
                res["handshake_parts"] = ctx["handshake_parts"]
            if status == KVPoll.Failed:
                if ctx.get("aborted"):
                    res["aborted"] = True
                    held[room] = (ctx, time.perf_counter())  # pages kept till safe, then painted
                    try:
                        receiver.failure_exception()
                    except Exception as exc:
                        res["reason"] = str(exc)
                    results[room] = res
                    del active[room]
                    continue
                if r.host:
                    receiver.abort()  # as SGLang's decode does for a failed host receive
                try:
                    receiver.failure_exception()
                except Exception as exc:
                    res["reason"] = str(exc)
                if r.host:
                    # SGLang keeps the host pages until the receiver says that nothing more
                    # can land in them (no timeout: a remote WRITE may not have stopped)
                    res["host"] = True
                    held[room] = (ctx, time.perf_counter())
                    results[room] = res
                    del active[room]
                    continue
            else:
                receiver.clear()
                res["bytes"] = len(ctx["pages"]) * pools.item_len * len(pools.kv_ptrs)
                if r.host:
                    res["host"] = True
                if spec.verify:
                    # across page sizes only the request's tokens travel (SGLang's
                    # num_kv_tokens); equal pages travel whole
                    tokens = r.tokens if w.pages_differ else None
                    res["bad_pages"] = pools.check(room, ctx["pages"], r.host, tokens)
                    slot = ctx["slot"]
                    res["bad_aux"] = sum(
                        int(
                            not np.array_equal(
                                buf[slot * n : (slot + 1) * n], aux_pattern(room, b, n)
                            )
                        )
                        for b, (buf, n) in enumerate(zip(pools.aux, AUX_ITEM_BYTES, strict=False))
                    )
                    if r.with_state:
                        row = pools.state_row(slot)
                        got = row.cpu().numpy() if spec.mem_kind == "VRAM" else row
                        res["bad_state"] = int(
                            not np.array_equal(got, state_pattern(room, STATE_ITEM_BYTES))
                        )
            results[room] = res
            if progress is not None:
                progress(len(results))
            (host_pool if r.host else pool).release(ctx["pages"])
            slots.append(ctx["slot"])
            del active[room]
        for room, (ctx, since) in list(held.items()):
            receiver = ctx["receiver"]
            if ctx.get("aborted"):  # a device room: SGLang's decode counts the prefills' ACKs
                safe = mgr.is_abort_release_safe(room, ctx["acks"])
            else:
                safe = receiver.is_abort_release_safe()
            if safe:
                if ctx.get("aborted"):  # nothing may land from now on: paint, check at the end
                    mgr.clear_deferred_abort_state(room)
                    pools.paint(ctx["pages"])
                    painted[room] = ctx["pages"]
                receiver.clear()
                results[room]["held_s"] = time.perf_counter() - since
                if not ctx.get("aborted"):
                    host_pool.release(ctx["pages"])
                slots.append(ctx["slot"])
                del held[room]
        bell.wait(FLAG_POLL_S if flags_pending() else None)
    timed_out = [r.room for r in pending] + list(active)
    if painted:
        # checked once every room ended here: a write the prefill still made into an aborted
        # room after its ACK (a copy launched or left running past it) has landed by now,
        # the later rooms' transfers having gone through the same prefill workers after it
        for room, pages in painted.items():
            results[room]["written_after_ack"] = pools.unpainted(pages)
            pool.release(pages)
    result = {
        "results": results,
        "timed_out": timed_out,
        "host_pages_held": sorted(held),  # failed host rooms never said safe to reuse
        "tables": _tables(mgr),
        "ready_s": ready_s,
    }
    if before_close is not None:
        before_close(result)
    close = getattr(mgr, "close", None)
    if close is not None:
        close()
    return result


def run_bootstrap(spec: RankSpec, env: dict[str, Any], done: Any) -> dict[str, Any]:
    server = env["classes"]["bootstrap_server"](host="127.0.0.1", port=spec.bootstrap_port)
    done.wait(timeout=spec.deadline_s)
    server.close()
    return {"results": {}, "timed_out": [], "tables": {}}


def rank_main(spec: RankSpec, out: Any, done: Any, release: Any = None) -> None:
    """Process entry point: runs one rank and puts ``(role, instance, tp_rank, result)`` on ``out``.

    A decode rank reports as soon as its rooms are done, then keeps its manager (and NIXL
    agent) up until ``release`` is set, like a decode server that stays up: a prefill rank
    with nothing to send it (an MLA prefill rank beyond the decode TP, SGLang's "dummy"
    rank) may still be handshaking with it after the decode got all its data.
    """
    key = (spec.role, spec.instance, spec.rank)
    reported = False

    def report_then_hold(result: dict[str, Any]) -> None:
        nonlocal reported
        out.put((*key, result))
        reported = True
        if release is not None:
            release.wait(timeout=spec.deadline_s)

    try:
        logging.basicConfig(level=settings.value("BENCH_LOG"))
        if logging.getLogger().getEffectiveLevel() > logging.INFO:
            # SGLang warns at import that its CUDA-only quantization kernels are unavailable
            warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
        env = _setup(spec)
        if spec.role == "prefill":
            result = run_prefill(spec, env, done)
        elif spec.role == "decode":
            result = run_decode(
                spec, env, lambda n: out.put((*key, {"progress": n})), report_then_hold
            )
        else:
            result = run_bootstrap(spec, env, done)
        if not reported:
            out.put((*key, result))
    except BaseException:
        if not reported:
            out.put((*key, {"error": traceback.format_exc()}))
