#!/usr/bin/env bash
# The third session's single-GPU experiments (docs/benchmarks.md, "Third session"), one phase
# per device call on one H200/H100. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session3.sh stream   # bench/gemv_stream.py: a plain persistent GEMV
#   bash scripts/issue5_session3.sh probe    # bench/gemv_probe.py: the megakernel's GEMV alone
#   bash scripts/issue5_session3.sh workers  # 2 workers per SM (264 x 4 warps) against 132 x 8
#   bash scripts/issue5_session3.sh sync     # wait elision + signal coalescing off/on, profile
#   bash scripts/issue5_session3.sh unroll   # two K blocks per GEMV iteration (--unroll 1,2)
#   bash scripts/issue5_session3.sh next     # not yet run: --attention-dot (larger attention blocks)
#                                            # and 264 x 8-warp workers, which its 128 registers allow
#   bash scripts/issue5_session3.sh final    # = scripts/issue5_final.sh (amk bench + baselines)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --gemv-stages 1 --fuse 1 --tokens 64"
S="python3 bench/megakernel_sweep.py"
case "${1:-}" in
stream)  # gemv_stream_k2048.json (first call) and gemv_stream_ex.json (second) in one sweep
    timeout 400 python3 bench/gemv_stream.py --rows 65536 --blocks 16x1024,8x1024,16x512,8x2048,32x512 \
        --warps 4,8,16 --json "$OUT/gemv_stream.json" ;;
probe)
    for op in norm_gemv gemv; do for g in "" "--giant"; do
        timeout 150 python3 bench/gemv_probe.py --op $op $g --json "$OUT/probe_${op}${g:+_giant}.json"
    done; done ;;
workers)
    $S config:llama-3.2-1b --workers 132 --tile 16 --warps 8 --gemv-block 16x1024 $C --json "$OUT/w_llama_a.json"
    $S config:llama-3.2-1b --workers 264 --tile 16 --warps 4 --gemv-block 16x1024,16x512,8x1024 $C --json "$OUT/w_llama_b.json"
    $S config:llama-3.2-1b --workers 264 --tile 8 --warps 4 --gemv-block 8x1024 $C --json "$OUT/w_llama_c.json"
    $S config:smollm2-135m --workers 132,264 --tile 16 --warps 4 --gemv-block 16x512,16x256 $C --json "$OUT/w_smol_a.json"
    $S config:smollm2-135m --workers 264 --tile 8 --warps 4 --gemv-block 8x512 $C --json "$OUT/w_smol_b.json" ;;
sync)
    timeout 150 python3 bench/profile_megakernel.py config:llama-3.2-1b --workers 132 --tile 16 --warps 8 \
        --gemv-block 16x1024 --policy balanced --fuse --sync-opt 1 --json "$OUT/profile_llama1b_syncopt.json"
    $S config:llama-3.2-1b --workers 132 --tile 16 --warps 8 --gemv-block 16x1024 --sync-opt 0,1 $C --json "$OUT/sync_llama.json"
    $S config:smollm2-135m --workers 132 --tile 16 --warps 8 --gemv-block 16x512 --sync-opt 0,1 --att-t 64 $C \
        --json "$OUT/sync_smol.json" ;;
unroll)
    $S config:llama-3.2-1b --workers 132 --tile 16 --warps 8 --gemv-block 16x1024,16x512 --unroll 1,2 $C \
        --json "$OUT/unroll_llama.json"
    $S config:smollm2-135m --workers 132 --tile 16 --warps 8 --gemv-block 16x512,16x256 --unroll 1,2 --att-t 64 $C \
        --json "$OUT/unroll_smol.json" ;;
next)
    $S config:smollm2-135m --workers 132 --tile 16 --warps 8 --gemv-block 16x512 --unroll 2 --att-dot 0,1 \
        --att-t 64,128 $C --tokens 128 --json "$OUT/attdot_smol.json"
    $S config:llama-3.2-1b --workers 132,264 --tile 16 --warps 8 --gemv-block 16x512 --unroll 2 --att-dot 1 \
        --att-t 64 $C --json "$OUT/attdot_llama.json" ;;
final)
    exec bash scripts/issue5_final.sh ;;
*)
    echo "usage: $0 stream|probe|workers|sync|unroll|next|final" >&2; exit 2 ;;
esac
