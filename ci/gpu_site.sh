# Sourced by the GPU scripts that need SGLang (ci/gpu_one_pass.sh, ci/gpu_product_gap.sh):
# install whichever wheel folders this call carried (.whl, .sglwhl; one device call carries
# at most 64 MiB, so the two come in two calls to the same warm machine) into /tmp/site,
# check that nixl and SGLang import, and put this tree, /tmp/site and the GPU stubs on
# PYTHONPATH. The tree comes first: the plugin wheel in /tmp/site (built for its entry
# point) would otherwise shadow the working tree's package in every script.
if ! PYTHONPATH=/tmp/site python3 -c "import nixl, sglang" 2>/dev/null; then
  for d in .whl .sglwhl; do
    if ls $d/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site $d/*.whl || exit 1
    fi
  done
fi
PYTHONPATH=/tmp/site python3 -c "import nixl, sglang" 2>/dev/null || { echo "nixl or sglang missing in /tmp/site"; exit 1; }
export PYTHONPATH=$PWD:/tmp/site:$PWD/ci/gpu_stubs
