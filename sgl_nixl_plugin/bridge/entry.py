"""SGLang's ``sglang.srt.plugins`` entry point: ``register()``.

SGLang imports this module in every process it starts (launcher, schedulers, detokenizer,
DP controller), so the module itself imports nothing heavy; all work happens inside
``register()``, which SGLang's ``load_plugins()`` calls once per process before applying
the hooks we queue.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sgl_nixl_plugin.bridge")

#: None until register() ran; then "registered" or "disabled" (the reason is in the log).
_state: str | None = None


def register() -> None:
    """Gate on the SGLang version and signatures, then route our backends into SGLang.

    Idempotent. On an unsupported SGLang it logs one error and registers nothing (SGLang's
    in-tree backends keep working); with ``SGLANG_NIXL_PLUGIN_STRICT=1`` it raises SystemExit
    instead. SystemExit, not RuntimeError: ``load_plugins()`` catches and logs ``Exception``
    from plugins and would carry on without us.
    """
    global _state
    if _state is not None:
        return

    from sgl_nixl_plugin import __version__
    from sgl_nixl_plugin.adapter import hooks
    from sgl_nixl_plugin.bridge import version_gate

    gate = version_gate.evaluate()
    if not gate.ok:
        _state = "disabled"
        if version_gate.strict_mode():
            raise SystemExit(gate.message)
        logger.error("%s", gate.message)
        return

    from sgl_nixl_plugin.registry import manager

    try:
        specs = manager.backends()
        plan = hooks.build_plan(specs)
    except Exception as exc:
        _state = "disabled"
        message = (
            f"sgl-nixl-plugin {__version__} is NOT active; SGLang's in-tree transfer backends "
            f"stay in use. Reason: could not prepare registration: {type(exc).__name__}: {exc}"
        )
        if version_gate.strict_mode():
            raise SystemExit(message) from exc
        logger.error("%s", message, exc_info=logger.isEnabledFor(logging.DEBUG))
        return

    hooks.install(plan)
    _state = "registered"
    logger.info("sgl-nixl-plugin %s %s", __version__, hooks.summary())
