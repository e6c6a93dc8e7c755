"""The release gate: which SGLang releases this plugin supports, and whether the installed
one is one of them with the interfaces we rely on.

This is the single place that names the supported SGLang releases. SGLang's disaggregation
classes change between releases (the sender's constructor in 0.5.22, the abort-ACK API in
0.5.22, the backend template moved into SGLang's common classes in 0.5.23), so each
supported release maps to a contract module (``adapter/releases``) with that release's
signatures and our classes composed for it; at start-up the bridge checks that every
signature still looks the way it does in that release. Both checks return plain problem
strings so the bridge, the CLI and the tests can all report them the same way.

Importing this module is cheap (the bridge imports it in every SGLang process): the
signature check imports SGLang's modules, and only for a supported version; our classes for
that release (``adapter/releases``) are imported only when SGLang asks for them.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.adapter import contract

#: Each supported SGLang release (``major.minor.micro``; its post-releases too) and the
#: module of ``sgl_nixl_plugin.adapter.releases`` that serves it.
CONTRACTS: dict[str, str] = {
    "0.5.21": "sglang_0_5_21",
    "0.5.22": "sglang_0_5_22",
    "0.5.23": "sglang_0_5_23",
}
#: The same releases as a range. Keep in step with ``CONTRACTS`` and with
#: ``[project.optional-dependencies] sglang`` in pyproject.toml (a test checks both).
SUPPORTED_SGLANG = ">=0.5.21,<0.5.24"
#: The newest supported release (what the fix text tells users to install).
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


def release_for(version: str | None) -> str | None:
    """The supported release (a key of :data:`CONTRACTS`) SGLang ``version`` is, or None."""
    if version is None:
        return None
    try:
        parsed = Version(version)
    except InvalidVersion:
        return None
    if not SUPPORTED_SPECIFIER.contains(parsed, prereleases=True):
        return None
    release = ".".join(str(n) for n in (parsed.release + (0, 0, 0))[:3])
    return release if release in CONTRACTS else None


def contract_for(version: str | None) -> str | None:
    """The release module serving SGLang ``version``, or None when it is not supported."""
    release = release_for(version)
    return None if release is None else CONTRACTS[release]


def check_version(version: str | None = None) -> list[str]:
    """Problems with the installed (or given) SGLang version; empty when it is supported."""
    found = installed_sglang_version() if version is None else version
    if found is None:
        return [
            f"SGLang is not installed; sgl-nixl-plugin needs SGLang {SUPPORTED_SGLANG}. {FIX_HINT}"
        ]
    try:
        Version(found)
    except InvalidVersion:
        return [
            f"installed SGLang version {found!r} is not a valid version; supported range is "
            f"{SUPPORTED_SGLANG}. {FIX_HINT}"
        ]
    if contract_for(found) is None:
        return [
            f"installed SGLang {found} is not a supported release (supported: "
            f"{', '.join(CONTRACTS)}, i.e. {SUPPORTED_SGLANG}). {FIX_HINT}"
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
    found = installed_sglang_version()
    release = str(release_for(found))
    problems = contract.check_signatures(contract.SIGNATURES[release])
    if problems:
        problems.append(
            f"installed SGLang {found} is a supported release but its interfaces differ "
            f"from {release}'s. {FIX_HINT}"
        )
    return problems
