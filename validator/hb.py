"""Happens-before over the unrolled window: counter edges as a checked fixpoint, and vector
clocks per segment.

Events and edges (ir/program.py semantics; docs/validator.md has the full argument):

* Queue order: a task happens-before (HB) every later task of its worker, in every epoch.
* Kernel boundary: every task of rank r in epoch e HB every task of rank r in epoch e+1,
  and rank r's puts and remote signals of epoch e are complete before epoch e+1 starts.
* Counter edges: a signal instance S to counter c is *guaranteed* before a wait W on c
  when, in every execution, W can only pass after S was applied. The candidate set G is
  the set of (static signal, static wait) pairs whose instances ran in order in the
  greedy simulation (a pair out of order there has a counterexample execution). G is then
  refined as a greatest fixpoint: a pair stays iff the amount of OTHER signal instances
  to c that may be applied before W passes is below W's threshold, where an instance X
  "may be applied before W" unless W HB X or S's application HB X (both computed with the
  HB of the current G). Soundness (minimal-violation argument): take the first moment a
  pair of the final G is violated; every HB fact used for it only involves events that
  cannot have happened yet at that moment, so the count could not have reached the
  threshold, a contradiction. Thresholds are epoch-relative (the base epoch's history
  contributes exactly base * N(c)); instances beyond the window are bounded through the
  kernel boundary: if W (or S) HB some task of rank a in window epoch j, all of rank a's
  signal instances of later epochs are after it; otherwise they count as unbounded.
  G is periodic: one decision per static pair, checked on the reference instance
  (W in epoch 0, or epoch 1 for ``@prev`` credit waits, whose S is in epoch 0).
* A remote signal (to a counter of another rank, or any signal of a task that writes
  remotely, i.e. put-with-signal) is applied asynchronously: it HB only the waits that are
  guaranteed to include it, the quiet that completes it, later signals of the same worker
  to the same rank behind a fence, and the next epoch of its rank.

Vector clocks: ``vc[seg, chain]`` = the largest unrolled position of ``chain`` that HB the
first task of segment ``seg`` (``-1``: none); the segment's own chain holds its start
position. They are computed level by level in the simulation's round order (a topological
order of all edges in G), vectorised over the segments of each round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from validator.deadlock import SimResult, _ranges
from validator.structure import OP_FENCE, OP_PUT, OP_QUIET, Index
from validator.verdict import Finding
from validator.window import Window

BIGPOS = 1 << 40  # "never" as a frontier position


@dataclass
class HBResult:
    """Happens-before of the window, with query helpers (all vectorised)."""

    ix: Index
    win: Window
    vcs: np.ndarray  # [n_seg, C]
    kvc: np.ndarray  # [R, E, C]: VC of the end of each rank's epoch (kernel boundary)
    pair_w: np.ndarray  # static candidate pairs (wait, signal)
    pair_k: np.ndarray
    g: np.ndarray  # bool: pair in the final guaranteed set
    sig_async: np.ndarray  # static signal applied asynchronously (remote / put-with-signal)
    t_pending: np.ndarray  # static task writes remotely (put op or remote region)
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    # ---- basic queries ----
    def pos(self, task: np.ndarray, epoch) -> np.ndarray:
        return self.win.task_pos(self.ix, task, epoch)

    def vc_rows(self, task: np.ndarray, epoch) -> np.ndarray:
        """Vector clock rows of task instances (own chain = the task's own position)."""
        task = np.asarray(task, dtype=np.int64)
        seg = self.win.task_seg(task, epoch)
        rows = self.vcs[seg].astype(np.int64)
        rows[np.arange(len(task)), self.ix.t_chain[task]] = self.pos(task, epoch)
        return rows

    def before(self, a: np.ndarray, ea, b: np.ndarray, eb) -> np.ndarray:
        """Task instance a (epoch ea) HB-or-equal task instance b (epoch eb), elementwise."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        ca = self.ix.t_chain[a]
        seg_b = self.win.task_seg(b, eb)
        known = self.vcs[seg_b, ca].astype(np.int64)
        same = ca == self.ix.t_chain[b]
        pb = self.pos(b, eb)
        known = np.where(same, pb, known)
        return known >= self.pos(a, ea)

    def frontier_before(self, front: np.ndarray, b: np.ndarray, eb) -> np.ndarray:
        """Events with frontier rows ``front`` [n, C] HB task instances ``b`` (epoch eb)."""
        rows = self.vc_rows(b, eb)
        return (rows >= front).any(axis=1)

    # ---- frontiers of asynchronous events ----
    def delivery_frontier(self, task: np.ndarray, epoch: int, dest: np.ndarray) -> np.ndarray:
        """Frontier rows of the delivery of remote writes by ``task`` in ``epoch`` to ``dest``.

        A task instance Y sees the data iff ``(vc_own(Y) >= row).any()``. Entries: the waits
        guaranteed to include the writer's own signal to a counter of ``dest``
        (put-with-signal), the first later quiet of the worker, the waits guaranteed to
        include a signal to ``dest`` issued at or after a later fence of the worker (remote
        signals only: a fence orders deliveries per destination rank), and the next epoch of
        the writer's rank (kernel end).
        """
        return _delivery_frontier(self, np.asarray(task, dtype=np.int64), epoch,
                                  np.asarray(dest, dtype=np.int64))


def _pending_tasks(ix: Index) -> np.ndarray:
    pend = np.zeros(len(ix.task_ids), dtype=bool)
    pend[ix.t_op == OP_PUT] = True
    outs = ix.r_out & (ix.r_rank != ix.t_rank[ix.r_task])
    pend[ix.r_task[outs]] = True
    return pend


class _Ctx:
    """Static tables shared by the fixpoint iterations."""

    def __init__(self, ix: Index, win: Window, sim: SimResult):
        self.ix, self.win, self.sim = ix, win, sim
        self.E, self.C, self.R = win.E, win.n_chains, ix.ranks
        self.L = win.chain_len
        nctr = len(ix.ctr_names)
        # static signals grouped by counter
        self.sc_order = np.argsort(ix.s_ctr, kind="stable")
        cnt = np.bincount(ix.s_ctr, minlength=nctr)
        self.sc_lo = np.concatenate(([0], np.cumsum(cnt)[:-1])).astype(np.int64)
        self.sc_hi = self.sc_lo + cnt
        self.t_pending = _pending_tasks(ix)
        self.sig_async = (ix.ctr_rank[ix.s_ctr] != ix.t_rank[ix.s_task]) | \
            self.t_pending[ix.s_task]
        # quiet / fence positions per chain (epoch-relative qpos), for frontier rules
        self.quiet_tasks = np.nonzero(ix.t_op == OP_QUIET)[0]
        self.fence_tasks = np.nonzero(ix.t_op == OP_FENCE)[0]
        big = int(self.L.max()) + 1 if len(self.L) else 1
        self.big = big
        self.q_key = np.sort(ix.t_chain[self.quiet_tasks] * big + ix.t_qpos[self.quiet_tasks])
        self.f_key = np.sort(ix.t_chain[self.fence_tasks] * big + ix.t_qpos[self.fence_tasks])
        # candidate pairs: every (wait, signal to the same counter)
        nw = len(ix.w_task)
        per_w = cnt[ix.w_ctr] if nw else np.zeros(0, dtype=np.int64)
        self.pair_w = np.repeat(np.arange(nw), per_w)
        idx, _ = _ranges(self.sc_lo[ix.w_ctr], self.sc_hi[ix.w_ctr]) if nw else \
            (np.zeros(0, dtype=np.int64), None)
        self.pair_k = self.sc_order[idx] if len(idx) else np.zeros(0, dtype=np.int64)
        self.w_pair_lo = np.concatenate(([0], np.cumsum(per_w)[:-1])).astype(np.int64) \
            if nw else np.zeros(0, dtype=np.int64)
        self.w_pair_hi = self.w_pair_lo + per_w
        # reference epoch of a wait: 0, or 1 for @prev (its S lives in epoch 0)
        self.w_ref = np.where(ix.w_off < 0, 1, 0) if nw else np.zeros(0, dtype=np.int64)

    def next_after(self, keys: np.ndarray, chain: np.ndarray, qpos: np.ndarray) -> np.ndarray:
        """qpos of the first key (quiet/fence) strictly after qpos on chain, else BIGPOS."""
        if not len(keys):
            return np.full(len(chain), BIGPOS, dtype=np.int64)
        q = chain * self.big + qpos
        i = np.searchsorted(keys, q, side="right")
        ok = i < len(keys)
        nxt = np.where(ok, keys[np.minimum(i, len(keys) - 1)], -1)
        ok &= (nxt // self.big) == chain
        return np.where(ok, nxt % self.big, BIGPOS)


def compute(ix: Index, win: Window, sim: SimResult) -> HBResult:
    """Compute the guaranteed counter edges (fixpoint) and the vector clocks of the window."""
    ctx = _Ctx(ix, win, sim)
    g = _initial_pairs(ctx)
    iters = 0
    while True:
        iters += 1
        vcs, kvc = _vector_clocks(ctx, g)
        hb = HBResult(ix, win, vcs, kvc, ctx.pair_w, ctx.pair_k, g.copy(), ctx.sig_async,
                      ctx.t_pending)
        keep = _check_pairs(ctx, hb, g)
        if keep.sum() == g.sum():
            break
        g = keep
    hb.stats = {"hb_iterations": iters, "counter_pairs": int(len(g)),
                "guaranteed_pairs": int(g.sum())}
    return hb


def _initial_pairs(ctx: _Ctx) -> np.ndarray:
    """Candidate pairs whose every window instance ran in order in the greedy simulation."""
    ix, win, E = ctx.ix, ctx.win, ctx.E
    pw, pk = ctx.pair_w, ctx.pair_k
    ok = np.ones(len(pw), dtype=bool)
    real_any = np.zeros(len(pw), dtype=bool)
    rnd = ctx.sim.seg_round
    wt, st = ix.w_task[pw], ix.s_task[pk]
    off = ix.w_off[pw]
    for e in range(E):
        es = e + off
        absthr = (e + off) * ix.ctr_n[ix.w_ctr[pw]] + ix.w_thr[pw]
        real = (absthr > 0) & (es >= 0)
        rw = rnd[win.task_seg(wt, e)]
        rs = rnd[win.task_seg(st, np.maximum(es, 0))]
        ok &= ~real | (rs < rw)
        real_any |= real
    return ok & real_any


def _vector_clocks(ctx: _Ctx, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    ix, win, E, C, R = ctx.ix, ctx.win, ctx.E, ctx.C, ctx.R
    n_seg = win.n_seg
    maxpos = int((win.chain_len.max() if C else 0) * E) + 2
    dt = np.int16 if maxpos < 30000 else (np.int32 if maxpos < (1 << 30) else np.int64)
    vcs = np.full((n_seg, C), -1, dtype=dt)
    cur = np.full((C, C), -1, dtype=np.int64)
    kvc = np.full((R, E, C), -1, dtype=np.int64)
    nctr = len(ix.ctr_names)
    nw = len(ix.w_task)

    # per static wait: all its pairs guaranteed? -> join the counter's hub of that epoch
    full = np.ones(nw, dtype=bool)
    if len(g):
        bad = np.bincount(ctx.pair_w[~g], minlength=nw) > 0
        full &= ~bad
    any_g = np.bincount(ctx.pair_w[g], minlength=nw) > 0 if len(g) else np.zeros(nw, bool)
    # hubs only for counters that some full wait joins
    hub_ctr = np.zeros(nctr, dtype=bool)
    if nw:
        hub_ctr[ix.w_ctr[full & any_g]] = True
    hub_id = np.full(nctr, -1, dtype=np.int64)
    hub_id[hub_ctr] = np.arange(int(hub_ctr.sum()))
    hubs = np.full((max(1, int(hub_ctr.sum())) * E, C), -1, dtype=np.int64)

    # guaranteed pairs of non-full waits, grouped by wait
    part_pairs = np.nonzero(g & ~full[ctx.pair_w])[0] if len(g) else np.zeros(0, np.int64)
    pp_w = ctx.pair_w[part_pairs]
    pp_k = ctx.pair_k[part_pairs]
    o = np.argsort(pp_w, kind="stable")
    pp_w, pp_k = pp_w[o], pp_k[o]
    pp_lo = np.searchsorted(pp_w, np.arange(nw), side="left")
    pp_hi = np.searchsorted(pp_w, np.arange(nw), side="right")

    rnd = ctx.sim.seg_round
    order = np.lexsort((win.seg_start, win.seg_chain, rnd))
    rs = rnd[order]
    bounds = np.searchsorted(rs, np.arange(int(rs.max()) + 2 if len(rs) else 1))
    seg_rank = win.chain_rank[win.seg_chain]
    seg_L = win.chain_len[win.seg_chain]
    epoch_end = (win.seg_end == (win.seg_epoch + 1) * seg_L)
    ar_C = np.arange(C)

    for r in range(len(bounds) - 1):
        segs = order[bounds[r]:bounds[r + 1]]
        if not len(segs):
            continue
        n = len(segs)
        ch = win.seg_chain[segs]
        M = cur[ch].copy()
        # kernel boundary joins
        kern = np.nonzero(win.seg_kernel[segs] == 1)[0]
        if len(kern):
            ks = segs[kern]
            M[kern] = np.maximum(M[kern], kvc[seg_rank[ks], win.seg_epoch[ks] - 1])
        # counter joins
        wl, wh = win.seg_wi_lo[segs], win.seg_wi_hi[segs]
        if (wh > wl).any():
            wi, own = _ranges(wl, wh)
            w = win.wi_wait[wi]
            ep = win.seg_epoch[segs[own]]
            # full waits: the hub of (counter, epoch + offset)
            f = full[w] & any_g[w]
            if f.any():
                hrow = hub_id[ix.w_ctr[w[f]]] * E + ep[f] + ix.w_off[w[f]]
                _max_into(M, own[f], hubs[hrow])
            # partial waits: individual guaranteed signal instances
            pf = ~full[w]
            if pf.any():
                idx, o2 = _ranges(pp_lo[w[pf]], pp_hi[w[pf]])
                if len(idx):
                    tgt = own[pf][o2]
                    k = pp_k[idx]
                    es = ep[pf][o2] + ix.w_off[w[pf]][o2]
                    st = ix.s_task[k]
                    sseg = win.task_seg(st, es)
                    rows = vcs[sseg].astype(np.int64)
                    rows[np.arange(len(k)), ix.t_chain[st]] = win.task_pos(ix, st, es)
                    _max_into(M, tgt, rows)
        # several segments of one chain in this round: prefix max along the chain
        if n > 1 and (ch[1:] == ch[:-1]).any():
            grp = np.concatenate(([0], np.cumsum(ch[1:] != ch[:-1])))
            big = int(maxpos) + 4
            A = M + 1 + grp[:, None] * big
            np.maximum.accumulate(A, axis=0, out=A)
            M = A - 1 - grp[:, None] * big
        M[np.arange(n), ch] = win.seg_start[segs]
        vcs[segs] = M
        # chain state: the last segment of each chain in this round, own = its last task
        last = np.ones(n, dtype=bool)
        last[:-1] = ch[1:] != ch[:-1]
        Ml = M[last].copy()
        Ml[np.arange(len(Ml)), ch[last]] = win.seg_end[segs[last]] - 1
        cur[ch[last]] = Ml
        # kernel rows: segments that end their chain's epoch
        ee = epoch_end[segs]
        if ee.any():
            es_ = segs[ee]
            rows = M[ee].copy()
            rows[np.arange(len(es_)), win.seg_chain[es_]] = win.seg_end[es_] - 1
            _max_into(kvc.reshape(R * E, C), seg_rank[es_] * E + win.seg_epoch[es_], rows)
        # hubs: signals of this round's segments to hub counters
        sl, sh = win.seg_si_lo[segs], win.seg_si_hi[segs]
        if (sh > sl).any():
            si, own = _ranges(sl, sh)
            hsel = hub_ctr[win.si_ctr[si]]
            if hsel.any():
                si, own = si[hsel], own[hsel]
                rows = M[own].copy()
                rows[np.arange(len(si)), ch[own]] = win.si_pos[si]
                _max_into(hubs, hub_id[win.si_ctr[si]] * E + win.si_epoch[si], rows)
    del ar_C
    return vcs, kvc


def _max_into(M: np.ndarray, tgt: np.ndarray, rows: np.ndarray) -> None:
    """``M[tgt[i]] = max(M[tgt[i]], rows[i])`` with repeated targets (row-wise max)."""
    if not len(tgt):
        return
    if len(tgt) == 1:
        M[tgt[0]] = np.maximum(M[tgt[0]], rows[0])
        return
    o = np.argsort(tgt, kind="stable")
    t = tgt[o]
    starts = np.concatenate(([0], np.nonzero(t[1:] != t[:-1])[0] + 1))
    red = np.maximum.reduceat(rows[o], starts, axis=0)
    u = t[starts]
    M[u] = np.maximum(M[u], red)


def _signal_frontiers(ctx: _Ctx, hb: HBResult, g: np.ndarray, k: np.ndarray,
                      es: np.ndarray) -> np.ndarray:
    """Frontier rows of the *application* of static signals ``k`` in epochs ``es``.

    Synchronous (local) signal: its task. Asynchronous: the guaranteed waits (pairs in g),
    the first later quiet of the worker, and the next epoch of the signaller's rank.
    (A fence orders the application only before later signals of the SAME worker to the
    same rank; that case is handled where the worker is known, in ``_after_app``.)
    """
    ix, win, C, E = ctx.ix, ctx.win, ctx.C, ctx.E
    n = len(k)
    F = np.full((n, C), BIGPOS, dtype=np.int64)
    st = ix.s_task[k]
    ch = ix.t_chain[st]
    ar = np.arange(n)
    sync = ~ctx.sig_async[k]
    pos = win.task_pos(ix, st, es)
    F[ar[sync], ch[sync]] = pos[sync]
    asy = np.nonzero(~sync)[0]
    if len(asy):
        # quiet
        qn = ctx.next_after(ctx.q_key, ch[asy], ix.t_qpos[st[asy]])
        has = qn < BIGPOS
        F[asy[has], ch[asy[has]]] = es[asy[has]] * ctx.L[ch[asy[has]]] + qn[has]
        # kernel: the first task of epoch es+1 on every chain of the signaller's rank
        rk = ix.t_rank[st[asy]]
        W = ix.workers
        for w in range(W):
            cc = rk * W + w
            okk = (ctx.L[cc] > 0) & (es[asy] + 1 < E)
            F[asy[okk], cc[okk]] = np.minimum(F[asy[okk], cc[okk]],
                                              (es[asy[okk]] + 1) * ctx.L[cc[okk]])
        # guaranteed waits
        _add_waiter_entries(ctx, g, k[asy], es[asy], F, asy)
    return F


def _add_waiter_entries(ctx: _Ctx, g: np.ndarray, k: np.ndarray, es: np.ndarray,
                        F: np.ndarray, rows: np.ndarray) -> None:
    """F[rows[i], chain(W)] = min(., pos(W)) for every wait W guaranteed to include signal
    instance (k[i], es[i]) (pairs in g; W's epoch is es + 0, or es + 1 for @prev)."""
    ix, win, E = ctx.ix, ctx.win, ctx.E
    if not len(k) or not g.any():
        return
    gk = ctx.pair_k[g]
    gw = ctx.pair_w[g]
    o = np.argsort(gk, kind="stable")
    gk, gw = gk[o], gw[o]
    lo = np.searchsorted(gk, k, side="left")
    hi = np.searchsorted(gk, k, side="right")
    idx, own = _ranges(lo, hi)
    if not len(idx):
        return
    w = gw[idx]
    ew = es[own] - ix.w_off[w]
    ok = ew < E
    w, ew, own = w[ok], ew[ok], own[ok]
    wt = ix.w_task[w]
    wc = ix.t_chain[wt]
    wp = win.task_pos(ix, wt, ew)
    np.minimum.at(F, (rows[own], wc), wp)


def _after_app(ctx: _Ctx, hb: HBResult, F: np.ndarray, k: np.ndarray, es: np.ndarray,
               xt: np.ndarray, xe: np.ndarray, x_rows: np.ndarray) -> np.ndarray:
    """Matrix [len(k), len(xt)]: application of signal instance i HB task instance j.

    ``x_rows`` are the own vector clock rows of the task instances (xt, xe).
    Includes the fence rule: same worker, a fence after the signal and at or before X
    (callers pass X that signal the same counter, i.e. the same destination rank).
    """
    ix = ctx.ix
    after = (x_rows[None, :, :] >= F[:, None, :]).any(axis=2)
    asy = ctx.sig_async[k]
    if asy.any() and len(ctx.fence_tasks):
        st = ix.s_task[k]
        fn = ctx.next_after(ctx.f_key, ix.t_chain[st], ix.t_qpos[st])
        fpos = np.where(fn < BIGPOS, es * ctx.L[ix.t_chain[st]] + fn, BIGPOS)
        xpos = hb.pos(xt, xe)
        same = ix.t_chain[st][:, None] == ix.t_chain[xt][None, :]
        after |= asy[:, None] & same & (xpos[None, :] >= fpos[:, None])
    return after


def _check_pairs(ctx: _Ctx, hb: HBResult, g: np.ndarray) -> np.ndarray:
    """One refinement step of the greatest fixpoint: keep the pairs that pass the count."""
    ix, win, E, R = ctx.ix, ctx.win, ctx.E, ctx.R
    keep = g.copy()
    if not g.any():
        return keep
    waits = np.unique(ctx.pair_w[g])
    # ---- per wait W (reference instance): possible amount P(W) and unreached ranks ----
    wt = ix.w_task[waits]
    wref = ctx.w_ref[waits]
    wch = ix.t_chain[wt]
    wpos = win.task_pos(ix, wt, wref)
    c = ix.w_ctr[waits]
    ns = ctx.sc_hi[c] - ctx.sc_lo[c]
    # X instances: every static signal to c in every window epoch
    idx, own = _ranges(np.repeat(ctx.sc_lo[c], E), np.repeat(ctx.sc_hi[c], E))
    own_w = own // E
    xe = own % E
    xk = ctx.sc_order[idx]
    xt = ix.s_task[xk]
    xseg = win.task_seg(xt, xe)
    known = hb.vcs[xseg, wch[own_w]].astype(np.int64)
    xpos = win.task_pos(ix, xt, xe)
    known = np.where(ix.t_chain[xt] == wch[own_w], xpos, known)
    after_w = known >= wpos[own_w]
    amt = ix.s_amt[xk]
    P = np.bincount(own_w, weights=np.where(after_w, 0, amt), minlength=len(waits))
    # ranks that signal c and that W does not reach within the window -> unbounded
    reach_w = hb.kvc[:, E - 1, :][:, wch] >= wpos[None, :]  # [R, n_waits]
    sig_rank = np.zeros((len(waits), R), dtype=bool)
    sig_rank[own_w, ix.t_rank[xt]] = True
    unb_w = sig_rank & ~reach_w.T
    inf_w = unb_w.any(axis=1)
    # ---- fast pass: P(W) - a(S) < t for every S ----
    gi = np.nonzero(g)[0]
    pos_in = np.searchsorted(waits, ctx.pair_w[gi])
    a_s = ix.s_amt[ctx.pair_k[gi]]
    thr = ix.w_thr[ctx.pair_w[gi]]
    fast = ~inf_w[pos_in] & (P[pos_in] - a_s < thr)
    slow = gi[~fast]
    if not len(slow):
        return keep
    # ---- refined: per wait with slow pairs, exclude instances after S's application ----
    x_lo = np.searchsorted(own_w, np.arange(len(waits)), side="left")
    x_hi = np.searchsorted(own_w, np.arange(len(waits)), side="right")
    slow_w = ctx.pair_w[slow]
    for wv in np.unique(slow_w):
        wi = int(np.searchsorted(waits, wv))
        sel = slow[slow_w == wv]
        k = ctx.pair_k[sel]
        es = np.zeros(len(k), dtype=np.int64)  # S instance: base epoch 0
        F = _signal_frontiers(ctx, hb, g, k, es)
        a, b = x_lo[wi], x_hi[wi]
        X_t, X_e, X_k = xt[a:b], xe[a:b], xk[a:b]
        x_rows = hb.vc_rows(X_t, X_e)
        aft_s = _after_app(ctx, hb, F, k, es, X_t, X_e, x_rows)
        is_s = (X_k[None, :] == k[:, None]) & (X_e[None, :] == 0)
        poss = ~after_w[a:b][None, :] & ~aft_s & ~is_s
        others = (poss * amt[a:b][None, :]).sum(axis=1)
        # unbounded beyond the window unless W or S reaches the signalling rank
        reach_s = (hb.kvc[:, E - 1, :][None, :, :] >= F[:, None, :]).any(axis=2)  # [n, R]
        unb = (unb_w[wi][None, :] & ~reach_s).any(axis=1)
        fail = unb | (others >= int(ix.w_thr[wv]))
        keep[sel[fail]] = False
    return keep


def _delivery_frontier(hb: HBResult, task: np.ndarray, epoch: int,
                       dest: np.ndarray) -> np.ndarray:
    ix, win = hb.ix, hb.win
    ctx = hb._ctx
    E, C, W = ctx.E, ctx.C, ix.workers
    n = len(task)
    F = np.full((n, C), BIGPOS, dtype=np.int64)
    if not n:
        return F
    ch = ix.t_chain[task]
    qp = ix.t_qpos[task]
    L = ctx.L
    ar = np.arange(n)
    # (d) kernel end of the writer's rank
    rk = ix.t_rank[task]
    if epoch + 1 < E:
        for w in range(W):
            cc = rk * W + w
            okk = L[cc] > 0
            F[ar[okk], cc[okk]] = (epoch + 1) * L[cc[okk]]
    # (b) the first later quiet on the worker
    qn = ctx.next_after(ctx.q_key, ch, qp)
    has = qn < BIGPOS
    F[ar[has], ch[has]] = np.minimum(F[ar[has], ch[has]], epoch * L[ch[has]] + qn[has])
    # (a) the writer's own signals to counters of the destination rank
    g = hb.g
    s_lo = np.searchsorted(ix.s_task, task, side="left") if _sorted(ix.s_task) else None
    if s_lo is None:
        order = np.argsort(ix.s_task, kind="stable")
        st_sorted = ix.s_task[order]
        lo = np.searchsorted(st_sorted, task, side="left")
        hi = np.searchsorted(st_sorted, task, side="right")
        idx, own = _ranges(lo, hi)
        ks = order[idx]
    else:
        hi = np.searchsorted(ix.s_task, task, side="right")
        idx, own = _ranges(s_lo, hi)
        ks = idx
    if len(ks):
        okd = ix.ctr_rank[ix.s_ctr[ks]] == dest[own]
        _add_waiter_entries(ctx, g, ks[okd], np.full(int(okd.sum()), epoch, np.int64), F,
                            own[okd])
    # (c) fence later on the worker, then remote signals to the destination rank
    if len(ctx.fence_tasks):
        fn = ctx.next_after(ctx.f_key, ch, qp)
        hasf = np.nonzero(fn < BIGPOS)[0]
        if len(hasf):
            # signals of tasks on the same chain at qpos >= fence, to counters on dest
            s_ch = ix.t_chain[ix.s_task]
            s_q = ix.t_qpos[ix.s_task]
            key = s_ch * ctx.big + s_q
            order = np.argsort(key, kind="stable")
            ks_sorted = key[order]
            lo = np.searchsorted(ks_sorted, ch[hasf] * ctx.big + fn[hasf], side="left")
            hi = np.searchsorted(ks_sorted, ch[hasf] * ctx.big + ctx.big - 1, side="right")
            idx, own = _ranges(lo, hi)
            if len(idx):
                k2 = order[idx]
                rows = hasf[own]
                okd = (ix.ctr_rank[ix.s_ctr[k2]] == dest[rows]) & \
                    (ix.ctr_rank[ix.s_ctr[k2]] != ix.t_rank[task[rows]])
                _add_waiter_entries(ctx, g, k2[okd], np.full(int(okd.sum()), epoch, np.int64),
                                    F, rows[okd])
    return F


def _sorted(a: np.ndarray) -> bool:
    return bool(len(a) < 2 or (a[1:] >= a[:-1]).all())
