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
  G is periodic: one decision per static pair, checked on the reference instance: W in
  the first epoch in which it is not satisfied at once, whose base epoch is 0 (epoch 0, or
  epoch 1 for ``@prev`` credits and for ``wait(c >= t)`` with ``-N < t <= 0``, which in
  epoch e means ``c >= e N + t``; thresholds are normalised in validator/structure.py);
  S is in epoch 0. A wait whose first such epoch lies beyond the window gives no edges.
  Fast bound: when every signal of c comes from one rank, later epochs' instances are
  after S's application, so at most N(c) - a(S) others can precede W (no lookups).
  A pair the counting cannot prove is re-checked by an exact greedy run of the window in
  the world where S is never applied and W never passes (``_cut_proof``); that proof does
  not depend on G.
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
class GSet:
    """Guaranteed counter edges. Static wait ``w`` is guaranteed ALL signals to its counter
    when ``full[w]``; otherwise exactly the signals ``pk[i]`` of the explicit pairs
    ``(pw[i], pk[i])`` with ``g[i]``. (Barrier-like waits stay ``full``: no pair list.)"""

    full: np.ndarray
    pw: np.ndarray
    pk: np.ndarray
    g: np.ndarray

    def size(self, ctx: "_Ctx") -> int:
        """Number of guaranteed static (signal, wait) pairs."""
        nf = ctx.sc_hi[ctx.ix.w_ctr] - ctx.sc_lo[ctx.ix.w_ctr]
        return int(nf[self.full].sum()) + int(self.g.sum())


@dataclass
class Frontier:
    """Where an asynchronous event (a signal's application, a put's delivery) becomes known.

    Row i: the event HB task instance X iff X is in (or knows) rank ``k_rank[i]``'s epoch
    ``k_epoch[i] + 1`` or later (kernel boundary; ``k_rank = -1``: none), or X knows
    position ``e_pos`` of chain ``e_chain`` for one of the row's entries
    ``lo[i]:hi[i]`` (a wait guaranteed to include the event, a quiet, the task itself).
    """

    k_rank: np.ndarray
    k_epoch: np.ndarray
    e_chain: np.ndarray
    e_pos: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @staticmethod
    def build(n: int, k_rank, k_epoch, rows, chains, poss) -> "Frontier":
        rows = np.asarray(rows, dtype=np.int64)
        o = np.lexsort((poss, chains, rows))
        rows, chains, poss = rows[o], np.asarray(chains)[o], np.asarray(poss)[o]
        keep = np.ones(len(rows), dtype=bool)  # one entry per (row, chain): the smallest pos
        if len(rows) > 1:
            keep[1:] = (rows[1:] != rows[:-1]) | (chains[1:] != chains[:-1])
        rows, chains, poss = rows[keep], chains[keep], poss[keep]
        lo = np.searchsorted(rows, np.arange(n), side="left")
        hi = np.searchsorted(rows, np.arange(n), side="right")
        return Frontier(np.asarray(k_rank, dtype=np.int64), np.asarray(k_epoch, dtype=np.int64),
                        chains.astype(np.int64), poss.astype(np.int64), lo, hi)

    def rows_json(self, i: int) -> dict:
        return {"kernel_rank": int(self.k_rank[i]), "kernel_epoch": int(self.k_epoch[i]),
                "entries": [[int(c), int(p)] for c, p in
                            zip(self.e_chain[self.lo[i]:self.hi[i]],
                                self.e_pos[self.lo[i]:self.hi[i]])]}


