"""The plugin in real ``python -m sglang.launch_server`` processes (SGLang 0.5.23, CPU only).

For each configuration a prefill and a decode server (``--disaggregation-transfer-backend
nixl``) and the router (``sglang_router.launch_router --pd-disaggregation --mini-lb``) run on
127.0.0.1 with a tiny random-weight Llama written at test time (tiny_model.py). Greedy
/generate requests go through the router one at a time, then all at once, and their
``output_ids`` must equal, token for token, those of a normal (non-disaggregated) reference
server on the same weights and flags.

The same stage runs with SGLang's in-tree nixl backend as the control: it proves the stage
itself is right (a stage that failed the in-tree backend too would say nothing about ours).
The controls run in the full run (``bash ci/run_tests.sh --full``), with the combinations
the gate leaves out (``Config.full``); the gate keeps one stack per feature.
The control keeps our plugin out with SGLang's ``SGLANG_PLUGINS`` whitelist and needs one
test-tree shim (shims/intree_dram: its CPU pool relabelled DRAM); the plugin run needs none.
Server logs are checked too: the plugin run's prefill and decode say ``sgl-nixl: ... manager
ready`` once per TP rank, and the control's logs never mention ``sgl-nixl``.

A negative control shows the comparison is sensitive to the KV the decode received: with a
test-only plugin (shims/kv_damage) that zeroes one layer-0 key per request on the decode
server, most requests must differ from the reference (their first token, which the prefill
samples, must not).

Budget: about 30-60 s per server start on 2 cores; one reference server per TP size is
started, queried and stopped before the first configuration that needs it, and each
configuration reuses one PD pair for all its requests. See shims/README.md for the shims,
stack.py for every flag and variable, and why each is there.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import requests

from sgl_nixl_plugin import __version__
from sgl_nixl_plugin.adapter import release_gate

from .procs import ProcessGroup
from .stack import (
    CHUNKED_PREFILL,
    DP_CPU_MARKER,
    HOST_POOL_MARKER,
    INTREE_DRAM_MARKER,
    INTREE_DRAM_PLUGIN,
    KV_DAMAGE_MARKER,
    KV_DAMAGE_PLUGIN,
    REQUEST_TIMEOUT_S,
    SHIM_PLUGINS,
    TIMEOUT_SCALE,
    Launcher,
    PDStack,
    logs_on_failure,
    server_env,
)
from .tiny_model import build_tiny_llama, build_tiny_qwen3
from .workload import make_requests, mismatches, run_concurrent, run_sequential

pytestmark = pytest.mark.realserver

#: Modules the servers and the router import that the light test set does not carry
#: (ci/requirements-sglang-server.txt installs them).
SERVER_MODULES = (
    "fastapi", "uvicorn", "uvloop", "multipart", "setproctitle", "openai",
    "partial_json_parser", "einops", "jsonschema", "xgrammar", "soundfile", "sglang_router",
    "transformers", "tokenizers", "sglang", "nixl",
)  # fmt: skip

SEQUENTIAL = make_requests(seed=1, tag="a")
#: The concurrent batch repeats the sequential prompts (prefix-cache hits on the prefill
#: server) and adds fresh ones.
CONCURRENT = SEQUENTIAL + make_requests(seed=2, tag="b", with_text=False)


@dataclass(frozen=True)
class Config:
    backend: str  # "plugin" or "in-tree"
    page: int
    tp: int = 1
    batches: tuple[str, ...] = ("sequential", "concurrent")
    metrics: bool = False  # both servers with --enable-metrics; the prefill's series checked
    host: bool = False  # the decode receives every request into its host pool
    decode_page: int | None = None  # the decode's page size, where it differs
    pp: int = 1  # the prefill's pipeline stages
    decode_pp: int = 1  # the decode's: 1 or ``pp``
    prefill_dp: int = 1  # attention DP ranks (--enable-dp-attention --dp-size N)
    decode_dp: int = 1
    named: bool = False  # the decode names its prefill (SGLANG_NIXL_PLUGIN_PREFILLS)
    full: bool = False  # only in the full run (the gate runs one stack per feature)

    @property
    def dp(self) -> bool:
        return max(self.prefill_dp, self.decode_dp) > 1

    @property
    def id(self) -> str:
        tp = f"-tp{self.tp}" if self.tp > 1 else ""
        pp = f"-pp{self.pp}to{self.decode_pp}" if self.pp > 1 else ""
        dp = f"-dp{self.prefill_dp}to{self.decode_dp}" if self.dp else ""
        page = f"p{self.page}" + (f"-d{self.decode_page}" if self.decode_page else "")
        named = "-named" if self.named else ""
        return f"{self.backend}-{page}{tp}{pp}{dp}" + ("-host" if self.host else "") + named


#: Page sizes a real server can run on a CPU. SGLang 0.5.21 allocates pages of more than one
#: token with a Triton kernel only (its paged allocator has no CPU path), so its stage runs
#: page size 1; later releases allocate on the CPU too.
CPU_PAGE_SIZES = (
    (1,)
    if release_gate.contract_for(release_gate.installed_sglang_version()) == "sglang_0_5_21"
    else (1, 16, 64)
)


#: Pipeline-parallel servers run on the newest release only: a PD pair of them takes 2-3
#: minutes to start on CI's 2 cores, and the multi-process tests cover 0.5.21's PP path.
PP_ON_CPU = CPU_PAGE_SIZES != (1,)

#: DP attention runs on the newest release only (the same releases as PP);
#: ``SGL_NIXL_REALSERVER_DP=0`` leaves it out. A DP pair is four schedulers, two DP
#: controllers and the router on the host's cores (~4 minutes on 2 cores); there the
#: prefill's control threads stall for 4-18 s in their own handlers (a warm-up WRITE to a
#: starved decode; batches of requests). Before liveness used ZMTP heartbeats, decodes
#: called such a live prefill lost after 5 s, and 3 of 6 DP runs failed so.
DP_ON_CPU = PP_ON_CPU and os.environ.get("SGL_NIXL_REALSERVER_DP", "1") != "0"

#: SGLang 0.5.21's host pools allocate and copy through CUDA only (the host_pool_cpu shim
#: stands in for 0.5.22's and later layouts): its stage runs no host-receive config.
HOST_RECEIVE_ON_CPU = CPU_PAGE_SIZES != (1,)


def _runnable(configs: tuple[Config, ...]) -> tuple[Config, ...]:
    """The configurations at page sizes this SGLang runs on a CPU (others at page size 1;
    one configuration per id, with metrics if any of the ones it stands for had them, and
    in the gate if any of them is)."""
    out: dict[str, Config] = {}
    for c in configs:
        if c.host and not HOST_RECEIVE_ON_CPU:
            continue
        if c.pp > 1 and not PP_ON_CPU:
            continue
        if c.dp and not DP_ON_CPU:
            continue
        if c.decode_page and not {c.page, c.decode_page} <= set(CPU_PAGE_SIZES):
            continue  # a page-size difference needs paged allocation on both servers
        if c.page not in CPU_PAGE_SIZES:
            c = replace(c, page=1)
        prev = out.get(c.id)
        if prev is not None:
            c = replace(prev, metrics=prev.metrics or c.metrics, full=prev.full and c.full)
        out[c.id] = c
    return tuple(out.values())


#: The gate runs one stack per feature (``full=False``); ``bash ci/run_tests.sh --full`` adds
#: the other combinations. The gate's stacks: page-size pairing with metrics (the device
#: path), TP 2, host receive, pipeline stages into a PP 1 decode, and the damaged-KV control
#: below; on 0.5.21 (page size 1 only) the page-16 stacks fold into ``plugin-p1``. DP
#: attention's gate check is the multi-process ``tests/e2e/test_dp_attention.py``.
CONFIGS = _runnable(
    (
        Config("plugin", 1, full=True),
        Config("plugin", 16, metrics=True, full=True),
        # SGLang's own backend on the same stage: proves the stage, not our plugin
        Config("in-tree", 16, full=True),
        Config("in-tree", 1, full=True),
        # TP 2, the decode naming its prefill: linked and warmed before the first request
        Config("plugin", 16, tp=2, named=True),
        Config("plugin", 16, host=True),
        # pages of different sizes on each side, both ways, paired token by token
        Config("plugin", 16, decode_page=64, metrics=True),
        Config("plugin", 64, decode_page=16, batches=("concurrent",), full=True),
        # pipeline stages: each writes its layer into a PP 1 decode, or into its own stage
        # (SGLang's in-tree backend cannot run the first on a CPU host: it takes the decode's
        # larger layer list for a speculative draft and refuses DRAM there)
        Config("plugin", 16, pp=2, decode_pp=1, batches=("concurrent",)),
        Config("plugin", 16, pp=2, decode_pp=2, batches=("concurrent",), full=True),
        # DP attention (both servers TP 2, two attention DP ranks of attention TP 1, on the
        # tiny model as Qwen3: SGLang's Llama has no DP attention): a DeepSeek-style decode
        # behind a TP prefill (each decode rank reads its heads from both prefill ranks), and
        # a DP prefill too (the decode picks the prefill DP rank from the bootstrap room)
        Config("plugin", 16, tp=2, decode_dp=2, batches=("concurrent",), full=True),
        Config("plugin", 16, tp=2, prefill_dp=2, decode_dp=2, batches=("concurrent",), full=True),
        # The in-tree backend is several times slower here (its 8 prefill transfer threads and
        # UCX progress share 2 cores with 4 TP ranks), so its TP 2 control sends only the
        # concurrent batch: every prompt still, the sequential ones included.
        Config("in-tree", 16, tp=2, batches=("concurrent",), full=True),
    )
)
BATCHES = {"sequential": (run_sequential, SEQUENTIAL), "concurrent": (run_concurrent, CONCURRENT)}


def _missing_modules() -> list[str]:
    return [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]


@pytest.fixture(scope="module", autouse=True)
def _server_dependencies() -> None:
    missing = _missing_modules()
    if not missing:
        return
    message = (
        f"real-server stage: server dependencies not installed ({', '.join(missing)}); "
        "install ci/requirements-sglang-server.txt (ci/setup_env.sh does)"
    )
    if os.environ.get("CI"):
        pytest.fail(message + " -- and CI is set, where the stage must run", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="module")
def rs_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("realserver")


@pytest.fixture(scope="module")
def group(rs_tmp: Path) -> Iterator[ProcessGroup]:
    logs = rs_tmp / "logs"
    logs.mkdir()
    g = ProcessGroup(logs, rs_tmp)
    try:
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="module")
def launcher(group: ProcessGroup, rs_tmp: Path) -> Launcher:
    model = build_tiny_llama(rs_tmp / "tiny-llama")
    dp_model = build_tiny_qwen3(rs_tmp / "tiny-qwen3") if any(c.dp for c in CONFIGS) else None
    return Launcher(group, model, rs_tmp, dp_model)


@pytest.fixture(scope="module")
def reference_outputs(
    launcher: Launcher, group: ProcessGroup
) -> Callable[..., dict[str, list[int]]]:
    """``get(tp, dp_model=False)``: the reference server's output ids per request name
    (started once per tp and model; the DP model's reference runs without DP attention)."""
    cache: dict[tuple[int, bool], dict[str, list[int]]] = {}

    def get(tp: int, dp_model: bool = False) -> dict[str, list[int]]:
        if (tp, dp_model) in cache:
            return cache[(tp, dp_model)]
        with logs_on_failure(group):
            server = launcher.reference(tp, dp_model=dp_model)
            try:
                wanted = list({r.name: r for r in CONCURRENT}.values())
                results = run_sequential(server.url, wanted, REQUEST_TIMEOUT_S)
                broken = [f"{r.req.name}: {r.error}" for r in results if r.error]
                assert not broken, "reference server failed requests:\n" + "\n".join(broken)
                expected = {r.req.name: r.output_ids for r in results}
                # Exact comparison is meaningful only if the reference agrees with itself
                # when the same requests run batched together.
                again = mismatches(
                    run_concurrent(server.url, CONCURRENT, REQUEST_TIMEOUT_S), expected
                )
                assert not again, (
                    "the reference server's own concurrent outputs differ from its "
                    "sequential ones, so exact comparison is not possible:\n" + "\n".join(again)
                )
            finally:
                launcher.stop([server.proc])
        cache[(tp, dp_model)] = expected
        return expected

    return get


def _count(text: str, needle: str) -> int:
    return text.count(needle)


def _room_lines(log: str, prefix: str) -> set[int]:
    """Rooms with a per-room line ``<prefix> R: ok`` (SGLANG_NIXL_PLUGIN_LOG_LEVEL=DEBUG)."""
    return {int(m) for m in re.findall(rf"{prefix} (\d+): ok ", log)}


def _log_problems(stack: PDStack, sent: int) -> list[str]:
    problems = []
    for role, server in (("prefill", stack.prefill), ("decode", stack.decode)):
        # one manager per scheduler process: TP x PP of that server
        tp = stack.tp * (stack.prefill_pp if role == "prefill" else stack.decode_pp)
        log = server.proc.log_text()
        if "Traceback (most recent call last)" in log:
            problems.append(f"{role} log has a Traceback")
        if stack.backend == "plugin":
            ready = _count(log, f"sgl-nixl: {role} manager ready")
            if ready != tp:
                problems.append(
                    f"{role} log: 'sgl-nixl: {role} manager ready' {ready} times, expected {tp}"
                )
            # each names the memory the plugin holds for staging (a host pool here: DRAM):
            # none at start-up, taken once at most, when a peer first stages
            held = _count(log, "0 MiB of host memory for staging (up to ")
            if held != tp:
                problems.append(
                    f"{role} log: no staging memory at start-up named {held} times, not {tp}"
                )
            taken = _count(log, "MiB of host memory for staging (")  # the start-up lines too
            if taken - held > tp:
                problems.append(f"{role} log: {taken - held} staging allocations on {tp} ranks")
            startup = f"sgl-nixl-plugin {__version__} serving: registered transfer backend(s): nixl"
            if _count(log, startup) != tp:  # once per scheduler process
                problems.append(
                    f"{role} log: {startup!r} {_count(log, startup)} times, expected {tp}"
                )
            if _count(log, "DRAM KV") != tp:  # the memory kind came from the pointers
                problems.append(f"{role} log: the KV pool was not registered as DRAM on every rank")
            if INTREE_DRAM_MARKER in log:
                problems.append(f"{role} log: the plugin run loaded the in-tree control shim")
            # the plugin's own level (the server runs at --log-level info): a line per room
            prefix = "sgl-nixl room" if role == "prefill" else "sgl-nixl decode room"
            rooms = _room_lines(log, prefix)
            if len(rooms) < sent:
                problems.append(
                    f"{role} log: {len(rooms)} rooms with a '{prefix} R: ok' line, {sent} "
                    "requests sent"
                )
            # the warm-up at first contact: each decode rank registered with its prefill
            # ranks before its first request (every stage of a PP 1 decode, every DP group,
            # every attention TP rank holding its heads), and each of them linked it once
            # per decode rank that registered: with a warm-up WRITE into its padding page
            # when the decode named it at start-up, without one when a request waited
            n = stack.links_per_decode_rank
            decode_ranks = stack.tp * stack.decode_pp
            warm = f"{n} of {n} ranks linked and warmed" if role == "decode" else ", warm-up WRITE "
            if role == "prefill" and not stack.named:
                warm = ", no warm-up WRITE (a request was waiting)"
            expected = decode_ranks if role == "decode" else decode_ranks * n
            if _count(log, warm) != expected:
                why = [ln for ln in log.splitlines() if "warm-up" in ln or "connect" in ln]
                problems.append(
                    f"{role} log: {warm!r} {_count(log, warm)} times, expected {expected}; its "
                    "warm-up and connection lines:\n  " + "\n  ".join(why[-8:])
                )
            if role == "decode":
                # each decode rank's first look at the prefill (SGLang's topology query) was
                # answered from the route table its warm-up asked for: one GET, not two
                first = _count(log, "SGLang's first look answered from the route table")
                if first != decode_ranks:
                    problems.append(
                        f"decode log: SGLang's first look answered from the route table {first} "
                        f"times, expected {decode_ranks}"
                    )
            if role == "decode" and stack.named:
                problems += _named_prefill_problems(log, decode_ranks)
            if role == "prefill" and stack.prefill_pp > 1:
                whose = "its own stage" if stack.decode_pp > 1 else "its layers of this stage"
                staged = f"into decode PP 0/{stack.decode_pp} ({whose})"
                if stack.decode_pp > 1:
                    staged = f"/{stack.decode_pp} ({whose})"
                if _count(log, staged) != tp:
                    problems.append(f"prefill log: {staged!r} {_count(log, staged)} times")
            if role == "prefill" and stack.decode_page != stack.page:
                paired = f"pages of {stack.page} tokens into pages of {stack.decode_page}"
                if _count(log, paired) != tp:
                    problems.append(f"prefill log: {paired!r} {_count(log, paired)} times")
            dp = stack.prefill_dp if role == "prefill" else stack.decode_dp
            if dp > 1:
                # DP attention really ran: the shim loaded, and every DP rank did batches
                kind = "Prefill" if role == "prefill" else "Decode"
                idle = [r for r in range(dp) if f"DP{r} TP{r}] {kind} batch" not in log]
                if DP_CPU_MARKER not in log or idle:
                    problems.append(
                        f"{role} log: DP shim marker {'seen' if DP_CPU_MARKER in log else 'absent'}"
                        f", no {kind.lower()} batch on DP ranks {idle}"
                    )
        else:
            if "sgl-nixl" in log:
                line = next(ln for ln in log.splitlines() if "sgl-nixl" in ln)
                problems.append(f"{role} log of the in-tree control mentions sgl-nixl: {line}")
            shim = _count(log, INTREE_DRAM_MARKER)
            if shim != tp:
                problems.append(
                    f"{role} log: control shim marker {shim} times, expected {tp} (one per rank)"
                )
    return problems


def _named_prefill_problems(log: str, decode_ranks: int) -> list[str]:
    """A decode that names its prefill (``SGLANG_NIXL_PLUGIN_PREFILLS``) registers with it
    at start-up on every rank: each rank's "linked and warmed" line comes before the first
    request's room line, so the first request a user sends finds the pair ready."""
    problems = []
    up = _count(log, "(named in SGLANG_NIXL_PLUGIN_PREFILLS) is up")
    if up != decode_ranks:
        problems.append(f"decode log: the named prefill seen up {up} times, not {decode_ranks}")
    lines = log.splitlines()
    warmed = [i for i, ln in enumerate(lines) if "ranks linked and warmed" in ln]
    rooms = [i for i, ln in enumerate(lines) if "sgl-nixl decode room" in ln]
    if rooms and (len(warmed) < decode_ranks or warmed[decode_ranks - 1] > rooms[0]):
        problems.append(
            f"decode log: {len(warmed)} ranks linked and warmed before line {rooms[0]} (the "
            f"first room's), not {decode_ranks}"
        )
    return problems


def _series(url: str) -> dict[str, float]:
    """``name{labels}`` -> value of every ``sgl_nixl_*`` sample a server's /metrics shows."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("sgl_nixl_"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "pid")
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def _host_receive_problems(stack: PDStack, sent: int) -> list[str]:
    """Every request went through the decode's host pool: our manager registered it, and
    SGLang loaded each received request from it into the device pool (the shim's marker,
    once per request) before decoding."""
    log = stack.decode.proc.log_text()
    problems = []
    if _count(log, "sgl-nixl: decode manager ready") != _count(log, "with a host pool of"):
        problems.append("decode log: a manager came up without a host pool")
    loaded = _count(log, HOST_POOL_MARKER)
    if loaded < sent:
        problems.append(f"decode log: {loaded} host pool loads for {sent} requests sent")
    return problems


def _metrics_problems(stack: PDStack, sent: int) -> list[str]:
    """SGLang runs its metrics in multiprocess mode: our series, counted in the scheduler
    process, must reach the server's /metrics and count every request sent, each once."""
    pre, dec = _series(stack.prefill.url), _series(stack.decode.url)

    def total(series: dict[str, float], name: str, **labels: str) -> float:
        want = [f"{k}={v}" for k, v in labels.items()]
        return sum(
            v for k, v in series.items()
            if k.split("{")[0] == name and all(w in k for w in want)
        )  # fmt: skip

    problems = []
    ok = total(pre, "sgl_nixl_transfers_total", outcome="ok")
    if ok != sent:
        problems.append(
            f"prefill /metrics: sgl_nixl_transfers_total{{outcome=ok}} {ok}, sent {sent}"
        )
    rooms = total(pre, "sgl_nixl_room_seconds_count")
    if rooms != sent:
        problems.append(f"prefill /metrics: sgl_nixl_room_seconds_count {rooms}, sent {sent}")
    if total(pre, "sgl_nixl_transfer_bytes_total") <= 0:
        problems.append("prefill /metrics: no sgl_nixl_transfer_bytes_total")
    failed = total(pre, "sgl_nixl_failures_total") + total(dec, "sgl_nixl_failures_total")
    if failed:
        problems.append(f"/metrics: {failed} sgl_nixl_failures_total on a run with no failure")
    return problems


def _run_batches(
    stack: PDStack, expected: dict[str, list[int]], batches: tuple[str, ...]
) -> tuple[list[str], dict]:
    timings = {}
    problems = []
    for label in batches:
        runner, reqs = BATCHES[label]
        started = time.monotonic()
        results = runner(stack.url, reqs, REQUEST_TIMEOUT_S)
        timings[f"{label}_s"] = round(time.monotonic() - started, 1)
        problems += [f"{label}: {line}" for line in mismatches(results, expected)]
    return problems, timings


@pytest.mark.timeout(int(900 * TIMEOUT_SCALE))
@pytest.mark.parametrize(
    "cfg",
    [pytest.param(c, id=c.id, marks=[pytest.mark.full] if c.full else []) for c in CONFIGS],
)
def test_pd_output_ids_match_reference(
    cfg: Config,
    launcher: Launcher,
    group: ProcessGroup,
    reference_outputs: Callable[[int], dict[str, list[int]]],
    record_property: Callable[[str, object], None],
) -> None:
    expected = reference_outputs(cfg.tp, dp_model=cfg.dp)
    with logs_on_failure(group):
        extra = ["--enable-metrics"] if cfg.metrics else []
        stack = launcher.pd(
            cfg.backend,
            cfg.tp,
            cfg.page,
            extra=extra,
            host_receive=cfg.host,
            decode_page=cfg.decode_page,
            prefill_pp=cfg.pp,
            decode_pp=cfg.decode_pp,
            prefill_dp=cfg.prefill_dp,
            decode_dp=cfg.decode_dp,
            named=cfg.named,
        )
        try:
            record_property("pd_startup_s", round(stack.startup_s, 1))
            problems, timings = _run_batches(stack, expected, cfg.batches)
            for key, value in timings.items():
                record_property(key, value)
            problems += _log_problems(stack, sum(len(BATCHES[b][1]) for b in cfg.batches))
            if cfg.host:
                problems += _host_receive_problems(
                    stack, sum(len(BATCHES[b][1]) for b in cfg.batches)
                )
            if cfg.metrics:
                sent = sum(len(BATCHES[b][1]) for b in cfg.batches)
                problems += _metrics_problems(stack, sent)
            assert not problems, f"{cfg.id}:\n" + "\n".join(problems)
            sent = " + ".join(f"{len(BATCHES[b][1])} {b}" for b in cfg.batches)
            print(
                f"{cfg.id}: {sent} requests match the reference exactly; "
                f"startup {stack.startup_s:.0f}s, {timings}"
            )
        finally:
            launcher.stop(stack.procs)


@pytest.mark.timeout(int(600 * TIMEOUT_SCALE))
def test_stage_detects_damaged_kv(
    launcher: Launcher,
    group: ProcessGroup,
    reference_outputs: Callable[[int], dict[str, list[int]]],
) -> None:
    """Negative control: a decode that damages one received KV entry must fail the stage.

    The decode server also loads shims/kv_damage, which zeroes the layer-0 key of one prompt
    token per request after the transfer. Every first output token (sampled on the prefill
    server) must still match, and most requests must then differ: the comparison depends on
    the KV the decode server received through the plugin.
    """
    expected = reference_outputs(1)
    with logs_on_failure(group):
        stack = launcher.pd("plugin", 1, CPU_PAGE_SIZES[-1], decode_plugins=[KV_DAMAGE_PLUGIN])
        try:
            results = run_sequential(stack.url, SEQUENTIAL, REQUEST_TIMEOUT_S)
            failed = [f"{r.req.name}: {r.error}" for r in results if r.error]
            assert not failed, "requests failed:\n" + "\n".join(failed)
            damaged = stack.decode.proc.log_text().count(KV_DAMAGE_MARKER)
            assert damaged == len(SEQUENTIAL), f"{damaged} damage markers, {len(SEQUENTIAL)} sent"
            first = [r.req.name for r in results if r.output_ids[0] != expected[r.req.name][0]]
            assert not first, f"first output token (from prefill) differs for {first}"
            differ = [r.req.name for r in results if r.output_ids != expected[r.req.name]]
            assert len(differ) * 2 >= len(results), (
                f"only {len(differ)} of {len(results)} requests changed when the decode's "
                f"received KV was damaged ({differ}): the stage is not sensitive to the KV"
            )
            print(f"kv damage: {len(differ)} of {len(results)} requests differ, as they must")
        finally:
            launcher.stop(stack.procs)


def test_stage_setup(tmp_path: Path) -> None:
    """The workload covers chunks and page boundaries; the plugin run has no override."""
    lengths = {len(r.input_ids) for r in SEQUENTIAL if r.input_ids}
    assert max(lengths) > 3 * CHUNKED_PREFILL  # spans several prefill chunks
    assert {15, 16, 17} <= lengths and {63, 64, 65} <= lengths
    names = [r.name for r in CONCURRENT]
    assert len(set(names)) == len(names)

    plugin = server_env("plugin", 1, tmp_path)
    assert "SGLANG_PLUGINS" not in plugin  # SGLang's normal discovery finds our entry point
    assert not [k for k in plugin if "MEM_KIND" in k]  # the plugin detects DRAM itself
    assert str(SHIM_PLUGINS[INTREE_DRAM_PLUGIN]) not in plugin["PYTHONPATH"].split(os.pathsep)
    control = server_env("in-tree", 1, tmp_path)
    assert control["SGLANG_PLUGINS"] == INTREE_DRAM_PLUGIN  # whitelist: sgl_nixl_plugin skipped


def test_a_stack_that_never_gets_ready_is_stopped_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill that never answers /health fails ``pd()``, which stops the servers and the
    router it started instead of leaving them to the module's teardown, where they kept the
    cores busy and the next test's servers never got ready (seen in CI)."""
    from . import stack as stack_module

    never_ready = [sys.executable, "-c", "import time; time.sleep(600)"]
    monkeypatch.setattr(stack_module, "server_argv", lambda *a, **k: never_ready)
    monkeypatch.setattr(stack_module, "SERVER_READY_S", 2.0)
    logs = tmp_path / "logs"
    logs.mkdir()
    g = ProcessGroup(logs, tmp_path)
    try:
        with pytest.raises(TimeoutError, match="/health not ready after 2s"):
            Launcher(g, tmp_path, tmp_path).pd("plugin", 1, 16)
        assert [p.name for p in g.procs] == [
            "prefill-plugin-tp1-p16",
            "decode-plugin-tp1-p16",
            "router-plugin-tp1-p16",
        ]
        assert [p.name for p in g.procs if p.alive()] == []
    finally:
        g.stop()
