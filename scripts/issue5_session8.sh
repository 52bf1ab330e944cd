#!/usr/bin/env bash
# The eighth session's single-GPU experiments (docs/benchmarks.md, "Eighth session"), one
# phase per device call on one H200/H100. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session8.sh preload  # Blocks.w_preload (a GEMV's first weight columns
#                                            # loaded before its waits) on both shapes; the wave
#                                            # knob on Llama-3.2-1B with and without L2 prefetch;
#                                            # a per-stage profile with the preload
#   bash scripts/issue5_session8.sh roll     # the task-ahead L2 prefetch from the row's own fields
#                                            # (table.prefetch_ahead), with the preload; the wave
#                                            # knob with a capped task-ahead prefetch and the GEMV's
#                                            # rolling row-block prefetch (Blocks.prefetch_cap, roll)
#   bash scripts/issue5_session8.sh tiles    # Llama-3.2-1B: per-stage tile rows (the
#                                            # tile_gate_up and tile_lm_head knobs), with and without the
#                                            # rolling prefetch and a capped task-ahead prefetch
#   bash scripts/issue5_session8.sh final    # amk bench rows with baselines (a) and both (b)
#                                            # modes for both shapes, with the best flags found
#   bash scripts/issue5_session8.sh attn     # after the attention change (K/V one block ahead,
#                                            # 16-byte K/V loads): the final flags, amk only
#   bash scripts/issue5_session8.sh tp2      # (nvidia-h200-x2) Llama-3.1-8B shape at tp 2 with the
#                                            # same flags, amk only
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --fuse 1 --tokens 64 --warps 8 --workers 132"
S="timeout 200 python3 bench/megakernel_sweep.py"
PR="timeout 120 python3 bench/profile_megakernel.py"
L="config:llama-3.2-1b"; SM="config:smollm2-135m"
# the best flags found this session, for `amk bench` (phases final and attn)
BEST_SM="--workers 132 --config bench/configs/smollm2-135m.json --num-warps 8 --gemv-block 16x64 --gemv-unroll 8
    --prefetch 1 --attn-split 3 --tokens 128 --w-preload 512 --roll 1"
BEST_L="--workers 132 --config bench/configs/llama-3.2-1b.json --num-warps 8 --gemv-block 16x128 --gemv-unroll 8
    --prefetch 1 --attn-split 4 --tokens 128 --w-preload 1024 --prefetch-cap 65536 --roll 1"
case "${1:-}" in
preload)
    $S $L --tile 16 --attn-split 4 --gemv-block 16x128 --unroll 8 --prefetch 1 --w-preload 0,1024,2048 $C \
        --json "$OUT/preload_llama.json"
    $S $SM --tile 16 --wave 1 --attn-split 3 --gemv-block 16x64 --unroll 8 --prefetch 1 --w-preload 0,512,1024 $C \
        --json "$OUT/preload_smol.json"
    $S $L --tile 16 --wave 1 --attn-split 4 --gemv-block 16x128 --unroll 8 --prefetch 0,1 --w-preload 0,1024 $C \
        --json "$OUT/wave_llama.json"
    $PR $L --tile 16 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --fuse --w-preload 1024 \
        --json "$OUT/profile_llama_preload.json" 2>&1 | grep -v Warning ;;
roll)
    $S $L --tile 16 --attn-split 4 --gemv-block 16x128 --unroll 8 --prefetch 1 --w-preload 0,1024 $C \
        --json "$OUT/ahead_llama.json"
    $S $L --tile 16 --wave 1 --attn-split 4 --gemv-block 16x128 --unroll 8 --prefetch 1 --prefetch-cap 0,65536 \
        --roll 0,1 $C --json "$OUT/roll_llama.json"
    $S $SM --tile 16 --wave 1 --attn-split 3 --gemv-block 16x64 --unroll 8 --prefetch 1 --w-preload 0,512,1024 \
        --roll 0,1 $C --json "$OUT/roll_smol.json" ;;
tiles)
    T="--tile 16 --attn-split 4 --gemv-block 16x128 --unroll 8 --prefetch 1 --w-preload 1024"
    $S $L $T --tile-gate-up 0,32 --tile-lm-head 0,64 $C --json "$OUT/tiles_llama.json"
    $S $L $T --tile-gate-up 32,64 --tile-lm-head 64,128 --roll 1 --prefetch-cap 65536 $C \
        --json "$OUT/tiles_roll_llama.json" ;;
final)
    B="python3 -m amk bench --baseline-compile-mode default,max-autotune-no-cudagraphs"
    timeout 230 $B $SM $BEST_SM --out "$OUT/bench_smollm2-135m.json"
    timeout 240 $B $L $BEST_L --out "$OUT/bench_llama-3.2-1b.json" ;;
attn)  # the final rows' flags after the attention change (K/V blocks loaded one block ahead,
       # 16-byte K/V loads), amk only
    B="python3 -m amk bench --no-baselines"
    timeout 150 $B $SM $BEST_SM --out "$OUT/attn_smollm2-135m.json"
    timeout 150 $B $L $BEST_L --out "$OUT/attn_llama-3.2-1b.json" ;;
tp2)  # issue 6 on nvidia-h200-x2: the eighth session's flags at tp 2, amk only (no device time
      # was left for the baselines)
    timeout 400 python3 -m amk bench config:llama-3.1-8b --tp 2 --config bench/configs/llama-3.1-8b-tiles.json \
        --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 64 \
        --w-preload 1024 --prefetch-cap 65536 --roll 1 --no-baselines --out "$OUT/bench_tp2_llama-3.1-8b_amk_only.json" ;;
*)
    echo "usage: $0 preload|roll|tiles|final|attn|tp2" >&2; exit 2 ;;
esac
