#!/usr/bin/env bash
# The multi-GPU measurements of issue 6 in two back-to-back device calls on nvidia-h200-x4
# (4 x H200, NVLink). Each call carries half of the SmolLM2 GGUF (.gga/, .ggb/: a single call
# carries at most 64 MiB) plus .whlnv/ (nvshmem4py, lark, gguf wheels); the first half waits
# in /tmp for the second call (the machine stays warm between the calls). tp=2 runs use GPUs
# 0,1 or 2,3 of the same host.
#
#   bash scripts/multigpu_suite.sh comm  # comm micro-benchmarks at 2 and 4 ranks
#   bash scripts/multigpu_suite.sh 1     # 8B at tp 2 (GPUs 0,1) while 1B tp 2 runs on GPUs 2,3;
#                                        # then 8B at tp 4
#   bash scripts/multigpu_suite.sh 2     # real SmolLM2 --verify at tp 2, then tp 4
# Results go to $OUT (the device tool's output folder) or ./out.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
GG=/tmp/smollm2.gguf
CFG8=bench/configs/llama-3.1-8b.json
run() { local t=$1; shift; echo "=== $*"; timeout "$t" "$@"; echo "=== rc=$?"; }
bench() {  # bench MODEL R GPUS CONFIG [extra args]
    local m=$1 r=$2 g=$3 c=$4; shift 4
    run 330 env CUDA_VISIBLE_DEVICES=$g python3 -m amk bench $m --tp $r --config $c --gemv-block 16x1024 \
        --tokens 64 --out "$OUT/bench_tp${r}_${m#config:}.json" "$@" 2>&1 | grep -v "warn\|Loading\|Writing"
}
gen() {  # gen R GPUS: real SmolLM2, greedy, --verify against HF
    run 170 env CUDA_VISIBLE_DEVICES=$2 python3 -m amk generate $GG --prompt "The capital of France is" \
        --max-new-tokens 32 --tp $1 --backend triton --verify --json > "$OUT/generate_tp$1_smollm2_real.json"
    tail -c 700 "$OUT/generate_tp$1_smollm2_real.json"; echo
}

case "${1:?comm, 1 or 2}" in
comm)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    run 150 env CUDA_VISIBLE_DEVICES=0,1 python3 bench/comm.py --ranks 2 --iters 100 --json "$OUT/comm_r2.json"
    run 150 python3 bench/comm.py --ranks 4 --iters 100 --json "$OUT/comm_r4.json" ;;
1)
    [ -f .gga/gg_part_aa ] && cp .gga/gg_part_aa /tmp/gg_part_aa
    ( bench config:llama-3.2-1b 2 2,3 bench/configs/llama-3.2-1b.json --tile 16 > "$OUT/bench_tp2_1b.log" ) &
    bench config:llama-3.1-8b 2 0,1 $CFG8
    wait; cat "$OUT/bench_tp2_1b.log"
    bench config:llama-3.1-8b 4 0,1,2,3 $CFG8 ;;
2)
    [ -f /tmp/gg_part_aa ] && cat /tmp/gg_part_aa .ggb/gg_part_ab > $GG
    gen 2 0,1
    gen 4 0,1,2,3 ;;
esac
