"""A rank's staging buffer, allocated when a peer first needs the staged path.

SGLang sizes its KV pool before the plugin starts, so a buffer taken at start-up comes out
of the headroom SGLang keeps for activations, also on ranks that never stage (one-pass
pairs, direct-only deployments). ``LazyStaging`` holds the planned size and allocates (and
NIXL-registers) the buffer once, on whichever thread first asks; a failure is kept, so a
rank that cannot have it falls back to direct transfers instead of retrying every peer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sgl_nixl_plugin.engine.staging import SPARE_BYTES, StagingBuffer

logger = logging.getLogger(__name__)

#: What an operator sets when the staging buffer does not fit.
SETTINGS_HINT = (
    "set SGLANG_NIXL_PLUGIN_STAGING_BYTES lower (SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES: "
    "the slot size) or 0 to turn staging off"
)


def planned_bytes(nbytes: int, slot_bytes: int) -> int:
    """What a ``StagingBuffer(nbytes, slot_bytes)`` holds: whole slots and the spare tail."""
    if slot_bytes <= 0 or nbytes < slot_bytes:
        return 0
    return (nbytes // slot_bytes) * slot_bytes + (SPARE_BYTES if slot_bytes > SPARE_BYTES else 0)


def _mib(nbytes: int) -> int:
    return nbytes >> 20


def _kind(mem_kind: str) -> str:
    return "GPU" if mem_kind == "VRAM" else "host"


class LazyStaging:
    """The planned staging buffer of one rank; ``ensure`` allocates it at most once.

    Thread-safe: the prefill's setup thread and the decode's allocation thread call
    ``ensure``; every other thread reads ``buffer`` (None until allocated).
    """

    def __init__(
        self,
        agent: Any,
        nbytes: int,
        slot_bytes: int,
        mem_kind: str,
        device: int = 0,
        make: Callable[..., StagingBuffer] = StagingBuffer,
    ) -> None:
        self.agent = agent
        self.nbytes = nbytes
        self.slot_bytes = slot_bytes
        self.mem_kind = mem_kind
        self.device = device
        self.planned = planned_bytes(nbytes, slot_bytes)
        self.buffer: StagingBuffer | None = None
        self.error = ""  # why the allocation failed ("" if it did not, or not yet)
        self.allocations = 0
        self.failures = 0
        self._make = make
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes of memory the buffer holds now (0 before it is allocated)."""
        buffer = self.buffer
        return buffer.nbytes if buffer is not None else 0

    def describe(self) -> str:
        """What the start-up line says: what it holds now, and the most it takes."""
        held = f"{_mib(self.held)} MiB of {_kind(self.mem_kind)} memory for staging"
        if self.buffer is not None:
            return held
        return f"{held} (up to {_mib(self.planned)} MiB when a peer first stages)"

    def ensure(self, why: str = "") -> StagingBuffer | None:
        """The buffer, allocated now on this thread if it is not yet; None if it cannot be
        (the reason in ``error``, logged once). ``why``: who needs it, for the log line."""
        with self._lock:
            if self.buffer is not None or self.error:
                return self.buffer
            started = time.monotonic()
            try:
                if self.mem_kind == "VRAM":
                    import torch

                    torch.cuda.set_device(self.device)  # this thread's device: the rank's
                buffer = self._make(
                    self.agent, self.nbytes, self.slot_bytes, self.mem_kind, self.device
                )
            except Exception as exc:  # out of memory, or NIXL refused the registration
                self.failures += 1
                self.error = (
                    f"could not allocate the {_mib(self.planned)} MiB staging buffer "
                    f"({_kind(self.mem_kind)} memory): "
                    f"{type(exc).__name__}: {exc}; {SETTINGS_HINT}"
                )
                logger.error("sgl-nixl: %s; staged transfers go direct", self.error)
                return None
            self.buffer = buffer
            self.allocations += 1
        logger.info(
            "sgl-nixl: allocated %d MiB of %s memory for staging (%d slots of %d MiB) in %.1f ms%s",
            _mib(buffer.nbytes),
            "GPU" if self.mem_kind == "VRAM" else "host",
            buffer.num_slots,
            _mib(buffer.slot_bytes),
            (time.monotonic() - started) * 1e3,
            f": {why}" if why else "",
        )
        return buffer

    def counts(self) -> dict[str, int]:
        """For the rank's tables (``count.*``: events and figures, not per-room state)."""
        return {
            "count.staging.held_bytes": self.held,
            "count.staging.allocations": self.allocations,
            "count.staging.alloc_failures": self.failures,
        }
