#!/usr/bin/env bash
# VRAM end-to-end runs through SGLang's real classes on the lent GPU machine (prefill ranks on
# GPU 0, decode ranks on GPU 1 when two GPUs are present). Not part of CI: CI has no GPU.
#
# The GPU image has torch, Triton, aiohttp, requests and pytest but neither NIXL nor SGLang, and
# no package index. Carry two wheel folders (see docs/benchmarks.md): .whl (nixl-cu13, nixl,
# pyzmq, msgspec) and .sglwhl (sglang for cp312 and the light packages its disaggregation
# layer imports). Every step is bounded by `timeout`; outputs go to the folder given as the
# argument, else $OUT, else /tmp/out (never into the repo).
set -uo pipefail
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
# The two folders together exceed one call's 64 MiB, so they may come in two calls to the same
# (still warm) machine: install whichever is here into the same target.
for d in .whl .sglwhl; do
  if ls $d/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $d/*.whl || exit 1
  fi
done
PYTHONPATH=/tmp/site python3 -c "import nixl, sglang" 2>/dev/null || { echo "nixl or sglang missing in /tmp/site"; exit 1; }
# Our package with its dist-info, so SGLang's load_plugins() discovers the entry point: the
# wheel ci/gpu_wheels.sh put in .sglwhl (installed above), else built here.
if ! ls .sglwhl/sgl_nixl_plugin-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/plugin . || exit 1
fi
export PYTHONPATH=/tmp/plugin:/tmp/site:$PWD/ci/gpu_stubs  # gpu_stubs: see its docstring
export PYTHONUNBUFFERED=1 SGLANG_HOST_IP=127.0.0.1
NGPU=$(nvidia-smi -L | wc -l)
DEC_GPU=$(( NGPU > 1 ? 1 : 0 ))
nvidia-smi -L | tee "$OUT/e2e.txt"
timeout 120 python3 -c "import sitecustomize, sglang.srt.server_args, sglang.srt.disaggregation.common.conn" 2>&1 | tail -4 | tee -a "$OUT/e2e.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "SGLang's disaggregation layer does not import here" | tee -a "$OUT/e2e.txt"; exit 1; }
timeout 120 python3 -c "
from sglang.srt.plugins import load_plugins; load_plugins()
from sglang.srt.disaggregation import utils
print('manager class:', utils.get_kv_class(utils.TransferBackend.NIXL, utils.KVClassType.MANAGER))
" 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/e2e.txt"
RUNS=${GPU_E2E_RUNS:-all}  # e.g. "tp21_p16 tp12_p1 kill": only these
want() { [[ $RUNS == all || " $RUNS " == *" $1 "* ]]; }
run() {  # label, then bench args
  local label=$1; shift
  want "$label" || return 0
  echo "=== $label" | tee -a "$OUT/e2e.txt"
  timeout 240 python3 -m sgl_nixl_plugin bench --mem VRAM --quiet --prefill-gpu 0 --decode-gpu "$DEC_GPU" "$@" \
    2>"$OUT/err_${label}.txt" | tee -a "$OUT/e2e.txt"
  echo "exit $?" | tee -a "$OUT/e2e.txt"
  grep -v -i "warn" "$OUT/err_${label}.txt" | grep -i "error\|Traceback" | head -5 | tee -a "$OUT/e2e.txt"
  # SGLANG_NIXL_PLUGIN_BENCH_LOG=DEBUG: the first rooms' timelines of both sides, and the warm-up
  grep -h "sgl-nixl room\|sgl-nixl decode room\|warm-up WRITE" "$OUT/err_${label}.txt" | head -7 | cut -c1-400 | tee -a "$OUT/e2e.txt"
  # with the bench log at DEBUG: transfer rates from the prefill's room timelines
  python3 benchmarks/room_rates.py "$OUT/err_${label}.txt" | grep -v "no successful" | tee -a "$OUT/e2e.txt"
}
COMMON="--requests 24 --min-tokens 1024 --max-tokens 4096 --concurrency 8"
run tp11_p16 $COMMON --page-size 16
# cold start: one request in flight, first request against the steady state, warm-up on / off
COLD="--requests 16 --min-tokens 4096 --max-tokens 8192 --concurrency 1"
run cold_p16 $COLD --page-size 16
run cold_p1 $COLD --page-size 1
SGLANG_NIXL_PLUGIN_WARMUP=0 run cold_off_p16 $COLD --page-size 16
run cold_c8_p16 --requests 32 --min-tokens 4096 --max-tokens 8192 --concurrency 8 --page-size 16
# decode host-pool destinations (VRAM -> pinned host DRAM) against VRAM -> VRAM, same requests
HOSTW="--requests 16 --min-tokens 4096 --max-tokens 8192 --concurrency 4 --no-state"
run dev_nostate_p16 $HOSTW --page-size 16
run host_p16 $HOSTW --page-size 16 --host-every 1
HOSTW1="--requests 6 --min-tokens 4096 --max-tokens 8192 --concurrency 2 --no-state"
run dev_nostate_p1 $HOSTW1 --page-size 1
run host_p1 $HOSTW1 --page-size 1 --host-every 1
run host_tp21_p16 $HOSTW --page-size 16 --host-every 2 --prefill-tp 2
# pages of different sizes on the two sides (paired token by token) against equal ones,
# same requests; staged (the default path) and direct
PAGESW="--requests 16 --min-tokens 4096 --max-tokens 8192 --concurrency 4 --no-state"
run pages_eq_p16 $PAGESW --page-size 16
run pages_16to64 $PAGESW --page-size 16 --decode-page-size 64
run pages_eq_p64 $PAGESW --page-size 64
run pages_64to16 $PAGESW --page-size 64 --decode-page-size 16
run pages_1to16 $PAGESW --page-size 1 --decode-page-size 16
run pages_16to64_tp12 $PAGESW --page-size 16 --decode-page-size 64 --decode-tp 2
run pages_16to64_host $PAGESW --page-size 16 --decode-page-size 64 --host-every 1
# direct descriptors cost per page run: fewer requests
DIRECTW="--requests 4 --min-tokens 4096 --max-tokens 8192 --concurrency 2 --no-state"
SGLANG_NIXL_PLUGIN_TRANSFER_PATH=direct run pages_eq_p16_direct $DIRECTW --page-size 16
SGLANG_NIXL_PLUGIN_TRANSFER_PATH=direct run pages_16to64_direct $DIRECTW --page-size 16 --decode-page-size 64
run tp11_p1 $COMMON --page-size 1
run tp21_p16 $COMMON --page-size 16 --prefill-tp 2
run tp12_p1 $COMMON --page-size 1 --decode-tp 2
run tp11_mla --preset deepseek-mla --page-size 16 --requests 16 --min-tokens 1024 --max-tokens 4096
export SGLANG_NIXL_PLUGIN_TRANSFER_PATH=direct
run tp11_direct_p16 --requests 8 --min-tokens 1024 --max-tokens 4096 --page-size 16
unset SGLANG_NIXL_PLUGIN_TRANSFER_PATH
if want engine; then  # the engine path, same shape and sizes: what the product path is held to
  echo "=== engine (benchmarks/bench_staging.py, one GPU)" | tee -a "$OUT/e2e.txt"
  timeout 200 python3 benchmarks/bench_staging.py --mem VRAM --send-gpu 0 --recv-gpu "$DEC_GPU" \
    --page-size 1 16 --rows ours --requests 16 --min-tokens 4096 --max-tokens 8192 --budget-s 120 \
    2>"$OUT/err_engine.txt" | sed -n '/^bench_staging summary/,$p' | tee -a "$OUT/e2e.txt"
fi
if want kill; then
  echo "=== prefill killed mid-transfer" | tee -a "$OUT/e2e.txt"
  timeout 200 python3 benchmarks/kill_check.py --mem VRAM --decode-gpu "$DEC_GPU" 2>"$OUT/err_kill.txt" | tee -a "$OUT/e2e.txt"
fi
