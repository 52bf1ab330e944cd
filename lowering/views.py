"""Views of a ScheduleProgram sized for a prompt: a summary and slices, never the whole program.

* ``timeline(prog)``: a PREDICTED run of one decode step on the cost model
  (lowering/costmodel.py): every worker runs its queue in order; a task starts when its
  worker is free and its waits are met, and takes ``task_bytes / (hbm_bw / workers) +
  task_overhead + serial_passes x head_latency`` (the workers of a rank share its HBM
  bandwidth evenly; the per-head ops' dependent passes are latency bound); a wait met by a
  signal from another rank adds ``cross_rank_latency``. From it: each task's start and end,
  the critical path (the chain of tasks, through queue order and the signals that released
  each wait, that ends at the last task) and each worker's idle time. ``durations`` (task id
  -> seconds, e.g. ``lowering.trace.task_durations`` of a measured trace) replaces the cost
  model's duration of the tasks it names; the waits, queues and signals are simulated as
  before, so the timeline then shows where the MEASURED step binds.
* ``summary(prog)``: per stage (``ir.edits.stage_of``) and rank the task count per worker
  and predicted time, the cost model's latency, the critical path and the idle time per
  worker, as a dict of plain data.
* ``slice_program(prog, layer=, worker=, stage=, rank=)``: the selected tasks as a program
  in the text IR (with the buffers and counters they name), parseable by ``ir.parse_program``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ground.errors import AmkError
from ir.edits import stage_of
from ir.program import ScheduleProgram
from ir.text import format_program
from lowering.costmodel import (DEFAULT_CROSS_RANK_LATENCY_S, DEFAULT_HBM_BW, DEFAULT_HEAD_LATENCY_S,
                                DEFAULT_TASK_OVERHEAD_S, estimate, serial_passes, task_bytes)

#: the most tasks a slice may hold; a bigger selection is refused (narrow it)
MAX_SLICE_TASKS = 400
#: the most stages and critical-path entries a summary lists
MAX_STAGES = 80
MAX_PATH = 40


@dataclass
class Timeline:
    """A predicted step: ``start`` / ``end`` (seconds) per task index, ``makespan``, the
    critical path (task indices, first to last), busy seconds per (rank, worker), and the
    indices of tasks that never ran (a deadlocked schedule)."""

    start: dict[int, float]
    end: dict[int, float]
    makespan: float
    critical: list[int]
    busy: dict[tuple[int, int], float]
    stuck: list[int]


def model_durations(prog: ScheduleProgram, seq_len: int = 1, hbm_bw: float = DEFAULT_HBM_BW,
                    task_overhead_s: float = DEFAULT_TASK_OVERHEAD_S,
                    head_latency_s: float = DEFAULT_HEAD_LATENCY_S) -> dict[str, float]:
    """Task id -> the cost model's duration of the task in seconds, as ``timeline`` takes it:
    ``task_bytes / (hbm_bw / workers) + task_overhead + serial_passes x head_latency``."""
    buffers = prog.buffer_map()
    share = hbm_bw / max(1, prog.workers)
    return {t.id: task_bytes(t, buffers, seq_len) / share + task_overhead_s
            + serial_passes(t) * head_latency_s for t in prog.tasks}


def timeline(prog: ScheduleProgram, seq_len: int = 1, hbm_bw: float = DEFAULT_HBM_BW,
             task_overhead_s: float = DEFAULT_TASK_OVERHEAD_S,
             cross_rank_latency_s: float = DEFAULT_CROSS_RANK_LATENCY_S,
             head_latency_s: float = DEFAULT_HEAD_LATENCY_S,
             durations: dict[str, float] | None = None) -> Timeline:
    """Run step 0 of ``prog`` on the cost model (module docstring). ``seq_len``: tokens in
    the KV cache. ``durations``: task id -> seconds; a task named there takes that time (a
    measured duration) instead of the cost model's (``model_durations``), the others keep the
    model's; ids of no task are ignored. Waits on the previous step (``@prev``) and
    thresholds at or below zero are met at time 0. Never raises on a deadlocked schedule:
    tasks that cannot start are listed in ``stuck``."""
    model = model_durations(prog, seq_len, hbm_bw, task_overhead_s, head_latency_s)
    if durations:
        model.update((k, float(v)) for k, v in durations.items() if k in model)
    queues: dict[tuple[int, int], list[int]] = {}
    for k, t in enumerate(prog.tasks):
        queues.setdefault((t.rank, t.worker), []).append(k)
    head = {q: 0 for q in queues}
    free = {q: 0.0 for q in queues}
    last: dict[tuple[int, int], int | None] = {q: None for q in queues}
    arrivals: dict[str, list[tuple[float, int, int]]] = {}  # counter -> (time, amount, task)
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    why: dict[int, int | None] = {}
    busy = {q: 0.0 for q in queues}
    progress = True
    while progress:
        progress = False
        for q, ks in queues.items():
            while head[q] < len(ks):
                k = ks[head[q]]
                t = prog.tasks[k]
                ready, cause = free[q], last[q]
                ok = True
                for w in t.waits:
                    if w.offset < 0 or w.threshold <= 0:
                        continue
                    got = sorted(arrivals.get(w.counter, ()))
                    total = 0
                    for tm, amt, src in got:
                        total += amt
                        if total >= w.threshold:
                            lat = cross_rank_latency_s if prog.tasks[src].rank != t.rank else 0.0
                            if tm + lat > ready:
                                ready, cause = tm + lat, src
                            break
                    else:
                        ok = False
                        break
                if not ok:
                    break
                dur = model[t.id]
                start[k], end[k], why[k] = ready, ready + dur, cause
                busy[q] += dur
                free[q], last[q] = ready + dur, k
                for s in t.signals:
                    arrivals.setdefault(s.counter, []).append((ready + dur, s.amount, k))
                head[q] += 1
                progress = True
    stuck = [ks[h] for q, ks in queues.items() for h in range(head[q], len(ks))]
    makespan = max(end.values(), default=0.0)
    path: list[int] = []
    k = max(end, key=lambda i: end[i]) if end else None
    while k is not None and len(path) <= len(prog.tasks):
        path.append(k)
        k = why.get(k)
    return Timeline(start, end, makespan, path[::-1], busy, stuck)


def summary(prog: ScheduleProgram, seq_len: int = 1, max_stages: int = MAX_STAGES,
            max_path: int = MAX_PATH) -> dict[str, Any]:
    """A prompt-sized summary of ``prog`` (module docstring): ``program`` (name, ranks,
    workers, tasks, config), ``predicted`` (the cost model's step latency and the timeline's
    makespan, microseconds, labelled PREDICTED), ``stages`` (per stage and rank: tasks per
    worker and predicted microseconds; at most ``max_stages``, in program order),
    ``critical_path`` (at most ``max_path`` entries: task, stage, rank.worker, start and
    end us), ``workers`` (busy and idle us per rank.worker) and ``stuck`` (tasks that could
    not start: a deadlock)."""
    tl = timeline(prog, seq_len)
    est = estimate(prog, seq_len)
    stages: dict[str, dict[int, dict[str, Any]]] = {}
    for k, t in enumerate(prog.tasks):
        st = stages.setdefault(stage_of(t.id), {})
        e = st.setdefault(t.rank, {"tasks_per_worker": {}, "us": 0.0})
        e["tasks_per_worker"][t.worker] = e["tasks_per_worker"].get(t.worker, 0) + 1
        if k in tl.end:
            e["us"] += (tl.end[k] - tl.start[k]) * 1e6
    rows = []
    for name, per_rank in stages.items():
        for r, e in sorted(per_rank.items()):
            rows.append({"stage": name, "rank": r, "tasks": sum(e["tasks_per_worker"].values()),
                         "tasks_per_worker": {f"w{w}": n for w, n in sorted(e["tasks_per_worker"].items())},
                         "predicted_us": round(e["us"], 3)})
    path = [{"task": prog.tasks[k].id, "stage": stage_of(prog.tasks[k].id),
             "at": f"@r{prog.tasks[k].rank}.w{prog.tasks[k].worker}",
             "start_us": round(tl.start[k] * 1e6, 3), "end_us": round(tl.end[k] * 1e6, 3)}
            for k in tl.critical]
    workers = [{"at": f"@r{r}.w{w}", "busy_us": round(b * 1e6, 3),
                "idle_us": round((tl.makespan - b) * 1e6, 3)}
               for (r, w), b in sorted(tl.busy.items())]
    out: dict[str, Any] = {
        "program": {"name": prog.name, "ranks": prog.ranks, "workers": prog.workers,
                    "tasks": len(prog.tasks), "counters": len(prog.counters),
                    "config": dict(prog.config)},
        "predicted": {"label": "PREDICTED (roofline cost model, not a measurement)",
                      "cost_model_us": round(est.predicted_latency_s * 1e6, 3),
                      "timeline_makespan_us": round(tl.makespan * 1e6, 3), "seq_len": seq_len},
        "stages": rows[:max_stages],
        "critical_path": path if len(path) <= max_path else path[:max_path // 2] + path[-max_path // 2:],
        "workers": workers,
        "stuck": [prog.tasks[k].id for k in tl.stuck[:20]],
    }
    if len(rows) > max_stages:
        out["stages_left_out"] = len(rows) - max_stages
    if len(path) > max_path:
        out["critical_path_left_out"] = len(path) - max_path
    return out


def format_summary(s: dict[str, Any]) -> str:
    """The summary as short text lines (for a terminal or a prompt)."""
    p, pr = s["program"], s["predicted"]
    lines = [f"program {p['name']}: {p['tasks']} tasks, {p['ranks']} rank(s) x {p['workers']} "
             f"worker(s), {p['counters']} counters",
             f"{pr['label']}: cost model {pr['cost_model_us']:.2f} us, timeline "
             f"{pr['timeline_makespan_us']:.2f} us (seq_len {pr['seq_len']})",
             "stages (rank: tasks per worker, predicted us):"]
    for row in s["stages"]:
        per = " ".join(f"{w}={n}" for w, n in row["tasks_per_worker"].items())
        lines.append(f"  {row['stage']:<24} r{row['rank']}: {per}  {row['predicted_us']:.2f} us")
    if s.get("stages_left_out"):
        lines.append(f"  ... {s['stages_left_out']} more (ask for a slice)")
    lines.append("critical path:")
    for e in s["critical_path"]:
        lines.append(f"  {e['task']:<28} {e['at']:<9} {e['start_us']:9.2f} -> {e['end_us']:9.2f} us")
    lines.append("idle per worker (us): " + ", ".join(f"{w['at']} {w['idle_us']:.2f}" for w in s["workers"]))
    if s["stuck"]:
        lines.append("never start (deadlock): " + ", ".join(s["stuck"]))
    return "\n".join(lines)


def slice_program(prog: ScheduleProgram, layer: int | None = None, worker: int | None = None,
                  stage: str | None = None, rank: int | None = None,
                  max_tasks: int = MAX_SLICE_TASKS) -> str:
    """The tasks of one layer (ids ``l{layer}.*``), worker, stage and/or rank (all given
    filters apply) as a text-IR program with the buffers and counters they name.

    Raises AmkError (exit 2) without a filter, for an empty selection, or for one of more
    than ``max_tasks`` tasks (narrow it: the whole program is never printed).
    """
    if layer is None and worker is None and stage is None and rank is None:
        raise AmkError("a slice needs at least one of layer, worker, stage, rank")
    sel = [t for t in prog.tasks
           if (layer is None or t.id.startswith(f"l{layer}."))
           and (worker is None or t.worker == worker)
           and (stage is None or stage_of(t.id) == stage)
           and (rank is None or t.rank == rank)]
    if not sel:
        raise AmkError("the slice selects no task (layers are the l<N>. task ids; stages: "
                       + ", ".join(sorted({stage_of(t.id) for t in prog.tasks})[:10]) + ", ...)")
    if len(sel) > max_tasks:
        raise AmkError(f"the slice selects {len(sel)} tasks, more than {max_tasks}; narrow it "
                       "(add a rank, worker or stage)")
    bufs = {r.buffer for t in sel for r in (*t.ins, *t.outs)}
    ctrs = {w.counter for t in sel for w in t.waits} | {s.counter for t in sel for s in t.signals}
    part = prog.copy()
    ids = {t.id for t in sel}
    part.tasks = [t for t in part.tasks if t.id in ids]
    part.buffers = [b for b in part.buffers if b.name in bufs]
    part.counters = [c for c in part.counters if c.name in ctrs]
    return format_program(part)
