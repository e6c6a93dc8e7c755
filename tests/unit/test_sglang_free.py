"""The per-side threads and the transport import no SGLang, not even through another module.

``test_structure`` reads each file's own imports; this imports the modules for real, in a
fresh interpreter whose import system refuses every ``sglang`` module, so a chain through a
third module (a side importing a facade helper that imports SGLang) fails too. The decode
listener is named on its own: it must run where SGLang is not importable.
"""

from __future__ import annotations

import pytest
from helpers import subproc

#: The decode listener: its thread, its policy and what they are handed.
DECODE_LISTENER = "sgl_nixl_plugin.adapter.decode"

#: Modules that must import without SGLang (each with everything it imports).
SGLANG_FREE = (
    DECODE_LISTENER,
    "sgl_nixl_plugin.adapter.bootstrap_client",
    "sgl_nixl_plugin.adapter.context",
    "sgl_nixl_plugin.adapter.control_loop",
    "sgl_nixl_plugin.adapter.decode_policy",
    "sgl_nixl_plugin.adapter.decode_side",
    "sgl_nixl_plugin.adapter.decode_staging",
    "sgl_nixl_plugin.adapter.decode_warmup",
    "sgl_nixl_plugin.adapter.liveness",
    "sgl_nixl_plugin.adapter.memory",
    "sgl_nixl_plugin.adapter.one_pass",
    "sgl_nixl_plugin.adapter.peer_setup",
    "sgl_nixl_plugin.adapter.pipeline_stages",
    "sgl_nixl_plugin.adapter.prefill_control",
    "sgl_nixl_plugin.adapter.prefill_side",
    "sgl_nixl_plugin.adapter.process_knobs",
    "sgl_nixl_plugin.adapter.transfer_worker",
    "sgl_nixl_plugin.adapter.transport",
)

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
    proc = subproc.run(subproc.python_argv("-c", _IMPORT_WITHOUT_SGLANG, *SGLANG_FREE))
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
