#!/usr/bin/env bash
# The ninth session's experiments (docs/benchmarks.md, "Ninth session"), one phase per device
# call. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session9.sh llama  # (one H200) Llama-3.2-1B shape, 64 tokens: q/k/v tiles
#                                          # of 24 rows (tile_qkv: one round), the GEMV's K-roll
#                                          # (Blocks.kroll) and a row-capped task-ahead prefetch
#                                          # (prefetch_rows 16); then `amk bench` (128 tokens) with
#                                          # the fastest correct row (bench/sweep_best.py) and
#                                          # baselines (a) and both (b) modes in the same run
#   bash scripts/issue5_session9.sh kroll  # (one H200) the K-roll as per-thread line prefetches, kroll
#                                          # 0/1/2/4; then `amk bench` with the fastest row and both (b)
#   bash scripts/issue5_session9.sh stage  # (one H200) the stage placement policy against balanced; then
#                                          # `amk bench` with the fastest row and both (b) modes
#   bash scripts/issue5_session9.sh h100   # (nvidia-h100-x1) both shapes with both (b) modes, best flags;
#                                          # a per-stage profile of the Llama-3.2-1B step
#   bash scripts/issue5_session9.sh smol   # (one H200) SmolLM2 shape: `amk bench` with both (b)
#                                          # modes, the eighth session's flags
#   bash scripts/issue5_session9.sh tp2    # (nvidia-h200-x2) Llama-3.1-8B shape at tp 2 with the
#                                          # HF TP baselines (eager and compiled + graph, both modes)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --fuse 1 --tokens 64 --warps 8 --workers 132"
S="python3 bench/megakernel_sweep.py"
L="config:llama-3.2-1b"; SM="config:smollm2-135m"
B="python3 -m amk bench --baseline-compile-mode default,max-autotune-no-cudagraphs"
# the eighth session's best Llama-3.2-1B flags (sweep form): tile 16, gate/up 32, LM head 128
LS="--tile 16 --tile-gate-up 32 --tile-lm-head 128 --attn-split 4 --gemv-block 16x128 --unroll 8 --prefetch 1
    --w-preload 1024 --roll 1"
BEST_L="--workers 132 --config bench/configs/llama-3.2-1b-qkv24.json --num-warps 8 --gemv-block 16x128 --gemv-unroll 8
    --prefetch 1 --attn-split 4 --tokens 128 --w-preload 1024 --prefetch-cap 65536 --roll 1"
BEST_SM="--workers 132 --config bench/configs/smollm2-135m.json --num-warps 8 --gemv-block 16x64 --gemv-unroll 8
    --prefetch 1 --attn-split 3 --tokens 128 --w-preload 512 --roll 1"
case "${1:-}" in
llama)
    timeout 130 $S $L $LS --prefetch-cap 65536 --tile-qkv 0,24 --kroll 0,2 $C --json "$OUT/qkv_kroll_llama.json"
    timeout 75 $S $L $LS --prefetch-cap 65536 --tile-qkv 24 --kroll 1,4 $C --json "$OUT/kroll2_llama.json"
    timeout 75 $S $L $LS --prefetch-cap 0 --prefetch-rows 16 --tile-qkv 24 --kroll 0,2 $C \
        --json "$OUT/rows_llama.json"
    F=$(python3 bench/sweep_best.py "$OUT"/qkv_kroll_llama.json "$OUT"/kroll2_llama.json "$OUT"/rows_llama.json \
        --config-out "$OUT/best_llama-3.2-1b.json") || exit 1
    echo "best: $F"; cat "$OUT/best_llama-3.2-1b.json"
    timeout 270 $B $L $F --tokens 128 --out "$OUT/bench_llama-3.2-1b.json" ;;
kroll)  # the K-roll rewritten as per-thread 128-byte line prefetches (the bulk prefetch's per-row
        # addresses were serialized in warp 0); then `amk bench` with the fastest correct row
    timeout 150 $S $L $LS --prefetch-cap 65536 --tile-qkv 24 --kroll 0,1,2,4 $C --json "$OUT/kroll_lines_llama.json"
    F=$(python3 bench/sweep_best.py "$OUT"/kroll_lines_llama.json --config-out "$OUT/best_llama-3.2-1b.json") || exit 1
    echo "best: $F"
    timeout 270 $B $L $F --tokens 128 --out "$OUT/bench_kroll_llama-3.2-1b.json" ;;
stage)  # (one H200) the stage placement policy (each stage's tiles balanced among themselves: the
        # balanced policy's whole-step totals put two q/k/v tiles on 12 workers from layer 8 on);
        # then `amk bench` with the fastest correct row and both (b) modes
    C2="--fuse 1 --tokens 64 --warps 8 --workers 132"
    timeout 80 $S $L $LS --prefetch-cap 65536 --tile-qkv 24 --policy balanced,stage $C2 --json "$OUT/stage_llama.json"
    timeout 80 $S $L $LS --prefetch-cap 65536 --tile-qkv 0,32 --policy stage $C2 --json "$OUT/stage2_llama.json"
    F=$(python3 bench/sweep_best.py "$OUT"/stage_llama.json "$OUT"/stage2_llama.json \
        --config-out "$OUT/best_stage_llama-3.2-1b.json") || exit 1
    echo "best: $F"; cat "$OUT/best_stage_llama-3.2-1b.json"
    timeout 270 $B $L $F --tokens 128 --out "$OUT/bench_stage_llama-3.2-1b.json" ;;
h100)  # (nvidia-h100-x1, the issue's reference GPU) both shapes with both (b) modes, then a per-stage
       # profile of the Llama-3.2-1B step with the same flags
    timeout 250 $B $L $BEST_L --out "$OUT/bench_llama-3.2-1b.json"
    timeout 200 $B $SM $BEST_SM --out "$OUT/bench_smollm2-135m.json"
    timeout 100 python3 bench/profile_megakernel.py $L --tile 16 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 \
        --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --fuse --w-preload 1024 --prefetch-cap 65536 \
        --roll 1 --json "$OUT/profile_llama.json" 2>&1 | grep -v Warning ;;
smol)
    timeout 240 $B $SM $BEST_SM --out "$OUT/bench_smollm2-135m.json" ;;
tp2)
    timeout 580 python3 -m amk bench config:llama-3.1-8b --tp 2 --config bench/configs/llama-3.1-8b-qkv24.json \
        --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 64 \
        --w-preload 1024 --prefetch-cap 65536 --roll 1 ${TP_EXTRA:-} \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp2_llama-3.1-8b.json" ;;
*)
    echo "usage: $0 llama|kroll|stage|h100|smol|tp2" >&2; exit 2 ;;
esac
