"""``sgl-nixl-plugin bench``: a PD session through SGLang's classes, with figures.

With no flags it runs the embedded default: one prefill and one decode process on this
machine, DRAM pools of a Llama-3.1-8B-shaped KV cache, random page allocation, every byte
verified. ``--role`` runs a single side so prefill and decode can sit on two hosts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from dataclasses import replace
from typing import Any

from sgl_nixl_plugin.bench.workload import PRESETS, ModelShape, Workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sgl-nixl-plugin bench",
        description="Run a prefill/decode KV-transfer session and print throughput and latency.",
    )
    m = p.add_argument_group("model shape")
    m.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b")
    m.add_argument("--layers", type=int, help="override the preset's layer count")
    m.add_argument("--kv-heads", type=int, help="override the preset's total KV heads")
    m.add_argument("--head-dim", type=int, help="override the preset's head dim")
    m.add_argument("--dtype", choices=["bfloat16", "float16", "float32", "fp8_e4m3"])
    m.add_argument("--mla", action="store_true", default=None, help="MLA layout (one latent head)")
    w = p.add_argument_group("workload")
    w.add_argument("--page-size", type=int, default=16)
    w.add_argument(
        "--decode-page-size",
        type=int,
        default=0,
        metavar="N",
        help="the decode's page size where it differs from --page-size (the prefill's): "
        "pages are paired token by token",
    )
    w.add_argument("--requests", type=int, default=48)
    w.add_argument("--min-tokens", type=int, default=256)
    w.add_argument("--max-tokens", type=int, default=1024)
    w.add_argument("--concurrency", type=int, default=8)
    w.add_argument("--chunks", type=int, default=1, help="chunked-prefill sends per request")
    w.add_argument(
        "--chunk-gap-ms",
        type=float,
        default=0.0,
        help="time between a request's chunked-prefill sends (its forward passes)",
    )
    w.add_argument("--fragmentation", choices=["random", "contiguous", "mixed"], default="random")
    w.add_argument("--no-state", action="store_true", help="do not transfer a state row")
    w.add_argument(
        "--host-every",
        type=int,
        default=0,
        metavar="N",
        help="every N-th request goes into the decode's host pool, as SGLang's "
        "--disaggregation-decode-host-receive-threshold does (1: all; implies --no-state)",
    )
    w.add_argument("--seed", type=int, default=1234)
    d = p.add_argument_group("deployment")
    d.add_argument("--prefill-tp", type=int, default=1)
    d.add_argument("--decode-tp", type=int, default=1)
    d.add_argument("--prefill-pp", type=int, default=1, help="pipeline stages of the prefill")
    d.add_argument(
        "--decode-pp", type=int, default=1, help="of the decode: 1 or --prefill-pp (as SGLang)"
    )
    d.add_argument(
        "--prefill-dp",
        type=int,
        default=1,
        help="attention DP groups of the prefill (--enable-dp-attention --dp-size N); "
        "divides --prefill-tp",
    )
    d.add_argument("--decode-dp", type=int, default=1, help="of the decode; divides --decode-tp")
    d.add_argument("--mem", choices=["DRAM", "VRAM"], default="DRAM")
    d.add_argument("--prefill-gpu", type=int, default=0)
    d.add_argument("--decode-gpu", type=int, default=0)
    d.add_argument(
        "--preconnect",
        action="store_true",
        help="decodes name their prefills at start-up (SGLANG_NIXL_PLUGIN_PREFILLS) and send "
        "each its first request once that registration is done, as to a server up a while",
    )
    d.add_argument("--compare", choices=["in-tree"], help="also run SGLang's in-tree nixl backend")
    d.add_argument("--timeout", type=float, default=600.0, help="session deadline in seconds")
    d.add_argument("--no-verify", action="store_true", help="skip the byte-by-byte check")
    d.add_argument("--role", choices=["prefill", "decode", "bootstrap"], help="run one side only")
    d.add_argument("--bootstrap", metavar="HOST:PORT", help="bootstrap server (with --role)")
    d.add_argument("--tp-rank", type=int, default=0, help="this process's TP rank (with --role)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print figures as JSON")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument(
        "--verbose",
        action="store_true",
        help="show the ranks' INFO logs, NIXL's and SGLang's import-time warnings",
    )
    o.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the ranks' Prometheus metrics on 127.0.0.1:PORT/metrics while it runs",
    )
    return p


def workload_of(args: argparse.Namespace) -> Workload:
    shape = PRESETS[args.preset]
    overrides = {
        k: v
        for k, v in {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "dtype": args.dtype,
            "mla": args.mla,
        }.items()
        if v is not None
    }
    if overrides:
        shape = replace(shape, name="custom", **overrides)
    return Workload(
        shape=shape,
        page_size=args.page_size,
        requests=args.requests,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        chunks=(args.chunks,),
        chunk_gap_ms=args.chunk_gap_ms,
        fragmentation=args.fragmentation,
        state=not args.no_state and not args.host_every,
        seed=args.seed,
        host_every=max(0, args.host_every),
        decode_page_size=max(0, args.decode_page_size),
    )


def _run(cfg: Any, quiet: bool) -> Any:
    from sgl_nixl_plugin.bench.session import Session

    session = Session(cfg).start()
    if quiet:
        return session.wait()
    from tqdm import tqdm

    with tqdm(
        total=cfg.workload.requests, desc=f"{cfg.backend:>7}", unit="req", file=sys.stderr
    ) as bar:
        return session.wait(lambda n: bar.update(max(0, n - bar.n)))


def _single_role(args: argparse.Namespace, workload: Workload) -> int:
    from sgl_nixl_plugin.bench.rank import RankSpec, rank_main

    if not args.bootstrap:
        print("--role needs --bootstrap HOST:PORT", file=sys.stderr)
        return 2
    host, _, port = args.bootstrap.rpartition(":")
    tp = args.prefill_tp if args.role != "decode" else args.decode_tp
    spec = RankSpec(
        role=args.role,
        instance=0,
        tp_size=tp,
        tp_rank=args.tp_rank,
        dp_size=args.decode_dp if args.role == "decode" else args.prefill_dp,
        workload=workload,
        bootstrap_port=int(port),
        prefill_addrs=[args.bootstrap],
        serve_bootstrap=False,
        mem_kind=args.mem,
        gpu_id=args.prefill_gpu if args.role == "prefill" else args.decode_gpu,
        deadline_s=args.timeout,
        verify=not args.no_verify,
    )
    ctx = mp.get_context("spawn")
    out, done = ctx.Queue(), ctx.Event()
    if args.role == "decode":
        done.set()  # a prefill serves until its decodes are done; a bootstrap until --timeout
    rank_main(spec, out, done)
    while True:
        role, _, _, result = out.get()
        if "progress" not in result:
            break
    if "error" in result:
        print(result["error"], file=sys.stderr)
        return 1
    results = result["results"]
    ok = sum(1 for r in results.values() if r["ok"])
    bad = sum(r.get("bad_pages", 0) for r in results.values())
    print(
        json.dumps(
            {
                "role": role,
                "ok": ok,
                "failed": len(results) - ok,
                "timed_out": len(result["timed_out"]),
                "corrupt_pages": bad,
            }
        )
    )
    return 0 if ok == len(results) and not result["timed_out"] and not bad else 1


def _serve_metrics(port: int) -> None:
    """Collect the rank processes' metrics (prometheus-client multiprocess mode) and serve them."""
    import os
    import tempfile

    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="sgl-nixl-metrics-"))
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    start_http_server(port, addr="127.0.0.1", registry=registry)
    print(f"metrics: http://127.0.0.1:{port}/metrics", file=sys.stderr)


