#!/usr/bin/env bash
# Build the wheel folders the lent GPU machine needs (it has no package index), from the repo
# root, on a machine with pip and network:
#
#     bash ci/gpu_wheels.sh          # .whl: NIXL (CUDA 13), pyzmq, msgspec       (~58 MiB)
#     bash ci/gpu_wheels.sh sglang [release]
#                                    # .sglwhl: SGLang for cp312 (the newest supported release,
#                                    #   or the one given), the light packages its
#                                    #   disaggregation layer imports that the GPU image lacks,
#                                    #   and this checkout as a wheel (rebuild after a change)
#
# Both folders are git-ignored through .git/info/exclude (added here). One device call carries
# at most 64 MiB: send .whl and .sglwhl in two calls to the same warm machine (ci/gpu_e2e.sh
# installs whichever is present). Versions: the GPU image's package list in the device tool's
# KINDS.md (torch, transformers, aiohttp, requests, ... are already there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
grep -qx '/.sglwhl/' .git/info/exclude 2>/dev/null || echo '/.sglwhl/' >>.git/info/exclude
bin=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64)
if [[ ${1:-} == sglang ]]; then
    release=${2:-$(PYTHONPATH=$PWD python3 -c 'from sgl_nixl_plugin.adapter import release_gate
print(release_gate.TESTED_SGLANG)')}
    mkdir -p .sglwhl
    rm -f .sglwhl/sglang-*.whl  # one release at a time (a call carries at most 64 MiB)
    python3 -m pip download -q "${bin[@]}" -d .sglwhl "sglang==$release"
    # pure-Python or binary packages SGLang's server_args / disaggregation imports need and the
    # GPU image does not have (see ci/requirements-sglang-light.txt for why each is there)
    python3 -m pip download -q "${bin[@]}" -d .sglwhl \
        apache-tvm-ffi==0.1.11 orjson pybase64 pydantic pydantic-core annotated-types \
        typing-inspection compressed-tensors gguf dill starlette \
        ipython decorator jedi parso matplotlib-inline traitlets pexpect ptyprocess \
        prompt-toolkit wcwidth stack-data executing asttokens pure-eval ipython-pygments-lexers \
        loguru
    # this checkout, as a wheel: the GPU image's setuptools may predate our pyproject
    rm -f .sglwhl/sgl_nixl_plugin-*.whl
    python3 -m pip wheel -q --no-deps -w .sglwhl .
    du -sh .sglwhl
else
    mkdir -p .whl
    python3 -m pip download -q "${bin[@]}" -d .whl nixl-cu13==1.5.1 pyzmq==27.3.0 msgspec==0.23.0
    python3 -m pip download -q --no-deps -d .whl nixl==1.5.1
    du -sh .whl
fi