@dataclass
class HBResult:
    """Happens-before of the window, with query helpers (all vectorised)."""

    ix: Index
    win: Window
    vcs: np.ndarray  # [n_seg, C]
    kvc: np.ndarray  # [R, E, C]: VC of the end of each rank's epoch (kernel boundary)
    G: GSet
    ctx: "_Ctx"
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def _ctx(self) -> "_Ctx":
        return self.ctx

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

    def known(self, seg: np.ndarray, chain: np.ndarray, own_chain: np.ndarray,
              own_pos: np.ndarray) -> np.ndarray:
        """Latest position of ``chain`` known at segment ``seg`` (own chain: own_pos)."""
        k = self.vcs[seg, chain].astype(np.int64)
        return np.where(chain == own_chain, own_pos, k)

    def hits(self, F: Frontier, fi: np.ndarray, xt: np.ndarray, xe) -> np.ndarray:
        """Event row ``fi[q]`` of F happens-before task instance (xt[q], xe[q])."""
        ix, win = self.ix, self.win
        n = len(fi)
        out = np.zeros(n, dtype=bool)
        if not n:
            return out
        xe = np.broadcast_to(np.asarray(xe, dtype=np.int64), (n,))
        seg = win.task_seg(xt, xe)
        xch = ix.t_chain[xt]
        xpos = win.task_pos(ix, xt, xe)
        kr = F.k_rank[fi]
        ke = F.k_epoch[fi]
        # X on the event's rank in a later epoch: after the kernel boundary, no lookup
        xr = ix.t_rank[xt]
        out |= (kr >= 0) & (xr == kr) & (xe > ke)
        q = np.nonzero((kr >= 0) & ~out)[0]
        if len(q):
            W = ix.workers
            # one lookup per distinct (segment, rank, epoch)
            key = (seg[q] * self.ix.ranks + kr[q]) * (win.E + 1) + ke[q] + 1
            uk, first, inv = np.unique(key, return_index=True, return_inverse=True)
            qf = q[first]
            cols = kr[qf][:, None] * W + np.arange(W)[None, :]
            kn = self.vcs[seg[qf][:, None], cols].astype(np.int64)
            kn = np.where(cols == xch[qf][:, None], xpos[qf][:, None], kn)
            L = win.chain_len[cols]
            need = (ke[qf] + 1)[:, None] * L
            out[q] = ((kn >= need) & (L > 0)).any(axis=1)[inv]
        idx, own = _ranges(F.lo[fi], F.hi[fi])
        if len(idx):
            ch = F.e_chain[idx]
            kn = self.known(seg[own], ch, xch[own], xpos[own])
            hit = kn >= F.e_pos[idx]
            out |= np.bincount(own[hit], minlength=n) > 0
        return out

    def reach(self, F: Frontier) -> np.ndarray:
        """[n, R]: the event HB the end of rank a's last window epoch (so every later
        epoch of rank a is after it)."""
        win, E, R, W = self.win, self.win.E, self.ix.ranks, self.ix.workers
        n = len(F.k_rank)
        out = np.zeros((n, R), dtype=bool)
        kend = self.kvc[:, E - 1, :].astype(np.int64)  # [R, C]
        has = np.nonzero(F.k_rank >= 0)[0]
        if len(has):
            out[has, F.k_rank[has]] = F.k_epoch[has] < E
            cols = F.k_rank[has][:, None] * W + np.arange(W)[None, :]
            L = win.chain_len[cols]
            need = (F.k_epoch[has] + 1)[:, None] * L
            for a in range(R):
                out[has, a] |= ((kend[a][cols] >= need) & (L > 0)).any(axis=1)
        owner = np.repeat(np.arange(n), F.hi - F.lo)
        if len(F.e_chain):
            hit = kend[:, F.e_chain] >= F.e_pos[None, :]  # [R, n_entries]
            for a in range(R):
                out[:, a] |= np.bincount(owner[hit[a]], minlength=n) > 0
        return out

    def delivery_frontier(self, task: np.ndarray, epoch: int, dest: np.ndarray) -> Frontier:
        """Frontier of the delivery of remote writes by ``task`` in ``epoch`` to ``dest``.

        A task instance Y sees the data iff ``hits``. Entries: the waits
        guaranteed to include the writer's own signal to a counter of ``dest``
        (put-with-signal), the first later quiet of the worker, the waits guaranteed to
        include a remote signal to ``dest`` issued at or after a later fence of the worker
        (a fence orders deliveries per destination rank), and the next epoch of the
        writer's rank (kernel end).
        """
        return _delivery_frontier(self, np.asarray(task, dtype=np.int64), epoch,
                                  np.asarray(dest, dtype=np.int64))


def _pending_tasks(ix: Index) -> np.ndarray:
    pend = np.zeros(len(ix.task_ids), dtype=bool)
    pend[ix.t_op == OP_PUT] = True
    outs = ix.r_out & (ix.r_rank != ix.t_rank[ix.r_task])
    pend[ix.r_task[outs]] = True
    return pend


def _csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    order = np.argsort(keys, kind="stable")
    cnt = np.bincount(keys, minlength=n) if len(keys) else np.zeros(n, dtype=np.int64)
    lo = np.concatenate(([0], np.cumsum(cnt)[:-1])).astype(np.int64)
    return order, lo, lo + cnt


