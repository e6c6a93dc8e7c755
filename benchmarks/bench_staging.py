"""Benchmark: staged KV transfer (ours) against the ceiling and the other ways, two processes.

A sender process (prefill) and a receiver process (decode) each own a paged KV pool
(Llama-3.1-8B shape by default: 32 layers x K,V = 64 regions; 8 KV heads x 128 x bf16 =
2 KiB per token per region). Pages are allocated at random on both sides (different
permutations). Per page size, every row moves the same requests' bytes in the same run:

1. ceiling      -- one contiguous copy of the request's bytes (VRAM: torch device copy on
                   the sender GPU, or the GPU0 -> GPU1 peer copy; DRAM: numpy.copyto);
2. one WRITE    -- one NIXL WRITE of the same bytes, staging buffer to staging buffer;
3. per-page     -- ``TransferEngine.write``: one descriptor per page per region, what
                   SGLang's in-tree backend submits (prepared lists, NIXL merges runs);
4. plain staging-- gather all -> one WRITE -> scatter all, sequential, no overlap;
5. ours         -- the product's staged path, as ``sgl-nixl-plugin bench`` runs it: a PD
                   session of the bench's drivers (``sgl_nixl_plugin.bench.session``,
                   SGLang's classes, our plugin, ``TRANSFER_PATH=staging``) over the same
                   requests (token counts, shape), one at a time, pages at random;
6. ours, B     -- row 5 again in a session of its own with other settings
                   (``--b-map-units``, ``--b-env NAME=VALUE``), for an A/B in one run;
7. one pass    -- the receiver exports its pool by CUDA IPC (``engine.cuda_ipc``); the
                   sender maps it and writes the request's pages into the receiver's pages
                   with ONE ``TritonCopier.pair_copy`` of all layers, then tells the receiver
                   over the Pipe. VRAM only, and only where the two processes may map each
                   other's memory (one GPU or peers; else skipped, with the reason).

Rows 4 and 7 are timed end to end on the sender: from the first gather (row 7: the
index preparation) until the receiver's last "scattered" reply (row 7: its reply to "the
copy's event has completed"). Rows 5 and 6 are timed from what the product reports of
each room (``TransferEvent`` and ``ReceiveEvent`` stamps, one clock for both processes):
from the prefill's transfer worker claiming the request's chunk (its first gather follows
at once) until the decode's last piece is scattered. Rows 1-3 are timed on the sender
until the copy or WRITE completes. The destination is checked byte-exact (first and last
request by default) for rows 3, 4 and 7, after the destination pages were cleared; rows 5
and 6 check every byte of every request (the bench's decode does; ``--verify none``: none).
By default the engine rows take turns per request (``--order interleaved``), so that a
shared machine's drift hits them alike; each has one untimed warm-up. Rows 5 and 6 run
after them, each in its own session (the decodes register with their prefill at start-up,
so the first request finds the pair linked and warmed). Ratios are medians over the
requests both rows ran. The engine agents run without NIXL's progress thread (our
default): the receiver progresses its agent every ``--recv-progress-us`` while waiting, as
the adapter's decode listener does; without that, UCX wire-up over TCP never completes.

    python benchmarks/bench_staging.py --mem VRAM --page-size 1 16 --json out.json
    python benchmarks/bench_staging.py --mem DRAM --quick          # CPU smoke test

Rows 5 and 6 need what ``sgl-nixl-plugin bench`` needs (SGLang, pluggy); each request's
steps after the worker's claim come from the product's per-room stamps (first and last
WRITE posted, first and last piece at the decode, last scattered, status applied, Success
seen). The engine copy of row 5 that they replace also timed each piece's hand-offs and
the sender's calls (and took ``--pipeline-pieces``, ``--min-piece-mib``, ``--b-pieces``,
``--warm-us``, ``--recv-spin-ms``); the product plans its own pieces, and its stamps are
per room: ``benchmarks/product_timeline.py`` prints them step by step.

Every wait is bounded; child processes are always stopped; a failing row prints its
error and the others still run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402

ROWS = ("ceiling", "write", "perpage", "plain", "ours", "oursb", "ipc")
RUN_ORDER = ("ceiling", "write", "plain", "ipc", "perpage")  # engine rows; slow one last
SESSION_ROWS = ("ours", "oursb")  # the product, through the bench's session
LABELS = {
    "ceiling": "1 ceiling: contiguous copy",
    "write": "2 one NIXL WRITE (1 descriptor)",
    "perpage": "3 per-page descriptors (SGLang)",
    "plain": "4 plain staging, no overlap",
    "ours": "5 ours: the product, staged",
    "oursb": "6 ours, variant B (--b-*)",
    "ipc": "7 one pass: pair_copy over IPC",
}
VERIFIED_ROWS = ("perpage", "plain", "ours", "oursb", "ipc")
_PLUGGY_STUBBED = False


def _ensure_pluggy() -> None:
    """``sgl_nixl_plugin.registry`` imports pluggy; the engine rows use none of its hooks.

    Where pluggy is not installed (the bare GPU machine) a stub stands in, so that the
    engine modules import; rows 5-6 (the product, whose hooks report each room) then fail
    with an error and the engine rows still run.
    """
    global _PLUGGY_STUBBED
    try:
        import pluggy  # noqa: F401
    except ImportError:
        import types

        stub = types.ModuleType("pluggy")

        class _Marker:
            def __init__(self, project_name: str) -> None:
                self.project_name = project_name

            def __call__(self, function: Any = None, **_: Any) -> Any:
                return function if function is not None else (lambda f: f)

        class _NoManager:
            def __init__(self, *_: Any, **__: Any) -> None:
                raise RuntimeError("pluggy is not installed (bench_staging stub)")

        stub.HookspecMarker = _Marker  # type: ignore[attr-defined]
        stub.HookimplMarker = _Marker  # type: ignore[attr-defined]
        stub.PluginManager = _NoManager  # type: ignore[attr-defined]
        sys.modules["pluggy"] = stub
        _PLUGGY_STUBBED = True


_ensure_pluggy()

from sgl_nixl_plugin.engine import cuda_ipc  # noqa: E402
from sgl_nixl_plugin.engine.descriptors import expected_descriptors  # noqa: E402
from sgl_nixl_plugin.engine.engine import Memory, TransferEngine  # noqa: E402
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet  # noqa: E402
from sgl_nixl_plugin.registry.spec import AgentConfig  # noqa: E402
from sgl_nixl_plugin.settings import STAGING_DEFAULTS, Settings  # noqa: E402

MiB = 1 << 20


# ----------------------------------------------------------------------------- options
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--mem", choices=("DRAM", "VRAM"), default="VRAM")
    p.add_argument("--send-gpu", type=int, default=0)
    p.add_argument("--recv-gpu", type=int, default=0)
    p.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=None, help="default 50 (3 with --quick)")
    p.add_argument("--min-tokens", type=int, default=None, help="default 4096 (256 with --quick)")
    p.add_argument("--max-tokens", type=int, default=None, help="default 8192 (512 with --quick)")
    p.add_argument("--layers", type=int, default=32, help="regions = 2 x layers (K and V)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype-bytes", type=int, choices=(1, 2, 4), default=2, help="2 = bf16")
    p.add_argument(
        "--staging-mib",
        type=int,
        default=None,
        help="rows 5-6: the product's staging buffer (SGLANG_NIXL_PLUGIN_STAGING_BYTES); "
        "default: the plugin's VRAM default (16 with --quick)",
    )
    p.add_argument(
        "--slot-mib",
        type=int,
        default=None,
        help="rows 5-6: its slots (SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES); "
        "default: the plugin's VRAM default (2 with --quick)",
    )
    p.add_argument(
        "--rows", nargs="+", choices=ROWS, default=list(ROWS), help="rows to run (default: all)"
    )
    p.add_argument(
        "--copier",
        choices=("auto", "triton", "torch", "numpy"),
        default="auto",
        help="make_copier(prefer=...) for the one-pass row",
    )
    p.add_argument(
        "--recv-progress-us",
        type=float,
        default=1000.0,
        help="receiver: progress its NIXL agent this often while waiting for a "
        "message (the adapter's decode listener uses 1 ms; 0 spins)",
    )
    p.add_argument(
        "--map-units",
        choices=("on", "off"),
        default=None,
        help="gathers (row 5: the product's, SGLANG_NIXL_PLUGIN_MAP_INDICES) and the "
        "one-pass copy read the request's indices from pinned host memory instead of "
        "uploading them first (default: the plugin's setting)",
    )
    p.add_argument(
        "--b-map-units",
        choices=("on", "off"),
        default=None,
        help="row 6: ours with --map-units set so",
    )
    p.add_argument(
        "--b-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="row 6: ours with this variable set in its ranks (repeatable), e.g. "
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES=4194304",
    )
    p.add_argument("--num-threads", type=int, default=0, help="NIXL backend threads (0: default)")
    p.add_argument(
        "--per-page-requests",
        type=int,
        default=0,
        help="requests for the per-page row (0: all, or 2 at page size 1 on VRAM)",
    )
    p.add_argument(
        "--order",
        choices=("interleaved", "rows"),
        default="interleaved",
        help="interleaved: per request every row in turn (drift hits all rows "
        "alike); rows: one row over all requests, then the next",
    )
    p.add_argument("--verify", choices=("first-last", "all", "none"), default="first-last")
    p.add_argument(
        "--row-budget-s",
        type=float,
        default=90.0,
        help="a row starts no new request after this long",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="whole run (0: none); split over the page sizes, rows shortened to fit",
    )
    p.add_argument("--req-timeout-s", type=float, default=60.0, help="bound on one request")
    p.add_argument(
        "--setup-timeout-s",
        type=float,
        default=240.0,
        help="bound on process start, allocation and linking",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true", help="few small requests (CI smoke test)")
    p.add_argument(
        "--host-torch",
        action="store_true",
        help="DRAM only: run the torch code paths (pool, ceiling, plain staging, "
        "pattern, verification) on CPU tensors, to test them without a GPU",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="run both processes under cProfile; their top functions go to DIR",
    )
    p.add_argument("--json", default=None, help="write the results here (after each page size)")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "requests": 3 if q else 50,
        "min_tokens": 256 if q else 4096,
        "max_tokens": 512 if q else 8192,
        "staging_mib": 16 if q else STAGING_DEFAULTS["VRAM"][0] // MiB,
        "slot_mib": 2 if q else STAGING_DEFAULTS["VRAM"][1] // MiB,
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.min_tokens < 1 or args.max_tokens < args.min_tokens:
        p.error("need 1 <= --min-tokens <= --max-tokens")
    if args.requests < 1:
        p.error("--requests must be >= 1")
    if args.host_torch and args.mem != "DRAM":
        p.error("--host-torch is for --mem DRAM")
    has_b = args.b_env or args.b_map_units is not None
    if any("=" not in kv for kv in args.b_env):
        p.error("--b-env takes NAME=VALUE")
    if "oursb" in args.rows and not has_b:
        if "--rows" in (argv if argv is not None else sys.argv):
            p.error("row oursb needs --b-map-units or --b-env")
        args.rows = [r for r in args.rows if r != "oursb"]
    if args.slot_mib < 1 or args.staging_mib < args.slot_mib:
        p.error("need 1 <= --slot-mib <= --staging-mib")
    return args


def geometry_of(cfg: dict, page_size: int) -> dict:
    regions = 2 * cfg["layers"]
    token_bytes = cfg["kv_heads"] * cfg["head_dim"] * cfg["dtype_bytes"]
    item = page_size * token_bytes
    max_pages = -(-cfg["max_tokens"] // page_size)
    pool_pages = 2 * max_pages
    return {
        "regions": regions,
        "item": item,
        "max_pages": max_pages,
        "pool_pages": pool_pages,
        "max_bytes": regions * max_pages * item,
    }


def workload_of(cfg: dict, page_size: int) -> Any:
    """The requests as the bench's session runs them (rows 5-6): this shape, one request at
    a time, random pages, no state row."""
    from sgl_nixl_plugin.bench.workload import ModelShape, Workload

    dtype = {1: "fp8_e4m3", 2: "bfloat16", 4: "float32"}[cfg["dtype_bytes"]]
    shape = ModelShape("bench_staging", cfg["layers"], cfg["kv_heads"], cfg["head_dim"], dtype)
    return Workload(
        shape,
        page_size=page_size,
        requests=cfg["requests"],
        min_tokens=cfg["min_tokens"],
        max_tokens=cfg["max_tokens"],
        concurrency=1,
        fragmentation="random",
        state=False,
        seed=cfg["seed"],
    )


def make_requests(cfg: dict, page_size: int) -> list[dict]:
    """Token counts (the bench workload's: same for every page size and every row) and
    random pages on both sides."""
    g = geometry_of(cfg, page_size)
    tokens = [r.tokens for r in workload_of(cfg, page_size).make_requests()]
    src_rng = np.random.default_rng(cfg["seed"] + 1000 + page_size)
    dst_rng = np.random.default_rng(cfg["seed"] + 2000 + page_size)
    out = []
    for i, t in enumerate(tokens):
        n = -(-int(t) // page_size)
        out.append(
            {
                "i": i,
                "tokens": int(t),
                "pages": n,
                "bytes": g["regions"] * n * g["item"],
                "src": src_rng.permutation(g["pool_pages"])[:n].astype(np.int64),
                "dst": dst_rng.permutation(g["pool_pages"])[:n].astype(np.int64),
            }
        )
    return out


# ----------------------------------------------------------------------------- pattern
def _pattern_np(r: int, pages: np.ndarray, elems: int) -> np.ndarray:
    """Deterministic bf16 words (as int16) for region ``r``, rows ``pages``: (n, elems)."""
    p = pages.astype(np.int64).reshape(-1, 1)
    e = np.arange(elems, dtype=np.int64).reshape(1, -1)
    h = p * 0x9E3779B1 + e * 0x85EBCA77 + (r + 1) * 0xC2B2AE3D
    h ^= h >> 17
    h = (h & 0xFFFFFFFF) * 0x27D4EB2F
    h ^= h >> 31
    return ((h & 0xFFFF) - 32768).astype(np.int16)


def _pattern_torch(r: int, pages: Any, elems: int) -> Any:
    import torch

    p = pages.to(torch.int64).reshape(-1, 1)
    e = torch.arange(elems, dtype=torch.int64, device=pages.device).reshape(1, -1)
    h = p * 0x9E3779B1 + e * 0x85EBCA77 + (r + 1) * 0xC2B2AE3D
    h ^= h >> 17
    h = (h & 0xFFFFFFFF) * 0x27D4EB2F
    h ^= h >> 31
    return ((h & 0xFFFF) - 32768).to(torch.int16)


# ----------------------------------------------------------------------------- copier
def load_copier(mem: str, device: int, prefer: str = "auto") -> tuple[Any, str]:
    """The one-pass row's copier (``pair_copy``)."""
    from sgl_nixl_plugin.engine.copy_kernels import make_copier

    copier = make_copier(mem, device, prefer=prefer)
    return copier, f"copy_kernels.make_copier -> {type(copier).__name__}"


# ----------------------------------------------------------------------------- one side
class Side:
    """A process's pool, engine and one request-sized staging buffer."""

    def __init__(self, cfg: dict, page_size: int, device: int) -> None:
        self.cfg, self.mem, self.device = cfg, cfg["mem"], device
        g = geometry_of(cfg, page_size)
        self.R, self.item, self.P = g["regions"], g["item"], g["pool_pages"]
        self.max_bytes = g["max_bytes"]
        self.elems = self.item // 2
        self.torch = None
        self.cuda = self.mem == "VRAM"
        if self.cuda or cfg["host_torch"]:
            import torch

            self.torch = torch
            if self.cuda:
                torch.cuda.set_device(device)  # before the NIXL agent exists
            else:
                torch.set_num_threads(1)  # two processes on few cores: no OpenMP spinning
            self.dev = torch.device(f"cuda:{device}" if self.cuda else "cpu")
            # One spare item between regions: no two regions are adjacent (no merging
            # across regions), as with SGLang's separately allocated layer buffers.
            self.pool = torch.zeros(
                (self.R, self.P + 1, self.item), dtype=torch.uint8, device=self.dev
            )
            base = self.pool.data_ptr()
            self.big = torch.zeros(self.max_bytes, dtype=torch.uint8, device=self.dev)
            self.big_ptr = self.big.data_ptr()
        else:
            self.pool = np.zeros((self.R, self.P + 1, self.item), dtype=np.uint8)
            self.pool.fill(0)  # touch every page now: no faults inside the timed rows
            base = self.pool.ctypes.data
            self.big = np.zeros(self.max_bytes, dtype=np.uint8)
            self.big.fill(0)
            self.big_ptr = self.big.ctypes.data
        stride = (self.P + 1) * self.item
        self.region_ptrs = [base + r * stride for r in range(self.R)]
        self.kv = RegionSet.of(
            self.region_ptrs, [self.P * self.item] * self.R, [self.item] * self.R, self.mem, device
        )
        empty = RegionSet.of([], [], [], self.mem)
        self.engine = TransferEngine(
            AgentConfig(num_threads=cfg["num_threads"]), Memory(kv=self.kv, aux=empty)
        )
        self.agent = self.engine.agent
        self.agent.register(
            RegionSet((self.big_ptr,), (self.max_bytes,), (self.max_bytes,), (device,), self.mem)
        )
        self.bases = np.asarray(self.region_ptrs, dtype=np.uint64)
        self.stream = self.torch.cuda.Stream(self.dev) if self.cuda else None

    # views -----------------------------------------------------------------------
    def pages_view(self):
        return self.pool[:, : self.P]

    def stage3d(self, n: int):
        return self.big[: self.R * n * self.item].reshape(self.R, n, self.item)

    def idx(self, pages: np.ndarray):
        if self.torch is None:
            return pages
        return self.torch.from_numpy(pages).to(self.dev, non_blocking=False)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    # pattern -----------------------------------------------------------------------
    def fill_pattern(self) -> None:
        rows = max(1, (1 << 21) // self.elems)
        if self.torch is not None:
            torch = self.torch
            view = self.pool.view(torch.int16)
            for r in range(self.R):
                for p0 in range(0, self.P, rows):
                    p1 = min(self.P, p0 + rows)
                    pages = torch.arange(p0, p1, dtype=torch.int64, device=self.dev)
                    view[r, p0:p1] = _pattern_torch(r, pages, self.elems)
            self.sync()
        else:
            view = self.pool.view(np.int16)
            for r in range(self.R):
                for p0 in range(0, self.P, rows):
                    p1 = min(self.P, p0 + rows)
                    view[r, p0:p1] = _pattern_np(r, np.arange(p0, p1), self.elems)

    def clear(self, dst: np.ndarray) -> None:
        if self.torch is not None:
            self.pages_view().index_fill_(1, self.idx(dst), 0)
            self.sync()
        else:
            self.pool[:, dst] = 0

    def verify(self, src: np.ndarray, dst: np.ndarray) -> dict:
        """Compare destination pages ``dst`` with the sender's pattern for pages ``src``."""
        bad = 0
        first = None
        if self.torch is not None:
            torch = self.torch
            view = self.pool.view(torch.int16)
            s_dev, d_dev = self.idx(src), self.idx(dst)
            chunk = max(1, (1 << 22) // self.elems)
            for r in range(self.R):
                for j0 in range(0, len(src), chunk):
                    j1 = min(len(src), j0 + chunk)
                    exp = _pattern_torch(r, s_dev[j0:j1], self.elems)
                    got = view[r].index_select(0, d_dev[j0:j1])
                    rows_bad = (got != exp).any(dim=1)
                    nb = int(rows_bad.sum().item())
                    if nb and first is None:
                        j = j0 + int(torch.nonzero(rows_bad)[0].item())
                        first = {
                            "region": r,
                            "j": j,
                            "src_page": int(src[j]),
                            "dst_page": int(dst[j]),
                        }
                    bad += nb
        else:
            view = self.pool.view(np.int16)
            chunk = max(1, (1 << 21) // self.elems)
            for r in range(self.R):
                for j0 in range(0, len(src), chunk):
                    j1 = min(len(src), j0 + chunk)
                    exp = _pattern_np(r, src[j0:j1], self.elems)
                    got = view[r, dst[j0:j1]]
                    rows_bad = (got != exp).any(axis=1)
                    nb = int(rows_bad.sum())
                    if nb and first is None:
                        j = j0 + int(np.flatnonzero(rows_bad)[0])
                        first = {
                            "region": r,
                            "j": j,
                            "src_page": int(src[j]),
                            "dst_page": int(dst[j]),
                        }
                    bad += nb
        return {"bad_page_rows": bad, "page_rows": self.R * len(src), "first_bad": first}

    def close(self) -> None:
        try:
            self.engine.close()
        except Exception as exc:  # best effort at exit
            print(f"[bench_staging] engine close: {exc}", file=sys.stderr)


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()


def _recv(conn, timeout: float, kind: str | None = None):
    """One message within ``timeout`` seconds; raises on timeout, EOF or a peer error."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {kind or 'message'} from the peer within {timeout:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"receiver failed: {msg[1]}")
    if kind is not None and msg[0] != kind:
        raise RuntimeError(f"expected {kind!r} from the peer, got {msg[0]!r}")
    return msg


# ----------------------------------------------------------------------------- receiver
def _export_pool(cfg: dict, side: Side) -> tuple[Any, str]:
    """Row 7: the receiver's KV regions exported by CUDA IPC, or why not."""
    if "ipc" not in cfg["rows"]:
        return None, "not requested"
    if side.mem != "VRAM" or not side.cuda:
        return None, "needs --mem VRAM"
    if not cuda_ipc.available():
        return None, "cuda_ipc.available() is False (no GPU or no cuda.bindings)"
    try:
        ranges = [(p, side.P * side.item) for p in side.region_ptrs]
        return cuda_ipc.export_ranges(ranges, side.device), ""
    except cuda_ipc.IpcError as exc:
        return None, str(exc)


def receiver_main(cfg: dict, page_size: int, conn) -> None:
    side = None
    try:
        side = Side(cfg, page_size, cfg["recv_gpu"])
        ipc_export, ipc_error = _export_pool(cfg, side)
        conn.send(
            (
                "hello",
                {
                    "meta": side.agent.metadata,
                    "ptrs": side.region_ptrs,
                    "lens": list(side.kv.lens),
                    "item_lens": list(side.kv.item_lens),
                    "big_ptr": side.big_ptr,
                    "ipc": ipc_export,
                    "ipc_error": ipc_error,
                },
            )
        )
        dst = src = dst_dev = None
        idle = cfg["setup_timeout_s"] + cfg["req_timeout_s"] + 60
        # The agent has no progress thread: like the adapter's decode listener, progress it
        # between messages (a two-sided transport, e.g. UCX over TCP, needs the target to).
        tick = cfg["recv_progress_us"] * 1e-6
        progress = side.agent.progress if hasattr(side.agent, "progress") else (lambda: None)

        while True:
            last = time.perf_counter()
            checked = last
            # block for ``tick`` between progress calls, as the decode's control loop
            # blocks on ZMQ
            while not conn.poll(tick):
                progress()
                now = time.perf_counter()
                if now - checked > 2.0:
                    checked = now
                    if now - last >= idle or not _parent_alive():
                        print(
                            "[bench_staging] receiver: sender silent or parent gone, exiting",
                            file=sys.stderr,
                        )
                        return
            progress()
            msg = conn.recv()
            kind = msg[0]
            if kind == "stop":
                return
            try:
                if kind == "peer":
                    side.agent.add_peer(msg[1])
                elif kind == "req":
                    dst, src = msg[1], msg[2]
                    dst_dev = side.idx(dst) if side.torch is not None else dst
                elif kind == "scatter_all":
                    n = len(dst)
                    t0 = time.perf_counter()
                    stage = side.stage3d(n)
                    if side.torch is not None:
                        side.pages_view().index_copy_(1, dst_dev, stage)
                        side.sync()
                    else:
                        for r in range(side.R):
                            side.pool[r][dst] = stage[r]
                    conn.send(("scattered_all", time.perf_counter() - t0))
                elif kind == "clear":
                    side.clear(dst)
                    conn.send(("ok",))
                elif kind == "verify":
                    side.sync()
                    conn.send(("verified", side.verify(src, dst)))
                elif kind == "sync":
                    conn.send(("synced", msg[1]))
                elif kind == "ipc_done":  # row 7: the sender's one-pass copy has landed
                    conn.send(("ipc_ack", time.perf_counter()))
                else:
                    conn.send(("error", f"unknown message {kind!r}"))
            except Exception:
                conn.send(("error", traceback.format_exc(limit=4)))
    except Exception:
        tb = traceback.format_exc()
        print(f"[bench_staging] receiver failed:\n{tb}", file=sys.stderr)
        try:
            conn.send(("error", tb))
        except Exception:
            pass
    finally:
        if side is not None:
            side.close()


# ----------------------------------------------------------------------------- sender
class Sender:
    def __init__(self, cfg: dict, page_size: int, conn) -> None:
        self.cfg, self.ps, self.conn = cfg, page_size, conn
        self.mem = cfg["mem"]
        self.side = Side(cfg, page_size, cfg["send_gpu"])
        self.side.fill_pattern()
        self.copier: Any = None
        self.copier_name = "none (the one-pass row alone uses one)"
        if "ipc" in cfg["rows"] and self.mem == "VRAM":
            self.copier, self.copier_name = load_copier(self.mem, cfg["send_gpu"], cfg["copier"])
            self.copier.bind(self.side.stream)  # like a prefill transfer worker
        self._map_default = Settings.from_env().map_indices  # as a prefill sets it
        hello = _recv(conn, cfg["setup_timeout_s"], "hello")[1]
        self.peer_info = hello
        conn.send(("peer", self.side.agent.metadata))
        rdev = cfg["recv_gpu"]
        remote_kv = RegionSet.of(hello["ptrs"], hello["lens"], hello["item_lens"], self.mem, rdev)
        t0 = time.perf_counter()
        self.link = self.side.engine.link(
            hello["meta"], Memory(kv=remote_kv, aux=RegionSet.of([], [], [], self.mem))
        )
        self.link_s = time.perf_counter() - t0
        self.requests = make_requests(cfg, page_size)
        self.peer_buf = None
        if self.mem == "VRAM" and cfg["send_gpu"] != cfg["recv_gpu"]:
            torch = self.side.torch
            self.peer_buf = torch.empty(
                self.side.max_bytes, dtype=torch.uint8, device=f"cuda:{cfg['recv_gpu']}"
            )
        self.seq = 0
        self.ipc: Any = None  # row 7: the receiver's pool mapped here
        self.ipc_reason = self._open_ipc(hello) if "ipc" in cfg["rows"] else "not requested"

    def _open_ipc(self, hello: dict) -> str:
        """Row 7: map the receiver's exported pool and compile the one-pass kernel; returns
        "" when ready, else why the row is skipped."""
        if hello.get("ipc") is None:
            return hello.get("ipc_error") or "the receiver exported nothing"
        if self.copier is None:
            return "needs --mem VRAM"
        if not hasattr(self.copier, "pair_copy"):
            return f"the {type(self.copier).__name__} has no pair_copy (needs Triton)"
        dev = self.cfg["send_gpu"]
        reason = cuda_ipc.why_not(hello["ipc"], dev)
        if reason is not None:
            return f"why_not: {reason}"
        try:
            self.ipc = cuda_ipc.open_export(hello["ipc"], dev)
        except cuda_ipc.IpcError as exc:
            return str(exc)
        s = self.side
        try:
            self.ipc_src = self.copier.prepare_bases(s.bases, s.stream)
            self.ipc_dst = self.copier.prepare_bases(self.ipc.translate(hello["ptrs"]), s.stream)
            self.copier.warmup_pair(s.item, s.item, 0, s.item, 0)
        except Exception as exc:  # the other rows still run
            self.close_ipc()
            self.ipc = None
            return f"setup FAILED: {type(exc).__name__}: {exc}"
        return ""

    def close_ipc(self) -> None:
        if self.ipc is not None:
            self.side.sync()  # no copy may still be writing through the mapping
            self.ipc.close()

    # helpers -------------------------------------------------------------------------
    def _deadline(self) -> float:
        return time.perf_counter() + self.cfg["req_timeout_s"]

    def _wait(self, xfer, deadline: float) -> None:
        agent = self.side.agent
        while agent.poll(xfer) == "PROC":
            if time.perf_counter() > deadline:
                agent.release(xfer)
                raise TimeoutError(f"WRITE not done within {self.cfg['req_timeout_s']:.0f} s")
        state = xfer.state
        agent.release(xfer)
        if state != "DONE":
            raise RuntimeError(xfer.error or f"WRITE ended in state {state}")

    def ping(self, n: int = 200) -> dict:
        """Round trips of an empty control message (the receiver in its normal loop)."""
        rtts = []
        for _ in range(n):
            self.seq += 1
            t0 = time.perf_counter()
            self.conn.send(("sync", self.seq))
            msg = _recv(self.conn, self.cfg["req_timeout_s"], "synced")
            rtts.append(time.perf_counter() - t0)
            if msg[1] != self.seq:
                raise RuntimeError("ping out of step")
        a = np.asarray(rtts) * 1e6
        return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}

    def resync(self) -> None:
        """After a failed request: drain stray replies until the receiver echoes a token."""
        self.seq += 1
        token = self.seq
        self.conn.send(("sync", token))
        deadline = time.perf_counter() + self.cfg["req_timeout_s"]
        while time.perf_counter() < deadline:
            if self.conn.poll(0.5):
                msg = self.conn.recv()
                if msg[0] == "synced" and msg[1] == token:
                    return
        raise TimeoutError("receiver did not resynchronise")

    # the rows: each returns (seconds, components) for one request -------------------
    def row_ceiling(self, req: dict) -> tuple[float, dict]:
        s, nbytes = self.side, req["bytes"]
        if s.torch is not None:
            src = s.pool.view(-1)[:nbytes]
            dst = self.peer_buf[:nbytes] if self.peer_buf is not None else s.big[:nbytes]
            s.sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=s.cuda)
            s.sync()
            if self.peer_buf is not None:
                s.torch.cuda.synchronize(self.peer_buf.device)
            return time.perf_counter() - t0, {}
        src = s.pool.reshape(-1)[:nbytes]
        t0 = time.perf_counter()
        np.copyto(s.big[:nbytes], src)
        return time.perf_counter() - t0, {}

    def row_write(self, req: dict) -> tuple[float, dict]:
        s = self.side
        deadline = self._deadline()
        t0 = time.perf_counter()
        x = s.agent.write_contiguous(
            s.big_ptr,
            self.peer_info["big_ptr"],
            req["bytes"],
            peer=self.link.name,
            mem_kind=self.mem,
            remote_mem_kind=self.mem,
            local_device=self.cfg["send_gpu"],
            remote_device=self.cfg["recv_gpu"],
        )
        t_post = time.perf_counter()
        self._wait(x, deadline)
        t1 = time.perf_counter()
        return t1 - t0, {"post_ms": (t_post - t0) * 1e3}

    def row_perpage(self, req: dict, limit: int | None = None) -> tuple[float, dict]:
        s = self.side
        src, dst = req["src"], req["dst"]
        if limit is not None:
            src, dst = src[:limit], dst[:limit]
        deadline = self._deadline()
        t0 = time.perf_counter()
        x = s.engine.write(self.link, "kv", src, dst)
        self._wait(x, deadline)
        dt = time.perf_counter() - t0
        descs = expected_descriptors(src, dst, s.R, Geometry.whole_items())
        return dt, {"descriptors": descs}

    def row_plain(self, req: dict) -> tuple[float, dict]:
        s = self.side
        n = req["pages"]
        stage = s.stage3d(n)
        src_dev = s.idx(req["src"])
        s.sync()
        deadline = self._deadline()
        t0 = time.perf_counter()
        if s.torch is not None:
            s.torch.index_select(s.pages_view(), 1, src_dev, out=stage)
            s.sync()
        else:
            for r in range(s.R):
                # mode="clip": the default "raise" would buffer ``out`` (indices are valid)
                np.take(s.pool[r], req["src"], axis=0, out=stage[r], mode="clip")
        t1 = time.perf_counter()
        x = s.agent.write_contiguous(
            s.big_ptr,
            self.peer_info["big_ptr"],
            req["bytes"],
            peer=self.link.name,
            mem_kind=self.mem,
            remote_mem_kind=self.mem,
            local_device=self.cfg["send_gpu"],
            remote_device=self.cfg["recv_gpu"],
        )
        self._wait(x, deadline)
        t2 = time.perf_counter()
        self.conn.send(("scatter_all", req["bytes"]))
        scatter_s = _recv(self.conn, max(0.1, deadline - time.perf_counter()), "scattered_all")[1]
        t3 = time.perf_counter()
        return t3 - t0, {
            "gather_ms": (t1 - t0) * 1e3,
            "write_ms": (t2 - t1) * 1e3,
            "scatter_ms": scatter_s * 1e3,
        }

    def row_ipc(self, req: dict) -> tuple[float, dict]:
        """Row 7: one pair_copy of every layer's pages straight into the receiver's pages,
        timed from the first index upload to the receiver's reply to "landed"."""
        if self.ipc is None:
            raise RuntimeError(f"row ipc unavailable: {self.ipc_reason}")
        s, cfg, c = self.side, self.cfg, self.copier
        if hasattr(c, "map_units"):  # as rows 5-6 set the product's
            want = cfg["map_units"]
            c.map_units = self._map_default if want is None else want == "on"
        index = getattr(c, "_index", None)
        if index is not None:  # each request's upload, none cached from the warm-up
            index._units.clear()
        s.sync()
        done = s.torch.cuda.Event()
        deadline = self._deadline()
        _hot(True)
        t0 = time.perf_counter()
        units = [c.prepare_units(req["src"], s.stream), c.prepare_units(req["dst"], s.stream)]
        try:
            c.pair_copy(self.ipc_src, self.ipc_dst, *units, s.item, s.item, 0, s.item, 0, s.stream)
            done.record(s.stream)
            t_launched = time.perf_counter()
            while not done.query():
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"pair_copy not done within {cfg['req_timeout_s']:.0f} s")
            t_done = time.perf_counter()
        finally:
            for u in units:
                c.release_units(u, s.stream)
        self.conn.send(("ipc_done", t_done))
        _recv(self.conn, max(0.1, deadline - time.perf_counter()), "ipc_ack")
        t_end = time.perf_counter()
        _hot(False)
        return t_end - t0, {
            "launch_ms": (t_launched - t0) * 1e3,
            "copy_ms": (t_done - t0) * 1e3,
            "notify_ms": (t_end - t_done) * 1e3,
        }

    # driver --------------------------------------------------------------------------
    def row_plan(self, row: str) -> tuple[list[int], str]:
        """Which requests a row runs, and why not all of them."""
        n = len(self.requests)
        idx, note = list(range(n)), ""
        if row == "perpage":
            k = self.cfg["per_page_requests"]
            if k <= 0 and self.mem == "VRAM" and self.ps == 1:
                k = 2
                note = "2 requests only (page size 1 on VRAM: seconds per request)"
            elif k > 0:
                note = f"{k} requests (--per-page-requests)"
            if 0 < k < n:
                idx = sorted({*idx[: max(1, k - 1)], idx[-1]})[:k] if k > 1 else [0]
        if row == "ipc" and self.ipc is None:
            idx, note = [], f"skipped: {self.ipc_reason}"
        return idx, note

    def warm(self, row: str) -> None:
        """Untimed: request 0 (only its first pages for the per-page row)."""
        req = self.requests[0]
        self.conn.send(("req", req["dst"], req["src"]))
        if row == "perpage":
            self.row_perpage(req, limit=min(req["pages"], 64))
        else:
            getattr(self, f"row_{row}")(req)

    def one(self, row: str, i: int, out: dict) -> None:
        """Request ``i`` through ``row``: clear and verify the destination when sampled."""
        if not _parent_alive():
            raise SystemExit("bench_staging: parent process gone")
        reqs, mode = self.requests, self.cfg["verify"]
        req = reqs[i]
        check = row in VERIFIED_ROWS and (
            mode == "all" or (mode == "first-last" and i in (0, len(reqs) - 1))
        )
        self.conn.send(("req", req["dst"], req["src"]))
        if check:
            self.conn.send(("clear",))
            _recv(self.conn, self.cfg["req_timeout_s"], "ok")
        dt, comp = getattr(self, f"row_{row}")(req)
        out["req_idx"].append(i)
        out["times_ms"].append(dt * 1e3)
        out["bytes"].append(req["bytes"])
        out["components"].append(comp)
        if check:
            self.conn.send(("verify",))
            v = _recv(self.conn, self.cfg["req_timeout_s"] + 60, "verified")[1]
            v["request"] = i
            out["verify"].append(v)

    def failed(self, out: dict) -> None:
        """Record the error being handled, then resynchronise (``_Fatal`` if that fails)."""
        exc = sys.exc_info()[1]
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=6)
        try:
            self.resync()
        except Exception as exc2:
            out["error"] += f" (then: {exc2})"
            raise _Fatal(out) from exc2


