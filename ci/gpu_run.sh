#!/usr/bin/env bash
# Everything we measure on the lent GPU machine, in ONE device call, from the repo root:
#
#     bash ci/gpu_run.sh [OUTPUT_DIR]
#
# That machine has python3 (3.12), torch (CUDA 13) and triton, but no network and none of
# our other dependencies: .whl/ must hold the wheels of nixl-cu13, nixl, pyzmq and msgspec
# (pluggy too if that machine has no pytest: the benchmark then stubs it, see below).
# Logs, JSON and a summary go to OUTPUT_DIR, else $OUT (the folder that comes back), else
# /tmp/gpu_out: never into the repo (raw logs are not kept there).
# The whole script stays under ~9 minutes: every step has its own `timeout`, and the
# staging benchmarks get what is left of the budget.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${1:-${OUT:-/tmp/gpu_out}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
T0=$SECONDS
END=$((T0 + ${GPU_RUN_BUDGET_S:-530}))  # the staging runs end by then
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

note() { echo "[gpu_run +$((SECONDS - T0))s] $*" | tee -a "$SUMMARY"; }

# step NAME LIMIT_S CMD...: run CMD under a time limit, log to $OUT/NAME.log, note its exit
step() {
    local name=$1 limit=$2
    shift 2
    note "start $name (limit ${limit}s): $*"
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        note "$name: TIMED OUT after ${limit}s"
    fi
    [[ $rc -ne 0 ]] && FAILED=$((FAILED + 1))
    note "end $name: exit $rc"
    return 0
}

python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
note "installed: $(ls .whl | tr '\n' ' ')"
note "tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'no git') $(git status --short 2>/dev/null | wc -l) changed files; $(date -u)"

nvidia-smi 2>&1 | tee "$OUT/nvidia-smi.txt"
nvidia-smi topo -m 2>&1 | tee -a "$OUT/nvidia-smi.txt"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
note "GPUs: $NGPU"

timeout 60 "$PY" - <<'EOF' 2>&1 | tee "$OUT/versions.txt" | tee -a "$SUMMARY"
import importlib.metadata as md, platform
print("python", platform.python_version())
for d in ("torch", "triton", "nixl", "nixl-cu13", "pyzmq", "msgspec", "pluggy", "pytest", "numpy"):
    try:
        print(f"{d} {md.version(d)}")
    except Exception:
        print(f"{d} MISSING")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
          [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except Exception as exc:
    print("torch import failed:", exc)
try:
    from nixl._api import nixl_agent  # noqa: F401
    print("nixl import ok")
except Exception as exc:
    print("nixl import FAILED:", exc)
try:
    import pluggy  # noqa: F401
except ImportError:
    print("pluggy MISSING: sgl_nixl_plugin.registry (imported by engine.agent/engine/staging) "
          "needs it; bench_staging.py stubs it, pytest would have brought it")
EOF

# 1. GPU tests: copy kernels, and staged transfers on VRAM (byte-exact bf16, rooms sharing
#    slots, statuses after scatters, failure mid-transfer); they skip cleanly without CUDA
if [[ ${GPU_RUN_TESTS:-1} != 1 ]]; then
    note "GPU tests skipped (GPU_RUN_TESTS=${GPU_RUN_TESTS})"
elif timeout 60 "$PY" -m pytest --version >/dev/null 2>&1; then
    step pytest_gpu 200 "$PY" -m pytest -q -p no:cacheprovider -rs \
        tests/component/test_copy_kernels.py tests/component/test_staging.py
else
    note "pytest is not installed here: the GPU tests were NOT run (carry wheels of" \
        "pytest, iniconfig, packaging, pluggy, pygments in .whl/ to run them)"
fi
step gpu_host_costs 90 "$PY" benchmarks/gpu_host_costs.py --gpu 0 --peer-gpu 0

# 2. kernel bench (prints its own table; dumps stacks and exits at --timeout)
if [[ ${GPU_RUN_KERNEL_BENCH:-1} != 1 ]]; then
    note "kernel bench skipped (GPU_RUN_KERNEL_BENCH=${GPU_RUN_KERNEL_BENCH})"
elif [[ -f benchmarks/gpu_kernels_bench.py ]]; then
    step gpu_kernels_bench 110 "$PY" benchmarks/gpu_kernels_bench.py --timeout 100
else
    note "benchmarks/gpu_kernels_bench.py: not in this tree, not run"
fi

# 3. staging end to end: one GPU (two processes), then GPU0 -> GPU1 when there are two
RUNS=1
[[ $NGPU -ge 2 ]] && RUNS=2
staging() {
    local name=$1
    shift
    local left=$((END - SECONDS))
    local limit=$((left / RUNS))
    ((limit > 240)) && limit=240
    if ((limit < 60)); then
        note "$name: only ${left}s left, NOT run"
        FAILED=$((FAILED + 1))
        RUNS=$((RUNS - 1))
        return 0
    fi
    # the benchmark's own budget ends before `timeout`: it stops rows early and writes JSON
    # staging sizes: the plugin's VRAM defaults (settings.STAGING_DEFAULTS)
    step "$name" "$limit" "$PY" benchmarks/bench_staging.py --mem VRAM --page-size 1 16 \
        --requests 50 --min-tokens 4096 --max-tokens 8192 \
        --row-budget-s 40 --req-timeout-s 30 --setup-timeout-s 90 \
        --budget-s $((limit - 25)) "$@"
    RUNS=$((RUNS - 1))
}
# rows 5-6 ("ours") run the product through the bench's session: they need SGLang and
# pluggy (ci/gpu_site.sh installs them); without those the engine rows run alone
ROWS=()
if ! "$PY" -c "import sglang, pluggy" >/dev/null 2>&1; then
    ROWS=(--rows ceiling write perpage plain ipc)
    note "no SGLang or pluggy here: bench_staging runs its engine rows only (no 'ours')"
fi
staging staging_1gpu --send-gpu 0 --recv-gpu 0 --json "$OUT/staging_1gpu.json" "${ROWS[@]}"
if [[ $NGPU -ge 2 ]]; then
    staging staging_2gpu --send-gpu 0 --recv-gpu 1 --json "$OUT/staging_2gpu.json" "${ROWS[@]}"
else
    note "one GPU only: the GPU0 -> GPU1 run is skipped"
fi

note "done in $((SECONDS - T0))s; failed steps: $FAILED"
echo "===== summary"
cat "$SUMMARY"
for f in "$OUT"/staging_*.log; do
    [[ -f $f ]] || continue
    echo "===== $(basename "$f")"
    sed -n '/^bench_staging summary/,$p' "$f"
done
[[ $FAILED -eq 0 ]]
