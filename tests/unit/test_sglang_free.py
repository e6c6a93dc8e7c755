"""The per-side threads and the transport import no SGLang, not even through another module.

``test_structure`` reads each file's own imports; this imports the modules for real, in a
fresh interpreter whose import system refuses every ``sglang`` module, so a chain through a
third module (a side importing a facade helper that imports SGLang) fails too. The decode
listener is named on its own: it must run where SGLang is not importable.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import subproc

#: The decode listener: its thread, its policy and what they are handed.
DECODE_LISTENER = "sgl_nixl_plugin.sides.decode_listener"

#: Packages that must import without SGLang, every module of them (with all they import).
SGLANG_FREE_PACKAGES = ("sides", "transport")


def _modules() -> list[str]:
    root = Path(__file__).resolve().parents[2] / "sgl_nixl_plugin"
    names = [DECODE_LISTENER]
    for package in SGLANG_FREE_PACKAGES:
        names += [
            f"sgl_nixl_plugin.{package}" + ("" if p.stem == "__init__" else f".{p.stem}")
            for p in sorted((root / package).glob("*.py"))
        ]
    return names


#: Run in the subprocess: refuse SGLang, then import each module named in argv.
_IMPORT_WITHOUT_SGLANG = """
import importlib, sys, traceback

class RefuseSGLang:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ModuleNotFoundError(f"SGLang is refused here: {name}", name=name)
        return None

sys.meta_path.insert(0, RefuseSGLang())
failed = 0
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except ImportError:
        failed += 1
        print(f"{module} imports SGLang:", file=sys.stderr)
        traceback.print_exc()
sys.exit(1 if failed else 0)
"""


@pytest.mark.timeout(int(subproc.TIMEOUT_S) + 30)
def test_sides_and_transport_import_no_sglang() -> None:
    proc = subproc.run(subproc.python_argv("-c", _IMPORT_WITHOUT_SGLANG, *_modules()))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.timeout(int(subproc.TIMEOUT_S) + 30)
def test_the_check_catches_an_sglang_import() -> None:
    """The refusal works: a facade module that imports SGLang fails under it."""
    proc = subproc.run(
        subproc.python_argv("-c", _IMPORT_WITHOUT_SGLANG, "sgl_nixl_plugin.adapter.sglang_rooms")
    )
    assert proc.returncode == 1
    assert "sgl_nixl_plugin.adapter.sglang_rooms imports SGLang" in proc.stderr
    assert "SGLang is refused here: sglang" in proc.stderr