class _Fatal(Exception):
    def __init__(self, partial: dict) -> None:
        super().__init__(partial.get("error", "fatal"))
        self.partial = partial


def _drive(sender: Sender, cfg: dict, budget_s: float, report) -> dict:
    """Run every row over the requests; returns {row: result}.

    ``interleaved`` (default): per request, every row in turn, so that drift of a shared
    machine hits all rows alike; ``rows``: one row over all requests, then the next.
    A row starts no new request once it has spent its budget.
    """
    order = tuple(r for r in RUN_ORDER if r in cfg["rows"])
    rows: dict[str, dict] = {}
    plans: dict[str, list[int]] = {}
    spent = dict.fromkeys(order, 0.0)
    active = dict.fromkeys(order, True)
    t0 = time.perf_counter()
    for row in order:
        idx, note = sender.row_plan(row)
        plans[row] = idx
        rows[row] = {
            "label": LABELS[row],
            "req_idx": [],
            "times_ms": [],
            "bytes": [],
            "components": [],
            "verify": [],
            "note": note,
            "error": "",
        }
    for row in order:
        if not plans[row]:  # a row skipped on this machine (its note says why)
            active[row] = False
            continue
        try:
            sender.warm(row)
        except Exception:
            try:
                sender.failed(rows[row])
            except _Fatal as fatal:
                rows["__fatal__"] = fatal.partial["error"]
                return rows
            finally:
                rows[row]["error"] = "warm-up: " + rows[row]["error"]
            active[row] = False

    def budget_of(row: str, rows_left: int) -> float:
        if budget_s <= 0:
            return cfg["row_budget_s"]
        left = budget_s - (time.perf_counter() - t0)
        return min(cfg["row_budget_s"], max(1.0, left / max(1, rows_left)))

    def step(row: str, i: int, budget: float) -> bool:
        out = rows[row]
        if spent[row] > budget and out["times_ms"]:
            out["note"] = (out["note"] + "; " if out["note"] else "") + (
                f"row budget {budget:.0f} s spent after {len(out['times_ms'])} requests"
            )
            active[row] = False
            return False
        t = time.perf_counter()
        try:
            sender.one(row, i, out)
        except Exception:
            sender.failed(out)
            active[row] = False
        spent[row] += time.perf_counter() - t
        return active[row]

    try:
        if cfg["order"] == "rows":
            for n_left, row in zip(range(len(order), 0, -1), order, strict=True):
                budget = budget_of(row, n_left)
                for i in plans[row]:
                    if not active[row] or not step(row, i, budget):
                        break
                report(row, rows[row], spent[row])
        else:
            # Each row is capped by --row-budget-s; the page size's budget is one deadline
            # for all (cheap rows hardly spend anything, the per-page row gets the rest).
            deadline = t0 + budget_s if budget_s > 0 else float("inf")
            for i in range(len(sender.requests)):
                if time.perf_counter() > deadline:
                    for row in order:
                        if active[row] and rows[row]["times_ms"] and plans[row][-1] >= i:
                            rows[row]["note"] = (
                                rows[row]["note"] + "; " if rows[row]["note"] else ""
                            ) + (f"time budget spent after {len(rows[row]['times_ms'])} requests")
                    break
                for row in order:
                    if active[row] and i in plans[row]:
                        step(row, i, cfg["row_budget_s"])
            for row in order:
                report(row, rows[row], spent[row])
    except _Fatal as fatal:  # the receiver is out of step: keep what was measured
        rows["__fatal__"] = fatal.partial["error"]
    return rows


