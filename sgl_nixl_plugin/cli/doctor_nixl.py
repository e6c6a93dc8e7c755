"""The doctor's NIXL check: a throwaway agent, probed in a thread with the native logs captured
(they must not corrupt ``--json`` output), says which transfer backends can be created here
and which memory types each moves."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from sgl_nixl_plugin.cli.doctor_report import CheckResult, DoctorContext

#: NIXL backends that move memory between hosts (the storage plugins are of no use for PD).
TRANSFER_BACKEND_CANDIDATES: tuple[str, ...] = ("UCX", "LIBFABRIC", "UCCL", "MOONCAKE", "GPUNETIO")
NIXL_PROBE_TIMEOUT_S = 60.0


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
