"""Validation time: of a real lowered schedule (stage by stage, and `amk validate` end to end),
or of large synthetic schedules (validator/synth.py) over 4 ranks.

Real schedule (the default when ``--model`` or ``--schedule`` is given)::

    python bench/validator_speed.py --model config:llama-3.1-8b --tp 4 [--repeat 7]
    python bench/validator_speed.py --schedule build/llama-3.1-8b-tp4/schedule.amk

``--model`` lowers the model the way ``amk compile MODEL --tp R`` does (default lowering
config, sim target) but builds it on the meta device: no weights are read or allocated and
no HF reference runs, so an 8B model needs no 32 GB of fp32 weights. The schedule is
written to ``--schedule-out`` (default: a temporary directory) as ``schedule.amk``. Then,
``--repeat`` times each, it measures in this process

* ``parse``: ``ir.io.load_program_located`` (read + parse the text form),
* the validator's stages from ``Verdict.stats``: ``structure``; ``deadlock`` (unsatisfiable
  waits, collective participation, the window, the simulation); ``happens_before``;
  ``collective_order``; ``races``; ``validate`` (all of them),
* ``parse + validate``,

and ``cli``: the wall time of a fresh ``python -m amk validate FILE --quiet`` process (start,
imports, parse, validation, exit). It prints a table of the minimum and median wall seconds
(and CPU seconds, which waiting for a shared core does not inflate) and writes JSON
(default ``bench/results/cpu/validator_speed_<model>-tp<R>.json``) with every sample, the
machine and its load average.

Synthetic schedules (no ``--model``/``--schedule``)::

    python bench/validator_speed.py --sizes 10000,50000,150000,300000 [--repeat 3]

For each target size it builds the transformer-shaped schedule (4 ranks x 64 workers,
GEMV tiles, one-shot all-reduces with puts, signals and reduce tasks; credits or double
buffering), validates it ``--repeat`` times and reports the best wall-clock and CPU time
with the per-stage CPU split. Writes bench/results/validator_speed.json.
"shared" programs share equal range / wait / signal tuples between tasks, as the text parser
(ir/text.py) builds them; "fresh" ones (``--fresh`` sizes) have new objects everywhere.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from validator import validate  # noqa: E402

# validator stages (Verdict.stats["timings_s"] keys) grouped as the table shows them
STAGE_GROUPS = {
    "structure": ("structure",),
    "deadlock": ("unsatisfiable", "collectives", "window", "simulation"),
    "happens_before": ("happens_before",),
    "collective_order": ("collective_order",),
    "races": ("races",),
}
COLUMNS = ["parse", *STAGE_GROUPS, "validate", "parse + validate", "cli"]


# ------------------------------------------------------------------------------------------
# a real schedule
# ------------------------------------------------------------------------------------------

def lower_schedule(model: str, tp: int, out_dir: Path) -> Path:
    """Lower ``model`` for ``tp`` ranks as ``amk compile`` does (default config, sim target),
    on the meta device (no weights, no HF reference); write ``out_dir/schedule.amk``."""
    from amk import pipeline
    from ir.io import save_program
    from ir.program import Target
    from lowering.config import LoweringConfig
    from models.sources import resolve_model

    resolved = resolve_model(model, dtype="fp32", weights=False)
    compilation = pipeline.Compilation.build(model, tp, LoweringConfig(), Target(backend="sim"),
                                             validate=False, resolved=resolved)
    out_dir.mkdir(parents=True, exist_ok=True)
    return save_program(compilation.program, out_dir / "schedule.amk")


def _sample_inprocess(path: Path) -> tuple[dict[str, float], dict[str, float], dict]:
    """One parse + validate of ``path`` in this process: wall and CPU seconds per column."""
    try:
        from ir.io import load_program_located as load
    except ImportError:  # an older checkout (for a before/after comparison)
        from ir.io import load_program

        def load(p):
            return load_program(p), None

    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    prog, _ = load(path)
    wall = {"parse": time.perf_counter() - t}
    cpu = {"parse": time.process_time() - c}
    v = validate(prog)
    st = v.stats
    for col, keys in STAGE_GROUPS.items():
        wall[col] = sum(st["timings_s"].get(k, 0.0) for k in keys)
        cpu[col] = sum(st["cpu_s"].get(k, 0.0) for k in keys)
    wall["validate"], cpu["validate"] = st["total_s"], st["total_cpu_s"]
    wall["parse + validate"] = wall["parse"] + wall["validate"]
    cpu["parse + validate"] = cpu["parse"] + cpu["validate"]
    info = {"ok": v.ok, "errors": [f"{f.cls}: {f.message}" for f in v.errors[:5]],
            "tasks": len(prog.tasks), "ranks": prog.ranks, "workers": prog.workers,
            "slots": prog.slots, "segments": st.get("segments"),
            "sim_rounds": st.get("sim_rounds"), "window_epochs": st.get("window_epochs")}
    del prog, v
    return wall, cpu, info


def _sample_cli(path: Path) -> tuple[float, float]:
    """Wall and CPU (user + sys of the child) seconds of ``python -m amk validate FILE``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    before = os.times()
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "amk", "validate", str(path), "--quiet"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = os.times()
    if r.returncode != 0:
        raise SystemExit(f"amk validate {path} exited {r.returncode}: {r.stdout}{r.stderr}")
    cpu = (after.children_user - before.children_user) + \
        (after.children_system - before.children_system)
    return wall, cpu


