"""An independent dynamic oracle for schedule safety: an abstract executor of a program's
synchronisation that explores interleavings and reports the deadlocks and races it observes.

Independence: this module shares no code with the static validator (validator/validate.py and
its helpers). It imports only the IR (ir/program.py data model, ir/ops.py op contract) and
implements the semantics of ir/program.py's module docstring directly, as an executor.

Model (one *run* = one interleaving of a bounded unroll)
-------------------------------------------------------
* Every rank runs ``E`` epochs (decode steps) of the program, ``E = max(3, slots + 1)``
  (capped by ``max_epochs``): enough for a rank to run a whole step ahead of another and
  for a double-buffered slot to come round again. On rank ``r`` epoch ``e + 1`` starts only
  when every task of rank ``r``'s epoch ``e`` finished and every remote operation rank ``r``
  issued in epoch ``e`` was delivered (the kernel end completes outstanding puts). Ranks
  are otherwise unsynchronised.
* Worker ``(r, w)`` runs its queue serially. A task runs atomically once its waits hold:
  a wait ``c >= t`` with offset ``o`` in epoch ``e`` needs ``value(c) >= (e + o) * N(c) + t``
  (at or below zero it holds trivially and acquires nothing); ``quiet`` additionally needs
  every remote operation its worker issued to be delivered.
* When a task runs it reads its ``ins``, writes its local ``outs`` and applies signals to
  counters of its own rank. A write to another rank's memory, and a signal to another rank's
  counter, become *pending remote operations* of the worker, delivered later in an order
  the run chooses, subject only to NVSHMEM's guarantees:
    - put-with-signal: a task's signal to a counter owned by rank ``d`` is delivered after
      that task's own data for rank ``d`` (nvshmem_put_signal);
    - fence: an operation to rank ``d`` issued after a ``fence`` is delivered after every
      operation to ``d`` the worker issued before it (nvshmem_fence orders per PE only);
    - quiet: the worker blocks until all its operations are delivered (nvshmem_quiet).
  Anything else is unordered: a signal may overtake an earlier put of the same worker.
* Happens-before (HB) is tracked exactly with causal histories: every event (a task
  instance, or the delivery of a remote operation) has a bitset of the events that HB it,
  which is a vector clock in another encoding. Queue order and epoch order extend a
  worker's history; a delivery carries its issuer's history (plus the histories of the
  operations NVSHMEM orders before it); a counter accumulates the union of the histories of
  every increment applied so far (an atomic-add release sequence); a wait that passes joins
  the counter's history (acquire); a quiet joins the histories of its worker's deliveries.
* Memory is tracked per *cell*: the coarsest boxes such that every region of the program is
  a union of cells (exact element granularity, cheaper). Per cell the run keeps the last
  write and the reads since it, and reports
    - ``write_write_race``: two writes not ordered by HB;
    - ``read_write_race``: a read and a write (either order) not ordered by HB;
    - ``uninit_read``: a read of a non-persistent buffer (activation, scratch, io_output)
      that no write of the reader's epoch HB-precedes (never written, partially covered,
      or left over from another step).
  Remote writes take effect at delivery; reads and local writes at task time.
* ``deadlock``: a reachable state where nothing can run (every pending operation
  delivered) and not every task finished. Counters are monotone and waits are ``>=``, so
  running an action never disables another: every maximal run ends in the same stuck set,
  and one run decides deadlock; the witness lists each blocked queue's head.

Exploration: ``runs`` random interleavings with adversarial biases, after the structural
checks. Per run: random worker priorities with random re-prioritisation points (PCT-style,
Burckhardt et al., ASPLOS 2010), a rank that runs ahead, a slow worker that the others may
overtake by a whole step, one task's puts held back while everything else proceeds
(slow worker and held-back puts cycle through all candidates), waiters run as soon as their threshold is met (so they acquire as
few increments as possible: "wrong" increments satisfy a partial wait), and per issuing
rank deliveries of data and of signals that are late, prompt or random (late data with
prompt signals: signals overtake puts). Small
programs are additionally explored exhaustively (DFS over states with state hashing, up to
``max_states`` states). The witness of each problem is the first run (its seed and policy)
that showed it, with the tail of its trace.

Structural problems are observed before and while running: unknown names, queues outside
``ranks x workers``, op contract violations (ir/ops.py OpSpec: arity, dtypes, params, shape
checks), regions outside their buffer, reads of another rank's memory, waits on another
rank's counter, remote writes to local buffers, more workers than the target can keep
co-resident (``too_many_workers``: a persistent kernel whose workers are not all resident
can deadlock), counters that overflow within ``max_epochs`` steps (``N(c) * (max_epochs + 1)
> 2**(width - 1) - 1``) and non-positive signal amounts (``non_monotone``).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ir.ops import OPS, squeeze
from ir.program import (
    BUFFER_KINDS, COUNTER_WIDTHS, DTYPES, ScheduleProgram,
)

#: Oracle problem classes and what each means.
PROBLEM_CLASSES: dict[str, str] = {
    "malformed": "program-level field out of its domain (ranks, workers, slots, buffer/counter declarations, duplicate names)",
    "unknown_name": "a task names a buffer, counter or op that does not exist",
    "bad_queue": "a task's rank or worker is outside ranks x workers",
    "op_contract": "arity, operand dtypes, params or shapes violate the op's ir/ops.py contract",
    "out_of_bounds": "a region is outside its buffer's shape, empty, or has the wrong number of axes",
    "remote_read": "a task reads memory of another rank",
    "remote_wait": "a task waits on a counter owned by another rank",
    "remote_write_local": "a task writes another rank's copy of a local (non-symmetric) buffer",
    "too_many_workers": "more workers per rank than the target can keep co-resident",
    "counter_overflow": "a counter exceeds its signed width within max_epochs steps",
    "non_monotone": "a signal amount is zero or negative (a counter must only grow)",
    "deadlock": "a reachable state where no task can run and not all finished",
    "write_write_race": "two writes of one element not ordered by happens-before",
    "read_write_race": "a read and a write of one element not ordered by happens-before",
    "uninit_read": "a read of a non-persistent element that no write of the same step happens-before",
}

STRUCTURAL_CLASSES = frozenset({
    "malformed", "unknown_name", "bad_queue", "op_contract", "out_of_bounds", "remote_read",
    "remote_wait", "remote_write_local", "too_many_workers", "counter_overflow", "non_monotone",
})
# Structural problems after which the program cannot be executed meaningfully.
_FATAL = frozenset({"malformed", "unknown_name", "bad_queue"})

PERSISTENT_KINDS = frozenset({"weight", "kv_cache", "io_input"})
_PLACEMENTS = ("local", "symmetric")
_TRACE_TAIL = 40


@dataclass
class Problem:
    """One problem the oracle observed. ``cls`` is a key of ``PROBLEM_CLASSES``;
    ``witness`` is JSON-serialisable (for dynamic problems: the run, its seed and policy,
    the events involved and the tail of the interleaving)."""

    cls: str
    message: str
    tasks: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    witness: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"class": self.cls, "message": self.message, "tasks": list(self.tasks),
                "buffers": list(self.buffers), "witness": self.witness}


@dataclass
class OracleResult:
    """The oracle's label of one program: safe iff no problem was observed."""

    problems: list[Problem] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def safe(self) -> bool:
        return not self.problems

    @property
    def classes(self) -> set[str]:
        return {p.cls for p in self.problems}

    def to_json(self) -> dict[str, Any]:
        return {"safe": self.safe, "classes": sorted(self.classes),
                "problems": [p.to_json() for p in self.problems], "stats": self.stats}


