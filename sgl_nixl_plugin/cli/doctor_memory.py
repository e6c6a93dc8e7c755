"""The doctor's memory checks: whether a GPU is visible (and CUDA IPC for one-pass writes),
which memory kinds the configured backend can move, and how much the staging buffer takes on
each rank."""

from __future__ import annotations

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.cli.doctor_report import CheckResult, DoctorContext


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
    kind of the KV pool: none at start-up; the buffer is taken when a peer first needs the
    staged path (after SGLang sized its pools: it comes out of the headroom)."""
    cfg = settings.Settings.from_env()
    most = {kind: settings.staging_sizes(cfg, kind)[0] for kind in ("VRAM", "DRAM")}
    ctx.facts["staging_bytes"] = most  # the most one rank takes
    if not any(most.values()):
        return [CheckResult("staging memory", "ok", "none: staging is off on every rank")]
    detail = (
        f"0 MiB at start-up; up to {_gib(most['VRAM'])} of GPU memory on each rank with its "
        f"KV pool on a GPU, {_gib(most['DRAM'])} of host memory with a host KV pool, taken "
        "when a peer first needs the staged path (never on a rank whose peers all write in "
        "one pass or direct; each rank logs it when it happens). "
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES sets it; 0: none, scattered pages go direct"
    )
    return [CheckResult("staging memory", "ok", detail)]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
