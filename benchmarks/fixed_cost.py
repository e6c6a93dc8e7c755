"""Issue 36's figures: per-request latency and fixed cost, ours against SGLang's in-tree nixl.

Not a test: it prints figures and asserts nothing. Run it from the repository root (CPU,
DRAM, UCX on loopback; one prefill and one decode process per session, as
``sgl-nixl-plugin bench``)::

    python benchmarks/fixed_cost.py                          # every cell, ours vs in-tree
    python benchmarks/fixed_cost.py --tokens 16 --concurrency 1 --pages 16 --requests 30
    git archive <commit> sgl_nixl_plugin | tar -x -C .old    # an older tree, for the A/B
    python benchmarks/fixed_cost.py --old .old --rounds 2 --json > fixed_cost.json

Cells: tokens (16, 256, 4,096) x concurrency (1, 8) x page size (1, 16), each list settable
(``--tokens``, ``--concurrency``, ``--pages``). Model shape: ``sgl-nixl-plugin bench``'s
custom shape ``--layers 8 --kv-heads 8 --head-dim 128`` (bf16: 16 K/V regions, 32 KiB a
token), random pages on both sides, every request exactly ``tokens`` long, no state row
(as ``bench --compare`` runs both backends), every byte checked unless ``--no-verify``.
Requests per session: 200 below 4,096 tokens, 60 at 4,096 (``--requests`` for all).

Per cell, every round (``--rounds``, rooms pooled over rounds): the WRITE alone (in this
process), then the sessions of ours, SGLang's in-tree backend and, with ``--old``, ours from
the old tree (that order reversed every other round), each in its own Python process with
``PYTHONPATH`` = the tree it runs, driving that tree's ``bench.session.run_session`` with
the workload its ``sgl-nixl-plugin bench`` CLI builds from the same flags.

The clocks:

* ours / in-tree / old p50, p99 -- per room, as ``sgl-nixl-plugin bench`` measures it in the
  decode process: starts just before the decode's ``receiver.send_metadata(...)``, stops
  when its ``receiver.poll()`` returns Success *and* the room's aux (bootstrap_room) row has
  landed (SGLang's metadata gate), less any time the prefill's sender was made after the
  decode's request (``prefill_late_s``: its "forward pass", not transfer time; before
  this release the clock also left out the request's way to the prefill, up to its
  WaitingForInput, and an ``--old`` tree from then still does). It
  includes the decode's loop: with concurrency 8 a room's Success is seen once the loop
  has polled (and, unless ``--no-verify``, byte-checked) the rooms finished before it.
  Only steady rooms count: the first room to the prefill carries the pair's handshake
  (SGLang's bootstrap query; ours also registers, links and warms up), and so do the rooms
  sent while it is in flight, so every room whose request went before the first room
  finished is left out (with concurrency 1 that is the first room alone; ``steady`` in
  the JSON says how many rooms count).
* WRITE alone p50 -- one of our ``TransferEngine``s in this process (the prefill's
  agent settings: ``SGLANG_DISAGGREGATION_NIXL_BACKEND(_PARAMS)``, the plugin's NIXL thread
  count and progress-thread setting) WRITEs into another's in a second process, as a
  session's prefill into its decode; DRAM pools as the bench's (16 separate regions of the
  same size, page 0 never used), UCX on loopback; one WRITE of a request's KV bytes,
  page-granular (one descriptor per page per region before NIXL merges adjacent pages),
  random pages on both sides. Starts before ``TransferEngine.write`` (index arithmetic,
  ``make_prepped_xfer``, ``transfer``), stops when a busy ``poll`` sees DONE (the target
  progresses its agent every 0.1 ms meanwhile, for a transport that needs the target's
  progress); the handle is released outside the clock. ``--write-repeats`` timed WRITEs
  (default: the cell's request count) after 5 untimed ones (the link's wire-up), all on
  one link. UCX moves host-to-host puts between two processes of one host by CMA
  (``process_vm_writev`` inside ``transfer``, in the posting thread), which costs more
  than between two agents of one process: ``WRITE 1-proc`` is that WRITE with both
  agents here (the target progressed between polls), the basis of the fixed cost before
  this release.
* CPU ms/room -- the CPU time (every thread, ``time.process_time``) of the session's prefill
  and decode processes from their manager's start to their last room's end, over the
  session's rooms: what the backend's threads (and a NIXL progress thread, which SGLang's
  in-tree backend runs) cost beside the bench loops' own work on the pages, which is the
  same for every backend. It includes the pair's set-up, spread over the rooms.
* fixed cost p50 -- a backend's p50 minus the WRITE-alone p50 of the same cell. It keeps
  whatever the backend does besides moving the KV bytes: control messages, the aux row's
  WRITE and the completion signal, the threads' hand-offs, the decode's polling. At page
  size 1 from ~64 tokens (about 1,000 descriptors) our plugin takes the staging path (a
  gather and fewer, larger WRITEs; the ``path`` column) once the pair's staging is set up,
  which can move the bytes faster than the page-granular WRITE: its fixed cost can then
  come out below the real one, even negative.

The machine matters: every NIXL agent's threads and both ranks' loops share the cores, and
absolute figures drift with other load; compare within one run (the sessions of a cell are
interleaved so drift hits them alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ["UCX_NET_DEVICES"] = "lo"  # before NIXL loads UCX: loopback only
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"layers": 8, "kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}
WARMUP_WRITES = 5


@dataclass(frozen=True)
class Cell:
    tokens: int
    concurrency: int
    page: int
    requests: int

    @property
    def label(self) -> str:
        return f"{self.tokens}t c{self.concurrency} p{self.page}"


@dataclass
class Run:
    """The rooms of one backend in one cell, pooled over rounds."""

    latencies_ms: list[float] = field(default_factory=list)
    excluded: int = 0  # rooms that carried (or overlapped) the handshake
    failed: int = 0
    corrupt_pages: int = 0
    handshake_ms: list[float] = field(default_factory=list)
    path: str = "-"
    package: str = ""
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # both ranks' processes while their rooms ran, over ``cpu_rooms``
    cpu_rooms: int = 0

    def cpu_ms_per_room(self) -> float | None:
        return self.cpu_s / self.cpu_rooms * 1e3 if self.cpu_rooms else None

    def pct(self, q: float) -> float | None:
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else None


# -- one session, in a subprocess whose PYTHONPATH is the tree under test ----------------------


def cli_argv(cell: Cell, seed: int, timeout_s: float, verify: bool) -> list[str]:
    """``sgl-nixl-plugin bench``'s flags for the cell (parsed by the tree's own CLI)."""
    argv = [
        "--layers", str(SHAPE["layers"]), "--kv-heads", str(SHAPE["kv_heads"]),
        "--head-dim", str(SHAPE["head_dim"]), "--dtype", str(SHAPE["dtype"]),
        "--page-size", str(cell.page), "--requests", str(cell.requests),
        "--min-tokens", str(cell.tokens), "--max-tokens", str(cell.tokens),
        "--concurrency", str(cell.concurrency), "--fragmentation", "random",
        "--seed", str(seed), "--timeout", str(timeout_s),
    ]  # fmt: skip
    return argv + ([] if verify else ["--no-verify"])


def session_worker(spec_path: str) -> int:
    """Run one session with whichever ``sgl_nixl_plugin`` is on ``sys.path``; write its rooms."""
    from dataclasses import replace

    import sgl_nixl_plugin
    from sgl_nixl_plugin.bench.report import summarize
    from sgl_nixl_plugin.bench.session import SessionConfig, run_session, with_backend
    from sgl_nixl_plugin.cli.bench import build_parser, workload_of

    spec = json.loads(Path(spec_path).read_text())
    args = build_parser().parse_args(spec["argv"])
    # as ``bench --compare``: SGLang's in-tree backend registers state buffers as VRAM
    workload = replace(workload_of(args), state=False)
    cfg = SessionConfig(workload, timeout_s=args.timeout, verify=not args.no_verify)
    result = run_session(with_backend(cfg, spec["backend"]))
    rooms = [
        {
            k: r.get(k)
            for k in ("ok", "latency_s", "wall0", "wall1", "handshake_s", "bytes")
            + ("bad_pages", "bad_aux", "prefill_late_s")
        }
        for r in result.decode_results().values()
    ]
    out = {
        "package": str(Path(sgl_nixl_plugin.__file__).parent),
        "rooms": rooms,
        "summary": summarize(result),
        "errors": result.errors,
        "cpu_s": result.cpu_s() if hasattr(result, "cpu_s") else None,
    }
    Path(spec["out"]).write_text(json.dumps(out))
    return 0


def run_session_in(tree: Path, backend: str, argv: list[str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fixed-cost-") as tmp:
        spec, out = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec.write_text(json.dumps({"argv": argv, "backend": backend, "out": str(out)}))
        # the tree first; what PYTHONPATH held after it (a site folder of wheels on the GPU host)
        path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {**os.environ, "PYTHONPATH": path, "NIXL_LOG_LEVEL": "WARN"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--session-worker", str(spec)]
        try:
            proc = subprocess.run(
                cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout_s + 120
            )
        except subprocess.TimeoutExpired:
            return {"errors": [f"{backend}: the session process passed {timeout_s + 120:.0f} s"]}
        if not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            return {"errors": [f"{backend}: exit {proc.returncode}: " + " | ".join(tail)]}
        return dict(json.loads(out.read_text()))


def add_rooms(run: Run, doc: dict[str, Any]) -> None:
    """Pool one session's steady rooms into ``run``."""
    run.errors += [str(e).splitlines()[-1] if e else str(e) for e in doc.get("errors", [])]
    run.package = doc.get("package", run.package)
    summary = doc.get("summary") or {}
    run.path = summary.get("path", run.path)
    run.wall_s += float(summary.get("wall_s") or 0.0)
    rooms = doc.get("rooms", [])
    if doc.get("cpu_s") is not None and rooms:
        run.cpu_s += float(doc["cpu_s"])
        run.cpu_rooms += len(rooms)
    ok = [r for r in rooms if r["ok"]]
    run.failed += int(summary.get("failed", len(rooms) - len(ok)))
    run.corrupt_pages += sum(int(r.get(k) or 0) for r in ok for k in ("bad_pages", "bad_aux"))
    if not ok:
        return
    first = min(ok, key=lambda r: r["wall0"])
    run.handshake_ms.append(float(first.get("handshake_s") or 0.0) * 1e3)
    steady = [r for r in ok if r is not first and r["wall0"] >= first["wall1"]]
    run.excluded += len(ok) - len(steady)
    run.latencies_ms += [float(r["latency_s"]) * 1e3 for r in steady]


