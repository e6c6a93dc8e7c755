#!/usr/bin/env bash
# The older supported SGLang releases (release_gate.CONTRACTS, all but the newest), each against
# the contract, adapter and multi-process tests; the oldest also against the real-server
# stage. The newest release is the base environment's (ci/setup_env.sh) and gets the whole
# suite from ci/run_tests.sh, which runs this script after it.
#
# Each release is an overlay on the base environment: `pip install --no-deps --target
# $VENV/sglang-<release> sglang==<release>`, first on PYTHONPATH, so `import sglang`,
# importlib.metadata and every process a test starts see that release. The releases' Python
# layers import the same light packages (ci/requirements-sglang-light.txt); 0.5.21 pins torch
# 2.13.0, which this CPU environment cannot pair with a torchvision, so it runs on the base's
# torch 2.14.1 (docs/sglang-releases.md).
#
# `bash ci/run_matrix.sh [--gate|--full] [release ...]`: only those releases (all older ones
# by default); extra pytest arguments after --. --gate (the default) runs the tests whose
# outcome depends on the release; --full runs the whole matrix below.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=ci/setup_env.sh
source ci/setup_env.sh

mode=gate
case "${1:-}" in
--gate | --full)
    mode="${1#--}"
    shift
    ;;
esac
wanted=()
while [[ $# -gt 0 && $1 != "--" ]]; do
    wanted+=("$1")
    shift
done
[[ ${1:-} == "--" ]] && shift

read -r -a older <<<"$(python -c 'from sgl_nixl_plugin.adapter import release_gate
print(" ".join(v for v in release_gate.CONTRACTS if v != release_gate.TESTED_SGLANG))')"
oldest="${older[0]}"
[[ ${#wanted[@]} -gt 0 ]] && older=("${wanted[@]}")

xdist=(-n 2 --dist loadfile)
if [[ $mode == gate ]]; then
    # What a release changes: its contract (signatures, KVArgs as its own queues build them,
    # the version gate, the bridge's registration), SGLang's own tests of the backend seam
    # (tests/upstream), the decode's room table under its abort ACKs, and one multi-process
    # PD matrix through its classes; on the oldest, one real-server stack too.
    MATRIX_TESTS=(
        tests/upstream tests/component/test_kvargs_contract.py
        tests/component/test_version_gate.py tests/component/test_bridge.py
        tests/unit/test_adapter_layout.py tests/unit/test_decode_rooms.py
        tests/e2e/test_e2e_pd.py::test_pd_matrix
    )
    OLDEST_TESTS=()
    REALSERVER=(tests/realserver/test_real_server.py::test_pd_output_ids_match_reference[plugin-p1])
else
    MATRIX_TESTS=(
        tests/unit tests/component tests/upstream tests/e2e/test_e2e_pd.py
    )
    # On the oldest release only (the releases between it and the newest compose the same
    # template, and the newest runs everything): host destinations, failure paths,
    # lifecycle, page-size differences and pipeline stages.
    OLDEST_TESTS=(
        tests/e2e/test_host_destination.py
        tests/e2e/test_failures.py tests/e2e/test_lifecycle.py
        tests/e2e/test_page_sizes.py tests/e2e/test_pipeline_parallel.py
    )
    # The real-server stage's plugin configurations and its own checks (the in-tree
    # controls are SGLang's backend, measured on the newest release).
    REALSERVER=(tests/realserver -k "plugin or damaged or setup or never")
fi

rc=0
for release in "${older[@]}"; do
    overlay="$VIRTUAL_ENV/sglang-$release"
    if ! PYTHONPATH="$overlay" python -c "import importlib.metadata as m, sys
sys.exit(m.version('sglang') != '$release')" 2>/dev/null; then
        echo "run_matrix: installing SGLang $release into $overlay" >&2
        rm -rf "$overlay"
        python -m pip install -q --disable-pip-version-check --no-deps --target "$overlay" \
            "sglang==$release"
    fi
    found="$(PYTHONPATH="$overlay" python -c 'import importlib.metadata as m
print(m.version("sglang"))')"
    if [[ $found != "$release" ]]; then
        echo "run_matrix: $overlay gives SGLang $found, not $release" >&2
        rc=1
        continue
    fi
    tests=("${MATRIX_TESTS[@]}")
    [[ $release == "$oldest" ]] && tests+=("${OLDEST_TESTS[@]}")
    echo "run_matrix: SGLang $release: ${tests[*]}" >&2
    t0=$SECONDS
    PYTHONPATH="$overlay" python -m pytest -q -p no:cacheprovider "${xdist[@]}" "${tests[@]}" \
        "$@" || rc=1
    echo "run_matrix: SGLang $release: tests took $((SECONDS - t0))s" >&2
    if [[ $release == "$oldest" ]]; then
        t0=$SECONDS
        echo "run_matrix: SGLang $release: ${REALSERVER[*]}" >&2
        PYTHONPATH="$overlay" python -m pytest -q -p no:cacheprovider "${REALSERVER[@]}" "$@" ||
            rc=1
        echo "run_matrix: SGLang $release: real servers took $((SECONDS - t0))s" >&2
    fi
done
if [[ $rc -ne 0 ]]; then
    echo "run_matrix: a release's tests failed (see above)" >&2
fi
exit "$rc"
