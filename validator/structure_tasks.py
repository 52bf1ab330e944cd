"""The task half of the structure pass: tasks, regions, operands, waits and signals.

``check_tasks`` checks every task against the IR contract (ir/program.py, ir/ops.py) with
numpy expressions over flat columns, read with ``operator.attrgetter`` and
``itertools.chain`` (no per-task Python logic), and returns the flat arrays of the
:class:`~validator.structure.Index`. A column that is not uniformly well typed is read
element by element instead, and only the rows a check flags are visited in Python, to word
their findings. So a valid program of 150k tasks costs a few numpy passes, and a malformed
one gets every finding, in program order (task by task, each task's in the order below).

Per task, in order (a fatal problem skips what depends on it):

1. head: a non-empty, unique string id, rank, worker and an IR op (fatal: the task is
   skipped); the op implemented by the backend; group a string or null; ins, outs, waits
   and signals lists and params a dict (fatal: the task is skipped);
2. arity;
3. regions, ins then outs: a known buffer, the rank, one range per axis, start/stop bounds,
   int bounds, a constant extent and in bounds at every slot (affine in the slot, so the
   first and last slot suffice) (fatal: the region is skipped); a put's destination
   symmetric; no remote write to a local buffer; no remote read; a local region naming its
   owner rank;
4. operands, of tasks with the right arity and sound regions: the dtype of each operand,
   params, the op's shape check (run once per distinct signature of op, params, dtypes and
   squeezed shapes);
5. waits: a known counter, an int threshold and offset 0 or -1 (fatal: the wait is
   skipped), a counter of the task's own rank;
6. signals: a known counter, an int amount, an amount > 0 (fatal: the signal is skipped).

Equal range, wait and signal tuples that are one shared object (the text parser and the
lowering build them so) are read once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any

import numpy as np

from ir.ops import OPS
from ir.program import DTYPES

BACKENDS = ("sim", "triton")
OP_NAMES = list(OPS)
OP_ID = {n: i for i, n in enumerate(OP_NAMES)}
OP_PUT, OP_QUIET, OP_FENCE = OP_ID["put"], OP_ID["quiet"], OP_ID["fence"]
# int64-safe clamp of wait thresholds (validator/structure.py's module doc)
THR_CLAMP_LOW, THR_CLAMP_HIGH = 1 << 61, 1 << 62
DT_ID = {d: i for i, d in enumerate(DTYPES)}
MAX_IN = max(s.max_ins_all for s in OPS.values())  # a quantized weight's scale included
MAX_OUT = max(s.max_outs for s in OPS.values())  # mirror outputs included
N_OPER = MAX_IN + MAX_OUT
# bounds and dims up to this size are checked in int64 (no product can wrap); larger ones
# as Python ints
_SMALL = 1 << 31

_MIN_IN = np.array([OPS[n].min_ins for n in OP_NAMES])
_MAX_IN = np.array([OPS[n].max_ins_all for n in OP_NAMES])
_MIN_OUT = np.array([OPS[n].min_outs for n in OP_NAMES])
_MAX_OUT = np.array([OPS[n].max_outs for n in OP_NAMES])


def _dtype_table() -> np.ndarray:
    """``[op, operand slot, dtype]`` -> allowed; slots ``0..MAX_IN-1`` are ins, then outs."""
    ok = np.zeros((len(OP_NAMES), N_OPER, len(DTYPES)), dtype=bool)
    for o, name in enumerate(OP_NAMES):
        spec = OPS[name]
        for i in range(spec.max_ins_all):
            for d in spec.dtypes_for_in(i):
                ok[o, i, DT_ID[d]] = True
        for i in range(spec.max_outs):
            for d in spec.dtypes_for_out(i):
                ok[o, MAX_IN + i, DT_ID[d]] = True
    return ok


_DT_OK = _dtype_table()
_B4 = attrgetter("start.const", "start.coef", "stop.const", "stop.coef")
_SEQ = (tuple, list)
_SEQT = {tuple, list}
# finding phases of one task, in the order they are reported
HEAD, ARITY, REGION, DTYPE, PARAMS, SHAPE, WAIT, SIGNAL = range(8)


def is_int(x: Any) -> bool:
    """Exactly an int: bool and float are not ints here."""
    return type(x) is int


def _all_int(xs) -> bool:
    """Every element is exactly an int (not bool, not float); C-speed via map(type)."""
    return set(map(type, xs)) <= {int}


def _all_type(xs, types: set) -> bool:
    return set(map(type, xs)) <= types


# ------------------------------------------------------------------------------------------
# columns
# ------------------------------------------------------------------------------------------

def _attr_lists(objs: list, names: tuple[str, ...]) -> list:
    """One sequence per attribute of ``objs`` (C-level passes); an object that lacks one
    reads it as None (the checks then report it)."""
    try:
        if len(names) > 3:  # one pass and a transpose beat many passes over many fields
            cols = list(zip(*map(attrgetter(*names), objs)))
            return cols if cols else [() for _ in names]
        return [list(map(attrgetter(a), objs)) for a in names]
    except AttributeError:
        return [[getattr(o, a, None) for o in objs] for a in names]


def _mask(xs, ok_types: set, pred) -> np.ndarray:
    """``pred(x)`` for every element; all True without a Python call per element when every
    type is in ``ok_types`` (``pred`` holds for those)."""
    if _all_type(xs, ok_types):
        return np.ones(len(xs), dtype=bool)
    return np.fromiter(map(pred, xs), bool, len(xs))


def _ints_in(xs, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, ok)``: ok where the element is an int in ``[lo, hi)``; int64 values, 0
    where not ok."""
    n = len(xs)
    if _all_int(xs):
        try:
            a = np.fromiter(xs, np.int64, n)
        except OverflowError:
            a = None
        if a is not None:
            ok = (a >= lo) & (a < hi)
            return (a if ok.all() else np.where(ok, a, 0)), ok
    ok = np.fromiter((is_int(x) and lo <= x < hi for x in xs), bool, n)
    return np.fromiter((x if o else 0 for x, o in zip(xs, ok)), np.int64, n), ok


