"""Re-placing one stage of a ScheduleProgram by a placement policy (the ``replace`` edit).

The lowering places each task when it emits it (``lowering.lower._Emitter.place``); this
module re-runs that placement for the tasks of one stage of an existing program, with the
same policies (``round_robin``, ``balanced``, ``stage``) and the same cost (``task_bytes``
plus ``TASK_FIXED_BYTES`` per task), and then repairs the synchronisation that queue order
carried: the lowering omits a wait when the producer runs earlier on the consumer's worker,
and chains (gate -> up -> silu) signal only at their end. Every pair of tasks of the rank
that touch overlapping memory (one of them writing) and were ordered before the edit but
no longer are gets an explicit edge: the earlier task signals a fresh counter
``c.place.<task id>`` and the later one waits for it. Program order is kept, so each
queue's order is the program order restricted to it, as in the lowering.
"""

from __future__ import annotations

import dataclasses
from graphlib import CycleError, TopologicalSorter

from ir.edits import Edit, EditError, apply_edits as _apply, stage_of
from ir.program import Counter, Region, ScheduleProgram, Signal, Wait
from lowering.costmodel import task_bytes
from lowering.lower import TASK_FIXED_BYTES


def _ancestors(p: ScheduleProgram, rank: int) -> dict[int, int]:
    """For every task index k of ``rank``: a bitset (bit j = task index j) of the rank's
    tasks ordered before it by queue order and by waits that need all of a step's signals
    (threshold N(c), this step). Raises EditError on a dependency cycle."""
    mine = [k for k, t in enumerate(p.tasks) if t.rank == rank]
    n_of = p.signals_per_epoch()
    signallers: dict[str, list[int]] = {}
    for k in mine:
        for s in p.tasks[k].signals:
            signallers.setdefault(s.counter, []).append(k)
    preds: dict[int, set[int]] = {k: set() for k in mine}
    last: dict[int, int] = {}
    for k in mine:
        t = p.tasks[k]
        if t.worker in last:
            preds[k].add(last[t.worker])
        last[t.worker] = k
        for w in t.waits:
            if w.offset == 0 and w.threshold >= n_of.get(w.counter, 0) > 0:
                preds[k].update(q for q in signallers.get(w.counter, ()) if q != k)
    try:
        order = list(TopologicalSorter(preds).static_order())
    except CycleError as e:
        raise EditError(f"replace: rank {rank}'s tasks wait on each other in a cycle "
                        f"({' -> '.join(p.tasks[k].id for k in e.args[1][:6])}); re-placement "
                        "needs an acyclic schedule") from None
    anc: dict[int, int] = {}
    for k in order:
        bits = 0
        for q in preds[k]:
            bits |= anc[q] | (1 << q)
        anc[k] = bits
    return anc


def _overlap(a: Region, b: Region, slots: int) -> bool:
    if a.buffer != b.buffer or a.rank != b.rank or len(a.ranges) != len(b.ranges):
        return False
    return any(all(x.at(s)[0] < y.at(s)[1] and y.at(s)[0] < x.at(s)[1]
                   for x, y in zip(a.ranges, b.ranges)) for s in range(max(1, slots)))


def _conflicts(p: ScheduleProgram, rank: int) -> list[tuple[int, int]]:
    """Pairs (i, j), i < j task indices of ``rank``, that touch overlapping memory of the
    rank's own copies with at least one write."""
    acc: dict[str, list[tuple[int, bool, Region]]] = {}
    for k, t in enumerate(p.tasks):
        if t.rank != rank:
            continue
        for r in t.ins:
            if r.rank == rank:
                acc.setdefault(r.buffer, []).append((k, False, r))
        for r in t.outs:
            if r.rank == rank:
                acc.setdefault(r.buffer, []).append((k, True, r))
    pairs = set()
    for lst in acc.values():
        if not any(w for _, w, _ in lst):
            continue
        for x in range(len(lst)):
            kx, wx, rx = lst[x]
            for y in range(x + 1, len(lst)):
                ky, wy, ry = lst[y]
                if kx != ky and (wx or wy) and _overlap(rx, ry, p.slots):
                    pairs.add((min(kx, ky), max(kx, ky)))
    return sorted(pairs)


def replace_stage(prog: ScheduleProgram, stage: str, policy: str,
                  rank: int | None = None) -> ScheduleProgram:
    """A copy of ``prog`` with the tasks of ``stage`` (``ir.edits.stage_of`` of their ids) on
    ``rank`` (every rank when None) re-placed onto workers by ``policy`` and the lost
    queue-order dependencies replaced by counters (module docstring).

    Raises EditError for an unknown stage or policy, or a rank whose tasks already wait on
    each other in a cycle.
    """
    from lowering.config import POLICIES

    if policy not in POLICIES:
        raise EditError(f"replace: unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    p = prog.copy()
    idx = [k for k, t in enumerate(p.tasks)
           if stage_of(t.id) == stage and (rank is None or t.rank == rank)]
    if not idx:
        stages = sorted({stage_of(t.id) for t in p.tasks})
        hint = ", ".join(stages[:12]) + (", ..." if len(stages) > 12 else "")
        raise EditError(f"replace: field 'stage': no task of stage {stage!r}"
                        + (f" on rank {rank}" if rank is not None else "") + f"; stages: {hint}")
    buffers = p.buffer_map()
    seq = max(1, int(p.config.get("max_seq", 2) or 2) // 2)
    W = p.workers
    in_stage = set(idx)
    for r in sorted({p.tasks[k].rank for k in idx}):
        before = _ancestors(p, r)
        loads, st, cursor = [0] * W, [0] * W, 0
        for k, t in enumerate(p.tasks):
            if t.rank != r:
                continue
            cost = task_bytes(t, buffers, seq) + TASK_FIXED_BYTES
            if k in in_stage:
                if policy == "round_robin":
                    w = cursor % W
                    cursor += 1
                elif policy == "balanced":
                    w = min(range(W), key=lambda i: (loads[i], i))
                else:
                    w = min(range(W), key=lambda i: (st[i], loads[i], i))
                    st[w] += cost
                p.tasks[k] = dataclasses.replace(t, worker=w)
                t = p.tasks[k]
            loads[t.worker] += cost
        after = _ancestors(p, r)
        need: dict[int, list[int]] = {}
        for i, j in _conflicts(p, r):
            for a, b in ((i, j), (j, i)):
                if before.get(b, 0) >> a & 1 and not after.get(b, 0) >> a & 1:
                    need.setdefault(a, []).append(b)
        names = {c.name for c in p.counters}
        for a, consumers in need.items():
            ta = p.tasks[a]
            c = f"c.place.{ta.id}"
            while c in names:
                c += "_"
            names.add(c)
            p.counters.append(Counter(c, r))
            p.tasks[a] = dataclasses.replace(ta, signals=ta.signals + (Signal(c, 1),))
            for b in sorted(set(consumers)):
                tb = p.tasks[b]
                p.tasks[b] = dataclasses.replace(tb, waits=tb.waits + (Wait(c, 1),))
    return p


def apply_edits(prog: ScheduleProgram, edits: list[Edit]) -> ScheduleProgram:
    """``ir.edits.apply_edits`` with the ``replace`` op (``replace_stage``): every op of the
    edit language. Returns the edited copy (not validated); raises EditError (exit 2)."""
    return _apply(prog, edits, placer=replace_stage)
