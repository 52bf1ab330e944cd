"""The adversarial corpus: mutated valid schedules, labelled by the oracle, judged against
the static validator.

Every corpus item is one *seed* (a valid multi-rank program: validator/seeds.py, the
reference examples of ir/examples.py, and tiny real lowerings when ``lowering.lower``
provides ``lowered_corpus_seeds()``) transformed by one *mutation class*. A mutation is a
function ``(program, rng) -> program | None`` (``None``: not applicable to that seed); it
never modifies its input. Classes marked ``safe`` are meant to keep the schedule safe: they
measure false rejects.

Each item is labelled by the independent oracle (validator/oracle.py) and then validated
by ``validator.validate``. Outcomes:

* false accept: the oracle observed a problem but the validator accepted (must be zero);
* false reject: the oracle observed no problem but the validator rejected. Before an item
  counts as one, the oracle re-checks it with 16x the interleavings and one more epoch per
  rank (a problem found then is a real witness and the label becomes unsafe). Each
  remaining one is attributed to a named reason (``FR_REASONS``): a conservative rule of
  the validator or a blind spot of the oracle. A reject no reason covers is counted as
  unexplained.

Everything is deterministic in ``seed``: item ``i`` uses ``random.Random(f"{seed}:{i}")``,
its class is ``CLASSES[i % len(CLASSES)]`` (balanced), and the oracle runs with seed ``i``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ir.program import Bound, Counter, Range, Region, ScheduleProgram, Signal, Task, Wait

Mutation = Callable[[ScheduleProgram, random.Random], "ScheduleProgram | None"]


@dataclass(frozen=True)
class MutationClass:
    """A named mutation. ``intent`` is ``unsafe`` (meant to break the schedule) or ``safe``;
    the oracle, not the intent, labels each generated program."""

    name: str
    intent: str
    description: str
    fn: Mutation


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

def _owner(prog: ScheduleProgram, reg: Region) -> int:
    """The rank whose memory ``reg`` addresses. The buffer map is cached on the program
    object (mutations work on fresh copies, which start without the cache)."""
    bm = prog.__dict__.get("_corpus_bm")
    if bm is None or len(bm) != len(prog.buffers):
        bm = prog.__dict__["_corpus_bm"] = prog.buffer_map()
    b = bm[reg.buffer]
    return b.rank if b.placement == "local" else reg.rank


def _fresh(names: Iterable[str], base: str) -> str:
    taken = set(names)
    i = 0
    while f"{base}.{i}" in taken:
        i += 1
    return f"{base}.{i}"


def _new_counter(prog: ScheduleProgram, base: str, rank: int) -> str:
    name = _fresh((c.name for c in prog.counters), base)
    prog.counters.append(Counter(name, rank))
    return name


def _new_task_id(prog: ScheduleProgram, base: str) -> str:
    return _fresh((t.id for t in prog.tasks), base)


def _queue(prog: ScheduleProgram, r: int, w: int) -> list[int]:
    return [i for i, t in enumerate(prog.tasks) if t.rank == r and t.worker == w]


def _pick(rng: random.Random, xs: list):
    return xs[rng.randrange(len(xs))] if xs else None


def _entries(prog: ScheduleProgram, field: str) -> list[tuple[int, int]]:
    """(task index, entry index) of every entry of the tasks' ``field`` (waits, signals,
    ins or outs)."""
    return [(i, k) for i, t in enumerate(prog.tasks) for k in range(len(getattr(t, field)))]


def _drop(seq: tuple, k: int) -> tuple:
    return seq[:k] + seq[k + 1:]


def _set_entry(prog: ScheduleProgram, i: int, field: str, k: int, value: Any) -> None:
    """Task ``i`` gets ``value`` as entry ``k`` of its ``field``."""
    t = prog.tasks[i]
    entries = list(getattr(t, field))
    entries[k] = value
    prog.tasks[i] = dataclasses.replace(t, **{field: tuple(entries)})


def _other_rank(prog: ScheduleProgram, rng: random.Random, reg: Region) -> int:
    """A random rank other than the one whose memory ``reg`` addresses."""
    dest = _owner(prog, reg)
    return _pick(rng, [r for r in range(prog.ranks) if r != dest])


def _detach_signal(prog: ScheduleProgram, rng: random.Random, pws) -> tuple[int, Task, Signal]:
    """Remove the signal of a random put-with-signal (``pws``: _pws); returns the task's
    index, the task as it was and the signal."""
    i, j = _pick(rng, pws)
    t = prog.tasks[i]
    prog.tasks[i] = dataclasses.replace(t, signals=_drop(t.signals, j))
    return i, t, t.signals[j]


def _quiet_becomes(prog: ScheduleProgram, rng: random.Random, pws, op: str) -> bool:
    """With a ``quiet`` in the program, half the time (always without put-with-signals) a
    random one becomes ``op``; whether it did."""
    quiets = [i for i, t in enumerate(prog.tasks) if t.op == "quiet"]
    if quiets and (not pws or rng.random() < 0.5):
        i = _pick(rng, quiets)
        prog.tasks[i] = dataclasses.replace(prog.tasks[i], op=op)
        return True
    return False


def _prev_step_spelling(prog: ScheduleProgram, rng: random.Random, cands):
    """A random wait of ``cands`` ``c >= t`` spelled ``c >= t - N(c)`` with offset 0 (in
    step e: ``c >= (e - 1) N + t``); None without candidates."""
    if not cands:
        return None
    n = prog.signals_per_epoch()
    i, k = _pick(rng, cands)
    w = prog.tasks[i].waits[k]
    _set_entry(prog, i, "waits", k, Wait(w.counter, w.threshold - n[w.counter], 0))
    return prog


def _is_remote_write(prog: ScheduleProgram, t: Task) -> bool:
    return any(_owner(prog, reg) != t.rank for reg in t.outs)


def _pws(prog: ScheduleProgram) -> list[tuple[int, int]]:
    """(task index, signal index) of put-with-signal pairs: a put's signal to a counter
    owned by the put's destination rank."""
    cm = prog.counter_map()
    out = []
    for i, t in enumerate(prog.tasks):
        if t.op != "put" or not t.outs:
            continue
        dest = _owner(prog, t.outs[0])
        if dest == t.rank:
            continue
        for j, s in enumerate(t.signals):
            if cm[s.counter].rank == dest:
                out.append((i, j))
    return out


def _add_worker(prog: ScheduleProgram) -> int | None:
    """Add one (empty) worker per rank if the target has room; return its index."""
    if prog.workers + 1 > prog.target.max_workers:
        return None
    prog.workers += 1
    return prog.workers - 1


def _concrete(bound: Bound, slot: int = 0) -> Bound:
    return Bound(bound.at(slot))


def _shift_range(rg: Range, d: int) -> Range:
    return Range(Bound(rg.start.const + d, rg.start.coef), Bound(rg.stop.const + d, rg.stop.coef))


def _set_axis(reg: Region, axis: int, rg: Range) -> Region:
    ranges = list(reg.ranges)
    ranges[axis] = rg
    return dataclasses.replace(reg, ranges=tuple(ranges))


def _first_waits(prog: ScheduleProgram) -> set[tuple[int, int]]:
    """(task, wait index) of waits not already implied by queue order: no earlier task of
    the same worker waits on the same counter with the same offset and a threshold at
    least as high."""
    out = set()
    best: dict[tuple[int, int, str, int], int] = {}
    for i, t in enumerate(prog.tasks):
        seen = {}
        for k, w in enumerate(t.waits):
            key = (t.rank, t.worker, w.counter, w.offset)
            if best.get(key, -(1 << 62)) < w.threshold:
                out.add((i, k))
            seen[key] = max(seen.get(key, -(1 << 62)), w.threshold)
        for key, thr in seen.items():
            best[key] = max(best.get(key, -(1 << 62)), thr)
    return out


def _prefer(rng: random.Random, cands: list, good: set, p: float = 1.0) -> list:
    """``cands`` restricted to ``good`` with probability ``p`` (when any is good)."""
    sub = [c for c in cands if c in good]
    return sub if sub and rng.random() < p else cands


def _signal_edges(prog: ScheduleProgram) -> list[tuple[int, int, str]]:
    """(signalling task index, waiting task index, counter) for full waits (t == N, offset
    0), i.e. a waiter that needs every signal of the counter."""
    n = prog.signals_per_epoch()
    sig: dict[str, list[int]] = {}
    for i, t in enumerate(prog.tasks):
        for s in t.signals:
            sig.setdefault(s.counter, []).append(i)
    out = []
    for j, t in enumerate(prog.tasks):
        for w in t.waits:
            if w.offset == 0 and w.threshold >= n.get(w.counter, 0) > 0:
                out.extend((i, j, w.counter) for i in sig.get(w.counter, ()))
    return out


# --------------------------------------------------------------------------------------
# Mutations meant to break the schedule
# --------------------------------------------------------------------------------------

