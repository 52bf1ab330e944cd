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
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
S="python3 bench/megakernel_sweep.py"
L="config:llama-3.2-1b"
# the ninth session's best Llama-3.2-1B flags (profile / sweep form)
PF="--tile 16 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 --gemv-block 16x128 --unroll 8 --prefetch 1
    --attn-split 4 --fuse --w-preload 1024 --prefetch-cap 65536 --roll 1 --all-layers"
LS="--tile 16 --tile-qkv 24 --tile-gate-up 32 --tile-lm-head 128 --gemv-block 16x128 --unroll 8 --prefetch 1
    --w-preload 1024 --prefetch-cap 65536 --roll 1 --fuse 1 --tokens 64 --warps 8 --workers 132"
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
*)
    echo "usage: $0 diag|lmhead" >&2; exit 2 ;;
esac
