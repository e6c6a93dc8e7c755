"""Real SGLang 0.5.23 servers on 127.0.0.1: a reference server, a prefill/decode pair, the router.

Everything a server needs to run on a CPU-only host, in one place:

* flags ``--device cpu --attention-backend torch_native --disable-cuda-graph
  --disable-overlap-schedule`` and env ``SGLANG_USE_CPU_ENGINE=1``; decode also needs
  ``--disaggregation-decode-retraction-backup cpu_tensor`` (the default backup pins a host
  pool with ``cudaHostRegister``: "Found no NVIDIA driver on your system");
* ``--dtype float32`` (with ``auto`` SGLang runs this float32 checkpoint in float16 on CPU)
  and ``--max-total-tokens`` (otherwise the KV pool is sized from host RAM: ~16 GB and 16 s
  per server); every server, the reference included, uses the same flags and
  ``--chunked-prefill-size``, so all of them compute the same numbers;
* ``tests/realserver/shims`` (the ``sgl_kernel`` stand-in) on the servers' PYTHONPATH;
* ``SGLANG_HOST_IP=127.0.0.1``: the address SGLang (and the plugin) give their KV control
  sockets, otherwise auto-detected from the machine's interfaces; ``GLOO_SOCKET_IFNAME=lo``
  and ``UCX_NET_DEVICES=lo`` keep gloo's and UCX's listeners on loopback too. The one
  listener left on the wildcard address is torch.distributed's TCPStore in each scheduler
  (c10d binds it so; clients reach it at 127.0.0.1), which no setting moves;
* TP 2 or PP 2: ``SGLANG_CPU_OMP_THREADS_BIND`` gives each rank its own cores (one group
  per TP x PP rank: with fewer, a PP rank's scheduler fails an assertion at start), and
  ``SGLANG_NCCL_SO_PATH`` names a library that does not exist: SGLang's ``PyNcclCommunicator``
  then disables itself ("expected if you are not running on NVIDIA/AMD/MTHREADS GPUs")
  instead of calling ``torch.cuda.device`` on a CPU, and all-reduce runs over gloo;
* which transfer backend: ``plugin`` leaves SGLang's plugin discovery alone (our entry point
  ``sgl_nixl_plugin`` is loaded); ``in-tree`` sets ``SGLANG_PLUGINS=realserver_intree_dram``,
  a whitelist naming only the control shim (shims/intree_dram), so SGLang skips our plugin
  and runs its own nixl classes with the pool relabelled DRAM. The reference server sets
  ``SGLANG_PLUGINS=__none__`` (a whitelist that matches nothing): plain SGLang.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from helpers.subproc import TIMEOUT_SCALE  # the suite's one knob for slow machines

from .procs import ManagedProcess, ProcessGroup, free_ports, wait_http_ok

HERE = Path(__file__).resolve().parent
SHIMS = HERE / "shims"
INTREE_DRAM_PLUGIN = "realserver_intree_dram"
INTREE_DRAM_MARKER = "realserver-shim: in-tree nixl KV regions relabelled DRAM"
#: Negative-control shim (shims/kv_damage), loaded next to our plugin on one decode server.
KV_DAMAGE_PLUGIN = "realserver_kv_damage"
KV_DAMAGE_MARKER = "realserver-shim: damaged received KV"
#: Test-only SGLang plugins by entry-point name, and the folder holding each one's dist-info.
#: SGLang's decode host pool on a CPU host (shims/host_pool_cpu), for host-receive runs.
HOST_POOL_PLUGIN = "realserver_host_pool_cpu"
HOST_POOL_MARKER = "realserver-shim: host pool KV loaded to device"
#: DP attention on a CPU host (shims/dp_cpu), for the servers that run it.
DP_CPU_PLUGIN = "realserver_dp_cpu"
DP_CPU_MARKER = "realserver-shim: DP attention on CPU"
SHIM_PLUGINS = {
    INTREE_DRAM_PLUGIN: SHIMS / "intree_dram",
    KV_DAMAGE_PLUGIN: SHIMS / "kv_damage",
    HOST_POOL_PLUGIN: SHIMS / "host_pool_cpu",
    DP_CPU_PLUGIN: SHIMS / "dp_cpu",
}

SERVER_READY_S = 240 * TIMEOUT_SCALE
WARMUP_TIMEOUT_S = 30 * TIMEOUT_SCALE
ROUTER_READY_S = 60 * TIMEOUT_SCALE
PROCESS_DEADLINE_S = 900 * TIMEOUT_SCALE
REQUEST_TIMEOUT_S = 180 * TIMEOUT_SCALE

#: Every server, reference included, uses these (same numerics everywhere).
CHUNKED_PREFILL = 64
MAX_TOTAL_TOKENS = 8192
CPU_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--dtype", "float32",
    "--max-total-tokens", str(MAX_TOTAL_TOKENS),
    "--chunked-prefill-size", str(CHUNKED_PREFILL),
    "--log-level", "info",
)  # fmt: skip

#: Inherited variables that would change which backend or plugins a server runs.
_SCRUBBED_PREFIXES = ("SGLANG_", "UCX_", "NIXL_")
_KEEP = ("SGLANG_NIXL_PLUGIN_TEST_TIMEOUT_SCALE",)


def cpu_bind(tp: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: this process's cores, split evenly."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        cores = (cores * tp)[:tp]  # share cores rather than fail on a tiny machine
    size = len(cores) // tp
    groups = [cores[i * size : (i + 1) * size] for i in range(tp)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def server_env(
    backend: str, tp: int, tmp: Path, extra_plugins: Sequence[str] = ()
) -> dict[str, str]:
    """Environment of one server process; ``backend`` is reference, plugin or in-tree.

    ``extra_plugins``: test-only SGLang plugins (keys of ``SHIM_PLUGINS``) loaded as well.
    """
    env = {
        k: v for k, v in os.environ.items() if k in _KEEP or not k.startswith(_SCRUBBED_PREFIXES)
    }
    if backend == "in-tree":
        plugins = [INTREE_DRAM_PLUGIN, *extra_plugins]
    elif backend == "plugin":
        # Our plugin through SGLang's normal discovery: no whitelist unless a shim joins it.
        plugins = ["sgl_nixl_plugin", *extra_plugins] if extra_plugins else []
    elif backend == "reference":
        plugins = ["__none__"]  # a whitelist that matches nothing: plain SGLang
    else:
        raise ValueError(backend)
    if plugins:
        env["SGLANG_PLUGINS"] = ",".join(plugins)
    if backend == "plugin":
        env["SGLANG_NIXL_PLUGIN_LOG_LEVEL"] = "DEBUG"  # one line per room, checked by the stage
    if backend == "in-tree":
        # SGLang's decode calls a prefill lost after 2 missed 3 s /health GETs, 5 s apart:
        # on CI's 2 cores the in-tree TP 2 control's own ranks (8 transfer threads each, and
        # UCX progress) once starved its prefill's bootstrap thread that long. The control
        # checks the stage, not SGLang's liveness: give it 10 misses.
        env["SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"] = "10"
    pythonpath = [str(SHIM_PLUGINS[p]) for p in plugins if p in SHIM_PLUGINS]
    pythonpath.append(str(SHIMS))
    if env.get("PYTHONPATH"):
        pythonpath.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(pythonpath),
        SGLANG_USE_CPU_ENGINE="1",
        SGLANG_HOST_IP="127.0.0.1",
        # Loopback only for the sockets SGLang does not place itself: gloo's (TP groups) and
        # UCX's (under NIXL), which otherwise listen on every interface's address.
        GLOO_SOCKET_IFNAME="lo",
        UCX_NET_DEVICES="lo",
        SGLANG_CPU_OMP_THREADS_BIND=cpu_bind(tp),
        SGLANG_NCCL_SO_PATH=str(tmp / "no-nccl-on-this-cpu-host" / "libnccl.so.2"),
        # The warm-up WRITE at registration is checked to happen: on CI's 2 cores, shared by
        # 4 TP ranks, a router and their threads, its default 1 s bound was once too short.
        SGLANG_NIXL_PLUGIN_WARMUP_TIMEOUT=str(WARMUP_TIMEOUT_S),
        # SGLang's CPU path compiles Inductor kernels (g++) inside the schedulers at new
        # batch shapes, mid-run: on CI's 2 cores that starved a prefill's control threads
        # for 5-10 s (its log: "away from its socket ... woke ...s late") and its decodes
        # called it lost. Every server of the stage (the reference too) runs eager instead.
        TORCH_COMPILE_DISABLE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(tmp / "hf-home"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
    )
    return env


def dp_args(dp: int) -> list[str]:
    """DP attention over ``dp`` ranks. SGLang divides ``--chunked-prefill-size`` by the
    attention DP size, so it is scaled up to keep every server's chunk (same numerics).
    Every decode step is logged: the stage checks that each DP rank ran decode batches, and
    SGLang's default logs one step in 40, which a rank that drew few requests may not reach."""
    if dp <= 1:
        return []
    return [
        "--enable-dp-attention", "--dp-size", str(dp),
        "--chunked-prefill-size", str(CHUNKED_PREFILL * dp),
        "--decode-log-interval", "1",
    ]  # fmt: skip


