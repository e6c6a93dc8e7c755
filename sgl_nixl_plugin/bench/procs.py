"""Where the bench's rank processes come from.

A rank spends most of its start importing SGLang: its server arguments pull in torch and
transformers, several seconds of CPU per process. Ranks on host memory are forked from a
forkserver that imported those modules once, so a session of N ranks, and every later
session of the same parent process (a test run), pays for the import once. Ranks on a GPU
are spawned: a child forked after an import that touched CUDA cannot use it.

A forked child would inherit the environment and the standard output and error the
forkserver was started with; :class:`Inherited` carries its parent's, taken when the child
is started, as a spawned child would have inherited them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections.abc import Mapping
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from typing import Any

from sgl_nixl_plugin.adapter import harness

#: The environment this module was imported with. In the forkserver it is imported first,
#: before SGLang's import rewrites its legacy ``SGL_*`` variables to ``SGLANG_*``.
_START_ENV = dict(os.environ)

#: Imported once by the forkserver (in this order; one that fails to import is skipped).
PRELOAD = (
    __name__,
    "numpy",
    "torch",
    *harness.PRELOAD_MODULES,
    "sgl_nixl_plugin.bench.rank",
)


def context(mem_kind: str) -> BaseContext:
    """The start method for ranks on ``mem_kind`` memory: the preloaded forkserver for host
    memory on POSIX, spawn otherwise."""
    if mem_kind != "DRAM" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # no effect once the forkserver runs
    return ctx


class Inherited:
    """This process's environment, stdout and stderr, as a child started now would inherit
    them. Pass it with the child's arguments; the child calls :meth:`apply` first."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self._stdio: tuple[Any, Any] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # DupFd sends the descriptors along with the child's start request
        return _rebuild, (self.environ, reduction.DupFd(1), reduction.DupFd(2))

    def apply(self) -> None:
        """In the child: take the parent's environment and its stdout and stderr."""
        adopt_environ(self.environ)
        if self._stdio is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            for target, fd in zip((1, 2), self._stdio, strict=True):
                source = fd.detach()
                if source != target:  # a spawned child gets the parent's own 1 and 2 as is
                    os.dup2(source, target)
                    os.close(source)
            self._stdio = None


def _rebuild(environ: dict[str, str], out: Any, err: Any) -> Inherited:
    inherited = Inherited(environ)
    inherited._stdio = (out, err)
    return inherited


def adopt_environ(wanted: Mapping[str, str]) -> None:
    """Make this child's environment ``wanted`` (its parent's, taken when it asked for the
    child). Only variables the parent changed since the forkserver started are touched, so
    what the preloaded imports derived from the rest (SGLang's ``SGL_*`` rewrite) stays."""
    for key in _START_ENV.keys() | wanted.keys():
        value = wanted.get(key)
        if value == _START_ENV.get(key):
            continue
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
