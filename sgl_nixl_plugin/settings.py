"""Runtime settings, read from the environment once per process.

NIXL agent settings (SGLang's ``SGLANG_DISAGGREGATION_NIXL_BACKEND`` and ``..._PARAMS``)
are read by ``registry.manager.default_agent_config`` so that deployer hooks see them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from sgl_nixl_plugin import env

logger = logging.getLogger(__name__)

TRANSFER_PATHS = ("auto", "direct", "staging")


def _int(name: str, default: int) -> int:
    var, raw = env.lookup(name)
    try:
        return int(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{var}={raw!r} is not an integer") from exc


def _float(name: str, default: float) -> float:
    var, raw = env.lookup(name)
    try:
        return float(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{var}={raw!r} is not a number") from exc


def _flag(name: str, default: bool) -> bool:
    var, raw = env.lookup(name)
    if not raw:
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{var}={raw!r}: expected 1 or 0")


def read_secret() -> bytes | None:
    """The shared secret from ``SGLANG_NIXL_PLUGIN_SECRET`` or ``..._SECRET_FILE`` (or their
    ``SGL_NIXL_PLUGIN_`` spellings, see ``env``)."""
    raw = env.get("SECRET")
    var, path = env.lookup("SECRET_FILE")
    if path:
        try:
            raw = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{var}={path!r} is unreadable: {exc}") from exc
    return raw.encode() if raw else None


@dataclass(frozen=True)
class Settings:
    secret: bytes | None = None
    workers: int = 2
    nixl_threads: int = 8
    progress_thread: bool = False
    transfer_path: str = "auto"
    staging_bytes: int = -1  # -1: by memory kind (see ``staging_sizes``); 0: staging off
    staging_piece_bytes: int = -1
    kv_mem_kind: str = ""  # "" = what SGLang says, else DRAM/VRAM
    liveness_interval_s: float = 1.0
    liveness_misses: int = 5
    abort_drain_timeout_s: float = 5.0
    slot_wait_s: float = 2.0  # a chunk waits this long for a receiver slot, then goes direct
    map_indices: bool = True  # prefill GPU gathers read page indices from pinned host memory
    slot_returns: bool = True  # offer SlotReturn / SlotRecall to peers (0.3.0 behaviour: off)

    @classmethod
    def from_env(cls) -> Settings:
        var, path = env.lookup("TRANSFER_PATH")
        path = (path or "auto").lower()
        if path not in TRANSFER_PATHS:
            raise ValueError(f"{var}={path!r}: expected one of {TRANSFER_PATHS}")
        var, kind = env.lookup("KV_MEM_KIND")
        kind = kind.upper()
        if kind not in ("", "DRAM", "VRAM"):
            raise ValueError(f"{var}={kind!r}: expected DRAM or VRAM")
        return cls(
            secret=read_secret(),
            workers=max(1, _int("WORKERS", 2)),
            nixl_threads=max(0, _int("NIXL_THREADS", 8)),
            progress_thread=env.get("PROGRESS_THREAD", "0") == "1",
            transfer_path=path,
            staging_bytes=_int("STAGING_BYTES", -1),
            staging_piece_bytes=_int("STAGING_PIECE_BYTES", -1),
            kv_mem_kind=kind,
            liveness_interval_s=_float("LIVENESS_INTERVAL", 1.0),
            liveness_misses=max(1, _int("LIVENESS_MISSES", 5)),
            abort_drain_timeout_s=_float("ABORT_DRAIN_TIMEOUT", 5.0),
            slot_wait_s=max(0.0, _float("SLOT_WAIT", 2.0)),
            map_indices=_flag("MAP_INDICES", True),
            slot_returns=_flag("SLOT_RETURNS", True),
        )


#: Default staging buffer and slot sizes per memory kind: on GPUs 2 GiB in 256 MiB slots (a
#: 1 GiB request goes in ~6 pipelined pieces across GPUs, 4 on one GPU, see
#: ``staging.piece_bytes``; a room transferring holds up to 4 slots, so 8 slots let two
#: rooms transfer at once), modest ones in host memory. Prefill and decode on one GPU without MPS go faster with 512 MiB slots
#: (2 pieces; docs/benchmarks.md), at the cost of one room at a time.
STAGING_DEFAULTS = {"VRAM": (2 << 30, 256 << 20), "DRAM": (128 << 20, 16 << 20)}


def staging_sizes(settings: Settings, mem_kind: str) -> tuple[int, int]:
    """(buffer bytes, slot bytes) for this memory kind; (0, 0) when staging is off."""
    if settings.transfer_path == "direct" or settings.staging_bytes == 0:
        return 0, 0
    total, slot = STAGING_DEFAULTS[mem_kind]
    if settings.staging_bytes > 0:
        total = settings.staging_bytes
    if settings.staging_piece_bytes > 0:
        slot = settings.staging_piece_bytes
    return total, min(slot, total)
