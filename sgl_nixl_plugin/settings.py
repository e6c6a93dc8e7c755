"""Every environment variable of the plugin: one table (:data:`VARS`), read only here.

Only the ``SGLANG_NIXL_PLUGIN_<NAME>`` spelling is read. The ``SGL_NIXL_PLUGIN_<NAME>``
spelling of 0.4 and earlier is refused: set while the new one is not, reading the setting
raises ValueError naming both (ignoring it would, for the shared secret, silently turn
authentication off). Inside an SGLang server both are set, because SGLang copies every
``SGL_*`` variable to ``SGLANG_*`` at start-up; that case reads the ``SGLANG_`` one.

SGLang's own NIXL agent variables (:data:`SGLANG_VARS`) are read by
``registry.manager.default_agent_config`` so that deployer hooks see them; they are named
here so the README's table can be checked against one list.

Audiences: ``user`` variables are the stable interface; ``tuning`` and ``test`` ones are
knobs for benchmarks, debugging and the test suite and may change in any release.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

PREFIX = "SGLANG_NIXL_PLUGIN_"
LEGACY_PREFIX = "SGL_NIXL_PLUGIN_"

TRANSFER_PATHS = ("auto", "direct", "staging", "ipc")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

Kind = Literal["str", "int", "float", "flag", "choice"]
Audience = Literal["user", "tuning", "test"]


@dataclass(frozen=True)
class Var:
    """One environment variable: its full name, how its value is parsed, and who it is for.

    ``field`` names the :class:`Settings` field it fills (empty: read by its own function);
    ``minimum`` clamps a number from below; ``choices`` are the values of a ``choice``.
    """

    name: str
    kind: Kind
    default: Any
    doc: str
    audience: Audience
    choices: tuple[str, ...] = ()
    field: str = ""
    minimum: float | None = None

    @property
    def legacy_name(self) -> str:
        """The refused pre-0.5 spelling, ``SGL_NIXL_PLUGIN_<NAME>``."""
        return LEGACY_PREFIX + self.name[len(PREFIX) :]


def _v(name: str, kind: Kind, default: Any, audience: Audience, doc: str, **kw: Any) -> Var:
    return Var(PREFIX + name, kind, default, doc, audience, **kw)


# fmt: off
#: Every variable of ours. The README's Configuration tables list exactly these (checked by
#: tests/unit/test_env.py): ``user`` ones in the main table, the others in the knobs table.
VARS: tuple[Var, ...] = (
    # user: the stable interface
    _v("SECRET", "str", "", "user", "shared secret, the same on every prefill and decode"),
    _v("SECRET_FILE", "str", "", "user", "file holding the shared secret (wins over SECRET)"),
    _v("STRICT", "flag", False, "user", "an unsupported SGLang stops the process at start-up"),
    _v("TRANSFER_PATH", "choice", "auto", "user",
       "auto, direct, staging or ipc (one pass through CUDA IPC; auto takes it where the GPUs "
       "can map each other; direct and staging forbid it)",
       choices=TRANSFER_PATHS, field="transfer_path"),
    _v("CUDA_IPC", "flag", True, "user",
       "a decode offers its KV pool to prefills whose GPU can map it (one-pass transfers)",
       field="cuda_ipc"),
    _v("DONE_FLAGS", "flag", True, "tuning",
       "a one-pass room ends when the prefill's copy stream stores a flag in the decode's "
       "shared memory (/dev/shm), not after the status message's hop (set it on the decode "
       "or the prefill; 0 on either side turns it off)",
       field="done_flags"),
    _v("WRITE_NOTES", "flag", True, "tuning",
       "a small direct room ends when the decode's scheduler sees the NIXL notification "
       "of its last WRITE, not after the status message's hop (read by the decode; 0 "
       "leaves every direct room to the status message)",
       field="write_notes"),
    _v("STAGING_BYTES", "int", -1, "user",
       "staging buffer bytes; 0 turns staging off, -1: by memory kind", field="staging_bytes"),
    # tuning: not a stable interface
    _v("PREFILLS", "str", "", "tuning",
       "a decode registers at start-up with these prefills (their bootstrap host:port, "
       "comma-separated), so a user's first request does not wait for the link and "
       "warm-up; others are still learned from requests", field="prefills"),
    _v("STAGING_PIECE_BYTES", "int", -1, "tuning",
       "bytes of one staging slot (-1: by memory kind)", field="staging_piece_bytes"),
    _v("WORKERS", "int", 2, "tuning", "prefill transfer worker threads",
       field="workers", minimum=1),
    _v("NIXL_THREADS", "int", 8, "tuning", "threads of the UCX backend",
       field="nixl_threads", minimum=0),
    _v("PROGRESS_THREAD", "flag", False, "tuning", "NIXL's own progress thread",
       field="progress_thread"),
    _v("UCX_PREWARM", "choice", "auto", "tuning",
       "UCX selects its protocols for same-host peers at start-up (two throwaway in-process "
       "agents, ~50 ms), not inside the first request of a decode learned from it; auto: "
       "with a DRAM KV pool only (not yet measured on a GPU), 1: always, 0: never",
       choices=("auto", "1", "0"), field="ucx_prewarm"),
    _v("LOG_LEVEL", "choice", "", "tuning",
       "level of the plugin's loggers in SGLang's processes (DEBUG: one line per room); "
       "unset: SGLang's --log-level",
       choices=("DEBUG", "INFO", "WARNING", "ERROR"), field="log_level"),
    _v("SWITCH_INTERVAL_US", "float", 0.0, "tuning",
       "Python's GIL switch interval in SGLang's scheduler processes, in microseconds (0: "
       "Python's 5000); each step of the plugin's threads waits up to one interval while "
       "the scheduler runs Python", field="switch_interval_us", minimum=0.0),
    _v("KV_MEM_KIND", "choice", "", "tuning", "force DRAM or VRAM for the KV pool",
       choices=("DRAM", "VRAM"), field="kv_mem_kind"),
    _v("LIVENESS_INTERVAL", "float", 1.0, "tuning", "seconds between pings of busy peers",
       field="liveness_interval_s"),
    _v("LIVENESS_MISSES", "int", 5, "tuning", "silent intervals before a peer is gone",
       field="liveness_misses", minimum=1),
    _v("LIVENESS_STALL", "float", 30.0, "tuning",
       "seconds a peer whose connection still answers heartbeats may leave pings unanswered "
       "(its control thread busy) before it is gone", field="liveness_stall_s"),
    _v("ABORT_DRAIN_TIMEOUT", "float", 5.0, "tuning",
       "seconds a failed room's staging slots, and a lost prefill's host-pool pages, stay out "
       "of use", field="abort_drain_timeout_s"),
    _v("SLOT_WAIT", "float", 2.0, "tuning", "seconds a chunk waits for a slot, then goes direct",
       field="slot_wait_s", minimum=0.0),
    _v("MAP_INDICES", "flag", True, "tuning", "prefill gathers read page indices in place",
       field="map_indices"),
    _v("WARMUP", "flag", True, "tuning",
       "prefill WRITEs the padding page and the staging spare at registration, taking "
       "wire-up off the first request",
       field="warmup"),
    _v("WARMUP_TIMEOUT", "float", 1.0, "tuning",
       "seconds the prefill waits for each warm-up WRITE; past it the first request pays "
       "the wire-up", field="warmup_timeout_s", minimum=0.0),
    # test: hooks for the test suite and the benchmark
    _v("SGLANG_VERSION_OVERRIDE", "str", "", "test",
       "pretend this SGLang version is installed (exercises the version gate)"),
    _v("TEST_TIMEOUT_SCALE", "float", 1.0, "test", "multiplies the test suite's timeouts"),
    _v("CHAOS_S", "float", 45.0, "test",
       "seconds of faults in each chaos soak test (tests/e2e/test_chaos.py)", minimum=1.0),
    _v("CHAOS_SEED", "int", 0, "test", "seed of the chaos soak's fault scheduler (0: random)"),
    _v("CHAOS_NETNS", "flag", True, "test",
       "also run the chaos soak with netns link cuts (0 skips that variant)"),
    _v("BENCH_LOG", "str", "WARNING", "test",
       "log level of bench rank processes (set by `sgl-nixl-plugin bench --verbose`, "
       "read by bench/rank.py)"),
    _v("BENCH_POLL_WAIT_US", "float", 500.0, "test",
       "the bench rank loops' longest wait between two polls, in microseconds (0 spins)",
       minimum=0.0),
    _v("BENCH_BELL", "flag", True, "test",
       "the bench rank loops wake on a status change (0: they sleep the poll wait through)"),
    _v("BENCH_STACK_DUMP_S", "float", 0.0, "test",
       "a bench rank still running after this many seconds prints every thread's stack "
       "to its stderr (0: never)", minimum=0.0),
)
# fmt: on
_BY_NAME = {v.name: v for v in VARS}

#: SGLang's own variables that configure our NIXL agent (read in ``registry.manager``).
SGLANG_VARS: tuple[str, ...] = (
    "SGLANG_DISAGGREGATION_NIXL_BACKEND",
    "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS",
)


def _var(name: str) -> Var:
    return _BY_NAME[name if name.startswith(PREFIX) else PREFIX + name]


def _raw(var: Var) -> str:
    """The variable's value ("" when unset); refuses the legacy spelling set alone."""
    value = os.environ.get(var.name, "")
    if not value and os.environ.get(var.legacy_name, ""):
        raise ValueError(
            f"{var.legacy_name} is set but {var.name} is not: since sgl-nixl-plugin 0.5 only "
            f"the SGLANG_NIXL_PLUGIN_ spelling is read; rename {var.legacy_name} to {var.name}"
        )
    return value