# --------------------------------------------------------------------------------------
# Structural checks
# --------------------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _param_ok(v: Any, typ: type) -> bool:
    if typ is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if typ is int:
        return _is_int(v)
    return isinstance(v, typ)


def _structure(prog: ScheduleProgram) -> list[Problem]:
    """Every structural problem of ``prog`` (never raises on malformed input): the sizes,
    then the declarations, then each task, then counter overflow. A malformed size or
    declaration stops there (what follows would be meaningless)."""
    out: list[Problem] = []

    def add(cls: str, msg: str, tasks=(), buffers=()) -> None:
        out.append(Problem(cls, msg, list(tasks), list(buffers)))

    _size_problems(prog, add)
    if any(p.cls == "malformed" for p in out):
        return out
    if _is_int(prog.target.max_workers) and prog.workers > prog.target.max_workers:
        add("too_many_workers", f"{prog.workers} workers per rank exceed the target's "
            f"co-residency limit max_workers={prog.target.max_workers}")
    bufs, ctrs = _declaration_problems(prog, add)
    if any(p.cls == "malformed" for p in out):
        return out
    n_per_epoch = prog.signals_per_epoch()
    for t in prog.tasks:
        _task_problems(prog, t, bufs, ctrs, add)
    _overflow_problems(prog, n_per_epoch, add)
    return out


def _size_problems(prog: ScheduleProgram, add) -> None:
    """ranks, workers, slots and max_epochs: positive ints."""
    for name in ("ranks", "workers", "slots", "max_epochs"):
        v = getattr(prog, name)
        if not _is_int(v) or v < 1:
            add("malformed", f"{name} must be a positive int, got {v!r}")


def _declaration_problems(prog: ScheduleProgram, add) -> tuple[dict, dict]:
    """Buffers (unique, kind/dtype/placement, shape, owner), counters (unique, owner,
    width) and unique task ids; returns the buffers and counters by name."""
    ranks = prog.ranks
    bufs: dict[str, Any] = {}
    for b in prog.buffers:
        if b.name in bufs:
            add("malformed", f"duplicate buffer {b.name!r}", buffers=[b.name])
        bufs[b.name] = b
        if b.kind not in BUFFER_KINDS or b.dtype not in DTYPES or b.placement not in _PLACEMENTS:
            add("malformed", f"buffer {b.name!r}: bad kind/dtype/placement "
                f"({b.kind!r}, {b.dtype!r}, {b.placement!r})", buffers=[b.name])
        if not b.shape or not all(_is_int(d) and d >= 1 for d in b.shape):
            add("malformed", f"buffer {b.name!r}: bad shape {b.shape!r}", buffers=[b.name])
        if b.placement == "local" and not (_is_int(b.rank) and 0 <= b.rank < ranks):
            add("malformed", f"local buffer {b.name!r}: owner rank {b.rank!r} out of range",
                buffers=[b.name])
    ctrs: dict[str, Any] = {}
    for c in prog.counters:
        if c.name in ctrs:
            add("malformed", f"duplicate counter {c.name!r}")
        ctrs[c.name] = c
        if not (_is_int(c.rank) and 0 <= c.rank < ranks) or c.width not in COUNTER_WIDTHS:
            add("malformed", f"counter {c.name!r}: bad owner rank {c.rank!r} or width {c.width!r}")
    seen_ids: set[str] = set()
    for t in prog.tasks:
        if t.id in seen_ids:
            add("malformed", f"duplicate task id {t.id!r}", tasks=[t.id])
        seen_ids.add(t.id)
    return bufs, ctrs


def _task_problems(prog: ScheduleProgram, t, bufs: dict, ctrs: dict, add) -> None:
    """One task: its queue, then its names (op, buffers, counters) with the waits' and
    signals' rules, then (all names known) its regions and its op contract."""
    if not (_is_int(t.rank) and 0 <= t.rank < prog.ranks and _is_int(t.worker)
            and 0 <= t.worker < prog.workers):
        add("bad_queue", f"task {t.id}: queue @r{t.rank}.w{t.worker} is outside "
            f"{prog.ranks} ranks x {prog.workers} workers", [t.id])
        return
    spec = OPS.get(t.op)
    if spec is None:
        add("unknown_name", f"task {t.id}: unknown op {t.op!r}", [t.id])
    if _name_problems(t, bufs, ctrs, add):
        return
    shapes_ok = _region_problems(prog, t, bufs, add)
    if spec is not None:
        _check_op(t, spec, bufs, prog.slots, shapes_ok, add)


