#!/usr/bin/env bash
# A/B of the staging path on the lent GPU: an older tree against this one, in one device
# call, alternating so that drift hits both alike.
#
#     bash benchmarks/gpu_ab_staging.sh OLD_TREE [OUTPUT_DIR]
#
# OLD_TREE holds an older release's `sgl_nixl_plugin/` and its bench_staging.py (at
# OLD_TREE/ci/ or OLD_TREE/benchmarks/), e.g. `git archive v0.4.1 sgl_nixl_plugin
# ci/bench_staging.py | tar -x -C .old` (carry it: the folder is not tracked). .whl/ holds the
# wheels `ci/gpu_wheels.sh` downloads. Output goes to OUTPUT_DIR, else $OUT, else /tmp.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OLD=$(cd "$1" && pwd)
OUT=${2:-${OUT:-/tmp/gpu_ab}}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
OLD_BENCH=$OLD/benchmarks/bench_staging.py
[[ -f $OLD_BENCH ]] || OLD_BENCH=$OLD/ci/bench_staging.py
ARGS=(--mem VRAM --send-gpu 0 --recv-gpu 0 --page-size 1 16 --rows ceiling ours
      --requests ${AB_REQUESTS:-20} --budget-s ${AB_BUDGET_S:-110})
for round in 1 2; do
    for side in old new; do
        if [[ $side == old ]]; then tree=$OLD bench=$OLD_BENCH; else tree=$PWD bench=benchmarks/bench_staging.py; fi
        echo "== round $round: $side ($tree)"
        PYTHONPATH=/tmp/site:$tree timeout -k 10 $((${AB_BUDGET_S:-110} + 40)) \
            python3 "$bench" "${ARGS[@]}" --json "$OUT/$side-$round.json" >"$OUT/$side-$round.log" 2>&1
        echo "exit $?"
        sed -n '/^bench_staging summary/,$p' "$OUT/$side-$round.log"
    done
done
