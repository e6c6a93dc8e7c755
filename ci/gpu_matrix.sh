#!/usr/bin/env bash
# Issue 37's measurement matrix on the lent GPU, one device call per MPS mode, same machine:
#
#   kernel   the one-pass kernel alone (benchmarks/gpu_pair_sweep.py at the product's tile),
#            with a second process holding a CUDA context on the GPU all along
#   engine   benchmarks/bench_staging.py rows ceiling (contiguous copy) and ipc (one pass),
#            two processes, page 1 and 16, random pages (its "ours" row is the product's
#            staged path now, measured below as p_staging_*)
#   product  `sgl-nixl-plugin bench --mem VRAM` through SGLang's classes, page 1 and 16, on
#            the one-pass path (auto) and the staged path, one request at a time
#
# Llama-3.1-8B KV, REQ requests (default 50) of 4-8k tokens. Every figure names the card
# (the first line of the summary).
#
#     bash ci/gpu_matrix.sh              # without MPS
#     MPS=1 bash ci/gpu_matrix.sh        # both processes under one MPS server
#     MATRIX_RUNS="kernel engine p_auto_16 p_staging_1_512" REQ=20 bash ci/gpu_matrix.sh
#                                        # p_PATH_PAGE[_MIB]: MIB sets the staging buffer
#
# Needs /tmp/site with nixl and SGLang (ci/gpu_site.sh's two-call install). Outputs go to
# $OUT: matrix_<mode>.txt (the figures), the raw logs in one archive.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
T0=$SECONDS
BUDGET=${MATRIX_BUDGET_S:-540} # no step starts after this (each has its own timeout too)
REQ=${REQ:-50}
# shellcheck source=ci/gpu_site.sh
source ci/gpu_site.sh
export PYTHONUNBUFFERED=1 SGLANG_HOST_IP=127.0.0.1
TAG=nomps
if [[ ${MPS:-0} == 1 ]]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS server did not start"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  TAG=mps
fi
SUM="$OUT/matrix_$TAG.txt"
LOGS="$OUT/logs_$TAG"
mkdir -p "$LOGS"
echo "=== $TAG on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), tree" \
  "$(git rev-parse --short HEAD 2>/dev/null), $REQ requests of 4-8k tokens, $(date -u)" | tee "$SUM"
left() { echo $((BUDGET - (SECONDS - T0))); }
fits() { # name, seconds it needs
  if (($(left) < $2)); then echo "=== $1 skipped: $(left)s of the budget left" | tee -a "$SUM"; return 1; fi
  echo "=== $1 (+$((SECONDS - T0))s)" | tee -a "$SUM"
}

kernel() {
  fits kernel 60 || return
  # a second process holding a context, as the product's decode does beside the prefill
  python3 -c "import time, torch; torch.zeros(1, device='cuda'); time.sleep(120)" &
  local holder=$!
  timeout -k 5 90 python3 benchmarks/gpu_pair_sweep.py --tokens 6144 --tiles 16384 --warps 4 \
    >"$LOGS/kernel.txt" 2>&1
  echo "exit $?" >>"$LOGS/kernel.txt"
  kill "$holder" 2>/dev/null
  wait "$holder" 2>/dev/null
  grep -E "^==|device idx|exit|Error" "$LOGS/kernel.txt" | tee -a "$SUM"
}

engine() {
  fits engine 120 || return
  timeout -k 10 200 python3 benchmarks/bench_staging.py --mem VRAM --send-gpu 0 --recv-gpu 0 \
    --page-size 1 16 --rows ceiling ipc --requests "$REQ" --min-tokens 4096 \
    --max-tokens 8192 --budget-s 170 --json "$LOGS/engine.json" ${ENGINE_ARGS:-} \
    >"$LOGS/engine.txt" 2>"$LOGS/engine.err"
  echo "exit $?" | tee -a "$SUM"
  sed -n '/^bench_staging summary/,$p' "$LOGS/engine.txt" | tee -a "$SUM"
}

product() { # path (auto | staging), page size[, staging buffer MiB]
  local name="p_$1_$2${3:+_$3}"
  fits "$name: sgl-nixl-plugin bench, path $1, page $2${3:+, staging $3 MiB}" 60 || return
  SGLANG_NIXL_PLUGIN_STAGING_BYTES=$((${3:--1} < 0 ? -1 : ${3:-0} << 20)) \
    SGLANG_NIXL_PLUGIN_TRANSFER_PATH=$1 timeout -k 10 150 python3 -m sgl_nixl_plugin bench \
    --mem VRAM --page-size "$2" --concurrency 1 --requests "$REQ" --min-tokens 4096 \
    --max-tokens 8192 --no-verify --quiet >"$LOGS/$name.txt" 2>"$LOGS/$name.err"
  echo "exit $?" >>"$LOGS/$name.txt"
  grep -E "ok / failed|p50 / p99|GB/s|first request|transfer path|staging memory|exit|rror" \
    "$LOGS/$name.txt" | tee -a "$SUM"
}

for r in ${MATRIX_RUNS:-kernel engine p_auto_16 p_auto_1 p_staging_16 p_staging_1}; do
  case $r in
  kernel) kernel ;;
  engine) engine ;;
  p_*_*)
    IFS=_ read -r _ path page mib <<<"$r"
    product "$path" "$page" "$mib"
    ;;
  *) echo "unknown run $r" | tee -a "$SUM" ;;
  esac
done
echo "=== done (+$((SECONDS - T0))s)" | tee -a "$SUM"
# few files come back from a device call: the logs in one archive
tar czf "$OUT/logs_$TAG.tgz" -C "$OUT" "logs_$TAG" && rm -rf "$LOGS"