def server_argv(
    model: Path, port: int, tp: int, page: int, extra: Sequence[str], pp: int = 1
) -> list[str]:
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", str(tp),
        "--page-size", str(page),
        *CPU_FLAGS,
    ]  # fmt: skip
    if tp > 1:
        argv.append("--disable-custom-all-reduce")
    if pp > 1:
        argv += ["--pp-size", str(pp)]
    return argv + list(extra)


@dataclass
class Server:
    proc: ManagedProcess
    port: int
    ready_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class PDStack:
    backend: str
    tp: int
    page: int
    prefill: Server
    decode: Server
    router: Server
    bootstrap_port: int
    startup_s: float = 0.0
    procs: list[ManagedProcess] = field(default_factory=list)
    decode_page: int = 0  # the decode's page size (the prefill's ``page`` when equal)
    prefill_pp: int = 1  # pipeline stages of each server
    decode_pp: int = 1
    prefill_dp: int = 1  # attention DP ranks of each server (1: no DP attention)
    decode_dp: int = 1
    named: bool = False  # the decode names the prefill in SGLANG_NIXL_PLUGIN_PREFILLS

    def __post_init__(self) -> None:
        self.decode_page = self.decode_page or self.page

    @property
    def links_per_decode_rank(self) -> int:
        """Prefill ranks each decode rank links (and warms) at first contact: every stage
        of a PP 1 decode, every DP group, and every attention TP rank holding its heads."""
        attn_tp = max(1, (self.tp // self.prefill_dp) // (self.tp // self.decode_dp))
        return (self.prefill_pp // self.decode_pp) * self.prefill_dp * attn_tp

    @property
    def url(self) -> str:
        return self.router.url


class Launcher:
    """Starts servers into one :class:`ProcessGroup` (one per test module)."""

    def __init__(
        self,
        group: ProcessGroup,
        model: Path,
        tmp: Path,
        dp_model: Path | None = None,
        plugin_env: dict[str, str] | None = None,
    ) -> None:
        self.group = group
        self.model = model
        self.dp_model = dp_model or model  # a model SGLang runs under DP attention
        self.tmp = tmp
        self.plugin_env = plugin_env or {}  # more environment for our plugin's servers

    def _server(
        self,
        name: str,
        backend: str,
        tp: int,
        page: int,
        extra: Sequence[str] = (),
        plugins: Sequence[str] = (),
        pp: int = 1,
        model: Path | None = None,
        env_extra: dict[str, str] | None = None,
    ) -> Server:
        (port,) = free_ports(1)
        argv = server_argv(model or self.model, port, tp, page, extra, pp)
        env = {**server_env(backend, tp * pp, self.tmp, plugins), **(env_extra or {})}
        if backend == "plugin":
            env.update(self.plugin_env)
        return Server(self.group.start(name, argv, env, PROCESS_DEADLINE_S), port)

    def _await(self, servers: Sequence[Server], path: str, timeout_s: float) -> None:
        for s in servers:
            others = [o.proc for o in servers if o is not s]
            s.ready_s = wait_http_ok(s.url + path, s.proc, timeout_s, others)

    def reference(self, tp: int, page: int = 1, dp_model: bool = False) -> Server:
        model = self.dp_model if dp_model else self.model
        name = f"reference-tp{tp}" + ("-dp-model" if dp_model else "")
        server = self._server(name, "reference", tp, page, model=model)
        try:
            self._await([server], "/health", SERVER_READY_S)
        except BaseException:
            self.group.stop([server.proc])
            raise
        return server

    def pd(
        self,
        backend: str,
        tp: int,
        page: int,
        decode_plugins: Sequence[str] = (),
        extra: Sequence[str] = (),
        host_receive: bool = False,
        decode_page: int | None = None,
        prefill_pp: int = 1,
        decode_pp: int = 1,
        prefill_dp: int = 1,
        decode_dp: int = 1,
        named: bool = False,
    ) -> PDStack:
        """Prefill + decode (started together) and the router; ``decode_plugins``: extra
        test-only SGLang plugins for the decode server (the negative control); ``extra``:
        more server arguments for both; ``host_receive``: the decode receives every request
        into its host pool (threshold 0: SGLang's ``host_pool`` backup, on a CPU host with
        the ``host_pool_cpu`` shim) instead of its device pool; ``decode_page``: the
        decode's ``--page-size`` where it differs from the prefill's ``page``;
        ``prefill_pp``, ``decode_pp``: each server's ``--pp-size``; ``prefill_dp``,
        ``decode_dp``: each server's attention DP ranks (both servers then load the DP
        model, and the servers with DP attention the ``dp_cpu`` shim); ``named``: the decode
        names the prefill's bootstrap in ``SGLANG_NIXL_PLUGIN_PREFILLS``."""
        if host_receive:
            decode_plugins = [*decode_plugins, HOST_POOL_PLUGIN]
            decode_args = ["--disaggregation-decode-host-receive-threshold", "0"]
        else:
            decode_args = ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        dpage = decode_page or page
        tag = f"{backend}-tp{tp}-p{page}" + (f"-d{dpage}" if dpage != page else "")
        if prefill_pp > 1:
            tag += f"-pp{prefill_pp}to{decode_pp}"
        dp = max(prefill_dp, decode_dp) > 1
        if dp:
            tag += f"-dp{prefill_dp}to{decode_dp}"
        if named:
            tag += "-named"
        model = self.dp_model if dp else self.model
        prefill_plugins = [DP_CPU_PLUGIN] if prefill_dp > 1 else []
        if decode_dp > 1:
            decode_plugins = [*decode_plugins, DP_CPU_PLUGIN]
        tag += "".join(f"-{p}" for p in decode_plugins)
        started = time.monotonic()
        bootstrap, decode_bootstrap = free_ports(2)
        prefill = self._server(
            f"prefill-{tag}", backend, tp, page,
            ["--disaggregation-mode", "prefill",
             "--disaggregation-transfer-backend", "nixl",
             "--disaggregation-bootstrap-port", str(bootstrap), *dp_args(prefill_dp),
             *extra],
            plugins=prefill_plugins,
            pp=prefill_pp,
            model=model,
        )  # fmt: skip
        decode = self._server(
            f"decode-{tag}", backend, tp, dpage,
            ["--disaggregation-mode", "decode",
             "--disaggregation-transfer-backend", "nixl",
             "--disaggregation-bootstrap-port", str(decode_bootstrap),
             *decode_args, *dp_args(decode_dp), *extra],
            plugins=decode_plugins,
            pp=decode_pp,
            model=model,
            env_extra={"SGLANG_NIXL_PLUGIN_PREFILLS": f"127.0.0.1:{bootstrap}"} if named else None,
        )  # fmt: skip
        (router_port,) = free_ports(1)
        router_argv = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--pd-disaggregation", "--mini-lb",
            "--prefill", prefill.url, str(bootstrap),
            "--decode", decode.url,
            "--host", "127.0.0.1", "--port", str(router_port),
            "--request-timeout-secs", str(int(REQUEST_TIMEOUT_S)),
        ]  # fmt: skip
        # Started with the servers, not after them: an idle in-tree TP 2 pair keeps both cores
        # busy, and a router started then took over 60 s to answer (seen in CI).
        router_env = server_env("reference", 1, self.tmp)  # the router loads no SGLang plugin
        router = Server(
            self.group.start(f"router-{tag}", router_argv, router_env, PROCESS_DEADLINE_S),
            router_port,
        )
        procs = [prefill.proc, decode.proc, router.proc]
        try:
            self._await([prefill, decode], "/health", SERVER_READY_S)
            self._await([router], "/health", ROUTER_READY_S)
        except BaseException:
            # Stopped now, not at the module's teardown: a stack left running starved the
            # next test's servers of CPU (seen in CI).
            self.group.stop(procs)
            raise
        return PDStack(
            backend, tp, page, prefill, decode, router, bootstrap,
            startup_s=time.monotonic() - started, procs=procs, decode_page=dpage,
            prefill_pp=prefill_pp, decode_pp=decode_pp, prefill_dp=prefill_dp,
            decode_dp=decode_dp, named=named,
        )  # fmt: skip

    def stop(self, procs: Sequence[ManagedProcess]) -> None:
        self.group.stop(procs)


@contextmanager
def logs_on_failure(group: ProcessGroup) -> Iterator[None]:
    """Print the tail of every process's log when the block raises (pytest shows it)."""
    try:
        yield
    except BaseException:
        print(group.report(), flush=True)
        raise
