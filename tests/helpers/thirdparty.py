"""Build throwaway third-party packages that register backends through our entry-point group.

A directory with ``<pkg>/`` and ``<dist>.dist-info/{METADATA,entry_points.txt}`` is all
``importlib.metadata`` needs: put the directory on ``sys.path``/``PYTHONPATH`` and the
package's entry points are discovered exactly as an installed wheel's would be.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

ENTRY_POINT_GROUP = "sgl_nixl_plugin.backends"


def write_dist(
    root: Path,
    dist_name: str,
    entry_points: dict[str, str],
    files: dict[str, str],
    version: str = "0.0.1",
) -> Path:
    """Write ``files`` (relative path -> source) and dist-info metadata under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n"
    )
    lines = [f"[{ENTRY_POINT_GROUP}]"] + [f"{k} = {v}" for k, v in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


def write_nixl_test_backend(root: Path) -> Path:
    """The ``nixl_test`` backend: trivial subclasses of SGLang's Common* classes."""
    return write_dist(
        root,
        "nixl-test-backend",
        {"nixl_test": "nixl_test_backend.plugin"},
        {
            "nixl_test_backend/__init__.py": "",
            "nixl_test_backend/plugin.py": """
                from sgl_nixl_plugin.registry import BackendSpec, hookimpl

                @hookimpl
                def sgl_nixl_register_backends():
                    return [
                        BackendSpec(
                            name="nixl_test",
                            classes_module="nixl_test_backend.classes",
                            manager="TestManager",
                            sender="TestSender",
                            receiver="TestReceiver",
                            bootstrap_server="TestBootstrapServer",
                        )
                    ]
            """,
            "nixl_test_backend/classes.py": """
                from sglang.srt.disaggregation.common.conn import (
                    CommonKVBootstrapServer,
                    CommonKVManager,
                    CommonKVReceiver,
                    CommonKVSender,
                )

                class TestManager(CommonKVManager):
                    pass

                class TestSender(CommonKVSender):
                    pass

                class TestReceiver(CommonKVReceiver):
                    pass

                class TestBootstrapServer(CommonKVBootstrapServer):
                    pass
            """,
        },
    )
