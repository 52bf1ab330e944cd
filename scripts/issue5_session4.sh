#!/usr/bin/env bash
# The fourth session's single-GPU experiments (docs/benchmarks.md, "Fourth session"), one phase
# per device call on one H200/H100. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session4.sh unroll   # barrier-free GEMV loop: K blocks below 32 x warps,
#                                            # unrolled 4 / 8 times; attention dot; 2 CTAs or 16 warps
#   bash scripts/issue5_session4.sh rounds   # bytes in flight per task (16x64 u8 .. 16x128 u16) and
#                                            # L2 prefetch of the next task's tile, both shapes
#   bash scripts/issue5_session4.sh profile  # stage timelines: SmolLM2 at 40 and 136 positions,
#                                            # Llama-3.2-1B with the 16x128 unroll-8 GEMV
#   bash scripts/issue5_session4.sh split    # attn_split (attention tasks per KV head), both shapes,
#                                            # 64 and 128 timed tokens
#   bash scripts/issue5_session4.sh split2   # attention position block with the split (one query
#                                            # head per task leaves registers for longer blocks)
#   bash scripts/issue5_session4.sh ladder   # bench/gemv_ladder.py (plain GEMV -> table operands ->
#                                            # opcode dispatch -> stamps) and the megakernel probe
#   bash scripts/issue5_session4.sh rowpf    # the next task's table row prefetched into L1, both
#                                            # shapes at their best flags (128 tokens), and profiled
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --gemv-stages 1 --fuse 1 --tokens 64 --tile 16"
S="timeout 280 python3 bench/megakernel_sweep.py"
case "${1:-}" in
unroll)
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x512 --unroll 2 --att-dot 0 $C \
        --json "$OUT/u_llama_ref.json"
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 4,8 --att-dot 0,1 $C \
        --json "$OUT/u_llama_128.json"
    $S config:llama-3.2-1b --workers 264 --warps 8 --gemv-block 16x128 --unroll 8 --att-dot 1 $C \
        --json "$OUT/u_llama_264.json"
    $S config:llama-3.2-1b --workers 132 --warps 16 --gemv-block 16x256 --unroll 8 --att-dot 1 $C \
        --json "$OUT/u_llama_w16.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x512,16x128,16x64 --unroll 2,8 --att-t 64 $C \
        --json "$OUT/u_smol.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x128 --unroll 8 --att-dot 1 --att-t 64,128 $C \
        --tokens 128 --json "$OUT/u_smol_attdot.json" ;;
rounds)
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 8,16 --prefetch 0,1 $C \
        --json "$OUT/r_llama_128.json"
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 $C \
        --json "$OUT/r_llama_64.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64,16x32 --unroll 8,16 --att-t 64 $C \
        --json "$OUT/r_smol.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 --prefetch 1 --att-t 64 $C \
        --json "$OUT/r_smol_pf.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x512 --unroll 2 --att-t 64,128 $C \
        --tokens 128 --json "$OUT/r_smol_128tok_ref.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 --att-t 64,128 $C \
        --tokens 128 --json "$OUT/r_smol_128tok.json" ;;
profile)
    P="timeout 150 python3 bench/profile_megakernel.py --workers 132 --tile 16 --warps 8 --fuse"
    for n in 40 136; do
        $P config:smollm2-135m --gemv-block 16x64 --unroll 8 --att-t 64 --steps $n \
            --json "$OUT/profile_smol_steps$n.json"
    done
    $P config:llama-3.2-1b --gemv-block 16x128 --unroll 8 --json "$OUT/profile_llama_u8.json" ;;
split)
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 --prefetch 1 --att-t 64 \
        --attn-split 1,3 $C --tokens 128 --json "$OUT/split_smol_128tok.json"
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 \
        --attn-split 1,2,4 $C --tokens 128 --json "$OUT/split_llama_128tok.json" ;;
split2)
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 --prefetch 1 --att-t 32,64,128 \
        --attn-split 3 $C --tokens 128 --json "$OUT/split2_smol_128tok.json"
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 --att-t 32,64 \
        --attn-split 4 $C --tokens 128 --json "$OUT/split2_llama_128tok.json" ;;
ladder)
    timeout 200 python3 bench/gemv_ladder.py --blocks 16x512:2,16x128:8 --json "$OUT/ladder.json"
    for b in 16x512:2 16x128:8; do for p in "--no-profile" ""; do
        timeout 120 python3 bench/gemv_probe.py --op gemv --gemv-block ${b%:*} --unroll ${b#*:} $p \
            --json "$OUT/probe_gemv_${b%:*}${p:+_noprof}.json"
    done; done ;;
rowpf)
    $S config:llama-3.2-1b --workers 132 --warps 8 --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 \
        --row-prefetch 0,1 $C --tokens 128 --json "$OUT/rowpf_llama_128tok.json"
    $S config:smollm2-135m --workers 132 --warps 8 --gemv-block 16x64 --unroll 8 --prefetch 1 --attn-split 3 \
        --row-prefetch 0,1 $C --tokens 128 --json "$OUT/rowpf_smol_128tok.json"
    timeout 150 python3 bench/profile_megakernel.py config:llama-3.2-1b --workers 132 --tile 16 --warps 8 --fuse \
        --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --row-prefetch 1 --json "$OUT/profile_llama_rowpf.json" ;;
*)
    echo "usage: $0 unroll|rounds|profile|split|split2|ladder|rowpf" >&2; exit 2 ;;
esac
