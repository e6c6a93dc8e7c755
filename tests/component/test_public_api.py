"""The public face: a short ``__all__``, cheap to import, typed (py.typed shipped)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers.subproc import REPO_ROOT, TIMEOUT_S, clean_env, python_argv, run

import sgl_nixl_plugin
from sgl_nixl_plugin import registry

PUBLIC = {
    "__version__",
    "hookimpl",
    "hookspec",
    "AgentConfig",
    "BackendSpec",
    "TransferEvent",
    "ReceiveEvent",
    "ENTRY_POINT_GROUP",
}
HEAVY = ("torch", "nixl", "sglang", "pluggy", "zmq")


def test_all_is_exactly_the_public_names_and_each_resolves() -> None:
    assert set(sgl_nixl_plugin.__all__) == PUBLIC
    assert len(sgl_nixl_plugin.__all__) == len(PUBLIC)
    for name in PUBLIC - {"__version__"}:
        assert getattr(sgl_nixl_plugin, name) is getattr(registry, name), name
    assert isinstance(sgl_nixl_plugin.__version__, str)
    assert PUBLIC <= set(dir(sgl_nixl_plugin))
    with pytest.raises(AttributeError):
        sgl_nixl_plugin.NixlPluginKVManager  # noqa: B018  # private: not re-exported


def test_importing_the_package_pulls_in_nothing_heavy() -> None:
    code = f"import sys, sgl_nixl_plugin; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    res = run(python_argv("-c", code), env=clean_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "", f"imported eagerly: {res.stdout.strip()}"


def test_py_typed_is_in_the_package_and_declared() -> None:
    assert (REPO_ROOT / "sgl_nixl_plugin" / "py.typed").is_file()
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["sgl_nixl_plugin"]


def test_py_typed_is_in_the_built_wheel(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src / name)
    shutil.copytree(
        REPO_ROOT / "sgl_nixl_plugin",
        src / "sgl_nixl_plugin",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot build a wheel offline here: {res.stderr[-500:]}")
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert "sgl_nixl_plugin/py.typed" in zipfile.ZipFile(wheel).namelist()
