"""The pluggy hooks third-party packages (and deployers) implement.

Implementations live in modules registered under the entry-point group
``sgl_nixl_plugin.backends``; decorate functions with :data:`hookimpl`.
"""

from __future__ import annotations

import pluggy

from sgl_nixl_plugin.registry.spec import AgentConfig, BackendSpec, ReceiveEvent, TransferEvent

PROJECT_NAME = "sgl_nixl_plugin"
ENTRY_POINT_GROUP = "sgl_nixl_plugin.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def sgl_nixl_register_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """Return the transfer backends this plugin provides.

    A name that is already an SGLang ``TransferBackend`` value (e.g. "nixl") takes over that
    name; any other name is added to SGLang's CLI choices and ``TransferBackend`` enum.
    """


@hookspec
def sgl_nixl_agent_config(config: AgentConfig) -> None:
    """Adjust ``config`` in place before the NIXL agent is created (backend, params, threads).

    Called in every process that creates an agent; keep it deterministic and cheap.
    """


@hookspec
def sgl_nixl_transfer_done(event: TransferEvent) -> None:
    """Observe one finished transfer. Runs on the transfer path: return quickly.

    Exceptions are logged and swallowed; they never affect the transfer.
    """


@hookspec
def sgl_nixl_receive_done(event: ReceiveEvent) -> None:
    """Observe one room a decode rank received (ok or not), once SGLang cleared it. Runs on
    SGLang's scheduler thread: return quickly.

    Exceptions are logged and swallowed; they never affect the transfer.
    """
