"""``ci/setup_env.sh`` refuses to start a new venv on a disk too full to hold it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_new_venv_on_a_full_disk_is_refused_before_pip_runs(tmp_path: Path) -> None:
    venv = tmp_path / "absent" / "venv"
    env = {
        k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "NIXL_PLUGIN_CI_VENV_READY")
    }
    # No disk has this much free, so the check must refuse whatever the machine.
    env.update(VENV=str(venv), PYTHON=sys.executable, SGL_NIXL_MIN_FREE_GIB="1e9")
    done = subprocess.run(
        ["bash", str(ROOT / "ci" / "setup_env.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert f"GiB free under {tmp_path}; a new venv needs about 1e+09 GiB" in done.stderr
    assert "setup_env: FAILED (exit 1)" in done.stderr
    assert not (tmp_path / "absent").exists()
