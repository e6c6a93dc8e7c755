#!/usr/bin/env bash
# The first request of a fresh pair on the lent GPU (issues 36 item 6, 37's first-request
# goal), one device call: `sgl-nixl-plugin bench --mem VRAM`, Llama-3.1-8B KV, 20 requests
# of 4-8k tokens one at a time, on the one-pass path (page 16 and 1) and the staged path
# (page 16), each with the decode learning the prefill from its first request and with
# the decode naming it at start-up (--preconnect). The first request's clock starts at
# the decode's request (bench/decode_driver.py, HandshakeClock); the bench prints its handshake parts.
#
#     bash ci/gpu_first_request.sh        # after ci/gpu_site.sh's two-call install
#     ROUNDS=3 GC_TRACE=1 bash ci/gpu_first_request.sh   # each run 3 times; slow GCs logged
#     ONLY='auto-p16-[0-9]' ROUNDS=6 bash ci/gpu_first_request.sh  # runs whose name matches
#     TREES="main= lhw=ab/lhw" ONLY='^auto-p16-[0-9]' ROUNDS=3 bash ci/gpu_first_request.sh
#         # an A/B in one call: each round runs every tree in turn (name=folder holding another
#         # sgl_nixl_plugin package, put first on PYTHONPATH; empty: this tree), e.g. after
#         # mkdir -p ab/lhw && git archive BRANCH sgl_nixl_plugin | tar -x -C ab/lhw
#
# Each run prints the bench's figures, the prefill's setup time of the decode ("set up in",
# from the prefill's INFO log), and where the first request's time went after the
# handshake (`first_request_steps_ms` of `bench --json`: its room's stamps from both sides,
# ms after the decode's send_metadata). GC_TRACE=1 puts ci/gpu_gc_trace first on
# PYTHONPATH: every process then logs its slow garbage collections (`gc-trace` lines) and
# each time a thread of its own woke 30 ms or more late (`late-wake` lines, with the stacks
# of every thread at that moment: what held the interpreter or the host).
# Outputs go to $OUT (first_request.txt: the figures; one JSON and one log per run).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
REPO=$PWD
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
# shellcheck source=ci/gpu_site.sh
source ci/gpu_site.sh
# INFO: the prefill's "connected" line says how long each decode's setup took (link, one-pass
# mapping, warm-up): what a learned decode's first request waits for
export PYTHONUNBUFFERED=1 SGLANG_HOST_IP=127.0.0.1
export SGLANG_NIXL_PLUGIN_BENCH_LOG=${SGLANG_NIXL_PLUGIN_BENCH_LOG:-INFO}
SUMMARY="$OUT/first_request.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$SUMMARY"
if [[ ${GC_TRACE:-0} == 1 ]]; then  # its sitecustomize runs the GPU stubs' after its own
  export PYTHONPATH=$PWD/ci/gpu_gc_trace:$PYTHONPATH
  python3 -c 'import gc, sgl_kernel; print("gc trace on:", bool(gc.callbacks), "stubs:", type(sgl_kernel).__name__)' | tee -a "$SUMMARY"
fi
for run in "auto 16" "auto 1" "staging 16"; do
  set -- $run
  for pre in "" "--preconnect"; do
    for round in $(seq "${ROUNDS:-1}"); do
     for tree in ${TREES:-=}; do
      tag=${tree%%=*} dir=${tree#*=}
      name="$1-p$2${pre:+-pre}-$round${tag:+-$tag}"
      [[ -n ${ONLY:-} && ! $name =~ $ONLY ]] && continue
      echo "== $name: path $1, page $2 ${pre:-(learned at the first request)}${dir:+, tree $dir}" | tee -a "$SUMMARY"
      # from /tmp: `python3 -m` puts the working directory ahead of PYTHONPATH, so run
      # from the repository every tree would be the repository's own package
      (cd /tmp && export PYTHONPATH=${dir:+$REPO/$dir:}$REPO:$PYTHONPATH &&
        python3 -c 'import sgl_nixl_plugin as p; print("package:", p.__file__)' &&
        SGLANG_NIXL_PLUGIN_TRANSFER_PATH=$1 timeout -k 10 150 python3 -m sgl_nixl_plugin \
        bench --mem VRAM --page-size "$2" --concurrency 1 --requests 20 --min-tokens 4096 \
        --max-tokens 8192 --quiet --json $pre >"$OUT/$name.json" 2>"$OUT/$name.log") |
        tee -a "$SUMMARY"
      echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log" "$SUMMARY"
      python3 - "$OUT/$name.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
except (OSError, ValueError, KeyError, IndexError) as exc:
    sys.exit(f"no figures: {exc!r}")
print(f"ok {r['ok']} failed {r['failed']} corrupted {r['corrupt_pages']} path {r['path']}")
print(f"first {r['first_request_ms']:.1f} ms (handshake {r['handshake_ms']:.1f}: "
      + ", ".join(f"{k} {v:.1f}" for k, v in r["handshake_parts_ms"].items())
      + f"), steady p50 {r['steady_p50_ms']:.1f} ms, {r['first_vs_steady_p50']:.2f}x per byte")
print("first request's steps (ms after send_metadata): "
      + ", ".join(f"{k} {v:.1f}" for k, v in r.get("first_request_steps_ms", {}).items()))
PY
      grep -oE "set up in .*|after the reply.*" "$OUT/$name.log" | head -4 | tee -a "$SUMMARY"
      grep -E "gc-trace|late-wake|Error|error" "$OUT/$name.log" | tail -12 | tee -a "$SUMMARY"
     done
    done
  done
done
