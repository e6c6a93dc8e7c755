"""``sgl-nixl-plugin doctor``: can a prefill/decode KV transfer work on this machine?

Each check is a function ``check(ctx) -> list[CheckResult]`` in :data:`CHECKS`, run in order;
later checks read what earlier ones found from ``ctx.facts``. To add a check (e.g. a
security warning), write such a function and append it to :data:`CHECKS`. A ``fail`` result
makes the exit code non-zero; ``warn`` and ``info`` are reported only.

Heavy imports (SGLang, torch, NIXL) happen inside the checks, never at module import.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import ipaddress
import json
import os
import socket
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from sgl_nixl_plugin import __version__, compat, settings

Status = Literal["ok", "warn", "fail", "info"]

#: The ``sglang.srt.plugins`` entry point SGLang must discover for the plugin to load.
SGLANG_PLUGIN_GROUP = "sglang.srt.plugins"
SGLANG_PLATFORM_GROUP = "sglang.srt.platforms"
OUR_ENTRY_POINT_VALUE = "sgl_nixl_plugin.bridge.entry:register"
#: NIXL backends that move memory between hosts (the storage plugins are of no use for PD).
TRANSFER_BACKEND_CANDIDATES: tuple[str, ...] = ("UCX", "LIBFABRIC", "UCCL", "MOONCAKE", "GPUNETIO")
NIXL_PROBE_TIMEOUT_S = 60.0


@dataclass
class CheckResult:
    """One row of the doctor's table."""

    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass
class DoctorContext:
    """Shared state of one doctor run; ``facts`` also goes into ``--json`` output."""

    facts: dict[str, Any] = field(default_factory=dict)


Check = Callable[[DoctorContext], list[CheckResult]]


# --------------------------------------------------------------------------- checks


def check_plugin(ctx: DoctorContext) -> list[CheckResult]:
    """Which plugin build is running, and the backends its registry provides."""
    from sgl_nixl_plugin.registry import manager

    ctx.facts["plugin_version"] = __version__
    results = [
        CheckResult(
            "sgl-nixl-plugin",
            "info",
            f"{__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})",
        )
    ]
    specs = manager.backends()
    ctx.facts["backends"] = {name: spec.classes_module for name, spec in specs.items()}
    if specs:
        detail = ", ".join(f"{name} -> {spec.classes_module}" for name, spec in specs.items())
        results.append(CheckResult("registered backends", "ok", detail))
    else:
        results.append(
            CheckResult(
                "registered backends",
                "fail",
                "no transfer backend registered",
                "reinstall: pip install --force-reinstall sgl-nixl-plugin",
            )
        )
    return results


def _fix_unless_said(problems: list[str]) -> str:
    return "" if any(compat.FIX_HINT in p for p in problems) else compat.FIX_HINT


