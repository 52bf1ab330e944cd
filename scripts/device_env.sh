#!/usr/bin/env bash
# Source on a GPU machine: install the carried wheels (any .whl*/ folder at the repo root)
# into /tmp/site without touching the image's torch/triton/transformers, put amk and them on
# PYTHONPATH, and keep NVLink multicast off (docs/gpu-testing.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
shopt -s nullglob
_w=()
declare -A _seen=()
for f in .whl*/*.whl .gg*/*.whl; do  # one copy of each wheel (pip refuses duplicates)
    b=$(basename "$f"); [ -n "${_seen[$b]:-}" ] && continue; _seen[$b]=1; _w+=("$f")
done
shopt -u nullglob
if [ "${#_w[@]}" -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${_w[@]}" >/dev/null
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
