#!/usr/bin/env bash
# Run the GPU test suite (pytest -m "gpu or multigpu") on a GPU machine without internet.
#
#   bash scripts/device_test.sh [extra pytest args...]
#
# - If .whl/ (or a sibling such as .whlz3/) holds wheels (nvshmem4py, z3-solver, lark, optuna,
#   anthropic, ... carried from a machine with internet), they are installed offline into
#   /tmp/site (AMK_SITE overrides) without touching the image's torch/triton/transformers,
#   and put on PYTHONPATH.
# - amk runs from the source tree (PYTHONPATH=repo root), it is not pip-installed.
# - NVLink multicast/NVLS stays off: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
#   NVSHMEM_DISABLE_NVLS=1 (see docs/gpu-testing.md).
# Exit code: pytest's, except that "no tests collected" (5) counts as success with a notice,
# because early in the project there may be no GPU tests yet.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${AMK_PYTHON:-python3}"
SITE="${AMK_SITE:-/tmp/site}"

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1

shopt -s nullglob
wheels=(.whl/*.whl .whl?*/*.whl)   # .whl/ and sibling folders such as .whlz3/
shopt -u nullglob
if [ "${#wheels[@]}" -gt 0 ]; then
    echo "[device] installing ${#wheels[@]} carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" -m amk doctor || true   # informational; a missing optional package is not fatal here

rc=0
"$PY" -m pytest -ra -m "gpu or multigpu" -p no:cacheprovider "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "[device] no gpu/multigpu tests were collected"
    rc=0
fi
exit "$rc"