# -- the WRITE alone, its target in a second process (or in this one) --------------------


PROGRESS_S = 1e-4  # the WRITE target's progress period


def _write_target(conn: Any, pool: int, item_len: int, regions: int) -> None:
    """A WRITE target in its own process: registers its pools, sends its metadata and
    region addresses, and progresses its agent until told to stop (or its parent goes)."""
    from sgl_nixl_plugin.engine.engine import Memory, TransferEngine
    from sgl_nixl_plugin.engine.layout import RegionSet
    from sgl_nixl_plugin.registry.manager import resolve_agent_config

    bufs = [np.full(pool * item_len, 0, dtype=np.uint8) for _ in range(regions)]
    ptrs = [int(b.ctypes.data) for b in bufs]
    rs = RegionSet.of(ptrs, [pool * item_len] * regions, [item_len] * regions, "DRAM")
    engine = TransferEngine(resolve_agent_config(), Memory(rs, RegionSet.of([], [], [], "DRAM")))
    try:
        conn.send((engine.metadata, ptrs))
        while not conn.poll(PROGRESS_S):
            engine.agent.progress()
    except (EOFError, OSError):
        pass  # the parent went
    finally:
        engine.close()


def write_alone(cell: Cell, repeats: int, seed: int, processes: int = 2) -> dict[str, Any]:
    """p50 (and p99) of one KV WRITE of a request's pages, alone, the target in a second
    process (``processes`` 2) or in this one (1); see the module's doc."""
    import multiprocessing

    from sgl_nixl_plugin.cli.bench import build_parser, workload_of
    from sgl_nixl_plugin.engine.engine import Memory, TransferEngine
    from sgl_nixl_plugin.engine.layout import RegionSet
    from sgl_nixl_plugin.registry.manager import resolve_agent_config
    from sgl_nixl_plugin.settings import Settings

    # the sessions' workload, so the pools (and so the pages' spread) are the bench's
    w = workload_of(build_parser().parse_args(cli_argv(cell, seed, 600.0, verify=False)))
    shape = w.shape
    pool = w.pool_pages()
    item_len = cell.page * shape.heads_per_rank(1) * shape.head_bytes
    n_pages = -(-cell.tokens // cell.page)
    regions = shape.regions()

    def region_set(ptrs: list[int]) -> RegionSet:
        return RegionSet.of(ptrs, [pool * item_len] * regions, [item_len] * regions, "DRAM")

    no_aux = RegionSet.of([], [], [], "DRAM")
    settings = Settings.from_env()
    config = resolve_agent_config()
    if config.num_threads == 0:
        config.num_threads = settings.nixl_threads  # as the plugin's prefill (the initiator)
    src_bufs = [np.full(pool * item_len, 1, dtype=np.uint8) for _ in range(regions)]
    prefill = TransferEngine(
        config,
        Memory(region_set([int(b.ctypes.data) for b in src_bufs]), no_aux),
        progress_thread=settings.progress_thread,
    )
    decode: Any = None
    proc: Any = None
    conn: Any = None
    rng = np.random.default_rng(seed)
    times: list[float] = []
    posted = -1
    try:
        if processes == 1:
            dst_bufs = [np.full(pool * item_len, 0, dtype=np.uint8) for _ in range(regions)]
            dst_ptrs = [int(b.ctypes.data) for b in dst_bufs]
            decode = TransferEngine(resolve_agent_config(), Memory(region_set(dst_ptrs), no_aux))
            metadata = decode.metadata
        else:
            mp = multiprocessing.get_context("spawn")
            conn, theirs = mp.Pipe()
            proc = mp.Process(
                target=_write_target, args=(theirs, pool, item_len, regions), daemon=True
            )
            proc.start()
            if not conn.poll(120):
                raise RuntimeError("WRITE alone: the target process sent no metadata in 120 s")
            metadata, dst_ptrs = conn.recv()
        link = prefill.link(metadata, Memory(region_set(dst_ptrs), no_aux))
        for i in range(WARMUP_WRITES + repeats):
            src = rng.choice(np.arange(1, pool), n_pages, replace=False)
            dst = rng.choice(np.arange(1, pool), n_pages, replace=False)
            t0 = time.perf_counter()
            xfer = prefill.write(link, "kv", src, dst)
            assert xfer is not None
            while prefill.poll(xfer) == "PROC":
                if decode is not None:
                    decode.agent.progress()  # the target's side, for a two-sided transport
                if time.perf_counter() - t0 > 60:
                    break
            elapsed = time.perf_counter() - t0
            if xfer.state != "DONE":
                raise RuntimeError(f"WRITE alone: {xfer.state} {xfer.error}")
            posted = (prefill.agent.telemetry(xfer) or {}).get("descriptors", -1)
            prefill.release(xfer)
            if i >= WARMUP_WRITES:
                times.append(elapsed * 1e3)
        prefill.unlink(link)
    finally:
        prefill.close()
        if decode is not None:
            decode.close()
        if proc is not None:
            try:
                conn.send("stop")
            except OSError:
                pass  # the target already went
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    del src_bufs
    return {
        "p50_ms": statistics.median(times),
        "p99_ms": float(np.percentile(times, 99)),
        "repeats": len(times),
        "processes": processes,
        "bytes": n_pages * item_len * regions,
        "descriptors_built": n_pages * regions,
        "descriptors_posted": posted,
    }


# -- the table ---------------------------------------------------------------------------------


def fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def rows_of(cells: list[dict[str, Any]], with_old: bool) -> tuple[list[str], list[list[str]]]:
    head = ["cell", "ours p50", "ours p99", "in-tree p50", "in-tree p99", "ours/in-tree"]
    if with_old:
        head += ["old p50", "old p99", "ours/old"]
    head += ["WRITE p50", "WRITE 1-proc", "fixed ours", "fixed in-tree"]
    head += ["fixed old"] if with_old else []
    head += ["CPU ms/room ours", "in-tree"] + (["old"] if with_old else [])
    head += ["steady rooms", "path ours"]
    body = []
    for c in cells:
        o, t, w = c["ours"], c["in-tree"], c["write"]["p50_ms"]
        row = [c["cell"], fmt(o["p50_ms"]), fmt(o["p99_ms"]), fmt(t["p50_ms"]), fmt(t["p99_ms"])]
        row.append(ratio(o["p50_ms"], t["p50_ms"]))
        if with_old:
            d = c["old"]
            row += [fmt(d["p50_ms"]), fmt(d["p99_ms"]), ratio(o["p50_ms"], d["p50_ms"])]
        row += [fmt(w), fmt(c["write"].get("one_process_p50_ms"))]
        row += [fmt(minus(o["p50_ms"], w)), fmt(minus(t["p50_ms"], w))]
        if with_old:
            row.append(fmt(minus(c["old"]["p50_ms"], w)))
        keys = ["ours", "in-tree"] + (["old"] if with_old else [])
        row += [fmt(c[k]["cpu_ms_per_room"]) for k in keys]
        row.append("/".join(str(c[k]["steady"]) for k in keys))
        row.append(o["path"])
        body.append(row)
    return head, body


def table(head: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 4096])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--pages", type=int, nargs="+", default=[1, 16], help="page sizes")
    p.add_argument(
        "--requests", type=int, help="requests per session (default: 200, 60 at >= 4,096 tokens)"
    )
    p.add_argument("--write-repeats", type=int, help="timed WRITEs alone (default: requests)")
    p.add_argument("--rounds", type=int, default=1, help="sessions per backend per cell, pooled")
    p.add_argument(
        "--old",
        type=Path,
        metavar="TREE",
        help="a directory holding an older sgl_nixl_plugin/ "
        "(git archive COMMIT sgl_nixl_plugin | tar -x -C TREE): ours from it too, for the A/B",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the bench's byte check")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=600.0, help="per session, seconds")
    p.add_argument("--json", action="store_true", help="print the figures as JSON, no table")
    p.add_argument("--session-worker", metavar="SPEC", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def summary_of(run: Run) -> dict[str, Any]:
    return {
        "p50_ms": run.pct(50),
        "p99_ms": run.pct(99),
        "steady": len(run.latencies_ms),
        "excluded": run.excluded,
        "failed": run.failed,
        "corrupt_pages": run.corrupt_pages,
        "handshake_ms": run.handshake_ms,
        "path": run.path,
        "package": run.package,
        "wall_s": run.wall_s,
        "cpu_ms_per_room": run.cpu_ms_per_room(),
        "errors": run.errors,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.session_worker:
        return session_worker(args.session_worker)
    old = args.old.resolve() if args.old else None
    if old is not None and not (old / "sgl_nixl_plugin").is_dir():
        print(f"--old {args.old}: no sgl_nixl_plugin/ in it", file=sys.stderr)
        return 2
    sides: list[tuple[str, Path, str]] = [("ours", ROOT, "plugin"), ("in-tree", ROOT, "in-tree")]
    if old is not None:
        sides.append(("old", old, "plugin"))
    cells = [
        Cell(t, c, p, args.requests or (60 if t >= 4096 else 200))
        for t in args.tokens
        for c in args.concurrency
        for p in args.pages
    ]
    started = time.perf_counter()
    out: list[dict[str, Any]] = []
    for cell in cells:
        runs = {name: Run() for name, _, _ in sides}
        writes: list[dict[str, Any]] = []
        writes1: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            repeats = args.write_repeats or cell.requests
            writes.append(write_alone(cell, repeats, args.seed + rnd, processes=2))
            writes1.append(write_alone(cell, repeats, args.seed + rnd, processes=1))
            print(
                f"[{cell.label} round {rnd + 1}] WRITE alone p50 {writes[-1]['p50_ms']:.3f} ms "
                f"(in one process {writes1[-1]['p50_ms']:.3f})",
                file=sys.stderr,
            )
            argv_ = cli_argv(cell, args.seed + rnd, args.timeout, not args.no_verify)
            # the order flips every round, so a drift over a round favours no side
            for name, tree, backend in sides if rnd % 2 == 0 else sides[::-1]:
                doc = run_session_in(tree, backend, argv_, args.timeout)
                add_rooms(runs[name], doc)
                r = runs[name]
                print(
                    f"[{cell.label} round {rnd + 1}] {name}: p50 {fmt(r.pct(50))} ms, "
                    f"{len(r.latencies_ms)} steady rooms so far"
                    + (f", errors: {r.errors[-1]}" if r.errors else ""),
                    file=sys.stderr,
                )
        write = {
            "p50_ms": statistics.median(x["p50_ms"] for x in writes),
            "one_process_p50_ms": statistics.median(x["p50_ms"] for x in writes1),
            "rounds": writes,
            "one_process_rounds": writes1,
        }
        out.append(
            {
                "cell": cell.label,
                **asdict(cell),
                "write": write,
                **{k: summary_of(v) for k, v in runs.items()},
            }
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    note = (
        f"shape: {SHAPE['layers']} layers x {SHAPE['kv_heads']} KV heads x {SHAPE['head_dim']} "
        f"({SHAPE['dtype']}), random pages, DRAM, UCX on loopback, "
        f"{'no byte check' if args.no_verify else 'every byte checked'}, {args.rounds} round(s); "
        f"{os.cpu_count()} CPU cores, 1-minute load {load:.1f} at the end; "
        f"{time.perf_counter() - started:.0f} s"
    )
    if args.json:
        print(json.dumps({"note": note, "old": str(old) if old else None, "cells": out}, indent=2))
        return 0
    head, body = rows_of(out, old is not None)
    print(
        "milliseconds; p50/p99 over steady rooms (send_metadata -> poll() Success); "
        "fixed = p50 - WRITE-alone p50 (its target in a second process; "
        "WRITE 1-proc: both agents in one)"
    )
    print(table(head, body))
    print(note)
    for c in out:
        for name, _, _ in sides:
            s = c[name]
            if s["failed"] or s["corrupt_pages"] or s["errors"]:
                print(
                    f"[{c['cell']}] {name}: {s['failed']} failed, "
                    f"{s['corrupt_pages']} corrupt pages, errors: {s['errors'][:3]}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
