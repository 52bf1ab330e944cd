"""Validation time of large synthetic schedules (validator/synth.py) over 4 ranks.

Usage: ``python bench/validator_speed.py [--sizes 10000,50000,150000,300000] [--repeat 3]``

For each target size it builds the transformer-shaped schedule (4 ranks x 64 workers,
GEMV tiles, one-shot all-reduces with puts, signals and reduce tasks; credits or double
buffering), validates it ``--repeat`` times and reports the best wall-clock and CPU time
with the per-stage CPU split. Prints a table and writes bench/results/validator_speed.json.
"shared" programs share equal range / wait / signal tuples between tasks, as the text parser
(ir/text.py) builds them; "fresh" ones (``--fresh`` sizes) have new objects everywhere.
The machine's load average is recorded: on a shared machine the wall-clock time includes
waiting for a core, the CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from validator import validate  # noqa: E402
from validator.synth import schedule_for_tasks  # noqa: E402


def bench(size: int, reuse: str, repeat: int, ranks: int, workers: int,
          share: bool = True) -> dict:
    t = time.perf_counter()
    prog = schedule_for_tasks(size, ranks=ranks, workers=workers, reuse=reuse, share=share)
    build_s = time.perf_counter() - t
    best = None
    for _ in range(repeat):
        v = validate(prog)
        if not v.ok:
            raise SystemExit(f"synthetic schedule rejected: {[f.message for f in v.errors][:3]}")
        if best is None or v.stats["total_s"] < best.stats["total_s"]:
            best = v
    s = best.stats
    return {"tasks": len(prog.tasks), "ranks": ranks, "workers": workers, "reuse": reuse,
            "shared_tuples": share,
            "slots": prog.slots, "segments": s.get("segments"), "sim_rounds": s.get("sim_rounds"),
            "wall_s": s["total_s"], "cpu_s": s["total_cpu_s"], "stage_cpu_s": s["cpu_s"],
            "build_s": round(build_s, 2), "accepted": best.ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,50000,150000,300000",
                    help="comma-separated target task counts")
    ap.add_argument("--reuse", default="credit,slots", help="receive-buffer reuse modes")
    ap.add_argument("--repeat", type=int, default=3, help="validations per size (best kept)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--fresh", default="150000",
                    help="sizes also measured with fresh (unshared) tuples, as a program "
                         "built object by object without interning (empty: none)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "validator_speed.json"))
    args = ap.parse_args(argv)
    rows = []
    runs = [(reuse, int(x), True) for reuse in args.reuse.split(",")
            for x in args.sizes.split(",")]
    runs += [("credit", int(x), False) for x in args.fresh.split(",") if x]
    for reuse, size, share in runs:
        r = bench(size, reuse, args.repeat, args.ranks, args.workers, share)
        rows.append(r)
        print(f"{r['tasks']:>8} tasks  {r['reuse']:<6} {'shared' if share else 'fresh ':<6} "
              f"wall {r['wall_s']:6.3f} s  cpu {r['cpu_s']:6.3f} s  (build {r['build_s']:.1f} s)",
              flush=True)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print()
    print(f"{'tasks':>8} {'reuse':<7} {'tuples':<7} {'wall s':>8} {'cpu s':>8}  stage cpu s")
    for r in rows:
        st = ", ".join(f"{k} {v:.2f}" for k, v in r["stage_cpu_s"].items()
                       if k != "deep" and v >= 0.01)
        tup = "shared" if r["shared_tuples"] else "fresh"
        print(f"{r['tasks']:>8} {r['reuse']:<7} {tup:<7} {r['wall_s']:8.3f} {r['cpu_s']:8.3f}  "
              f"{st}")
    out = {"machine": {"cpus": os.cpu_count(), "load_avg_1_5_15": load,
                       "python": platform.python_version(), "platform": platform.platform()},
           "rows": rows,
           "note": "wall_s is the best of --repeat runs; cpu_s is process CPU time of that run"}
    from ground.files import atomic_write_text  # whole file or none; AmkError names the path

    atomic_write_text(args.out, json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out}; load average {load}")
    return 0


if __name__ == "__main__":
    from ground.errors import AmkError

    try:
        raise SystemExit(main())
    except AmkError as err:  # e.g. the result file cannot be written: one line, exit 2
        print(f"bench/validator_speed.py: error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code)
