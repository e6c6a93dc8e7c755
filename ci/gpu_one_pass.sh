#!/usr/bin/env bash
# The one-pass path (CUDA IPC, issue 19) on the lent GPU machine, one device call: its GPU
# tests (the IPC module and kernel, then end to end through SGLang's classes: byte-exact,
# TP and page-size mismatches, host destinations, forbidding it, concurrency, mappings
# closed), then a prefill killed mid-transfer with the decode on the one-pass path.
# The figures come from ci/gpu_product_gap.sh (engine rows "ours ipc", product runs with
# and without SGLANG_NIXL_PLUGIN_TRANSFER_PATH=staging); see docs/benchmarks.md.
#
#     bash ci/gpu_one_pass.sh                 # everything
#     ONE_PASS_RUNS="tests kill" bash ...     # only these steps
#
# Needs /tmp/site with nixl and SGLang (ci/gpu_e2e.sh's two-call install: .whl in one call,
# .sglwhl in the next; either folder found here is installed first). Outputs go to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${1:-${OUT:-/tmp/out}}
mkdir -p "$OUT"
# shellcheck source=ci/gpu_site.sh
source ci/gpu_site.sh
export PYTHONUNBUFFERED=1 SGLANG_HOST_IP=127.0.0.1
LOG="$OUT/one_pass.txt"
echo "=== $(nvidia-smi -L | head -2 | tr '\n' ' ') $(date -u)" | tee -a "$LOG"
python3 -c "import cuda.bindings, triton, torch; print('cuda-bindings', cuda.bindings.__version__, 'triton', triton.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee -a "$LOG"
want() { [[ -z ${ONE_PASS_RUNS:-} || " $ONE_PASS_RUNS " == *" $1 "* ]]; }
if want tests; then
  echo "=== GPU tests" | tee -a "$LOG"
  timeout -k 10 420 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/component/test_cuda_ipc.py tests/component/test_copy_kernels.py tests/e2e/test_one_pass.py \
    >"$OUT/tests.txt" 2>&1
  echo "exit $?" | tee -a "$LOG"
  tail -25 "$OUT/tests.txt" | tee -a "$LOG"
fi
if want kill; then
  echo "=== prefill killed mid-transfer (one-pass path)" | tee -a "$LOG"
  timeout -k 10 150 python3 benchmarks/kill_check.py --mem VRAM --decode-gpu 0 \
    >"$OUT/kill.txt" 2>"$OUT/err_kill.txt"
  echo "exit $?" | tee -a "$LOG"
  tail -8 "$OUT/kill.txt" | tee -a "$LOG"
  grep -h "one-pass" "$OUT/err_kill.txt" | head -3 | cut -c1-300 | tee -a "$LOG"
fi
echo "=== done" | tee -a "$LOG"
