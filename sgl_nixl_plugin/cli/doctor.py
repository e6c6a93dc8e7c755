"""``sgl-nixl-plugin doctor``: can a prefill/decode KV transfer work on this machine?

Each check is a function ``check(ctx) -> list[CheckResult]`` in :data:`CHECKS`, run in order;
later checks read what earlier ones found from ``ctx.facts``. The checks live by concern in
``doctor_install``, ``doctor_nixl``, ``doctor_memory`` and ``doctor_exposure``, over the row
and verdict types of ``doctor_report``; this module orders them, runs them and prints. To add
a check, write such a function beside its kind and append it to :data:`CHECKS`. A ``fail``
result makes the exit code non-zero; ``warn`` and ``info`` are reported only.

Heavy imports (SGLang, torch, NIXL) happen inside the checks, never at module import.
"""

from __future__ import annotations

import json
import sys

from sgl_nixl_plugin import __version__
from sgl_nixl_plugin.cli.doctor_exposure import check_exposure
from sgl_nixl_plugin.cli.doctor_install import check_discovery, check_plugin, check_sglang
from sgl_nixl_plugin.cli.doctor_memory import check_cuda, check_memory_kinds, check_staging_memory
from sgl_nixl_plugin.cli.doctor_nixl import check_nixl
from sgl_nixl_plugin.cli.doctor_report import Check, CheckResult, DoctorContext, DoctorReport

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
