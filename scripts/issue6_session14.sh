#!/usr/bin/env bash
# Fourteenth session, issue 6 (multi-GPU): device phases. Results go to $OUT.
#   CONFIG=bench/configs/llama-3.1-8b-tp2-lr.json bash scripts/issue6_session13.sh tp2fr
#                                            # (nvidia-h200-x2) same-run tp 2 bench with late_reduce (ran first)
#   bash scripts/issue6_session14.sh tp4fr   # (nvidia-h200-x4) amk bench --tp 4 with the twelfth session's
#                                            # best tp 4 row (oneshot) plus fuse_reduce, with the HF TP
#                                            # baselines, then the multigpu GPU tests of fuse_reduce
#   bash scripts/issue6_session14.sh lr2     # (nvidia-h200-x2, next session) the thirteenth session's lr2 sweep
#                                            # (late_reduce 0/1 with fuse_reduce) with room for both rows: on a
#                                            # fresh machine the first row's kernel build alone took 149 s and
#                                            # the 330 s budget held only that row
#   bash scripts/issue6_session14.sh prof2fr # (nvidia-h200-x2) per-rank tp 2 profiles of the fuse_reduce row
#                                            # (bench/configs/llama-3.1-8b-tp2-fr.json's knobs)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
M=config:llama-3.1-8b
case "${1:-}" in
tp4fr)
    timeout 440 python3 -m amk bench $M --tp 4 --config "${CONFIG:-bench/configs/llama-3.1-8b-tp4-fr.json}" \
        --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 64 \
        --w-preload 1024 --prefetch-cap 65536 --roll 1 ${EXTRA:-} \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp4_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading"
    timeout 130 bash scripts/device_test.sh tests/test_multigpu_megakernel.py -k "reduce" -x 2>&1 | tail -15 ;;
lr2)  # the thirteenth session's lr2 phase (same flags) with room for both rows
    LR2_S=560 OUT="$OUT" bash scripts/issue6_session13.sh lr2 ;;
prof2fr)  # the thirteenth session's prof2 phase with the fuse_reduce row's knobs
    PROF_S=285 TAG=fr EXTRA="--allreduce fused --lean-release 1 --fuse-reduce" OUT="$OUT" \
        bash scripts/issue6_session13.sh prof2 ;;
*)
    echo "usage: $0 tp4fr|lr2|prof2fr" >&2; exit 2 ;;
esac
