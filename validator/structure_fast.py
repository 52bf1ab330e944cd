"""Vectorised structure pass for well-formed programs (the common, large case).

``fast_tasks`` pulls every task field into flat lists with ``operator.attrgetter`` and
``itertools.chain`` (no per-task Python logic), then runs all per-task structure checks as
numpy expressions: ids, ranks, workers, ops and backend support, arity, regions (buffer,
rank copy, one range per axis, int bounds, bounds at every slot, constant extent, remote
reads, remote writes to local buffers, local owner), operand dtypes, params, the op shape
checks (run once per distinct signature of op, dtypes, squeezed shapes and params), waits
and signals. It returns the flat arrays of the Index, or ``None`` as soon as anything is
unusual or wrong -- then validator/structure.py's per-task pass runs and produces the
findings. It is only a filter: it never produces findings itself, so both paths report
exactly the same errors (tests/test_validator.py checks that they agree).
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from ir.ops import OPS
from ir.program import DTYPES

THR_CLAMP_LOW, THR_CLAMP_HIGH = 1 << 61, 1 << 62  # as validator/structure.py

OP_NAMES = list(OPS)
OP_ID = {n: i for i, n in enumerate(OP_NAMES)}
DT_ID = {d: i for i, d in enumerate(DTYPES)}
MAX_IN = max(s.max_ins for s in OPS.values())
MAX_OUT = max(s.max_outs for s in OPS.values())  # mirror outputs included
N_OPER = MAX_IN + MAX_OUT

_MIN_IN = np.array([OPS[n].min_ins for n in OP_NAMES])
_MAX_IN = np.array([OPS[n].max_ins for n in OP_NAMES])
_MIN_OUT = np.array([OPS[n].min_outs for n in OP_NAMES])
_MAX_OUT = np.array([OPS[n].max_outs for n in OP_NAMES])
# allowed dtype per (op, operand slot, dtype): slots 0..MAX_IN-1 are ins, then outs
_DT_OK = np.zeros((len(OP_NAMES), N_OPER, len(DTYPES)), dtype=bool)
for _o, _n in enumerate(OP_NAMES):
    _s = OPS[_n]
    for _i in range(_s.max_ins):
        for _d in _s.dtypes_for_in(_i):
            _DT_OK[_o, _i, DT_ID[_d]] = True
    for _i in range(_s.max_outs):
        for _d in _s.dtypes_for_out(_i):
            _DT_OK[_o, MAX_IN + _i, DT_ID[_d]] = True

_TASK = attrgetter("id", "rank", "worker", "op", "group", "ins", "outs", "params", "waits",
                   "signals")
_REG_BUFFER, _REG_RANK, _REG_RANGES = (attrgetter(a) for a in ("buffer", "rank", "ranges"))
_B4 = attrgetter("start.const", "start.coef", "stop.const", "stop.coef")
_WAIT = attrgetter("counter", "threshold", "offset")
_SIG = attrgetter("counter", "amount")
_SEQ = (tuple, list)


def _all_int(xs) -> bool:
    """Every element is exactly an int (not bool, not float); C-speed via map(type)."""
    return set(map(type, xs)) <= {int}


def _all_type(xs, types) -> bool:
    return set(map(type, xs)) <= types


_SEQT = {tuple, list}


def fast_tasks(prog: Any, R: int, W: int, S: int, be: str, buf_id: dict[str, int],
               buf_shape: list, buf_dtype: list, buf_sym: list, buf_owner: list,
               ctr_id: dict[str, int], ctr_rank: list, nb_axes: int,
               check_params, backends_ok) -> dict[str, Any] | None:
    """Flat task/region/wait/signal arrays, or None if any task needs the per-task pass."""
    try:
        return _fast(prog, R, W, S, be, buf_id, buf_shape, buf_dtype, buf_sym, buf_owner,
                     ctr_id, ctr_rank, nb_axes, check_params, backends_ok)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError):
        return None  # malformed somewhere: the per-task pass will say where


def _fast(prog, R, W, S, be, buf_id, buf_shape, buf_dtype, buf_sym, buf_owner, ctr_id,
          ctr_rank, A, check_params, backends_ok):
    tasks = prog.tasks
    n = len(tasks)
    if n == 0:
        return None
    ids, rk, wk, ops, grp, ins, outs, prm, wts, sgs = zip(*map(_TASK, tasks))
    id_set = set(ids)
    if not _all_type(ids, {str}) or len(id_set) != n or "" in id_set:
        return None
    if not (_all_int(rk) and _all_int(wk)):
        return None
    t_rank = np.fromiter(rk, np.int64, n)
    t_worker = np.fromiter(wk, np.int64, n)
    if (t_rank < 0).any() or (t_rank >= R).any() or (t_worker < 0).any() or \
            (t_worker >= W).any():
        return None
    opi = list(map(OP_ID.get, ops))
    if None in opi:
        return None
    t_op = np.asarray(opi, dtype=np.int64)
    if not backends_ok[t_op].all():
        return None
    if not _all_type(grp, {str, type(None)}):
        return None
    if not (_all_type(ins, _SEQT) and _all_type(outs, _SEQT) and _all_type(wts, _SEQT)
            and _all_type(sgs, _SEQT) and _all_type(prm, {dict})):
        return None
    n_in = np.fromiter(map(len, ins), np.int64, n)
    n_out = np.fromiter(map(len, outs), np.int64, n)
    if ((n_in < _MIN_IN[t_op]) | (n_in > _MAX_IN[t_op]) | (n_out < _MIN_OUT[t_op]) | (n_out > _MAX_OUT[t_op])).any():
        return None

    # ---- regions, in task order: ins then outs ----
    n_ops = n_in + n_out
    regs = list(chain.from_iterable(map(tuple.__add__, map(tuple, ins), map(tuple, outs))))
    nreg = len(regs)
    r_task = np.repeat(np.arange(n), n_ops)
    first = np.repeat(np.concatenate(([0], np.cumsum(n_ops)[:-1])), n_ops)
    k_in_task = np.arange(nreg) - first
    r_out = k_in_task >= n_in[r_task]
    r_operand = np.where(r_out, k_in_task - n_in[r_task], k_in_task)
    if nreg:
        # three C-level passes beat building and transposing 150k tuples
        bnames, rranks, rranges = (list(map(_REG_BUFFER, regs)), list(map(_REG_RANK, regs)),
                                   list(map(_REG_RANGES, regs)))
        bi = list(map(buf_id.get, bnames))
        if None in bi or not _all_int(rranks) or not _all_type(rranges, _SEQT):
            return None
    else:
        bi, rranks, rranges = [], [], []
    r_buf = np.asarray(bi, dtype=np.int64)
    r_rank = np.asarray(rranks, dtype=np.int64)
    if ((r_rank < 0) | (r_rank >= R)).any():
        return None
    ndim = np.asarray([len(s) for s in buf_shape], dtype=np.int64)
    nr = np.fromiter(map(len, rranges), np.int64, nreg)
    if (nr != ndim[r_buf]).any():
        return None
    # range tuples are often shared objects (the text parser caches them): read each once
    rid = np.fromiter(map(id, rranges), np.int64, nreg)
    uid, first_of, inv = np.unique(rid, return_index=True, return_inverse=True)
    if len(uid) < 0.8 * nreg:
        u_ranges = [rranges[i] for i in first_of.tolist()]
        nr_u = nr[first_of]
    else:
        u_ranges, nr_u, inv = rranges, nr, None
    rng_objs = list(chain.from_iterable(u_ranges))
    vals = _range_bounds(rng_objs)
    if vals is None:
        return None
    if inv is not None:  # expand back to every region
        starts_u = np.concatenate(([0], np.cumsum(nr_u)[:-1]))
        vals = vals[_expand_ranges(starts_u[inv], nr_u[inv])]
    rngs = vals
    rr = np.repeat(np.arange(nreg), nr)
    ax = np.arange(len(rngs)) - np.repeat(np.concatenate(([0], np.cumsum(nr)[:-1])), nr)
    lo_c = np.zeros((nreg, A), dtype=np.int64)
    lo_k = np.zeros((nreg, A), dtype=np.int64)
    hi_c = np.ones((nreg, A), dtype=np.int64)
    hi_k = np.zeros((nreg, A), dtype=np.int64)
    lo_c[rr, ax], lo_k[rr, ax], hi_c[rr, ax], hi_k[rr, ax] = vals.T
    if (lo_k != hi_k).any():
        return None
    dims = np.ones((len(buf_shape), A), dtype=np.int64)
    for b, shp in enumerate(buf_shape):
        dims[b, :len(shp)] = shp
    dimr = dims[r_buf]
    for s in ((0, S - 1) if S > 1 else (0,)):
        lo, hi = lo_c + lo_k * s, hi_c + hi_k * s
        if ((lo < 0) | (lo >= hi) | (hi > dimr)).any():
            return None
    sym = np.asarray(buf_sym, dtype=bool)[r_buf]
    owner = np.asarray(buf_owner, dtype=np.int64)[r_buf]
    trk = t_rank[r_task]
    if (r_out & (r_rank != trk) & ~sym).any():
        return None  # RemoteWriteToLocal
    if (r_out & ~sym & (t_op[r_task] == OPS_PUT_ID)).any():
        return None  # a put's destination must be symmetric
    if (~sym & (r_rank != owner)).any():
        return None  # local region names another rank
    if (~r_out & (r_rank != trk)).any():
        return None  # RemoteRead
    dt = np.asarray([DT_ID[d] for d in buf_dtype], dtype=np.int64)[r_buf]
    slot = np.where(r_out, MAX_IN + r_operand, r_operand)
    if not _DT_OK[t_op[r_task], slot, dt].all():
        return None

    # ---- params and op shape checks, once per distinct signature ----
    pkeys = [tuple(sorted(p.items())) if p else () for p in prm]
    intern: dict = {}
    pid = np.fromiter((intern.setdefault((o, k), len(intern)) for o, k in zip(ops, pkeys)),
                      np.int64, n)
    for (o, k), _ in intern.items():
        if check_params(OPS[o], dict(k)):
            return None
    ext = hi_c - lo_c
    order = np.argsort(ext == 1, axis=1, kind="stable")
    sq = np.take_along_axis(ext, order, axis=1)
    sq[sq == 1] = 0  # squeezed shape, zero-padded
    sig = np.zeros((n, 2 + N_OPER * (A + 1)), dtype=np.int64)
    sig[:, 0] = pid
    sig[:, 1] = n_in
    base = 2 + slot * (A + 1)
    sig[r_task, base] = dt + 1
    cols = base[:, None] + 1 + np.arange(A)[None, :]
    sig[np.repeat(r_task, A).reshape(nreg, A), cols] = sq
    rep_idx = _distinct_rows(sig)
    for t in rep_idx:
        spec = OPS[ops[t]]
        if spec.check is None:
            continue
        row = sig[t]
        ins_s, ind, outs_s, outd = [], [], [], []
        for sl in range(N_OPER):
            d = row[2 + sl * (A + 1)]
            if d == 0:
                continue
            shp = tuple(int(x) for x in row[3 + sl * (A + 1): 3 + sl * (A + 1) + A] if x)
            if sl < MAX_IN:
                ins_s.append(shp)
                ind.append(DTYPES[d - 1])
            else:
                outs_s.append(shp)
                outd.append(DTYPES[d - 1])
        try:
            msgs = spec.check(ins_s, ind, outs_s, outd, prm[t])
        except Exception:
            return None
        if msgs:
            return None

    # ---- waits ----
    nw_t, wl, w_idx = _flat_shared(wts, n)
    if wl:
        wc, wth, wo = zip(*map(_WAIT, wl))
        ci = list(map(ctr_id.get, wc))
        if None in ci or not _all_int(wth) or not _all_int(wo):
            return None
        w_ctr = _take(np.asarray(ci, dtype=np.int64), w_idx)
        w_thr = _take(np.asarray(wth, dtype=np.int64), w_idx)
        w_off = _take(np.asarray(wo, dtype=np.int64), w_idx)
        w_task = np.repeat(np.arange(n), nw_t)
        if ((w_off != 0) & (w_off != -1)).any():
            return None
        w_thr_src = w_thr
        if ((w_thr > THR_CLAMP_HIGH) | (w_thr < -THR_CLAMP_LOW)).any():
            w_thr = np.clip(w_thr, -THR_CLAMP_LOW, THR_CLAMP_HIGH)
        if (np.asarray(ctr_rank, dtype=np.int64)[w_ctr] != t_rank[w_task]).any():
            return None
    else:
        w_ctr = w_thr = w_off = w_task = w_thr_src = np.zeros(0, dtype=np.int64)

    # ---- signals ----
    ns_t, sl_, s_idx = _flat_shared(sgs, n)
    if sl_:
        sc, sa = zip(*map(_SIG, sl_))
        ci = list(map(ctr_id.get, sc))
        if None in ci or not _all_int(sa):
            return None
        s_ctr = _take(np.asarray(ci, dtype=np.int64), s_idx)
        s_amt = _take(np.asarray(sa, dtype=np.int64), s_idx)
        s_task = np.repeat(np.arange(n), ns_t)
        if (s_amt <= 0).any():
            return None
    else:
        s_ctr = s_amt = s_task = np.zeros(0, dtype=np.int64)

    return dict(task_ids=list(ids), t_rank=t_rank, t_worker=t_worker, t_op=t_op,
                t_group=list(grp), r_task=r_task, r_out=r_out, r_buf=r_buf, r_rank=r_rank,
                r_operand=r_operand, lo_c=lo_c, lo_k=lo_k, hi_c=hi_c, hi_k=hi_k,
                w_task=w_task, w_ctr=w_ctr, w_thr=w_thr, w_off=w_off, w_thr_src=w_thr_src,
                s_task=s_task, s_ctr=s_ctr, s_amt=s_amt)


OPS_PUT_ID = OP_ID["put"]


def _range_bounds(rngs: list) -> np.ndarray | None:
    """[n, 4] int64 (start.const, start.coef, stop.const, stop.coef) of Range objects, or
    None if a bound is not an int. Range objects that are shared (a producer that caches
    its Range constructor) are read once; a sample decides whether deduplication pays."""
    n = len(rngs)
    sample = rngs[:4096]
    if n > 8192 and len(set(map(id, sample))) < 0.8 * len(sample):
        ids = np.fromiter(map(id, rngs), np.int64, n)
        _, first, inv = np.unique(ids, return_index=True, return_inverse=True)
        uniq = [rngs[i] for i in first.tolist()]
        flat = list(chain.from_iterable(map(_B4, uniq)))
        if not _all_int(flat):
            return None
        return np.asarray(flat, dtype=np.int64).reshape(-1, 4)[inv.ravel()]
    flat = list(chain.from_iterable(map(_B4, rngs)))
    if not _all_int(flat):
        return None
    return np.asarray(flat, dtype=np.int64).reshape(-1, 4)


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
    ustart = np.concatenate(([0], np.cumsum(uc)[:-1])).astype(np.int64)
    return counts, elems, _expand_ranges(ustart[inv.ravel()], counts)


def _take(a: np.ndarray, idx) -> np.ndarray:
    return a if idx is None else a[idx]


def _expand_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenate arange(starts[i], starts[i] + counts[i])."""
    tot = int(counts.sum())
    off = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return off + np.arange(tot)


def _distinct_rows(M: np.ndarray) -> np.ndarray:
    """Indices of one representative row per distinct row of M (int64 [n, k]).

    Rows are hashed with random odd 64-bit multipliers (wrapping arithmetic); every row is
    then compared with its group's representative, and on any collision the exact (slower)
    ``np.unique(axis=0)`` is used, so no distinct signature is ever skipped.
    """
    rng = np.random.default_rng(12345)
    mult = rng.integers(1, 1 << 62, size=M.shape[1], dtype=np.int64) | 1
    with np.errstate(over="ignore"):
        h = (M * mult[None, :]).sum(axis=1) + (M * (mult[None, :] >> 7)).sum(axis=1) * 31
    uh, first, inv = np.unique(h, return_index=True, return_inverse=True)
    if (M == M[first[inv]]).all():
        return first
    _, first = np.unique(M, axis=0, return_index=True)
    return first
