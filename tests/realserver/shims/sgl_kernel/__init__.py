"""Import-time stand-in for ``sgl_kernel`` -- test tree only, never part of the package.

Why: SGLang 0.5.23 imports ops from ``sgl_kernel`` at module level on the CPU path (e.g.
``sglang/kernels/ops/kvcache/cache_move.py`` does ``from sgl_kernel import
copy_all_layer_kv_cache_cpu`` when the device is CPU). The PyPI ``sglang-kernel`` wheel
is a CUDA build and will not load on a GPU-less CI host. On a CPU without AMX, with
``--attention-backend torch_native``, the server never calls any ``sgl_kernel`` op, so
an importable placeholder is enough to start real servers.

Only the real-server test puts ``tests/realserver/shims`` on the PYTHONPATH of the
server processes it starts. Any op that *is* called raises a clear error naming it, so
a code path that starts needing a real kernel fails loudly instead of silently.
"""

from __future__ import annotations

IS_STAND_IN = True


class SglKernelStandInError(RuntimeError):
    pass


def _stand_in(name: str):
    def op(*args, **kwargs):
        raise SglKernelStandInError(
            f"sgl_kernel.{name} was called, but this process runs with the test-only "
            "sgl_kernel stand-in (tests/realserver/shims/sgl_kernel); the real-server "
            "test assumes a CPU path that calls no sgl_kernel op"
        )

    op.__name__ = name
    op.__qualname__ = name
    return op


def __getattr__(name: str):
    # Dunder/private lookups (pickling, introspection, version probes) must fail normally.
    if name.startswith("_"):
        raise AttributeError(name)
    return _stand_in(name)