def sender_main(cfg: dict, page_size: int, conn, result_conn, budget_s: float) -> None:
    sender = None
    t_start = time.perf_counter()
    result: dict[str, Any] = {"page_size": page_size, "rows": {}}
    try:
        sender = Sender(cfg, page_size, conn)
        g = geometry_of(cfg, page_size)
        result.update(
            {
                "geometry": g,
                "copier": sender.copier_name,
                "link_prepare_s": sender.link_s,
                "requests": [
                    {"i": r["i"], "tokens": r["tokens"], "pages": r["pages"], "bytes": r["bytes"]}
                    for r in sender.requests
                ],
                "setup_s": time.perf_counter() - t_start,
                "control_rtt": sender.ping(),
            }
        )
        result_conn.send(
            (
                "progress",
                f"page size {page_size}: setup done in "
                f"{result['setup_s']:.1f} s ({sender.copier_name}); "
                f"link prepared in {sender.link_s * 1e3:.0f} ms; order {cfg['order']}; "
                f"control round trip p50 {result['control_rtt']['p50_us']:.0f} us, "
                f"p99 {result['control_rtt']['p99_us']:.0f} us",
            )
        )

        if "ipc" in cfg["rows"] and sender.ipc is None:
            result_conn.send(("progress", f"  ipc: skipped: {sender.ipc_reason}"))

        def report(row: str, res: dict, spent: float) -> None:
            msg = f"  {row}: {len(res['times_ms'])} requests, {spent:.1f} s"
            if res["error"]:
                msg += f"; ERROR {res['error']}"
            result_conn.send(("progress", msg))

        left = budget_s - (time.perf_counter() - t_start) if budget_s > 0 else 0.0
        rows = _drive(sender, cfg, max(1.0, left) if budget_s > 0 else 0.0, report)
        fatal = rows.pop("__fatal__", None)
        result["rows"] = rows
        if fatal:
            result["error"] = f"stopped early, the receiver is out of step: {fatal}"
            result_conn.send(("progress", f"  FATAL {fatal}"))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    finally:
        if sender is not None:
            try:
                sender.close_ipc()  # before the receiver frees the pool
            except Exception as exc:
                print(f"[bench_staging] closing the IPC mapping: {exc}", file=sys.stderr)
        try:
            conn.send(("stop",))
        except Exception:
            pass
        try:
            result_conn.send(("result", result))
        except Exception as exc:
            print(f"[bench_staging] could not send results: {exc}", file=sys.stderr)
        if sender is not None:
            sender.side.close()


