"""Our environment variables: ``SGLANG_NIXL_PLUGIN_<NAME>``, or ``SGL_NIXL_PLUGIN_<NAME>``.

SGLang (0.5.23) treats every ``SGL_*`` variable as a legacy spelling: it copies it to
``SGLANG_*`` and warns "please use SGLANG_...". A deployer who follows that advice must not
lose the setting (for the shared secret, that would silently turn authentication off), so
both spellings are read, the ``SGLANG_`` one first. ``SGL_`` was the only one up to 0.2.0.
"""

from __future__ import annotations

import os

PREFIX = "SGLANG_NIXL_PLUGIN_"
LEGACY_PREFIX = "SGL_NIXL_PLUGIN_"


def lookup(name: str) -> tuple[str, str]:
    """(the variable that is set, its value) for setting ``name``; the new spelling and ""
    when neither is set."""
    for prefix in (PREFIX, LEGACY_PREFIX):
        value = os.environ.get(prefix + name, "")
        if value:
            return prefix + name, value
    return PREFIX + name, ""


def get(name: str, default: str = "") -> str:
    """The value of setting ``name`` (either spelling), or ``default``."""
    return lookup(name)[1] or default
