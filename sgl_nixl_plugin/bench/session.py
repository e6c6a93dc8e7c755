"""A whole PD session in local processes: bootstrap, prefill ranks, decode ranks.

Used by ``sgl-nixl-plugin bench`` and by the end-to-end tests. Every process has a
deadline and is terminated (then killed) when the session ends, whatever happened.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from sgl_nixl_plugin.bench import procs
from sgl_nixl_plugin.bench.ports import free_port
from sgl_nixl_plugin.bench.rank import INTREE_PLUGINS, RankSpec, rank_main, requests_of
from sgl_nixl_plugin.bench.workload import Workload

LOOPBACK_ENV = {
    # Keep every byte of control and data traffic on the loopback interface.
    "SGLANG_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "PYTHONWARNINGS": "ignore",
}


def _rank_process(
    spec: RankSpec, out: Any, done: Any, release: Any, inherited: procs.Inherited
) -> None:
    """Process target: run the rank, flush its result, then exit at once. A backend may leave
    non-daemon threads behind (SGLang's in-tree NIXL prefill starts its bootstrap thread
    without ``daemon=True``), which would keep the process alive until ``_reap`` gives up
    after 15 s and terminates it."""
    inherited.apply()
    rank_main(spec, out, done, release)
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@dataclass
class SessionConfig:
    workload: Workload
    prefill_tp: int = 1
    decode_tp: int = 1
    n_prefill: int = 1
    n_decode: int = 1
    backend: str = "plugin"  # plugin | in-tree
    mem_kind: str = "DRAM"
    prefill_gpu: int = 0
    decode_gpu: int = 0
    separate_bootstrap: bool = False
    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    # extra environment of one role's ranks ("prefill", "decode"), over ``env``
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    verify: bool = True
    prefill_pp: int = 1  # pipeline stages of each prefill server
    decode_pp: int = 1  # of each decode server: 1 or prefill_pp (what SGLang pairs)
    # DP attention (--enable-dp-attention --dp-size N) of each server: N attention DP groups
    # of tp / N ranks each; 1: none
    prefill_dp: int = 1
    decode_dp: int = 1
    # the decodes name the prefills at start-up (SGLANG_NIXL_PLUGIN_PREFILLS), as a static
    # fleet can: the first request of each goes once that registration is done
    preconnect: bool = False

    def __post_init__(self) -> None:
        for role, tp, dp, pp in (
            ("prefill", self.prefill_tp, self.prefill_dp, self.prefill_pp),
            ("decode", self.decode_tp, self.decode_dp, self.decode_pp),
        ):
            if dp < 1 or tp % dp:
                raise ValueError(f"{role} DP {dp} does not divide its TP {tp}")
            if dp > 1 and pp > 1:
                raise ValueError(f"{role}: DP attention with PP is not covered by the bench")

    def ranks(self, role: str) -> int:
        """Scheduler processes of one ``role`` server (TP x PP)."""
        if role == "prefill":
            return self.prefill_tp * self.prefill_pp
        return self.decode_tp * self.decode_pp

    def rooms_of(self, role: str, instance: int, rank: int) -> set[int]:
        """The rooms world rank ``rank`` of server ``instance`` of ``role`` takes part in."""
        tp, dp = (
            (self.prefill_tp, self.prefill_dp)
            if role == "prefill"
            else (self.decode_tp, self.decode_dp)
        )
        n = self.n_prefill if role == "prefill" else self.n_decode
        dp_rank = (rank % tp) // (tp // dp)
        reqs = self.workload.make_requests()
        return {r.room for r in requests_of(reqs, role, instance, n, dp, dp_rank)}


@dataclass
class SessionResult:
    config: SessionConfig
    wall_s: float
    prefill: dict[tuple[int, int], dict[str, Any]]
    decode: dict[tuple[int, int], dict[str, Any]]
    errors: list[str]
    processes: dict[str, Any] = field(default_factory=dict)

    def cpu_s(self) -> float | None:
        """CPU seconds of every prefill and decode rank while its rooms ran (None when a
        rank did not say)."""
        ranks = [*self.prefill.values(), *self.decode.values()]
        if not ranks or any(r.get("cpu_s") is None for r in ranks):
            return None
        return float(sum(r["cpu_s"] for r in ranks))

    def decode_results(self) -> dict[int, dict[str, Any]]:
        """Per room, merged across decode ranks (a room is ok only if every rank is)."""
        out: dict[int, dict[str, Any]] = {}
        for res in self.decode.values():
            for room, r in res.get("results", {}).items():
                prev = out.get(room)
                if prev is None:
                    out[room] = dict(r)
                else:
                    prev["ok"] = prev["ok"] and r["ok"]
                    for k in ("bytes", "bad_pages", "bad_aux", "bad_state"):
                        if k in r:
                            prev[k] = prev.get(k, 0) + r[k]
                    prev["latency_s"] = max(prev.get("latency_s", 0), r.get("latency_s", 0))
                    if r.get("handshake_s", 0) > prev.get("handshake_s", 0):
                        prev["handshake_s"] = r["handshake_s"]
                        prev["handshake_parts"] = r.get("handshake_parts")
                    prev["reason"] = prev.get("reason") or r.get("reason")
        # The clock of a transfer starts once both sides are ready: the decode's request sent
        # and the prefill's sender made (its "forward pass", here filling the pages, may end
        # after the request arrived); the part spent waiting for the prefill is kept apart.
        # What follows the sender's making is ours and counts: the request reaching the
        # prefill, the pair's set-up (a fresh pair's first room waits for it there) and the
        # room's filing, up to WaitingForInput.
        opened: dict[int, float] = {}
        for res in self.prefill.values():
            for room, r in res.get("results", {}).items():
                if r.get("open_wall") is not None:
                    opened[room] = max(opened.get(room, 0.0), r["open_wall"])
        for room, r in out.items():
            late = max(0.0, opened.get(room, 0.0) - r.get("wall0", 0.0))
            if late and "latency_s" in r:
                r["prefill_late_s"] = min(late, r["latency_s"])
                r["latency_s"] -= r["prefill_late_s"]
        return out


def _server_ranks(
    role: str, instance: int, tp: int, pp: int, dp: int = 1, **common: Any
) -> list[RankSpec]:
    """The scheduler ranks of one server, stage-major (SGLang's world-rank order); a PP
    prefill's ranks share a gloo rendezvous port for their PP groups."""
    pp_port = free_port() if role == "prefill" and pp > 1 else 0
    return [
        RankSpec(
            role, instance, tp, r, pp_size=pp, pp_rank=stage, pp_port=pp_port, dp_size=dp, **common
        )
        for stage in range(pp)
        for r in range(tp)
    ]


def _specs(cfg: SessionConfig) -> tuple[list[RankSpec], list[str]]:
    env = {**LOOPBACK_ENV, **cfg.env}
    if cfg.backend == "in-tree":
        env["SGLANG_PLUGINS"] = INTREE_PLUGINS  # exclude our plugin: SGLang's own nixl classes
    ports = [free_port() for _ in range(cfg.n_prefill)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    specs = []
    common = dict(
        workload=cfg.workload,
        n_prefill=cfg.n_prefill,
        n_decode=cfg.n_decode,
        env=env,
        deadline_s=cfg.timeout_s,
        mem_kind=cfg.mem_kind,
        verify=cfg.verify,
    )
    for i, port in enumerate(ports):
        if cfg.separate_bootstrap:
            specs.append(RankSpec("bootstrap", i, cfg.prefill_tp, 0, bootstrap_port=port, **common))
        ranks = _server_ranks(
            "prefill", i, cfg.prefill_tp, cfg.prefill_pp, cfg.prefill_dp,
            bootstrap_port=port, gpu_id=cfg.prefill_gpu,
            **{**common, "env": {**env, **cfg.role_env.get("prefill", {})}},
        )  # fmt: skip
        ranks[0] = replace(ranks[0], serve_bootstrap=not cfg.separate_bootstrap)
        specs += ranks
    common["env"] = {**env, **cfg.role_env.get("decode", {})}
    if cfg.preconnect:
        common["env"] = {**common["env"], "SGLANG_NIXL_PLUGIN_PREFILLS": ",".join(addrs)}
    for i in range(cfg.n_decode):
        specs += _server_ranks(
            "decode", i, cfg.decode_tp, cfg.decode_pp, cfg.decode_dp, bootstrap_port=0,
            prefill_addrs=addrs, gpu_id=cfg.decode_gpu, preconnect=cfg.preconnect, **common,
        )  # fmt: skip
    return specs, addrs


class Session:
    """Starts every rank; ``wait`` collects results; ``kill`` is for failure tests."""

    def __init__(self, cfg: SessionConfig, start_method: str | None = None) -> None:
        """``start_method``: ``spawn`` for ranks whose entry point lives in a script's
        ``__main__`` (a forked child cannot import it); by default, ``procs.context``."""
        self.cfg = cfg
        self.ctx = mp.get_context(start_method) if start_method else procs.context(cfg.mem_kind)
        self.out = self.ctx.Queue()
        self.done = self.ctx.Event()
        self.release = self.ctx.Event()  # every result is in: decode ranks may close
        self.specs, self.addrs = _specs(cfg)
        self.procs: dict[tuple[str, int, int], Any] = {}
        self.started = time.monotonic()

    def start(self) -> Session:
        for spec in self.specs:
            self.start_rank(spec)
        return self

    def start_rank(self, spec: RankSpec) -> None:
        """Start one rank's process, with the environment and output this process has now."""
        p = self.ctx.Process(
            target=_rank_process,
            args=(spec, self.out, self.done, self.release, procs.Inherited()),
            daemon=True,
            name=f"{spec.role}{spec.instance}.{spec.rank}",
        )
        p.start()
        self.procs[(spec.role, spec.instance, spec.rank)] = p

    def kill(self, role: str, instance: int = 0, rank: int = 0) -> None:
        """Kill one rank: ``rank`` is its world rank in the server (``RankSpec.rank``)."""
        p = self.procs[(role, instance, rank)]
        p.kill()
        p.join(timeout=10)

    def wait(self, progress: Any = None) -> SessionResult:
        """Collect every rank's result; ``progress(done_requests)`` is called as decodes report."""
        expected = {k for k, p in self.procs.items() if k[0] != "bootstrap"}
        got: dict[tuple[str, int, int], dict[str, Any]] = {}
        errors: list[str] = []
        deadline = self.started + self.cfg.timeout_s + 60
        decodes = {k for k in expected if k[0] == "decode"}
        counts: dict[tuple[str, int, int], int] = {}
        try:
            while True:
                dead = self._dead()
                missing = expected - set(got) - dead
                if not missing:
                    break
                if decodes <= set(got) | dead:
                    self.done.set()  # decodes finished: prefills may close their sockets
                try:
                    role, inst, rank, res = self.out.get(timeout=1.0)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        errors.append(f"session timed out; missing {sorted(missing)}")
                        break
                    continue
                if "progress" in res:
                    counts[(role, inst, rank)] = res["progress"]
                    if progress is not None:
                        # a room is reported by the ranks of one attention DP group
                        per_room = self.cfg.ranks("decode") // self.cfg.decode_dp
                        progress(sum(counts.values()) // per_room)
                    continue
                got[(role, inst, rank)] = res
                if "error" in res:
                    errors.append(f"{role}{inst}.{rank}: {res['error']}")
            for k in sorted(self._dead() - set(got)):
                errors.append(f"{k[0]}{k[1]}.{k[2]} died with exit code {self.procs[k].exitcode}")
        finally:
            self.done.set()
            self.release.set()
            self._reap()
        wall = time.monotonic() - self.started
        return SessionResult(
            self.cfg,
            wall,
            {(k[1], k[2]): v for k, v in got.items() if k[0] == "prefill"},
            {(k[1], k[2]): v for k, v in got.items() if k[0] == "decode"},
            errors,
            {f"{k[0]}{k[1]}.{k[2]}": p.exitcode for k, p in self.procs.items()},
        )

    def _dead(self) -> set[tuple[str, int, int]]:
        return {
            k for k, p in self.procs.items() if not p.is_alive() and p.exitcode not in (0, None)
        }

    def _reap(self) -> None:
        for p in self.procs.values():
            p.join(timeout=15)
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def run_session(cfg: SessionConfig, progress: Any = None) -> SessionResult:
    return Session(cfg).start().wait(progress)


def with_backend(cfg: SessionConfig, backend: str) -> SessionConfig:
    return replace(cfg, backend=backend)


def cpu_count() -> int:
    return os.cpu_count() or 1
