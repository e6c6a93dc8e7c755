"""Decide, before touching SGLang, whether this plugin may register at all.

An unsupported SGLang (or one whose interfaces moved) must not get half-working classes:
the bridge then leaves SGLang's in-tree backends alone and logs why, or, in strict mode,
stops the process so a misconfigured deployment fails at start-up rather than per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_nixl_plugin import __version__, settings
from sgl_nixl_plugin.adapter import release_gate

#: Set to 1/true/yes/on to make an unsupported SGLang a start-up failure instead of a warning.
STRICT_ENV = "SGLANG_NIXL_PLUGIN_STRICT"  # read by ``settings.strict_mode``


def strict_mode() -> bool:
    """Whether ``SGLANG_NIXL_PLUGIN_STRICT`` asks for a hard failure."""
    return settings.strict_mode()


@dataclass(frozen=True)
class GateResult:
    """The gate's verdict: no problems means the plugin may register."""

    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def message(self) -> str:
        """One self-contained line for the log (or the SystemExit text in strict mode)."""
        if self.ok:
            return ""
        reason = " | ".join(self.problems)
        if strict_mode():
            return (
                f"sgl-nixl-plugin {__version__} refuses to start ({STRICT_ENV} is set). "
                f"Reason: {reason}"
            )
        return (
            f"sgl-nixl-plugin {__version__} is NOT active; SGLang's in-tree transfer backends "
            f"stay in use. Reason: {reason} (set {STRICT_ENV}=1 to make this a start-up failure)"
        )


def evaluate() -> GateResult:
    """Check the installed SGLang's version and the signatures we rely on."""
    return GateResult(problems=tuple(release_gate.check_sglang()))