def m_cross_rank_wait_cycle(prog: ScheduleProgram, rng: random.Random):
    """Close a cycle through two ranks: a producer on rank a whose signal rank b waits for
    now also waits for a new counter that rank b signals only after that wait."""
    p = prog.copy()
    edges = [(i, j, c) for i, j, c in _signal_edges(p) if p.tasks[i].rank != p.tasks[j].rank]
    if edges and rng.random() < 0.7:
        i, j, _ = _pick(rng, edges)
        prod, cons = p.tasks[i], p.tasks[j]
        q = _queue(p, cons.rank, cons.worker)
        later = [k for k in q if k >= j]
        z = _pick(rng, later)
        k = _new_counter(p, f"c.cycle.r{prod.rank}", prod.rank)
        p.tasks[i] = dataclasses.replace(prod, waits=prod.waits + (Wait(k, 1),))
        zt = p.tasks[z]
        p.tasks[z] = dataclasses.replace(zt, signals=zt.signals + (Signal(k, 1),))
        return p
    if p.ranks < 2 or not p.tasks:
        return None
    a, b = rng.sample(range(p.ranks), 2)
    xa = [i for i, t in enumerate(p.tasks) if t.rank == a]
    yb = [i for i, t in enumerate(p.tasks) if t.rank == b]
    if not xa or not yb:
        return None
    x, y = _pick(rng, xa), _pick(rng, yb)
    k1 = _new_counter(p, f"c.cycle.r{a}", a)
    k2 = _new_counter(p, f"c.cycle.r{b}", b)
    tx, ty = p.tasks[x], p.tasks[y]
    p.tasks[x] = dataclasses.replace(tx, waits=tx.waits + (Wait(k1, 1),), signals=tx.signals + (Signal(k2, 1),))
    p.tasks[y] = dataclasses.replace(ty, waits=ty.waits + (Wait(k2, 1),), signals=ty.signals + (Signal(k1, 1),))
    return p


def m_queue_inversion(prog: ScheduleProgram, rng: random.Random):
    """Invert queue order across workers of one rank: with a signal edge P (worker a) ->
    Q (worker b), P now also waits for a new counter signalled by the task after Q on
    worker b (the two-SM deadlock); on one worker, P is moved behind its consumer Q."""
    p = prog.copy()
    edges = [(i, j, c) for i, j, c in _signal_edges(p)
             if p.tasks[i].rank == p.tasks[j].rank and i != j]
    if not edges:
        return None
    cross = [e for e in edges if p.tasks[e[0]].worker != p.tasks[e[1]].worker]
    if cross:
        i, j, _ = _pick(rng, cross)
        prod, cons = p.tasks[i], p.tasks[j]
        q = _queue(p, cons.rank, cons.worker)
        after = [k for k in q if k > j]
        z = after[0] if after else j
        k = _new_counter(p, f"c.inv.r{prod.rank}", prod.rank)
        p.tasks[i] = dataclasses.replace(prod, waits=prod.waits + (Wait(k, 1),))
        zt = p.tasks[z]
        p.tasks[z] = dataclasses.replace(zt, signals=zt.signals + (Signal(k, 1),))
        return p
    i, j, _ = _pick(rng, edges)
    prod = p.tasks.pop(i)
    j = j - 1 if j > i else j
    p.tasks.insert(j + 1, prod)
    return p


def m_unsatisfiable_threshold(prog: ScheduleProgram, rng: random.Random):
    """Raise a wait's threshold above N(c), the increments the counter gets per step."""
    p = prog.copy()
    n = p.signals_per_epoch()
    cands = [(i, k) for i, t in enumerate(p.tasks) for k, w in enumerate(t.waits)
             if n.get(w.counter, 0) > 0]
    if not cands:
        return None
    i, k = _pick(rng, cands)
    w = p.tasks[i].waits[k]
    _set_entry(p, i, "waits", k, Wait(w.counter, n[w.counter] + rng.randint(1, 3), w.offset))
    return p


def m_partial_wait_shared_counter(prog: ScheduleProgram, rng: random.Random):
    """Lower the threshold of a wait on a counter that several signals share, so that the
    wait may pass on the "wrong" increments (a wait that queue order does not imply)."""
    p = prog.copy()
    n = p.signals_per_epoch()
    cands = [(i, k) for i, t in enumerate(p.tasks) for k, w in enumerate(t.waits)
             if w.threshold >= 2 and n.get(w.counter, 0) >= 2]
    if not cands:
        return None
    cands = _prefer(rng, cands, _first_waits(p))
    i, k = _pick(rng, cands)
    w = p.tasks[i].waits[k]
    _set_entry(p, i, "waits", k, Wait(w.counter, rng.randint(1, w.threshold - 1), w.offset))
    return p


def m_dropped_wait(prog: ScheduleProgram, rng: random.Random):
    """Remove one wait of one task (mostly one that queue order does not already imply)."""
    p = prog.copy()
    cands = _entries(p, "waits")
    if not cands:
        return None
    i, k = _pick(rng, _prefer(rng, cands, _first_waits(p), 0.8))
    p.tasks[i] = dataclasses.replace(p.tasks[i], waits=_drop(p.tasks[i].waits, k))
    return p


def m_dropped_signal(prog: ScheduleProgram, rng: random.Random):
    """Remove one signal of one task."""
    p = prog.copy()
    cands = _entries(p, "signals")
    if not cands:
        return None
    i, k = _pick(rng, cands)
    p.tasks[i] = dataclasses.replace(p.tasks[i], signals=_drop(p.tasks[i].signals, k))
    return p


def m_missing_quiet(prog: ScheduleProgram, rng: random.Random):
    """Signal without completing the puts: a ``quiet`` becomes a ``nop`` (same waits and
    signals), or a put-with-signal's signal moves to a ``nop`` after the put."""
    p = prog.copy()
    pws = _pws(p)
    if _quiet_becomes(p, rng, pws, "nop"):
        return p
    if not pws:
        return None
    i, t, sig = _detach_signal(p, rng, pws)
    p.tasks.insert(i + 1, Task(_new_task_id(p, f"{t.id}.notify"), t.rank, t.worker, "nop",
                               signals=(sig,), group=t.group))
    return p


def m_fence_across_ranks(prog: ScheduleProgram, rng: random.Random):
    """Rely on ``fence`` to order a put before a signal that goes to another rank: a
    ``quiet`` becomes a ``fence``; or a put-with-signal to rank d becomes put; fence;
    signal to a new counter on rank d2 != d, relayed to the original counter by a task on
    a new worker of rank d2."""
    p = prog.copy()
    pws = _pws(p)
    if _quiet_becomes(p, rng, pws, "fence"):
        return p
    if not pws:
        return None
    i, t, sig = _detach_signal(p, rng, pws)
    d2 = _other_rank(p, rng, t.outs[0])
    w_new = _add_worker(p)
    if w_new is None:
        return None
    k = _new_counter(p, f"c.relay.r{d2}", d2)
    p.tasks.insert(i + 1, Task(_new_task_id(p, f"{t.id}.fence"), t.rank, t.worker, "fence"))
    p.tasks.insert(i + 2, Task(_new_task_id(p, f"{t.id}.notify"), t.rank, t.worker, "nop",
                               signals=(Signal(k, 1),)))
    p.tasks.append(Task(_new_task_id(p, f"{t.id}.relay"), d2, w_new, "nop",
                        waits=(Wait(k, p.signals_per_epoch()[k]),), signals=(sig,)))
    return p


def m_put_signal_data_overrun(prog: ScheduleProgram, rng: random.Random):
    """Shift a put-with-signal's destination window by one along a concrete axis (and
    widen the source with it when possible), so the data overruns into a neighbour's
    part of the receive buffer."""
    p = prog.copy()
    bm = p.buffer_map()
    pws = sorted({i for i, _ in _pws(p)})
    rng.shuffle(pws)
    for i in pws:
        t = p.tasks[i]
        dst = t.outs[0]
        shape = bm[dst.buffer].shape
        axes = [a for a, rg in enumerate(dst.ranges) if not rg.symbolic]
        rng.shuffle(axes)
        for a in axes:
            rg = dst.ranges[a]
            for d in rng.sample((1, -1), 2):
                lo, hi = rg.start.const + d, rg.stop.const + d
                if 0 <= lo and hi <= shape[a] and (lo, hi) != (rg.start.const, rg.stop.const):
                    p.tasks[i] = dataclasses.replace(t, outs=(_set_axis(dst, a, _shift_range(rg, d)),)
                                                     + t.outs[1:])
                    return p
    return None


def m_recv_reuse_without_credit(prog: ScheduleProgram, rng: random.Random):
    """Reuse a receive buffer across steps without protection: drop the credit waits
    (``@prev``) of one task, or collapse double buffering to one slot."""
    p = prog.copy()
    credit = [i for i, t in enumerate(p.tasks) if any(w.offset == -1 for w in t.waits)]
    if credit and (p.slots < 2 or rng.random() < 0.5):
        i = _pick(rng, credit)
        t = p.tasks[i]
        p.tasks[i] = dataclasses.replace(t, waits=tuple(w for w in t.waits if w.offset != -1))
        return p
    if p.slots < 2:
        return None
    p.slots = 1

    def fix(reg: Region) -> Region:
        return dataclasses.replace(reg, ranges=tuple(Range(_concrete(r.start), _concrete(r.stop))
                                                     for r in reg.ranges))

    for i, t in enumerate(p.tasks):
        p.tasks[i] = dataclasses.replace(t, ins=tuple(map(fix, t.ins)), outs=tuple(map(fix, t.outs)))
    return p


