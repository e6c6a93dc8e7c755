"""Backend registry: pluggy hooks that let other packages add transfer backends, tune the
NIXL agent, and observe transfers (entry-point group ``sgl_nixl_plugin.backends``).

Third-party packages need only::

    from sgl_nixl_plugin.registry import BackendSpec, hookimpl
"""

from sgl_nixl_plugin.registry.hookspecs import ENTRY_POINT_GROUP, hookimpl, hookspec
from sgl_nixl_plugin.registry.spec import AgentConfig, BackendSpec, ReceiveEvent, TransferEvent

__all__ = [
    "ENTRY_POINT_GROUP",
    "AgentConfig",
    "BackendSpec",
    "ReceiveEvent",
    "TransferEvent",
    "hookimpl",
    "hookspec",
]