def value(name: str) -> Any:
    """The parsed value of variable ``name`` (``"SLOT_WAIT"`` or its full name), or its
    default when unset; ValueError naming the variable when the value does not parse."""
    var = _var(name)
    raw = _raw(var)
    if not raw:
        return var.default
    if var.kind == "str":
        return raw
    text = raw.strip()
    if var.kind == "int":
        try:
            number: float = int(text)
        except ValueError as exc:
            raise ValueError(f"{var.name}={raw!r} is not an integer") from exc
    elif var.kind == "float":
        try:
            number = float(text)
        except ValueError as exc:
            raise ValueError(f"{var.name}={raw!r} is not a number") from exc
    elif var.kind == "flag":
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{var.name}={raw!r}: expected 1 or 0")
    else:
        for choice in var.choices:
            if text.lower() == choice.lower():
                return choice
        raise ValueError(f"{var.name}={raw!r}: expected one of {var.choices}")
    if var.minimum is not None:
        number = max(type(number)(var.minimum), number)
    return number


def read_secret() -> bytes | None:
    """The shared secret from ``SGLANG_NIXL_PLUGIN_SECRET`` or ``..._SECRET_FILE`` (the file
    wins); None when neither is set."""
    raw = value("SECRET")
    path = value("SECRET_FILE")
    if path:
        try:
            raw = Path(path).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{PREFIX}SECRET_FILE={path!r} is unreadable: {exc}") from exc
    return raw.encode() if raw else None