# ----------------------------------------------------------------------------- main side
_PROFILE: Any = None  # with --profile: a cProfile.Profile enabled only inside the hot paths


def _hot(on: bool) -> None:
    """Profile only the timed path of the one-pass row (the sender's ``row_ipc``)."""
    if _PROFILE is not None:
        _PROFILE.enable() if on else _PROFILE.disable()


def _profiled(cfg: dict, name: str, fn: Any, *args: Any) -> None:
    """Run ``fn(*args)``; with ``--profile DIR``, the profile of its hot paths to DIR/name.txt."""
    global _PROFILE
    if not cfg.get("profile"):
        fn(*args)
        return
    import cProfile
    import io
    import pstats

    _PROFILE = cProfile.Profile()
    try:
        fn(*args)
    finally:
        out = io.StringIO()
        stats = pstats.Stats(_PROFILE, stream=out)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        Path(cfg["profile"]).mkdir(parents=True, exist_ok=True)
        (Path(cfg["profile"]) / f"{name}.txt").write_text(out.getvalue())


# ----------------------------------------------------------------------------- rows 5-6
def session_env(cfg: dict, variant_b: bool) -> dict[str, str]:
    """The ranks' settings for row 5 (``variant_b``: row 6)."""
    env = {
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": "staging",
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(cfg["staging_mib"] * MiB),
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(cfg["slot_mib"] * MiB),
    }
    if cfg["num_threads"]:
        env["SGLANG_NIXL_PLUGIN_NIXL_THREADS"] = str(cfg["num_threads"])
    want = cfg["b_map_units"] if variant_b and cfg["b_map_units"] else cfg["map_units"]
    if want is not None:
        env["SGLANG_NIXL_PLUGIN_MAP_INDICES"] = "1" if want == "on" else "0"
    if variant_b:
        env.update(kv.split("=", 1) for kv in cfg["b_env"])
    return env