def _exact_ints(xs) -> tuple[np.ndarray, np.ndarray]:
    """``(values, ok)``: ok where the element is an int; values int64, or Python ints in an
    object array when one exceeds int64; 0 where not ok."""
    n = len(xs)
    if _all_int(xs):
        try:
            return np.fromiter(xs, np.int64, n), np.ones(n, dtype=bool)
        except OverflowError:
            ok = np.ones(n, dtype=bool)
    else:
        ok = np.fromiter(map(is_int, xs), bool, n)
    vals = [x if o else 0 for x, o in zip(xs, ok)]
    try:
        return np.asarray(vals, dtype=np.int64).reshape(n), ok
    except OverflowError:
        return np.asarray(vals, dtype=object).reshape(n), ok


def _lookup(names: list, table: dict[str, int], missing: int) -> np.ndarray:
    """``table[name]`` per element (names must be strings), ``missing`` where unknown."""
    try:
        got = list(map(table.get, names))
    except TypeError:  # an unhashable name
        got = [table.get(x) if isinstance(x, str) else None for x in names]
    if None in got:
        got = [missing if g is None else g for g in got]
    return np.asarray(got, dtype=np.int64).reshape(len(names))


def _take(a, idx):
    return a if idx is None else a[idx]


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each group of a flat array starts, for groups of ``counts`` elements."""
    return np.cumsum(counts) - counts


def _expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate arange(starts[i], starts[i] + counts[i])."""
    tot = int(counts.sum())
    off = np.repeat(starts - _starts(counts), counts)
    return off + np.arange(tot)


def _flat_shared(seqs, n: int):
    """Per-task tuples -> (count per task, elements to read, index of each task element
    into them). Tuples that are one shared object (the text parser shares equal wait and
    signal tuples) are read once; ``index`` is None when nothing is shared."""
    counts = np.fromiter(map(len, seqs), np.int64, n)
    ids = np.fromiter(map(id, seqs), np.int64, n)
    uid, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    if len(uid) >= 0.8 * n:
        return counts, list(chain.from_iterable(seqs)), None
    uc = counts[first]
    elems = list(chain.from_iterable([seqs[i] for i in first.tolist()]))
    ustart = _starts(uc)
    return counts, elems, _expand_ranges(ustart[inv.ravel()], counts)


def _position_in_task(counts: np.ndarray) -> np.ndarray:
    """For elements grouped per task (``counts`` per task): each one's index in its task."""
    tot = int(counts.sum())
    return np.arange(tot) - np.repeat(_starts(counts), counts)


# ------------------------------------------------------------------------------------------
# findings
# ------------------------------------------------------------------------------------------

class _Report:
    """Task findings keyed by where they belong: ``(task position, phase, operand / wait /
    signal index, check)``. ``flush`` emits them in program order."""

    def __init__(self) -> None:
        self.items: list[tuple[tuple, tuple]] = []

    def add(self, key: tuple, cls: str, message: str, tasks=(), buffers=(), witness=None,
            fatal: bool = False) -> None:
        self.items.append((key, (cls, message, tasks, buffers, witness, fatal)))

    def flush(self, out) -> None:
        """Add every finding to ``out`` (a validator.structure._Collector) in program order."""
        self.items.sort(key=itemgetter(0))
        for _, (cls, message, tasks, buffers, witness, fatal) in self.items:
            out.add(cls, message, tasks, buffers, witness, fatal)


@dataclass
class Geometry:
    """The program-level facts the task checks need."""

    ranks: int
    workers: int
    slots: int
    backend: Any  # checked by the caller; not one of BACKENDS: no op-support check


@dataclass
class Declared:
    """The buffers and counters that passed their checks (validator/structure.py), numbered
    in declaration order."""

    buf_names: list[str] = field(default_factory=list)
    buf_id: dict[str, int] = field(default_factory=dict)
    buf_kind: list[str] = field(default_factory=list)
    buf_dtype: list[str] = field(default_factory=list)
    buf_shape: list[tuple[int, ...]] = field(default_factory=list)
    buf_sym: list[bool] = field(default_factory=list)
    buf_owner: list[int] = field(default_factory=list)  # -1 for symmetric buffers
    ctr_names: list[str] = field(default_factory=list)
    ctr_id: dict[str, int] = field(default_factory=dict)
    ctr_rank: list[int] = field(default_factory=list)
    ctr_width: list[int] = field(default_factory=list)

    @property
    def axes(self) -> int:
        """Axes of the flat region arrays: the most of any buffer (at least 1)."""
        return max((len(s) for s in self.buf_shape), default=1)


def check_tasks(tasks: list, geo: Geometry, decl: Declared, out) -> dict[str, Any]:
    """Check every task (module doc); add the findings to ``out`` in program order and
    return the flat arrays of the tasks, regions, waits and signals that passed their
    fatal checks (``validator.structure.Index`` fields: ``task_ids``, ``t_rank``,
    ``t_worker``, ``t_op``, ``t_group``, ``r_*``, ``lo_*``/``hi_*``, ``w_*``, ``s_*``).
    Never raises on malformed tasks."""
    rep = _Report()
    tk = _check_heads(tasks, geo, rep)
    arity_ok = _check_arity(tk, rep)
    rg = _check_regions(tk, geo, decl, rep)
    _check_operands(tk, rg, arity_ok, decl, rep)
    waits = _check_waits(tk, decl, rep)
    signals = _check_signals(tk, decl, rep)
    rep.flush(out)
    return dict(task_ids=tk.ids, t_rank=tk.rank, t_worker=tk.worker, t_op=tk.op,
                t_group=tk.group, **rg.arrays(), **waits, **signals)


# ------------------------------------------------------------------------------------------
# 1. task heads
# ------------------------------------------------------------------------------------------

_TASK_FIELDS = ("id", "rank", "worker", "op", "group", "ins", "outs", "params", "waits",
                "signals")


@dataclass
class _Tasks:
    """The tasks that passed the head checks, in program order (``pos``: index in
    ``prog.tasks``); the Index numbers them ``0..n-1``."""

    pos: np.ndarray
    ids: list
    rank: np.ndarray
    worker: np.ndarray
    op: np.ndarray
    names: list  # op names
    group: list
    n_in: np.ndarray
    n_out: np.ndarray
    ins: list
    outs: list
    params: list
    waits: list
    signals: list

    def key(self, i: int, phase: int, sub: int = 0, check: int = 0) -> tuple:
        return (int(self.pos[i]), phase, sub, check)