def m_overlapping_unordered_writes(prog: ScheduleProgram, rng: random.Random):
    """Duplicate a compute task that writes local memory onto another worker of its rank
    (same waits, no signals): the two writes of the same region are unordered."""
    p = prog.copy()
    cands = [i for i, t in enumerate(p.tasks)
             if t.outs and t.op not in ("put",) and not _is_remote_write(p, t)]
    if not cands:
        return None
    i = _pick(rng, cands)
    t = p.tasks[i]
    others = [w for w in range(p.workers) if w != t.worker]
    w = _pick(rng, others) if others else _add_worker(p)
    if w is None:
        return None
    p.tasks.append(dataclasses.replace(t, id=_new_task_id(p, f"{t.id}.dup"), worker=w,
                                       signals=(), params=dict(t.params)))
    return p


_ELEMENTWISE = ("copy", "add", "silu_mul")


def m_partial_coverage_read(prog: ScheduleProgram, rng: random.Random):
    """Leave part of a buffer unwritten while its readers still synchronise as before: a
    writer becomes a ``nop`` with the same waits and signals, or a tile loses its last
    row/element (all of its operands shrink, so the op stays well-formed)."""
    p = prog.copy()
    bm = p.buffer_map()
    readers = {reg.buffer for t in p.tasks for reg in t.ins}
    writers = [i for i, t in enumerate(p.tasks)
               if t.op != "put" and t.outs and not _is_remote_write(p, t)
               and any(reg.buffer in readers and bm[reg.buffer].kind not in
                       ("weight", "kv_cache", "io_input") for reg in t.outs)]
    shrinkable = [i for i in writers if p.tasks[i].op in _ELEMENTWISE + ("gemv",)
                  and p.tasks[i].outs[0].shape()[-1] >= 2]
    if shrinkable and rng.random() < 0.5:
        i = _pick(rng, shrinkable)
        t = p.tasks[i]

        def shrink(reg: Region, axis: int) -> Region:
            rg = reg.ranges[axis]
            return _set_axis(reg, axis, Range(rg.start, Bound(rg.stop.const - 1, rg.stop.coef)))

        out = shrink(t.outs[0], len(t.outs[0].ranges) - 1)
        if t.op == "gemv":
            w = t.ins[1]
            if w.shape()[0] != t.outs[0].shape()[-1]:
                return None
            ins = (t.ins[0], shrink(w, 0)) + tuple(shrink(r, len(r.ranges) - 1) for r in t.ins[2:])
        else:
            ins = tuple(shrink(r, len(r.ranges) - 1) for r in t.ins)
        p.tasks[i] = dataclasses.replace(t, ins=ins, outs=(out,) + t.outs[1:])
        return p
    if not writers:
        return None
    i = _pick(rng, writers)
    t = p.tasks[i]
    p.tasks[i] = dataclasses.replace(t, op="nop", ins=(), outs=(), params={})
    return p


def m_region_out_of_range(prog: ScheduleProgram, rng: random.Random):
    """Push one operand region past its buffer's end along one axis."""
    p = prog.copy()
    bm = p.buffer_map()
    cands = [(i, role, k) for i, t in enumerate(p.tasks)
             for role, regs in (("ins", t.ins), ("outs", t.outs)) for k in range(len(regs))]
    if not cands:
        return None
    i, role, k = _pick(rng, cands)
    t = p.tasks[i]
    regs = list(getattr(t, role))
    reg = regs[k]
    a = rng.randrange(len(reg.ranges))
    dim = bm[reg.buffer].shape[a]
    rg = reg.ranges[a]
    if rng.random() < 0.5:
        new = Range(rg.start, Bound(dim + rng.randint(1, 3), 0))
    else:
        new = _shift_range(rg, dim)
    regs[k] = _set_axis(reg, a, new)
    p.tasks[i] = dataclasses.replace(t, **{role: tuple(regs)})
    return p


def m_param_out_of_range(prog: ScheduleProgram, rng: random.Random):
    """Set an op parameter outside its valid range or inconsistent with the operand
    shapes (rmsnorm dim/eps, argmax offset, rope/attention head_dim, attention scale), or
    drop a required one."""
    p = prog.copy()
    cands = [i for i, t in enumerate(p.tasks) if t.params]
    if not cands:
        return None
    i = _pick(rng, cands)
    t = p.tasks[i]
    params = dict(t.params)
    key = _pick(rng, sorted(params))
    v = params[key]
    if rng.random() < 0.15:
        del params[key]
    elif key == "eps":
        params[key] = _pick(rng, [0.0, -1e-5, 1.0, 2.5])
    elif key == "scale":
        params[key] = _pick(rng, [0.0, -abs(float(v))])
    elif key == "offset":
        params[key] = -rng.randint(1, 5)
    elif isinstance(v, int):
        params[key] = _pick(rng, [0, -1, v + 1, 2 * v + 1])
    elif isinstance(v, float):
        params[key] = -abs(v) - 1.0
    else:
        return None
    p.tasks[i] = dataclasses.replace(t, params=params)
    return p


def m_collective_order_mismatch(prog: ScheduleProgram, rng: random.Random):
    """On one rank, run the tasks of a later collective before those of an earlier one
    (other ranks keep the original order)."""
    p = prog.copy()
    ranks = []
    for r in range(p.ranks):
        groups: list[str] = []
        for t in p.tasks:
            if t.rank == r and t.group and t.group not in groups:
                groups.append(t.group)
        if len(groups) >= 2:
            ranks.append((r, groups))
    if not ranks:
        return None
    r, groups = _pick(rng, ranks)
    a = rng.randrange(len(groups) - 1)
    g1, g2 = groups[a], groups[rng.randrange(a + 1, len(groups))]
    pos = [i for i, t in enumerate(p.tasks) if t.rank == r and t.group in (g1, g2)]
    seq = [p.tasks[i] for i in pos]
    seq = [t for t in seq if t.group == g2] + [t for t in seq if t.group == g1]
    for i, t in zip(pos, seq):
        p.tasks[i] = t
    return p


def m_counter_reuse_without_epochs(prog: ScheduleProgram, rng: random.Random):
    """Reuse one counter for two phases as if it were reset between them: the signals and
    waits of counter B move to counter A (same rank), thresholds unchanged."""
    p = prog.copy()
    n = p.signals_per_epoch()
    by_rank: dict[int, list[str]] = {}
    for c in p.counters:
        if n.get(c.name, 0) > 0:
            by_rank.setdefault(c.rank, []).append(c.name)
    pairs = [(r, cs) for r, cs in by_rank.items() if len(cs) >= 2]
    if not pairs:
        return None
    r, cs = _pick(rng, pairs)
    a, b = rng.sample(cs, 2)
    for i, t in enumerate(p.tasks):
        if any(w.counter == b for w in t.waits) or any(s.counter == b for s in t.signals):
            p.tasks[i] = dataclasses.replace(
                t, waits=tuple(Wait(a if w.counter == b else w.counter, w.threshold, w.offset) for w in t.waits),
                signals=tuple(Signal(a if s.counter == b else s.counter, s.amount) for s in t.signals))
    p.counters = [c for c in p.counters if c.name != b]
    return p


def m_shared_counter_across_steps(prog: ScheduleProgram, rng: random.Random):
    """Merge two counters of one rank that a task waits on together (e.g. per-source
    arrival counters) into one, waited for in full (the sum of both thresholds). Counters
    are never reset, so a producer one step ahead can then stand in for a slow one."""
    p = prog.copy()
    n = p.signals_per_epoch()
    cands = []
    for i, t in enumerate(p.tasks):
        full = [w for w in t.waits if w.offset == 0 and 0 < w.threshold == n.get(w.counter, 0)]
        for x in range(len(full)):
            for y in range(x + 1, len(full)):
                if full[x].counter != full[y].counter:
                    cands.append((full[x].counter, full[y].counter))
    if not cands:
        return None
    a, b = _pick(rng, sorted(set(cands)))
    merged = n[a] + n[b]

    def fix_waits(waits: tuple[Wait, ...]) -> tuple[Wait, ...]:
        names = {w.counter for w in waits if w.offset == 0}
        out = []
        for w in waits:
            if w.counter in (a, b) and w.offset == 0 and {a, b} <= names:
                if w.counter == a:
                    out.append(Wait(a, merged, 0))  # the pair becomes one full wait
                continue
            if w.counter == b:
                # b alone: its share of the merged count (a partial wait; rare in seeds)
                out.append(Wait(a, w.threshold, w.offset))
                continue
            out.append(w)
        return tuple(out)

    for i, t in enumerate(p.tasks):
        if any(w.counter in (a, b) for w in t.waits) or any(s.counter == b for s in t.signals):
            p.tasks[i] = dataclasses.replace(
                t, waits=fix_waits(t.waits),
                signals=tuple(Signal(a if s.counter == b else s.counter, s.amount) for s in t.signals))
    p.counters = [c for c in p.counters if c.name != b]
    return p