def secret_vars_set() -> list[str]:
    """Names of the secret variables that are set (for reports; never raises)."""
    return [name for name in (PREFIX + "SECRET", PREFIX + "SECRET_FILE") if os.environ.get(name)]


def strict_mode() -> bool:
    """Whether ``SGLANG_NIXL_PLUGIN_STRICT`` asks for a start-up failure on an unsupported
    SGLang."""
    return bool(value("STRICT"))


def sglang_version_override() -> str:
    """``SGLANG_NIXL_PLUGIN_SGLANG_VERSION_OVERRIDE`` (a test hook), "" when unset."""
    return str(value("SGLANG_VERSION_OVERRIDE")).strip()


def test_timeout_scale() -> float:
    """``SGLANG_NIXL_PLUGIN_TEST_TIMEOUT_SCALE``: multiplies the test suite's timeouts."""
    return float(value("TEST_TIMEOUT_SCALE"))


test_timeout_scale.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


@dataclass(frozen=True)
class Settings:
    """The settings a manager reads once at start-up (see :data:`VARS` for each field)."""

    secret: bytes | None = None
    workers: int = 2
    nixl_threads: int = 8
    progress_thread: bool = False
    ucx_prewarm: str = "auto"
    transfer_path: str = "auto"
    prefills: str = ""  # bootstrap host:port list a decode registers with at start-up
    cuda_ipc: bool = True  # a decode exports its KV pool for one-pass transfers
    done_flags: bool = True  # one-pass rooms end through a flag in the decode's /dev/shm
    write_notes: bool = True  # small direct rooms end through their WRITEs' notifications
    staging_bytes: int = -1  # -1: by memory kind (see ``staging_sizes``); 0: staging off
    staging_piece_bytes: int = -1
    kv_mem_kind: str = ""  # "" = what the pointers say, else DRAM/VRAM
    liveness_interval_s: float = 1.0
    liveness_misses: int = 5
    liveness_stall_s: float = 30.0  # a peer with live heartbeats but a busy control thread
    abort_drain_timeout_s: float = 5.0
    slot_wait_s: float = 2.0  # a chunk waits this long for a receiver slot, then goes direct
    map_indices: bool = True  # prefill GPU gathers read page indices from pinned host memory
    warmup: bool = True  # a WRITE into the decode's padding page when it registers
    warmup_timeout_s: float = 1.0  # the prefill's setup thread waits this long for it
    log_level: str = ""  # the plugin's loggers; "": whatever SGLang's --log-level set
    switch_interval_us: float = 0.0  # 0: leave Python's GIL switch interval as it is

    @classmethod
    def from_env(cls) -> Settings:
        fields = {var.field: value(var.name) for var in VARS if var.field}
        return cls(secret=read_secret(), **fields)


def prefill_addrs(text: str) -> tuple[str, ...]:
    """``SGLANG_NIXL_PLUGIN_PREFILLS`` as bootstrap addresses, ``host:port`` each (as
    SGLang's requests name them); ValueError naming the entry that is not one."""
    out: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"{PREFIX}PREFILLS: {entry!r} is not host:port (a prefill's bootstrap "
                "address, e.g. 10.0.0.5:8998; several are comma-separated)"
            )
        if entry not in out:
            out.append(entry)
    return tuple(out)


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
