#!/usr/bin/env bash
# Set up the environment (ci/setup_env.sh), lint, run the whole test suite on the newest
# supported SGLang release, then the older releases' matrix (ci/run_matrix.sh).
# Extra arguments go to pytest and skip the matrix, e.g. `bash ci/run_tests.sh -k bridge`.
# Every stage runs; the exit code is non-zero if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=ci/setup_env.sh
source ci/setup_env.sh

lint_rc=0
ruff check . || lint_rc=$?
ruff format --check . || lint_rc=$?

test_rc=0
python -m pytest -q -p no:cacheprovider --durations=25 "$@" || test_rc=$?
if [[ $test_rc -eq 5 ]]; then
    echo "run_tests: pytest collected no tests; that is a failure" >&2
fi

matrix_rc=0
if [[ $# -eq 0 ]]; then
    bash ci/run_matrix.sh || matrix_rc=$?
fi

if [[ $lint_rc -ne 0 ]]; then
    echo "run_tests: ruff check / ruff format --check failed (exit $lint_rc)" >&2
fi
if [[ $test_rc -ne 0 ]]; then
    exit "$test_rc"
fi
if [[ $matrix_rc -ne 0 ]]; then
    exit "$matrix_rc"
fi
exit "$lint_rc"