def m_wait_previous_epoch(prog: ScheduleProgram, rng: random.Random):
    """Turn a wait on this step's count into a wait on the previous step's (``@prev``):
    the counter's history from the last step satisfies it."""
    p = prog.copy()
    cands = [(i, k) for i, t in enumerate(p.tasks) for k, w in enumerate(t.waits) if w.offset == 0]
    if not cands:
        return None
    i, k = _pick(rng, _prefer(rng, cands, _first_waits(p), 0.8))
    w = p.tasks[i].waits[k]
    _set_entry(p, i, "waits", k, Wait(w.counter, w.threshold, -1))
    return p


def m_workers_beyond_coresidency(prog: ScheduleProgram, rng: random.Random):
    """Ask for more workers per rank than the target keeps co-resident: lower the target's
    limit below the worker count, or add workers beyond it."""
    p = prog.copy()
    p.target = dataclasses.replace(p.target)
    if rng.random() < 0.5 and p.workers >= 2:
        p.target.max_workers = rng.randint(1, p.workers - 1)
    else:
        p.target.max_workers = max(1, min(p.target.max_workers, p.workers + rng.randint(0, 2)))
        p.workers = p.target.max_workers + rng.randint(1, 3)
    return p


def m_counter_overflow(prog: ScheduleProgram, rng: random.Random):
    """Run enough steps that a counter's monotone count exceeds its signed width
    (``N(c) * (max_epochs + 1) > 2**(width-1) - 1``)."""
    p = prog.copy()
    n = p.signals_per_epoch()
    cands = [c for c in p.counters if n.get(c.name, 0) > 0]
    if not cands:
        return None
    c = _pick(rng, cands)
    if rng.random() < 0.3:
        c.width = 32
    limit = (1 << (c.width - 1)) - 1
    p.max_epochs = limit // n[c.name] + rng.randint(0, 1000)
    return p


def m_non_monotone_signal(prog: ScheduleProgram, rng: random.Random):
    """Make a signal amount zero or negative (a reset or decrement of a monotone counter)."""
    p = prog.copy()
    cands = _entries(p, "signals")
    if not cands:
        return None
    i, k = _pick(rng, cands)
    sig = p.tasks[i].signals[k]
    _set_entry(p, i, "signals", k, Signal(sig.counter, _pick(rng, [0, -1, -sig.amount - 1])))
    return p


def m_early_signal(prog: ScheduleProgram, rng: random.Random):
    """Release a signal before the write it publishes: move a writer's signal to a ``nop``
    placed just before it on the same worker."""
    p = prog.copy()
    cands = [i for i, t in enumerate(p.tasks) if t.signals and t.outs]
    if not cands:
        return None
    i = _pick(rng, cands)
    t = p.tasks[i]
    k = rng.randrange(len(t.signals))
    p.tasks[i] = dataclasses.replace(t, signals=t.signals[:k] + t.signals[k + 1:])
    p.tasks.insert(i, Task(_new_task_id(p, f"{t.id}.early"), t.rank, t.worker, "nop",
                           waits=t.waits, signals=(t.signals[k],)))
    return p


def m_remote_read(prog: ScheduleProgram, rng: random.Random):
    """Make a task read another rank's copy of a symmetric buffer (loads from a peer's
    memory are outside the IR's model: data moves only by put)."""
    p = prog.copy()
    bm = p.buffer_map()
    cands = [(i, k) for i, t in enumerate(p.tasks) for k, reg in enumerate(t.ins)
             if bm[reg.buffer].placement == "symmetric"]
    if not cands or p.ranks < 2:
        return None
    i, k = _pick(rng, cands)
    t = p.tasks[i]
    _set_entry(p, i, "ins", k, dataclasses.replace(
        t.ins[k], rank=_pick(rng, [r for r in range(p.ranks) if r != t.rank])))
    return p


def m_put_signal_relay(prog: ScheduleProgram, rng: random.Random):
    """Publish a put's data through a signal that is not on its destination rank: a
    put-with-signal to rank d signals a new counter on its own rank (or a third rank)
    instead, and a task on a new worker of that rank relays it to the original counter.
    NVSHMEM orders a signal after the data only at the same PE, so the relay may overtake
    the data."""
    p = prog.copy()
    pws = _pws(p)
    if not pws:
        return None
    i, j = _pick(rng, pws)
    t = p.tasks[i]
    r2 = _other_rank(p, rng, t.outs[0])
    w_new = _add_worker(p)
    if w_new is None:
        return None
    sig = t.signals[j]
    k = _new_counter(p, f"c.relay.r{r2}", r2)
    _set_entry(p, i, "signals", j, Signal(k, 1))
    p.tasks.append(Task(_new_task_id(p, f"{t.id}.relay"), r2, w_new, "nop",
                        waits=(Wait(k, 1),), signals=(sig,)))
    return p


def _wait_cands(p: ScheduleProgram, offset: int) -> list[tuple[int, int]]:
    n = p.signals_per_epoch()
    return [(i, k) for i, t in enumerate(p.tasks) for k, w in enumerate(t.waits)
            if w.offset == offset and 0 < w.threshold <= n.get(w.counter, 0)]


def m_wait_zero_threshold(prog: ScheduleProgram, rng: random.Random):
    """Spell a wait on this step's count ``c >= t`` as ``c >= t - N(c)``: in step e that is
    ``c >= (e - 1) N + t``, the previous step's count (satisfied at once in step 0)."""
    p = prog.copy()
    return _prev_step_spelling(p, rng, _prefer(rng, _wait_cands(p, 0), _first_waits(p), 0.8))


def m_threshold_beyond_range(prog: ScheduleProgram, rng: random.Random):
    """Set a wait's threshold beyond what its counter can ever hold: past the counter's
    signed width, or past 64 bits (e.g. 2**70)."""
    p = prog.copy()
    cands = _entries(p, "waits")
    if not cands:
        return None
    i, k = _pick(rng, cands)
    w = p.tasks[i].waits[k]
    width = p.counter_map()[w.counter].width
    thr = _pick(rng, [1 << (width - 1), (1 << 63) + rng.randint(0, 9), 1 << 70,
                      (1 << 64) * rng.randint(1, 1000)])
    _set_entry(p, i, "waits", k, Wait(w.counter, thr, w.offset))
    return p


# --------------------------------------------------------------------------------------
# Mutations meant to keep the schedule safe (false-reject probes)
# --------------------------------------------------------------------------------------

def s_rename(prog: ScheduleProgram, rng: random.Random):
    """Rename every task, buffer and counter consistently and shuffle the declaration
    order of buffers and counters."""
    p = prog.copy()
    tag = rng.randrange(1000)
    bmap = {b.name: f"b{tag}.{i}" for i, b in enumerate(p.buffers)}
    cmap = {c.name: f"k{tag}.{i}" for i, c in enumerate(p.counters)}
    for b in p.buffers:
        b.name = bmap[b.name]
    for c in p.counters:
        c.name = cmap[c.name]
    rng.shuffle(p.buffers)
    rng.shuffle(p.counters)
    for i, t in enumerate(p.tasks):
        p.tasks[i] = dataclasses.replace(
            t, id=f"t{tag}.{i}",
            ins=tuple(dataclasses.replace(r, buffer=bmap[r.buffer]) for r in t.ins),
            outs=tuple(dataclasses.replace(r, buffer=bmap[r.buffer]) for r in t.outs),
            waits=tuple(dataclasses.replace(w, counter=cmap[w.counter]) for w in t.waits),
            signals=tuple(dataclasses.replace(s, counter=cmap[s.counter]) for s in t.signals))
    return p


def s_redundant_wait(prog: ScheduleProgram, rng: random.Random):
    """Repeat a wait (same or lower threshold) on a later task of the same worker: it is
    already implied by queue order."""
    p = prog.copy()
    cands = []
    for i, t in enumerate(p.tasks):
        later = [j for j in _queue(p, t.rank, t.worker) if j > i]
        for w in t.waits:
            cands.extend((j, w) for j in later)
    if not cands:
        return None
    j, w = _pick(rng, cands)
    thr = rng.randint(1, w.threshold) if w.threshold >= 1 else w.threshold
    t = p.tasks[j]
    p.tasks[j] = dataclasses.replace(t, waits=t.waits + (Wait(w.counter, thr, w.offset),))
    return p


