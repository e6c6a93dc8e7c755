#!/usr/bin/env bash
# Prepare a Python environment for the tests and the benchmark.
#
# Which venv: $VENV if set; else the active virtualenv ($VIRTUAL_ENV); else ./.venv (created
# when missing, with $PYTHON, default python3; 3.11 tested). Installs the plugin editable with
# its test extras, then the newest supported SGLang (release_gate.TESTED_SGLANG) with --no-deps plus the light packages its imported
# modules need (ci/requirements-sglang-light.txt). Run it, or source it to keep the venv
# active in your shell (`source ci/setup_env.sh`); sourcing does not change your shell options.

_sgl_nixl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -n "${VENV:-}" ]]; then
    _sgl_nixl_venv="$VENV"
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    _sgl_nixl_venv="$VIRTUAL_ENV"
else
    _sgl_nixl_venv="$_sgl_nixl_root/.venv"
fi

# A run that already set this venv up (ci/run_tests.sh before ci/run_matrix.sh) installs
# nothing again.
if [[ ${NIXL_PLUGIN_CI_VENV_READY:-} == "$_sgl_nixl_venv" && -x "$_sgl_nixl_venv/bin/python" ]]; then
    echo "setup_env: $_sgl_nixl_venv was set up earlier in this run" >&2
else
# The work runs in a subshell with strict options, so a sourcing shell is left untouched.
(
    set -euo pipefail
    root="$_sgl_nixl_root"
    venv="$_sgl_nixl_venv"
    python="${PYTHON:-python3}"
    pip_q=(-q --disable-pip-version-check)

    if [[ ! -x "$venv/bin/python" ]]; then
        "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || {
            echo "setup_env: $python is older than 3.10; set PYTHON=python3.11" >&2
            exit 1
        }
        # A new venv takes about 7 GiB (SGLang pins torch 2.14.1, whose wheel brings the CUDA
        # libraries), and pip unpacks into $TMPDIR as it goes. A full disk otherwise shows up
        # as an OSError halfway through pip and an import error after it.
        need_gib="${SGL_NIXL_MIN_FREE_GIB:-9}"
        "$python" - "$venv" "$need_gib" <<'PY' || exit 1
import os, shutil, sys
path, need = os.path.abspath(sys.argv[1]), float(sys.argv[2])
while not os.path.exists(path):
    path = os.path.dirname(path)
free = shutil.disk_usage(path).free / 2**30
if free < need:
    sys.exit(
        f"setup_env: {free:.1f} GiB free under {path}; a new venv needs about {need:g} GiB. "
        "Free some space, or point VENV at a roomier disk "
        "(SGL_NIXL_MIN_FREE_GIB changes the threshold)."
    )
PY
        echo "setup_env: creating virtualenv $venv" >&2
        "$python" -m venv "$venv"
    fi
    # shellcheck disable=SC1091
    source "$venv/bin/activate"

    echo "setup_env: installing into $venv (quiet; errors are shown)" >&2
    python -m pip install "${pip_q[@]}" -U pip
    # One resolver run for our package, the light set and the real-server set (what real
    # `sglang.launch_server` processes import on top; tests/realserver), so torch lands on
    # SGLang's pin.
    python -m pip install "${pip_q[@]}" -e "$root[test]" \
        -r "$root/ci/requirements-sglang-light.txt" \
        -r "$root/ci/requirements-sglang-server.txt"
    # SGLang's declared dependencies include CUDA-only kernels; we import only its Python layer.
    # The newest supported release (the older ones: ci/run_matrix.sh).
    newest="$(python -c 'from sgl_nixl_plugin.adapter import release_gate; print(release_gate.TESTED_SGLANG)')"
    python -m pip install "${pip_q[@]}" --no-deps "sglang==$newest"
    if ! python -W ignore -c 'import sgl_nixl_plugin, sglang.srt.plugins' >/dev/null; then
        echo "setup_env: the installed packages do not import (see the error above)" >&2
        exit 1
    fi
    echo "setup_env: ready: $(python --version) in $venv" >&2
) || {
    _sgl_nixl_rc=$?
    unset _sgl_nixl_root _sgl_nixl_venv
    echo "setup_env: FAILED (exit $_sgl_nixl_rc)" >&2
    # `return` when sourced, `exit` when run.
    return "$_sgl_nixl_rc" 2>/dev/null || exit "$_sgl_nixl_rc"
}
export NIXL_PLUGIN_CI_VENV_READY="$_sgl_nixl_venv"
fi

# shellcheck disable=SC1091
source "$_sgl_nixl_venv/bin/activate"
unset _sgl_nixl_root _sgl_nixl_venv
