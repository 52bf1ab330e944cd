#!/usr/bin/env bash
# Thirteenth session, issue 6 (multi-GPU): device phases. Results go to $OUT.
#   bash scripts/issue6_session13.sh lean2   # (nvidia-h200-x2) tp 2 sweep: Blocks.lean_release 0/1 with the
#                                            # fused all-reduce (and one-shot with it), then per-rank profiles
#                                            # of the fused + lean row
#   EXTRA=... bash scripts/issue6_session13.sh prof2   # (nvidia-h200-x2) per-rank tp 2 profiles only
#   bash scripts/issue6_session13.sh fr2     # (nvidia-h200-x2) tp 2 sweep: fuse_reduce 0/1 (fused all-reduce,
#                                            # lean_release), then amk bench --tp 2 with the fastest correct
#                                            # row and the HF TP baselines (one call, ~9 min; the 140 s
#                                            # sweep budget held only its first row on the device)
#   bash scripts/issue6_session13.sh frsweep # (nvidia-h200-x2) the fr2 sweep alone
# Built after the device time ran out; run in the fourteenth session (scripts/issue6_session14.sh):
#   bash scripts/issue6_session13.sh lr2     # (nvidia-h200-x2) tp 2 sweep: late_reduce 0/1 with fuse_reduce
#   CONFIG=... bash scripts/issue6_session13.sh tp2fr   # (nvidia-h200-x2) amk bench --tp 2 with the HF TP
#                                            # baselines (default config: llama-3.1-8b-tp2-fr.json)
#   bash scripts/issue6_session13.sh fr4     # (nvidia-h200-x4) tp 4 sweep oneshot/fused x late_reduce 0/1
#                                            # with fuse_reduce, then amk bench --tp 4 with the best row
# The same-run benches with the HF TP baselines: scripts/issue6_session12.sh tp2 / tp4 (EXTRA flags).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
M=config:llama-3.1-8b
# bench/configs/llama-3.1-8b-tp2-fused.json in sweep form, with the twelfth session's fixed flags
S="--workers 132 --policy stage --warps 8 --gemv-block 16x128 --fuse 1 --prefetch 1 --attn-split 4
   --unroll 8 --w-preload 1024 --prefetch-cap 65536 --roll 1 --tile-lm-head 128 --late-append 1
   --tile-reduce 256 --tokens 64 --tile 16 --tile-qkv 24 --tile-gate-up 56"
P="--workers 132 --warps 8 --tile 16 --tile-qkv 24 --tile-gate-up 56 --tile-lm-head 128 --policy stage
   --fuse --late-append --gemv-block 16x128 --unroll 8 --prefetch 1 --attn-split 4 --w-preload 1024
   --prefetch-cap 65536 --roll 1 --tile-reduce 256 --all-layers --steps 12"
prof2() {  # PROF_S: its time budget in seconds (default 150)
    timeout "${PROF_S:-150}" python3 bench/profile_megakernel.py $M --tp 2 --spawn $P ${EXTRA:-} \
        --json "$OUT/prof_tp2_$1.json" 2>&1 | grep -v "warn\|Loading" | tail -45
}
# fr_sweep SECONDS: the tp 2 sweep of fuse_reduce 0/1 (fused all-reduce, lean_release)
fr_sweep() {
    timeout "$1" python3 bench/megakernel_sweep.py $M --tp 2 $S --allreduce fused --lean-release 1 \
        --fuse-reduce 0,1 --json "$OUT/fr_tp2.json" 2>&1 | grep -v "warn\|Loading"
}
# best_bench R SWEEP_JSON SECONDS: amk bench --tp R with the sweep's fastest correct row and
# the HF TP baselines
best_bench() {
    F=$(python3 bench/sweep_best.py "$2" --config-out "$OUT/best_tp$1.json") || exit 1
    echo "best: $F"; cat "$OUT/best_tp$1.json"
    timeout "$3" python3 -m amk bench $M --tp "$1" $F --tokens 64 \
        --baseline-compile-mode default,max-autotune-no-cudagraphs --out "$OUT/bench_tp$1_llama-3.1-8b.json" \
        2>&1 | grep -v "warn\|Loading"
}
case "${1:-}" in
lean2)
    timeout 240 python3 bench/megakernel_sweep.py $M --tp 2 $S --allreduce fused --lean-release 0,1 \
        --json "$OUT/lean_tp2.json" 2>&1 | grep -v "warn\|Loading"
    timeout 100 python3 bench/megakernel_sweep.py $M --tp 2 $S --allreduce oneshot --lean-release 1 \
        --json "$OUT/lean_tp2_oneshot.json" 2>&1 | grep -v "warn\|Loading"
    EXTRA="--allreduce fused --lean-release 1" prof2 fused_lean ;;
frsweep)
    fr_sweep 330 ;;
fr2)
    fr_sweep 140
    best_bench 2 "$OUT/fr_tp2.json" 445 ;;
lr2)  # LR2_S: the sweep's time budget in seconds (default 330)
    timeout "${LR2_S:-330}" python3 bench/megakernel_sweep.py $M --tp 2 $S --allreduce fused --fuse-reduce 1 \
        --late-reduce 0,1 --json "$OUT/lr_tp2.json" 2>&1 | grep -v "warn\|Loading" ;;
tp2fr)  # the twelfth session's tp2 phase (same flags) with the fuse_reduce config
    CONFIG="${CONFIG:-bench/configs/llama-3.1-8b-tp2-fr.json}" OUT="$OUT" bash scripts/issue6_session12.sh tp2 ;;
fr4)
    S4="--workers 132 --policy stage --warps 8 --gemv-block 16x128 --fuse 1 --prefetch 1 --attn-split 4
        --unroll 8 --w-preload 1024 --prefetch-cap 65536 --roll 1 --tile-lm-head 128 --late-append 1
        --tile-reduce 256 --tokens 64 --tile 32 --tile-qkv 12 --tile-gate-up 28"
    timeout 250 python3 bench/megakernel_sweep.py $M --tp 4 $S4 --allreduce oneshot,fused --fuse-reduce 1 \
        --late-reduce 0,1 --json "$OUT/fr_tp4.json" 2>&1 | grep -v "warn\|Loading"
    best_bench 4 "$OUT/fr_tp4.json" 320 ;;
prof2)
    prof2 "${TAG:-extra}" ;;
*)
    echo "usage: $0 lean2|fr2|frsweep|lr2|tp2fr|fr4|prof2" >&2; exit 2 ;;
esac
