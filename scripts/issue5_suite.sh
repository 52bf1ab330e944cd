#!/usr/bin/env bash
# Issue 5 measurements in one device call on one H200/H100: GPU tests of the GEMV pipeline and
# the --unsafe watchdog, a GEMV-stages sweep on both models, then `amk bench` (with baselines
# (a) and (b)) at the fastest correct sweep row. Results go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/device_env.sh
OUT="${OUT:-out}"; mkdir -p "$OUT"
run() { local t=$1; shift; echo "=== $*"; timeout "$t" "$@"; echo "=== rc=$?"; }

run 120 python3 -m pytest -q -m gpu tests/test_run_cli.py -k deadlock
( time python3 -m amk run examples/schedules/deadlock.amk --backend triton --unsafe --timeout 1 ) \
    > "$OUT/run_deadlock_unsafe.txt" 2>&1; echo "rc=$?" >> "$OUT/run_deadlock_unsafe.txt"
cat "$OUT/run_deadlock_unsafe.txt"
run 150 python3 -m pytest -q -m gpu tests/test_triton_ops.py -k "gemv or compile"

declare -A TILE=( [config:llama-3.2-1b]=16 [config:smollm2-135m]=16 )
declare -A NAME=( [config:llama-3.2-1b]=llama-3.2-1b [config:smollm2-135m]=smollm2-135m )
for M in config:llama-3.2-1b config:smollm2-135m; do
    n=${NAME[$M]}
    run 240 python3 bench/megakernel_sweep.py $M --workers 132 --tile ${TILE[$M]} --policy balanced \
        --warps 8 --gemv-block 16x1024,16x512 --gemv-stages 1,3,4 --fuse 1 --tokens 64 \
        --json "$OUT/sweep_stages_$n.json"
    best=$(python3 - "$OUT/sweep_stages_$n.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("correct")]
b = min(rows, key=lambda r: r["latency_ms_median"]) if rows else None
print(f'{b["gemv_block"]} {b["gemv_stages"]}' if b else "16x1024 1")
PY
)
    set -- $best
    run 200 python3 -m amk bench $M --workers 132 --tile ${TILE[$M]} --config bench/configs/$n.json \
        --num-warps 8 --gemv-block $1 --gemv-stages $2 --tokens 128 --out "$OUT/bench_$n.json"
done