def _name_problems(t, bufs: dict, ctrs: dict, add) -> bool:
    """Unknown buffers and counters of task ``t``; remote or malformed waits; malformed or
    non-monotone signals. Returns whether a name was unknown."""
    tid = [t.id]
    unknown = False
    for reg in (*t.ins, *t.outs):
        if reg.buffer not in bufs:
            add("unknown_name", f"task {t.id}: unknown buffer {reg.buffer!r}", tid, [reg.buffer])
            unknown = True
    for w in t.waits:
        if w.counter not in ctrs:
            add("unknown_name", f"task {t.id}: wait on unknown counter {w.counter!r}", tid)
            unknown = True
        else:
            if ctrs[w.counter].rank != t.rank:
                add("remote_wait", f"task {t.id} on rank {t.rank} waits on {w.counter} "
                    f"owned by rank {ctrs[w.counter].rank}", tid)
            if not _is_int(w.threshold) or w.offset not in (0, -1):
                add("malformed", f"task {t.id}: wait {w.counter} needs an int threshold "
                    f"and offset 0 or -1, got {w.threshold!r}, {w.offset!r}", tid)
    for s in t.signals:
        if s.counter not in ctrs:
            add("unknown_name", f"task {t.id}: signal to unknown counter {s.counter!r}", tid)
            unknown = True
        elif not _is_int(s.amount):
            add("malformed", f"task {t.id}: signal amount {s.amount!r} is not an int", tid)
        elif s.amount <= 0:
            add("non_monotone", f"task {t.id}: signal {s.counter} += {s.amount} "
                "does not increase the counter", tid)
    return unknown


def _region_problems(prog: ScheduleProgram, t, bufs: dict, add) -> bool:
    """Task ``t``'s regions: one range per axis, in bounds at every slot, a rank in range,
    and the local/remote rules. Returns whether every region's shape is sound."""
    tid = [t.id]
    shapes_ok = True
    for role, regs in (("in", t.ins), ("out", t.outs)):
        for reg in regs:
            b = bufs[reg.buffer]
            if len(reg.ranges) != len(b.shape):
                add("out_of_bounds", f"task {t.id}: region of {reg.buffer} has "
                    f"{len(reg.ranges)} axes, the buffer {len(b.shape)}", tid, [reg.buffer])
                shapes_ok = False
                continue
            if not _bounds_ok(prog, t, role, reg, b, add):
                shapes_ok = False
            if not (_is_int(reg.rank) and 0 <= reg.rank < prog.ranks):
                add("malformed", f"task {t.id}: region of {reg.buffer} on rank {reg.rank!r} "
                    "out of range", tid, [reg.buffer])
                continue
            _placement_problems(t, role, reg, b, add)
    return shapes_ok


def _bounds_ok(prog: ScheduleProgram, t, role: str, reg, b, add) -> bool:
    """Region ``reg`` inside buffer ``b`` (and not empty) at every slot; the first axis
    that is not, at the first such slot, is reported."""
    for slot in range(prog.slots):
        bad = [(a, b0, b1) for a, ((b0, b1), d) in enumerate(zip(reg.concrete(slot), b.shape))
               if not (0 <= b0 < b1 <= d)]
        if bad:
            a, b0, b1 = bad[0]
            add("out_of_bounds", f"task {t.id}: {role} region of {reg.buffer} axis "
                f"{a} is [{b0}, {b1}) at slot {slot}, buffer dim {b.shape[a]}",
                [t.id], [reg.buffer])
            return False
    return True


def _placement_problems(t, role: str, reg, b, add) -> None:
    """A local buffer addressed on another rank; a read of another rank's memory; a write
    to another rank's local buffer."""
    owner = b.rank if b.placement == "local" else reg.rank
    if b.placement == "local" and reg.rank != b.rank:
        add("remote_write_local" if role == "out" else "remote_read",
            f"task {t.id}: region of local buffer {reg.buffer} (owner rank {b.rank}) "
            f"addresses rank {reg.rank}", [t.id], [reg.buffer])
    elif role == "in" and owner != t.rank:
        add("remote_read", f"task {t.id} on rank {t.rank} reads {reg.buffer} "
            f"on rank {owner}", [t.id], [reg.buffer])
    elif role == "out" and owner != t.rank and b.placement != "symmetric":
        add("remote_write_local", f"task {t.id} writes local buffer {reg.buffer} "
            f"of rank {owner}", [t.id], [reg.buffer])


def _overflow_problems(prog: ScheduleProgram, n_per_epoch: dict[str, int], add) -> None:
    """Counters whose count after max_epochs + 1 steps leaves their signed width
    (``n_per_epoch``: the amount signalled to each counter per step)."""
    for c in prog.counters:
        n = n_per_epoch.get(c.name, 0)
        limit = (1 << (c.width - 1)) - 1
        if n * (prog.max_epochs + 1) > limit:
            add("counter_overflow", f"counter {c.name}: {n} increments per step x "
                f"(max_epochs + 1 = {prog.max_epochs + 1}) exceed {limit} ({c.width}-bit signed)")


