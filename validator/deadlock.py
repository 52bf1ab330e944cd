"""Deadlock checks: unsatisfiable waits, the exact monotone simulation, cycle witnesses, and
collective participation.

Why one greedy run decides deadlock: counters only grow and waits are ``>=`` thresholds, so
running a task never disables another one. Hence every maximal execution ends in the same
state (the system is confluent), and if a greedy run stalls, every execution stalls
(ir/program.py semantics; this is the classic argument for monotone counter systems). Remote
puts and signals are assumed to be delivered eventually (NVSHMEM progress; a kernel end
completes them), so for liveness a signal counts from the moment its task ran.

The run is *round based* and vectorised over chains (validator/window.py): in each round
every worker queue runs as many segments as the counter values at the start of the round
allow; the round's signals are added at its end. Work is O(segments + waits + signals) in
numpy. Launches of 1, 2, ..., E steps are checked in one pass: stage k allows only epochs
< k, runs to the fixpoint, and a stall at stage k is a deadlock of a k-step launch.

The round in which each segment ran is a topological order of every happens-before edge
(queue order, kernel boundaries, and any signal that preceded its waiter in this run), so
validator/hb.py reuses it to compute vector clocks level by level.

Error classes: UnsatisfiableWait, Deadlock, DeadlockCycle, CollectiveParticipation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from validator.structure import Index
from validator.verdict import Finding
from validator.window import Window


@dataclass
class SimResult:
    """``seg_round[s]``: the round segment ``s`` ran in (-1: never). ``stuck``: deadlock."""

    seg_round: np.ndarray
    rounds: int
    stuck: bool
    findings: list[Finding] = field(default_factory=list)
    stalled_launch_steps: int | None = None


def _ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate ``arange(lo[i], hi[i])`` for all i; also return the owner i per element."""
    cnt = hi - lo
    cs = np.cumsum(cnt)  # called thousands of times on short arrays: fewest numpy calls
    tot = int(cs[-1]) if len(cs) else 0
    if tot == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(lo)), cnt)
    starts = np.repeat(lo - (cs - cnt), cnt)
    return starts + np.arange(tot), owner


def unsatisfiable_waits(ix: Index) -> list[Finding]:
    """Waits whose threshold exceeds one epoch's worth of signals: ``t > N(c)``.

    With offset 0 such a wait needs signals of a later step, which never come in the last
    step of a launch; with ``@prev`` it waits for more than the previous step produced. A
    threshold beyond the counter's signed range (or beyond int64) is the same diagnosis:
    the Index holds it clamped above N(c), the message the value as written.
    """
    out = []
    if not len(ix.w_task):
        return out
    bad = np.nonzero(ix.w_thr > ix.ctr_n[ix.w_ctr])[0]
    for k in bad:
        t, c = int(ix.w_task[k]), int(ix.w_ctr[k])
        n = int(ix.ctr_n[c])
        thr, off = _src_wait(ix, int(k))
        prev = " @prev" if off else ""
        width = int(ix.ctr_width[c])
        beyond = (f" (beyond the {width}-bit counter's range, at most {(1 << (width - 1)) - 1})"
                  if thr > (1 << (width - 1)) - 1 else "")
        out.append(Finding(
            "UnsatisfiableWait",
            f"task {ix.task_ids[t]} waits {ix.ctr_names[c]} >= {thr}{prev}{beyond}, but "
            f"only {n} is signalled to it per step",
            tasks=[ix.task_ids[t]],
            witness={"task": ix.task_ids[t], "counter": ix.ctr_names[c],
                     "threshold": thr, "offset": off, "counter_width": width,
                     "signalled_per_step": n,
                     "signallers": _signallers(ix, c)}))
    return out


def _src_wait(ix: Index, k: int) -> tuple[int, int]:
    """Static wait ``k``'s threshold and offset as written (the Index normalises them)."""
    thr = ix.w_thr_src[k] if ix.w_thr_src is not None else ix.w_thr[k]
    off = ix.w_off_src[k] if ix.w_off_src is not None else ix.w_off[k]
    return int(thr), int(off)


