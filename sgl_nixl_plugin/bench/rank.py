"""One SGLang rank in its own process, driving the real KV classes like a scheduler would.

The classes come only from SGLang's ``load_plugins()`` + ``get_kv_class``, so the same
code drives our plugin or SGLang's in-tree backend (with ``SGLANG_PLUGINS`` excluding us).
Prefill fills each room's pages with a known pattern; decode checks every byte it got
(``prefill_driver``, ``decode_driver``).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import traceback
import warnings
from typing import Any

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench.decode_driver import run_decode
from sgl_nixl_plugin.bench.pools import kv_cache_dtype_arg
from sgl_nixl_plugin.bench.prefill_driver import run_prefill
from sgl_nixl_plugin.bench.spec import INTREE_PLUGINS, RankSpec, requests_of

__all__ = ["INTREE_PLUGINS", "RankSpec", "rank_main", "requests_of", "setup"]


def setup(spec: RankSpec) -> dict[str, Any]:
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


def run_bootstrap(spec: RankSpec, env: dict[str, Any], done: Any) -> dict[str, Any]:
    server = env["classes"]["bootstrap_server"](host="127.0.0.1", port=spec.bootstrap_port)
    done.wait(timeout=spec.deadline_s)
    server.close()
    return {"results": {}, "timed_out": [], "tables": {}}


def configure_logging(level: str) -> None:
    """Log at ``level`` to stderr even where an import already configured the root logger:
    a call through the root logger installs a WARNING handler, after which a plain
    ``basicConfig`` does nothing and the rank's INFO lines (a decode's "set up in" parts)
    never reach the log."""
    logging.basicConfig(level=level, force=True)


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
        configure_logging(settings.value("BENCH_LOG"))
        if logging.getLogger().getEffectiveLevel() > logging.INFO:
            # SGLang warns at import that its CUDA-only quantization kernels are unavailable
            warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
        env = setup(spec)
        if settings.value("BENCH_STACK_DUMP_S") > 0:  # a stalled run says where it waits
            faulthandler.dump_traceback_later(settings.value("BENCH_STACK_DUMP_S"), exit=False)
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
