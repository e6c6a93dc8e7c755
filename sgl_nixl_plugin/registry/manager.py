"""The plugin manager: loads ``sgl_nixl_plugin.backends`` entry points and calls the hooks.

Everything here runs inside SGLang's processes, often at start-up, so a broken third-party
plugin must never take the server down: each failure is logged once, the offending plugin
(or hook implementation) is skipped, and the rest carry on.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import pluggy

from sgl_nixl_plugin.registry import builtin, hookspecs
from sgl_nixl_plugin.registry.spec import AgentConfig, BackendSpec, ReceiveEvent, TransferEvent

logger = logging.getLogger(__name__)

#: Same variables SGLang's in-tree NIXL backend reads, so existing deployments carry over.
BACKEND_ENV = "SGLANG_DISAGGREGATION_NIXL_BACKEND"
BACKEND_PARAMS_ENV = "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"
_BUILTIN_PLUGIN_NAME = "nixl"

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_backends: dict[str, BackendSpec] | None = None
_observer_failures: dict[str, int] = {}


def _log_failure(message: str, *args: object) -> None:
    """One error record per failure; the traceback only when debugging is on."""
    logger.error(message, *args, exc_info=logger.isEnabledFor(logging.DEBUG))


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    # Sorted so that load order, and therefore conflict resolution, is the same everywhere.
    return sorted(eps, key=lambda ep: (ep.name, ep.value))


def _build_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for ep in _entry_points():
        if pm.has_plugin(ep.name):
            if ep.value != builtin.__name__:
                logger.error(
                    "sgl-nixl-plugin: skipping plugin entry point %r (%s): the name is already "
                    "taken by another plugin",
                    ep.name,
                    ep.value,
                )
            continue
        try:
            pm.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP, name=ep.name)
        except Exception as exc:
            _log_failure(
                "sgl-nixl-plugin: skipping broken plugin %r (%s): %s: %s",
                ep.name,
                ep.value,
                type(exc).__name__,
                exc,
            )
    # Running from a source tree without installed metadata: still provide our own backend.
    if not pm.is_registered(builtin):
        name = _BUILTIN_PLUGIN_NAME
        if pm.has_plugin(name):
            name = builtin.__name__
        pm.register(builtin, name=name)
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built (and entry points loaded) on first use."""
    global _pm
    with _lock:
        if _pm is None:
            _pm = _build_plugin_manager()
        return _pm


def reset_for_tests() -> None:
    """Forget the cached plugin manager and backends so the next call rescans entry points."""
    global _pm, _backends
    with _lock:
        _pm = None
        _backends = None
        _observer_failures.clear()


