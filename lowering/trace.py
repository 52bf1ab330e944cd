"""A decode step as a trace in the Chrome / Perfetto trace-event format, and its checker.

``build_trace(prog, times, clock=...)`` turns per-task times of one step into the JSON object
that ui.perfetto.dev and chrome://tracing open (the "JSON Object Format" of the Trace Event
Format):

* one process per rank (``pid`` = rank, named ``rank R`` by a ``process_name`` "M" event),
  one track per worker (``tid`` = worker, named ``worker W`` by ``thread_name``);
* one complete ("X") slice per task: ``ts`` / ``dur`` in microseconds, name = the task id,
  ``cat`` = its op, ``args``: op, layer, stage, bytes, achieved GB/s, its waits and signals;
* one "X" slice (``cat`` ``wait``) per task that waited on its counters: from the moment the
  task reached the head of its worker's queue until its waits were met;
* one flow ("s" -> "f", one ``id`` each) from each signal to the wait it released: the
  signalling task whose signal made the counter reach the wait's threshold (on the GPU clock
  a signal stamped after the waiter ended, by the clocks of two SMs, has no arrow:
  ``otherData.flows_dropped`` counts them);
* ``otherData``: the clock (``simulated``: the cost model's timeline, lowering/views.py;
  ``gpu``: the megakernel's in-kernel %globaltimer stamps), the step's makespan, the cost
  model's roofline and prediction, and the program's shape.

``sim_times(prog, seq_len)`` gives the times of the cost model's timeline. ``check_trace(obj)``
lists every way an object breaks the format (empty: valid); the tests run it over fresh traces
and every committed ``bench/results/**/trace*.json``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ground.errors import AmkError
from ir.edits import stage_of
from ir.program import ScheduleProgram
from lowering.costmodel import estimate, task_bytes
from lowering.views import timeline

#: the clocks a trace's times may come from (``otherData.clock``)
CLOCKS = ("simulated", "gpu")
#: the phases an amk trace uses; ``check_trace`` accepts these and the other standard ones
PHASES = {"X", "M", "s", "t", "f", "B", "E", "i", "I", "C", "b", "e", "n"}
METADATA_NAMES = {"process_name", "process_labels", "process_sort_index", "thread_name",
                  "thread_sort_index"}
#: a flow point sits this far (us) inside the slice it binds to, so that the viewers bind it
_INSIDE_US = 1e-3

#: TaskTimes: task index -> (reached the queue head, waits met, done), seconds from step start
TaskTimes = dict[int, tuple[float, float, float]]


def sim_times(prog: ScheduleProgram, seq_len: int = 1) -> TaskTimes:
    """Per task of ``prog`` (index into ``prog.tasks``): the cost model's predicted (queue
    head, waits met, end) in seconds from the step's start (lowering/views.py ``timeline``).
    A task reaches its queue head when the worker's previous task ends. Tasks that never
    start (a deadlocked schedule) are left out."""
    tl = timeline(prog, seq_len)
    times: TaskTimes = {}
    prev_end: dict[tuple[int, int], float] = {}
    for k, t in enumerate(prog.tasks):
        if k not in tl.start:
            continue
        q = (t.rank, t.worker)
        head = prev_end.get(q, 0.0)
        times[k] = (min(head, tl.start[k]), tl.start[k], tl.end[k])
        prev_end[q] = tl.end[k]
    return times


def releases(prog: ScheduleProgram, times: TaskTimes) -> list[tuple[int, int, int]]:
    """(signalling task, waiting task, index of the wait) for every wait of this step (not a
    ``@prev`` wait, threshold above 0) whose threshold a signal of a task in ``times`` reached:
    counting each counter's signals in the order they were raised (task end times), the
    signal that brings the count to the threshold released the wait."""
    arrivals: dict[str, list[tuple[float, int, int]]] = {}
    for k, (_, _, end) in times.items():
        for s in prog.tasks[k].signals:
            arrivals.setdefault(s.counter, []).append((end, k, s.amount))
    for lst in arrivals.values():
        lst.sort()
    out = []
    for k in sorted(times):
        for i, w in enumerate(prog.tasks[k].waits):
            if w.offset < 0 or w.threshold <= 0:
                continue
            total = 0
            for _, src, amount in arrivals.get(w.counter, ()):
                total += amount
                if total >= w.threshold:
                    out.append((src, k, i))
                    break
    return out


def _layer(task_id: str) -> int | str | None:
    m = re.match(r"l(\d+)\.", task_id)
    if m:
        return int(m.group(1))
    head = task_id.split(".", 1)[0]
    return head if head in ("lm", "embed", "emb") else None


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 6)


def build_trace(prog: ScheduleProgram, times: TaskTimes, *, clock: str, seq_len: int = 1,
                meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """The trace-event object of one step of ``prog`` (module docstring). ``times``: per task
    index (queue head, waits met, end) in seconds from the step's start (``sim_times``, or the
    GPU's stamps); ``clock``: ``simulated`` or ``gpu``; ``seq_len``: tokens in the KV cache
    (bytes and the roofline are taken at it); ``meta``: more ``otherData`` entries (model,
    device, config). Raises AmkError for another clock."""
    if clock not in CLOCKS:
        raise AmkError(f"trace clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    buffers = prog.buffer_map()
    ev: list[dict[str, Any]] = []
    for r in range(prog.ranks):
        ev.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for w in range(prog.workers):
            ev.append({"name": "thread_name", "ph": "M", "pid": r, "tid": w, "args": {"name": f"worker {w}"}})
            ev.append({"name": "thread_sort_index", "ph": "M", "pid": r, "tid": w,
                       "args": {"sort_index": w}})
    wait_slice: dict[int, tuple[float, float]] = {}
    span = max((e for _, _, e in times.values()), default=0.0)
    for k in sorted(times, key=lambda i: times[i][1]):
        t = prog.tasks[k]
        head, start, end = times[k]
        nbytes = task_bytes(t, buffers, seq_len)
        dur = max(0.0, end - start)
        waits = [f"{w.counter}>={w.threshold}" + ("@prev" if w.offset < 0 else "") for w in t.waits]
        if t.waits and start - head > 0:
            ts, wd = _us(head), _us(start) - _us(head)
            wait_slice[k] = (ts, wd)
            ev.append({"name": "wait " + ", ".join(waits), "cat": "wait", "ph": "X", "pid": t.rank,
                       "tid": t.worker, "ts": ts, "dur": wd,
                       "args": {"task": t.id, "counters": waits}})
        ev.append({"name": t.id, "cat": t.op, "ph": "X", "pid": t.rank, "tid": t.worker,
                   "ts": _us(start), "dur": _us(end) - _us(start),
                   "args": {"op": t.op, "layer": _layer(t.id), "stage": stage_of(t.id), "bytes": nbytes,
                            "gbps": round(nbytes / dur / 1e9, 3) if dur > 0 else None,
                            "waits": waits,
                            "signals": [f"{s.counter}+={s.amount}" for s in t.signals]}})
    n = dropped = 0
    for src, dst, i in releases(prog, times):
        s_t, d_t = prog.tasks[src], prog.tasks[dst]
        s_start, s_end = _us(times[src][1]), _us(times[src][2])
        d_start, d_end = _us(times[dst][1]), _us(times[dst][2])
        s_ts = max(s_start, s_end - min(_INSIDE_US, (s_end - s_start) / 2))
        if dst in wait_slice:  # bind to the wait slice, just before it ends
            ws, wd = wait_slice[dst]
            lo, f_ts = ws, ws + wd - min(_INSIDE_US, wd / 2)
        else:  # no wait: the task slice, just after it starts
            lo, f_ts = d_start, d_start + min(_INSIDE_US, (d_end - d_start) / 2)
        if f_ts < s_ts:  # the signal's stamp after the release (clocks of two SMs): any
            s_ts = s_ts if s_ts <= d_end else s_start  # point of the waiter's slices will do
            if s_ts > d_end:
                dropped += 1
                continue
            f_ts = max(s_ts, lo)
        w = d_t.waits[i]
        name = f"{w.counter}>={w.threshold}"
        n += 1
        ev.append({"name": name, "cat": "signal", "ph": "s", "id": n, "pid": s_t.rank,
                   "tid": s_t.worker, "ts": round(s_ts, 6)})
        ev.append({"name": name, "cat": "signal", "ph": "f", "bp": "e", "id": n, "pid": d_t.rank,
                   "tid": d_t.worker, "ts": round(f_ts, 6)})
    est = estimate(prog, seq_len)
    other: dict[str, Any] = {
        "clock": clock,
        "clock_note": ("PREDICTED: the cost model's timeline (lowering/costmodel.py), not a measurement"
                       if clock == "simulated" else
                       "MEASURED: the megakernel's in-kernel %globaltimer stamps of one decode step"),
        "program": prog.name, "ranks": prog.ranks, "workers": prog.workers, "tasks": len(prog.tasks),
        "traced_tasks": len(times), "seq_len": seq_len, "step_us": _us(span),
        "flows": n, "flows_dropped": dropped,
        "roofline": {**est.to_json(), "step_pct_of_roofline":
                     round(100 * est.roofline_s / span, 3) if span > 0 else None},
        "config": dict(prog.config),
    }
    other.update(meta or {})
    return {"traceEvents": ev, "displayTimeUnit": "ns", "otherData": other}


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_trace(obj: Any, amk: bool = True) -> list[str]:
    """Every way ``obj`` breaks the trace-event JSON object format (empty list: valid).

    Checked: an object with a ``traceEvents`` list; each event an object with a known ``ph``
    and a string ``name``; integer ``pid`` / ``tid``; finite ``ts`` >= 0 (``dur`` >= 0 for
    "X"); "M" events of a known name with their ``args``; ``args`` an object; the "X" slices
    of one track nest (no partial overlap: the viewers cannot draw it); each flow ``id`` has
    one "s" and one "f" of the same ``cat`` and ``name``, the "f" not before the "s", each
    inside an "X" slice of its track. ``amk``: also every track named by "M" events and
    ``otherData.clock`` one of CLOCKS."""
    out: list[str] = []
    if not isinstance(obj, dict):
        return [f"a trace must be a JSON object, got {type(obj).__name__}"]
    evs = obj.get("traceEvents")
    if not isinstance(evs, list):
        return ["the object has no 'traceEvents' list"]
    try:
        json.dumps(obj, allow_nan=False)
    except (TypeError, ValueError) as e:
        out.append(f"not strict JSON: {e}")
    slices: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    flows: dict[Any, dict[str, tuple[int, dict]]] = {}
    named_p, named_t, used = set(), set(), set()
    for i, e in enumerate(evs):
        where = f"traceEvents[{i}]"
        if not isinstance(e, dict):
            out.append(f"{where}: not an object")
            continue
        ph = e.get("ph")
        if ph not in PHASES:
            out.append(f"{where}: unknown ph {ph!r}")
            continue
        if not isinstance(e.get("name"), str):
            out.append(f"{where}: 'name' must be a string")
        if "args" in e and not isinstance(e["args"], dict):
            out.append(f"{where}: 'args' must be an object")
        for f in ("pid", "tid"):
            if f in e and (not isinstance(e[f], int) or isinstance(e[f], bool)):
                out.append(f"{where}: '{f}' must be an integer")
        if ph == "M":
            if e.get("name") not in METADATA_NAMES:
                out.append(f"{where}: unknown metadata event {e.get('name')!r}")
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            if e.get("name") in ("process_name", "thread_name") and not isinstance(args.get("name"), str):
                out.append(f"{where}: {e.get('name')} needs args.name (a string)")
            if e.get("name") == "process_name":
                named_p.add(e.get("pid"))
            if e.get("name") == "thread_name":
                named_t.add((e.get("pid"), e.get("tid")))
            continue
        if "pid" not in e or "tid" not in e:
            out.append(f"{where}: ph {ph!r} needs 'pid' and 'tid'")
            continue
        if not _num(e.get("ts")) or e["ts"] < 0:
            out.append(f"{where}: 'ts' must be a finite number >= 0 (microseconds)")
            continue
        track = (e["pid"], e["tid"])
        used.add(track)
        if ph == "X":
            if not _num(e.get("dur")) or e["dur"] < 0:
                out.append(f"{where}: an 'X' event needs a finite 'dur' >= 0 (microseconds)")
                continue
            slices.setdefault(track, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), i))
        elif ph in ("s", "t", "f"):
            if not isinstance(e.get("id"), (int, str)) or isinstance(e.get("id"), bool):
                out.append(f"{where}: a flow event needs an 'id' (integer or string)")
                continue
            if ph == "f" and e.get("bp", "e") != "e":
                out.append(f"{where}: 'bp' of a flow end must be 'e'")
            key = (e.get("cat"), e.get("name"), e["id"])
            if ph in flows.setdefault(key, {}):
                out.append(f"{where}: flow id {e['id']!r} has a second {ph!r} event")
            flows[key][ph] = (i, e)
    eps = 1e-6
    for track, lst in slices.items():
        lst.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[float, float, int]] = []
        for a, b, i in lst:
            while stack and stack[-1][1] <= a + eps:
                stack.pop()
            if stack and b > stack[-1][1] + eps:
                out.append(f"traceEvents[{i}]: slice [{a}, {b}] on pid {track[0]} tid {track[1]} partly "
                           f"overlaps traceEvents[{stack[-1][2]}] (slices of one track must nest)")
            stack.append((a, b, i))

    def inside(e: dict) -> bool:
        return any(a - eps <= e["ts"] <= b + eps for a, b, _ in slices.get((e["pid"], e["tid"]), ()))

    for (cat, name, fid), ends in flows.items():
        if "s" not in ends or "f" not in ends:
            out.append(f"flow id {fid!r} ({name}) lacks its {'s' if 's' not in ends else 'f'!r} event")
            continue
        (si, s), (fi, f) = ends["s"], ends["f"]
        if f["ts"] < s["ts"] - eps:
            out.append(f"traceEvents[{fi}]: flow id {fid!r} ends before it starts")
        for j, e in ((si, s), (fi, f)):
            if not inside(e):
                out.append(f"traceEvents[{j}]: flow id {fid!r} is not inside a slice of its track")
    if amk:
        for pid, tid in sorted(used):
            if pid not in named_p:
                out.append(f"pid {pid} has no process_name metadata event")
            if (pid, tid) not in named_t:
                out.append(f"pid {pid} tid {tid} has no thread_name metadata event")
        other = obj.get("otherData")
        if not isinstance(other, dict) or other.get("clock") not in CLOCKS:
            out.append(f"otherData.clock must be one of {', '.join(CLOCKS)}")
    return out


def read_trace(path: str) -> dict[str, Any]:
    """The trace object of a JSON file, gzip-compressed when its name ends in ``.gz`` (as
    Perfetto and chrome://tracing also open it); AmkError (exit 2) naming the file (and
    line:column) when it cannot be read or is not JSON."""
    import gzip

    from ground.files import parse_json, read_json

    if not str(path).endswith(".gz"):
        return read_json(path, "the trace")
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise AmkError(f"{path}: cannot read the trace: {getattr(e, 'strerror', None) or e}") from None
    return parse_json(text, path, "the trace")


def task_durations(trace: Any, source: str = "the trace") -> dict[str, float]:
    """Task id -> duration in seconds of every task slice of ``trace`` (an object as
    ``build_trace`` writes it, e.g. from ``read_trace`` of an ``amk profile --trace`` file):
    an "X" event whose ``args`` carry the task's ``op`` (the wait slices, ``cat`` ``wait``,
    are not tasks); its ``name`` is the task id as the program spells it (tasks of every rank,
    ``pid`` = rank, keep their ids) and its ``dur`` (microseconds) the time from its waits
    being met to its end. A task traced twice keeps its longest slice. Raises AmkError (one
    line, naming ``source``) for an object that is not a trace or holds no task slice."""
    evs = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(evs, list):
        raise AmkError(f"{source}: not a trace (a JSON object with a 'traceEvents' list)")
    out: dict[str, float] = {}
    for e in evs:
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") == "wait":
            continue
        args = e.get("args")
        if not isinstance(args, dict) or "op" not in args or not isinstance(e.get("name"), str) \
                or not _num(e.get("dur")) or e["dur"] < 0:
            continue
        out[e["name"]] = max(out.get(e["name"], 0.0), float(e["dur"]) * 1e-6)
    if not out:
        raise AmkError(f"{source}: the trace holds no task slices (\"X\" events named by a task id "
                       "with args.op, as `amk profile --trace` writes)")
    return out
