#!/usr/bin/env bash
# The product path against the engine path on the lent GPU machine (issue 16, item 4), one
# device call: benchmarks/bench_staging.py (its row "ours" is the product's staged path
# through the bench's session, timed from the worker's claim to the last scatter; pass
# ENGINE_ARGS="--rows write plain ours" for engine rows beside it) and the product
# (`sgl-nixl-plugin bench --mem VRAM` through SGLang's classes) with per-step timelines of
# both processes on one clock from the product's own stamps (benchmarks/product_timeline.py).
# Same shape and sizes: Llama-3.1-8B, 4-8k tokens, random pages, one GPU for both sides.
#
#     GAP_RUNS="engine t_p16_c1 t_p1_c1" bash ci/gpu_product_gap.sh      # no MPS
#     MPS=1 GAP_RUNS="engine t_p16_c1" bash ci/gpu_product_gap.sh        # both under one MPS server
#     GAP_TAG=label ...                  # names this invocation's runs (default: nomps / mps),
#                                        # for several invocations with different env in one call
#     ENGINE_ARGS="--slot-mib 512" SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES=536870912 ...
#                                        # both sides at another staging slot size
#
# Needs /tmp/site with nixl and SGLang (ci/gpu_e2e.sh's two-call install: .whl in one call,
# .sglwhl in the next; either folder found here is installed first). Outputs go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
T0=$SECONDS
BUDGET=${GAP_BUDGET_S:-540}  # no run starts after this (each has its own timeout too)
# shellcheck source=ci/gpu_site.sh
source ci/gpu_site.sh
export PYTHONUNBUFFERED=1 SGLANG_HOST_IP=127.0.0.1 SGLANG_NIXL_PLUGIN_BENCH_LOG=${BENCH_LOG:-DEBUG}
LOG="$OUT/gap.txt"
TAG=nomps
if [[ ${MPS:-0} == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS server did not start" | tee -a "$LOG"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  TAG=mps
fi
TAG=${GAP_TAG:-$TAG}
echo "=== $TAG, $(nvidia-smi -L | head -1), tree $(git rev-parse --short HEAD 2>/dev/null) $(date -u)" | tee -a "$LOG"
left() { echo $((BUDGET - (SECONDS - T0))); }
SIZES="--mem VRAM --prefill-gpu 0 --decode-gpu 0 --min-tokens 4096 --max-tokens 8192"
timeline() {  # label, limit, then bench args
  local label=${TAG}_$1 limit=$2
  shift 2
  if (( $(left) < limit / 2 )); then echo "=== $label skipped (budget)" | tee -a "$LOG"; return; fi
  echo "=== $label (+$((SECONDS - T0))s): $*" | tee -a "$LOG"
  timeout -k 10 "$limit" python3 benchmarks/product_timeline.py --label "$label" --out "$OUT" \
    $SIZES --quiet --timeout $((limit - 15)) "$@" >"$OUT/$label.txt" 2>"$OUT/err_$label.txt"
  echo "exit $?" | tee -a "$LOG"
  grep -v -i "warn" "$OUT/err_$label.txt" | grep -i "error\|Traceback" | head -5 | cut -c1-300 | tee -a "$LOG"
  grep -v "^SUMMARY" "$OUT/$label.txt" | tee -a "$LOG"
  grep -h "sgl-nixl room\|sgl-nixl decode room" "$OUT/err_$label.txt" | sed -n '2,4p' | cut -c1-400 | tee -a "$LOG"
  python3 benchmarks/room_rates.py "$OUT/err_$label.txt" | grep -v "no successful" | tee -a "$LOG"
}
for r in ${GAP_RUNS:-engine t_p16_c1 t_p1_c1}; do
  case $r in
  engine)
    if (( $(left) < 100 )); then echo "=== engine skipped (budget)" | tee -a "$LOG"; continue; fi
    echo "=== ${TAG}_engine (+$((SECONDS - T0))s): bench_staging.py, one GPU" | tee -a "$LOG"
    timeout -k 10 170 python3 benchmarks/bench_staging.py --mem VRAM --send-gpu 0 --recv-gpu 0 \
      --page-size 1 16 --rows ours --requests 16 --min-tokens 4096 --max-tokens 8192 \
      --budget-s "${ENGINE_BUDGET_S:-110}" --json "$OUT/${TAG}_engine.json" ${ENGINE_ARGS:-} \
      >"$OUT/${TAG}_engine.txt" 2>"$OUT/err_${TAG}_engine.txt"
    echo "exit $?" | tee -a "$LOG"
    sed -n '/^bench_staging summary/,$p' "$OUT/${TAG}_engine.txt" | tee -a "$LOG" ;;
  # the documented product run: 16 requests, one in flight, every byte checked (the page fill)
  v_p16_c1) timeline v_p16_c1 150 --page-size 16 --requests 16 --concurrency 1 ;;
  v_p1_c1) timeline v_p1_c1 150 --page-size 1 --requests 16 --concurrency 1 ;;
  v_p16_c4) timeline v_p16_c4 150 --page-size 16 --requests 24 --concurrency 4 ;;
  # without the check: no page fill on the prefill, no read-back on the decode
  t_p16_c1) timeline t_p16_c1 90 --page-size 16 --requests 24 --concurrency 1 --no-verify ;;
  t_p1_c1) timeline t_p1_c1 90 --page-size 1 --requests 24 --concurrency 1 --no-verify ;;
  t_p16_c4) timeline t_p16_c4 90 --page-size 16 --requests 32 --concurrency 4 --no-verify ;;
  t_p1_c4) timeline t_p1_c4 90 --page-size 1 --requests 32 --concurrency 4 --no-verify ;;
  # the bench's poll loops spinning (no wait between polls)
  s_p16_c1) timeline s_p16_c1 90 --page-size 16 --requests 24 --concurrency 1 --no-verify --poll-wait-us 0 ;;
  s_p1_c1) timeline s_p1_c1 90 --page-size 1 --requests 24 --concurrency 1 --no-verify --poll-wait-us 0 ;;
  # the poll loops as before the status bell: a 0.5 ms sleep between polls, no wake-up
  n_p16_c1) timeline n_p16_c1 90 --page-size 16 --requests 24 --concurrency 1 --no-verify --no-bell ;;
  # the rank processes' GIL switch interval at 0.2 ms instead of Python's 5 ms
  w_p16_c1) timeline w_p16_c1 90 --page-size 16 --requests 24 --concurrency 1 --no-verify --switch-interval-us 200 ;;
  w_p1_c1) timeline w_p1_c1 90 --page-size 1 --requests 24 --concurrency 1 --no-verify --switch-interval-us 200 ;;
  n_p1_c1) timeline n_p1_c1 90 --page-size 1 --requests 24 --concurrency 1 --no-verify --no-bell ;;
  *) echo "unknown run $r" | tee -a "$LOG" ;;
  esac
done
echo "=== done (+$((SECONDS - T0))s)" | tee -a "$LOG"
# at most 8 files come back from a device call: everything but the summary in one archive
tar czf "/tmp/gap_${TAG}_logs.tgz" -C "$OUT" --exclude='*.tgz' --exclude=gap.txt . 
find "$OUT" -mindepth 1 ! -name '*.tgz' ! -name gap.txt -exec rm -rf {} + 2>/dev/null
mv "/tmp/gap_${TAG}_logs.tgz" "$OUT/"
