"""Settings that change the SGLang process the plugin runs in, not only the plugin."""

from __future__ import annotations

import logging
import sys

from sgl_nixl_plugin.settings import Settings

logger = logging.getLogger(__name__)


def apply_process_knobs(settings: Settings) -> list[str]:
    """Apply ``LOG_LEVEL`` (our loggers only: SGLang's ``--log-level`` governs the rest)
    and ``SWITCH_INTERVAL_US`` (process-wide: the plugin's threads get the GIL from a
    scheduler running Python within one interval); returns what was changed, for the log."""
    changed = []
    if settings.log_level:
        logging.getLogger("sgl_nixl_plugin").setLevel(settings.log_level)
        changed.append(f"plugin log level {settings.log_level}")
    if settings.switch_interval_us > 0:
        sys.setswitchinterval(settings.switch_interval_us * 1e-6)
        changed.append(f"GIL switch interval {settings.switch_interval_us:g} us")
    if changed:
        logger.info("sgl-nixl: %s (SGLANG_NIXL_PLUGIN_ settings)", ", ".join(changed))
    return changed