def new_row(row: str, note: str = "") -> dict:
    keys = ("req_idx", "times_ms", "bytes", "components", "verify")
    return {"label": LABELS[row], **{k: [] for k in keys}, "note": note, "error": ""}


#: Row 5's figures per request, from the product's stamps: ms after the transfer worker
#: claimed the request's chunk (``bench.stamps``: ``p:`` prefill, ``d:`` decode)
_STEPS = {
    "first_post_ms": "p:first_post_at",  # first WRITE posted (the first gather's piece)
    "first_piece_ms": "d:first_piece_at",  # the decode's scatter thread got the first piece
    "last_post_ms": "p:last_post_at",  # the last WRITE posted (the aux row's)
    "last_piece_ms": "d:last_piece_at",
    "last_scatter_done_ms": "d:scattered_at",  # the row's end
    "applied_ms": "d:applied_at",  # the status applied behind the scatters
    "success_ms": "d:end_seen_at",  # the bench's decode loop saw Success
}


def run_session_row(cfg: dict, page_size: int, row: str) -> dict:
    """Rows 5-6: every request through the bench's session (its prefill and decode drivers,
    SGLang's classes, our plugin), one at a time, timed from the product's own stamps."""
    from sgl_nixl_plugin.bench.session import SessionConfig, run_session
    from sgl_nixl_plugin.bench.stamps import T0, T1, room_stamps

    env = session_env(cfg, row == "oursb")
    out = new_row(row, "own session: " + " ".join(f"{k[19:]}={v}" for k, v in env.items()))
    w = workload_of(cfg, page_size)
    reqs = make_requests(cfg, page_size)
    scfg = SessionConfig(
        w,
        mem_kind=cfg["mem"],
        prefill_gpu=cfg["send_gpu"],
        decode_gpu=cfg["recv_gpu"],
        timeout_s=cfg["setup_timeout_s"] + cfg["row_budget_s"],
        verify=cfg["verify"] != "none",
        env=env,
        preconnect=True,  # the pair linked and warmed before the first request
    )
    res = run_session(scfg)
    stamps, decoded = room_stamps(res), res.decode_results()
    failed = []
    for i, r in enumerate(w.make_requests()):
        st = stamps.get(r.room)
        if st is None or not st["ok"] or T1 not in st:
            failed.append(i)
            continue
        claim = st["p:claimed_at"]
        end = st.get("d:scattered_at") or st["p:ended_at"]  # not staged: its last WRITE
        comp = {k: (st[v] - claim) * 1e3 for k, v in _STEPS.items() if v in st}
        comp.update(pieces=st["pieces"], path=st["path"], latency_ms=(st[T1] - st[T0]) * 1e3)
        out["req_idx"].append(i)
        out["times_ms"].append((end - claim) * 1e3)
        out["bytes"].append(reqs[i]["bytes"])
        out["components"].append(comp)
        d = decoded.get(r.room, {})
        if "bad_pages" in d:
            rows = geometry_of(cfg, page_size)["regions"] * reqs[i]["pages"]
            out["verify"].append(
                {"bad_page_rows": d["bad_pages"], "page_rows": rows, "request": i,
                 "first_bad": None}
            )  # fmt: skip
    if failed or res.errors:
        out["error"] = f"requests {failed} failed; session errors: {res.errors[:3]}"
    return out


