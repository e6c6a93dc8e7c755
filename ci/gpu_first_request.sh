#!/usr/bin/env bash
# The first request of a fresh pair on the lent GPU (issues 36 item 6, 37's first-request
# goal), one device call: `sgl-nixl-plugin bench --mem VRAM`, Llama-3.1-8B KV, 20 requests
# of 4-8k tokens one at a time, on the one-pass path (page 16 and 1) and the staged path
# (page 16), each with the decode learning the prefill from its first request and with
# the decode naming it at start-up (--preconnect). The first request's clock starts at
# the decode's request (bench/decode_driver.py, HandshakeClock); the bench prints its handshake parts.
#
#     bash ci/gpu_first_request.sh        # after ci/gpu_site.sh's two-call install
#
# Outputs go to $OUT (first_request.txt: the figures; one log per run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
# shellcheck source=ci/gpu_site.sh
source ci/gpu_site.sh
export PYTHONUNBUFFERED=1 SGLANG_HOST_IP=127.0.0.1
SUMMARY="$OUT/first_request.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$SUMMARY"
for run in "auto 16" "auto 1" "staging 16"; do
  set -- $run
  for pre in "" "--preconnect"; do
    name="$1-p$2${pre:+-pre}"
    echo "== $name: path $1, page $2 ${pre:-(learned at the first request)}" | tee -a "$SUMMARY"
    SGLANG_NIXL_PLUGIN_TRANSFER_PATH=$1 timeout -k 10 150 python3 -m sgl_nixl_plugin bench \
      --mem VRAM --page-size "$2" --concurrency 1 --requests 20 --min-tokens 4096 \
      --max-tokens 8192 --quiet $pre >"$OUT/$name.log" 2>&1
    echo "exit $?" >>"$OUT/$name.log"
    grep -E "ok / failed|corrupted|p50 / p99|first request|handshake|transfer path|exit|error" \
      "$OUT/$name.log" | tee -a "$SUMMARY"
  done
done
