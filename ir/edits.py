"""Typed schedule edits: a small language of changes to a ScheduleProgram, and their application.

An edit list is JSON: a list of objects, each with an ``"op"`` and that op's typed fields
(docs/ir.md, "Schedule edits", has the table and examples). Tasks are named by id. The
language is deliberately able to express unsafe schedules (a wait on a signal that comes
later in the same queue, a dropped wait, a moved signal): the validator, not the edit
language, decides whether the result may run.

``parse_edits(obj)`` checks the list against the schema and returns ``Edit`` objects;
``apply_edits(prog, edits)`` applies them in order to a copy of the program. Both raise
``EditError`` (an AmkError, exit code 2) naming the edit's index and the field, e.g.
``edit 2 (move): field 'worker': expected an integer >= 0, got "1"``.

The ``replace`` op (re-place one stage by a placement policy) needs the lowering's
placement rules and cost model, which live above this package; ``apply_edits`` takes them
as ``placer`` (``lowering.placement.apply_edits`` passes it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from ground.errors import AmkError
from ir.program import Bound, Range, Region, ScheduleProgram, Signal, Task, Wait

#: the placement policies of the lowering (lowering.config.POLICIES, repeated here because
#: ir/ sits below lowering/; tests/test_edits.py checks that they agree)
POLICIES = ("round_robin", "balanced", "stage")
#: ops whose tiles ``split`` and ``merge`` handle: weight rows split, the output rows with them
GEMV_FAMILY = ("gemv", "norm_gemv", "gemv_res", "swiglu_gemv", "reduce_norm_gemv")
#: per op, the input roles cut along with the output rows (the rest is the whole input vector)
ROW_INPUTS = {"gemv": ("w", "bias", "scale"), "norm_gemv": ("w", "bias", "scale"), "gemv_res": ("w", "r", "scale"),
              "swiglu_gemv": ("w", "r", "scale"), "reduce_norm_gemv": ("w", "bias", "scale")}


class EditError(AmkError):
    """A malformed edit list, or an edit that cannot be applied (unknown task, a split of a
    non-GEMV task, ...). One line naming the edit's index, op and field; exit code 2."""


# -- the schema ----------------------------------------------------------------------------
# field kinds: "id" (non-empty string), "int>=0", "int>=1", "int" (any integer),
# "offset" (0 or -1), "policy", "str"
SCHEMA: dict[str, dict[str, tuple[str, bool]]] = {
    "move": {"task": ("id", True), "worker": ("int>=0", False), "before": ("id", False),
             "after": ("id", False), "position": ("int>=0", False)},
    "swap": {"a": ("id", True), "b": ("id", True)},
    "split": {"task": ("id", True), "rows": ("int>=1", False), "ids": ("ids2", False)},
    "merge": {"a": ("id", True), "b": ("id", True), "id": ("id", False)},
    "replace": {"stage": ("id", True), "policy": ("policy", True), "rank": ("int>=0", False)},
    "refine_wait": {"counter": ("id", True), "task": ("id", False)},
    "add_wait": {"task": ("id", True), "counter": ("id", True), "threshold": ("int", True),
                 "offset": ("offset", False)},
    "drop_wait": {"task": ("id", True), "counter": ("id", True), "offset": ("offset", False)},
    "add_signal": {"task": ("id", True), "counter": ("id", True), "amount": ("int", False)},
    "drop_signal": {"task": ("id", True), "counter": ("id", True)},
    "add_counter": {"name": ("id", True), "rank": ("int>=0", True), "width": ("width", False)},
}

#: one line per op, for help texts and the MCP tool description
OP_HELP = {
    "move": "move a task to another worker of its rank and/or queue position "
            "(worker; before | after: a task id of that queue | position: index in it)",
    "swap": "exchange the queue slots (worker and position) of two tasks of one rank",
    "split": "split a GEMV-family tile into two by weight rows (rows: the first tile's rows, "
             "default half); full-threshold waits on its counters count both halves",
    "merge": "merge two adjacent tiles of one stage (rows a then b) into one task at a's place",
    "replace": "re-place one stage's tasks (stage: the task id without .tN and .rN, e.g. "
               "l0.q) by a placement policy: round_robin | balanced | stage",
    "refine_wait": "replace a stage-wide wait on a counter by a finer counter per consumer: "
                   "only the signallers whose outputs the consumer reads",
    "add_wait": "add wait(counter >= threshold [@prev]) to a task",
    "drop_wait": "remove a task's wait on a counter",
    "add_signal": "add signal(counter += amount) to a task",
    "drop_signal": "remove a task's signal to a counter",
    "add_counter": "declare a new counter (name, rank, width 32|64)",
}


