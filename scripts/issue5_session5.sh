#!/usr/bin/env bash
# The fifth session's single-GPU experiments (docs/benchmarks.md, "Fifth session"), one phase
# per device call on one H200/H100. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session5.sh bisect   # is the megakernel's GEMV stream bound by DRAM or by
#                                            # the SM side? the probe over an L2-resident W (2 tiles
#                                            # per worker) against a 268 MB W; the plain kernel with
#                                            # row-major vs block-contiguous W; wave and 2 CTAs/SM
#   bash scripts/issue5_session5.sh regcap   # two (three) 8-warp workers per SM, the register cap
#                                            # (Blocks.maxnreg, automatic) letting them co-reside
#   bash scripts/issue5_session5.sh cap1     # one worker per SM, register cap 128 / 168 against
#                                            # ptxas's own choice (the ladder: registers cost 14%)
#   bash scripts/issue5_session5.sh final    # the final amk bench rows with baselines (a), (b),
#                                            # e.g. on an H100 (nvidia-h100-x1)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --gemv-stages 1 --fuse 1 --tokens 64 --tile 16"
S="timeout 280 python3 bench/megakernel_sweep.py"
P="timeout 150 python3 bench/gemv_probe.py --giant"
case "${1:-}" in
bisect)
    for rows in 65536 4224; do
        $P --op norm_gemv --gemv-block 16x128 --unroll 8 --rows $rows --json "$OUT/probe_ng_128u8_r$rows.json"
        $P --op gemv --gemv-block 16x512 --unroll 2 --rows $rows --json "$OUT/probe_g_512u2_r$rows.json"
    done
    for rows in 131072 4224; do
        timeout 200 python3 bench/gemv_stream.py --rows $rows --blocks 16x512,16x128 --per-sm 1,2 --unroll 2 \
            --layout row,tiled --no-ex --json "$OUT/stream_layout_r$rows.json"
    done
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 \
        --wave 0,1 $C --json "$OUT/wave_llama.json"
    $S config:llama-3.2-1b --workers 264 --warps 4 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 \
        $C --json "$OUT/w264_llama.json" ;;
regcap)
    $S config:llama-3.2-1b --workers 132,264 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 \
        $C --json "$OUT/regcap_llama.json"
    $S config:llama-3.2-1b --workers 264,396 --warps 8 --gemv-block 16x512 --unroll 2 --prefetch 1 --attn-split 4 \
        $C --json "$OUT/regcap_llama_512.json"
    $S config:llama-3.2-1b --workers 264 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 \
        --policy balanced --gemv-stages 1 --fuse 1 --tokens 64 --tile 8 --json "$OUT/regcap_llama_t8.json"
    $S config:smollm2-135m --workers 132,264 --warps 8 --gemv-block 16x64 --unroll 8 --prefetch 1 --attn-split 3 \
        $C --json "$OUT/regcap_smol.json" ;;
cap1)
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 \
        --maxnreg 0,128,168 $C --json "$OUT/cap1_llama.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 --prefetch 1 --attn-split 3 \
        --maxnreg 0,128 $C --json "$OUT/cap1_smol.json" ;;
final)  # the fourth session's final amk bench rows (scripts/issue5_final.sh), without its tests;
        # MODES=default,max-autotune-no-cudagraphs adds the stronger (b) (~2-4 more minutes per model)
    B="timeout 560 python3 -m amk bench --baseline-compile-mode ${MODES:-default}"
    $B config:llama-3.2-1b --workers 132 --tile 16 --config bench/configs/llama-3.2-1b.json --num-warps 8 \
        --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 128 --out "$OUT/bench_llama-3.2-1b.json"
    $B config:smollm2-135m --workers 132 --tile 16 --config bench/configs/smollm2-135m.json --num-warps 8 \
        --gemv-block 16x64 --gemv-unroll 8 --prefetch 1 --attn-split 3 --tokens 128 --out "$OUT/bench_smollm2-135m.json" ;;
*)
    echo "usage: $0 bisect|regcap|cap1|final" >&2; exit 2 ;;
esac
