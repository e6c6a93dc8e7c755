"""The doctor's install checks: which plugin build runs, whether the installed SGLang is one
it supports, and whether SGLang's plugin loader would find and run its entry point."""

from __future__ import annotations

import importlib.metadata
import os
import warnings

from sgl_nixl_plugin import __version__, settings
from sgl_nixl_plugin.adapter import release_gate as compat
from sgl_nixl_plugin.cli.doctor_report import CheckResult, DoctorContext

#: The ``sglang.srt.plugins`` entry point SGLang must discover for the plugin to load.
SGLANG_PLUGIN_GROUP = "sglang.srt.plugins"
SGLANG_PLATFORM_GROUP = "sglang.srt.platforms"
OUR_ENTRY_POINT_VALUE = "sgl_nixl_plugin.bridge.entry:register"


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
