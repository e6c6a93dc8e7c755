"""What a doctor check returns and what the doctor concludes from them: rows, the context
checks share, and the verdict. Apart from ``doctor`` so the check modules can use these
types without importing the command that imports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from sgl_nixl_plugin import __version__

Status = Literal["ok", "warn", "fail", "info"]


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