def s_split_task(prog: ScheduleProgram, rng: random.Random):
    """Split a local compute task's output (and matching operands) into two tasks on the
    same worker: the first keeps the waits, the second the signals."""
    p = prog.copy()
    cands = []
    for i, t in enumerate(p.tasks):
        if _is_remote_write(p, t) or not t.outs:
            continue
        n = t.outs[0].shape()[-1]
        if t.op in _ELEMENTWISE and n >= 2 and len(t.outs) == 1:
            cands.append(i)
        elif t.op == "gemv" and n >= 2 and t.ins[1].shape()[0] == n:
            cands.append(i)
        elif t.op == "reduce" and n >= 4 and len(t.ins[0].ranges) >= 2:
            cands.append(i)
    if not cands:
        return None
    i = _pick(rng, cands)
    t = p.tasks[i]
    n = t.outs[0].shape()[-1]
    cut = rng.randint(2, n - 2) if t.op == "reduce" else rng.randint(1, n - 1)

    def half(reg: Region, axis: int, first: bool) -> Region:
        rg = reg.ranges[axis]
        mid = Bound(rg.start.const + cut, rg.start.coef)
        return _set_axis(reg, axis, Range(rg.start, mid) if first else Range(mid, rg.stop))

    def part(first: bool) -> Task:
        out = half(t.outs[0], len(t.outs[0].ranges) - 1, first)
        if t.op == "gemv":
            ins = (t.ins[0], half(t.ins[1], 0, first)) + tuple(
                half(r, len(r.ranges) - 1, first) for r in t.ins[2:])
        else:
            ins = tuple(half(r, len(r.ranges) - 1, first) for r in t.ins)
        return dataclasses.replace(t, id=_new_task_id(p, f"{t.id}.{'a' if first else 'b'}"),
                                   ins=ins, outs=(out,), params=dict(t.params),
                                   waits=t.waits if first else (),
                                   signals=() if first else t.signals)

    a = part(True)
    p.tasks[i] = a
    p.tasks.insert(i + 1, part(False))
    return p


def _split_put_signal(prog: ScheduleProgram, rng: random.Random, op: str):
    p = prog.copy()
    pws = _pws(p)
    if not pws:
        return None
    i, t, sig = _detach_signal(p, rng, pws)
    p.tasks.insert(i + 1, Task(_new_task_id(p, f"{t.id}.{op}"), t.rank, t.worker, op, group=t.group))
    p.tasks.insert(i + 2, Task(_new_task_id(p, f"{t.id}.notify"), t.rank, t.worker, "nop",
                               signals=(sig,), group=t.group))
    return p


def s_fence_same_destination(prog: ScheduleProgram, rng: random.Random):
    """put-with-signal -> put; fence; signal to the same destination rank (a fence orders
    deliveries to one PE, so the signal still follows the data)."""
    return _split_put_signal(prog, rng, "fence")


def s_quiet_then_signal(prog: ScheduleProgram, rng: random.Random):
    """put-with-signal -> put; quiet; signal (the quiet completes the put first)."""
    return _split_put_signal(prog, rng, "quiet")


def _touch(prog: ScheduleProgram, t: Task) -> list[tuple[str, int, Region]]:
    return [(reg.buffer, _owner(prog, reg), reg) for reg in (*t.ins, *t.outs)]


def _overlap(a: Region, b: Region, slots: int) -> bool:
    for s in range(slots):
        if all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(a.concrete(s), b.concrete(s))):
            return True
    return False


def s_reorder_independent(prog: ScheduleProgram, rng: random.Random):
    """Swap two adjacent tasks A, B of one worker that share no memory. B takes a copy of
    A's waits (so it keeps every acquire it had behind A); excluded: B signals while A
    writes (B's signal would no longer publish A's writes), B waits while A signals (B
    might wait for A), remote writes, quiet and fence."""
    p = prog.copy()
    cands = []
    for r in range(p.ranks):
        for w in range(p.workers):
            q = _queue(p, r, w)
            for a, b in zip(q, q[1:]):
                ta, tb = p.tasks[a], p.tasks[b]
                if {ta.op, tb.op} & {"quiet", "fence"}:
                    continue
                if (tb.signals and ta.outs) or (tb.waits and ta.signals):
                    continue
                if _is_remote_write(p, ta) or _is_remote_write(p, tb):
                    continue
                if any(x[0] == y[0] and x[1] == y[1] and _overlap(x[2], y[2], p.slots)
                       for x in _touch(p, ta) for y in _touch(p, tb)):
                    continue
                cands.append((a, b))
    if not cands:
        return None
    a, b = _pick(rng, cands)
    ta, tb = p.tasks[a], p.tasks[b]
    extra = tuple(w for w in ta.waits if w not in tb.waits)
    p.tasks[a], p.tasks[b] = dataclasses.replace(tb, waits=extra + tb.waits), ta
    return p


def s_shuffle_listing(prog: ScheduleProgram, rng: random.Random):
    """Interleave the task list differently while keeping every worker's queue order
    (only per-queue order is meaningful)."""
    p = prog.copy()
    queues = [list(_queue(p, r, w)) for r in range(p.ranks) for w in range(p.workers)]
    queues = [q for q in queues if q]
    if len(queues) < 2:
        return None
    order = []
    heads = [0] * len(queues)
    live = list(range(len(queues)))
    while live:
        k = _pick(rng, live)
        order.append(queues[k][heads[k]])
        heads[k] += 1
        if heads[k] == len(queues[k]):
            live.remove(k)
    p.tasks = [p.tasks[i] for i in order]
    return p


def s_permute_workers(prog: ScheduleProgram, rng: random.Random):
    """Relabel the workers of one rank by a permutation (queues move as a whole)."""
    p = prog.copy()
    if p.workers < 2:
        w = _add_worker(p)
        if w is None:
            return None
    r = rng.randrange(p.ranks)
    perm = list(range(p.workers))
    while perm == list(range(p.workers)):
        rng.shuffle(perm)
    for i, t in enumerate(p.tasks):
        if t.rank == r:
            p.tasks[i] = dataclasses.replace(t, worker=perm[t.worker])
    return p


def s_put_signal_other_rank(prog: ScheduleProgram, rng: random.Random):
    """A put-with-signal also signals a new counter on its own rank (or a third rank) that a
    new task there waits for: a task may signal counters on any rank (docs/ir.md); the data
    is still published by the signal to the destination."""
    p = prog.copy()
    pws = _pws(p)
    if not pws:
        return None
    i, _ = _pick(rng, pws)
    t = p.tasks[i]
    r2 = _other_rank(p, rng, t.outs[0])
    k = _new_counter(p, f"c.extra.r{r2}", r2)
    p.tasks[i] = dataclasses.replace(t, signals=t.signals + (Signal(k, 1),))
    p.tasks.append(Task(_new_task_id(p, f"{t.id}.extra"), r2, rng.randrange(p.workers), "nop",
                        waits=(Wait(k, 1),)))
    return p


def s_credit_zero_threshold(prog: ScheduleProgram, rng: random.Random):
    """Spell a credit ``c >= t @prev`` as ``c >= t - N(c)`` (offset 0): in step e both mean
    ``c >= (e - 1) N + t``; the second is satisfied at once in step 0 and orders later steps."""
    p = prog.copy()
    return _prev_step_spelling(p, rng, _wait_cands(p, -1))


CLASSES: list[MutationClass] = [
    MutationClass("cross_rank_wait_cycle", "unsafe", "waits forming a cycle through two ranks", m_cross_rank_wait_cycle),
    MutationClass("queue_inversion", "unsafe", "queue order of two workers (or one) inverts a signal edge", m_queue_inversion),
    MutationClass("unsatisfiable_threshold", "unsafe", "a threshold above the increments a counter gets per step", m_unsatisfiable_threshold),
    MutationClass("partial_wait_shared_counter", "unsafe", "a wait on a shared counter for fewer increments than its producers give", m_partial_wait_shared_counter),
    MutationClass("dropped_wait", "unsafe", "one wait removed", m_dropped_wait),
    MutationClass("dropped_signal", "unsafe", "one signal removed", m_dropped_signal),
    MutationClass("missing_quiet", "unsafe", "a signal after puts with no quiet (or put-with-signal) completing them", m_missing_quiet),
    MutationClass("fence_across_ranks", "unsafe", "a fence relied on to order a put before a signal to another rank", m_fence_across_ranks),
    MutationClass("put_signal_data_overrun", "unsafe", "a put-with-signal writes past its window into a neighbour's", m_put_signal_data_overrun),
    MutationClass("recv_reuse_without_credit", "unsafe", "a receive buffer rewritten next step without a credit or a second slot", m_recv_reuse_without_credit),
    MutationClass("overlapping_unordered_writes", "unsafe", "a writer duplicated on another worker: overlapping unordered writes", m_overlapping_unordered_writes),
    MutationClass("partial_coverage_read", "unsafe", "part of a buffer left unwritten while its readers sync as before", m_partial_coverage_read),
    MutationClass("region_out_of_range", "unsafe", "a region past its buffer's end", m_region_out_of_range),
    MutationClass("param_out_of_range", "unsafe", "an op parameter out of range or missing", m_param_out_of_range),
    MutationClass("collective_order_mismatch", "unsafe", "one rank runs two collectives in the other order", m_collective_order_mismatch),
    MutationClass("counter_reuse_without_epochs", "unsafe", "one counter reused by two phases as if reset between them", m_counter_reuse_without_epochs),
    MutationClass("shared_counter_across_steps", "unsafe", "two counters waited together merged into one full wait: a producer a step ahead can stand in for a slow one", m_shared_counter_across_steps),
    MutationClass("wait_previous_epoch", "unsafe", "a wait on this step's count turned into a wait on the previous step's", m_wait_previous_epoch),
    MutationClass("workers_beyond_coresidency", "unsafe", "more workers than the target keeps co-resident", m_workers_beyond_coresidency),
    MutationClass("counter_overflow", "unsafe", "a counter overflows its width within max_epochs", m_counter_overflow),
    MutationClass("non_monotone_signal", "unsafe", "a zero or negative signal amount", m_non_monotone_signal),
    MutationClass("early_signal", "unsafe", "a signal released before the write it publishes", m_early_signal),
    MutationClass("remote_read", "unsafe", "a load from another rank's memory", m_remote_read),
    MutationClass("put_signal_relay", "unsafe", "a put's data published by its signal to a counter off its destination rank, relayed there", m_put_signal_relay),
    MutationClass("wait_zero_threshold", "unsafe", "a wait on this step's count spelled c >= t - N(c): the previous step's count", m_wait_zero_threshold),
    MutationClass("threshold_beyond_range", "unsafe", "a threshold beyond the counter's width (or 64 bits)", m_threshold_beyond_range),
    MutationClass("safe_rename", "safe", "every name changed consistently", s_rename),
    MutationClass("safe_redundant_wait", "safe", "a wait repeated where queue order implies it", s_redundant_wait),
    MutationClass("safe_split_task", "safe", "a compute task split in two (waits on the first, signals on the second)", s_split_task),
    MutationClass("safe_fence_same_destination", "safe", "put-with-signal -> put; fence; signal to the same rank", s_fence_same_destination),
    MutationClass("safe_quiet_then_signal", "safe", "put-with-signal -> put; quiet; signal", s_quiet_then_signal),
    MutationClass("safe_reorder_independent", "safe", "two independent adjacent tasks of a worker swapped (the second keeps the first's waits)", s_reorder_independent),
    MutationClass("safe_shuffle_listing", "safe", "task list interleaved differently, queue orders kept", s_shuffle_listing),
    MutationClass("safe_permute_workers", "safe", "workers of one rank relabelled", s_permute_workers),
    MutationClass("safe_put_signal_other_rank", "safe", "a put-with-signal also signals a counter on its own (or a third) rank", s_put_signal_other_rank),
    MutationClass("safe_credit_zero_threshold", "safe", "a credit c >= t @prev spelled c >= t - N(c) (offset 0)", s_credit_zero_threshold),
]
CLASS_MAP = {c.name: c for c in CLASSES}