def _signallers(ix: Index, c: int, limit: int = 20) -> list[str]:
    ks = np.nonzero(ix.s_ctr == c)[0][:limit]
    return [ix.task_ids[int(ix.s_task[k])] for k in ks]


def _rank_finished(cptr: np.ndarray, lo: np.ndarray, per_epoch: np.ndarray, R: int,
                   W: int) -> np.ndarray:
    """Per rank, the number of whole epochs all of its queues (chains) have completed."""
    fin = np.full(len(cptr), np.iinfo(np.int64).max // 4, dtype=np.int64)
    nz = per_epoch > 0
    fin[nz] = (cptr[nz] - lo[nz]) // per_epoch[nz]
    return fin.reshape(R, W).min(axis=1)


def _segments_ready(win: Window, cand: np.ndarray, seg_rank: np.ndarray, rfin: np.ndarray,
                    V0: np.ndarray) -> np.ndarray:
    """For each candidate segment: its kernel boundary has passed (a segment that opens an
    epoch runs only once its rank finished the previous one) and every wait of the segment
    holds against the counter values ``V0`` at the start of the round."""
    ok = np.ones(len(cand), dtype=bool)
    kern = win.seg_kernel[cand] == 1
    if kern.any():
        ok &= ~kern | (rfin[seg_rank[cand]] >= win.seg_epoch[cand])
    wl, wh = win.seg_wi_lo[cand], win.seg_wi_hi[cand]
    if (wh > wl).any():
        idx, own = _ranges(wl, wh)
        unsat = V0[win.wi_ctr[idx]] < win.wi_abs[idx]
        ok &= ~(np.bincount(own[unsat], minlength=len(cand)) > 0)
    return ok


LOOKAHEAD = 16  # segments of one queue tested per numpy pass of the simulation
_LOOK = np.arange(LOOKAHEAD)


def simulate(ix: Index, win: Window) -> SimResult:
    """Greedy round-based run of all queues over the window's epochs (see module doc)."""
    R, W = ix.ranks, ix.workers
    lo, hi = win.chain_seg_lo, win.chain_seg_hi
    cm = win.cm_order
    per_epoch = (hi - lo) // win.E  # segments per chain per epoch
    V = np.zeros(len(ix.ctr_names), dtype=np.int64)
    cptr = lo.copy()
    seg_round = np.full(win.n_seg, -1, dtype=np.int64)
    rnd = 0
    seg_rank = win.chain_rank[win.seg_chain]

    def rank_finished() -> np.ndarray:
        return _rank_finished(cptr, lo, per_epoch, R, W)

    n_cm = len(cm)
    for allowed in range(win.E):  # stage: a launch of allowed+1 steps
        while True:
            V0 = V.copy()
            rfin = rank_finished()
            active = np.nonzero(cptr < hi)[0]
            ran = []
            # Within a round the counters (V0) and finished steps (rfin) are fixed, so each
            # queue runs the longest prefix of its next segments that are ready: look
            # LOOKAHEAD segments ahead at once instead of one segment per numpy pass.
            while len(active):
                offs = cptr[active][:, None] + _LOOK[None, :]
                valid = offs < hi[active][:, None]
                cand = cm[np.minimum(offs, n_cm - 1)]
                flat = cand.ravel()
                ok = (valid.ravel() & (win.seg_epoch[flat] <= allowed)
                      & _segments_ready(win, flat, seg_rank, rfin, V0))
                ok = np.logical_and.accumulate(ok.reshape(cand.shape), axis=1)
                nrun = ok.sum(axis=1)
                if not nrun.any():
                    break
                ran.append(cand[ok])
                cptr[active] += nrun
                active = active[(nrun == LOOKAHEAD) & (cptr[active] < hi[active])]
            if not ran:
                break
            done = np.concatenate(ran)
            seg_round[done] = rnd
            rnd += 1
            idx, _ = _ranges(win.seg_si_lo[done], win.seg_si_hi[done])
            if len(idx):
                V += np.bincount(win.si_ctr[idx], weights=win.si_amt[idx],
                                 minlength=len(V)).astype(np.int64)
        # stalled in this stage? (some chain still has a segment of an allowed epoch)
        heads_ok = cptr < hi
        if heads_ok.any():
            head = cm[cptr[heads_ok]]
            if (win.seg_epoch[head] <= allowed).any():
                res = SimResult(seg_round, rnd, True, stalled_launch_steps=allowed + 1)
                res.findings = _deadlock_findings(ix, win, V, cptr, allowed, rank_finished())
                return res
    return SimResult(seg_round, rnd, False)


def _deadlock_findings(ix: Index, win: Window, V, cptr, allowed: int, rfin) -> list[Finding]:
    """Witness of a stalled run: the blocked queue heads and, if any, a wait-for cycle."""
    import networkx as nx  # only for a witness: importing it costs ~0.2 s per process

    C, W = win.n_chains, ix.workers
    hi, cm = win.chain_seg_hi, win.cm_order
    blocked = []
    g = nx.DiGraph()
    stuck_chains = [c for c in range(C) if cptr[c] < hi[c]
                    and win.seg_epoch[cm[cptr[c]]] <= allowed]
    head_of = {c: int(cm[cptr[c]]) for c in range(C) if cptr[c] < hi[c]}

    def tnode(seg: int) -> str:
        return f"task {ix.task_ids[int(win.seg_task[seg])]} (step {int(win.seg_epoch[seg])})"

    # unexecuted signal instances per counter -> the blocked heads they sit behind
    pend: dict[int, list[tuple[str, int]]] = {}
    for c, h in head_of.items():
        segs = cm[cptr[c]:hi[c]]
        segs = segs[win.seg_epoch[segs] <= allowed]
        idx, own = _ranges(win.seg_si_lo[segs], win.seg_si_hi[segs])
        for k in idx:
            task = ix.task_ids[int(ix.s_task[int(win.si_sig[k])])]
            pend.setdefault(int(win.si_ctr[k]), []).append((task, h))
    for c in stuck_chains:
        h = head_of[c]
        e = int(win.seg_epoch[h])
        entry = {"rank": int(c // W), "worker": int(c % W),
                 "task": ix.task_ids[int(win.seg_task[h])], "step": e, "waits": []}
        if win.seg_kernel[h] and rfin[win.chain_rank[c]] < e:
            r = int(win.chain_rank[c])
            unfinished = [w for w in range(W) if (r * W + w) in head_of
                          and win.seg_epoch[head_of[r * W + w]] <= e - 1]
            entry["waits"].append({"kernel_boundary": f"rank {r} step {e - 1}",
                                   "unfinished_workers": unfinished})
            kn = f"end of step {e - 1} on rank {r}"
            g.add_edge(tnode(h), kn)
            for w in unfinished:
                g.add_edge(kn, tnode(head_of[r * W + w]))
        for k in range(win.seg_wi_lo[h], win.seg_wi_hi[h]):
            ctr, need = int(win.wi_ctr[k]), int(win.wi_abs[k])
            if V[ctr] >= need:
                continue
            thr, off = _src_wait(ix, int(win.wi_wait[k]))
            base = e + off
            n = int(ix.ctr_n[ctr])
            entry["waits"].append({
                "counter": ix.ctr_names[ctr], "value": int(V[ctr]), "needed": base * n + thr,
                "value_in_step": int(V[ctr]) - base * n, "threshold": thr, "offset": off,
                "pending_signallers": sorted({t for t, _ in pend.get(ctr, [])})[:10]})
            cn = f"counter {ix.ctr_names[ctr]}"
            g.add_edge(tnode(h), cn)
            for task, hh in pend.get(ctr, []):
                g.add_edge(cn, tnode(hh), via=task)
        blocked.append(entry)
    steps = allowed + 1
    tasks = [b["task"] for b in blocked]
    findings = []
    try:
        cyc = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        cyc = None
    if cyc:
        path = []
        for u, v in cyc:
            step = {"from": u, "to": v}
            via = g.edges[u, v].get("via")
            if via:
                step["signalled_by"] = via
            path.append(step)
        names = [u for u, _ in cyc]
        findings.append(Finding(
            "DeadlockCycle",
            f"circular wait in a launch of {steps} step(s): " + " -> ".join(names + [names[0]]),
            tasks=sorted({n.split()[1] for n in names if n.startswith("task ")}),
            witness={"cycle": path, "launch_steps": steps, "blocked": blocked[:32]}))
    else:
        findings.append(Finding(
            "Deadlock",
            f"the queues stall in a launch of {steps} step(s): {len(blocked)} worker(s) blocked, "
            f"e.g. {blocked[0]['task']} on " + ", ".join(
                w.get("counter", w.get("kernel_boundary", "?")) for w in blocked[0]["waits"]),
            tasks=tasks[:64],
            witness={"launch_steps": steps, "blocked": blocked[:32],
                     "blocked_total": len(blocked)}))
    return findings


def collective_participation(ix: Index) -> list[Finding]:
    """Every collective instance (``group``) must have at least one task on every rank."""
    ranks_of: dict[str, set[int]] = {}
    first: dict[str, str] = {}
    for i, grp in enumerate(ix.t_group):
        if grp is not None:
            ranks_of.setdefault(grp, set()).add(int(ix.t_rank[i]))
            first.setdefault(grp, ix.task_ids[i])
    out = []
    for grp, rs in ranks_of.items():
        missing = [r for r in range(ix.ranks) if r not in rs]
        if missing:
            out.append(Finding(
                "CollectiveParticipation",
                f"collective {grp} has no task on rank(s) {missing}; every rank must take part",
                tasks=[first[grp]],
                witness={"group": grp, "ranks_present": sorted(rs), "ranks_missing": missing}))
    return out


def collective_order(ix: Index, hb) -> list[Finding]:
    """Collective instances must be ordered the same way on every rank.

    Rule (docs/validator.md): on rank r, group A precedes group B (A <_r B) iff some task of
    A on r happens-before some task of B on r (epoch-0 happens-before of validator/hb.py).
    An error is a pair of groups with A <_r1 B and not B <_r1 A on one rank, and
    B <_r2 A and not A <_r2 B on another. Groups that are concurrent or interleaved on a
    rank impose no order there.
    """
    tasks = np.asarray([i for i, grp in enumerate(ix.t_group) if grp is not None],
                       dtype=np.int64)
    if len(tasks) == 0:
        return []
    names = sorted({ix.t_group[i] for i in tasks})
    if len(names) < 2:
        return []
    gid = {n: k for k, n in enumerate(names)}
    G = len(names)
    tg = np.asarray([gid[ix.t_group[i]] for i in tasks], dtype=np.int64)
    W = ix.workers
    rows = hb.vc_rows(tasks, 0)
    big = np.iinfo(np.int64).max
    prec = []
    for r in range(ix.ranks):
        sel = ix.t_rank[tasks] == r
        if not sel.any():
            prec.append(np.zeros((G, G), dtype=bool))
            continue
        t, g = tasks[sel], tg[sel]
        cols = slice(r * W, (r + 1) * W)
        J = np.full((G, W), -1, dtype=np.int64)
        np.maximum.at(J, g, rows[sel][:, cols])
        M = np.full((G, W), big, dtype=np.int64)
        np.minimum.at(M, (g, ix.t_worker[t]), ix.t_qpos[t])
        P = np.zeros((G, G), dtype=bool)
        for a0 in range(0, G, 64):  # A chunks keep the G x G x W tensor small
            P[a0:a0 + 64] = (J[None, :, :] >= M[a0:a0 + 64, None, :]).any(axis=2)
        np.fill_diagonal(P, False)
        prec.append(P)
    strict = [p & ~p.T for p in prec]
    out = []
    for r1 in range(ix.ranks):
        for r2 in range(r1 + 1, ix.ranks):
            bad = strict[r1] & strict[r2].T
            for a, b in np.argwhere(bad)[:5]:
                A, B = names[a], names[b]
                out.append(Finding(
                    "CollectiveOrder",
                    f"collectives {A} and {B} run in opposite orders: {A} before {B} on rank "
                    f"{r1}, {B} before {A} on rank {r2}",
                    tasks=[ix.task_ids[int(i)] for i in tasks[(tg == a) | (tg == b)][:8]],
                    witness={"groups": [A, B], "order_on_rank": {str(r1): [A, B],
                                                                 str(r2): [B, A]},
                             "rule": "A before B on a rank iff a task of A happens-before a "
                                     "task of B there"}))
    return out


def cut_run(ix: Index, win: Window, stop_pos: np.ndarray, drop_si: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy maximal run of the window in a *cut world* (used by validator/hb.py).

    Chain c completes only its tasks at unrolled positions < ``stop_pos[c]`` (tasks before
    the stop in the stop's segment still run once the segment's waits hold), and the signal
    instances with ``drop_si`` set are never applied. By confluence the run reaches the
    largest set of events that can happen in that world, so the returned counter values
    are the most any execution of the cut world can reach. Returns (counter values,
    per rank: whether every queue of the rank ran through the whole window).
    """
    C = win.n_chains
    R, W = ix.ranks, ix.workers
    lo, hi = win.chain_seg_lo, win.chain_seg_hi
    cm = win.cm_order
    per_epoch = (hi - lo) // win.E
    V = np.zeros(len(ix.ctr_names), dtype=np.int64)
    cptr = lo.copy()
    dead = np.zeros(C, dtype=bool)
    seg_rank = win.chain_rank[win.seg_chain]
    amt = np.where(drop_si, 0, win.si_amt)

    def rank_finished() -> np.ndarray:
        return _rank_finished(cptr, lo, per_epoch, R, W)

    while True:
        V0 = V.copy()
        rfin = rank_finished()
        active = np.nonzero((cptr < hi) & ~dead)[0]
        ran, partial = [], []
        while len(active):
            cand = cm[cptr[active]]
            ok = ((win.seg_start[cand] < stop_pos[active])
                  & _segments_ready(win, cand, seg_rank, rfin, V0))
            # a runnable segment that contains the stop runs only up to it
            cut = ok & (win.seg_end[cand] > stop_pos[active])
            if cut.any():
                partial.append(cand[cut])
                dead[active[cut]] = True
            full = ok & ~cut
            if not full.any():
                break
            adv = active[full]
            ran.append(cand[full])
            cptr[adv] += 1
            active = adv[(cptr[adv] < hi[adv]) & ~dead[adv]]
        if not ran and not partial:
            break
        if ran:
            done = np.concatenate(ran)
            idx, _ = _ranges(win.seg_si_lo[done], win.seg_si_hi[done])
            if len(idx):
                V += np.bincount(win.si_ctr[idx], weights=amt[idx],
                                 minlength=len(V)).astype(np.int64)
        if partial:
            ps = np.concatenate(partial)
            idx, own = _ranges(win.seg_si_lo[ps], win.seg_si_hi[ps])
            if len(idx):
                keep = win.si_pos[idx] < stop_pos[win.seg_chain[ps[own]]]
                idx = idx[keep]
                V += np.bincount(win.si_ctr[idx], weights=amt[idx],
                                 minlength=len(V)).astype(np.int64)
    done_all = (cptr >= hi).reshape(R, W).all(axis=1)
    return V, done_all
