"""The reduce family: ``reduce`` (the sum of an all-reduce), ``argmax``, ``argmax_combine``.

Partial sums are added in index order, ``((P[0] + P[1]) + ...) + P[KP-1]``, like
lowering/reference.py (``sum_rows``, also the prologue of ops/gemv.py's reduce_norm_gemv).
The argmaxes treat a NaN as the maximum (torch.argmax) and break ties by the lowest index.
"""

from __future__ import annotations

import triton.language as tl

from lowering.triton import layout as L
from lowering.triton.lang import INT_POISON, aligned, device, flat_off, store
from lowering.triton.layout import DECODER_ARGS, OpLowering, plain_call, TableError, Variant, tl_dtypes, vec_arg
from lowering.triton.vm import arena_ptr, operand, param_i, status_ok


@device
def sum_rows(p, p_rs, KP, idx, m):
    """fp32 (P[0] + P[1]) + ... + P[KP-1] at element offsets ``idx`` of each row (row k at
    p + k * p_rs), in index order like reference.py's reduce (reduce, reduce_norm_gemv)."""
    acc = tl.load(p + idx, mask=m, other=0).to(tl.float32)
    for k in range(1, KP):
        acc += tl.load(p + k * p_rs + idx, mask=m, other=0).to(tl.float32)
    return acc


@device
def reduce(p, p_rs, p_n2, p_s1, p_s2, KP, r, r_n1, r_n2, r_s0, r_s1, r_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n,
           HAS_RES: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr = 0):
    """y = ((P[0] + P[1]) + ...) + P[KP-1] (+ residual), partials P[KP, n], summed in index
    order in fp32 like reference.py. Row k starts at p + k * p_rs; its element i at
    ``(i // p_n2) * p_s1 + (i % p_n2) * p_s2`` (a row of up to two strided axes: partials
    ``[KP, rows, C]`` with p_n2 = C, the table's ``partials`` view). ``VEC`` > 0 (table flag
    ``vec``): every row of P, the residual and y are contiguous, start on a multiple of
    ``VEC`` elements (16 bytes) and ``n`` is one too, so the loads and stores are 16-byte
    vectors (the caller aligned the pointers; the generic strided addressing moved 2 bytes
    per access)."""
    if VEC > 0:
        n = aligned(n, VEC)
        p_rs = aligned(p_rs, VEC)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        if VEC > 0:  # plain i, so Triton's analysis sees the contiguity
            pi = i
            yi = i
        else:
            pi = (i // p_n2) * p_s1 + (i % p_n2) * p_s2
            yi = flat_off(i, y_n1, y_n2, y_s0, y_s1, y_s2)
        acc = sum_rows(p, p_rs, KP, pi, m)
        if HAS_RES:
            if VEC > 0:
                ri = i
            else:
                ri = flat_off(i, r_n1, r_n2, r_s0, r_s1, r_s2)
            acc += tl.load(r + ri, mask=m, other=0).to(tl.float32)
        store(y + yi, acc, m)


@device
def argmax(x, x_n1, x_n2, x_s0, x_s1, x_s2, n, offset, y, y_n1, y_n2, y_s0, y_s1, y_s2,
           BLOCK: tl.constexpr):
    """y = (max(x), offset + i) as two fp32, i the first index of the maximum; a NaN counts
    as the maximum (torch.argmax; reference.py).

    One pass with no cross-thread work in the loop: every lane keeps its own running
    (max, first index of it) and first NaN index over the elements it visits (lane l sees
    l, l + BLOCK, ... in increasing order, so a strict ``>`` keeps the lane's first
    maximum); the lanes are combined once at the end (three reductions in all, where a
    per-block combine costs three per block)."""
    lane = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32) + n  # n = "none yet"
    nan_i = tl.zeros([BLOCK], dtype=tl.int32) + n
    for i0 in range(0, n, BLOCK):
        i = i0 + lane
        m = i < n
        v = tl.load(x + flat_off(i, x_n1, x_n2, x_s0, x_s1, x_s2), mask=m, other=0).to(tl.float32)
        isn = (v != v) & m
        nan_i = tl.minimum(nan_i, tl.where(isn, i, n))
        ok = m & (isn == 0)
        upd = ok & ((v > best_v) | (best_i == n))
        best_i = tl.where(upd, i, best_i)
        best_v = tl.where(upd, v, best_v)
    bv = tl.max(best_v, axis=0)
    bi = tl.min(tl.where((best_v == bv) & (best_i < n), best_i, n), axis=0)
    ni = tl.min(nan_i, axis=0)
    idx = tl.where(ni < n, ni, bi)
    val = tl.load(x + flat_off(idx, x_n1, x_n2, x_s0, x_s1, x_s2)).to(tl.float32)
    store(y + flat_off(0, y_n1, y_n2, y_s0, y_s1, y_s2), val, None)
    store(y + flat_off(1, y_n1, y_n2, y_s0, y_s1, y_s2), (offset + idx).to(tl.float32), None)