# --------------------------------------------------------------------------------------
# Seeds
# --------------------------------------------------------------------------------------

SeedProvider = Callable[[], list[ScheduleProgram]]


def _lowered_seeds() -> list[ScheduleProgram]:
    """Tiny real lowerings (lowering.lower.lowered_corpus_seeds), when the lowering exists."""
    from lowering.lower import lowered_corpus_seeds

    return list(lowered_corpus_seeds())


def seed_programs(include_lowered: bool = True,
                  extra: Iterable[SeedProvider] = ()) -> tuple[list[tuple[str, ScheduleProgram]], dict]:
    """The corpus seeds as ``(label, program)`` pairs, and a dict describing where they came
    from. ``extra``: more providers (functions returning programs), e.g. other lowerings.
    A provider that fails is reported in the info dict, never silently dropped."""
    from validator.seeds import hand_seeds

    groups: list[tuple[str, list[ScheduleProgram]]] = [("hand", hand_seeds())]
    info: dict[str, Any] = {"providers": {}}
    providers: list[tuple[str, SeedProvider]] = []
    if include_lowered:
        providers.append(("lowered", _lowered_seeds))
    providers.extend((getattr(f, "__name__", f"extra{i}"), f) for i, f in enumerate(extra))
    for name, fn in providers:
        try:
            progs = fn()
            groups.append((name, progs))
        except Exception as exc:  # a missing or broken provider is reported, not fatal
            info["providers"][name] = f"unavailable: {type(exc).__name__}: {exc}"
    out: list[tuple[str, ScheduleProgram]] = []
    seen: set[str] = set()
    for gname, progs in groups:
        info["providers"].setdefault(gname, f"{len(progs)} programs")
        for p in progs:
            label = f"{gname}:{p.name}.{p.ranks}r{p.workers}w"
            k, base = 1, label
            while label in seen:
                k += 1
                label = f"{base}#{k}"
            seen.add(label)
            out.append((label, p))
    return out, info


# --------------------------------------------------------------------------------------
# False-reject reasons
# --------------------------------------------------------------------------------------

# Why the validator may reject a schedule in which the oracle observes no problem. Each
# reason names a conservative rule of the validator or a blind spot of the oracle; the
# classifier below attributes a false reject to one of them from the validator's findings
# and the program (and says "unexplained" otherwise, which is reported).
FR_REASONS: dict[str, dict[str, str]] = {
    "shared_counter_counting": {
        "kind": "conservative rule (validator)",
        "explanation": (
            "Safety rests on counting the increments of a counter that several producers "
            "share (across ranks, steps or phases): every other increment that could arrive "
            "first is itself ordered after the needed one or after the wait (a later task of "
            "the same worker, a credit that needs the wait, a relay). The validator proves a "
            "signal is included in a wait only when the other signals that could precede the "
            "wait total less than the threshold, without using those orders, and rejects. "
            "The oracle's executions never pass the wait without the needed increment."),
    },
    "credit_threshold_rule": {
        "kind": "conservative rule (validator)",
        "explanation": (
            "A credit wait (offset -1, @prev) with a threshold above N(c) is rejected as "
            "unsatisfiable (UnsatisfiableWait), and the receive buffer it guards as reused "
            "without credit. It is neither: in step e it waits for (e - 1) * N + t "
            "increments, i.e. also for some of step e's own credits, which other ranks or "
            "workers provide without the waiter, and a credit of step e is issued only after "
            "its rank finished step e - 1 (kernel boundary), reads included. The oracle runs "
            "every step to completion without a race."),
    },
    "collective_order_rule": {
        "kind": "conservative rule (validator)",
        "explanation": (
            "Collectives must appear in the same order on every rank (CollectiveOrder / "
            "CollectiveParticipation). When the swapped collectives use separate counters and "
            "buffers and the workers allow both orders, no execution deadlocks or races."),
    },
}

_HB_CLASSES = frozenset({"RemoteReadBeforeDelivery", "ReceiveBufferReuseWithoutCredit",
                         "CrossEpochRace", "ReadWriteRace", "UnorderedWrites", "UncoveredRead",
                         "PartialCoverageRead"})
_RULE_REASONS = {"CollectiveOrder": "collective_order_rule",
                 "CollectiveParticipation": "collective_order_rule"}


def _waits_on_shared_counter(prog: ScheduleProgram, task_ids: Iterable[str]) -> bool:
    """True if a task of ``task_ids`` (or an earlier task of its worker) waits on a counter
    signalled by two or more tasks."""
    signallers: dict[str, set[str]] = {}
    for t in prog.tasks:
        for s in t.signals:
            signallers.setdefault(s.counter, set()).add(t.id)
    pos = {t.id: i for i, t in enumerate(prog.tasks)}
    for tid in set(task_ids):
        if tid not in pos:
            continue
        t = prog.tasks[pos[tid]]
        for u in prog.tasks[:pos[tid] + 1]:
            if u.rank == t.rank and u.worker == t.worker and any(
                    len(signallers.get(w.counter, ())) >= 2 for w in u.waits):
                return True
    return False


def explain_false_reject(prog: ScheduleProgram, mutation: str, verdict_json: dict) -> str:
    """The ``FR_REASONS`` key of a reject of a program the oracle found safe, or
    ``"unexplained"``. Every finding must be covered by the reason: rule findings by their
    rule, happens-before findings (races, remote reads, receive-buffer reuse) by a shared
    counter on which one of the finding's tasks (or an earlier task of its worker) waits."""
    errors = verdict_json.get("errors", [])
    if not errors:
        return "unexplained"
    reasons = set()
    n = prog.signals_per_epoch()
    by_id = {t.id: t for t in prog.tasks}

    def over_credit(tid: str) -> bool:
        t = by_id.get(tid)
        return t is not None and any(w.offset == -1 and w.threshold > n.get(w.counter, 0)
                                     for w in t.waits)

    for e in errors:
        cls = e.get("class")
        tids = [t for t in e.get("tasks", ()) if t in by_id]
        if cls == "UnsatisfiableWait" and tids and all(over_credit(t) for t in tids):
            reasons.add("credit_threshold_rule")
        elif cls == "ReceiveBufferReuseWithoutCredit" and any(over_credit(t) for t in tids):
            reasons.add("credit_threshold_rule")
        elif cls in _RULE_REASONS:
            reasons.add(_RULE_REASONS[cls])
        elif cls in _HB_CLASSES and _waits_on_shared_counter(prog, e.get("tasks", ())):
            reasons.add("shared_counter_counting")
        else:
            return "unexplained"
    # Report one reason per schedule: the rule that fired first in FR_REASONS order.
    return next(k for k in FR_REASONS if k in reasons)


# --------------------------------------------------------------------------------------
# Generation, labelling, validation
# --------------------------------------------------------------------------------------

