"""Launching a remembered Triton specialization through its compiled launcher: Triton's
generic dispatch costs tens of microseconds per call in Python, paid per staged piece."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def _spec(x: int) -> tuple[bool, bool]:
    return x == 1, x % 16 == 0


class _FastLaunch:
    """Launches a kernel specialization Triton compiled before, through its compiled
    launcher: Triton's generic dispatch (argument binding, specialization key, cache lookup)
    costs tens of microseconds per call in Python, paid per staged piece.

    The key mirrors what Triton specializes on: the constexprs, 16-byte alignment of the
    two pointers, the index dtype, and (=1, %16) of the integer arguments it does not
    treat as ``do_not_specialize``. ``TritonCopier.warmup`` checks the bytes it copies;
    any failure turns it off for good (the generic path remains)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.enabled = True
        self._kernels: dict[tuple, Any] = {}
        try:
            from triton import knobs

            self._hooks: Any = knobs.runtime
        except Exception:  # older Triton: hooks live on CompiledKernel
            self._hooks = None

    # per kernel: (pointer arguments, integer arguments Triton specializes, first constexpr)
    _LAYOUT = {"unit": ((0, 1), (4, 5, 6), 7), "pair": ((0, 1, 2, 3), (5, 6, 7, 8, 9), 10)}

    @classmethod
    def _key(cls, kind: str, num_warps: int, args: tuple) -> tuple:
        ptrs, ints, const = cls._LAYOUT[kind]
        return (
            kind,
            num_warps,
            *args[const:],
            *(args[i].dtype for i in ptrs),
            *(args[i].data_ptr() % 16 == 0 for i in ptrs),
            *(_spec(args[i]) for i in ints),
        )

    def remember(self, kind: str, num_warps: int, args: tuple, compiled: Any) -> None:
        if self.enabled and compiled is not None and hasattr(compiled, "run"):
            self._kernels[self._key(kind, num_warps, args)] = compiled

    def launch(self, kind: str, grid: tuple[int, int], num_warps: int, args: tuple) -> bool:
        if not self.enabled:
            return False
        ck = self._kernels.get(self._key(kind, num_warps, args))
        if ck is None:
            return False
        try:
            stream = self.torch._C._cuda_getCurrentRawStream(self.torch._C._cuda_getDevice())
            full = (grid[0], grid[1], 1)
            hooks = self._hooks
            enter = getattr(hooks, "launch_enter_hook", None) if hooks else None
            leave = getattr(hooks, "launch_exit_hook", None) if hooks else None
            meta = ck.launch_metadata(full, stream, *args)
            ck.run(
                full[0],
                full[1],
                full[2],
                stream,
                ck.function,
                ck.packed_metadata,
                meta,
                enter,
                leave,
                *args,
            )
            return True
        except Exception as exc:
            logger.warning("sgl-nixl: fast Triton launch failed (%s); using Triton's own", exc)
            self.enabled = False
            return False