def _implementations(hook_name: str) -> Iterator[Any]:
    """Plain hook implementations in pluggy's call order (tryfirst / last-registered first).

    We call them one by one instead of through ``pm.hook`` so that one failing
    implementation is reported and skipped without hiding the others' results.
    """
    caller = getattr(get_plugin_manager().hook, hook_name)
    for impl in reversed(caller.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            logger.warning(
                "sgl-nixl-plugin: hook wrappers are not supported for %s; ignoring %r",
                hook_name,
                impl.plugin_name,
            )
            continue
        yield impl


def _call(impl: Any, **kwargs: Any) -> Any:
    return impl.function(*[kwargs[name] for name in impl.argnames])


def _collect_backends() -> dict[str, BackendSpec]:
    pm = get_plugin_manager()
    found: dict[str, tuple[BackendSpec, str]] = {}
    for impl in _implementations("sgl_nixl_register_backends"):
        try:
            result = _call(impl)
            specs = list(result or [])
        except Exception as exc:
            _log_failure(
                "sgl-nixl-plugin: plugin %r failed to register backends: %s: %s",
                impl.plugin_name,
                type(exc).__name__,
                exc,
            )
            continue
        for spec in specs:
            if not isinstance(spec, BackendSpec):
                logger.error(
                    "sgl-nixl-plugin: plugin %r returned %r, not a BackendSpec; ignored",
                    impl.plugin_name,
                    spec,
                )
                continue
            previous = found.get(spec.name)
            if previous is None:
                found[spec.name] = (spec, impl.plugin_name)
                continue
            # Our own backend keeps its name; otherwise the first plugin (by name) wins.
            ours = pm.get_plugin(impl.plugin_name) is builtin
            keep_new = ours or (
                pm.get_plugin(previous[1]) is not builtin and impl.plugin_name < previous[1]
            )
            winner, loser = (
                (impl.plugin_name, previous[1]) if keep_new else (previous[1], impl.plugin_name)
            )
            logger.error(
                "sgl-nixl-plugin: backend %r is registered by plugins %r and %r; using %r",
                spec.name,
                winner,
                loser,
                winner,
            )
            if keep_new:
                found[spec.name] = (spec, impl.plugin_name)
    return {name: spec for name, (spec, _plugin) in sorted(found.items())}


def backends() -> dict[str, BackendSpec]:
    """All registered transfer backends by name (computed once per process)."""
    global _backends
    with _lock:
        if _backends is None:
            _backends = _collect_backends()
        return dict(_backends)


def default_agent_config() -> AgentConfig:
    """The agent configuration before hooks: defaults, then SGLang's NIXL env variables.

    Raises ValueError when ``SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS`` is not a JSON object,
    so a typo fails loudly at agent creation instead of silently using defaults.
    """
    config = AgentConfig()
    backend = os.environ.get(BACKEND_ENV, "").strip()
    if backend:
        config.backend = backend
    raw = os.environ.get(BACKEND_PARAMS_ENV, "").strip()
    if raw:
        try:
            params = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{BACKEND_PARAMS_ENV} is not valid JSON: {exc}") from exc
        if not isinstance(params, dict):
            raise ValueError(f"{BACKEND_PARAMS_ENV} must be a JSON object, got {raw!r}")
        config.backend_params = {str(k): str(v) for k, v in params.items()}
    return config


def apply_agent_config(config: AgentConfig) -> AgentConfig:
    """Let every ``sgl_nixl_agent_config`` hook edit ``config`` in place; returns it."""
    for impl in _implementations("sgl_nixl_agent_config"):
        try:
            _call(impl, config=config)
        except Exception as exc:
            _log_failure(
                "sgl-nixl-plugin: agent-config hook of plugin %r failed (ignored): %s: %s",
                impl.plugin_name,
                type(exc).__name__,
                exc,
            )
    return config


def resolve_agent_config() -> AgentConfig:
    """What the engine should create its agent with: env defaults, then the hooks."""
    return apply_agent_config(default_agent_config())


def notify_transfer(event: TransferEvent) -> None:
    """Tell every observer about ``event``. Never raises: observers cannot break transfers."""
    _notify("sgl_nixl_transfer_done", event)


def notify_receive(event: ReceiveEvent) -> None:
    """Tell every decode-side observer about ``event``; never raises."""
    _notify("sgl_nixl_receive_done", event)


def _notify(hook_name: str, event: TransferEvent | ReceiveEvent) -> None:
    try:
        impls = list(_implementations(hook_name))
    except Exception as exc:
        _log_failure("sgl-nixl-plugin: cannot list transfer observers: %s", exc)
        return
    for impl in impls:
        try:
            _call(impl, event=event)
        except Exception as exc:
            # Observers run per transfer: report the first failure loudly, then quietly.
            count = _observer_failures.get(impl.plugin_name, 0) + 1
            _observer_failures[impl.plugin_name] = count
            log = _log_failure if count == 1 else logger.debug
            log(
                "sgl-nixl-plugin: transfer observer of plugin %r failed (ignored; failure %d, "
                "later ones are logged at DEBUG): %s: %s",
                impl.plugin_name,
                count,
                type(exc).__name__,
                exc,
            )