def make_item(i: int, seed: int, seeds: list[tuple[str, ScheduleProgram]]
              ) -> tuple[MutationClass, str, ScheduleProgram] | None:
    """Item ``i`` of the corpus: its class, seed label and mutated program (deterministic)."""
    rng = random.Random(f"{seed}:{i}")
    for shift in range(len(CLASSES)):
        cls = CLASSES[(i + shift) % len(CLASSES)]
        order = list(range(len(seeds)))
        rng.shuffle(order)
        for si in order:
            label, base = seeds[si]
            prog = cls.fn(base, rng)
            if prog is not None:
                return cls, label, prog
    return None


def _program_json(prog: ScheduleProgram) -> dict:
    try:
        from ir.jsonio import program_to_json

        return program_to_json(prog)
    except Exception:  # fall back to a plain dump if the JSON form cannot express it
        return json.loads(json.dumps(dataclasses.asdict(prog), default=repr))


def _load_validator():
    try:
        from validator import validate
    except Exception as exc:
        return None, f"unavailable: {type(exc).__name__}: {exc}"
    return validate, "validator.validate"


def label_one(i: int, seed: int, seeds, runs: int, validate) -> dict[str, Any] | None:
    """Generate, label (oracle) and validate item ``i``; return its record."""
    from validator import oracle

    item = make_item(i, seed, seeds)
    if item is None:
        return None
    cls, label, prog = item
    t0 = time.perf_counter()
    res = oracle.check(prog, runs=runs, seed=i)
    t1 = time.perf_counter()
    rec: dict[str, Any] = {
        "i": i, "class": cls.name, "seed": label, "oracle_safe": res.safe,
        "oracle_classes": sorted(res.classes), "oracle_seconds": t1 - t0,
        "oracle_exhaustive": bool(res.stats.get("exhaustive")),
    }
    if validate is None:
        rec.update(validator_ok=None, validator_classes=[], outcome="unvalidated")
        return rec
    try:
        v = validate(prog)
        ok, vcls, vjson = v.ok, sorted(v.classes), v.to_json()
    except Exception as exc:  # a crash is a bug to report, never an accept
        ok, vcls = False, ["ValidatorCrash"]
        vjson = {"ok": False, "errors": [{"class": "ValidatorCrash", "message": repr(exc)}]}
    rec["validate_seconds"] = time.perf_counter() - t1
    rec["validator_ok"], rec["validator_classes"] = ok, vcls
    if res.safe and not ok:
        # A disputed "safe" label: look harder before calling it a false reject (16x the
        # interleavings, one more epoch per rank). A problem found now is a real witness.
        t2 = time.perf_counter()
        deep = oracle.check(prog, runs=16 * runs, seed=7919 + i, exhaustive=False,
                            epochs=oracle.default_epochs(prog) + 1)
        rec["oracle_seconds"] += time.perf_counter() - t2
        rec["escalated"] = True
        if not deep.safe:
            res = deep
            rec["oracle_safe"], rec["oracle_classes"] = False, sorted(deep.classes)
            rec["escalation_found"] = True
    if res.safe:
        rec["outcome"] = "true_accept" if ok else "false_reject"
    else:
        rec["outcome"] = "false_accept" if ok else "true_reject"
    if rec["outcome"] == "false_reject":
        rec["fr_reason"] = explain_false_reject(prog, cls.name, vjson)
    if rec["outcome"] in ("false_accept", "false_reject") or "ValidatorCrash" in vcls:
        rec["detail"] = {"program": _program_json(prog), "oracle": res.to_json(), "validator": vjson}
    return rec


_STATE: dict[str, Any] = {}


def _init_worker(seed: int, include_lowered: bool, runs: int) -> None:
    _STATE["seeds"], _ = seed_programs(include_lowered)
    _STATE["seed"], _STATE["runs"] = seed, runs
    _STATE["validate"], _ = _load_validator()


def _work(i: int):
    return label_one(i, _STATE["seed"], _STATE["seeds"], _STATE["runs"], _STATE["validate"])


