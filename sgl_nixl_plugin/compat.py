"""Which SGLang releases this plugin supports, and the SGLang interfaces it relies on.

This is the single place that names the supported SGLang range. SGLang's disaggregation
classes change between releases (constructor and ``send`` parameters moved in 0.5.20-0.5.22),
so the plugin pins a range *and* checks, at start-up, that every signature it calls into
still looks the way it did in the release we tested. Both checks return plain problem
strings so the bridge, the CLI and the tests can all report them the same way.

Importing this module is cheap: the interfaces themselves are checked by
``sgl_nixl_plugin.adapter.contract`` (the SGLang facade), imported only for a supported
version.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from sgl_nixl_plugin import settings

#: The SGLang releases this plugin supports. Keep in step with ``[project.optional-dependencies]
#: sglang`` in pyproject.toml.
SUPPORTED_SGLANG = ">=0.5.23,<0.5.24"
#: The release the signatures below were read from (what the fix text tells users to install).
TESTED_SGLANG = "0.5.23"
SUPPORTED_SPECIFIER = SpecifierSet(SUPPORTED_SGLANG)

#: Test hook: when set, pretend this SGLang version is installed. Lets tests (and a curious
#: deployer) exercise the version gate without installing another SGLang. Not for production.
VERSION_OVERRIDE_ENV = "SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE"  # read by settings

FIX_HINT = (
    f"Fix: pip install 'sgl-nixl-plugin[sglang]' (or pip install 'sglang=={TESTED_SGLANG}'), "
    "or install a sgl-nixl-plugin release that supports your SGLang."
)


def installed_sglang_version() -> str | None:
    """The installed SGLang version string, or None when SGLang is not installed.

    Honours :data:`VERSION_OVERRIDE_ENV` (a test hook) before asking ``importlib.metadata``.
    """
    override = settings.sglang_version_override()
    if override:
        return override
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> list[str]:
    """Problems with the installed (or given) SGLang version; empty when it is supported."""
    found = installed_sglang_version() if version is None else version
    if found is None:
        return [
            f"SGLang is not installed; sgl-nixl-plugin needs SGLang {SUPPORTED_SGLANG}. {FIX_HINT}"
        ]
    try:
        parsed = Version(found)
    except InvalidVersion:
        return [
            f"installed SGLang version {found!r} is not a valid version; supported range is "
            f"{SUPPORTED_SGLANG}. {FIX_HINT}"
        ]
    if not SUPPORTED_SPECIFIER.contains(parsed, prereleases=True):
        return [
            f"installed SGLang {found} is outside the supported range {SUPPORTED_SGLANG}. "
            f"{FIX_HINT}"
        ]
    return []


def check_sglang() -> list[str]:
    """Everything wrong with the installed SGLang for this plugin; empty means supported.

    The version is checked first; signatures are only inspected for a supported version
    (an unsupported one is the decisive problem and inspecting it costs an SGLang import).
    """
    problems = check_version()
    if problems:
        return problems
    from sgl_nixl_plugin.adapter import contract  # the only part that imports SGLang

    problems = contract.check_signatures()
    if problems:
        found = installed_sglang_version()
        problems.append(
            f"installed SGLang {found} is in the supported range {SUPPORTED_SGLANG} but its "
            f"interfaces differ from {TESTED_SGLANG}'s. {FIX_HINT}"
        )
    return problems
