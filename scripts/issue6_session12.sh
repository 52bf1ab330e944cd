#!/usr/bin/env bash
# Twelfth session, issue 6 (multi-GPU): device phases. Results go to $OUT.
#   bash scripts/issue6_session12.sh tiles   # (nvidia-h200-x4) tile sizes that fill whole rounds of the
#                                            # 132 workers: tp 2 sweep (GPUs 0,1), then a tp 4 sweep
#   bash scripts/issue6_session12.sh fused2  # (nvidia-h200-x2) tp 2 sweep: the all-reduce's peer stores
#                                            # fused into the GEMV tiles (allreduce fused) vs oneshot
#   bash scripts/issue6_session12.sh tp2     # (nvidia-h200-x2) amk bench --tp 2 with the HF TP baselines
#                                            # (CONFIG: a bench/configs file, default the fused tp 2 one)
#   EXTRA="--lean-release 1" bash scripts/issue6_session12.sh tp2|tp4   # the same with Blocks.lean_release
#   bash scripts/issue6_session12.sh tp4     # (nvidia-h200-x4) tp 4 sweep oneshot vs fused, then amk bench
#                                            # --tp 4 with the fastest correct row and the HF TP baselines
#   bash scripts/issue6_session12.sh prof4   # (nvidia-h200-x4) per-rank profiles at tp 4, oneshot vs fused
#   bash scripts/issue6_session12.sh lean4   # (nvidia-h200-x4) tp 4 sweep: Blocks.lean_release (one thread-0
#                                            # fence, relaxed peer signals) with fused and oneshot
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
M=config:llama-3.1-8b
# the eleventh session's fixed flags (bench/configs/llama-3.1-8b-tp2.json, sweep form)
S="--workers 132 --policy stage --warps 8 --gemv-block 16x128 --fuse 1 --prefetch 1 --attn-split 4
   --unroll 8 --w-preload 1024 --prefetch-cap 65536 --roll 1 --tile-lm-head 128 --late-append 1
   --tile-reduce 256 --tokens 64"
case "${1:-}" in
tiles)
    echo "=== tp 2"
    CUDA_VISIBLE_DEVICES=0,1 timeout 290 python3 bench/megakernel_sweep.py $M --tp 2 $S --tile-qkv 24 \
        --tile 16,32 --tile-gate-up 32,28,56 --json "$OUT/tiles_tp2.json" 2>&1 | grep -v "warn\|Loading"
    echo "=== tp 4"
    timeout 200 python3 bench/megakernel_sweep.py $M --tp 4 $S --tile 16 --tile-qkv 0,12 \
        --tile-gate-up 32,28 --json "$OUT/tiles_tp4.json" 2>&1 | grep -v "warn\|Loading"
    timeout 80 python3 bench/megakernel_sweep.py $M --tp 4 $S --tile 32 --tile-qkv 12 \
        --tile-gate-up 28 --json "$OUT/tiles_tp4_t32.json" 2>&1 | grep -v "warn\|Loading" ;;
fused2)
    timeout 330 python3 bench/megakernel_sweep.py $M --tp 2 $S --tile-qkv 24 --tile-gate-up 56 \
        --tile 16,32 --allreduce oneshot,fused --json "$OUT/fused_tp2.json" 2>&1 | grep -v "warn\|Loading" ;;
tp2)
    timeout 590 python3 -m amk bench $M --tp 2 --config "${CONFIG:-bench/configs/llama-3.1-8b-tp2-fused.json}" \
        --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 64 \
        --w-preload 1024 --prefetch-cap 65536 --roll 1 ${EXTRA:-} \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp2_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading" ;;
tp4)
    timeout 150 python3 bench/megakernel_sweep.py $M --tp 4 $S --tile 32 --tile-qkv 12 --tile-gate-up 28 \
        --allreduce oneshot,fused ${EXTRA:-} --json "$OUT/fused_tp4.json" 2>&1 | grep -v "warn\|Loading"
    F=$(python3 bench/sweep_best.py "$OUT/fused_tp4.json" --config-out "$OUT/best_tp4.json") || exit 1
    echo "best: $F"; cat "$OUT/best_tp4.json"
    timeout 420 python3 -m amk bench $M --tp 4 $F --tokens 64 \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp4_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading" ;;
prof4)
    P="--workers 132 --warps 8 --tile 32 --tile-qkv 12 --tile-gate-up 28 --tile-lm-head 128 --policy stage
       --fuse --late-append --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --w-preload 1024
       --prefetch-cap 65536 --roll 1 --tile-reduce 256 --all-layers --steps 12"
    for ar in oneshot fused; do
        echo "=== $ar"
        timeout 150 python3 bench/profile_megakernel.py $M --tp 4 --spawn $P --allreduce $ar \
            --json "$OUT/prof_tp4_$ar.json" 2>&1 | grep -v "warn\|Loading" | tail -45
    done ;;
lean4)
    timeout 230 python3 bench/megakernel_sweep.py $M --tp 4 $S --tile 32 --tile-qkv 12 --tile-gate-up 28 \
        --allreduce fused,oneshot --lean-release 1,0 --json "$OUT/lean_tp4.json" 2>&1 | grep -v "warn\|Loading" ;;
*)
    echo "usage: $0 tiles|fused2|tp2|tp4|prof4|lean4" >&2; exit 2 ;;
esac
