#!/usr/bin/env bash
# Set up the environment (the benchmark drives SGLang's classes, so SGLang is installed too)
# and run the benchmark; arguments go to `sgl-nixl-plugin bench`.
# Until the bench command ships, this runs `sgl-nixl-plugin doctor` instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=ci/setup_env.sh
source ci/setup_env.sh

if python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("sgl_nixl_plugin.cli.bench") is None)'; then
    exec sgl-nixl-plugin bench "$@"
fi
echo "run_bench: the bench command is not available yet; running the doctor instead" >&2
exec sgl-nixl-plugin doctor
