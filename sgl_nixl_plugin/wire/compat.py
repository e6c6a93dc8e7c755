"""Compatibility hash checked on first contact, and the message a mismatch produces."""

from __future__ import annotations

import hashlib

import msgspec

from sgl_nixl_plugin.wire.messages import Compat

#: ``Compat`` fields the two sides may differ in: the prefill pairs tokens across page sizes
#: and checks layer counts against the pipeline stages (``sides.pipeline_stages``).
MAY_DIFFER = frozenset({"page_size", "num_layers"})


def _agreed(compat: Compat) -> list[str]:
    return [f for f in compat.__struct_fields__ if f not in MAY_DIFFER]


def compat_hash(compat: Compat) -> str:
    """Stable digest of everything both sides must agree on (field order is fixed)."""
    agreed = {name: getattr(compat, name) for name in _agreed(compat)}
    return hashlib.sha256(msgspec.json.encode(agreed)).hexdigest()[:32]


def describe_mismatch(local: Compat, remote: Compat, local_role: str = "prefill") -> str:
    """Human text naming each differing field with both sides' values ('' if none)."""
    remote_role = "decode" if local_role == "prefill" else "prefill"
    diffs = [
        f"{name}: {local_role}={getattr(local, name)!r} {remote_role}={getattr(remote, name)!r}"
        for name in _agreed(local)
        if getattr(local, name) != getattr(remote, name)
    ]
    if not diffs:
        return ""
    return (
        "incompatible KV layouts between prefill and decode ("
        + "; ".join(diffs)
        + "): start both servers with the same model and --kv-cache-dtype, "
        "and the same sgl-nixl-plugin release"
    )
