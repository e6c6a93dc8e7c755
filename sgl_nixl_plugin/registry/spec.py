"""Plain data passed through the pluggy hooks: backends, agent configuration, transfer events.

Kept free of SGLang, NIXL and torch imports so that registering a backend, or reading the
registry from the CLI, never pays for (or requires) the heavy stack.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Literal

#: The four classes SGLang asks a transfer backend for (``KVClassType`` values, minus
#: ``kvargs``, which is always SGLang's own ``KVArgs``).
CLASS_KINDS: tuple[str, ...] = ("manager", "sender", "receiver", "bootstrap_server")

# Lower-case identifier: it becomes an SGLang CLI choice and an Enum member (upper-cased).
_BACKEND_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class BackendSpec:
    """A transfer backend: its ``--disaggregation-transfer-backend`` name and where its
    classes live.

    Only names are stored, so declaring a backend is free; :meth:`load` imports the module
    the first time SGLang actually asks for one of its classes.
    """

    name: str
    classes_module: str
    manager: str
    sender: str
    receiver: str
    bootstrap_server: str

    def __post_init__(self) -> None:
        if not _BACKEND_NAME.match(self.name):
            raise ValueError(
                f"backend name {self.name!r} must be a lower-case identifier "
                "(it becomes an SGLang CLI choice and an Enum member)"
            )
        for kind in CLASS_KINDS:
            if not getattr(self, kind):
                raise ValueError(f"backend {self.name!r}: class name for {kind!r} is empty")

    def class_name(self, kind: str) -> str:
        """The attribute name in :attr:`classes_module` that implements ``kind``."""
        if kind not in CLASS_KINDS:
            raise ValueError(f"unknown class kind {kind!r}; expected one of {CLASS_KINDS}")
        return str(getattr(self, kind))

    def load(self, kind: str) -> type:
        """Import :attr:`classes_module` (lazily, on first use) and return the ``kind`` class."""
        attr = self.class_name(kind)
        try:
            module = importlib.import_module(self.classes_module)
        except Exception as exc:
            raise ImportError(
                f"transfer backend {self.name!r}: cannot import {self.classes_module!r} "
                f"for its {kind} class: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            cls = getattr(module, attr)
        except AttributeError as exc:
            raise ImportError(
                f"transfer backend {self.name!r}: {self.classes_module!r} has no {attr!r} "
                f"(its {kind} class)"
            ) from exc
        if not isinstance(cls, type):
            raise TypeError(
                f"transfer backend {self.name!r}: {self.classes_module}.{attr} is not a class"
            )
        return cls


@dataclass
class AgentConfig:
    """How the NIXL agent is created; ``sgl_nixl_agent_config`` hooks may edit it in place.

    ``backend`` is a NIXL backend plugin name ("UCX", "LIBFABRIC", ...); ``backend_params``
    goes to ``create_backend`` as-is (NIXL wants string values).
    """

    backend: str = "UCX"
    backend_params: dict[str, str] = field(default_factory=dict)
    num_threads: int = 0
    capture_telemetry: bool = True


@dataclass(frozen=True)
class TransferEvent:
    """What an observer learns when one room's transfer to one peer finishes (ok or not)."""

    room: int
    peer: str
    ok: bool
    bytes: int
    duration_s: float
    descriptors: int
    path: Literal["direct", "staging"]
    reason: str | None = None
    #: where the room's time went, in ms: ``to_chunk_ms`` (request filed to first chunk),
    #: ``to_post_ms`` (first chunk to first WRITE), ``slot_wait_ms``, ``writes_ms`` (first
    #: WRITE to the end), ``wall_ms``, ``after_last_ms`` (the last chunk to the end: what
    #: the request waits for after its last forward pass); plus ``chunks``, ``pieces`` and
    #: NIXL's ``post_us`` / ``xfer_us``; and when each step happened, as ``*_at`` keys in
    #: seconds of ``time.perf_counter()`` (see :data:`PREFILL_STAMPS`; a step that did not
    #: happen has no key)
    timeline: dict[str, float] = field(default_factory=dict)


#: The absolute stamps of a prefill room in ``TransferEvent.timeline`` (seconds of
#: ``time.perf_counter()``, i.e. CLOCK_MONOTONIC on Linux: one clock for every process of a
#: machine, so they compare with a decode's ``ReceiveEvent`` stamps): its first decode
#: destination filed, every destination filed, its first chunk at the transfer worker, its
#: last chunk there, its first and last WRITE (or copy) posted, the first one seen done,
#: and its end (the last transfer settled; its status went out just before).
PREFILL_STAMPS: tuple[str, ...] = (
    "started_at",
    "ready_at",
    "claimed_at",
    "last_chunk_at",
    "first_post_at",
    "last_post_at",
    "first_done_at",
    "ended_at",
)

#: The absolute stamps of a decode room in ``ReceiveEvent.timeline`` (same clock as
#: :data:`PREFILL_STAMPS`): its transfer requests going out, the first and last staged piece
#: reaching the scatter thread, the last piece scattered, the (last) prefill status received
#: (or, one-pass, its completion flag seen), that status applied for SGLang, and SGLang
#: clearing the receiver.
DECODE_STAMPS: tuple[str, ...] = (
    "requested_at",
    "first_piece_at",
    "last_piece_at",
    "scattered_at",
    "status_at",
    "applied_at",
    "ended_at",
)


@dataclass(frozen=True)
class ReceiveEvent:
    """What an observer learns when a decode rank's room ends (SGLang cleared its receiver).

    ``staged``: its pieces came through the decode's staging buffer; ``senders``: the
    prefill ranks that serve it. ``timeline`` holds durations in ms (``to_first_piece_ms``,
    ``to_status_ms``, ``status_to_applied_ms``, ``applied_to_clear_ms``, ``wall_ms``) and
    the :data:`DECODE_STAMPS` the room reached.
    """

    room: int
    ok: bool
    staged: bool
    senders: int
    timeline: dict[str, float] = field(default_factory=dict)