def _check_op(t, spec, bufs, slots, shapes_ok, add) -> None:
    """The op contract of ir/ops.py for task ``t`` (arity, dtypes, params, shape check)."""
    tid = [t.id]
    if not spec.arity_ok(len(t.ins), len(t.outs)):
        add("op_contract", f"task {t.id}: {t.op} takes {spec.arity_text()}, "
            f"got {len(t.ins)} and {len(t.outs)}", tid)
        return
    in_dt = [bufs[r.buffer].dtype for r in t.ins]
    out_dt = [bufs[r.buffer].dtype for r in t.outs]
    for i, d in enumerate(in_dt):
        if d not in spec.dtypes_for_in(i):
            add("op_contract", f"task {t.id}: input {i} of {t.op} has dtype {d}", tid)
    for i, d in enumerate(out_dt):
        if d not in spec.dtypes_for_out(i):
            add("op_contract", f"task {t.id}: output {i} of {t.op} has dtype {d}", tid)
    for name, typ in spec.params.items():
        if name not in t.params or not _param_ok(t.params[name], typ):
            add("op_contract", f"task {t.id}: {t.op} needs param {name} of type "
                f"{typ.__name__}, got {t.params.get(name)!r}", tid)
    for name, typ in spec.optional_params.items():
        if name in t.params and not _param_ok(t.params[name], typ):
            add("op_contract", f"task {t.id}: param {name} must be {typ.__name__}", tid)
    if spec.check is None or not shapes_ok:
        return
    seen: set[tuple] = set()
    for slot in range(slots):
        ins = [squeeze(r.shape(slot)) for r in t.ins]
        outs = [squeeze(r.shape(slot)) for r in t.outs]
        key = (tuple(ins), tuple(outs))
        if key in seen:
            continue
        seen.add(key)
        try:
            errs = spec.check(ins, in_dt, outs, out_dt, t.params)
        except Exception as exc:  # a malformed operand must not crash the oracle
            errs = [f"{t.op}: shape check failed on {ins} -> {outs}: {exc}"]
        for e in errs:
            add("op_contract", f"task {t.id}: {e}", tid)


# --------------------------------------------------------------------------------------
# The executable model
# --------------------------------------------------------------------------------------

class _Model:
    """A program compiled for execution: queues, per-task actions per slot, cells, events."""

    def __init__(self, prog: ScheduleProgram, epochs: int):
        self.prog = prog
        self.R, self.W, self.E = prog.ranks, prog.workers, epochs
        self.slots = prog.slots
        tasks = prog.tasks
        self.T = len(tasks)
        self.tids = [t.id for t in tasks]
        bufs = prog.buffer_map()
        cidx = {c.name: i for i, c in enumerate(prog.counters)}
        self.cnames = [c.name for c in prog.counters]
        self.cowner = [c.rank for c in prog.counters]
        npe = prog.signals_per_epoch()
        self.N = [npe.get(c, 0) for c in self.cnames]
        self.queues = [[[] for _ in range(self.W)] for _ in range(self.R)]
        for i, t in enumerate(tasks):
            self.queues[t.rank][t.worker].append(i)

        # Cells: per buffer, per axis the sorted breakpoints of every bound (clipped).
        cuts: dict[str, list[set[int]]] = {b.name: [{0, d} for d in b.shape] for b in prog.buffers}
        for t in tasks:
            for reg in (*t.ins, *t.outs):
                if len(reg.ranges) != len(bufs[reg.buffer].shape):
                    continue  # reported as out_of_bounds; not executed
                for slot in range(self.slots):
                    for a, (lo, hi) in enumerate(reg.concrete(slot)):
                        d = bufs[reg.buffer].shape[a]
                        cuts[reg.buffer][a].update((min(max(lo, 0), d), min(max(hi, 0), d)))
        self.bp = {n: [sorted(s) for s in ax] for n, ax in cuts.items()}
        self.bp_index = {n: [{v: i for i, v in enumerate(s)} for s in ax] for n, ax in self.bp.items()}
        self.cell_base: dict[tuple[str, int], int] = {}
        self.cell_info: list[tuple[str, int, int]] = []  # (buffer, rank, local index)
        written = {reg.buffer for t in tasks for reg in t.outs}
        self.persistent: list[bool] = []
        self.tracked: list[bool] = []
        ncell = 0
        for b in prog.buffers:
            size = 1
            for s in self.bp[b.name]:
                size *= max(len(s) - 1, 0)
            copies = [b.rank] if b.placement == "local" else list(range(self.R))
            for r in copies:
                self.cell_base[(b.name, r)] = ncell
                for k in range(size):
                    self.cell_info.append((b.name, r, k))
                    self.persistent.append(b.kind in PERSISTENT_KINDS)
                    # Reads of a never-written persistent buffer cannot conflict.
                    self.tracked.append(b.name in written or b.kind not in PERSISTENT_KINDS)
                ncell += size
        self.ncell = ncell

        # Per task: waits, local signals, remote op templates, cells per slot.
        self.waits = []
        self.lsig = []
        self.kind = []  # 0 compute/put/nop, 1 quiet, 2 fence
        self.reads = []  # [slot] -> tuple of cells
        self.lwrites = []  # [slot] -> tuple of cells
        self.ops = []  # per task: list of (is_data, dest, payload) payload=[slot]->cells | (c, amt)
        self.op_base = []
        nops = 0
        for t in tasks:
            self.waits.append(tuple((cidx[w.counter], w.threshold, w.offset) for w in t.waits))
            self.kind.append(1 if t.op == "quiet" else 2 if t.op == "fence" else 0)
            rd, lw = [], []
            ops: list[tuple] = []
            remote_regs = [reg for reg in t.outs if self._owner(bufs, reg) != t.rank]
            for slot in range(self.slots):
                rd.append(tuple(c for reg in t.ins for c in self._cells(bufs, reg, slot)
                                if self.tracked[c]))
                lw.append(tuple(c for reg in t.outs if self._owner(bufs, reg) == t.rank
                                for c in self._cells(bufs, reg, slot)))
            self.reads.append(rd)
            self.lwrites.append(lw)
            for reg in remote_regs:
                ops.append((True, self._owner(bufs, reg),
                            [tuple(self._cells(bufs, reg, s)) for s in range(self.slots)]))
            ls = []
            for s in t.signals:
                c = cidx[s.counter]
                if self.cowner[c] == t.rank:
                    ls.append((c, s.amount))
                else:
                    ops.append((False, self.cowner[c], (c, s.amount)))
            self.lsig.append(tuple(ls))
            self.op_base.append(nops)
            self.ops.append(ops)
            nops += len(ops)
        self.NOPS = nops
        self.op_owner = []
        for i, ops in enumerate(self.ops):
            self.op_owner.extend([(i, k) for k in range(len(ops))])

    @staticmethod
    def _owner(bufs, reg) -> int:
        b = bufs[reg.buffer]
        return b.rank if b.placement == "local" else reg.rank

    def _cells(self, bufs, reg, slot: int) -> list[int]:
        b = bufs[reg.buffer]
        base = self.cell_base.get((reg.buffer, self._owner(bufs, reg)))
        if base is None or len(reg.ranges) != len(b.shape):
            return []
        bp, idx = self.bp[reg.buffer], self.bp_index[reg.buffer]
        axes = []
        for a, (lo, hi) in enumerate(reg.concrete(slot)):
            d = b.shape[a]
            lo, hi = min(max(lo, 0), d), min(max(hi, 0), d)
            if lo >= hi:
                return []
            axes.append(range(idx[a][lo], idx[a][hi]))
        cells = [0]
        for a, rng in enumerate(axes):
            n = len(bp[a]) - 1
            cells = [c * n + i for c in cells for i in rng]
        return [base + c for c in cells]

    # -- naming events and cells for witnesses --
    def event(self, ev: int) -> dict[str, Any]:
        if ev < self.E * self.T:
            e, t = divmod(ev, self.T)
            return {"task": self.tids[t], "epoch": e, "event": "run"}
        e, k = divmod(ev - self.E * self.T, self.NOPS)
        t, j = self.op_owner[k]
        is_data, dest, payload = self.ops[t][j]
        what = "put data delivered" if is_data else f"signal {self.cnames[payload[0]]} delivered"
        return {"task": self.tids[t], "epoch": e, "event": what, "dest_rank": dest}

    def event_task(self, ev: int) -> str:
        return self.event(ev)["task"]

    def cell_box(self, cell: int) -> str:
        name, r, k = self.cell_info[cell]
        bp = self.bp[name]
        parts = []
        for a in reversed(range(len(bp))):
            n = len(bp[a]) - 1
            k, i = divmod(k, n)
            parts.append(f"{bp[a][i]}:{bp[a][i + 1]}")
        return f"{name}@{r}[{', '.join(reversed(parts))}]"