def _quiet_libraries(verbose: bool) -> None:
    """Keep the progress bar and the table readable: the rank processes (they inherit this
    environment) log at WARNING, NIXL at WARN, and SGLang's warnings about CUDA-only
    quantization kernels, irrelevant to KV transfer, are dropped unless ``--verbose``."""
    import os

    if verbose:
        os.environ["SGLANG_NIXL_PLUGIN_BENCH_LOG"] = "INFO"
        os.environ.setdefault("NIXL_LOG_LEVEL", "INFO")
    else:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries(args.verbose)
    from sgl_nixl_plugin.bench.report import summarize, table
    from sgl_nixl_plugin.bench.session import SessionConfig

    workload = workload_of(args)
    if args.metrics_port:
        _serve_metrics(args.metrics_port)
    if args.role:
        return _single_role(args, workload)
    if args.compare and workload.pages_differ:
        print(
            f"--compare {args.compare}: SGLang's backends need equal page sizes on both sides; "
            "drop --decode-page-size to compare",
            file=sys.stderr,
        )
        return 2
    if args.compare:
        # SGLang's in-tree backend registers state buffers as VRAM: compare without state.
        workload = replace(workload, state=False)
    if args.decode_pp not in (1, args.prefill_pp) or args.prefill_pp < 1:
        print(
            f"--decode-pp {args.decode_pp}: SGLang pairs a decode at the prefill's PP size "
            f"({args.prefill_pp}) or at PP 1",
            file=sys.stderr,
        )
        return 2
    for role, tp, dp, pp in (
        ("prefill", args.prefill_tp, args.prefill_dp, args.prefill_pp),
        ("decode", args.decode_tp, args.decode_dp, args.decode_pp),
    ):
        if dp < 1 or tp % dp or (dp > 1 and pp > 1):
            print(
                f"--{role}-dp {dp}: it must divide --{role}-tp ({tp}), without PP",
                file=sys.stderr,
            )
            return 2
    if args.decode_pp != args.prefill_pp and workload.state:
        # a hybrid model's state buffers are per stage: refused into a PP 1 decode
        workload = replace(workload, state=False)
    cfg = SessionConfig(
        workload,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        prefill_pp=args.prefill_pp,
        decode_pp=args.decode_pp,
        prefill_dp=args.prefill_dp,
        decode_dp=args.decode_dp,
        mem_kind=args.mem,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
        timeout_s=args.timeout,
        verify=not args.no_verify,
        preconnect=args.preconnect,
    )
    summaries = [summarize(_run(cfg, args.quiet))]
    if args.compare:
        summaries.append(summarize(_run(replace(cfg, backend=args.compare), args.quiet)))
    shape: ModelShape = workload.shape
    header = (
        f"{shape.name}: {shape.layers} layers x {'latent' if shape.mla else f'{shape.kv_heads} KV heads'}"
        f" x {shape.head_dim} ({shape.dtype}), page size {workload.page_size}"
        + (f" -> {workload.page_size_of('decode')}" if workload.pages_differ else "")
        + ", "
        f"{workload.requests} requests of {workload.min_tokens}-{workload.max_tokens} tokens, "
        f"concurrency {workload.concurrency}, {workload.fragmentation} pages, "
        f"TP {args.prefill_tp}->{args.decode_tp}, "
        + (f"PP {args.prefill_pp}->{args.decode_pp}, " if args.prefill_pp > 1 else "")
        + (
            f"DP {args.prefill_dp}->{args.decode_dp}, "
            if args.prefill_dp > 1 or args.decode_dp > 1
            else ""
        )
        + f"{args.mem}"
        + (", decodes registered at start-up" if args.preconnect else "")
    )
    if args.json:
        print(json.dumps({"workload": header, "results": summaries}, indent=2))
    else:
        print(header)
        print(table(summaries))
        for s in summaries:
            for e in s["errors"]:
                print(f"[{s['backend']}] error: {e}")
            for r in s["failure_reasons"]:
                print(f"[{s['backend']}] failure: {r}")
    ours = summaries[0]
    return 0 if ours["failed"] == 0 and ours["corrupt_pages"] == 0 and not ours["errors"] else 1
