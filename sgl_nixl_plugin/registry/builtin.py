"""Our own backend, registered through the ``sgl_nixl_plugin.backends`` entry point.

It takes over SGLang's built-in name "nixl", so every SGLang feature gate that tests for
"nixl" (staging, decode DCP, memory kinds) keeps applying to it.
"""

from __future__ import annotations

from sgl_nixl_plugin.registry.hookspecs import hookimpl
from sgl_nixl_plugin.registry.spec import BackendSpec

NIXL_BACKEND = BackendSpec(
    name="nixl",
    classes_module="sgl_nixl_plugin.adapter.classes",
    manager="NixlPluginKVManager",
    sender="NixlPluginKVSender",
    receiver="NixlPluginKVReceiver",
    bootstrap_server="NixlPluginKVBootstrapServer",
)


@hookimpl
def sgl_nixl_register_backends() -> list[BackendSpec]:
    """Provide the "nixl" backend."""
    return [NIXL_BACKEND]
