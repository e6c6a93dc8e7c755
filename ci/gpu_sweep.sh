#!/usr/bin/env bash
# Piece-count / slot-size sweep of the staged transfer on the lent GPU machine, in ONE call:
#
#     VARIANTS="base s256 s512 s1024 two" bash ci/gpu_sweep.sh
#
# Each variant runs benchmarks/bench_staging.py (rows ceiling, WRITE, ours; REQ requests, default 20)
# at page sizes 1 and 16 and appends the summary rows to $OUT/sweep.txt (one file: the device
# tool brings back only a few; an argument names another folder). Row "ours" is the product
# through the bench's session: it needs nixl and SGLang in /tmp/site (ci/gpu_site.sh: .whl and
# .sglwhl, two calls). The piece count is the product's own rule (the engine copy of the row
# and its --pipeline-pieces went when the row moved onto the session); slots and buffer come from --slot-mib and
# --staging-mib. docs/benchmarks.md §4 has the results of the 0.3.0 session (raw logs are
# not kept in the repo).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
# shellcheck source=ci/gpu_site.sh
source ci/gpu_site.sh
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
T0=$SECONDS
run() {  # name, then bench args
    local name=$1
    shift
    echo "=== $name" >>"$OUT/sweep.txt"
    echo "=== $name (+$((SECONDS - T0))s): $*"
    timeout -k 5 "${LIM:-100}" python3 benchmarks/bench_staging.py --mem VRAM --page-size 1 16 \
        --requests "${REQ:-20}" --rows ceiling write ours "$@" >"$OUT/$name.log" 2>&1
    echo "rc=$?"
    sed -n '/bench_staging summary/,$p' "$OUT/$name.log" | grep -E "^   [1256] |== page|verify|variant B" |
        cut -c1-700 | tee -a "$OUT/sweep.txt"
    rm -f "$OUT/$name.log"
}
if [[ ${COSTS:-0} == 1 ]]; then
    timeout 120 python3 benchmarks/gpu_host_costs.py 2>&1 | grep -v NIXL | tee "$OUT/costs.txt"
fi
if [[ ${MPS:-0} == 1 ]]; then
    # Both processes as clients of one MPS server (started here, stopped on exit): their
    # kernels and copies may then run at the same time instead of taking turns.
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS server did not start" | tee -a "$OUT/sweep.txt"; exit 1; }
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    echo "=== MPS on" | tee -a "$OUT/sweep.txt"
fi
for v in ${VARIANTS:-base}; do
    case $v in
    base) run base --send-gpu 0 --recv-gpu 0 ;;  # the plugin's defaults
    s128) run s128 --send-gpu 0 --recv-gpu 0 --slot-mib 128 --staging-mib 1024 ;;
    s256) run s256 --send-gpu 0 --recv-gpu 0 --slot-mib 256 ;;
    s512) run s512 --send-gpu 0 --recv-gpu 0 --slot-mib 512 --staging-mib 2048 ;;
    s1024) run s1024 --send-gpu 0 --recv-gpu 0 --slot-mib 1024 --staging-mib 2048 ;;
    two) run two --send-gpu 0 --recv-gpu 1 ;;
    map) run map --send-gpu 0 --recv-gpu 0 --map-units on ;;  # indices read in place
    nomap) run nomap --send-gpu 0 --recv-gpu 0 --map-units off ;;
    abmap) run abmap --send-gpu 0 --recv-gpu 0 --rows ceiling write ours oursb --b-map-units on ;;
    ab512) run ab512 --send-gpu 0 --recv-gpu 0 --rows ceiling write ours oursb --staging-mib 2048 \
        --b-env SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES=536870912 ;;  # B: 512 MiB slots
    full)  # every row (incl. per-page descriptors and plain torch staging), the log kept
        f=${FULL_NAME:-full}
        echo "=== full ($f.log)" >>"$OUT/sweep.txt"
        timeout -k 5 "${FULL_LIM:-330}" python3 benchmarks/bench_staging.py --mem VRAM --page-size 1 16 \
            --send-gpu 0 --recv-gpu 0 --budget-s "${FULL_BUDGET:-300}" --json "$OUT/$f.json" \
            >"$OUT/$f.log" 2>&1
        echo "rc=$?" | tee -a "$OUT/sweep.txt" ;;
    *) echo "unknown variant $v" ;;
    esac
done
echo "sweep done +$((SECONDS - T0))s"