def bench_schedule(path: Path, repeat: int) -> dict:
    """``repeat`` in-process samples and ``repeat`` CLI samples, interleaved."""
    walls: dict[str, list[float]] = {c: [] for c in COLUMNS}
    cpus: dict[str, list[float]] = {c: [] for c in COLUMNS}
    info: dict = {}
    for _ in range(repeat):
        w, c, info = _sample_inprocess(path)
        for k in w:
            walls[k].append(round(w[k], 4))
            cpus[k].append(round(c[k], 4))
        w_cli, c_cli = _sample_cli(path)
        walls["cli"].append(round(w_cli, 4))
        cpus["cli"].append(round(c_cli, 4))
    if not info.get("ok"):
        raise SystemExit(f"{path} is rejected: {info.get('errors')}")

    def summary(xs: list[float]) -> dict:
        return {"min": min(xs), "median": round(statistics.median(xs), 4), "samples": xs}

    return {"schedule": info, "wall_s": {k: summary(v) for k, v in walls.items()},
            "cpu_s": {k: summary(v) for k, v in cpus.items()}}


def table(res: dict, title: str) -> str:
    """The printed table: min / median wall and CPU seconds per column."""
    lines = [title, "",
             f"{'stage':<18} {'wall min':>9} {'wall med':>9} {'cpu min':>9} {'cpu med':>9}"]
    for col in COLUMNS:
        w, c = res["wall_s"][col], res["cpu_s"][col]
        lines.append(f"{col:<18} {w['min']:9.3f} {w['median']:9.3f} "
                     f"{c['min']:9.3f} {c['median']:9.3f}")
    return "\n".join(lines)


def _machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpus": os.cpu_count(), "load_avg_1_5_15": load,
            "python": platform.python_version(), "platform": platform.platform()}