def _check_heads(tasks: list, geo: Geometry, rep: _Report) -> _Tasks:
    """Step 1: ids, ranks, workers, ops, backend support, groups and field types."""
    cols = _attr_lists(tasks, _TASK_FIELDS)
    ids, rk, wk, ops, grp, ins, outs, prm, wts, sgs = cols
    id_set = set(ids) if _all_type(ids, {str}) else None
    id_ok = _id_mask(ids, id_set)
    dup = _duplicates(ids, id_ok, id_set)
    t_rank, rank_ok = _ints_in(rk, 0, geo.ranks)
    t_worker, worker_ok = _ints_in(wk, 0, geo.workers)
    t_op = _lookup(ops, OP_ID, -1)
    passed = id_ok & ~dup & rank_ok & worker_ok & (t_op >= 0)
    if not passed.all():
        _report_heads(np.flatnonzero(~passed), cols, id_ok, dup, rank_ok, worker_ok, t_op,
                      geo, rep)
    _report_backend(passed, ids, ops, t_op, geo.backend, rep)
    group_ok = _mask(grp, {str, type(None)}, lambda g: g is None or isinstance(g, str))
    for i in np.flatnonzero(passed & ~group_ok).tolist():
        rep.add((i, HEAD, 0, 2), "BadTask", f"task {ids[i]}: group must be a string or null, "
                f"got {grp[i]!r}", tasks=[ids[i]])
    boxes_ok = (_mask(ins, _SEQT, lambda x: isinstance(x, _SEQ))
                & _mask(outs, _SEQT, lambda x: isinstance(x, _SEQ))
                & _mask(prm, {dict}, lambda x: isinstance(x, dict))
                & _mask(wts, _SEQT, lambda x: isinstance(x, _SEQ))
                & _mask(sgs, _SEQT, lambda x: isinstance(x, _SEQ)))
    for i in np.flatnonzero(passed & ~boxes_ok).tolist():
        rep.add((i, HEAD, 0, 3), "BadTask", f"task {ids[i]}: ins, outs, waits and signals "
                f"must be lists and params a dict", tasks=[ids[i]], fatal=True)
    groups = grp if group_ok.all() else [g if ok else None for g, ok in zip(grp, group_ok)]
    return _select(passed & boxes_ok, ids, t_rank, t_worker, t_op, ops, groups, ins, outs,
                   prm, wts, sgs)


def _id_mask(ids: list, id_set: set | None) -> np.ndarray:
    """Ids that are non-empty strings (``id_set``: the set of ids when all are strings)."""
    if id_set is not None and "" not in id_set:
        return np.ones(len(ids), dtype=bool)
    return np.fromiter((isinstance(x, str) and x != "" for x in ids), bool, len(ids))


def _duplicates(ids: list, id_ok: np.ndarray, id_set: set | None) -> np.ndarray:
    """Tasks whose (valid) id an earlier task with a valid id already has."""
    n = len(ids)
    if id_set is not None and len(id_set) == n and id_ok.all():
        return np.zeros(n, dtype=bool)
    seen: set[str] = set()
    dup = np.zeros(n, dtype=bool)
    for i, (tid, ok) in enumerate(zip(ids, id_ok.tolist())):
        if ok:
            if tid in seen:
                dup[i] = True
            seen.add(tid)
    return dup


def _report_heads(bad, cols, id_ok, dup, rank_ok, worker_ok, t_op, geo, rep) -> None:
    """The first failing head check of each task in ``bad`` (all fatal)."""
    ids, rk, wk, ops = cols[0], cols[1], cols[2], cols[3]
    R, W = geo.ranks, geo.workers
    for i in bad.tolist():
        tid, key = ids[i], (i, HEAD, 0, 0)
        if not id_ok[i]:
            rep.add(key, "BadTask", f"task id must be a non-empty string, got {tid!r}",
                    fatal=True)
        elif dup[i]:
            rep.add(key, "DuplicateTask", f"task id {tid} is used twice", tasks=[tid],
                    fatal=True)
        elif not rank_ok[i]:
            rep.add(key, "BadTask", f"task {tid}: rank {rk[i]!r} is not in [0, {R})",
                    tasks=[tid], fatal=True)
        elif not worker_ok[i]:
            rep.add(key, "BadTask", f"task {tid}: worker {wk[i]!r} is not in [0, {W})",
                    tasks=[tid], fatal=True)
        else:
            rep.add(key, "UnknownOp", f"task {tid}: op {ops[i]!r} is not an IR op",
                    tasks=[tid], witness={"op": ops[i]}, fatal=True)


def _report_backend(passed, ids, ops, t_op, be, rep) -> None:
    """UnsupportedOp for the tasks whose op the backend does not implement."""
    if be not in BACKENDS:
        return
    supported = np.asarray([be in OPS[n].backends for n in OP_NAMES] + [True])
    for i in np.flatnonzero(passed & ~supported[t_op]).tolist():
        rep.add((i, HEAD, 0, 1), "UnsupportedOp", f"task {ids[i]}: op {ops[i]} is not "
                f"implemented by backend {be}", tasks=[ids[i]],
                witness={"op": ops[i], "backend": be})


def _select(keep, ids, rank, worker, op, names, groups, ins, outs, prm, wts, sgs) -> _Tasks:
    """The tasks where ``keep`` holds (all columns filtered alike)."""
    if keep.all():
        sel = np.arange(len(ids))
    else:
        sel = np.flatnonzero(keep)
        pick = sel.tolist()
        ids, names, groups, ins, outs, prm, wts, sgs = (
            [col[i] for i in pick] for col in (ids, names, groups, ins, outs, prm, wts, sgs))
        rank, worker, op = rank[sel], worker[sel], op[sel]
    n = len(sel)
    return _Tasks(sel, list(ids), rank, worker, op, names, groups,
                  np.fromiter(map(len, ins), np.int64, n),
                  np.fromiter(map(len, outs), np.int64, n), ins, outs, prm, wts, sgs)


# ------------------------------------------------------------------------------------------
# 2. arity
# ------------------------------------------------------------------------------------------

def _check_arity(tk: _Tasks, rep: _Report) -> np.ndarray:
    """Step 2: the number of ins and outs each op takes. Returns the mask of tasks with the
    right arity (their operands are checked in step 4)."""
    n_in, n_out, op = tk.n_in, tk.n_out, tk.op
    ok = (n_in >= _MIN_IN[op]) & (n_in <= _MAX_IN[op]) & (n_out >= _MIN_OUT[op]) & \
        (n_out <= _MAX_OUT[op])
    for i in np.flatnonzero(~ok).tolist():
        name, tid = tk.names[i], tk.ids[i]
        rep.add(tk.key(i, ARITY), "BadArity", f"task {tid}: op {name} takes "
                f"{OPS[name].arity_text()}, got {int(n_in[i])} and {int(n_out[i])}",
                tasks=[tid], witness={"op": name, "ins": int(n_in[i]), "outs": int(n_out[i])})
    return ok


