#!/usr/bin/env bash
# The tenth session's experiments (docs/benchmarks.md, "Tenth session"), one phase per device
# call. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session10.sh diag   # (one H200) Llama-3.2-1B shape: per-stage profiles of
#                                           # the balanced and stage policies, every layer averaged
#                                           # and the LM head (bench/profile_megakernel.py
#                                           # --all-layers); a 64-token sweep of policy x attn_split
#   bash scripts/issue5_session10.sh lmhead # (one H200) the LM head's argmax tasks after its tiles:
#                                           # sweep of both policies, profile of the stage policy
#   bash scripts/issue5_session10.sh late   # (one H200) late_append x policy sweep, a profile, then
#                                           # `amk bench` with the fastest row and both (b) modes
#   bash scripts/issue5_session10.sh tune   # (one H200) one KV-append task per rank in a worker's slack:
#                                           # Llama and SmolLM2 sweeps, best rows -> configs
#   bash scripts/issue5_session10.sh h100l  # (nvidia-h100-x1) `amk bench` Llama-3.2-1B, tuned config, both
#                                           # (b) modes; h100s: SmolLM2; h200l / h200s: the same on an H200
#   bash scripts/issue5_session10.sh tp2    # (nvidia-h200-x2) Llama-3.1-8B shape at tp 2 with the HF TP
#                                           # baselines, stage policy + late_append + the LM head order
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
S="python3 bench/megakernel_sweep.py"
B="python3 -m amk bench --baseline-compile-mode default,max-autotune-no-cudagraphs"
L="config:llama-3.2-1b"
# the ninth session's best Llama-3.2-1B flags (profile / sweep form)
PF="--tile 16 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 --gemv-block 16x128 --unroll 8 --prefetch 1
    --attn-split 4 --fuse --w-preload 1024 --prefetch-cap 65536 --roll 1 --all-layers"
LS="--tile 16 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 --gemv-block 16x128 --unroll 8 --prefetch 1
    --w-preload 1024 --prefetch-cap 65536 --roll 1 --fuse 1 --tokens 64 --warps 8 --workers 132"
SM="config:smollm2-135m"
# the eighth session's SmolLM2 flags (sweep form; bench/configs/smollm2-135m.json)
SS="--tile 16 --wave 1 --gemv-block 16x64 --unroll 8 --prefetch 1 --attn-split 3 --w-preload 512 --roll 1 --fuse 1 --tokens 64
    --warps 8 --workers 132"
# the tenth session's tuned configs (`tune`), as amk bench flags
BEST_L="--workers 132 --config bench/configs/llama-3.2-1b-late.json --num-warps 8 --gemv-block 16x128 --gemv-unroll 8
    --prefetch 1 --tokens 128 --w-preload 1024 --prefetch-cap 65536 --roll 1"
BEST_SM="--workers 132 --config bench/configs/smollm2-135m-late.json --num-warps 8 --gemv-block 16x64 --gemv-unroll 8
    --prefetch 1 --tokens 128 --w-preload 512 --roll 1"
case "${1:-}" in
diag)
    for p in balanced stage; do
        timeout 110 python3 bench/profile_megakernel.py $L $PF --policy $p --json "$OUT/profile_$p.json" 2>&1 \
            | grep -v Warning
    done
    timeout 150 $S $L $LS --policy balanced,stage --attn-split 1,2,4 --json "$OUT/split_llama.json" ;;
lmhead)  # every LM-head argmax after the rank's tiles (lowering.lower.lm_head): balanced and
         # stage policies, then the stage policy's profile
    timeout 100 $S $L $LS --policy balanced,stage --attn-split 4 --json "$OUT/lmhead_llama.json"
    timeout 110 python3 bench/profile_megakernel.py $L $PF --policy stage --json "$OUT/profile_lmhead_stage.json" 2>&1 \
        | grep -v Warning ;;
late)  # late_append (attention takes pos's k/v from the projections; the appends run beside the
       # o projection) on both policies, with the 88-field task row; then `amk bench` (128 tokens)
       # with the fastest correct row and baselines (a) and both (b) modes
    timeout 150 $S $L $LS --policy balanced,stage --attn-split 4 --late-append 0,1 --json "$OUT/late_llama.json"
    F=$(python3 bench/sweep_best.py "$OUT"/late_llama.json --config-out "$OUT/best_llama-3.2-1b.json") || exit 1
    echo "best: $F"; cat "$OUT/best_llama-3.2-1b.json"
    timeout 110 python3 bench/profile_megakernel.py $L $PF --policy stage --late-append --json "$OUT/profile_late.json" \
        2>&1 | grep -v Warning | tail -16
    timeout 280 $B $L $F --tokens 128 --out "$OUT/bench_llama-3.2-1b.json" ;;
tune)  # (one H200) the rank's KV appends as one task in the least-loaded worker's gate/up slack:
       # Llama-3.2-1B late_append x tile_gate_up x tile_lm_head (stage policy), SmolLM2 late_append x
       # policy; the fastest correct rows become bench configs ($OUT/best_*.json)
    timeout 250 $S $L $LS --policy stage --attn-split 4 --late-append 0,1 --tile-gate-up 32,64 --tile-lm-head 128,256 \
        --json "$OUT/tune_llama.json"
    python3 bench/sweep_best.py "$OUT"/tune_llama.json --config-out "$OUT/best_llama-3.2-1b.json"
    timeout 150 $S $SM $SS --policy balanced,stage --late-append 0,1 --json "$OUT/tune_smol.json"
    python3 bench/sweep_best.py "$OUT"/tune_smol.json --config-out "$OUT/best_smollm2-135m.json" ;;
h100l|h100s|h200l|h200s)  # `amk bench` (128 tokens) of Llama-3.2-1B (l) or SmolLM2 (s) with the tuned
       # configs and baselines (a) and both (b) modes in the same run; the h100 phases on nvidia-h100-x1
    if [ "${1: -1}" = l ]; then
        timeout 420 $B $L $BEST_L --out "$OUT/bench_llama-3.2-1b.json"
    else
        timeout 420 $B $SM $BEST_SM --out "$OUT/bench_smollm2-135m.json"
    fi ;;
tp2)  # (nvidia-h200-x2) Llama-3.1-8B shape at tp 2: the ninth session's tiles with this session's
      # LM head order, stage policy and late_append; HF TP baselines (eager, compiled + graph in both
      # modes) and the one-GPU megakernel in the same run
    timeout 580 python3 -m amk bench config:llama-3.1-8b --tp 2 --config bench/configs/llama-3.1-8b-late.json \
        --num-warps 8 --gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4 --tokens 64 \
        --w-preload 1024 --prefetch-cap 65536 --roll 1 ${TP_EXTRA:-} \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp2_llama-3.1-8b.json" ;;
*)
    echo "usage: $0 diag|lmhead|late|tune|h100l|h100s|h200l|h200s|tp2" >&2; exit 2 ;;
esac
