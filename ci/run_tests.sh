#!/usr/bin/env bash
# The test tiers (README, "Development"; what each runs: docs/testing.md):
#
#   bash ci/run_tests.sh           the gate (CI): lint, the suite on the newest SGLang less the
#                                  tests marked `full`, one real-server stack per feature, and
#                                  the release-dependent tests on the older releases
#   bash ci/run_tests.sh --quick   the inner loop: lint, unit, component, one multi-process e2e
#   bash ci/run_tests.sh --full    everything: every real-server combination and control, the
#                                  older releases on the whole matrix, 45 s chaos soaks
#   bash ci/run_tests.sh ARGS...   pytest ARGS on the newest release only (e.g. -k bridge)
#
# Every stage runs, whatever an earlier one did; each prints its duration, and the exit code
# is non-zero if any failed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

mode=gate
case "${1:-}" in
--quick | --full | --gate)
    mode="${1#--}"
    shift
    ;;
esac
if [[ $# -gt 0 ]]; then
    mode=args
fi

started=$SECONDS
summary=()
failed=0
# stage NAME COMMAND...: run it, time it, remember how it went.
stage() {
    local name=$1 t0=$SECONDS rc=0
    shift
    echo "run_tests: stage '$name' starts" >&2
    "$@" || rc=$?
    if [[ $rc -eq 5 ]]; then
        echo "run_tests: pytest collected no tests in stage '$name'; that is a failure" >&2
    fi
    local line
    line="$(printf '%-34s %-6s %5ds' "$name" "$([[ $rc -eq 0 ]] && echo ok || echo FAILED)" \
        $((SECONDS - t0)))"
    echo "run_tests: $line" >&2
    summary+=("$line")
    [[ $rc -eq 0 ]] || failed=1
}

# shellcheck source=ci/setup_env.sh
t0=$SECONDS
source ci/setup_env.sh
summary+=("$(printf '%-34s %-6s %5ds' "setup (install)" ok $((SECONDS - t0)))")

pytest_q=(python -m pytest -q -p no:cacheprovider)
# Two workers on CI's 2 cores: most of the suite waits on sockets, processes and deadlines.
xdist=(-n 2 --dist loadfile)

lint() {
    local rc=0
    ruff check . || rc=$?
    ruff format --check . || rc=$?
    return "$rc"
}

suite=(tests/unit tests/component tests/upstream tests/e2e)
case "$mode" in
quick)
    stage lint lint
    stage "quick: unit, component, one e2e" "${pytest_q[@]}" "${xdist[@]}" --durations=10 -m "not full" \
        tests/unit tests/component tests/e2e/test_e2e_pd.py::test_pd_matrix
    ;;
args)
    stage lint lint
    stage "pytest $*" "${pytest_q[@]}" --durations=25 "$@"
    ;;
gate)
    stage lint lint
    # The chaos soaks run 15 s each here; the full run keeps their 45 s default.
    stage "newest: suite" env SGLANG_NIXL_PLUGIN_CHAOS_S="${SGLANG_NIXL_PLUGIN_CHAOS_S:-15}" \
        "${pytest_q[@]}" "${xdist[@]}" --durations=15 -m "not full" "${suite[@]}"
    stage "newest: real servers" "${pytest_q[@]}" --durations=10 -m "not full" tests/realserver
    stage "older releases" bash ci/run_matrix.sh --gate
    ;;
full)
    stage lint lint
    stage "newest: suite" "${pytest_q[@]}" "${xdist[@]}" --durations=25 "${suite[@]}"
    stage "newest: real servers" "${pytest_q[@]}" --durations=20 tests/realserver
    stage "older releases" bash ci/run_matrix.sh --full
    ;;
esac

echo "run_tests: $mode run, stage by stage:" >&2
for line in "${summary[@]}"; do
    echo "  $line" >&2
done
echo "  $(printf '%-34s %-6s %5ds' total "$([[ $failed -eq 0 ]] && echo ok || echo FAILED)" \
    $((SECONDS - started)))" >&2
exit "$failed"
