#!/usr/bin/env bash
# Eleventh session, issue 6 (multi-GPU): device phases on nvidia-h200-x2. Results go to $OUT.
#   bash scripts/issue6_session11.sh prof    # per-rank in-kernel profile of Llama-3.1-8B at tp 2
#                                            # (one process per GPU), one-shot and two-shot all-reduce
#   bash scripts/issue6_session11.sh sweep1  # tp 2 sweep: 16-byte puts/reduces (all rows), tile_reduce
#                                            # x tile_gate_up; then the profile of one row
#   bash scripts/issue6_session11.sh sweep2  # tp 2 sweep (tile_reduce 256): the weight prefetch
#                                            # depth (Blocks prefetch / prefetch_cap)
#   bash scripts/issue6_session11.sh tp2     # (nvidia-h200-x2) amk bench --tp 2 with the HF TP baselines
#   bash scripts/issue6_session11.sh tp4     # (nvidia-h200-x4) amk bench --tp 4 with the HF TP baselines
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
M=config:llama-3.1-8b
# the tenth session's tp 2 flags (bench/configs/llama-3.1-8b-late.json), profiler form
PF="--workers 132 --warps 8 --tile 16 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 --policy stage
    --fuse --late-append --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --w-preload 1024
    --prefetch-cap 65536 --roll 1 --all-layers --steps 12"
case "${1:-}" in
prof)
    for ar in oneshot twoshot; do
        echo "=== $ar"
        timeout 240 python3 bench/profile_megakernel.py $M --tp 2 --spawn $PF --allreduce $ar \
            --json "$OUT/prof_tp2_$ar.json" 2>&1 | grep -v "warn\|Loading"
    done ;;
sweep1)
    timeout 420 python3 bench/megakernel_sweep.py $M --tp 2 --workers 132 --tile 16 --policy stage --warps 8 \
        --gemv-block 16x128 --fuse 1 --prefetch 1 --attn-split 4 --unroll 8 --w-preload 1024 \
        --prefetch-cap 65536 --roll 1 --tile-qkv 24 --tile-lm-head 128 --late-append 1 \
        --tile-reduce 0,256,1024 --tile-gate-up 32,16 --tokens 64 --json "$OUT/sweep1_tp2.json" 2>&1 \
        | grep -v "warn\|Loading"
    timeout 150 python3 bench/profile_megakernel.py $M --tp 2 --spawn $PF --tile-reduce 256 --tile-gate-up 16 \
        --json "$OUT/prof_tp2_reduce256_gu16.json" 2>&1 | grep -v "warn\|Loading" | tail -42 ;;
sweep2)
    C="--tp 2 --workers 132 --tile 16 --policy stage --warps 8 --gemv-block 16x128 --fuse 1 --attn-split 4
       --unroll 8 --w-preload 1024 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 --late-append 1
       --tile-reduce 256 --tokens 64"
    timeout 330 python3 bench/megakernel_sweep.py $M $C --prefetch 1,2 --prefetch-cap 65536,262144 --roll 1 \
        --json "$OUT/sweep2_tp2_prefetch.json" 2>&1 | grep -v "warn\|Loading" ;;
tp2|tp4)  # the tenth session's flags with tile_reduce 256 (tp 4: 16-row q/k/v tiles, 96 of them)
    R=${1#tp}
    timeout 590 python3 -m amk bench $M --tp $R --config bench/configs/llama-3.1-8b-tp$R.json \
        --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 64 \
        --w-preload 1024 --prefetch-cap 65536 --roll 1 \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp${R}_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading" ;;
*)
    echo "usage: $0 prof|sweep1|sweep2|tp2|tp4" >&2; exit 2 ;;
esac