def run_page_size(cfg: dict, page_size: int, budget_s: float) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe(duplex=True)
    res_r, res_w = ctx.Pipe(duplex=False)
    recv = ctx.Process(
        target=_profiled,
        args=(cfg, f"recv-ps{page_size}", receiver_main, cfg, page_size, b),
        daemon=True,
        name=f"bench-recv-ps{page_size}",
    )
    send = ctx.Process(
        target=_profiled,
        args=(cfg, f"send-ps{page_size}", sender_main, cfg, page_size, a, res_w, budget_s),
        daemon=True,
        name=f"bench-send-ps{page_size}",
    )
    procs = [recv, send]
    result: dict[str, Any] = {"page_size": page_size, "rows": {}}
    per_row = cfg["row_budget_s"] + 2 * cfg["req_timeout_s"]
    hard = (
        (budget_s if budget_s > 0 else len(ROWS) * per_row)
        + cfg["setup_timeout_s"]
        + 2 * cfg["req_timeout_s"]
    )
    finished = False
    try:
        recv.start()
        send.start()
        for c in (a, b, res_w):
            c.close()
        deadline = time.perf_counter() + hard
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                result["error"] = f"no result within {hard:.0f} s: processes stopped"
                break
            if res_r.poll(min(1.0, left)):
                try:
                    kind, payload = res_r.recv()
                except EOFError:
                    result["error"] = "sender exited without a result"
                    break
                if kind == "progress":
                    print(payload, flush=True)
                    continue
                result = payload
                finished = True
                break
            if not send.is_alive() and not res_r.poll(0.5):
                result["error"] = f"sender died (exit code {send.exitcode})"
                break
    finally:
        for p in procs:
            p.join(timeout=20 if finished else 1)
        for p in procs:
            if p.is_alive():
                print(f"[bench_staging] stopping {p.name} (pid {p.pid})", file=sys.stderr)
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        res_r.close()
    return result