# --------------------------------------------------------------------------------------
# One run (also used as the DFS state)
# --------------------------------------------------------------------------------------

class _Run:
    """The state of one execution of the unrolled program.

    Readiness is maintained incrementally: ``ready`` maps each queue whose head task can
    run to ``(task, has a non-trivial wait)``; a blocked queue is parked in ``waiting[c]``
    on the first counter it lacks and re-examined when that counter grows; ``deliv`` holds
    the pending remote operations whose NVSHMEM predecessors were all delivered.
    """

    __slots__ = ("m", "epoch", "pos", "wclk", "cval", "cclk", "pending", "pend_w", "pend_r",
                 "dacc", "barrier", "issued", "dm", "lw", "lw_ep", "rd", "problems", "trace",
                 "keys", "ready", "waiting", "deliv", "rdeps")

    def __init__(self, m: _Model):
        self.m = m
        R, W = m.R, m.W
        self.epoch = [0] * R
        self.pos = [[0] * W for _ in range(R)]
        self.wclk = [[0] * W for _ in range(R)]
        self.cval = [0] * len(m.N)
        self.cclk = [0] * len(m.N)
        # op event -> [dest, is_data, payload, mask, deps, (r, w), epoch]
        self.pending: dict[int, list] = {}
        self.pend_w = [[set() for _ in range(W)] for _ in range(R)]
        self.pend_r = [0] * R
        self.dacc = [[0] * W for _ in range(R)]  # union of delivered ops' histories per worker
        self.barrier = [[{} for _ in range(W)] for _ in range(R)]  # dest -> ops before last fence
        self.issued = [[[] for _ in range(W)] for _ in range(R)]  # (op, dest) this epoch
        self.dm: dict[int, int] = {}  # delivered op -> its final history
        self.lw = [-1] * m.ncell
        self.lw_ep = [-1] * m.ncell
        self.rd: list[list[int]] = [[] for _ in range(m.ncell)]
        self.problems: list[Problem] = []
        self.trace: deque = deque(maxlen=_TRACE_TAIL)
        self.keys: set = set()
        self.ready: dict[tuple[int, int], tuple[int, bool]] = {}
        self.waiting: dict[int, set] = {}
        self.deliv: set[int] = set()
        self.rdeps: dict[int, list[int]] = {}
        for r in range(R):
            self._maybe_advance(r)
            for w in range(W):
                self._refresh(r, w)

    def clone(self) -> "_Run":
        c = _Run.__new__(_Run)
        c.m = self.m
        c.epoch = list(self.epoch)
        c.pos = [list(p) for p in self.pos]
        c.wclk = [list(p) for p in self.wclk]
        c.cval = list(self.cval)
        c.cclk = list(self.cclk)
        c.pending = {k: list(v) for k, v in self.pending.items()}
        c.pend_w = [[set(s) for s in row] for row in self.pend_w]
        c.pend_r = list(self.pend_r)
        c.dacc = [list(p) for p in self.dacc]
        c.barrier = [[{d: set(s) for d, s in b.items()} for b in row] for row in self.barrier]
        c.issued = [[list(x) for x in row] for row in self.issued]
        c.dm = dict(self.dm)
        c.lw = list(self.lw)
        c.lw_ep = list(self.lw_ep)
        c.rd = [list(x) for x in self.rd]
        c.problems = self.problems
        c.trace = deque(self.trace, maxlen=_TRACE_TAIL)
        c.keys = self.keys
        c.ready = dict(self.ready)
        c.waiting = {k: set(v) for k, v in self.waiting.items()}
        c.deliv = set(self.deliv)
        c.rdeps = {k: list(v) for k, v in self.rdeps.items()}
        return c

    def state_key(self) -> tuple:
        return (tuple(self.epoch), tuple(map(tuple, self.pos)), tuple(map(tuple, self.wclk)),
                tuple(self.cval), tuple(self.cclk),
                tuple(sorted((k, v[3]) for k, v in self.pending.items())),
                tuple(map(tuple, self.dacc)), tuple(sorted(self.dm.items())),
                tuple(self.lw), tuple(self.lw_ep), tuple(tuple(x) for x in self.rd))

    # -- enabledness --
    def _refresh(self, r: int, w: int) -> None:
        """Re-examine the head of queue (r, w): mark it ready or park it on a counter."""
        m = self.m
        self.ready.pop((r, w), None)
        e = self.epoch[r]
        if e >= m.E:
            return
        q = m.queues[r][w]
        p = self.pos[r][w]
        if p >= len(q):
            return
        t = q[p]
        real = False
        for c, thr, off in m.waits[t]:
            need = (e + off) * m.N[c] + thr
            if need > 0:
                if self.cval[c] < need:
                    self.waiting.setdefault(c, set()).add((r, w))
                    return
                real = True
        if m.kind[t] == 1 and self.pend_w[r][w]:
            return  # quiet: re-examined when this worker's last operation is delivered
        self.ready[(r, w)] = (t, real)

    def _bump(self, c: int, amt: int, mask: int) -> None:
        self.cval[c] += amt
        self.cclk[c] |= mask
        parked = self.waiting.pop(c, None)
        if parked:
            for r, w in sorted(parked):
                self._refresh(r, w)

    def done(self) -> bool:
        return all(e >= self.m.E for e in self.epoch)

    # -- problems --
    def _report(self, cls: str, key: tuple, msg: str, tasks: list[str], buffers: list[str],
                wit: dict) -> None:
        k = (cls,) + key
        if k in self.keys:
            return
        self.keys.add(k)
        wit["trace"] = [self._fmt(a) for a in self.trace]
        self.problems.append(Problem(cls, msg, tasks, buffers, wit))

    def _fmt(self, a: tuple) -> str:
        m = self.m
        if a[0] == "run":
            return f"run {m.tids[a[1]]} (rank {a[2]} worker {a[3]} epoch {a[4]})"
        if a[0] == "deliver":
            ev = m.event(a[1])
            return f"{ev['event']} from {ev['task']} (epoch {ev['epoch']}) to rank {ev['dest_rank']}"
        return f"rank {a[1]} enters epoch {a[2]}"

    def _desc(self, ev: int) -> str:
        d = self.m.event(ev)
        return f"{d['task']} (epoch {d['epoch']}, {d['event']})"

    # -- memory accesses --
    def _write(self, cells, ev: int, mask: int, ep: int) -> None:
        lw, rd = self.lw, self.rd
        for c in cells:
            prev = lw[c]
            if prev >= 0 and prev != ev and not (mask >> prev) & 1:
                self._race("write_write_race", c, prev, ev, "write", "write")
            for r in rd[c]:
                if r != ev and not (mask >> r) & 1:
                    self._race("read_write_race", c, r, ev, "read", "write")
            lw[c] = ev
            self.lw_ep[c] = ep
            rd[c] = []

    def _read(self, cells, ev: int, mask: int, ep: int) -> None:
        m, lw = self.m, self.lw
        for c in cells:
            prev = lw[c]
            if prev >= 0 and not (mask >> prev) & 1:
                self._race("read_write_race", c, prev, ev, "write", "read")
            elif not m.persistent[c] and (prev < 0 or self.lw_ep[c] != ep):
                m_ev = m.event(ev)
                name = m.cell_info[c][0]
                if prev < 0:
                    why = "it was never written"
                else:
                    why = f"its last write, {self._desc(prev)}, belongs to step {self.lw_ep[c]}"
                self._report("uninit_read", (m_ev["task"], name),
                             f"{m_ev['task']} (epoch {ep}) reads {m.cell_box(c)} of non-persistent "
                             f"buffer {name}, but no write of epoch {ep} happens-before it: {why}",
                             [m_ev["task"]] + ([m.event_task(prev)] if prev >= 0 else []), [name],
                             {"reader": m_ev, "cell": m.cell_box(c),
                              "last_write": m.event(prev) if prev >= 0 else None})
            self.rd[c].append(ev)

    def _race(self, cls: str, cell: int, first: int, second: int, k1: str, k2: str) -> None:
        m = self.m
        a, b = m.event(first), m.event(second)
        name = m.cell_info[cell][0]
        key = (tuple(sorted((a["task"], b["task"]))), name)
        self._report(cls, key,
                     f"{k1} by {self._desc(first)} and {k2} by {self._desc(second)} of "
                     f"{m.cell_box(cell)} are not ordered by happens-before",
                     [a["task"], b["task"]], [name],
                     {"first": dict(a, access=k1), "second": dict(b, access=k2),
                      "cell": m.cell_box(cell)})

    # -- actions --
    def run_task(self, r: int, w: int, t: int) -> None:
        m = self.m
        e = self.epoch[r]
        slot = e % m.slots
        mask = self.wclk[r][w]
        for c, thr, off in m.waits[t]:
            if (e + off) * m.N[c] + thr > 0:
                mask |= self.cclk[c]
        if m.kind[t] == 1:  # quiet: every delivery of this worker happens-before what follows
            mask |= self.dacc[r][w]
        ev = e * m.T + t
        mask |= 1 << ev
        self.trace.append(("run", t, r, w, e))
        self._read(m.reads[t][slot], ev, mask, e)
        self._write(m.lwrites[t][slot], ev, mask, e)
        self.wclk[r][w] = mask
        self.pos[r][w] += 1
        if m.kind[t] == 2:  # fence: later ops to d are ordered after earlier ones to d
            bar = self.barrier[r][w]
            for k, dest in self.issued[r][w]:
                bar.setdefault(dest, set()).add(k)
        if m.ops[t]:
            base = m.E * m.T + e * m.NOPS + m.op_base[t]
            bar = self.barrier[r][w]
            data_to: dict[int, list[int]] = {}
            for j, (is_data, dest, payload) in enumerate(m.ops[t]):
                k = base + j
                deps = set(bar.get(dest, ()))
                if is_data:
                    data_to.setdefault(dest, []).append(k)
                    pl = payload[slot]
                else:
                    deps.update(data_to.get(dest, ()))  # put-with-signal
                    pl = payload
                self.pending[k] = [dest, is_data, pl, mask | (1 << k), deps, (r, w), e]
                self.pend_w[r][w].add(k)
                self.issued[r][w].append((k, dest))
                self.pend_r[r] += 1
                live = [d for d in deps if d in self.pending]
                if live:
                    for d in live:
                        self.rdeps.setdefault(d, []).append(k)
                else:
                    self.deliv.add(k)
        for c, amt in m.lsig[t]:
            self._bump(c, amt, mask)
        self._refresh(r, w)
        self._maybe_advance(r)

    def deliver(self, k: int) -> None:
        op = self.pending.pop(k)
        self.deliv.discard(k)
        dest, is_data, pl, mask, deps, (r, w), e = op
        for d in deps:  # NVSHMEM orders d before this op: whoever sees this one sees d
            mask |= self.dm[d]
        self.trace.append(("deliver", k))
        self.dm[k] = mask
        self.dacc[r][w] |= mask
        self.pend_w[r][w].discard(k)
        self.pend_r[r] -= 1
        for j in self.rdeps.pop(k, ()):
            if not any(d in self.pending for d in self.pending[j][4]):
                self.deliv.add(j)
        if is_data:
            self._write(pl, k, mask, e)
        else:
            c, amt = pl
            self._bump(c, amt, mask)
        if not self.pend_w[r][w]:
            self._refresh(r, w)
        self._maybe_advance(r)

    def _maybe_advance(self, r: int) -> None:
        m = self.m
        advanced = False
        while self.epoch[r] < m.E and self.pend_r[r] == 0 and all(
                self.pos[r][w] >= len(m.queues[r][w]) for w in range(m.W)):
            mask = 0
            for w in range(m.W):
                mask |= self.wclk[r][w] | self.dacc[r][w]
            self.epoch[r] += 1
            for w in range(m.W):
                self.wclk[r][w] = mask
                self.pos[r][w] = 0
                self.barrier[r][w] = {}
                self.issued[r][w] = []
            self.trace.append(("epoch", r, self.epoch[r]))
            advanced = True
        if advanced:
            for w in range(m.W):
                self._refresh(r, w)

    def deadlock(self) -> None:
        m = self.m
        blocked = []
        for r in range(m.R):
            e = self.epoch[r]
            if e >= m.E:
                continue
            for w in range(m.W):
                q, p = m.queues[r][w], self.pos[r][w]
                if p >= len(q):
                    continue
                t = q[p]
                need = []
                for c, thr, off in m.waits[t]:
                    n = (e + off) * m.N[c] + thr
                    if n > 0 and self.cval[c] < n:
                        need.append({"counter": m.cnames[c], "value": self.cval[c], "needed": n})
                blocked.append({"rank": r, "worker": w, "epoch": e, "task": m.tids[t], "waits": need})
        tasks = [b["task"] for b in blocked]
        heads = ", ".join(f"{b['task']}@r{b['rank']}.w{b['worker']} (epoch {b['epoch']}" +
                          "".join(f", {x['counter']}={x['value']}<{x['needed']}" for x in b["waits"]) + ")"
                          for b in blocked[:6])
        self._report("deadlock", (), f"no task can run and {len(blocked)} queue(s) are blocked: {heads}",
                     tasks, [], {"blocked": blocked})