# ------------------------------------------------------------------------------------------
# 3. regions
# ------------------------------------------------------------------------------------------

@dataclass
class _Regions:
    """Every region of the checked tasks (ins then outs, task by task) with its bounds
    (``[n, axes]``; padded axes ``[0, 1)``); ``ok`` marks those that passed the fatal
    checks."""

    task: np.ndarray
    out: np.ndarray
    operand: np.ndarray  # index within ins / outs
    place: np.ndarray  # index within ins + outs
    names: list
    ranks: list  # as written
    buf: np.ndarray
    rank: np.ndarray
    lo_c: np.ndarray
    lo_k: np.ndarray
    hi_c: np.ndarray
    hi_k: np.ndarray
    ok: np.ndarray

    def role(self, j: int) -> str:
        return f"{'outs' if self.out[j] else 'ins'}[{int(self.operand[j])}]"

    def arrays(self) -> dict[str, np.ndarray]:
        """The Index's region arrays: the regions that passed the fatal checks."""
        keep = slice(None) if self.ok.all() else self.ok
        as64 = (lambda a: a[keep].astype(np.int64)) if self.lo_c.dtype == object else \
            (lambda a: a[keep])
        return dict(r_task=self.task[keep], r_out=self.out[keep], r_buf=self.buf[keep],
                    r_rank=self.rank[keep], r_operand=self.operand[keep],
                    lo_c=as64(self.lo_c), lo_k=as64(self.lo_k), hi_c=as64(self.hi_c),
                    hi_k=as64(self.hi_k))


def _check_regions(tk: _Tasks, geo: Geometry, decl: Declared, rep: _Report) -> _Regions:
    """Step 3: every region of every task."""
    rg, rranges = _read_regions(tk, decl, geo.ranks)
    nb = len(decl.buf_shape)
    ndim = np.asarray([len(s) for s in decl.buf_shape] + [-1], dtype=np.int64)
    nr = _lengths(rranges)
    cand = (rg.buf < nb) & (rg.rank >= 0) & (nr == ndim[rg.buf])
    code = np.zeros(len(rranges), dtype=np.int64)  # 1 not bounds, 2 not ints (fatal)
    if cand.any():
        _read_bounds(rg, rranges, cand, nr, code)
    sound = cand & (code == 0)
    bad_axis = _axis_problems(rg, sound, decl, geo.slots)
    rg.ok = sound & ~bad_axis
    if not rg.ok.all():
        _report_regions(tk, rg, rranges, nr, code, geo, decl, rep)
    _check_placement(tk, rg, decl, rep)
    return rg


def _read_regions(tk: _Tasks, decl: Declared, R: int) -> tuple[_Regions, list]:
    """The flat regions of the tasks: buffer (``len(buffers)`` if unknown) and rank (-1 if
    not an int in ``[0, R)``); the ranges as written go alongside."""
    n, n_in = len(tk.ids), tk.n_in
    n_ops = n_in + tk.n_out
    regs = list(chain.from_iterable(map(tuple.__add__, map(tuple, tk.ins), map(tuple, tk.outs))))
    r_task = np.repeat(np.arange(n), n_ops)
    place = _position_in_task(n_ops)
    r_out = place >= n_in[r_task]
    operand = np.where(r_out, place - n_in[r_task], place)
    names, ranks, rranges = _attr_lists(regs, ("buffer", "rank", "ranges"))
    buf = _lookup(names, decl.buf_id, len(decl.buf_shape))
    rank, rank_ok = _ints_in(ranks, 0, R)
    if not rank_ok.all():
        rank[~rank_ok] = -1
    A, nreg = decl.axes, len(regs)
    return _Regions(r_task, r_out, operand, place, names, ranks, buf, rank,
                    np.zeros((nreg, A), dtype=np.int64), np.zeros((nreg, A), dtype=np.int64),
                    np.ones((nreg, A), dtype=np.int64), np.zeros((nreg, A), dtype=np.int64),
                    np.ones(nreg, dtype=bool)), rranges


def _lengths(seqs: list) -> np.ndarray:
    """``len`` of each list or tuple, -1 for anything else."""
    n = len(seqs)
    if _all_type(seqs, _SEQT):
        return np.fromiter(map(len, seqs), np.int64, n)
    return np.fromiter((len(s) if isinstance(s, _SEQ) else -1 for s in seqs), np.int64, n)


def _read_bounds(rg: _Regions, rranges: list, cand: np.ndarray, nr: np.ndarray,
                 code: np.ndarray) -> None:
    """The bounds of the candidate regions into ``rg.lo_c/lo_k/hi_c/hi_k`` (object arrays
    of Python ints when a bound is large); ``code[j]`` = 1 where a range of region ``j`` is
    not start/stop bounds, 2 where a bound is not an int."""
    sel = np.flatnonzero(cand)
    picked = rranges if len(sel) == len(rranges) else [rranges[j] for j in sel.tolist()]
    nr_sel = nr[sel]
    # range tuples are often shared objects (the text parser caches them): read each once
    rid = np.fromiter(map(id, picked), np.int64, len(picked))
    uid, first_of, inv = np.unique(rid, return_index=True, return_inverse=True)
    if len(uid) < 0.8 * len(picked):
        u_ranges, nr_u = [picked[i] for i in first_of.tolist()], nr_sel[first_of]
    else:
        u_ranges, nr_u, inv = picked, nr_sel, None
    vals, attr_bad, int_bad = _bound_values(list(chain.from_iterable(u_ranges)))
    starts_u = _starts(nr_u)
    if attr_bad.any() or int_bad.any():
        u_code = np.where(np.logical_or.reduceat(attr_bad, starts_u), 1,
                          np.where(np.logical_or.reduceat(int_bad, starts_u), 2, 0))
        code[sel] = u_code if inv is None else u_code[inv.ravel()]
    if inv is not None:  # expand back to every region
        vals = vals[_expand_ranges(starts_u[inv], nr_u[inv])]
    if vals.dtype == object or (vals > _SMALL).any() or (vals < -_SMALL).any():
        vals = vals.astype(object)
        for name in ("lo_c", "lo_k", "hi_c", "hi_k"):
            setattr(rg, name, getattr(rg, name).astype(object))
    rows = np.repeat(sel, nr_sel)
    axes = _position_in_task(nr_sel)
    rg.lo_c[rows, axes], rg.lo_k[rows, axes], rg.hi_c[rows, axes], rg.hi_k[rows, axes] = vals.T