def run_all_rows(cfg: dict, page_size: int, budget_s: float) -> dict:
    """The engine rows (two processes of their own), then rows 5-6 (a session each)."""
    engine = [r for r in cfg["rows"] if r not in SESSION_ROWS]
    result: dict[str, Any] = {"page_size": page_size, "rows": {}}
    if engine:
        result = run_page_size({**cfg, "rows": engine}, page_size, budget_s)
    for row in (r for r in SESSION_ROWS if r in cfg["rows"]):
        print(f"  {row}: a bench session of {cfg['requests']} requests", flush=True)
        try:
            result.setdefault("rows", {})[row] = run_session_row(cfg, page_size, row)
        except Exception as exc:
            result.setdefault("rows", {})[row] = {
                **new_row(row),
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        result.setdefault("requests", [
            {"i": r["i"], "tokens": r["tokens"], "pages": r["pages"], "bytes": r["bytes"]}
            for r in make_requests(cfg, page_size)
        ])  # fmt: skip
    return result


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summarise(run: dict) -> None:
    """Add p50/p99/GB/s per row and the matched-request ratios (in place)."""
    for row in run.get("rows", {}).values():
        t = row.get("times_ms", [])
        if t:
            row["p50_ms"] = _pct(t, 50)
            row["p99_ms"] = _pct(t, 99)
            row["mean_bytes"] = float(np.mean(row["bytes"]))
            row["GBps"] = row["mean_bytes"] / (row["p50_ms"] * 1e-3) / 1e9
    rows = run.get("rows", {})

    def ratio(other: str, mine_key: str = "ours") -> dict | None:
        ours, o = rows.get(mine_key, {}), rows.get(other, {})
        if not ours.get("times_ms") or not o.get("times_ms"):
            return None
        mine = dict(zip(ours["req_idx"], ours["times_ms"], strict=True))
        theirs = dict(zip(o["req_idx"], o["times_ms"], strict=True))
        common = sorted(set(mine) & set(theirs))
        if not common:
            return None
        r = [mine[i] / theirs[i] for i in common]
        return {"ours_over_other": float(np.median(r)), "n": len(common)}

    run["ratios"] = {k: ratio(k) for k in ("ceiling", "plain", "perpage", "write")}
    run["ratios"]["b_over_a"] = ratio("ours", "oursb")
    run["ratios"]["ipc_over_ours"] = ratio("ours", "ipc")


def fmt_table(run: dict, cfg: dict) -> str:
    lines = []
    ps = run["page_size"]
    reqs = run.get("requests", [])
    g = run.get("geometry") or geometry_of(cfg, ps)
    if reqs:
        b = [r["bytes"] for r in reqs]
        where = (
            f"VRAM GPU{cfg['send_gpu']} -> GPU{cfg['recv_gpu']}" if cfg["mem"] == "VRAM" else "DRAM"
        )
        lines.append(
            f"== page size {ps}: {len(reqs)} requests of {cfg['min_tokens']}-{cfg['max_tokens']} "
            f"tokens ({min(b) / MiB:.0f}-{max(b) / MiB:.0f} MiB, mean {np.mean(b) / MiB:.0f} MiB), "
            f"{g['regions']} regions x {g['item'] // 1024} KiB items, pool {g['pool_pages']} "
            f"pages/side; {where}"
        )
        rtt = run.get("control_rtt") or {}
        lines.append(
            f"   copier: {run.get('copier')}; staging {cfg['staging_mib']} MiB in "
            f"{cfg['slot_mib']} MiB slots; control (Pipe) round trip p50 "
            f"{rtt.get('p50_us', float('nan')):.0f} us; order {cfg['order']}"
        )
    else:
        lines.append(f"== page size {ps}")
    if run.get("error"):
        lines.append(f"   RUN ERROR: {run['error']}")
    lines.append(f"   {'row':34s} {'n':>4s} {'p50 ms':>10s} {'p99 ms':>10s} {'GB/s':>9s}  notes")
    for key in ROWS:
        row = run.get("rows", {}).get(key)
        if row is None:
            lines.append(f"   {LABELS[key]:34s}    - (not run)")
            continue
        notes = []
        comps = row.get("components", [])
        if key == "plain" and comps:
            med = {k: float(np.median([c[k] for c in comps])) for k in comps[0]}
            notes.append(
                f"gather {med['gather_ms']:.2f} + write {med['write_ms']:.2f} + "
                f"scatter {med['scatter_ms']:.2f} ms (p50)"
            )
        if key == "write" and comps:
            notes.append(
                f"post (build + transfer call) "
                f"{float(np.median([c['post_ms'] for c in comps])):.2f} ms of it (p50)"
            )
        if key == "perpage" and comps:
            notes.append(f"{int(np.median([c['descriptors'] for c in comps]))} descriptors")
        if key == "ipc" and comps:
            med = {k: float(np.median([c[k] for c in comps])) for k in comps[0]}
            notes.append(
                f"p50: launched {med['launch_ms']:.2f}, copy done {med['copy_ms']:.2f} ms, "
                f"then receiver told in {med['notify_ms']:.2f} ms"
            )
        if key in ("ours", "oursb") and comps:
            med = {
                k: float(np.median([c.get(k, np.nan) for c in comps]))
                for k in (*_STEPS, "pieces", "latency_ms")
            }
            notes.append(
                f"{med['pieces']:.0f} pieces; p50 after the worker's claim: first WRITE posted "
                f"{med['first_post_ms']:.2f}, first piece at the decode "
                f"{med['first_piece_ms']:.2f}, last WRITE posted {med['last_post_ms']:.2f}, "
                f"last piece at the decode {med['last_piece_ms']:.2f}, last scatter done "
                f"{med['last_scatter_done_ms']:.2f}, status applied {med['applied_ms']:.2f}, "
                f"Success seen {med['success_ms']:.2f} ms; the bench's latency (WaitingForInput "
                f"to Success) {med['latency_ms']:.2f} ms"
            )
        if row.get("note"):
            notes.append(row["note"])
        if row.get("times_ms"):
            lines.append(
                f"   {row['label']:34s} {len(row['times_ms']):4d} {row['p50_ms']:10.3f} "
                f"{row['p99_ms']:10.3f} {row['GBps']:9.2f}  {'; '.join(notes)}"
            )
        else:
            lines.append(
                f"   {row['label']:34s} {0:4d} {'-':>10s} {'-':>10s} {'-':>9s}  {'; '.join(notes)}"
            )
        if row.get("error"):
            lines.append(f"      ERROR: {row['error']}")
    r = run.get("ratios", {})
    lines.append("   ratios (median over the requests both rows ran):")

    def line(name: str, key: str, how: str) -> None:
        v = r.get(key)
        if not v:
            lines.append(f"     {name:28s} n/a")
            return
        x = v["ours_over_other"]
        if how == "time":
            s = f"{x:.2f}x the time"
        else:
            s = f"{1 / x:.1f}x faster" if x <= 1 else f"{x:.2f}x SLOWER"
        extra = ""
        if key == "write" and cfg["mem"] == "DRAM":
            extra = f"   (DRAM goal <= 1.3: {'MET' if x <= 1.3 else 'NOT MET'})"
        lines.append(f"     {name:28s} {s}  [n={v['n']}]{extra}")

    line("ours / ceiling", "ceiling", "time")
    line("ours vs plain staging", "plain", "speed")
    line("ours vs per-page", "perpage", "speed")
    line("ours / single WRITE", "write", "time")
    if r.get("b_over_a"):
        line("variant B (6) / ours (5)", "b_over_a", "time")
    if r.get("ipc_over_ours"):
        line("one pass (7) / ours (5)", "ipc_over_ours", "time")
    ver = []
    for key in VERIFIED_ROWS:
        row = run.get("rows", {}).get(key)
        if not row:
            continue
        vs = row.get("verify", [])
        if key == "ipc" and not row.get("times_ms"):
            continue  # skipped here: its note says why
        if not vs:
            ver.append(f"{key}: not checked")
            continue
        bad = sum(v["bad_page_rows"] for v in vs)
        total = sum(v["page_rows"] for v in vs)
        reqs_checked = ",".join(str(v["request"]) for v in vs)
        if bad:
            first = next(v["first_bad"] for v in vs if v["bad_page_rows"])
            ver.append(
                f"{key}: MISMATCH {bad}/{total} page-rows (requests {reqs_checked}; first {first})"
            )
        else:
            ver.append(f"{key}: OK {total} page-rows byte-exact (requests {reqs_checked})")
    lines.append("   verify: " + "; ".join(ver) if ver else "   verify: none")
    return "\n".join(lines)


def versions(cfg: dict) -> dict:
    from importlib import metadata

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "pluggy": "stub (not installed)" if _PLUGGY_STUBBED else "installed",
    }
    for dist in ("nixl", "nixl-cu13", "nixl-cu12", "torch", "triton"):
        try:
            info[dist] = metadata.version(dist)
        except Exception:
            pass
    try:
        from sgl_nixl_plugin import __version__

        info["sgl_nixl_plugin"] = __version__
    except Exception:
        pass
    if cfg["mem"] == "VRAM":
        try:
            import torch

            info["torch"] = torch.__version__
            info["cuda"] = torch.version.cuda
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception as exc:
            info["gpus"] = f"unavailable: {exc}"
    return info


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the children, keep what was measured
    if args.mem == "DRAM":
        os.environ.setdefault("UCX_NET_DEVICES", "lo")  # loopback: nothing leaves the host
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    cfg = {k: v for k, v in vars(args).items() if k not in ("json", "page_size")}
    info = versions(cfg)
    print("bench_staging:", " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    if _PLUGGY_STUBBED:
        print("bench_staging: pluggy is not installed; a stub stands in (no hooks are used)")
    print(
        f"bench_staging: mem={args.mem} send_gpu={args.send_gpu} recv_gpu={args.recv_gpu} "
        f"page_sizes={args.page_size} requests={args.requests} "
        f"tokens={args.min_tokens}-{args.max_tokens} layers={args.layers} "
        f"staging={args.staging_mib} MiB slot={args.slot_mib} MiB (rows 5-6) "
        f"verify={args.verify} map_units={args.map_units or 'default'} "
        f"row_budget={args.row_budget_s:.0f}s budget={args.budget_s:.0f}s",
        flush=True,
    )
    doc: dict[str, Any] = {
        "versions": info,
        "config": cfg,
        "page_sizes": args.page_size,
        "runs": [],
    }
    t_start = time.perf_counter()
    rc = 0
    tables = []
    for k, ps in enumerate(args.page_size):
        if args.budget_s > 0:
            left = args.budget_s - (time.perf_counter() - t_start)
            share = max(10.0, left / (len(args.page_size) - k))
        else:
            share = 0.0
        interrupted = False
        try:
            run = run_all_rows(cfg, ps, share)
        except KeyboardInterrupt:
            run = {"page_size": ps, "rows": {}, "error": "interrupted (SIGINT/SIGTERM)"}
            interrupted = True
        except Exception as exc:
            run = {"page_size": ps, "rows": {}, "error": f"{type(exc).__name__}: {exc}"}
        summarise(run)
        table = fmt_table(run, cfg)
        tables.append(table)
        print(table, flush=True)
        if run.get("error"):
            rc = 1
            if run.get("traceback"):
                print(run["traceback"], file=sys.stderr)
        for row in run.get("rows", {}).values():
            if row.get("error"):
                rc = 1
                print(
                    f"--- {row['label']}: {row['error']}\n{row.get('traceback', '')}",
                    file=sys.stderr,
                )
            if any(v["bad_page_rows"] for v in row.get("verify", [])):
                rc = 1
        doc["runs"].append(run)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(doc, indent=1, default=_json_default))
        if interrupted:
            break
    print("\n".join(["", "bench_staging summary"] + tables))
    print(f"bench_staging: done in {time.perf_counter() - t_start:.1f} s, exit {rc}")
    return rc


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