@dataclass(frozen=True)
class Edit:
    """One checked edit: ``op`` and its fields (``fields``: the JSON object minus ``op``);
    ``index``: its position in the list (for messages)."""

    index: int
    op: str
    fields: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def where(self) -> str:
        return f"edit {self.index} ({self.op})"


def _show(v: Any) -> str:
    try:
        s = json.dumps(v)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _check_field(kind: str, v: Any) -> str | None:
    """None if ``v`` is a valid value of ``kind``, else what was expected."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if kind == "id":
        return None if isinstance(v, str) and v else "a non-empty string (a task or counter id)"
    if kind == "ids2":
        ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) and x for x in v) \
            and v[0] != v[1]
        return None if ok else "a list of two different task ids"
    if kind == "int":
        return None if is_int else "an integer"
    if kind == "int>=0":
        return None if is_int and v >= 0 else "an integer >= 0"
    if kind == "int>=1":
        return None if is_int and v >= 1 else "an integer >= 1"
    if kind == "offset":
        return None if is_int and v in (0, -1) else "0 (this step) or -1 (the previous step)"
    if kind == "width":
        return None if is_int and v in (32, 64) else "32 or 64"
    if kind == "policy":
        return None if v in POLICIES else "one of " + ", ".join(POLICIES)
    raise AssertionError(kind)


def parse_edits(obj: Any, source: str = "edits") -> list[Edit]:
    """Check a decoded JSON value against the edit schema; the edits in order.

    Raises EditError (exit 2) with ``"{source}: edit {i} ({op}): field '{f}': ..."`` for the
    first problem: not a list, an edit that is not an object, an unknown op or field, a
    missing required field, a value of the wrong type.
    """
    if isinstance(obj, dict) and "edits" in obj and len(obj) == 1:
        obj = obj["edits"]
    if not isinstance(obj, list):
        raise EditError(f"{source}: expected a JSON list of edit objects, got {type(obj).__name__}")
    out = []
    for i, e in enumerate(obj):
        if not isinstance(e, dict):
            raise EditError(f"{source}: edit {i}: expected an object with an \"op\", got {_show(e)}")
        op = e.get("op")
        if op not in SCHEMA:
            raise EditError(f"{source}: edit {i}: field 'op': unknown op {_show(op)}; known ops: "
                            + ", ".join(SCHEMA))
        spec = SCHEMA[op]
        for k in e:
            if k != "op" and k not in spec:
                raise EditError(f"{source}: edit {i} ({op}): unknown field {k!r}; {op} takes "
                                + ", ".join(spec))
        for k, (kind, required) in spec.items():
            if k not in e:
                if required:
                    raise EditError(f"{source}: edit {i} ({op}): missing required field {k!r}")
                continue
            bad = _check_field(kind, e[k])
            if bad:
                raise EditError(f"{source}: edit {i} ({op}): field {k!r}: expected {bad}, got "
                                f"{_show(e[k])}")
        if op == "move":
            given = [k for k in ("before", "after", "position") if k in e]
            if len(given) > 1:
                raise EditError(f"{source}: edit {i} (move): give at most one of 'before', "
                                f"'after', 'position', got {', '.join(given)}")
            if not given and "worker" not in e:
                raise EditError(f"{source}: edit {i} (move): give 'worker' and/or one of "
                                "'before', 'after', 'position'")
        if op in ("swap", "merge") and e["a"] == e["b"]:
            raise EditError(f"{source}: edit {i} ({op}): fields 'a' and 'b' name the same task")
        if op == "add_signal" and "amount" in e and e["amount"] == 0:
            raise EditError(f"{source}: edit {i} (add_signal): field 'amount': a signal of 0 "
                            "does nothing")
        out.append(Edit(i, op, {k: v for k, v in e.items() if k != "op"}))
    return out


def load_edits(text: str, source: str = "edits") -> list[Edit]:
    """``parse_edits`` of a JSON text; invalid JSON is an EditError naming line:column."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise EditError(f"{source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    return parse_edits(obj, source)


# -- application -----------------------------------------------------------------------------
class _Edit:
    """The program being edited plus lookups kept in step with it."""

    def __init__(self, prog: ScheduleProgram):
        self.p = prog

    def index_of(self, e: Edit, tid: str, field: str) -> int:
        for i, t in enumerate(self.p.tasks):
            if t.id == tid:
                return i
        raise EditError(f"{e.where()}: field {field!r}: no task {tid!r} in the program")

    def task(self, e: Edit, field: str) -> Task:
        return self.p.tasks[self.index_of(e, e[field], field)]

    def counter(self, e: Edit, name: str, field: str = "counter"):
        c = self.p.counter_map().get(name)
        if c is None:
            raise EditError(f"{e.where()}: field {field!r}: no counter {name!r} in the program "
                            "(declare it with add_counter)")
        return c


def stage_of(task_id: str) -> str:
    """A task's stage name: its id without the tile index ``.tN`` and rank ``.rN`` parts
    (``l0.q.t3.r1`` -> ``l0.q``, ``l0.attn.red.t0.r0`` -> ``l0.attn.red``)."""
    parts = task_id.split(".")
    keep = [p for p in parts if not re.fullmatch(r"t\d+(_\d+)*|r\d+", p)]
    return ".".join(keep)


def _move(ed: _Edit, e: Edit) -> None:
    tasks = ed.p.tasks
    i = ed.index_of(e, e["task"], "task")
    t = tasks[i]
    key = "before" if "before" in e.fields else "after" if "after" in e.fields else None
    ref = tasks[ed.index_of(e, e[key], key)] if key else None
    if ref is not None and ref.id == t.id:
        raise EditError(f"{e.where()}: field {key!r}: a task cannot move {key} itself")
    # with before/after and no worker, the task joins the named task's queue
    worker = e.get("worker", ref.worker if ref is not None else t.worker)
    if worker >= ed.p.workers:
        raise EditError(f"{e.where()}: field 'worker': {worker} is not a worker of the program "
                        f"({ed.p.workers} per rank)")
    del tasks[i]
    moved = dataclasses.replace(t, worker=worker)
    queue = [k for k, x in enumerate(tasks) if x.rank == t.rank and x.worker == worker]
    if ref is not None:
        if (ref.rank, ref.worker) != (t.rank, worker):
            raise EditError(f"{e.where()}: field {key!r}: task {ref.id!r} runs on @r{ref.rank}."
                            f"w{ref.worker}, not on the target queue @r{t.rank}.w{worker}")
        j = tasks.index(ref)
        at = j if key == "before" else j + 1
    elif "position" in e.fields:
        pos = e["position"]
        if pos > len(queue):
            raise EditError(f"{e.where()}: field 'position': {pos} is past the end of queue "
                            f"@r{t.rank}.w{worker} ({len(queue)} other tasks)")
        at = queue[pos] if pos < len(queue) else (queue[-1] + 1 if queue else i)
    else:  # a worker only: keep the task's place in program order
        at = i
    tasks.insert(at, moved)


def _swap(ed: _Edit, e: Edit) -> None:
    tasks = ed.p.tasks
    i, j = ed.index_of(e, e["a"], "a"), ed.index_of(e, e["b"], "b")
    a, b = tasks[i], tasks[j]
    if a.rank != b.rank:
        raise EditError(f"{e.where()}: tasks {a.id!r} (@r{a.rank}) and {b.id!r} (@r{b.rank}) "
                        "are on different ranks; a task's regions belong to its rank")
    tasks[i] = dataclasses.replace(b, worker=a.worker)
    tasks[j] = dataclasses.replace(a, worker=b.worker)


def _row_region(reg: Region, a: int, b: int, weight: bool = False) -> Region:
    """``reg`` with the rows [a, b) (relative to its first row) of its row axis: axis 0 of a
    weight ``[N, K]`` (``weight``), else the last axis (vectors, receive-buffer rows)."""
    ax = 0 if weight else len(reg.ranges) - 1
    rng = reg.ranges[ax]
    lo = rng.start
    new = Range(Bound(lo.const + a, lo.coef), Bound(lo.const + b, lo.coef))
    return dataclasses.replace(reg, ranges=reg.ranges[:ax] + (new,) + reg.ranges[ax + 1:])


def _row_first(role: str, reg: Region) -> bool:
    """Whether an input's rows are its first axis: a weight ``[N, K]`` and a per-group scale
    ``[N, K / G]`` (ir/ops.py); a per-row scale is a vector."""
    return role == "w" or (role == "scale" and len(reg.ranges) > 1)


def _rows(t: Task) -> int:
    y = t.outs[0]
    return y.ranges[-1].stop.const - y.ranges[-1].start.const


def _roles(t: Task, p=None) -> list[str]:
    """The role of each of ``t``'s inputs; with the program ``p``, a quantized weight's
    trailing scale input (ir/ops.py) is ``scale``."""
    from ir.ops import OPS, scale_index

    spec = OPS[t.op]
    roles = list(spec.ins) + list(spec.optional_ins)
    if p is not None and spec.scaled:
        bufs = p.buffer_map()
        dts = [bufs[r.buffer].dtype if r.buffer in bufs else "" for r in t.ins]
        if scale_index(spec, dts) is not None:
            return roles[:len(t.ins) - 1] + ["scale"]
    return roles[:len(t.ins)]


def _split_ids(tid: str) -> list[str]:
    """Default ids of a split tile's halves: ``l0.q.t3.r0`` -> ``l0.q.t3_0.r0``, ``l0.q.t3_1.r0``."""
    m = list(re.finditer(r"(^|\.)t\d+(_\d+)*(?=\.|$)", tid))
    if not m:
        return [f"{tid}_0", f"{tid}_1"]
    end = m[-1].end()
    return [f"{tid[:end]}_{k}{tid[end:]}" for k in (0, 1)]


def _split(ed: _Edit, e: Edit) -> None:
    tasks = ed.p.tasks
    i = ed.index_of(e, e["task"], "task")
    t = tasks[i]
    if t.op not in GEMV_FAMILY:
        raise EditError(f"{e.where()}: field 'task': {t.id!r} is a {t.op} task; split cuts "
                        f"GEMV-family tiles ({', '.join(GEMV_FAMILY)})")
    n = _rows(t)
    k = e.get("rows", n // 2)
    if not 0 < k < n:
        raise EditError(f"{e.where()}: field 'rows': {k} does not cut the tile's {n} rows "
                        f"(expected 1 .. {n - 1})")
    ids = e.get("ids") or _split_ids(t.id)
    have = {x.id for x in tasks}
    for nid in ids:
        if nid in have and nid != t.id:
            raise EditError(f"{e.where()}: field 'ids': a task {nid!r} already exists")
    cut = set(ROW_INPUTS[t.op])

    def half(a: int, b: int, nid: str) -> Task:
        ins = tuple(_row_region(r, a, b, _row_first(role, r)) if role in cut else r
                    for r, role in zip(t.ins, _roles(t, ed.p)))
        outs = tuple(_row_region(r, a, b) for r in t.outs)
        return dataclasses.replace(t, id=nid, ins=ins, outs=outs, params=dict(t.params))

    old_n = ed.p.signals_per_epoch()
    tasks[i:i + 1] = [half(0, k, ids[0]), half(k, n, ids[1])]
    # a wait that counted every signal of a counter this tile signals counts both halves
    _retarget_full_waits(ed.p, old_n)


def _retarget_full_waits(p: ScheduleProgram, old_n: dict[str, int]) -> None:
    """Waits whose threshold was N(c) (all of a step's signals) before an edit changed N(c)
    wait for the new N(c)."""
    new_n = p.signals_per_epoch()
    changed = {c for c in new_n if new_n[c] != old_n.get(c, 0)}
    if not changed:
        return
    for k, t in enumerate(p.tasks):
        if any(w.counter in changed and w.threshold == old_n.get(w.counter) for w in t.waits):
            p.tasks[k] = dataclasses.replace(t, waits=tuple(
                Wait(w.counter, new_n[w.counter], w.offset)
                if w.counter in changed and w.threshold == old_n.get(w.counter) else w
                for w in t.waits))


def _merge(ed: _Edit, e: Edit) -> None:
    tasks = ed.p.tasks
    i, j = ed.index_of(e, e["a"], "a"), ed.index_of(e, e["b"], "b")
    a, b = tasks[i], tasks[j]
    why = None
    if a.op not in GEMV_FAMILY:
        why = f"{a.id!r} is a {a.op} task, not a GEMV-family tile"
    elif (a.op, a.rank, a.params, a.group, len(a.ins), len(a.outs)) != \
            (b.op, b.rank, b.params, b.group, len(b.ins), len(b.outs)):
        why = "the tiles differ in op, rank, params, group or operand count (not one stage)"
    else:
        cut = set(ROW_INPUTS[a.op])
        for ra, rb, role in zip(a.ins, b.ins, _roles(a, ed.p)):
            if role not in cut and ra != rb:
                why = f"their {role} inputs differ (not one stage)"
                break
        if why is None:
            na = _rows(a)
            pairs = [(ra, rb, _row_first(role, ra)) for ra, rb, role in zip(a.ins, b.ins, _roles(a, ed.p))
                     if role in cut]
            pairs += [(ra, rb, False) for ra, rb in zip(a.outs, b.outs)]
            for ra, rb, wt in pairs:
                if _row_region(ra, na, na + _rows(b), wt) != rb:
                    why = f"b's rows do not follow a's in {ra.buffer} (not adjacent)"
                    break
    if why:
        raise EditError(f"{e.where()}: cannot merge {a.id!r} and {b.id!r}: {why}")
    cut = set(ROW_INPUTS[a.op])
    n = _rows(a) + _rows(b)
    ins = tuple(_row_region(r, 0, n, _row_first(role, r)) if role in cut else r
                for r, role in zip(a.ins, _roles(a, ed.p)))
    outs = tuple(_row_region(r, 0, n) for r in a.outs)
    waits: dict[tuple[str, int], int] = {}
    for w in a.waits + b.waits:
        waits[(w.counter, w.offset)] = max(waits.get((w.counter, w.offset), w.threshold), w.threshold)
    sig: dict[str, int] = {}
    for s in a.signals + b.signals:  # the merged tile signals for both: N(c) is unchanged
        sig[s.counter] = sig.get(s.counter, 0) + s.amount
    merged = dataclasses.replace(a, id=e.get("id", a.id), ins=ins, outs=outs,
                                 waits=tuple(Wait(c, t, o) for (c, o), t in waits.items()),
                                 signals=tuple(Signal(c, k) for c, k in sig.items()))
    if merged.id != a.id and merged.id in {x.id for x in tasks}:
        raise EditError(f"{e.where()}: field 'id': a task {merged.id!r} already exists")
    tasks[i] = merged
    del tasks[j]


def _overlaps(r1: Region, r2: Region, slots: int) -> bool:
    if r1.buffer != r2.buffer or r1.rank != r2.rank or len(r1.ranges) != len(r2.ranges):
        return False
    for s in range(max(1, slots)):
        if all(a.at(s)[0] < b.at(s)[1] and b.at(s)[0] < a.at(s)[1]
               for a, b in zip(r1.ranges, r2.ranges)):
            return True
    return False


def _refine_wait(ed: _Edit, e: Edit) -> None:
    p = ed.p
    c = ed.counter(e, e["counter"])
    n = p.signals_per_epoch().get(c.name, 0)
    if "task" in e.fields:
        consumers = [ed.index_of(e, e["task"], "task")]
    else:
        consumers = [k for k, t in enumerate(p.tasks)
                     if any(w.counter == c.name and w.offset == 0 and w.threshold == n for w in t.waits)]
    if not consumers:
        raise EditError(f"{e.where()}: field 'counter': no task waits for all {n} signals of "
                        f"{c.name!r} in its own step (a stage-wide wait)")
    producers = [k for k, t in enumerate(p.tasks) if any(s.counter == c.name for s in t.signals)]
    names = {x.name for x in p.counters}
    for k in consumers:
        t = p.tasks[k]
        if not any(w.counter == c.name and w.offset == 0 and w.threshold == n for w in t.waits):
            raise EditError(f"{e.where()}: field 'task': {t.id!r} has no stage-wide wait "
                            f"(>= {n}, this step) on {c.name!r}")
        mine = [q for q in producers
                if any(_overlaps(o, i, p.slots) for o in p.tasks[q].outs for i in t.ins)]
        fine = f"{c.name}.{t.id}"
        while fine in names:
            fine += "_"
        names.add(fine)
        p.counters.append(dataclasses.replace(c, name=fine))
        for q in mine:
            pt = p.tasks[q]
            p.tasks[q] = dataclasses.replace(pt, signals=pt.signals + (Signal(fine, 1),))
        waits = tuple(w for w in t.waits if not (w.counter == c.name and w.offset == 0))
        if mine:
            waits += (Wait(fine, len(mine)),)
        p.tasks[k] = dataclasses.replace(p.tasks[k], waits=waits)


def _add_wait(ed: _Edit, e: Edit) -> None:
    k = ed.index_of(e, e["task"], "task")
    ed.counter(e, e["counter"])
    t = ed.p.tasks[k]
    ed.p.tasks[k] = dataclasses.replace(
        t, waits=t.waits + (Wait(e["counter"], e["threshold"], e.get("offset", 0)),))


def _drop_wait(ed: _Edit, e: Edit) -> None:
    k = ed.index_of(e, e["task"], "task")
    t = ed.p.tasks[k]
    keep = tuple(w for w in t.waits if not (w.counter == e["counter"]
                                             and ("offset" not in e.fields or w.offset == e["offset"])))
    if len(keep) == len(t.waits):
        raise EditError(f"{e.where()}: field 'counter': task {t.id!r} has no wait on "
                        f"{e['counter']!r}" + (f" at offset {e['offset']}" if "offset" in e.fields else ""))
    ed.p.tasks[k] = dataclasses.replace(t, waits=keep)


def _add_signal(ed: _Edit, e: Edit) -> None:
    k = ed.index_of(e, e["task"], "task")
    ed.counter(e, e["counter"])
    t = ed.p.tasks[k]
    ed.p.tasks[k] = dataclasses.replace(t, signals=t.signals + (Signal(e["counter"], e.get("amount", 1)),))


def _drop_signal(ed: _Edit, e: Edit) -> None:
    k = ed.index_of(e, e["task"], "task")
    t = ed.p.tasks[k]
    keep = tuple(s for s in t.signals if s.counter != e["counter"])
    if len(keep) == len(t.signals):
        raise EditError(f"{e.where()}: field 'counter': task {t.id!r} does not signal "
                        f"{e['counter']!r}")
    ed.p.tasks[k] = dataclasses.replace(t, signals=keep)


def _add_counter(ed: _Edit, e: Edit) -> None:
    from ir.program import Counter

    if e["name"] in ed.p.counter_map():
        raise EditError(f"{e.where()}: field 'name': a counter {e['name']!r} already exists")
    if e["rank"] >= ed.p.ranks:
        raise EditError(f"{e.where()}: field 'rank': {e['rank']} is not a rank of the program "
                        f"({ed.p.ranks} ranks)")
    ed.p.counters.append(Counter(e["name"], e["rank"], e.get("width", 32)))


_APPLY: dict[str, Callable[[_Edit, Edit], None]] = {
    "move": _move, "swap": _swap, "split": _split, "merge": _merge, "refine_wait": _refine_wait,
    "add_wait": _add_wait, "drop_wait": _drop_wait, "add_signal": _add_signal,
    "drop_signal": _drop_signal, "add_counter": _add_counter,
}

Placer = Callable[[ScheduleProgram, str, str, "int | None"], ScheduleProgram]


def apply_edits(prog: ScheduleProgram, edits: list[Edit], placer: Placer | None = None
                ) -> ScheduleProgram:
    """Apply ``edits`` in order to a copy of ``prog`` (``prog`` is not changed).

    ``placer(program, stage, policy, rank)`` performs a ``replace`` edit
    (``lowering.placement.replace_stage``); without it a ``replace`` edit is an EditError.
    The result is not validated: run ``validator.validate`` on it. Raises EditError (exit 2)
    for an edit that names a missing task or counter or cannot apply (a split of a non-GEMV
    task, a merge of non-adjacent tiles, a move onto another rank's queue, ...).
    """
    ed = _Edit(prog.copy())
    for e in edits:
        if e.op == "replace":
            if placer is None:
                raise EditError(f"{e.where()}: replace needs the lowering's placement "
                                "(lowering.placement.apply_edits)")
            ed.p = placer(ed.p, e["stage"], e["policy"], e.get("rank"))
            continue
        _APPLY[e.op](ed, e)
    return ed.p