# --------------------------------------------------------------------------------------
# Exploration
# --------------------------------------------------------------------------------------

_DELIVERY_MODES = ("late", "prompt", "random")


def _random_run(m: _Model, rng: random.Random, slow: tuple[int, int] | None | str = "draw",
                late_task: int | None = None) -> tuple[_Run, dict[str, Any], int]:
    """One adversarially biased random interleaving; returns (final state, policy, steps).

    Policy (drawn per run): random worker priorities, re-drawn at random points (PCT); a
    rank that runs ahead; a *slow* worker that runs only when nothing else can (so the
    others may overtake it by a whole step); waiters that run as soon as their threshold
    is met; and, per issuing rank and per kind (put data / remote signal), deliveries that
    are late (only when nothing else can happen), prompt, or at random times — late data
    with prompt signals lets signals overtake puts, prompt deliveries let a rank finish
    its step and run ahead. ``late_task``: a task whose remote data is delivered only when
    nothing else at all can happen (one put held back while everything else proceeds)."""
    st = _Run(m)
    R, W = m.R, m.W
    wprio = [[rng.random() for _ in range(W)] for _ in range(R)]
    ahead = rng.randrange(R) if rng.random() < 0.5 else -1
    if slow == "draw":
        busy = [(r, w) for r in range(R) for w in range(W) if m.queues[r][w]]
        slow = busy[rng.randrange(len(busy))] if busy and rng.random() < 0.5 else None
    eager = rng.random() < 0.7
    if rng.random() < 0.5:  # one mode for all: data (late/random) and signals (any)
        data = ("late", "random")[rng.randrange(2)]
        sig = _DELIVERY_MODES[rng.randrange(3)] if data == "late" else "random"
        modes = [[data, sig] for _ in range(R)]
    else:  # per issuing rank and kind
        modes = [[_DELIVERY_MODES[rng.randrange(3)] for _ in range(2)] for _ in range(R)]
    change = rng.choice((0.0, 0.02, 0.1))
    late_ops = set()
    if late_task is not None:
        base = m.op_base[late_task]
        late_ops = {m.E * m.T + e * m.NOPS + base + j for e in range(m.E)
                    for j, op in enumerate(m.ops[late_task]) if op[0]}
    policy = {"rank_ahead": ahead, "slow_worker": list(slow) if slow else None,
              "late_put": m.tids[late_task] if late_task is not None else None,
              "eager_waiters": eager, "reprioritise": change,
              "deliveries": {f"r{r}": {"data": modes[r][0], "signals": modes[r][1]}
                             for r in range(R)}}
    steps = 0
    while True:
        best, bestp = None, -1e9
        for (r, w), (t, real) in st.ready.items():
            if (r, w) == slow:
                p = -8.0 + wprio[r][w] * 0.1  # after even late deliveries
            else:
                p = wprio[r][w] + (1.0 if r == ahead else 0.0) + (2.0 if eager and real else 0.0)
            if p > bestp:
                best, bestp = (r, w, t), p
        for k in sorted(st.deliv):
            op = st.pending[k]
            mode = modes[op[5][0]][0 if op[1] else 1]
            if k in late_ops:
                p = -9.0 + rng.random() * 0.1
            elif mode == "late":
                p = -5.0 + rng.random()
            elif mode == "prompt":
                p = 2.5 + rng.random()
            else:
                p = rng.random() * 1.5
            if p > bestp:
                best, bestp = k, p
        if best is None:
            break
        if isinstance(best, tuple):
            st.run_task(*best)
        else:
            st.deliver(best)
        steps += 1
        if change and rng.random() < change:
            wprio[rng.randrange(R)][rng.randrange(W)] = rng.random()
    if not st.done():
        st.deadlock()
    return st, policy, steps


