#!/usr/bin/env bash
# Issue 5, third session: `amk bench` with baselines (a) and (b) in the same run on both model
# shapes at the session's best megakernel configs, after the GPU tests of this session's
# changes (co-residency check, two workers per SM, GEMV ops). Results go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
run() { local t=$1; shift; echo "=== $*"; timeout "$t" "$@"; echo "=== rc=$?"; }
run 150 python3 -m pytest -q -m gpu tests/test_triton_megakernel.py -k "resident or two_workers or bf16_model" -x
run 240 python3 -m amk bench config:llama-3.2-1b --workers 132 --tile 16 --config bench/configs/llama-3.2-1b.json \
    --num-warps 8 --gemv-block 16x512 --gemv-unroll 2 --tokens 128 --json "$OUT/bench_llama-3.2-1b.json"
run 200 python3 -m amk bench config:smollm2-135m --workers 132 --tile 16 --config bench/configs/smollm2-135m.json \
    --num-warps 8 --gemv-block 16x512 --gemv-unroll 2 --attention-block 64 --tokens 128 \
    --json "$OUT/bench_smollm2-135m.json"