def run_corpus(count: int = 10_000, seed: int = 0, jobs: int = 1, runs: int = 24,
               include_lowered: bool = True, progress: Callable[[int], None] | None = None,
               stability_sample: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Generate, label and validate ``count`` items; return (report, records).

    ``jobs`` > 1 uses that many processes (results are identical to ``jobs=1``).
    ``progress(n)`` is called after each finished item. ``stability_sample`` > 0 adds
    ``report["oracle_stability"]`` (see ``stability``: 16x the runs, 2 more epochs)."""
    t0 = time.perf_counter()
    seeds, seed_info = seed_programs(include_lowered)
    validate, vstatus = _load_validator()
    records: list[dict[str, Any]] = []
    if jobs > 1:
        import multiprocessing as mp

        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        with ctx.Pool(jobs, initializer=_init_worker, initargs=(seed, include_lowered, runs)) as pool:
            for rec in pool.imap(_work, range(count), chunksize=4):
                if rec is not None:
                    records.append(rec)
                if progress:
                    progress(1)
    else:
        for i in range(count):
            rec = label_one(i, seed, seeds, runs, validate)
            if rec is not None:
                records.append(rec)
            if progress:
                progress(1)
    report = build_report(records, seed=seed, count=count, runs=runs, jobs=jobs,
                          seeds=seeds, seed_info=seed_info, validator=vstatus,
                          seconds=time.perf_counter() - t0)
    report["seed_checks"] = check_seeds(seeds, runs, validate)
    if stability_sample > 0:
        t1 = time.perf_counter()
        report["oracle_stability"] = stability(records, seed, seeds, stability_sample, 16 * runs)
        report["oracle_stability"]["seconds"] = time.perf_counter() - t1
    return report, records


def check_seeds(seeds: list[tuple[str, ScheduleProgram]], runs: int, validate) -> dict[str, Any]:
    """Label and validate the unmutated seeds. Every seed should be oracle-safe (else the
    seed is wrong) and accepted; a rejected seed turns every safe mutation of it into a
    false reject, so it is listed with its reason."""
    from validator import oracle

    unsafe, rejected = [], []
    for label, prog in seeds:
        res = oracle.check(prog, runs=runs, seed=0)
        if not res.safe:
            unsafe.append({"seed": label, "problems": sorted(res.classes)})
            continue
        if validate is None:
            continue
        try:
            vjson = validate(prog).to_json()
        except Exception as exc:  # reported like a reject
            vjson = {"ok": False, "errors": [{"class": "ValidatorCrash", "message": repr(exc)}]}
        if not vjson["ok"]:
            rejected.append({"seed": label,
                             "validator_errors": sorted({e["class"] for e in vjson["errors"]}),
                             "reason": explain_false_reject(prog, "seed", vjson)})
    return {"programs": len(seeds), "oracle_unsafe": unsafe, "validator_rejects": rejected}


def build_report(records: list[dict[str, Any]], *, seed: int, count: int, runs: int, jobs: int,
                 seeds, seed_info: dict, validator: str, seconds: float) -> dict[str, Any]:
    """Aggregate records into the report (see docs/validator-corpus.md for the keys)."""
    def tally(recs: list[dict]) -> dict[str, Any]:
        d: dict[str, Any] = {
            "count": len(recs),
            "unsafe": sum(not r["oracle_safe"] for r in recs),
            "false_accepts": sum(r["outcome"] == "false_accept" for r in recs),
            "false_rejects": sum(r["outcome"] == "false_reject" for r in recs),
            "true_accepts": sum(r["outcome"] == "true_accept" for r in recs),
            "true_rejects": sum(r["outcome"] == "true_reject" for r in recs),
        }
        return d

    def counts(keys: Iterable[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in keys:
            out[k] = out.get(k, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    classes: dict[str, Any] = {}
    for cls in CLASSES:
        recs = [r for r in records if r["class"] == cls.name]
        d = tally(recs)
        d.update(intent=cls.intent, description=cls.description,
                 oracle_problems=counts(c for r in recs for c in r["oracle_classes"]),
                 validator_errors=counts(c for r in recs for c in r["validator_classes"]),
                 false_reject_reasons=counts(r["fr_reason"] for r in recs if r.get("fr_reason")))
        classes[cls.name] = d
    total = tally(records)
    frr = counts(r["fr_reason"] for r in records if r.get("fr_reason"))
    report: dict[str, Any] = {
        "total": total["count"], "unsafe": total["unsafe"], "safe": total["count"] - total["unsafe"],
        "false_accepts": total["false_accepts"], "false_rejects": total["false_rejects"],
        "true_accepts": total["true_accepts"], "true_rejects": total["true_rejects"],
        "unexplained_false_rejects": frr.get("unexplained", 0),
        # the validator failing on its own (a bug to fix; counted as rejects, never accepts)
        "validator_internal_errors": sum(
            any(c in ("InternalError", "ValidatorCrash") for c in r["validator_classes"])
            for r in records),
        "classes": classes,
        "false_reject_reasons": {k: {"count": n, **FR_REASONS.get(k, {"kind": "unexplained",
                                                                      "explanation": "no named reason covers it"})}
                                 for k, n in frr.items()},
        "oracle_problem_classes": counts(c for r in records for c in r["oracle_classes"]),
        "oracle_escalations": {
            "rechecked": sum(bool(r.get("escalated")) for r in records),
            "found_unsafe": sum(bool(r.get("escalation_found")) for r in records),
            "found_unsafe_items": [
                {"i": r["i"], "class": r["class"], "seed": r["seed"],
                 "problems": r["oracle_classes"]}
                for r in records if r.get("escalation_found")]},
        "false_accept_items": [
            {"i": r["i"], "class": r["class"], "seed": r["seed"], "problems": r["oracle_classes"]}
            for r in records if r["outcome"] == "false_accept"],
        "false_reject_items": [
            {"i": r["i"], "class": r["class"], "seed": r["seed"], "reason": r["fr_reason"],
             "validator_errors": r["validator_classes"]}
            for r in records if r["outcome"] == "false_reject"],
        "validator_error_classes": counts(c for r in records for c in r["validator_classes"]),
        "seeds": {"programs": len(seeds), "providers": seed_info["providers"],
                  "used": counts(r["seed"] for r in records)},
        "setup": {"count": count, "seed": seed, "jobs": jobs, "oracle_runs": runs,
                  "oracle_epochs": "max(3, slots + 1) per rank",
                  "oracle_exhaustive_items": sum(r.get("oracle_exhaustive", False) for r in records),
                  "validator": validator, "mutation_classes": len(CLASSES)},
        "seconds": {"total": seconds,
                    "oracle": sum(r["oracle_seconds"] for r in records),
                    "validator": sum(r.get("validate_seconds", 0.0) for r in records)},
    }
    return report


def stability(records: list[dict[str, Any]], seed: int, seeds, sample: int, runs: int,
              extra_epochs: int = 2) -> dict[str, Any]:
    """Re-check the first ``sample`` items the oracle labelled safe with ``runs`` fresh
    random interleavings (other seeds), and again with ``extra_epochs`` more epochs per
    rank: how many labels flip to unsafe measures the oracle's blind spot (bounded
    exploration, bounded unroll)."""
    from validator import oracle

    safe = [r for r in records if r["oracle_safe"]][:sample]
    flips_runs, flips_epochs = [], []
    for r in safe:
        _, _, prog = make_item(r["i"], seed, seeds)
        a = oracle.check(prog, runs=runs, seed=1_000_003 + r["i"], exhaustive=False)
        if not a.safe:
            flips_runs.append({"i": r["i"], "class": r["class"], "problems": sorted(a.classes)})
        b = oracle.check(prog, runs=max(1, runs // 4), seed=2_000_003 + r["i"], exhaustive=False,
                         epochs=oracle.default_epochs(prog) + extra_epochs)
        if not b.safe:
            flips_epochs.append({"i": r["i"], "class": r["class"], "problems": sorted(b.classes)})
    return {"rechecked": len(safe), "runs": runs, "flips_with_more_runs": flips_runs,
            "extra_epochs": extra_epochs, "flips_with_more_epochs": flips_epochs}


def write_outputs(out_dir: str, report: dict[str, Any], records: list[dict[str, Any]],
                  fr_samples: int = 3) -> None:
    """Write ``report.json``; every false accept to ``false_accepts/``; up to ``fr_samples``
    false rejects per reason to ``false_rejects/`` (each: program, oracle and validator).
    Each file is written whole or not at all; a failed write raises AmkError naming it."""
    from ground.files import atomic_write_text  # whole files or none; AmkError names the path

    atomic_write_text(os.path.join(out_dir, "report.json"), json.dumps(report, indent=1) + "\n")
    for sub in ("false_accepts", "false_rejects"):
        d = os.path.join(out_dir, sub)
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name.endswith(".json"):
                    os.remove(os.path.join(d, name))
    per_reason: dict[str, int] = {}
    for r in records:
        if "detail" not in r:
            continue
        if r["outcome"] == "false_accept" or "ValidatorCrash" in r["validator_classes"]:
            sub = "false_accepts" if r["outcome"] == "false_accept" else "false_rejects"
        else:
            k = r.get("fr_reason", "unexplained")
            per_reason[k] = per_reason.get(k, 0) + 1
            if per_reason[k] > fr_samples:
                continue
            sub = "false_rejects"
        body = {k: v for k, v in r.items() if k != "detail"}
        body.update(r["detail"])
        atomic_write_text(os.path.join(out_dir, sub, f"{r['i']:05d}-{r['class']}.json"),
                          json.dumps(body, indent=1) + "\n", durable=False)


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------

MD_BEGIN = "<!-- corpus-report:begin (generated by amk validate-corpus --markdown; do not edit) -->"
MD_END = "<!-- corpus-report:end -->"


def render_markdown(report: dict[str, Any]) -> str:
    """The generated section of docs/validator-corpus.md: totals, the per-class table,
    false-reject reasons and setup, all taken from ``report``."""
    s = report["setup"]
    lines = [
        MD_BEGIN, "",
        f"Corpus of **{report['total']}** schedules (`--count {s['count']} --seed {s['seed']}`), "
        f"{s['mutation_classes']} mutation classes, {report['seeds']['programs']} seed programs; "
        f"oracle: {s['oracle_runs']} random interleavings per schedule, {s['oracle_epochs']}, "
        f"{s['oracle_exhaustive_items']} schedules explored exhaustively; validator: `{s['validator']}`.",
        "",
        "| total | unsafe (oracle) | safe (oracle) | false accepts | false rejects | "
        "unexplained false rejects | validator internal errors |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {report['total']} | {report['unsafe']} | {report['safe']} | {report['false_accepts']} | "
        f"{report['false_rejects']} | {report['unexplained_false_rejects']} | "
        f"{report.get('validator_internal_errors', 0)} |",
        "",
        "| class | intent | count | unsafe | false accepts | false rejects | false-reject reasons | mutation |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for name, d in report["classes"].items():
        reasons = ", ".join(f"{k} ({v})" for k, v in d.get("false_reject_reasons", {}).items()) or "-"
        lines.append(f"| {name} | {d['intent']} | {d['count']} | {d['unsafe']} | "
                     f"{d['false_accepts']} | {d['false_rejects']} | {reasons} | "
                     f"{d.get('description', '')} |")
    lines += ["", "False rejects by reason:", ""]
    if report["false_reject_reasons"]:
        lines += ["| reason | kind | count | explanation |", "|---|---|---:|---|"]
        for k, d in report["false_reject_reasons"].items():
            lines.append(f"| {k} | {d.get('kind', '')} | {d['count']} | {d.get('explanation', '')} |")
    else:
        lines.append("none.")
    lines += ["", "Problems the oracle observed (a schedule may show several):", "",
              "| oracle class | schedules |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in report["oracle_problem_classes"].items()]
    sc = report.get("seed_checks")
    if sc:
        rej = "; ".join(f"{x['seed']} ({x['reason']})" for x in sc["validator_rejects"]) or "none"
        bad = "; ".join(f"{x['seed']} ({', '.join(x['problems'])})" for x in sc["oracle_unsafe"]) or "none"
        lines += ["", f"Seeds ({sc['programs']}): unsafe to the oracle: {bad}. Rejected by the "
                  f"validator (every safe mutation of these is a false reject): {rej}."]
    esc = report.get("oracle_escalations")
    if esc:
        lines += ["", f"Disputed labels: {esc['rechecked']} schedules the oracle found safe but the "
                  "validator rejected were re-checked with 16x the interleavings and one more "
                  f"epoch per rank; {esc['found_unsafe']} turned out unsafe (their labels and "
                  "witnesses are the re-check's)."]
    st = report.get("oracle_stability")
    if st:
        lines += ["", f"Oracle stability: of the first {st['rechecked']} schedules labelled safe, "
                  f"{len(st['flips_with_more_runs'])} became unsafe with {st['runs']} further random "
                  f"interleavings and {len(st['flips_with_more_epochs'])} with "
                  f"{st['extra_epochs']} more epochs per rank."]
    prov = "; ".join(f"{k}: {v}" for k, v in report["seeds"]["providers"].items())
    secs = report["seconds"]
    lines += ["", f"Seed providers: {prov}.", "",
              f"Time: {secs['total']:.0f} s wall ({s['jobs']} processes); oracle "
              f"{secs['oracle']:.0f} s, validator {secs['validator']:.0f} s (CPU seconds summed "
              "over processes).", "", MD_END]
    return "\n".join(lines) + "\n"


def update_markdown(path: str, report: dict[str, Any]) -> None:
    """Replace the generated section of ``path`` (between ``MD_BEGIN``/``MD_END``) with
    ``render_markdown(report)``; append it if the file has no such section. The file is
    replaced whole (AmkError naming it when it cannot be written)."""
    section = render_markdown(report)
    text = ""
    if os.path.isfile(path):
        with open(path) as f:
            text = f.read()
    if MD_BEGIN in text and MD_END in text:
        a = text.index(MD_BEGIN)
        b = text.index(MD_END) + len(MD_END)
        rest = text[b:]
        if rest.startswith("\n"):
            rest = rest[1:]
        text = text[:a] + section + rest
    else:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section
    from ground.files import atomic_write_text  # whole file or none; AmkError names the path

    atomic_write_text(path, text)