def check_sglang(ctx: DoctorContext) -> list[CheckResult]:
    """SGLang installed, a supported release, and with the signatures its contract names."""
    found = compat.installed_sglang_version()
    overridden = bool(settings.sglang_version_override())
    ctx.facts["sglang_version"] = found
    ctx.facts["sglang_supported_range"] = compat.SUPPORTED_SGLANG
    ctx.facts["sglang_contract"] = compat.contract_for(found)
    label = f"{found}{' (override)' if overridden else ''}" if found else "not installed"
    problems = compat.check_version()
    if problems:
        ctx.facts["sglang_ok"] = False
        return [
            CheckResult("SGLang", "fail", f"{label}: {problems[0]}", _fix_unless_said(problems))
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang's CPU-only import warnings are noise here
        problems = compat.check_sglang()
    ctx.facts["sglang_ok"] = not problems
    contract = f"contract {ctx.facts['sglang_contract']}"
    if problems:
        return [
            CheckResult(
                "SGLang",
                "fail",
                f"{label}, {contract}, but: " + "; ".join(problems),
                _fix_unless_said(problems),
            )
        ]
    return [
        CheckResult(
            "SGLang",
            "ok",
            f"{label}, supported ({compat.SUPPORTED_SGLANG}), {contract}, signatures match",
        )
    ]


def _allowed_plugin_names() -> set[str] | None:
    """``SGLANG_PLUGINS`` as SGLang reads it: unset or empty = no restriction."""
    raw = os.environ.get("SGLANG_PLUGINS")
    if not raw:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def check_discovery(ctx: DoctorContext) -> list[CheckResult]:
    """Would SGLang's ``load_plugins()`` find and run our entry point in this environment?"""
    ours = [
        ep
        for ep in importlib.metadata.entry_points(group=SGLANG_PLUGIN_GROUP)
        if ep.value == OUR_ENTRY_POINT_VALUE
    ]
    ctx.facts["entry_points"] = [ep.name for ep in ours]
    if not ours:
        ctx.facts["discoverable"] = False
        return [
            CheckResult(
                "SGLang discovery",
                "fail",
                f"no {SGLANG_PLUGIN_GROUP!r} entry point -> {OUR_ENTRY_POINT_VALUE} is installed",
                "install the package (pip install sgl-nixl-plugin) into the same environment "
                "as SGLang",
            )
        ]
    results: list[CheckResult] = []
    allowed = _allowed_plugin_names()
    selected_platform = os.environ.get("SGLANG_PLATFORM", "")
    platform_dists = {
        ep.dist.name
        for ep in importlib.metadata.entry_points(group=SGLANG_PLATFORM_GROUP)
        if ep.dist and ep.name != selected_platform
    }
    usable = []
    for ep in ours:
        if allowed is not None and ep.name not in allowed:
            continue
        if selected_platform and ep.dist and ep.dist.name in platform_dists:
            continue
        usable.append(ep)
    ctx.facts["discoverable"] = bool(usable)
    if not usable:
        why = (
            f"SGLANG_PLUGINS={os.environ.get('SGLANG_PLUGINS', '')!r} excludes it"
            if allowed is not None
            else f"SGLANG_PLATFORM={selected_platform!r} excludes its distribution"
        )
        results.append(
            CheckResult(
                "SGLang discovery",
                "fail",
                f"entry point {ours[0].name!r} is installed but {why}",
                f"add {ours[0].name} to SGLANG_PLUGINS (comma-separated) or unset it",
            )
        )
        return results
    ep = usable[0]
    dist_version = ep.dist.version if ep.dist else None
    results.append(
        CheckResult(
            "SGLang discovery",
            "ok",
            f"entry point {ep.name!r} in {SGLANG_PLUGIN_GROUP!r}"
            + (" (SGLANG_PLUGINS allows it)" if allowed is not None else ""),
        )
    )
    if dist_version and dist_version != __version__:
        results.append(
            CheckResult(
                "install metadata",
                "warn",
                f"installed metadata says {dist_version} but the code is {__version__}",
                "reinstall the package",
            )
        )
    return results


@contextlib.contextmanager
def _captured_native_output() -> Iterator[io.StringIO]:
    """Send fds 1 and 2 to a buffer: NIXL's C++ logs must not corrupt ``--json`` output."""
    captured = io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            sink.seek(0)
            captured.write(sink.read().decode("utf-8", "replace"))


def _probe_nixl(backend: str, params: dict[str, str], num_threads: int) -> dict[str, Any]:
    """Create a throwaway agent and try each candidate backend; never raises."""
    result: dict[str, Any] = {"plugins": [], "backends": {}}
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(
            f"sgl-nixl-doctor-{os.getpid()}",
            nixl_agent_config(enable_prog_thread=False, backends=[], num_threads=num_threads),
        )
        plugins = list(agent.get_plugin_list())
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    result["plugins"] = plugins
    # The configured backend always; the other candidates only if this NIXL build has them.
    names = [backend] + [
        name for name in TRANSFER_BACKEND_CANDIDATES if name != backend and name in plugins
    ]
    for name in names:
        entry: dict[str, Any] = {"configured": name == backend}
        if name not in plugins:
            entry.update(ok=False, error="plugin not present in this NIXL build")
            result["backends"][name] = entry
            continue
        try:
            agent.create_backend(name, params if name == backend else {})
            entry["ok"] = True
            try:
                entry["mem_types"] = list(agent.get_backend_mem_types(name))
            except Exception as exc:
                entry["mem_types"] = []
                entry["mem_types_error"] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        result["backends"][name] = entry
    return result


def check_nixl(ctx: DoctorContext) -> list[CheckResult]:
    """NIXL installed, and which transfer backends it can actually create here."""
    from sgl_nixl_plugin.registry import manager

    try:
        ctx.facts["nixl_version"] = importlib.metadata.version("nixl")
    except importlib.metadata.PackageNotFoundError:
        ctx.facts["nixl_version"] = None
        return [CheckResult("NIXL", "fail", "not installed", "pip install 'nixl>=1.5'")]
    try:
        config = manager.resolve_agent_config()
    except ValueError as exc:
        return [
            CheckResult("NIXL agent config", "fail", str(exc), f"fix {manager.BACKEND_PARAMS_ENV}")
        ]
    ctx.facts["agent_config"] = asdict(config)

    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome.update(_probe_nixl(config.backend, config.backend_params, config.num_threads))

    with _captured_native_output() as native:
        worker = threading.Thread(target=run, name="sgl-nixl-doctor-probe", daemon=True)
        worker.start()
        worker.join(NIXL_PROBE_TIMEOUT_S)
    if worker.is_alive():
        outcome = {"error": f"probe did not finish within {NIXL_PROBE_TIMEOUT_S:.0f} s"}
    ctx.facts["nixl_probe"] = outcome
    ctx.facts["nixl_native_log_tail"] = native.getvalue()[-2000:]

    version = ctx.facts["nixl_version"]
    if "error" in outcome:
        return [
            CheckResult(
                "NIXL",
                "fail",
                f"{version}: cannot create an agent: {outcome['error']}",
                "reinstall nixl for this platform (pip install --force-reinstall nixl)",
            )
        ]
    results = [
        CheckResult("NIXL", "ok", f"{version}; plugins: {', '.join(outcome['plugins']) or '-'}")
    ]
    for name, entry in outcome["backends"].items():
        tag = " (configured)" if entry["configured"] else ""
        if entry["ok"]:
            kinds = ", ".join(entry.get("mem_types", [])) or "none reported"
            results.append(
                CheckResult(f"NIXL backend {name}", "ok", f"created{tag}; memory types: {kinds}")
            )
        elif entry["configured"]:
            results.append(
                CheckResult(
                    f"NIXL backend {name}",
                    "fail",
                    f"cannot be created{tag}: {entry['error']}",
                    f"set {manager.BACKEND_ENV} to a backend marked ok (UCX is the default), "
                    f"or fix its parameters ({manager.BACKEND_PARAMS_ENV})",
                )
            )
        else:
            results.append(
                CheckResult(f"NIXL backend {name}", "info", f"not usable: {entry['error']}")
            )
    return results


def check_cuda(ctx: DoctorContext) -> list[CheckResult]:
    """Whether torch sees a GPU (KV in VRAM needs one; host-memory KV does not)."""
    try:
        import torch

        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
    except Exception as exc:
        ctx.facts["cuda"] = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
        return [CheckResult("CUDA", "warn", f"cannot query torch: {type(exc).__name__}: {exc}")]
    ctx.facts["cuda"] = {"available": available, "device_count": count}
    if not available:
        return [CheckResult("CUDA", "info", "not visible (torch.cuda.is_available() is False)")]
    out = [CheckResult("CUDA", "ok", f"visible, {count} device(s)")]
    from sgl_nixl_plugin.engine import cuda_ipc

    ipc = cuda_ipc.available()
    ctx.facts["cuda"]["one_pass"] = ipc
    if ipc:
        out.append(CheckResult("one-pass (CUDA IPC)", "ok", "cuda.bindings imports"))
    else:
        out.append(
            CheckResult(
                "one-pass (CUDA IPC)",
                "info",
                "cuda.bindings does not import: prefill and decode sharing a GPU (or NVLink "
                "peers) use the staged path instead of one-pass writes",
                fix="pip install cuda-bindings (cuda-python), the build for your CUDA major",
            )
        )
    return out


def check_memory_kinds(ctx: DoctorContext) -> list[CheckResult]:
    """Which memory kinds the configured backend can move here: DRAM and/or VRAM."""
    probe = ctx.facts.get("nixl_probe") or {}
    config = ctx.facts.get("agent_config") or {}
    entry = (probe.get("backends") or {}).get(config.get("backend", ""), {})
    mem_types = set(entry.get("mem_types", [])) if entry.get("ok") else set()
    cuda = bool((ctx.facts.get("cuda") or {}).get("available"))
    usable = []
    if "DRAM_SEG" in mem_types:
        usable.append("DRAM")
    if cuda and "VRAM_SEG" in mem_types:
        usable.append("VRAM")
    ctx.facts["memory_kinds"] = usable
    if not usable:
        return [
            CheckResult(
                "memory kinds",
                "fail",
                "none usable: the configured NIXL backend is not available",
                "see the NIXL backend rows above",
            )
        ]
    parts = [f"{kind} usable" for kind in usable]
    if "VRAM" not in usable:
        parts.append(
            "VRAM not usable ("
            + ("CUDA not visible" if not cuda else "backend does not report VRAM")
            + ")"
        )
    return [CheckResult("memory kinds", "ok", "; ".join(parts))]


def check_staging_memory(ctx: DoctorContext) -> list[CheckResult]:
    """How much memory the plugin holds on each rank for its staging buffer, per memory
    kind of the KV pool (SGLang sized its pools before: it comes out of the headroom)."""
    cfg = settings.Settings.from_env()
    held = {kind: settings.staging_sizes(cfg, kind)[0] for kind in ("VRAM", "DRAM")}
    ctx.facts["staging_bytes"] = held
    if not any(held.values()):
        return [CheckResult("staging memory", "ok", "none: staging is off on every rank")]
    detail = (
        f"{_gib(held['VRAM'])} of GPU memory on each rank with its KV pool on a GPU, "
        f"{_gib(held['DRAM'])} of host memory with a host KV pool; taken at start-up on "
        "every prefill and decode rank, after SGLang sized its KV pool "
        "(SGLANG_NIXL_PLUGIN_STAGING_BYTES sets it; 0: none, scattered pages go direct)"
    )
    return [CheckResult("staging memory", "ok", detail)]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


#: Environment variables that carry the shared secret (see ``settings.read_secret``).
SECRET_ENV = "SGLANG_NIXL_PLUGIN_SECRET"
SECRET_FILE_ENV = "SGLANG_NIXL_PLUGIN_SECRET_FILE"
#: Where SGLang takes the address its KV control sockets bind to (``get_local_ip_auto``).
HOST_IP_ENVS = ("SGLANG_HOST_IP", "HOST_IP")
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _socket_local_ip() -> str | None:
    """The address outbound traffic would leave from (a UDP connect sends nothing)."""
    for family, target in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 80))
                return str(s.getsockname()[0])
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def listen_host() -> tuple[str | None, str]:
    """The host SGLang's KV managers bind their ZMQ sockets to, and where it comes from."""
    for name in HOST_IP_ENVS:
        value = os.environ.get(name, "")
        if value:
            return value, f"from {name}"
    try:
        from sgl_nixl_plugin.adapter.harness import local_ip_finder

        get_local_ip_auto = local_ip_finder()
    except Exception:
        return _socket_local_ip(), "auto-detected from this machine's sockets"
    try:
        return get_local_ip_auto(), "auto-detected by SGLang's get_local_ip_auto"
    except Exception:
        return None, "SGLang could not detect a local IP"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only to them."""
    name = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(name.split("%")[0]).is_loopback
    except ValueError:
        pass
    if name.lower() in _LOOPBACK_NAMES:
        return True
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_exposure(ctx: DoctorContext) -> list[CheckResult]:
    """Warn when the bootstrap server and control sockets would be reachable beyond
    loopback without a shared secret (anyone who reaches them could register ranks,
    learn rank addresses and inject control messages)."""
    from sgl_nixl_plugin.settings import read_secret

    host, source = listen_host()
    exposed = host is None or not is_loopback(host)
    secret_vars = settings.secret_vars_set()
    problem = ""
    try:
        has_secret = read_secret() is not None
    except ValueError as exc:
        has_secret, problem = False, str(exc)
    ctx.facts["listen_host"] = host
    ctx.facts["listen_host_source"] = source
    ctx.facts["listen_exposed"] = exposed
    ctx.facts["shared_secret"] = has_secret
    where = f"{host} ({source})" if host else f"an unknown address ({source})"
    name = "network exposure"
    if has_secret:
        return [
            CheckResult(
                name,
                "ok",
                f"bootstrap server and ZMQ control sockets listen on {where}; "
                f"HTTP routes and control messages are signed ({' / '.join(secret_vars)} is set)",
            )
        ]
    if not exposed:
        return [
            CheckResult(
                name,
                "ok",
                f"bootstrap server and ZMQ control sockets listen on loopback {where} only",
            )
        ]
    why = f" ({problem})" if problem else ""
    return [
        CheckResult(
            name,
            "warn",
            f"the bootstrap server and ZMQ control sockets would listen on {where}, beyond "
            f"loopback, without a shared secret{why}: anyone who can reach this host could "
            "register prefill ranks, learn rank addresses and inject KV control messages",
            f"set {SECRET_ENV}=<secret> (or {SECRET_FILE_ENV}=<path of a file holding it>) "
            "to the same value on every prefill and decode node; or, if prefill and decode "
            "share this host, SGLANG_HOST_IP=127.0.0.1",
        )
    ]


#: The checks ``doctor`` runs, in order. Append to add one (see the module docstring).
CHECKS: list[Check] = [
    check_plugin,
    check_sglang,
    check_discovery,
    check_nixl,
    check_cuda,
    check_memory_kinds,
    check_staging_memory,
    check_exposure,
]


# --------------------------------------------------------------------------- running


@dataclass
class DoctorReport:
    """All rows plus the verdict; ``ok`` means a PD transfer could work here."""

    results: list[CheckResult]
    facts: dict[str, Any]

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        if self.ok:
            return "OK: a prefill/decode KV transfer can work on this machine."
        reasons = "; ".join(f"{r.name}: {r.detail.rstrip('.')}" for r in self.failures)
        fixes = " ".join(dict.fromkeys(r.fix for r in self.failures if r.fix))
        return f"NOT OK: a PD transfer cannot work here because {reasons}." + (
            f" What to do: {fixes}" if fixes else ""
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "plugin_version": __version__,
            "checks": [asdict(r) for r in self.results],
            "facts": self.facts,
        }


def run_checks(checks: list[Check] | None = None) -> DoctorReport:
    """Run ``checks`` (default :data:`CHECKS`); a crashing check becomes a ``warn`` row."""
    ctx = DoctorContext()
    results: list[CheckResult] = []
    for check in CHECKS if checks is None else checks:
        try:
            results.extend(check(ctx))
        except Exception as exc:
            results.append(
                CheckResult(check.__name__, "warn", f"check crashed: {type(exc).__name__}: {exc}")
            )
    return DoctorReport(results=results, facts=ctx.facts)


def render_plain(report: DoctorReport) -> str:
    """Aligned plain-text table (used when ``rich`` is not installed)."""
    rows = [("CHECK", "STATUS", "DETAIL")] + [
        (r.name, r.status, r.detail + (f"  -> fix: {r.fix}" if r.fix else ""))
        for r in report.results
    ]
    width0 = max(len(row[0]) for row in rows)
    width1 = max(len(row[1]) for row in rows)
    lines = [f"{a:<{width0}}  {b:<{width1}}  {c}" for a, b, c in rows]
    return "\n".join(lines + ["", report.verdict])


def _render_rich(report: DoctorReport) -> bool:
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return False
    styles = {"ok": "green", "warn": "yellow", "fail": "bold red", "info": "cyan"}
    table = Table(title=f"sgl-nixl-plugin {__version__} doctor")
    table.add_column("Check", no_wrap=True)
    table.add_column("Status", no_wrap=True)
    table.add_column("Detail")
    for r in report.results:
        detail = r.detail + (f"\n-> fix: {r.fix}" if r.fix else "")
        table.add_row(Text(r.name), Text(r.status, style=styles[r.status]), Text(detail))
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print(Text(report.verdict, style="green" if report.ok else "bold red"))
    return True


def main(as_json: bool = False, checks: list[Check] | None = None) -> int:
    """Run the doctor and print the table (or JSON); 0 when a PD transfer could work."""
    report = run_checks(checks)
    if as_json:
        print(json.dumps(report.to_json(), indent=2, default=str))
    elif not _render_rich(report):
        print(render_plain(report))
    return 0 if report.ok else 1