class _Ctx:
    """Static tables shared by the fixpoint iterations."""

    def __init__(self, ix: Index, win: Window, sim: SimResult):
        self.ix, self.win, self.sim = ix, win, sim
        self.E, self.C, self.R = win.E, win.n_chains, ix.ranks
        self.L = win.chain_len
        nctr = len(ix.ctr_names)
        self.sc_order, self.sc_lo, self.sc_hi = _csr(ix.s_ctr, nctr)
        self.wc_order, self.wc_lo, self.wc_hi = _csr(ix.w_ctr, nctr)
        self.t_pending = _pending_tasks(ix)
        self.sig_async = (ix.ctr_rank[ix.s_ctr] != ix.t_rank[ix.s_task]) | \
            self.t_pending[ix.s_task]
        # counters signalled only from their owner rank: later epochs' signals come after
        # any wait of the owner (kernel boundary)
        remote_sig = ix.ctr_rank[ix.s_ctr] != ix.t_rank[ix.s_task]
        self.local_ctr = np.bincount(ix.s_ctr[remote_sig], minlength=nctr) == 0
        # counters whose signals all come from ONE rank (the owner or not): every signal
        # instance of a later step is after any of this step's (kernel boundary)
        srank = ix.t_rank[ix.s_task]
        lo_r = np.full(nctr, np.iinfo(np.int64).max, dtype=np.int64)
        hi_r = np.full(nctr, -1, dtype=np.int64)
        if len(srank):
            np.minimum.at(lo_r, ix.s_ctr, srank)
            np.maximum.at(hi_r, ix.s_ctr, srank)
        self.one_rank_ctr = lo_r == hi_r
        self.min_amt = np.full(nctr, np.iinfo(np.int64).max // 4, dtype=np.int64)
        if len(ix.s_ctr):
            np.minimum.at(self.min_amt, ix.s_ctr, ix.s_amt)
        self.quiet_tasks = np.nonzero(ix.t_op == OP_QUIET)[0]
        self.fence_tasks = np.nonzero(ix.t_op == OP_FENCE)[0]
        big = int(self.L.max()) + 1 if len(self.L) else 1
        self.big = big
        self.q_key = np.sort(ix.t_chain[self.quiet_tasks] * big + ix.t_qpos[self.quiet_tasks])
        self.f_key = np.sort(ix.t_chain[self.fence_tasks] * big + ix.t_qpos[self.fence_tasks])
        # reference epoch of each wait: the first whose instance is not satisfied at once
        # (offsets are normalised, validator/structure.py: wait(c >= 0) is c >= N @prev)
        self.w_ref = np.maximum(-ix.w_off, 0)
        self.s_task_order, self.s_task_lo, self.s_task_hi = _csr(ix.s_task, len(ix.task_ids))
        # signals sorted by (chain, qpos) for the fence rule
        skey = ix.t_chain[ix.s_task] * big + ix.t_qpos[ix.s_task]
        self.s_pos_order = np.argsort(skey, kind="stable")
        self.s_pos_key = skey[self.s_pos_order]
        self.cut_cache: dict[tuple[int, int], bool] = {}

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

    def pairs_of(self, waits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """All (wait, signal) pairs of the given static waits (signals to their counter)."""
        c = self.ix.w_ctr[waits]
        idx, own = _ranges(self.sc_lo[c], self.sc_hi[c])
        return waits[own], self.sc_order[idx]


def compute(ix: Index, win: Window, sim: SimResult) -> HBResult:
    """Compute the guaranteed counter edges (greatest fixpoint) and the window's vector
    clocks; see the module doc for the rules and the soundness argument."""
    ctx = _Ctx(ix, win, sim)
    G = _initial(ctx)
    iters = 0
    while True:
        iters += 1
        vcs, kvc = _vector_clocks(ctx, G)
        hb = HBResult(ix, win, vcs, kvc, G, ctx)
        G2 = _check(ctx, hb, G)
        if G2.size(ctx) == G.size(ctx):
            break
        G = G2
    hb.stats = {"hb_iterations": iters, "guaranteed_pairs": G.size(ctx),
                "full_waits": int(G.full.sum()), "explicit_pairs": int(len(G.g))}
    return hb


def _real(ctx: _Ctx, w: np.ndarray, e) -> np.ndarray:
    """Wait instance (w, epoch e) is a real wait (absolute threshold > 0, S epoch >= 0)."""
    ix = ctx.ix
    es = e + ix.w_off[w]
    return (es >= 0) & (es * ix.ctr_n[ix.w_ctr[w]] + ix.w_thr[w] > 0)


def _initial(ctx: _Ctx) -> GSet:
    """Candidates that ran in order in the greedy simulation, for every window instance."""
    ix, win, E = ctx.ix, ctx.win, ctx.E
    nw, nctr = len(ix.w_task), len(ix.ctr_names)
    rnd = ctx.sim.seg_round
    # latest round of any signal instance of (counter, epoch)
    maxr = np.full(nctr * E, -1, dtype=np.int64)
    if len(win.si_ctr):
        np.maximum.at(maxr, win.si_ctr * E + win.si_epoch, rnd[win.si_seg])
    waits = np.arange(nw)
    active = np.zeros(nw, dtype=bool)
    full = np.ones(nw, dtype=bool)
    for e in range(E):
        real = _real(ctx, waits, e)
        es = np.maximum(e + ix.w_off, 0)
        rw = rnd[win.task_seg(ix.w_task, e)]
        full &= ~real | (maxr[ix.w_ctr * E + es] < rw)
        active |= real
    full &= active
    pw, pk = ctx.pairs_of(np.nonzero(active & ~full)[0])
    g = np.ones(len(pw), dtype=bool)
    for e in range(E):
        real = _real(ctx, pw, e)
        es = np.maximum(e + ix.w_off[pw], 0)
        rw = rnd[win.task_seg(ix.w_task[pw], e)]
        rs = rnd[win.task_seg(ix.s_task[pk], es)]
        g &= ~real | (rs < rw)
    return GSet(full, pw, pk, g)


def _vector_clocks(ctx: _Ctx, G: GSet) -> tuple[np.ndarray, np.ndarray]:
    ix, win, E, C, R = ctx.ix, ctx.win, ctx.E, ctx.C, ctx.R
    n_seg = win.n_seg
    maxpos = int((win.chain_len.max() if C else 0) * E) + 2
    dt = np.int16 if maxpos < 30000 else (np.int32 if maxpos < (1 << 30) else np.int64)
    wt = dt if dt != np.int64 else np.int64  # working rows use the storage width
    vcs = np.full((n_seg, C), -1, dtype=dt)
    cur = np.full((C, C), -1, dtype=wt)
    kvc = np.full((R, E, C), -1, dtype=wt)
    nctr = len(ix.ctr_names)
    nw = len(ix.w_task)
    full = G.full
    hub_ctr = np.zeros(nctr, dtype=bool)
    if nw:
        hub_ctr[ix.w_ctr[full]] = True
    hub_id = np.full(nctr, -1, dtype=np.int64)
    hub_id[hub_ctr] = np.arange(int(hub_ctr.sum()))
    n_hub_rows = max(1, int(hub_ctr.sum())) * E
    hubs = np.full((n_hub_rows, C), -1, dtype=wt)
    # explicit guaranteed pairs grouped by wait
    pp_w, pp_k = G.pw[G.g], G.pk[G.g]
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
    kflat = kvc.reshape(R * E, C)

    # Everything but the clocks themselves is known before the rounds run: gather it for
    # all segments in round order once, so that each of the (often 1,000+) rounds only
    # slices (a round's segments are contiguous in ``order``).
    N = len(order)
    ch_all = win.seg_chain[order]
    ep_all = win.seg_epoch[order]
    kern_all = win.seg_kernel[order] == 1
    krow_all = seg_rank[order] * E + ep_all - 1
    start_all = win.seg_start[order]
    endm1_all = win.seg_end[order] - 1
    ee_all = epoch_end[order]
    erow_all = seg_rank[order] * E + ep_all
    last_all = np.ones(N, dtype=bool)
    last_all[:-1] = ch_all[1:] != ch_all[:-1]
    ends = bounds[1:] - 1
    last_all[ends[ends >= 0]] = True  # the last segment of each round
    dup_all = np.zeros(N, dtype=bool)
    dup_all[1:] = ~last_all[:-1]  # the segment after one of the same chain in the round

    def per_round(flag: np.ndarray) -> list:
        """Whether any element of each round's slice is set (Python bools)."""
        cs = np.concatenate(([0], np.cumsum(flag)))
        return (cs[bounds[1:]] > cs[bounds[:-1]]).tolist()

    has_kern, has_ee, has_dup = per_round(kern_all), per_round(ee_all), per_round(dup_all)
    # wait instances of the segments, in round order; own: position in ``order``
    wi_g, wown_g = _ranges(win.seg_wi_lo[order], win.seg_wi_hi[order])
    w_g = win.wi_wait[wi_g]
    wep_g = ep_all[wown_g]
    f_g = full[w_g]
    fsel = np.flatnonzero(f_g)
    fw_own = wown_g[fsel]
    fw_hrow = hub_id[ix.w_ctr[w_g[fsel]]] * E + wep_g[fsel] + ix.w_off[w_g[fsel]]
    fb = np.searchsorted(fw_own, bounds).tolist()
    psel = np.flatnonzero(~f_g)
    pw_own, pw_w, pw_ep = wown_g[psel], w_g[psel], wep_g[psel]
    pb = np.searchsorted(pw_own, bounds).tolist()
    # hub signal rows: per (round, chain, hub row) the round's last signal instance of the
    # chain (later segments of a chain know everything earlier ones know)
    si_g, sown_g = _ranges(win.seg_si_lo[order], win.seg_si_hi[order])
    hs = hub_ctr[win.si_ctr[si_g]]
    si_g, sown_g = si_g[hs], sown_g[hs]
    s_hrow = hub_id[win.si_ctr[si_g]] * E + win.si_epoch[si_g]
    s_round = rs[sown_g]
    key = (s_round * C + ch_all[sown_g]) * n_hub_rows + s_hrow
    o = np.argsort(key, kind="stable")
    ks = key[o]
    lastm = np.ones(len(ks), dtype=bool)
    lastm[:-1] = ks[1:] != ks[:-1]
    ssel = o[lastm]
    ss_own, ss_hrow = sown_g[ssel], s_hrow[ssel]
    ss_col, ss_pos = ch_all[ss_own], win.si_pos[si_g[ssel]]
    sb = np.searchsorted(s_round[ssel], np.arange(len(bounds))).tolist()
    AR = np.arange(max(N, len(ssel)) + 1)  # row numbers, sliced
    bl = bounds.tolist()

    for r in range(len(bl) - 1):
        b0, b1 = bl[r], bl[r + 1]
        n = b1 - b0
        if not n:
            continue
        segs = order[b0:b1]
        ch = ch_all[b0:b1]
        M = cur[ch]  # fancy indexing: a copy
        if has_kern[r]:
            kern = np.flatnonzero(kern_all[b0:b1])
            M[kern] = np.maximum(M[kern], kflat[krow_all[b0:b1][kern]])
        if fb[r + 1] > fb[r]:
            _max_into(M, fw_own[fb[r]:fb[r + 1]] - b0, hubs[fw_hrow[fb[r]:fb[r + 1]]])
        if pb[r + 1] > pb[r]:
            w, ep = pw_w[pb[r]:pb[r + 1]], pw_ep[pb[r]:pb[r + 1]]
            idx, o2 = _ranges(pp_lo[w], pp_hi[w])
            if len(idx):
                tgt = (pw_own[pb[r]:pb[r + 1]] - b0)[o2]
                k = pp_k[idx]
                es = ep[o2] + ix.w_off[w][o2]
                st = ix.s_task[k]
                sseg = win.task_seg(st, es)
                rows = vcs[sseg].astype(wt)
                rows[np.arange(len(k)), ix.t_chain[st]] = win.task_pos(ix, st, es)
                _max_into(M, tgt, rows)
        if has_dup[r]:
            # several segments of one chain in this round: prefix max along the chain
            grp = np.concatenate(([0], np.cumsum(ch[1:] != ch[:-1])))
            big = maxpos + 4
            A = M.astype(np.int64) + (1 + grp * big)[:, None]
            np.maximum.accumulate(A, axis=0, out=A)
            M = (A - (1 + grp * big)[:, None]).astype(wt)
        M[AR[:n], ch] = start_all[b0:b1]
        vcs[segs] = M
        lm = last_all[b0:b1]
        Ml = M[lm]
        cl = ch[lm]
        Ml[AR[:len(cl)], cl] = endm1_all[b0:b1][lm]
        cur[cl] = Ml
        if has_ee[r]:
            ee = ee_all[b0:b1]
            rows = M[ee]
            ce = ch[ee]
            rows[AR[:len(ce)], ce] = endm1_all[b0:b1][ee]
            _max_into(kflat, erow_all[b0:b1][ee], rows)
        if sb[r + 1] > sb[r]:
            s0, s1 = sb[r], sb[r + 1]
            rows = M[ss_own[s0:s1] - b0]
            rows[AR[:s1 - s0], ss_col[s0:s1]] = ss_pos[s0:s1]
            _max_into(hubs, ss_hrow[s0:s1], rows)
    return vcs, kvc


def _max_into(M: np.ndarray, tgt: np.ndarray, rows: np.ndarray) -> None:
    """``M[tgt[i]] = max(M[tgt[i]], rows[i])`` with repeated targets (row-wise max)."""
    if not len(tgt):
        return
    if len(tgt) == 1:
        M[tgt[0]] = np.maximum(M[tgt[0]], rows[0])
        return
    step = tgt[1:] - tgt[:-1]
    if (step >= 0).all():  # sorted targets (the common case): reduce runs in place
        if (step > 0).all():
            M[tgt] = np.maximum(M[tgt], rows)
            return
        starts = np.concatenate(([0], np.nonzero(step)[0] + 1))
        u = tgt[starts]
        M[u] = np.maximum(M[u], np.maximum.reduceat(rows, starts, axis=0))
        return
    if int(tgt.max()) < 8 * len(tgt) + 4096:
        dup = np.bincount(tgt).max() > 1
    else:
        dup = len(np.unique(tgt)) != len(tgt)
    if not dup:
        M[tgt] = np.maximum(M[tgt], rows)
        return
    o = np.argsort(tgt, kind="stable")
    t = tgt[o]
    starts = np.concatenate(([0], np.nonzero(t[1:] != t[:-1])[0] + 1))
    red = np.maximum.reduceat(rows[o], starts, axis=0)
    u = t[starts]
    M[u] = np.maximum(M[u], red)


def _waiter_entries(ctx: _Ctx, G: GSet, k: np.ndarray, es: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i, chain, pos) for every real wait instance guaranteed to include signal instance
    (k[i], es[i]): the full waits on its counter and the explicit pairs of signal k[i]."""
    ix, win, E = ctx.ix, ctx.win, ctx.E
    out_i, out_w = [], []
    if len(k):
        c = ix.s_ctr[k]
        idx, own = _ranges(ctx.wc_lo[c], ctx.wc_hi[c])
        w = ctx.wc_order[idx]
        f = G.full[w]
        out_i.append(own[f])
        out_w.append(w[f])
        if G.g.any():
            gk, gw = G.pk[G.g], G.pw[G.g]
            o = np.argsort(gk, kind="stable")
            gk, gw = gk[o], gw[o]
            lo = np.searchsorted(gk, k, side="left")
            hi = np.searchsorted(gk, k, side="right")
            idx, own = _ranges(lo, hi)
            out_i.append(own)
            out_w.append(gw[idx])
    if not out_i:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    i = np.concatenate(out_i)
    w = np.concatenate(out_w)
    ew = es[i] - ix.w_off[w]
    ok = (ew < E) & _real(ctx, w, ew)
    i, w, ew = i[ok], w[ok], ew[ok]
    wt = ix.w_task[w]
    return i, ix.t_chain[wt], win.task_pos(ix, wt, ew)


def _signal_frontiers(ctx: _Ctx, G: GSet, k: np.ndarray, es: np.ndarray) -> Frontier:
    """Frontier of the *application* of static signals ``k`` in epochs ``es``.

    Synchronous (local) signal: its task. Asynchronous: the guaranteed waits, the first
    later quiet of the worker, and the next epoch of the signaller's rank. (A fence orders
    the application only before later signals of the SAME worker to the same rank; that
    case is handled where the worker is known, in ``_refined``.)
    """
    ix, win = ctx.ix, ctx.win
    n = len(k)
    st = ix.s_task[k]
    ch = ix.t_chain[st]
    sync = ~ctx.sig_async[k]
    pos = win.task_pos(ix, st, es)
    rows, chains, poss = [np.nonzero(sync)[0]], [ch[sync]], [pos[sync]]
    asy = np.nonzero(~sync)[0]
    k_rank = np.where(sync, -1, ix.t_rank[st])
    if len(asy):
        qn = ctx.next_after(ctx.q_key, ch[asy], ix.t_qpos[st[asy]])
        has = qn < BIGPOS
        rows.append(asy[has])
        chains.append(ch[asy[has]])
        poss.append(es[asy[has]] * ctx.L[ch[asy[has]]] + qn[has])
        i, wc, wp = _waiter_entries(ctx, G, k[asy], es[asy])
        rows.append(asy[i])
        chains.append(wc)
        poss.append(wp)
    return Frontier.build(n, k_rank, es, np.concatenate(rows), np.concatenate(chains),
                          np.concatenate(poss))


def _check(ctx: _Ctx, hb: HBResult, G: GSet) -> GSet:
    """One refinement step of the greatest fixpoint (see the module doc)."""
    ix = ctx.ix
    nw = len(ix.w_task)
    full = G.full.copy()
    c_w = ix.w_ctr
    # Fast bound, no vector clocks: if every signal of c comes from one rank, all signal
    # instances of later steps are after S's application (S's rank ends its step first,
    # which completes S), so at most N(c) - a(S) other increments from the base step can
    # precede W, for either offset. (Same for an offset-0 wait on a counter signalled only
    # by its own rank: later steps come after W.)
    bound_ok = ctx.one_rank_ctr[c_w] | ((ix.w_off == 0) & ctx.local_ctr[c_w])
    need_exact = np.zeros(nw, dtype=bool)
    need_exact[full & ~(bound_ok & (ix.ctr_n[c_w] - ctx.min_amt[c_w] < ix.w_thr))] = True
    need_exact[G.pw[G.g]] = True
    ex = np.nonzero(need_exact)[0]
    P = np.zeros(nw, dtype=np.float64)
    inf_w = np.zeros(nw, dtype=bool)
    xinfo = None
    if len(ex):
        xinfo = _possible(ctx, hb, ex)
        P[ex] = xinfo["P"]
        inf_w[ex] = xinfo["inf"]
    # full waits that fail the worst-case test become explicit pairs
    fail_full = full & need_exact & (inf_w | (P - ctx.min_amt[c_w] >= ix.w_thr))
    full &= ~fail_full
    cw_, ck_ = ctx.pairs_of(np.nonzero(fail_full)[0])
    pw = np.concatenate((G.pw, cw_))
    pk = np.concatenate((G.pk, ck_))
    g = np.concatenate((G.g, np.ones(len(cw_), dtype=bool)))
    gi = np.nonzero(g)[0]
    a_s, thr = ix.s_amt[pk[gi]], ix.w_thr[pw[gi]]
    fast = (~inf_w[pw[gi]] & (P[pw[gi]] - a_s < thr)) | \
        (bound_ok[pw[gi]] & (ix.ctr_n[c_w[pw[gi]]] - a_s < thr))
    slow = gi[~fast]
    if len(slow):
        ok = _refined(ctx, hb, G, pw[slow], pk[slow], xinfo, ex)
        # what counting cannot prove, the exact cut-world run may
        for i in np.nonzero(~ok)[0]:
            ok[i] = _cut_proof(ctx, int(pw[slow[i]]), int(pk[slow[i]]))
        g[slow[~ok]] = False
    return GSet(full, pw, pk, g)


def _cut_proof(ctx: _Ctx, w: int, k: int) -> bool:
    """Prove signal k (step 0) guaranteed before wait w (reference step) by running the
    window in the world where S is never applied and W never passes.

    In that world: W's queue stops at W; a synchronous S's queue stops at S's task; an
    asynchronous S is never applied, so its rank never ends step 0 (a kernel end would
    complete it), the first later quiet of its worker never completes, and signals its
    worker issues after a later fence to the same rank are never applied. The greedy run
    of this monotone system reaches the most events any execution of that world can
    (confluence); if W's counter stays below W's threshold and no rank that signals the
    counter runs past the window (it could then add unboundedly many), W cannot pass
    without S. Results are cached per static pair (the decision is periodic).
    """
    key = (w, k)
    if key in ctx.cut_cache:
        return ctx.cut_cache[key]
    from validator.deadlock import cut_run

    ix, win, E = ctx.ix, ctx.win, ctx.E
    stop = (E * ctx.L).astype(np.int64)
    wt, st = int(ix.w_task[w]), int(ix.s_task[k])
    e_ref = int(ctx.w_ref[w])
    wch, sch = int(ix.t_chain[wt]), int(ix.t_chain[st])
    stop[wch] = min(stop[wch], e_ref * int(ctx.L[wch]) + int(ix.t_qpos[wt]))
    drop = np.zeros(len(win.si_sig), dtype=bool)
    spos = int(ix.t_qpos[st])  # S is in step 0
    if ctx.sig_async[k]:
        drop |= (win.si_sig == k) & (win.si_epoch == 0)
        r = int(ix.t_rank[st])
        W = ix.workers
        for c in range(r * W, (r + 1) * W):
            stop[c] = min(stop[c], int(ctx.L[c]))  # the rank never ends step 0
        q = ctx.next_after(ctx.q_key, np.array([sch]), np.array([spos]))[0]
        if q < BIGPOS:
            stop[sch] = min(stop[sch], int(q))
        f = ctx.next_after(ctx.f_key, np.array([sch]), np.array([spos]))[0]
        if f < BIGPOS:
            owner = ix.ctr_rank[ix.s_ctr[k]]
            s_t = ix.s_task[win.si_sig]
            drop |= ((ix.t_chain[s_t] == sch) & (win.si_epoch == 0)
                     & (ix.t_qpos[s_t] >= f) & (ix.ctr_rank[win.si_ctr] == owner))
    else:
        stop[sch] = min(stop[sch], spos)
    V, done_all = cut_run(ix, win, stop, drop)
    c = int(ix.w_ctr[w])
    need = (e_ref + int(ix.w_off[w])) * int(ix.ctr_n[c]) + int(ix.w_thr[w])
    sig_ranks = np.unique(ix.t_rank[ix.s_task[ix.s_ctr == c]])
    unbounded = bool(done_all[sig_ranks].any())
    proven = (int(V[c]) < need) and not unbounded
    ctx.cut_cache[key] = proven
    return proven


def _possible(ctx: _Ctx, hb: HBResult, waits: np.ndarray) -> dict[str, Any]:
    """For waits (reference instance): the amount of signal instances to their counter
    in window epochs >= the base epoch that are not HB-after W, and whether a signalling
    rank is unreached by W in the window (then later epochs are unbounded)."""
    ix, win, E, R = ctx.ix, ctx.win, ctx.E, ctx.R
    wt = ix.w_task[waits]
    wref = ctx.w_ref[waits]
    wch = ix.t_chain[wt]
    wpos = win.task_pos(ix, wt, wref)
    c = ix.w_ctr[waits]
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
    reach_w = hb.kvc[:, E - 1, :][:, wch] >= wpos[None, :]  # [R, n]
    sig_rank = np.zeros((len(waits), R), dtype=bool)
    sig_rank[own_w, ix.t_rank[xt]] = True
    unb = sig_rank & ~reach_w.T
    x_lo = np.searchsorted(own_w, np.arange(len(waits)), side="left")
    x_hi = np.searchsorted(own_w, np.arange(len(waits)), side="right")
    return {"P": P, "inf": unb.any(axis=1), "unb": unb, "xt": xt, "xe": xe, "xk": xk,
            "after_w": after_w, "amt": amt, "x_lo": x_lo, "x_hi": x_hi}


def _refined(ctx: _Ctx, hb: HBResult, G: GSet, w: np.ndarray, k: np.ndarray, xinfo,
             ex: np.ndarray) -> np.ndarray:
    """Pairs (k[i], w[i]): count only the signal instances that are neither HB-after W nor
    HB-after S's application; also unbounded ranks must be reached by W or by S.

    Vectorised over all pairs and their instances; uses the HB of the current G."""
    ix = ctx.ix
    n = len(w)
    wi = np.searchsorted(ex, w)
    es = np.zeros(n, dtype=np.int64)  # S instance: the base epoch 0
    F = _signal_frontiers(ctx, G, k, es)
    idx, own = _ranges(xinfo["x_lo"][wi], xinfo["x_hi"][wi])  # (pair, X instance)
    xt, xe, xk = xinfo["xt"], xinfo["xe"], xinfo["xk"]
    others = np.zeros(n, dtype=np.float64)
    if len(idx):
        aft = hb.hits(F, own, xt[idx], xe[idx])
        # fence rule: same worker, a fence after S and at or before X (same counter, so the
        # same destination rank)
        kt = ix.s_task[k[own]]
        asy = ctx.sig_async[k[own]]
        if asy.any() and len(ctx.fence_tasks):
            ch = ix.t_chain[kt]
            fn = ctx.next_after(ctx.f_key, ch, ix.t_qpos[kt])  # S is in epoch 0
            same = ch == ix.t_chain[xt[idx]]
            aft |= asy & same & (hb.pos(xt[idx], xe[idx]) >= fn)
        is_s = (xk[idx] == k[own]) & (xe[idx] == 0)
        poss = ~xinfo["after_w"][idx] & ~aft & ~is_s
        others = np.bincount(own, weights=np.where(poss, xinfo["amt"][idx], 0), minlength=n)
    reach_s = hb.reach(F)
    unb = (xinfo["unb"][wi] & ~reach_s).any(axis=1)
    return ~unb & (others < ix.w_thr[w])


def _delivery_frontier(hb: HBResult, task: np.ndarray, epoch: int,
                       dest: np.ndarray) -> Frontier:
    ix, ctx, G = hb.ix, hb.ctx, hb.G
    n = len(task)
    ch = ix.t_chain[task]
    qp = ix.t_qpos[task]
    L = ctx.L
    # (d) kernel end of the writer's rank
    k_rank, k_epoch = ix.t_rank[task], np.full(n, epoch, dtype=np.int64)
    # (b) the first later quiet on the worker
    qn = ctx.next_after(ctx.q_key, ch, qp)
    has = np.nonzero(qn < BIGPOS)[0]
    rows, chains, poss = [has], [ch[has]], [epoch * L[ch[has]] + qn[has]]
    # (a) the writer's own signals to counters of the destination rank
    idx, own = _ranges(ctx.s_task_lo[task], ctx.s_task_hi[task])
    ks = ctx.s_task_order[idx]
    okd = ix.ctr_rank[ix.s_ctr[ks]] == dest[own]
    ks, own = ks[okd], own[okd]
    i, wc, wp = _waiter_entries(ctx, G, ks, np.full(len(ks), epoch, dtype=np.int64))
    rows.append(own[i])
    chains.append(wc)
    poss.append(wp)
    # (c) a later fence on the worker, then remote signals to the destination rank
    if len(ctx.fence_tasks):
        fn = ctx.next_after(ctx.f_key, ch, qp)
        hasf = np.nonzero(fn < BIGPOS)[0]
        if len(hasf):
            lo = np.searchsorted(ctx.s_pos_key, ch[hasf] * ctx.big + fn[hasf], side="left")
            hi = np.searchsorted(ctx.s_pos_key, ch[hasf] * ctx.big + ctx.big - 1, side="right")
            idx, own = _ranges(lo, hi)
            if len(idx):
                k2 = ctx.s_pos_order[idx]
                r2 = hasf[own]
                okd = (ix.ctr_rank[ix.s_ctr[k2]] == dest[r2]) & \
                    (ix.ctr_rank[ix.s_ctr[k2]] != ix.t_rank[task[r2]])
                k2, r2 = k2[okd], r2[okd]
                i, wc, wp = _waiter_entries(ctx, G, k2, np.full(len(k2), epoch, np.int64))
                rows.append(r2[i])
                chains.append(wc)
                poss.append(wp)
    return Frontier.build(n, k_rank, k_epoch, np.concatenate(rows), np.concatenate(chains),
                          np.concatenate(poss))
