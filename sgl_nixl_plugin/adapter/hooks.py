"""Route SGLang's ``get_kv_class`` to our backends through SGLang's own HookRegistry.

Two cases per backend name:

* an existing ``TransferBackend`` value (our "nixl"): only ``get_kv_class`` is wrapped, so
  SGLang's enum, CLI choices and every ``== TransferBackend.NIXL`` feature gate stay intact;
* a new name: it is appended to SGLang's CLI choices and ``TransferBackend`` is REPLACEd by
  an Enum with the old members plus the new ones (SGLang rebinds every imported copy).

:func:`build_plan` does every import and computation that can fail; :func:`install` then
only registers, so a failure can never leave SGLang half-patched.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sgl_nixl_plugin.adapter import release_gate
from sgl_nixl_plugin.registry.spec import BackendSpec

logger = logging.getLogger(__name__)

UTILS = "sglang.srt.disaggregation.utils"
GET_KV_CLASS_TARGET = f"{UTILS}.get_kv_class"
TRANSFER_BACKEND_TARGET = f"{UTILS}.TransferBackend"

#: What :func:`install` registered, for the start-up line (see :func:`announce`).
_summary = ""
_announced = False


@dataclass(frozen=True)
class RegistrationPlan:
    """Everything :func:`install` needs, computed up front."""

    backends: Mapping[str, BackendSpec]
    new_names: tuple[str, ...]
    transfer_backend_enum: type[enum.Enum] | None
    kvargs_class: type
    hook: Callable[..., Any]


def _pending_transfer_backend(current: type[enum.Enum]) -> type[enum.Enum]:
    """The enum SGLang will end up with once already-registered REPLACE hooks apply.

    Another plugin may have queued its own extended ``TransferBackend``; building on top of
    it keeps its members instead of silently dropping them (the last REPLACE wins).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:  # private registry state: a nicety, so any surprise falls back to the live enum
        queued = list(getattr(HookRegistry, "_hooks", {}).get(TRANSFER_BACKEND_TARGET, []))
        pending = [
            hook
            for hook_type, hook, *_ in queued
            if hook_type == HookType.REPLACE
            and isinstance(hook, type)
            and issubclass(hook, enum.Enum)
        ]
    except Exception:
        return current
    return pending[-1] if pending else current


def extend_transfer_backend(base: type[enum.Enum], names: tuple[str, ...]) -> type[enum.Enum]:
    """A new ``TransferBackend`` Enum: ``base``'s members, then one per new name."""
    members: dict[str, Any] = {member.name: member.value for member in base}
    for name in names:
        members[name.upper()] = name
    return enum.Enum(  # type: ignore[return-value]
        base.__name__, members, module=base.__module__, qualname=base.__qualname__
    )


def make_get_kv_class_hook(
    backends: Mapping[str, BackendSpec],
    kvargs_class: type,
    transfer_backend_enum: Callable[[], type[enum.Enum]] | None = None,
) -> Callable[..., Any]:
    """The AROUND hook: ``hook(original, transfer_backend, class_type)``.

    SGLang calls AROUND hooks as ``hook(original_fn, *args, **kwargs)`` with the caller's
    own arguments, so both are accepted positionally or by keyword.
    """
    routed = dict(backends)

    def sgl_nixl_get_kv_class(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        transfer_backend = args[0] if args else kwargs.get("transfer_backend")
        class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
        value = getattr(transfer_backend, "value", transfer_backend)
        spec = routed.get(value) if isinstance(value, str) else None
        if spec is None:
            if transfer_backend_enum is not None and isinstance(transfer_backend, enum.Enum):
                # A member of the enum we replaced (captured before the swap) would compare
                # unequal to every current member inside SGLang; hand over the current one.
                current = transfer_backend_enum()
                if type(transfer_backend) is not current:
                    rest = args[1:] if args else ()
                    if args:
                        return original(current(value), *rest, **kwargs)
                    return original(**{**kwargs, "transfer_backend": current(value)})
            return original(*args, **kwargs)
        kind = getattr(class_type, "value", class_type)
        if kind == "kvargs":
            return kvargs_class
        try:
            spec.class_name(kind)
        except ValueError:
            return None  # same as SGLang's own mapping for a class a backend lacks
        return spec.load(kind)

    return sgl_nixl_get_kv_class


def build_plan(backends: Mapping[str, BackendSpec]) -> RegistrationPlan:
    """Import SGLang's pieces and compute what to register; registers nothing."""
    import importlib

    from sglang.srt.disaggregation.base import KVArgs

    utils = importlib.import_module(UTILS)
    current: type[enum.Enum] = utils.TransferBackend
    builtin_values = {member.value for member in current}
    new_names = tuple(name for name in sorted(backends) if name not in builtin_values)

    extended: type[enum.Enum] | None = None
    enum_getter: Callable[[], type[enum.Enum]] | None = None
    if new_names:
        base = _pending_transfer_backend(current)
        missing = tuple(name for name in new_names if name not in {m.value for m in base})
        extended = extend_transfer_backend(base, missing) if missing else None
        # Read at call time: after apply_hooks() the module holds the replacement.
        enum_getter = functools.partial(getattr, utils, "TransferBackend")

    hook = make_get_kv_class_hook(backends, KVArgs, enum_getter)
    return RegistrationPlan(
        backends=dict(backends),
        new_names=new_names,
        transfer_backend_enum=extended,
        kvargs_class=KVArgs,
        hook=hook,
    )


def install(plan: RegistrationPlan) -> None:
    """Register the plan with SGLang (applied by ``load_plugins()`` right after us)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )

    choices = [name for name in plan.new_names if name not in DISAGG_TRANSFER_BACKEND_CHOICES]
    if choices:
        add_disagg_transfer_backend_choices(choices)  # a list: ``extend`` splits a str
    if plan.transfer_backend_enum is not None:
        HookRegistry.register(TRANSFER_BACKEND_TARGET, plan.transfer_backend_enum, HookType.REPLACE)
    HookRegistry.register(GET_KV_CLASS_TARGET, plan.hook, HookType.AROUND)
    global _summary
    _summary = "registered transfer backend(s): {}{} (SGLang {})".format(
        ", ".join(
            f"{name} -> {spec.classes_module}" for name, spec in sorted(plan.backends.items())
        )
        or "(none)",
        f" (new CLI choices: {', '.join(plan.new_names)})" if plan.new_names else "",
        release_gate.installed_sglang_version() or "unknown",
    )


def summary() -> str:
    """What :func:`install` registered in this process, in words ("" before it ran)."""
    return _summary


def announce() -> None:
    """Log the start-up line once per process, from the first manager SGLang builds.

    The bridge's ``register()`` runs before SGLang configures logging, so its INFO line
    never reaches a server's log; by the time a manager exists, logging is set up.
    """
    global _announced
    if _announced:
        return
    _announced = True
    from sgl_nixl_plugin import __version__

    logger.info("sgl-nixl-plugin %s serving: %s", __version__, _summary or "loaded directly")