def _exhaustive(m: _Model, max_states: int, stop_at_problem: bool = True
                ) -> tuple[list[Problem], int, bool]:
    """DFS over all interleavings with state hashing. Returns (problems, states, complete).
    With ``stop_at_problem`` the search ends at the first problem (the label is known)."""
    root = _Run(m)
    problems: list[Problem] = root.problems
    seen: set = set()
    stack = [root]
    states = 0
    while stack:
        st = stack.pop()
        key = st.state_key()
        if key in seen:
            continue
        seen.add(key)
        states += 1
        if states > max_states:
            return problems, states, False
        if problems and stop_at_problem:
            return problems, states, True
        acts: list = [(r, w, t) for (r, w), (t, _) in sorted(st.ready.items())]
        acts.extend(sorted(st.deliv))
        if not acts:
            if not st.done():
                st.deadlock()
            continue
        for a in acts:
            nxt = st.clone()
            if isinstance(a, tuple):
                nxt.run_task(*a)
            else:
                nxt.deliver(a)
            stack.append(nxt)
    return problems, states, True


def default_epochs(prog: ScheduleProgram) -> int:
    """Epochs unrolled per rank: ``max(3, slots + 1)``, at most ``max_epochs``."""
    e = max(3, int(prog.slots) + 1)
    return max(1, min(e, int(prog.max_epochs)))


