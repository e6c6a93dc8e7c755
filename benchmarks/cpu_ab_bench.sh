#!/usr/bin/env bash
# A/B of the main job (`sgl-nixl-plugin bench`, local processes, DRAM) between an older
# tree and this one, page sizes 1 and 16, alternating so drift hits both alike:
#
#     bash benchmarks/cpu_ab_bench.sh OLD_TREE [ROUNDS]
#
# OLD_TREE holds an older release's `sgl_nixl_plugin/` (e.g. `git archive v0.4.1
# sgl_nixl_plugin | tar -x -C .old`); both run in this environment's Python. Prints one
# line per run (the --json summary's throughput and latency).
#
# Each run starts in an empty directory: `python -m` puts the working directory first on
# `sys.path`, so a run started in the repository imports this tree whatever PYTHONPATH says
# (before this was fixed, every "old" run here was the new code). Each side checks which
# package it imports before it runs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OLD=$(cd "$1" && pwd)
ROUNDS=${2:-2}
PY=${PYTHON:-python}
NEW=$PWD
RUN_DIR=$(mktemp -d)
trap 'rm -rf "$RUN_DIR"' EXIT
for tree in "$OLD" "$NEW"; do
    got=$(cd "$RUN_DIR" && PYTHONPATH=$tree "$PY" -c 'import os, sgl_nixl_plugin as p; print(os.path.dirname(os.path.dirname(os.path.realpath(p.__file__))))')
    if [[ $got != "$(realpath "$tree")" ]]; then
        echo "cpu_ab_bench: PYTHONPATH=$tree imports the package from $got, not that tree" >&2
        exit 1
    fi
done
for round in $(seq "$ROUNDS"); do
    for page in 1 16; do
        for side in old new; do
            tree=$NEW
            [[ $side == old ]] && tree=$OLD
            out=$(cd "$RUN_DIR" && PYTHONPATH=$tree timeout 600 "$PY" -m sgl_nixl_plugin bench --page-size "$page" --json --quiet 2>/dev/null)
            echo "round $round page $page $side: $("$PY" -c '
import json, sys
doc = json.loads(sys.argv[1])
d = next(v[0] for v in doc.values() if isinstance(v, list) and v and "gbps" in v[0])
keys = ("gbps", "per_request_gbps_p50", "latency_p50_ms", "latency_p99_ms", "ok", "failed", "corrupt_pages", "path")
print(" ".join(f"{k}={d[k]:.2f}" if isinstance(d[k], float) else f"{k}={d[k]}" for k in keys if k in d))
' "$out" 2>&1 | tail -1)"
        done
    done
done
