"""The unrolled window of epochs that the deadlock and happens-before checks run on.

A program is one decode step; the runtime runs it once per step. Rank r's epoch e+1 starts
after all of rank r's epoch-e tasks finished (kernel boundary); ranks are not synchronised
(ir/program.py). The window unrolls ``E = max(2, slots + 1)`` epochs so that every pair of
epochs whose slot values can coincide is modelled (docs/validator.md: why E suffices).

Worker queues become *chains* (``chain = rank * workers + worker``) whose positions run over
the window: ``pos = epoch * L(chain) + qpos``. A chain is cut into *segments*: a segment
starts at a task with waits (and at each epoch start) and runs up to the next one. All
tasks of a segment know the same facts (happens-before changes only at waits), so the
vector clocks of validator/hb.py are stored per segment.

Arrays here are plain numpy, built without per-task Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from validator.structure import Index


@dataclass
class Window:
    """Segments of the unrolled chains, their waits and their signals.

    Segment arrays (``n_seg``): ``seg_chain``, ``seg_epoch``, ``seg_start`` / ``seg_end``
    (unrolled chain positions, end exclusive), ``seg_task`` (static task index of the
    first task). Chain ``c``'s segments are ``chain_seg_lo[c] .. chain_seg_hi[c]`` in order.
    (Segment ids are epoch-major: epoch e's are ``e * segs_per_epoch + k``; the per-chain order
is ``cm_order[chain_seg_lo[c]:chain_seg_hi[c]]``.) ``seg_kernel``: 1 if the segment is an epoch start (epoch >= 1) that waits for its
    rank's previous epoch (kernel boundary), else 0.

    Wait instances (``n_wi``), sorted by segment: ``wi_seg``, ``wi_wait`` (static wait
    index into ``Index.w_*``), ``wi_ctr``, ``wi_abs`` (absolute threshold
    ``(epoch + offset) * N(c) + t``; instances with ``abs <= 0`` are dropped: trivially
    satisfied). ``seg_wi_lo / seg_wi_hi`` index them per segment.

    Signal instances (``n_si``), sorted by segment: ``si_seg``, ``si_sig`` (static signal
    index into ``Index.s_*``), ``si_ctr``, ``si_amt``, ``si_pos`` (unrolled position of the
    signalling task), ``si_epoch``. ``seg_si_lo / seg_si_hi`` index them per segment.
    """

    E: int
    n_chains: int
    chain_len: np.ndarray
    chain_rank: np.ndarray
    seg_chain: np.ndarray
    seg_epoch: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray
    seg_task: np.ndarray
    seg_kernel: np.ndarray
    chain_seg_lo: np.ndarray
    chain_seg_hi: np.ndarray
    seg_wi_lo: np.ndarray
    seg_wi_hi: np.ndarray
    wi_seg: np.ndarray
    wi_wait: np.ndarray
    wi_ctr: np.ndarray
    wi_abs: np.ndarray
    seg_si_lo: np.ndarray
    seg_si_hi: np.ndarray
    si_seg: np.ndarray
    si_sig: np.ndarray
    si_ctr: np.ndarray
    si_amt: np.ndarray
    si_pos: np.ndarray
    si_epoch: np.ndarray
    task_seg0: np.ndarray  # static task -> its segment index within epoch 0 (global seg id)
    segs_per_epoch: int
    cm_order: np.ndarray  # segments in chain-major order; chain c: cm_order[lo[c]:hi[c]]

    @property
    def n_seg(self) -> int:
        return len(self.seg_chain)

    def task_seg(self, task: np.ndarray, epoch: int | np.ndarray) -> np.ndarray:
        """Global segment id of static task(s) ``task`` in window epoch ``epoch``."""
        return self.task_seg0[task] + np.asarray(epoch) * self.segs_per_epoch

    def task_pos(self, ix: Index, task: np.ndarray, epoch: int | np.ndarray) -> np.ndarray:
        """Unrolled chain position of static task(s) in window epoch ``epoch``."""
        return np.asarray(epoch) * self.chain_len[ix.t_chain[task]] + ix.t_qpos[task]


def build_window(ix: Index, E: int) -> Window:
    """Cut the chains of ``ix`` into segments over ``E`` unrolled epochs (see class doc)."""
    n_tasks = len(ix.task_ids)
    C = ix.ranks * ix.workers
    chain_len = ix.chain_len
    chain_rank = np.arange(C) // ix.workers

    # segment starts in epoch 0: qpos 0 of every non-empty chain + every task with waits
    has_wait = np.zeros(n_tasks, dtype=bool)
    if len(ix.w_task):
        has_wait[ix.w_task] = True
    starts = has_wait | (ix.t_qpos == 0)
    st_task = np.nonzero(starts)[0]
    # order segments by (chain, qpos)
    order = np.lexsort((ix.t_qpos[st_task], ix.t_chain[st_task]))
    st_task = st_task[order]
    s_chain = ix.t_chain[st_task]
    s_q = ix.t_qpos[st_task]
    n0 = len(st_task)
    # end of each segment (epoch-relative): next start on the same chain, else chain length
    s_end = np.empty(n0, dtype=np.int64)
    if n0:
        s_end[:-1] = s_q[1:]
        last = np.ones(n0, dtype=bool)
        last[:-1] = s_chain[1:] != s_chain[:-1]
        s_end[last] = chain_len[s_chain[last]]
    # segment of every task in epoch 0: the last start at or before it on its chain
    task_seg0 = np.empty(n_tasks, dtype=np.int64)
    if n0:
        # key = chain * BIG + qpos is sorted for starts
        big = int(chain_len.max()) + 1
        skey = s_chain * big + s_q
        tkey = ix.t_chain * big + ix.t_qpos
        task_seg0[:] = np.searchsorted(skey, tkey, side="right") - 1

    # unroll: epoch-major so that segs of epoch e are [e*n0, (e+1)*n0)
    ep = np.repeat(np.arange(E), n0)
    seg_chain = np.tile(s_chain, E)
    L = chain_len[seg_chain]
    seg_start = np.tile(s_q, E) + ep * L
    seg_end = np.tile(s_end, E) + ep * L
    seg_task = np.tile(st_task, E)
    seg_kernel = ((np.tile(s_q, E) == 0) & (ep >= 1)).astype(np.int8)
    n_seg = n0 * E
    # chain-major order index for per-chain iteration: segments of chain c over all epochs
    cm_order = np.lexsort((seg_start, seg_chain))
    chain_seg_count = np.bincount(seg_chain, minlength=C)
    chain_seg_lo = np.concatenate(([0], np.cumsum(chain_seg_count)[:-1]))
    chain_seg_hi = chain_seg_lo + chain_seg_count

    # wait instances
    nw = len(ix.w_task)
    if nw:
        w_seg0 = task_seg0[ix.w_task]
        wi_seg = (np.arange(E)[:, None] * n0 + w_seg0[None, :]).ravel()
        wi_wait = np.tile(np.arange(nw), E)
        wi_ctr = ix.w_ctr[wi_wait]
        wi_ep = np.repeat(np.arange(E), nw)
        wi_abs = (wi_ep + ix.w_off[wi_wait]) * ix.ctr_n[wi_ctr] + ix.w_thr[wi_wait]
        keep = wi_abs > 0
        wi_seg, wi_wait, wi_ctr, wi_abs = wi_seg[keep], wi_wait[keep], wi_ctr[keep], \
            wi_abs[keep]
        o = np.argsort(wi_seg, kind="stable")
        wi_seg, wi_wait, wi_ctr, wi_abs = wi_seg[o], wi_wait[o], wi_ctr[o], wi_abs[o]
    else:
        wi_seg = wi_wait = wi_ctr = wi_abs = np.zeros(0, dtype=np.int64)
    seg_wi_lo = np.searchsorted(wi_seg, np.arange(n_seg), side="left")
    seg_wi_hi = np.searchsorted(wi_seg, np.arange(n_seg), side="right")

    # signal instances
    ns = len(ix.s_task)
    if ns:
        s_seg0 = task_seg0[ix.s_task]
        si_seg = (np.arange(E)[:, None] * n0 + s_seg0[None, :]).ravel()
        si_sig = np.tile(np.arange(ns), E)
        si_epoch = np.repeat(np.arange(E), ns)
        si_task = ix.s_task[si_sig]
        si_pos = si_epoch * chain_len[ix.t_chain[si_task]] + ix.t_qpos[si_task]
        o = np.argsort(si_seg, kind="stable")
        si_seg, si_sig, si_epoch, si_pos = si_seg[o], si_sig[o], si_epoch[o], si_pos[o]
        si_ctr = ix.s_ctr[si_sig]
        si_amt = ix.s_amt[si_sig]
    else:
        si_seg = si_sig = si_ctr = si_amt = si_pos = si_epoch = np.zeros(0, dtype=np.int64)
    seg_si_lo = np.searchsorted(si_seg, np.arange(n_seg), side="left")
    seg_si_hi = np.searchsorted(si_seg, np.arange(n_seg), side="right")

    win = Window(
        E=E, n_chains=C, chain_len=chain_len, chain_rank=chain_rank, seg_chain=seg_chain,
        seg_epoch=ep, seg_start=seg_start, seg_end=seg_end, seg_task=seg_task,
        seg_kernel=seg_kernel, chain_seg_lo=chain_seg_lo, chain_seg_hi=chain_seg_hi,
        seg_wi_lo=seg_wi_lo, seg_wi_hi=seg_wi_hi, wi_seg=wi_seg, wi_wait=wi_wait,
        wi_ctr=wi_ctr, wi_abs=wi_abs, seg_si_lo=seg_si_lo, seg_si_hi=seg_si_hi,
        si_seg=si_seg, si_sig=si_sig, si_ctr=si_ctr, si_amt=si_amt, si_pos=si_pos,
        si_epoch=si_epoch, task_seg0=task_seg0, segs_per_epoch=n0, cm_order=cm_order,
    )
    return win