def _bound_values(rngs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[n, 4]`` (start.const, start.coef, stop.const, stop.coef) of Range objects (int64,
    or object for ints beyond it; 0 where unreadable), and per range whether it is not
    start/stop bounds and whether a bound is not an int. Shared Range objects (a producer
    that caches its Range constructor) are read once; a sample decides whether that pays."""
    n = len(rngs)
    sample = rngs[:4096]
    inv = None
    if n > 8192 and len(set(map(id, sample))) < 0.8 * len(sample):
        _, first, inv = np.unique(np.fromiter(map(id, rngs), np.int64, n), return_index=True,
                                  return_inverse=True)
        rngs = [rngs[i] for i in first.tolist()]
    try:
        flat = list(chain.from_iterable(map(_B4, rngs)))
        attr_bad = np.zeros(len(rngs), dtype=bool)
    except AttributeError:
        got = [_bounds_or_none(r) for r in rngs]
        attr_bad = np.fromiter((g is None for g in got), bool, len(got))
        flat = list(chain.from_iterable(g or (0, 0, 0, 0) for g in got))
    vals, ok = _exact_ints(flat)
    vals, int_bad = vals.reshape(-1, 4), ~ok.reshape(-1, 4).all(axis=1)
    if inv is not None:
        inv = inv.ravel()
        return vals[inv], attr_bad[inv], int_bad[inv]
    return vals, attr_bad, int_bad


def _bounds_or_none(rg: Any) -> tuple | None:
    try:
        return _B4(rg)
    except AttributeError:
        return None


def _axis_problems(rg: _Regions, sound: np.ndarray, decl: Declared, S: int) -> np.ndarray:
    """Regions (among ``sound``) with an axis whose extent changes with the slot or that
    leaves the buffer (or is empty) at the first or last slot."""
    exact = rg.lo_c.dtype == object or S - 1 > _SMALL or \
        any(d > _SMALL for s in decl.buf_shape for d in s)
    lo_c, lo_k, hi_c, hi_k = ((a.astype(object) for a in (rg.lo_c, rg.lo_k, rg.hi_c, rg.hi_k))
                              if exact else (rg.lo_c, rg.lo_k, rg.hi_c, rg.hi_k))
    dimr = _dims(decl, exact)[rg.buf]
    bad = np.asarray(lo_k != hi_k, dtype=bool)
    for s in ((0, S - 1) if S > 1 else (0,)):
        lo, hi = lo_c + lo_k * s, hi_c + hi_k * s
        bad |= np.asarray((lo < 0) | (lo >= hi) | (hi > dimr), dtype=bool)
    return sound & bad.any(axis=1) if bad.any() else bad[:, 0]


def _dims(decl: Declared, exact: bool) -> np.ndarray:
    """``[buffers + 1, axes]`` buffer dims (padded axes 1; a last all-ones row for unknown
    buffers); Python ints in an object array when ``exact``."""
    A = decl.axes
    rows = [list(s) + [1] * (A - len(s)) for s in decl.buf_shape]
    rows.append([1] * A)
    return np.asarray(rows, dtype=object if exact else np.int64)


def _report_regions(tk: _Tasks, rg: _Regions, rranges, nr, code, geo, decl, rep) -> None:
    """The first failing fatal check of each region that is not ok."""
    nb = len(decl.buf_shape)
    for j in np.flatnonzero(~rg.ok).tolist():
        i = int(rg.task[j])
        tid, role, bname = tk.ids[i], rg.role(j), rg.names[j]
        key = tk.key(i, REGION, int(rg.place[j]), 0)
        if rg.buf[j] == nb:
            rep.add(key, "UnknownBuffer", f"task {tid}: {role} names unknown buffer "
                    f"{bname!r}", tasks=[tid], buffers=[str(bname)], fatal=True)
            continue
        where = dict(tasks=[tid], buffers=[bname], fatal=True)
        ndim = len(decl.buf_shape[int(rg.buf[j])])
        if rg.rank[j] < 0:
            rep.add(key, "BadRegion", f"task {tid}: {role} {bname}: rank {rg.ranks[j]!r} is not in "
                    f"[0, {geo.ranks})", **where)
        elif nr[j] != ndim:
            n = nr[j] if nr[j] >= 0 else rranges[j]
            rep.add(key, "BadRegion", f"task {tid}: {role} {bname} has {n} ranges, the "
                    f"buffer has {ndim} axes", **where)
        elif code[j] == 1:
            rep.add(key, "BadRegion", f"task {tid}: {role} {bname}: a range is not "
                    f"start/stop bounds", **where)
        elif code[j] == 2:
            rep.add(key, "BadRegion", f"task {tid}: {role} {bname}: bounds must be ints",
                    **where)
        else:
            _report_axis(tid, role, bname, rg, j, decl.buf_shape[int(rg.buf[j])], geo.slots,
                         key, rep)


def _report_axis(tid, role, bname, rg: _Regions, j: int, shape, S: int, key, rep) -> None:
    """The first axis of region ``j`` whose extent changes with the slot or that is out of
    bounds (or empty) at the first or last slot."""
    where = dict(tasks=[tid], buffers=[bname], fatal=True)
    for ax in range(len(shape)):
        lc, lk, hc, hk = (int(a[j, ax]) for a in (rg.lo_c, rg.lo_k, rg.hi_c, rg.hi_k))
        if lk != hk:
            rep.add(key, "BadRegion", f"task {tid}: {role} {bname}: axis {ax} extent changes "
                    f"with the slot (start coef {lk}, stop coef {hk})", **where)
            return
        for s in ((0, S - 1) if S > 1 else (0,)):
            lo, hi = lc + lk * s, hc + hk * s
            if not 0 <= lo < hi <= shape[ax]:
                rep.add(key, "RegionOutOfBounds", f"task {tid}: {role} {bname} axis {ax} = "
                        f"[{lo}:{hi}) at slot {s} is outside [0:{shape[ax]}) or empty",
                        witness={"task": tid, "operand": role, "buffer": bname, "axis": ax,
                                 "slot": s, "range": [lo, hi], "dim": shape[ax]}, **where)
                return


def _check_placement(tk: _Tasks, rg: _Regions, decl: Declared, rep: _Report) -> None:
    """Where a sound region may live: a put writes a symmetric buffer; only symmetric
    buffers are written remotely; a task reads only its own rank's memory; a local
    region names its buffer's owner rank."""
    sym = np.asarray(list(decl.buf_sym) + [False], dtype=bool)[rg.buf]
    owner = np.asarray(list(decl.buf_owner) + [-1], dtype=np.int64)[rg.buf]
    trk = tk.rank[rg.task]
    ok, out, local = rg.ok, rg.out, ~sym
    put = ok & out & local & (tk.op[rg.task] == OP_PUT)
    remote_write = ok & out & local & (rg.rank != trk)
    out_owner = ok & out & local & (rg.rank == trk) & (rg.rank != owner)
    remote_read = ok & ~out & ((rg.rank != trk) | (local & (owner != trk)))
    in_owner = ok & ~out & local & (rg.rank != owner)
    if not (put.any() or remote_write.any() or out_owner.any() or remote_read.any()
            or in_owner.any()):
        return
    for j in np.flatnonzero(put | remote_write | out_owner | remote_read | in_owner).tolist():
        i = int(rg.task[j])
        tid, role, bname = tk.ids[i], rg.role(j), rg.names[j]
        trank, rrank, own = int(trk[j]), int(rg.rank[j]), int(owner[j])
        where = dict(tasks=[tid], buffers=[bname])
        p = int(rg.place[j])
        if put[j]:
            rep.add(tk.key(i, REGION, p, 1), "BadRegion", f"task {tid}: put destination "
                    f"{bname} is not a symmetric buffer (NVSHMEM puts address the symmetric "
                    f"heap)", **where)
        if remote_write[j]:
            rep.add(tk.key(i, REGION, p, 2), "RemoteWriteToLocal", f"task {tid}: {role} "
                    f"writes local buffer {bname} of rank {own} from rank {trank}; only "
                    f"symmetric buffers can be written remotely",
                    witness={"task_rank": trank, "region_rank": rrank}, **where)
        if remote_read[j]:
            seen = rrank if sym[j] else own
            rep.add(tk.key(i, REGION, p, 2), "RemoteRead", f"task {tid}: {role} reads "
                    f"{bname} on rank {seen} from rank {trank}; a task reads only its own "
                    f"rank's memory", witness={"task_rank": trank, "region_rank": seen},
                    **where)
        if out_owner[j] or in_owner[j]:
            rep.add(tk.key(i, REGION, p, 3), "BadRegion", f"task {tid}: {role} {bname} is "
                    f"local to rank {own} but the region names rank {rrank}", fatal=True,
                    **where)


# ------------------------------------------------------------------------------------------
# 4. operands: dtypes, params, shape checks
# ------------------------------------------------------------------------------------------

def _check_operands(tk: _Tasks, rg: _Regions, arity_ok: np.ndarray, decl: Declared,
                    rep: _Report) -> None:
    """Step 4, for the tasks with the right arity and sound regions: operand dtypes, params
    and the op's shape check."""
    n = len(tk.ids)
    whole = arity_ok if rg.ok.all() else \
        arity_ok & (np.bincount(rg.task[~rg.ok], minlength=n) == 0)
    regs = whole[rg.task]
    dt = np.asarray([DT_ID[d] for d in decl.buf_dtype] + [0], dtype=np.int64)[rg.buf]
    slot = np.where(rg.out, MAX_IN + rg.operand, rg.operand)
    if not regs.all():
        slot[~regs] = 0
    bad_dt = regs & ~_DT_OK[tk.op[rg.task], slot, dt]
    for j in np.flatnonzero(bad_dt).tolist():
        _report_dtype(tk, rg, j, decl.buf_dtype[int(rg.buf[j])], rep)
    pid, distinct = _param_ids(tk)
    checked = whole & ~_check_task_params(tk, whole, pid, distinct, rep)
    _check_shapes(tk, rg, checked, pid, regs, dt, slot, rep)


def _report_dtype(tk: _Tasks, rg: _Regions, j: int, dtype: str, rep: _Report) -> None:
    i, k = int(rg.task[j]), int(rg.operand[j])
    spec, tid = OPS[tk.names[i]], tk.ids[i]
    if rg.out[j]:
        what, allowed, role = "output", spec.dtypes_for_out(k), f"outs[{k}]"
    else:
        what, allowed, role = "input", spec.dtypes_for_in(k), f"ins[{k}]"
    rep.add(tk.key(i, DTYPE, int(rg.place[j])), "BadDtype", f"task {tid}: op {spec.name} "
            f"{what} {k} must be one of {'/'.join(allowed)}, got {dtype}", tasks=[tid],
            witness={"operand": role, "dtype": dtype})


def _param_ids(tk: _Tasks) -> tuple[np.ndarray, list]:
    """An id per task for its distinct ``(op, sorted params items)``, and those pairs in id
    order; ``-1 - i`` for a task ``i`` whose params cannot be keyed (names that do not sort,
    unhashable values: a params error in any case)."""
    n = len(tk.ids)
    intern: dict = {}
    try:
        keys = [tuple(sorted(p.items())) if p else () for p in tk.params]
        pid = np.fromiter((intern.setdefault(x, len(intern)) for x in zip(tk.names, keys)),
                          np.int64, n)
    except TypeError:
        intern = {}
        pid = np.fromiter((_param_id(intern, o, p, i) for i, (o, p) in
                           enumerate(zip(tk.names, tk.params))), np.int64, n)
    return pid, list(intern)


def _param_id(intern: dict, op: str, params: dict, i: int) -> int:
    try:
        return intern.setdefault((op, tuple(sorted(params.items())) if params else ()),
                                 len(intern))
    except TypeError:
        return -1 - i


def _check_task_params(tk: _Tasks, whole: np.ndarray, pid: np.ndarray, distinct: list,
                       rep: _Report) -> np.ndarray:
    """BadParams for the tasks in ``whole`` (each distinct op and params checked once);
    returns the mask of tasks with a params error."""
    group_bad = np.asarray([bool(_check_params(OPS[o], dict(k))) for o, k in distinct] +
                           [True], dtype=bool)
    bad = whole & group_bad[np.where(pid >= 0, pid, len(distinct))]
    for i in np.flatnonzero(bad).tolist():
        errs = _check_params(OPS[tk.names[i]], tk.params[i])  # in this dict's key order
        bad[i] = bool(errs)
        tid = tk.ids[i]
        for m, msg in enumerate(errs):
            rep.add(tk.key(i, PARAMS, m), "BadParams", f"task {tid}: {msg}", tasks=[tid],
                    witness={"params": _jsonable(tk.params[i])})
    return bad


def _check_shapes(tk: _Tasks, rg: _Regions, checked: np.ndarray, pid: np.ndarray,
                  regs: np.ndarray, dt: np.ndarray, slot: np.ndarray, rep: _Report) -> None:
    """The op shape check of every task in ``checked``, run once per distinct signature
    (op, params, dtypes and squeezed shapes of every operand)."""
    has_check = np.asarray([OPS[n].check is not None for n in OP_NAMES])[tk.op]
    rows = np.flatnonzero(checked & has_check)
    if not len(rows):
        return
    sig, used = _signatures(tk, rg, pid, regs, dt, slot)
    sig = sig if len(rows) == len(sig) else sig[rows]
    first, inv = _row_groups(sig)
    results = [_run_shape_check(tk, int(rows[f]), _full_signature(sig[f], used, rg))
               for f in first.tolist()]
    failed = np.asarray([bool(msgs) for msgs, _, _ in results], dtype=bool)
    for r, g in zip(rows[failed[inv]].tolist(), inv[failed[inv]].tolist()):
        msgs, in_s, out_s = results[g]
        tid, name = tk.ids[r], tk.names[r]
        for m, msg in enumerate(msgs):
            rep.add(tk.key(r, SHAPE, m), "BadParams" if "param" in msg else "ShapeMismatch",
                    f"task {tid}: {msg}", tasks=[tid],
                    witness={"op": name, "in_shapes": [list(s) for s in in_s],
                             "out_shapes": [list(s) for s in out_s],
                             "params": _jsonable(tk.params[r])})


def _signatures(tk: _Tasks, rg: _Regions, pid: np.ndarray, regs: np.ndarray, dt: np.ndarray,
                slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sig, used)``: ``sig`` ``[tasks, 2 + len(used) * (axes + 1)]`` int64: params id,
    number of ins, then per operand slot in ``used`` (the slots some region of ``regs``
    fills, ascending) its dtype + 1 (0: no operand) and its squeezed shape, zero-padded (the
    operands of the tasks with ``regs`` regions; other rows hold only the first two). The
    slots no region fills would be zero in every row, so leaving them out groups the rows
    alike (``_full_signature`` restores them for a shape check)."""
    n, A = len(tk.ids), rg.lo_c.shape[1]
    sel = slice(None) if regs.all() else regs
    task, ext = rg.task[sel], (rg.hi_c[sel] - rg.lo_c[sel]).astype(np.int64)
    order = np.argsort(ext == 1, axis=1, kind="stable")
    sq = np.take_along_axis(ext, order, axis=1)
    sq[sq == 1] = 0  # squeezed shape, zero-padded
    filled = np.zeros(N_OPER, dtype=bool)
    filled[slot[sel]] = True
    used = np.flatnonzero(filled)
    compact = np.cumsum(filled) - 1  # operand slot -> its place among the used ones
    sig = np.zeros((n, 2 + len(used) * (A + 1)), dtype=np.int64)
    sig[:, 0] = pid
    sig[:, 1] = tk.n_in
    base = 2 + compact[slot[sel]] * (A + 1)
    sig[task, base] = dt[sel] + 1
    cols = base[:, None] + 1 + np.arange(A)[None, :]
    sig[np.repeat(task, A).reshape(len(task), A), cols] = sq
    return sig, used


def _full_signature(row: np.ndarray, used: np.ndarray, rg: _Regions) -> np.ndarray:
    """A ``_signatures`` row in the layout of every operand slot (``N_OPER``), which
    ``_run_shape_check`` reads."""
    A = rg.lo_c.shape[1]
    full = np.zeros(2 + N_OPER * (A + 1), dtype=np.int64)
    full[:2] = row[:2]
    for k, sl in enumerate(used.tolist()):
        full[2 + sl * (A + 1):2 + (sl + 1) * (A + 1)] = row[2 + k * (A + 1):2 + (k + 1) * (A + 1)]
    return full


def _run_shape_check(tk: _Tasks, t: int, row: np.ndarray) -> tuple[list, list, list]:
    """The op's shape check of task ``t`` on the operands its signature ``row`` spells:
    ``(messages, in shapes, out shapes)``. A check that raises yields one message."""
    A = (len(row) - 2) // N_OPER - 1
    ins_s, ind, outs_s, outd = [], [], [], []
    for sl in range(N_OPER):
        d = int(row[2 + sl * (A + 1)])
        if d == 0:
            continue
        shp = tuple(int(x) for x in row[3 + sl * (A + 1): 3 + sl * (A + 1) + A] if x)
        if sl < MAX_IN:
            ins_s.append(shp)
            ind.append(DTYPES[d - 1])
        else:
            outs_s.append(shp)
            outd.append(DTYPES[d - 1])
    name = tk.names[t]
    try:
        msgs = OPS[name].check(ins_s, ind, outs_s, outd, tk.params[t])
    except Exception as exc:  # a check must not crash the validator
        msgs = [f"{name}: shape check failed on these operands ({exc!r})"]
    return list(msgs or ()), ins_s, outs_s


def _row_groups(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first, inverse)``: one representative row index per distinct row of ``M`` (int64
    ``[n, k]``) and each row's group.

    Rows are hashed with random odd 64-bit multipliers (wrapping arithmetic); every row is
    then compared with its group's representative, and on any collision the exact (slower)
    ``np.unique(axis=0)`` is used, so no distinct signature is ever skipped.
    """
    rng = np.random.default_rng(12345)
    mult = rng.integers(1, 1 << 62, size=M.shape[1], dtype=np.int64) | 1
    with np.errstate(over="ignore"):
        h = (M * mult[None, :]).sum(axis=1) + (M * (mult[None, :] >> 7)).sum(axis=1) * 31
    _, first, inv = np.unique(h, return_index=True, return_inverse=True)
    inv = inv.ravel()
    if (M == M[first[inv]]).all():
        return first, inv
    _, first, inv = np.unique(M, axis=0, return_index=True, return_inverse=True)
    return first, inv.ravel()


def _check_params(spec, params: dict) -> list[str]:
    """Required params present with the declared type; every value an int, float or str."""
    errs = []
    for k, v in params.items():
        if not isinstance(k, str):
            errs.append(f"param name {k!r} is not a string")
        elif not isinstance(v, (int, float, str)):
            errs.append(f"param {k} has type {type(v).__name__}; params are int, float or str")
        elif isinstance(v, float) and not math.isfinite(v):
            errs.append(f"param {k} = {v!r} is not finite")
    for group, required in ((spec.params, True), (spec.optional_params, False)):
        for k, typ in group.items():
            if k not in params:
                if required:
                    errs.append(f"op {spec.name} needs param {k} ({typ.__name__})")
                continue
            v = params[k]
            if typ is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            elif typ is int:
                ok = is_int(v)
            else:
                ok = isinstance(v, typ)
            if not ok:
                errs.append(f"param {k} of op {spec.name} must be {typ.__name__}, got {v!r}")
    return errs


def _jsonable(d: Any) -> Any:
    if isinstance(d, dict):
        return {str(k): _jsonable(v) for k, v in d.items()}
    if isinstance(d, (int, str)) or d is None:
        return d
    if isinstance(d, float):
        return d if math.isfinite(d) else repr(d)
    return repr(d)


# ------------------------------------------------------------------------------------------
# 5. waits, 6. signals
# ------------------------------------------------------------------------------------------

def _sync_column(tk: _Tasks, seqs: list, fields: tuple[str, ...]):
    """The waits or signals of every task, flat: ``(task, index in the task, values of each
    field per element, index into those values or None)``."""
    n = len(tk.ids)
    counts, elems, idx = _flat_shared(seqs, n)
    return np.repeat(np.arange(n), counts), _position_in_task(counts), \
        _attr_lists(elems, fields), idx


def _flagged(tk: _Tasks, task: np.ndarray, k: np.ndarray, idx, phase: int, mask: np.ndarray):
    """Per flagged wait or signal ``j``: ``(j, e, i, task id, finding key)`` with ``e`` its
    index in the values read (``idx``: _sync_column) and ``i`` its task."""
    for j in np.flatnonzero(mask).tolist():
        i = int(task[j])
        yield j, (j if idx is None else int(idx[j])), i, tk.ids[i], tk.key(i, phase, int(k[j]))


def _check_waits(tk: _Tasks, decl: Declared, rep: _Report) -> dict[str, Any]:
    """Step 5: every wait; returns the Index's wait arrays (thresholds clamped to the
    int64-safe range, ``w_thr_src`` as written)."""
    w_task, k, (cname, thr, off), idx = _sync_column(tk, tk.waits, ("counter", "threshold",
                                                                   "offset"))
    ci = _take(_lookup(cname, decl.ctr_id, -1), idx)
    thr_v, thr_int = _exact_ints(thr)
    off_v, off_int = _exact_ints(off)
    form = _take(thr_int & off_int & ((off_v == 0) | (off_v == -1)), idx)
    keep = (ci >= 0) & form
    ctr_rank = np.asarray(list(decl.ctr_rank) + [-1], dtype=np.int64)
    remote = keep & (ctr_rank[ci] != tk.rank[w_task])
    for j, e, i, tid, key in _flagged(tk, w_task, k, idx, WAIT, ~keep | remote):
        c = cname[e]
        if ci[j] < 0:
            rep.add(key, "UnknownCounter", f"task {tid}: waits on unknown counter {c!r}",
                    tasks=[tid], witness={"counter": c}, fatal=True)
        elif not form[j]:
            rep.add(key, "BadWait", f"task {tid}: wait on {c} needs an int threshold and "
                    f"offset 0 or -1, got threshold={thr[e]!r} offset={off[e]!r}",
                    tasks=[tid], fatal=True)
        else:
            own = int(ctr_rank[ci[j]])
            rep.add(key, "RemoteWait", f"task {tid} on rank {int(tk.rank[i])} waits on counter "
                    f"{c} owned by rank {own}; a task may only wait on its own rank's "
                    f"counters", tasks=[tid], witness={"counter": c, "owner": own})
    sel = slice(None) if keep.all() else keep
    src = _take(thr_v, idx)[sel]
    if src.dtype == object:
        src = src.tolist()
        clamped = np.asarray([min(max(t, -THR_CLAMP_LOW), THR_CLAMP_HIGH) for t in src],
                             dtype=np.int64)
    elif (src > THR_CLAMP_HIGH).any() or (src < -THR_CLAMP_LOW).any():
        clamped = np.clip(src, -THR_CLAMP_LOW, THR_CLAMP_HIGH)
    else:
        clamped = src
    return dict(w_task=w_task[sel], w_ctr=ci[sel], w_thr=clamped,
                w_off=np.asarray(_take(off_v, idx)[sel], dtype=np.int64), w_thr_src=src)


def _check_signals(tk: _Tasks, decl: Declared, rep: _Report) -> dict[str, Any]:
    """Step 6: every signal; returns the Index's signal arrays."""
    s_task, k, (cname, amt), idx = _sync_column(tk, tk.signals, ("counter", "amount"))
    ci = _take(_lookup(cname, decl.ctr_id, -1), idx)
    amt_v, amt_int = _exact_ints(amt)
    amt_v, amt_int = _take(amt_v, idx), _take(amt_int, idx)
    keep = (ci >= 0) & amt_int & (amt_v > 0)
    for j, e, _, tid, key in _flagged(tk, s_task, k, idx, SIGNAL, ~keep):
        c, a = cname[e], amt[e]
        if ci[j] < 0:
            rep.add(key, "UnknownCounter", f"task {tid}: signals unknown counter {c!r}",
                    tasks=[tid], witness={"counter": c}, fatal=True)
        elif not amt_int[j]:
            rep.add(key, "BadSignal", f"task {tid}: signal amount to {c} must be an int, "
                    f"got {a!r}", tasks=[tid], fatal=True)
        else:
            rep.add(key, "NonMonotoneCounter", f"task {tid}: signal {c} += {a}: counters "
                    f"are monotone, an amount <= 0 is a reset or decrement", tasks=[tid],
                    witness={"counter": c, "amount": a}, fatal=True)
    sel = slice(None) if keep.all() else keep
    return dict(s_task=s_task[sel], s_ctr=ci[sel], s_amt=np.asarray(amt_v[sel], dtype=np.int64))
