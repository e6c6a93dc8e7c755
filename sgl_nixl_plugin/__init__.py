"""sgl-nixl-plugin: a NIXL KV-cache transfer backend for SGLang PD disaggregation.

The public interface is :data:`__all__`: the version, the pluggy hook markers and the plain
types the hooks pass (also importable from ``sgl_nixl_plugin.registry``). Everything else in
this package is private and may change in any release.

Importing this package must stay cheap: SGLang imports our entry point in every process, so
nothing here may import torch, nixl, SGLang or pluggy; the names below load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.5.0"

__all__ = [
    "ENTRY_POINT_GROUP",
    "AgentConfig",
    "BackendSpec",
    "ReceiveEvent",
    "TransferEvent",
    "__version__",
    "hookimpl",
    "hookspec",
]

_LAZY = frozenset(__all__) - {"__version__"}

if TYPE_CHECKING:
    from sgl_nixl_plugin.registry import (
        ENTRY_POINT_GROUP,
        AgentConfig,
        BackendSpec,
        ReceiveEvent,
        TransferEvent,
        hookimpl,
        hookspec,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from sgl_nixl_plugin import registry

        value = getattr(registry, name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
