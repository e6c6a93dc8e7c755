"""GPU bench machine only: stand-ins for SGLang's CUDA kernel packages.

The lent GPU machine cannot install SGLang's kernel wheels (no index, 64 MiB carry limit), but
importing SGLang on a CUDA machine pulls them in at module level. The KV-transfer path never
calls them, so these stubs only have to satisfy ``import``: any attribute is a harmless
placeholder. Never on PYTHONPATH outside ci/gpu_e2e.sh.
"""

import importlib.abc
import importlib.machinery
import sys
import types

STUBBED = (
    "sgl_kernel",
    "flashinfer",
    "deep_gemm",
    "flash_attn",
    "sgl_kernel_npu",
    "vllm",
    "flash_mla",
    "sgl_flash_kernel",
    "cutlass",
    "cuda_bindings_stub",
)


class _Anything:
    def __init__(self, name="stub"):
        self._name = name

    def __call__(self, *a, **k):
        return _Anything(self._name)

    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self._name}.{item}")

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _Anything(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0"
        return m

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
