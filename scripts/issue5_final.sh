#!/usr/bin/env bash
# Issue 5, fourth session: `amk bench` with baselines (a) and (b) in the same run on both model
# shapes at the session's best megakernel configs (docs/benchmarks.md, "Fourth session"), after
# the GPU tests of this session's changes (split attention, unrolled GEMV; the table-row L1 prefetch
# is on by default). Results go to $OUT
# (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
run() { local t=$1; shift; echo "=== $*"; timeout "$t" "$@"; echo "=== rc=$?"; }
run 150 python3 -m pytest -q -m gpu tests/test_attn_split.py tests/test_triton_megakernel.py -k "split or resident or bf16_model" -x
run 240 python3 -m amk bench config:llama-3.2-1b --workers 132 --tile 16 --config bench/configs/llama-3.2-1b.json \
    --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 128 \
    --baseline-compile-mode default --out "$OUT/bench_llama-3.2-1b.json"
run 200 python3 -m amk bench config:smollm2-135m --workers 132 --tile 16 --config bench/configs/smollm2-135m.json \
    --num-warps 8 --gemv-block 16x64 --gemv-unroll 8 --prefetch 1 --attn-split 3 --tokens 128 \
    --baseline-compile-mode default --out "$OUT/bench_smollm2-135m.json"