def check(prog: ScheduleProgram, *, runs: int = 24, seed: int = 0, epochs: int | None = None,
          max_states: int = 1500, exhaustive: bool = True, dfs_actions: int = 40,
          all_runs: bool = False) -> OracleResult:
    """Label ``prog``: run the structural checks, then explore interleavings.

    ``runs``: random adversarial interleavings (deterministic in ``seed``). ``epochs``:
    steps unrolled per rank (default ``default_epochs``). ``exhaustive``: first run a DFS
    over all interleavings when the unroll has at most ``dfs_actions`` actions (task
    instances + remote operations), abandoned after ``max_states`` distinct states;
    ``stats["dfs"]`` says how it ended, and a complete DFS makes the random runs moot.
    Unless ``all_runs``, exploration stops at the first run (or DFS) that shows a problem.
    Never raises on a malformed program (it is labelled unsafe). Returns an
    ``OracleResult``; ``stats`` holds runs, steps, states, dfs, epochs and seconds.
    """
    t0 = time.perf_counter()
    stats: dict[str, Any] = {"runs": 0, "steps": 0, "states": 0, "exhaustive": False,
                             "dfs": "skipped"}
    try:
        problems = _structure(prog)
    except Exception as exc:  # defensive: a malformed program must still get a label
        problems = [Problem("malformed", f"program cannot be inspected: {exc!r}")]
    if any(p.cls in _FATAL for p in problems):
        stats["seconds"] = time.perf_counter() - t0
        stats["dynamic"] = "skipped: the program cannot be executed"
        return OracleResult(problems, stats)
    E = epochs if epochs is not None else default_epochs(prog)
    stats["epochs"] = E
    m = _Model(prog, E)
    dyn: dict[tuple, Problem] = {}

    def merge(found: list[Problem], wit: dict[str, Any]) -> None:
        for p in found:
            key = (p.cls, tuple(p.tasks), tuple(p.buffers))
            if key not in dyn:
                p.witness = {**wit, **p.witness}
                dyn[key] = p

    if exhaustive and max_states > 0 and E * (m.T + m.NOPS) <= dfs_actions:
        found, states, ended = _exhaustive(m, max_states, stop_at_problem=not all_runs)
        stats["states"] = states
        if not ended:
            stats["dfs"] = "abandoned"
        else:
            stats["dfs"] = "stopped at a problem" if found and not all_runs else "complete"
        stats["exhaustive"] = stats["dfs"] == "complete"
        merge(found, {"exploration": "exhaustive DFS"})
    if not ((stats["exhaustive"] or dyn) and not all_runs):
        # Runs i = 0, 1, 2, 3 (mod 4): starve one worker; hold back one task's puts; both;
        # neither. Starved workers and held-back puts cycle through every candidate (in
        # an order drawn from the seed).
        order = random.Random(seed)
        busy = [(r, w) for r in range(m.R) for w in range(m.W) if m.queues[r][w]]
        order.shuffle(busy)
        putters = [t for t in range(m.T) if any(op[0] for op in m.ops[t])]
        order.shuffle(putters)
        for i in range(runs):
            run_seed = (seed * 1_000_003 + i) & 0xFFFFFFFF
            slow = late = None
            q, kind = divmod(i, 4)
            if busy and kind in (0, 2):
                slow = busy[(q + (len(busy) // 2 if kind == 2 else 0)) % len(busy)]
            if putters and kind in (1, 2):
                late = putters[(q + (len(putters) // 2 if kind == 2 else 0)) % len(putters)]
            st, policy, steps = _random_run(m, random.Random(run_seed), slow, late)
            stats["runs"] += 1
            stats["steps"] += steps
            merge(st.problems, {"exploration": "random", "run": i, "run_seed": run_seed,
                                "policy": policy})
            if dyn and not all_runs:
                break
    stats["seconds"] = time.perf_counter() - t0
    return OracleResult(problems + list(dyn.values()), stats)
