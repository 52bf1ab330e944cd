#!/usr/bin/env bash
# The seventh session's single-GPU experiments (docs/benchmarks.md, "Seventh session"), one
# phase per device call on one H200/H100. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session7.sh survey   # per-stage profiles of both shapes with the sixth
#                                            # session's defaults, then a re-sweep of the knobs
#                                            # last measured while every GEMV load was 2 bytes
#                                            # (GEMV pipeline depth, 2 workers per SM, wave, block)
#   bash scripts/issue5_session7.sh reuse    # Blocks.x_reuse off/on (a GEMV skips the x pass the
#                                            # worker's previous task staged), L2 prefetch depth,
#                                            # tile 32; then the per-stage profile with reuse
#   bash scripts/issue5_session7.sh chunk    # Blocks.x_chunk (the x pass in one load), and the
#                                            # wave knob at tile 8 (one round of q/k/v tiles)
#   bash scripts/issue5_session7.sh final    # SmolLM2: the wave knob with gate and up tiles
#                                            # apart vs the old default; then amk bench rows with
#                                            # baselines (a) and both (b) modes for both shapes
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --fuse 1 --tokens 64 --warps 8 --prefetch 1"
S="timeout 240 python3 bench/megakernel_sweep.py"
PR="timeout 120 python3 bench/profile_megakernel.py"
L="config:llama-3.2-1b"; SM="config:smollm2-135m"
case "${1:-}" in
survey)
    $PR $L --tile 16 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --fuse \
        --json "$OUT/profile_llama.json" 2>&1 | grep -v Warning
    $PR $SM --tile 16 --gemv-block 16x64 --unroll 8 --prefetch 1 --attn-split 3 --fuse \
        --json "$OUT/profile_smol.json" 2>&1 | grep -v Warning
    $S $L --tile 16 --attn-split 4 --gemv-block 16x128 --unroll 8 --workers 132,264 --gemv-stages 1,3 $C \
        --json "$OUT/resweep_llama_a.json"
    $S $L --tile 16 --attn-split 4 --gemv-block 16x256,16x512 --unroll 4,2 --workers 132 --gemv-stages 1 \
        --wave 0,1 $C --json "$OUT/resweep_llama_b.json"
    $S $SM --tile 16 --attn-split 3 --gemv-block 16x64 --unroll 8 --workers 132,264 --gemv-stages 1,3 \
        --wave 0,1 $C --json "$OUT/resweep_smol.json" ;;
reuse)
    $S $L --tile 16 --attn-split 4 --gemv-block 16x128 --unroll 8 --workers 132 --gemv-stages 1 \
        --x-reuse 0,1 $C --json "$OUT/reuse_llama.json"
    $S $L --tile 16,32 --attn-split 4 --gemv-block 16x128 --unroll 8 --workers 132 --gemv-stages 1 \
        $C --prefetch 1,2,3 --json "$OUT/prefetch_llama.json"
    $S $SM --tile 16 --attn-split 3 --gemv-block 16x64 --unroll 8 --workers 132 --gemv-stages 1 \
        --x-reuse 0,1 --wave 0,1 $C --json "$OUT/reuse_smol.json"
    $PR $L --tile 16 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --fuse \
        --json "$OUT/profile_llama_reuse.json" 2>&1 | grep -v Warning ;;
chunk)
    $S $L --tile 16 --attn-split 4 --gemv-block 16x128 --unroll 8 --x-chunk 1,8192 $C \
        --json "$OUT/chunk_llama.json"
    # (the seventh session's run lacked --workers 132 here and also timed 32 and 66 workers)
    $S $L --tile 8 --wave 1 --attn-split 4 --gemv-block 16x128,8x128 --unroll 8 --workers 132 $C \
        --json "$OUT/wave8_llama.json"
    $S $SM --tile 8,16 --wave 0,1 --attn-split 3 --gemv-block 16x64,8x128 --unroll 8 --workers 132 $C \
        --json "$OUT/wave8_smol.json"
    $PR $SM --tile 8 --wave --gemv-block 16x64 --unroll 8 --prefetch 1 --attn-split 3 --fuse \
        --json "$OUT/profile_smol_wave8.json" 2>&1 | grep -v Warning ;;
final)
    timeout 110 python3 bench/megakernel_sweep.py $SM --workers 132 --tile 16,8 --wave 0,1 --attn-split 3 \
        --gemv-block 16x64 --unroll 8 --policy balanced --fuse 1 --tokens 64 --warps 8 --prefetch 1 \
        --json "$OUT/split_smol.json"
    B="python3 -m amk bench --baseline-compile-mode default,max-autotune-no-cudagraphs"
    timeout 230 $B $SM --workers 132 --config bench/configs/smollm2-135m.json --num-warps 8 \
        --gemv-block 16x64 --gemv-unroll 8 --prefetch 1 --attn-split 3 --tokens 128 \
        --out "$OUT/bench_smollm2-135m.json"
    timeout 240 $B $L --workers 132 --config bench/configs/llama-3.2-1b.json --num-warps 8 \
        --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 128 \
        --out "$OUT/bench_llama-3.2-1b.json" ;;
*)
    echo "usage: $0 survey|reuse|chunk|final" >&2; exit 2 ;;
esac