@device
def argmax_combine(p, p_rs, p_cs, KP, tok, BLOCK: tl.constexpr):
    """tok = the smallest index among the (value, index) pairs P[KP, 2] with the largest
    value (a NaN value counts as the largest); INT_POISON if a chosen index is NaN or not an
    integer (reference.py)."""
    has_nan = tl.full([], 0, dtype=tl.int32)
    mx = tl.full([], float("-inf"), dtype=tl.float32)
    for j0 in range(0, KP, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < KP
        v = tl.load(p + j * p_rs, mask=m, other=0).to(tl.float32)
        isn = (v != v) & m
        has_nan = tl.maximum(has_nan, tl.max(isn.to(tl.int32), axis=0))
        mx = tl.maximum(mx, tl.max(tl.where(isn | (m == 0), float("-inf"), v), axis=0))
    best = tl.full([], float("inf"), dtype=tl.float32)
    bad = tl.full([], 0, dtype=tl.int32)
    for j0 in range(0, KP, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < KP
        v = tl.load(p + j * p_rs, mask=m, other=0).to(tl.float32)
        idx = tl.load(p + j * p_rs + p_cs, mask=m, other=0).to(tl.float32)
        isn = v != v
        cand = m & tl.where(has_nan != 0, isn, (v == mx) & (isn == 0))
        badc = cand & ((idx != idx) | (idx != tl.floor(idx)))
        bad = tl.maximum(bad, tl.max(badc.to(tl.int32), axis=0))
        best = tl.minimum(best, tl.min(tl.where(cand & (badc == 0), idx, float("inf")), axis=0))
    res = tl.where(bad != 0, INT_POISON, tl.where(bad != 0, 0.0, best).to(tl.int32))
    store(tok, res, None)


# ---------------------------------------------------------------- row decoders
@device
def t_reduce(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DP: tl.constexpr, DR: tl.constexpr,
             DY: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr = 0):
    """reduce (partials [KP = n0, row (n1, n2)] under the ``partials`` view, [residual], y);
    ``VEC``: the variant's ``vec`` flag (reduce)."""
    po, pn0, pn1, pn2, ps0, ps1, ps2 = operand(row, 0, slot)
    if HAS_RES:
        ro, rn0, rn1, rn2, rs0, rs1, rs2 = operand(row, 1, slot)
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 2, slot)
        if VEC > 0:
            ro = aligned(ro, VEC)
        rp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DR) + ro
    else:
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 1, slot)
        rp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo
        rn1, rn2, rs0, rs1, rs2 = yn1, yn2, ys0, ys1, ys2
    if VEC > 0:
        po = aligned(po, VEC)
        yo = aligned(yo, VEC)
    reduce(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po, ps0, pn2, ps1, ps2, pn0, rp, rn1, rn2, rs0, rs1, rs2,
           arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, yn0 * yn1 * yn2,
           HAS_RES, BLOCK, VEC)
    return status_ok()


@device
def t_argmax(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DY: tl.constexpr,
             BLOCK: tl.constexpr):
    """argmax (x, y; param offset)."""
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = operand(row, 0, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 1, slot)
    argmax(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2, xn0 * xn1 * xn2,
           param_i(row, 0), arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, BLOCK)
    return status_ok()


@device
def t_argmax_combine(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DP: tl.constexpr, DT: tl.constexpr,
                     BLOCK: tl.constexpr):
    """argmax_combine (pairs, token)."""
    po, pn0, pn1, pn2, ps0, ps1, ps2 = operand(row, 0, slot)
    to, tn0, tn1, tn2, ts0, ts1, ts2 = operand(row, 1, slot)
    argmax_combine(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po, ps1, ps2, pn1,
                   arena_ptr(A_BF16, A_F16, A_F32, A_I32, DT) + to, BLOCK)
    return status_ok()


# ---------------------------------------------------------------- table encoding and dispatch
def _call_reduce(v: Variant) -> str:
    d = tl_dtypes(v)
    res = v.flag("residual")
    dr = d[1] if res else d[-1]
    return f"t_reduce({DECODER_ARGS}, {d[0]}, {dr}, {d[-1]}, {res}, BLOCK, {vec_arg(v)})"


_call_argmax = plain_call("t_argmax", "BLOCK")
_call_argmax_combine = plain_call("t_argmax_combine", "PAIR_BLOCK")


def _flags_reduce(task, dtypes, descs, slots) -> dict[str, bool]:
    """``residual`` (a residual operand), ``vec``: the partials P [KP, n] have contiguous
    rows at a 16-byte row stride, the residual and y are flat (16-byte loads and stores)."""
    return {"residual": len(task.ins) > 1,
            "vec": L.partials_vec_aligned(descs[0], descs[1:], L.vec_elems(dtypes), slots)}


def _splits_reduce(task) -> list[int | None]:
    """The partials' row length: the output's element count (reference.py)."""
    return [task.outs[0].numel()]


def _check_reduce(task, descs, where) -> None:
    """The partials viewed as [KP, row] match the output's N."""
    p, y = descs[0], descs[-1]
    if p.n[1] * p.n[2] != y.numel:
        raise TableError(f"{where}: partials viewed as [{p.n[0]}, {p.n[1] * p.n[2]}] do not match N={y.numel}")


def _check_argmax_combine(task, descs, where) -> None:
    """The pairs viewed as [k, 2]."""
    if descs[0].n[2] != 2:
        raise TableError(f"{where}: pairs viewed as [{descs[0].n[1]}, {descs[0].n[2]}], not [k, 2]")


LOWERINGS = (
    OpLowering("reduce", ("partials", "flat", "flat"), t_reduce, _call_reduce,  # partials, [residual], y
               flags=_flags_reduce, check=_check_reduce, in_place="same", splits=_splits_reduce),
    OpLowering("argmax", ("flat", "flat"), t_argmax, _call_argmax, params=(("offset", "i"),)),
    OpLowering("argmax_combine", ("matrix", "flat"), t_argmax_combine, _call_argmax_combine,
               check=_check_argmax_combine),
)
