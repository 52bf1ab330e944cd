#!/usr/bin/env bash
# The sixth session's single-GPU experiments (docs/benchmarks.md, "Sixth session"), one phase
# per device call on one H200/H100. Results go to $OUT (or ./out).
#
#   bash scripts/issue5_session6.sh xstage   # Blocks.x_stage off/on: the fused GEMV prologue f(x)
#                                            # staged once per task instead of per weight element
#                                            # (Llama-3.2-1B and SmolLM2 shapes, 64 tokens)
#   bash scripts/issue5_session6.sh poll     # Blocks.relaxed_poll off/on and GEMV blocks, x_stage on
#   bash scripts/issue5_session6.sh ncu      # the GEMV probe with x_stage off/on, then Nsight
#                                            # Compute on it: warp stall reasons per SASS line
#   bash scripts/issue5_session6.sh ncu-model  # the same on the real Llama-3.2-1B-shape kernel (XS=0 1)
#   bash scripts/issue5_session6.sh final    # amk bench rows with baselines (a) and both (b)
#                                            # modes (FLAGS_LLAMA / FLAGS_SMOL override the flags)
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
C="--policy balanced --gemv-stages 1 --fuse 1 --tokens 64 --tile 16 --workers 132 --warps 8 --prefetch 1"
S="timeout 290 python3 bench/megakernel_sweep.py"
P="python3 bench/gemv_probe.py --giant --op norm_gemv --gemv-block 16x128 --unroll 8 --rows 65536"
case "${1:-}" in
xstage)
    $S config:llama-3.2-1b --gemv-block 16x128 --unroll 8 --attn-split 4 --x-stage 0,1 $C \
        --json "$OUT/xstage_llama.json"
    $S config:smollm2-135m --gemv-block 16x64 --unroll 8 --attn-split 3 --x-stage 0,1 $C \
        --json "$OUT/xstage_smol.json" ;;
poll)  # relaxed polls (Blocks.relaxed_poll) and the GEMV block shape, x_stage on
    $S config:llama-3.2-1b --gemv-block 16x128,16x256 --unroll 8,4 --attn-split 4 --relaxed-poll 0,1 $C \
        --json "$OUT/poll_llama.json"
    $S config:smollm2-135m --gemv-block 16x64 --unroll 8 --attn-split 3 --relaxed-poll 0,1 $C \
        --json "$OUT/poll_smol.json" ;;
ncu)
    for xs in 0 1; do timeout 120 $P --x-stage $xs --json "$OUT/probe_xs$xs.json"; done
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for xs in 0 1; do
        timeout 200 "$NCU" --clock-control none -k regex:amk_megakernel --launch-skip 2 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SourceCounters \
            --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
            -f -o "$OUT/ncu_probe_xs$xs" $P --x-stage $xs > "$OUT/ncu_probe_xs$xs.log" 2>&1
        "$NCU" -i "$OUT/ncu_probe_xs$xs.ncu-rep" --page details --csv > "$OUT/ncu_probe_xs${xs}_details.csv" 2>&1
        "$NCU" -i "$OUT/ncu_probe_xs$xs.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu_probe_xs${xs}_sass.csv" 2>&1
        python3 scripts/ncu_sass.py hot "$OUT/ncu_probe_xs${xs}_sass.csv" > "$OUT/ncu_probe_xs${xs}_hot.txt" 2>&1
        gzip -f "$OUT/ncu_probe_xs${xs}_sass.csv"; rm -f "$OUT/ncu_probe_xs$xs.ncu-rep"
    done
    tail -n 40 "$OUT"/ncu_probe_xs*_hot.txt; grep -h -i "stall\|throughput\|Warp Cycles" "$OUT"/ncu_probe_xs*_details.csv | head -60 ;;
ncu-model)  # Nsight Compute on the real Llama-3.2-1B-shape megakernel (one decode step)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    for xs in ${XS:-0}; do
        timeout 270 "$NCU" --clock-control none -k regex:amk_megakernel --launch-skip 6 --launch-count 1 \
            --section SpeedOfLight --section WarpStateStats --section SourceCounters --section MemoryWorkloadAnalysis \
            -f -o "$OUT/ncu_llama_xs$xs" $S config:llama-3.2-1b --gemv-block 16x128 --unroll 8 --attn-split 4 \
            --x-stage $xs $C --tokens 8 > "$OUT/ncu_llama_xs$xs.log" 2>&1
        "$NCU" -i "$OUT/ncu_llama_xs$xs.ncu-rep" --page details --csv > "$OUT/ncu_llama_xs${xs}_details.csv" 2>&1
        "$NCU" -i "$OUT/ncu_llama_xs$xs.ncu-rep" --page source --csv --print-source sass \
            > "$OUT/ncu_llama_xs${xs}_sass.csv" 2>&1
        python3 scripts/ncu_sass.py hot "$OUT/ncu_llama_xs${xs}_sass.csv" --top 30 > "$OUT/ncu_llama_xs${xs}_hot.txt" 2>&1
        python3 scripts/ncu_sass.py loops "$OUT/ncu_llama_xs${xs}_sass.csv" > "$OUT/ncu_llama_xs${xs}_loops.txt" 2>&1
        gzip -f "$OUT/ncu_llama_xs${xs}_sass.csv"; rm -f "$OUT/ncu_llama_xs$xs.ncu-rep"
        cat "$OUT/ncu_llama_xs${xs}_loops.txt"; head -20 "$OUT/ncu_llama_xs${xs}_hot.txt"
    done
    grep -h "Duration\|DRAM Throughput\|Warp Cycles Per Issued" "$OUT"/ncu_llama_xs*_details.csv | cut -c60-300 ;;
final)
    B="timeout 590 python3 -m amk bench --baseline-compile-mode ${MODES:-default,max-autotune-no-cudagraphs}"
    $B config:llama-3.2-1b --workers 132 --tile 16 --config bench/configs/llama-3.2-1b.json --num-warps 8 \
        ${FLAGS_LLAMA:---gemv-block 16x128 --gemv-unroll 8 --prefetch 1 --attn-split 4} --tokens 128 \
        --out "$OUT/bench_llama-3.2-1b.json" ;;
final-smol)
    B="timeout 590 python3 -m amk bench --baseline-compile-mode ${MODES:-default,max-autotune-no-cudagraphs}"
    $B config:smollm2-135m --workers 132 --tile 16 --config bench/configs/smollm2-135m.json --num-warps 8 \
        ${FLAGS_SMOL:---gemv-block 16x64 --gemv-unroll 8 --prefetch 1 --attn-split 3} --tokens 128 \
        --out "$OUT/bench_smollm2-135m.json" ;;
*)
    echo "usage: $0 xstage|poll|ncu|ncu-model|final|final-smol" >&2; exit 2 ;;
esac
