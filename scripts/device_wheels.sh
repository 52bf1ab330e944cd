#!/usr/bin/env bash
# Download the cp312 wheels the GPU machines' image lacks (it has torch, triton, transformers
# and the NVSHMEM library) into git-ignored folders at the repo root, one folder per need, so
# a device call carries only what it uses (64 MiB a call; docs/gpu-testing.md):
#
#   .whl/        lark, gguf                      every call (schedules, GGUF checkpoints)
#   .whl-nv/     nvshmem4py-cu13 + cuda-python   multi-GPU calls (--tp R over NVSHMEM)
#   .whl-quant/  torchao                         torchao baselines (bench/quant.py)
#   .whl-opt/    optuna                          amk search / tune
#
#   bash scripts/device_wheels.sh [FOLDER ...]   # default: all four
#
# Needs a package index (pip download). --no-deps: only the listed packages, so the image's
# torch and triton stay untouched; the list names each package's needed dependencies itself.
# scripts/device_env.sh installs every carried .whl*/ folder on the GPU machine.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${AMK_PYTHON:-python3}"

declare -A PKGS=(
    [.whl]="lark==1.3.1 gguf==0.19.0"
    [.whl-nv]="nvshmem4py-cu13==0.4.1 cuda-core==1.2.2 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1 cuda-python==13.4.4"
    [.whl-quant]="torchao==0.17.0"
    [.whl-opt]="optuna==5.0.0"
)

folders=("$@")
[ "${#folders[@]}" -gt 0 ] || folders=(.whl .whl-nv .whl-quant .whl-opt)
for f in "${folders[@]}"; do
    if [ -z "${PKGS[$f]+x}" ]; then
        echo "scripts/device_wheels.sh: unknown folder '$f' (one of: ${!PKGS[*]})" >&2
        exit 2
    fi
done
for f in "${folders[@]}"; do
    # shellcheck disable=SC2086  # the package list splits on spaces
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$f" ${PKGS[$f]}
    echo "$f: $(du -sh "$f" | cut -f1)"
done