def main_schedule(args: argparse.Namespace) -> int:
    if args.schedule:
        path = Path(args.schedule)
        name = path.stem
        lower_s = None
    else:
        out_dir = Path(args.schedule_out) if args.schedule_out else \
            Path(tempfile.mkdtemp(prefix="amk-validator-speed-"))
        t = time.perf_counter()
        path = lower_schedule(args.model, args.tp, out_dir)
        lower_s = round(time.perf_counter() - t, 2)
        name = f"{args.model.split(':')[-1]}-tp{args.tp}"
        print(f"lowered {args.model} --tp {args.tp} in {lower_s} s: {path}", flush=True)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    res = bench_schedule(path, args.repeat)
    sch = res["schedule"]
    title = (f"amk validate {name}: {sch['tasks']} tasks, {sch['ranks']} ranks x "
             f"{sch['workers']} workers, slots {sch['slots']} ({sch['window_epochs']} unrolled "
             f"steps, {sch['segments']} segments, {sch['sim_rounds']} simulation rounds); "
             f"seconds over {args.repeat} runs")
    text = table(res, title)
    print(text)
    out = Path(args.out) if args.out else \
        ROOT / "bench" / "results" / "cpu" / f"validator_speed_{name}.json"
    machine = _machine()
    machine["load_avg_at_start"] = load_before
    body = {"model": args.model, "tp": args.tp, "schedule_file": str(path),
            "lower_s": lower_s, "repeat": args.repeat, "machine": machine, **res,
            "columns": {
                "parse": "ir.io.load_program_located: read and parse the text form",
                "structure": "validator structure stage",
                "deadlock": "unsatisfiable + collectives + window + simulation stages",
                "happens_before": "happens-before fixpoint and vector clocks",
                "collective_order": "collective order stage",
                "races": "race checks",
                "validate": "validator.validate total (all stages)",
                "parse + validate": "the two in one process",
                "cli": "a fresh `python -m amk validate FILE --quiet` process, end to end"},
            "note": "in-process columns come from one process that repeats parse + validate; "
                    "cli samples are interleaved with them; min and median over the samples"}
    from ground.files import atomic_write_text  # whole files or none; AmkError names the path

    atomic_write_text(out, json.dumps(body, indent=1) + "\n")
    atomic_write_text(out.with_suffix(".txt"), text + "\n")
    print(f"\nwrote {out} and {out.with_suffix('.txt').name}; load average {_machine()['load_avg_1_5_15']}")
    return 0


# ------------------------------------------------------------------------------------------
# synthetic schedules
# ------------------------------------------------------------------------------------------

def bench(size: int, reuse: str, repeat: int, ranks: int, workers: int,
          share: bool = True) -> dict:
    from validator.synth import schedule_for_tasks

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


def main_synthetic(args: argparse.Namespace) -> int:
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
    out = {"machine": _machine(), "rows": rows,
           "note": "wall_s is the best of --repeat runs; cpu_s is process CPU time of that run"}
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / "validator_speed.json"
    from ground.files import atomic_write_text  # whole file or none; AmkError names the path

    atomic_write_text(path, json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {path}; load average {load}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="lower this model (e.g. config:llama-3.1-8b) and time its schedule")
    ap.add_argument("--tp", type=int, default=4, help="ranks for --model (default 4)")
    ap.add_argument("--schedule", default=None, help="time this schedule file instead")
    ap.add_argument("--schedule-out", default=None,
                    help="directory for the lowered schedule (default: a temporary one)")
    ap.add_argument("--sizes", default="10000,50000,150000,300000",
                    help="synthetic: comma-separated target task counts")
    ap.add_argument("--reuse", default="credit,slots", help="synthetic: receive-buffer reuse modes")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs per measurement (default 7 for a schedule, 3 synthetic)")
    ap.add_argument("--ranks", type=int, default=4, help="synthetic: ranks")
    ap.add_argument("--workers", type=int, default=64, help="synthetic: workers per rank")
    ap.add_argument("--fresh", default="150000",
                    help="synthetic sizes also measured with fresh (unshared) tuples, as a "
                         "program built object by object without interning (empty: none)")
    ap.add_argument("--out", default=None, help="JSON output path")
    args = ap.parse_args(argv)
    if args.model or args.schedule:
        args.repeat = args.repeat or 7
        return main_schedule(args)
    args.repeat = args.repeat or 3
    return main_synthetic(args)


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/validator_speed.py")  # an AmkError: one line, its exit code
