#!/usr/bin/env bash
# Fifteenth session, issue 6 (multi-GPU): the GEMV's weight stream through TMA copies
# (Blocks.gemv_tma, amk bench --gemv-tma 1). Device phases; results go to $OUT.
#   bash scripts/issue6_session15.sh micro   # (nvidia-h200) bench/gemv_tma.py: one 8-warp program per SM,
#                                            # register loads (the megakernel's loop) vs TMA pipelines
#   bash scripts/issue6_session15.sh tma1    # (nvidia-h200) Llama-3.1-8B shape on one GPU: megakernel sweep
#                                            # of TMA box shapes and depths, then the register-load row
#   bash scripts/issue6_session15.sh tp2tma  # (nvidia-h200-x2) amk bench --tp 2 with TMA (TMA_FLAGS, CONFIG)
#                                            # and the HF TP baselines in the same run
#   bash scripts/issue6_session15.sh tp4tma  # (nvidia-h200-x4) the same at tp 4
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
M=config:llama-3.1-8b
# the fourteenth session's fixed sweep flags (bench/configs/llama-3.1-8b-tp2-fr.json's knobs), without
# the GEMV block, its loop and the tile
S="--workers 132 --policy stage --warps 8 --fuse 1 --prefetch 1 --attn-split 4 --prefetch-cap 65536
   --tile-lm-head 128 --late-append 1 --tile-reduce 256 --tokens 64 --tile-qkv 24 --tile-gate-up 56"
TMA_FLAGS="${TMA_FLAGS:---gemv-block 32x256 --gemv-stages 6 --gemv-tma 1 --prefetch 0}"
case "${1:-}" in
micro)
    V="ldg:16x128:8,ldg:16x128:16,tma:16x256:4,tma:16x256:8,tma:64x128:3,tma:64x128:4,tma:64x128:6"
    V="$V,tmaf:16x256:6,tmaf:16x256:8,tmaf:64x128:4,tmaf:32x256:4"
    for k in 4096 7168; do
        python3 bench/gemv_tma.py --k $k --variants $V --json "$OUT/gemv_tma_k$k.json" 2>&1 | grep -v Warn
    done ;;
tma1)
    timeout 400 python3 bench/megakernel_sweep.py $M $S --gemv-tma 1 --w-preload 0 --roll 0 --tile 32 \
        --gemv-block 32x256,64x128 --gemv-stages 4,6 --json "$OUT/tma_tp1.json" 2>&1 | grep -v "warn\|Loading"
    timeout 170 python3 bench/megakernel_sweep.py $M $S --gemv-block 16x128 --unroll 8 --w-preload 1024 \
        --roll 1 --tile 16 --json "$OUT/ldg_tp1.json" 2>&1 | grep -v "warn\|Loading" ;;
tp2tma)
    timeout 590 python3 -m amk bench $M --tp 2 --config "${CONFIG:-bench/configs/llama-3.1-8b-tp2-tma.json}" \
        --num-warps 8 --prefetch 1 --attn-split 4 --tokens 64 --prefetch-cap 65536 $TMA_FLAGS \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp2_tma_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading" ;;
tp4tma)
    timeout 440 python3 -m amk bench $M --tp 4 --config "${CONFIG:-bench/configs/llama-3.1-8b-tp4-fr.json}" \
        --num-warps 8 --prefetch 1 --attn-split 4 --tokens 64 --prefetch-cap 65536 $TMA_FLAGS \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp4_tma_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading" ;;
*)
    echo "usage: $0 micro|tma1|tp2tma|tp4tma" >&2; exit 2 ;;
esac
