"""The instruction library: one ``@triton.jit`` device function per IR op (ir/ops.py).

Every function computes exactly what lowering/reference.py defines for its op (the ground
truth): inputs are converted to fp32, the op is computed in fp32, the result is rounded once
to the output dtype. The persistent megakernel (megakernel.py) inlines them into its opcode
dispatch; the thin ``_k_*`` kernels and ``run_*`` launchers at the end of this file run one
op alone, for the unit tests (tests/test_triton_ops.py, CPU under ``TRITON_INTERPRET=1`` and
GPU).

Operand conventions
-------------------
* A *flat* operand (a vector of ``n`` elements) is a typed pointer ``p`` plus
  ``(n1, n2, s0, s1, s2)``: element ``i`` lives at ``p + flat_off(i, n1, n2, s0, s1, s2)``,
  a region of up to three strided axes (table.py's ``flat`` view). A contiguous vector is
  ``(1, n, 0, 0, 1)``.
* A *matrix* operand is ``p`` plus a row stride and a column stride (elements).
* A *cache* operand ``[G, S, D]`` is ``p`` plus three strides (kv head, position, dim).
* Offsets inside one operand are int32 (table.py limits a buffer to 2^31 - 1 elements);
  base pointers carry the 64-bit part.
Block sizes are ``tl.constexpr``; extents are runtime ints, handled with masks and loops, so
one compiled kernel serves every task of a variant.

Precision notes (where the GPU differs from the CPU reference by rounding only): the
reference sums in torch's order, these kernels sum in blocks (gemv, rmsnorm, attention
use an online softmax); with ``enable_fp_fusion`` the compiler may contract a*b+c into an
FMA. ``reduce`` sums partials in index order like the reference (bit-exact in fp32 when no
FMA is involved). RoPE's cos/sin use libdevice on the GPU (accurate for large angles, unlike
the approximate ``cos.approx`` path) and numpy under the interpreter.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

#: The int32 written by argmax_combine for a NaN / non-integer index (reference.INT_POISON).
INT_POISON = tl.constexpr(-(2**31))


def interpreting() -> bool:
    """Whether Triton runs under the CPU interpreter (``TRITON_INTERPRET=1``). Decided when
    the jit functions are created (at import), like Triton's own choice of interpreter."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Compile-time flag: True under the interpreter (no inline PTX, no libdevice; bf16 rounding
#: done by hand because the interpreter truncates f32 -> bf16 instead of rounding).
INTERPRET = tl.constexpr(interpreting())


def device(fn):
    """Decorator of the device functions (everything a kernel calls): ``triton.jit``, or
    under the interpreter the plain Python function. The interpreter re-patches
    ``triton.language`` on every call of a jit function (about 1 ms), which made an
    interpreted megakernel step several times slower; the calling kernel's patch already
    covers the helpers, so the semantics are the same."""
    return fn if interpreting() else triton.jit(fn)


# ---------------------------------------------------------------- addressing
@device
def aligned(v, A: tl.constexpr):
    """``v`` (a non-negative integer scalar that the caller knows is a multiple of ``A``)
    with that fact visible to Triton's alignment analysis, so loads through it can be
    16-byte vectors. The value is restated as ``(v // A) * A`` as well as hinted with
    ``tl.multiple_of``: on Triton 3.6 (the GPU machines' version) a bare ``multiple_of`` on
    an offset loaded from the task table is lost, and the megakernel's GEMV weights would be
    loaded 2 bytes at a time (SASS: LDG.E.U16 only, in Nsight Compute on the H200). The
    arithmetic costs a few integer instructions per task."""
    return tl.multiple_of((v // A) * A, A)


@device
def flat_off(i, n1, n2, s0, s1, s2):
    """Element offset of flat index ``i`` (any int tensor) in a region of up to 3 strided
    axes with extents (n0, n1, n2) and strides (s0, s1, s2); n0 is implied."""
    q = i // n2
    return (q // n1) * s0 + (q % n1) * s1 + (i % n2) * s2


@device
def bf16_rtne(v):
    """fp32 -> bf16 with round-to-nearest-even done on the bits (NaN stays a quiet NaN).
    Only used under the interpreter, whose own f32 -> bf16 cast truncates."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, (b >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@device
def store(ptr, val, mask):
    """``tl.store(ptr, val converted to ptr's dtype, mask)`` with round-to-nearest-even, the
    rounding of torch's ``copy_`` (reference.py) on the GPU and under the interpreter."""
    if INTERPRET:
        if ptr.dtype.element_ty == tl.bfloat16:
            if val.dtype != tl.bfloat16:
                val = bf16_rtne(val.to(tl.float32))
    tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)


@device
def global_timer():
    """%globaltimer in ns (GPU only): the megakernel's watchdog and profiling stamps."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@device
def l2_prefetch_bytes(p, n):
    """Start an L2 prefetch of the ``n`` bytes at ``p`` (both multiples of 16; nothing when
    n <= 0): one ``cp.async.bulk.prefetch.L2.global`` (sm_90, PTX ISA
    "cp.async.bulk.prefetch") issued by thread 0. A hint with no effect on memory contents.
    A no-op under the interpreter."""
    if not INTERPRET:
        if n > 0:
            tl.inline_asm_elementwise(
                "{ .reg .pred %pf_p; .reg .u32 %pf_t; mov.u32 %pf_t, %tid.x; setp.eq.u32 %pf_p, %pf_t, 0; "
                "@%pf_p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [p, n.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@device
def l2_prefetch_lines(ptrs, mask):
    """Start an L2 prefetch of the 128-byte line holding each address of ``ptrs`` where
    ``mask``: one ``prefetch.global.L2`` (PTX ISA "prefetch") per element, issued by the
    thread that holds it, so a tensor of one line per thread covers a [rows, bytes] slice in
    one instruction per thread (the GEMV's K-roll, gemv_ex ``KROLL``). Not
    ``cp.async.bulk.prefetch``: its operands must be warp-uniform, and per-row addresses make
    ptxas issue one bulk prefetch at a time in a loop ahead of warp 0's loads (seen in the
    SASS). A no-op under the interpreter."""
    if not INTERPRET:
        tl.inline_asm_elementwise(
            "{ .reg .pred %kl_p; setp.ne.s32 %kl_p, $2, 0; @%kl_p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


# ---------------------------------------------------------------- compute ops
@device
def round_as(v, DT: tl.constexpr):
    """fp32 ``v`` rounded (nearest even) to dtype DT and widened back to fp32: the value an
    unfused schedule would have stored in a DT buffer and read again (fused prologues)."""
    if DT == tl.float32:
        r = v
    elif INTERPRET and DT == tl.bfloat16:
        r = bf16_rtne(v).to(tl.float32)
    else:
        r = v.to(DT).to(tl.float32)
    return r


@device
def embed(tab, t_rs, t_cs, row, y, y_n1, y_n2, y_s0, y_s1, y_s2, H, BLOCK: tl.constexpr):
    """y[:] = tab[row, :] (H elements). ``row`` is the token id, already range-checked by
    the caller (an out-of-range token is an error, never a read)."""
    base = tab + row.to(tl.int64) * t_rs
    for h0 in range(0, H, BLOCK):
        h = h0 + tl.arange(0, BLOCK)
        m = h < H
        v = tl.load(base + h * t_cs, mask=m, other=0)
        store(y + flat_off(h, y_n1, y_n2, y_s0, y_s1, y_s2), v, m)


@device
def rmsnorm(x, x_n1, x_n2, x_s0, x_s1, x_s2, w, w_n1, w_n2, w_s0, w_s1, w_s2,
            y, y_n1, y_n2, y_s0, y_s1, y_s2, n, dim, eps, BLOCK: tl.constexpr):
    """Per group of ``dim`` consecutive elements of x (n of them in all):
    y = w * (x * rsqrt(mean(x^2) + eps)), fp32 (HF LlamaRMSNorm; reference.py).
    In place (y == x) is safe: each element is read before it is written."""
    for g in range(0, n // dim):
        base = g * dim
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for d0 in range(0, dim, BLOCK):
            d = d0 + tl.arange(0, BLOCK)
            m = d < dim
            xv = tl.load(x + flat_off(base + d, x_n1, x_n2, x_s0, x_s1, x_s2), mask=m, other=0).to(tl.float32)
            acc += xv * xv
        r = tl.rsqrt(tl.sum(acc, axis=0) / dim + eps)
        for d0 in range(0, dim, BLOCK):
            d = d0 + tl.arange(0, BLOCK)
            m = d < dim
            xv = tl.load(x + flat_off(base + d, x_n1, x_n2, x_s0, x_s1, x_s2), mask=m, other=0).to(tl.float32)
            wv = tl.load(w + flat_off(d, w_n1, w_n2, w_s0, w_s1, w_s2), mask=m, other=0).to(tl.float32)
            store(y + flat_off(base + d, y_n1, y_n2, y_s0, y_s1, y_s2), wv * (xv * r), m)


#: gemv prologue modes (``PRO``): plain x; RMSNorm of x times a (norm_gemv); silu(x) * a
#: (swiglu_gemv, x = gate, a = up); RMSNorm times a of the sum of the partial rows x plus a
#: residual (reduce_norm_gemv).
PRO_PLAIN = tl.constexpr(0)
PRO_NORM = tl.constexpr(1)
PRO_SWIGLU = tl.constexpr(2)
PRO_RNORM = tl.constexpr(3)


@device
def _sum_rows(p, p_rs, KP, idx, m):
    """fp32 (P[0] + P[1]) + ... + P[KP-1] at element offsets ``idx`` of each row (row k at
    p + k * p_rs), in index order like reference.py's reduce (reduce, reduce_norm_gemv)."""
    acc = tl.load(p + idx, mask=m, other=0).to(tl.float32)
    for k in range(1, KP):
        acc += tl.load(p + k * p_rs + idx, mask=m, other=0).to(tl.float32)
    return acc


@device
def _gemv_xsum(x, p_rs, KP, r, a, cols, cm):
    """reduce_norm_gemv's raw inputs at ``cols`` (fp32): h = ((P[0] + P[1]) + ...) + r, the
    partial rows x[k * p_rs + cols] summed in reduce's order and rounded to r's dtype (what
    a reduce stores), and the norm weight a. Rows, r and a contiguous and 16-byte aligned
    (the caller's hints; table._variant checks it)."""
    acc = _sum_rows(x, p_rs, KP, cols, cm)
    acc += tl.load(r + cols, mask=cm, other=0).to(tl.float32)
    return round_as(acc, r.dtype.element_ty), tl.load(a + cols, mask=cm, other=0).to(tl.float32)


@device
def _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, cols, cm,
                PRO: tl.constexpr, X_CONTIG: tl.constexpr, X_ALIGN: tl.constexpr = 0):
    """The raw GEMV inputs at ``cols`` as fp32: (x, a); a is x itself for PRO_PLAIN."""
    if X_ALIGN > 1:
        xv = tl.load(x + cols, mask=cm, other=0).to(tl.float32)
        av = xv
        if PRO != PRO_PLAIN:
            av = tl.load(a + cols, mask=cm, other=0).to(tl.float32)
        return xv, av
    if X_CONTIG:
        xv = tl.load(x + cols * x_s2, mask=cm, other=0).to(tl.float32)
    else:
        xv = tl.load(x + flat_off(cols, x_n1, x_n2, x_s0, x_s1, x_s2), mask=cm, other=0).to(tl.float32)
    av = xv
    if PRO != PRO_PLAIN:
        if X_CONTIG:
            av = tl.load(a + cols * a_s2, mask=cm, other=0).to(tl.float32)
        else:
            av = tl.load(a + flat_off(cols, a_n1, a_n2, a_s0, a_s1, a_s2), mask=cm, other=0).to(tl.float32)
    return xv, av


@device
def _gemv_xfn(x, xv, av, rstd, PRO: tl.constexpr):
    """The fused prologue f on loaded values: xv itself, or f(xv, av) rounded to x's dtype
    (what the unfused rmsnorm / silu_mul would have stored). ``x`` only gives the dtype."""
    if PRO == PRO_NORM or PRO == PRO_RNORM:
        xv = round_as(av * (xv * rstd), x.dtype.element_ty)
    elif PRO == PRO_SWIGLU:
        xv = round_as(xv / (1.0 + tl.exp(-xv)) * av, x.dtype.element_ty)
    return xv


@device
def _gemv_rstd(x, x_n1, x_n2, x_s0, x_s1, x_s2, K, eps, NB: tl.constexpr, PU: tl.constexpr,
               X_CONTIG: tl.constexpr, X_ALIGN: tl.constexpr):
    """RMSNorm's 1 / sqrt(mean(x^2) + eps) over x[0:K] (fp32), x read in chunks of NB
    elements (PU chunks unrolled), the squares summed per lane then across lanes."""
    sq = tl.zeros([NB], dtype=tl.float32)
    for k0 in tl.range(0, K, NB, loop_unroll_factor=PU):
        cols = k0 + tl.arange(0, NB)
        xv, _ = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, x, x_n1, x_n2, x_s0, x_s1, x_s2,
                            cols, cols < K, PRO_PLAIN, X_CONTIG, X_ALIGN)
        sq += xv * xv
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@device
def _gemv_wload(w, w_rs, w_cs, rows, rm, cols, cm, W_CONTIG: tl.constexpr):
    """The fp32 weight block W[rows, cols] (zeros outside the masks)."""
    if W_CONTIG:
        wp = w + rows[:, None] * w_rs + cols[None, :]
    else:
        wp = w + rows[:, None] * w_rs + cols[None, :] * w_cs
    return tl.load(wp, mask=rm[:, None] & cm[None, :], other=0).to(tl.float32)


@device
def gemv_wpre(w, w_rs, w_cs, N, K, ok, W_CONTIG: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
              PK: tl.constexpr):
    """W[0:BLOCK_N, 0:PK] in W's own dtype (unconverted: half the registers of fp32 for bf16),
    zeros outside [N, K] and everywhere when ``ok`` == 0 (then no memory is read): the block
    gemv_ex's ``wpre`` takes, loaded early so that its latency overlaps other work.
    ``W_CONTIG`` / ``W_ALIGN``: as gemv_ex."""
    if W_ALIGN > 1:
        w_rs = aligned(w_rs, W_ALIGN)
        K = aligned(K, W_ALIGN)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, PK)
    if W_CONTIG:
        wp = w + rows[:, None] * w_rs + cols[None, :]
    else:
        wp = w + rows[:, None] * w_rs + cols[None, :] * w_cs
    n = tl.where(ok != 0, N, 0)  # ok == 0: every row masked off
    return tl.load(wp, mask=(rows < n)[:, None] & (cols < K)[None, :], other=0)


@device
def _gemv_rows(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, rstd,
               w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
               PRO: tl.constexpr, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, X_ALIGN: tl.constexpr,
               UNROLL: tl.constexpr, wpre=0, W_PRE: tl.constexpr = 0, ROLL: tl.constexpr = 0, roll_ok=0,
               KROLL: tl.constexpr = 0, m1=0, m2=0, m3=0, MIRRORS: tl.constexpr = 0, W_TMA: tl.constexpr = False):
    """gemv_ex's row blocks: y[rows] = W[rows, :] @ f(x) (+ b) for every BLOCK_N rows, f the
    prologue ``PRO`` with the RMSNorm factor ``rstd`` already known (loop forms: gemv_ex).
    ``W_PRE`` > 0: ``wpre`` holds W[0:BLOCK_N, 0:W_PRE] (gemv_wpre); the first row block
    takes those columns from it and streams only the rest. ``ROLL`` > 0 and ``roll_ok``: at
    each row block, start an L2 prefetch of the row block ``ROLL`` blocks later (its rows
    are one contiguous range: the caller checked). ``KROLL`` > 0 (UNROLL >= 4,
    STAGES = 1, a group of at least one 128-byte line per row: the caller checked): the K
    loop runs in groups of UNROLL blocks; before the first group the row block's first
    KROLL groups are prefetched into L2, and each group starts the prefetch of the group
    KROLL later, line by line (l2_prefetch_lines), so a long row block streams from L2
    (same summation order as the plain unrolled loop: bit-identical). ``MIRRORS`` (0..3):
    each row block is also stored at ``y + m1`` (``m2``, ``m3``), the mirror outputs' element
    deltas (peer copies of y: megakernel.t_gemv). ``W_TMA`` (STAGES >= 2; W contiguous with a
    16-byte aligned start and row stride: the caller checked): W's blocks come through a
    tensor descriptor (TMA copies into shared memory; gemv_ex)."""
    if W_TMA:
        tl.static_assert(STAGES > 1 and W_CONTIG and W_PRE == 0, "W_TMA needs STAGES >= 2, W_CONTIG, no W_PRE")
        # a one-row W may have any row stride; TMA wants a 16-byte multiple (K is one)
        wd = tl.make_tensor_descriptor(w, shape=[N, K], strides=[tl.where(N > 1, w_rs, K), 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    pre = tl.zeros([BLOCK_N], dtype=tl.float32)
    if W_PRE > 0:
        pc = tl.arange(0, W_PRE)
        px, pa = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                             pc, pc < K, PRO, X_CONTIG, X_ALIGN)
        pre = tl.sum(wpre.to(tl.float32) * _gemv_xfn(x, px, pa, rstd, PRO)[None, :], axis=1)
    for n0 in range(0, N, BLOCK_N):
        if ROLL > 0:  # a large tile keeps its own stream ahead in L2
            if roll_ok != 0:
                nxt = n0 + ROLL * BLOCK_N
                if nxt < N:
                    l2_prefetch_bytes(w + nxt.to(tl.int64) * w_rs,
                                      tl.minimum(N - nxt, BLOCK_N) * K * (w.dtype.element_ty.primitive_bitwidth // 8))
        rows = n0 + tl.arange(0, BLOCK_N)
        rm = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        kb = 0
        if W_PRE > 0:
            if n0 == 0:
                # at most K: an unrolled loop's remainder would start below a start above its
                # end (and sum columns twice when W_PRE > K)
                kb = tl.minimum(K, W_PRE)
        if STAGES <= 1 and UNROLL == 2:
            for k0 in range(kb, K, 2 * BLOCK_K):
                # both K blocks' weight loads go out before either is consumed: two blocks in
                # flight per CTA, one [BLOCK_N, BLOCK_K] accumulator
                c0 = k0 + tl.arange(0, BLOCK_K)
                c1 = c0 + BLOCK_K
                w0 = _gemv_wload(w, w_rs, w_cs, rows, rm, c0, c0 < K, W_CONTIG)
                w1 = _gemv_wload(w, w_rs, w_cs, rows, rm, c1, c1 < K, W_CONTIG)
                x0, a0 = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                     c0, c0 < K, PRO, X_CONTIG, X_ALIGN)
                x1, a1 = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                     c1, c1 < K, PRO, X_CONTIG, X_ALIGN)
                acc += w0 * _gemv_xfn(x, x0, a0, rstd, PRO)[None, :]
                acc += w1 * _gemv_xfn(x, x1, a1, rstd, PRO)[None, :]
        elif STAGES <= 1 and UNROLL > 2 and KROLL > 0:
            # the unrolled loop below, written out as groups of UNROLL blocks so that each
            # group can first start the L2 prefetch of the group KROLL ahead (all rows): one
            # 128-byte line per element of a [BLOCK_N x LPR] tensor, one per thread at 8 warps
            # for 16 x 128 bf16 blocks unrolled 8 times
            G: tl.constexpr = UNROLL * BLOCK_K
            ES: tl.constexpr = w.dtype.element_ty.primitive_bitwidth // 8
            LPR: tl.constexpr = G * ES // 128  # lines per row of one group (gemv_ex checked >= 1)
            li = tl.arange(0, BLOCK_N * LPR)
            lrow = li // LPR
            lcol = (li % LPR) * (128 // ES)
            lok = lrow < N - n0
            lp = w + (n0 + lrow) * w_rs + lcol  # the lines of the group at column 0
            for g in tl.static_range(KROLL):
                l2_prefetch_lines(lp + (kb + g * G), lok & (kb + g * G + lcol < K))
            for kc in range(kb, K, G):
                c = kc + KROLL * G
                l2_prefetch_lines(lp + c, lok & (c + lcol < K))
                for u in tl.static_range(UNROLL):
                    cols = kc + u * BLOCK_K + tl.arange(0, BLOCK_K)
                    cm = cols < K
                    wv = _gemv_wload(w, w_rs, w_cs, rows, rm, cols, cm, W_CONTIG)
                    xv, av = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                         cols, cm, PRO, X_CONTIG, X_ALIGN)
                    acc += wv * _gemv_xfn(x, xv, av, rstd, PRO)[None, :]
        elif STAGES <= 1 and UNROLL > 2:
            # the loop unrolled by the compiler: straight-line code in which ptxas issues all
            # UNROLL weight loads ahead of the FMAs, provided x needs no layout conversion
            # (its bar.syncs would fence the loads): BLOCK_K < 32 * num_warps (docs/triton.md)
            for k0 in tl.range(kb, K, BLOCK_K, loop_unroll_factor=UNROLL):
                cols = k0 + tl.arange(0, BLOCK_K)
                cm = cols < K
                wv = _gemv_wload(w, w_rs, w_cs, rows, rm, cols, cm, W_CONTIG)
                xv, av = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                     cols, cm, PRO, X_CONTIG, X_ALIGN)
                acc += wv * _gemv_xfn(x, xv, av, rstd, PRO)[None, :]
        elif STAGES <= 1:
            for k0 in range(kb, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                cm = cols < K
                xv, av = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                     cols, cm, PRO, X_CONTIG, X_ALIGN)
                xv = _gemv_xfn(x, xv, av, rstd, PRO)
                wv = _gemv_wload(w, w_rs, w_cs, rows, rm, cols, cm, W_CONTIG)
                acc += wv * xv[None, :]
        else:
            cols = kb + tl.arange(0, BLOCK_K)
            xv, av = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                 cols, cols < K, PRO, X_CONTIG)
            for k0 in tl.range(kb, K, BLOCK_K, num_stages=STAGES):
                cols = k0 + tl.arange(0, BLOCK_K)
                cm = cols < K
                # next iteration's x / a (all masked off after the last block: no traffic)
                xn, an = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                     cols + BLOCK_K, (cols + BLOCK_K) < K, PRO, X_CONTIG)
                f = _gemv_xfn(x, xv, av, rstd, PRO)
                if W_TMA:  # one TMA copy per block; rows >= N and columns >= K arrive as zeros
                    wv = wd.load([n0, k0]).to(tl.float32)
                else:
                    wv = _gemv_wload(w, w_rs, w_cs, rows, rm, cols, cm, W_CONTIG)
                acc += wv * f[None, :]
                xv = xn
                av = an
        out = tl.sum(acc, axis=1)
        if W_PRE > 0:
            if n0 == 0:
                out += pre
        if HAS_BIAS:
            out += tl.load(b + flat_off(rows, b_n1, b_n2, b_s0, b_s1, b_s2), mask=rm, other=0).to(tl.float32)
        yoff = flat_off(rows, y_n1, y_n2, y_s0, y_s1, y_s2)
        store(y + yoff, out, rm)
        if MIRRORS > 0:
            store(y + m1 + yoff, out, rm)
        if MIRRORS > 1:
            store(y + m2 + yoff, out, rm)
        if MIRRORS > 2:
            store(y + m3 + yoff, out, rm)


@device
def gemv_stage(xs, x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, eps, K,
               PRO: tl.constexpr, X_CONTIG: tl.constexpr, X_ALIGN: tl.constexpr, XB: tl.constexpr,
               r=None, KP=1, p_rs=0):
    """The GEMV prologue f(x) for all K columns, stored into the worker's scratch row ``xs``
    (its element type: x's dtype, or fp32; f(x) is already rounded to x's dtype, so both hold
    the same values), between two CTA barriers: before (no thread still reads the previous
    call's f(x)) and after (every element stored before any thread reads it). x (and a) are
    read in chunks of ``XB`` elements; when K fits one chunk they are loaded once and
    RMSNorm's sum of squares comes from the same registers. ``PRO`` and the operands as in
    gemv_ex (PRO_RNORM: x holds the ``KP`` partial rows at row stride ``p_rs``, ``r`` the
    residual)."""
    rstd = tl.full([], 1.0, dtype=tl.float32)
    if K <= XB:  # one chunk: x (and a) loaded once
        cols = tl.arange(0, XB)
        cm = cols < K
        if PRO == PRO_RNORM:
            xv, av = _gemv_xsum(x, p_rs, KP, r, a, cols, cm)
        else:
            xv, av = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2,
                                 cols, cm, PRO, X_CONTIG, X_ALIGN)
        if PRO == PRO_NORM or PRO == PRO_RNORM:
            rstd = tl.rsqrt(tl.sum(xv * xv, axis=0) / K + eps)
        tl.debug_barrier()  # no thread still reads the previous call's f(x)
        tl.store(xs + cols, _gemv_xfn(x, xv, av, rstd, PRO), mask=cm)
    else:
        if PRO == PRO_NORM:  # x^2 in chunks of XB elements
            rstd = _gemv_rstd(x, x_n1, x_n2, x_s0, x_s1, x_s2, K, eps, XB, 1, X_CONTIG, X_ALIGN)
        if PRO == PRO_RNORM:  # h^2 in chunks of XB elements (h summed twice: same values)
            sq = tl.zeros([XB], dtype=tl.float32)
            for k0 in range(0, K, XB):
                cols = k0 + tl.arange(0, XB)
                hv, _ = _gemv_xsum(x, p_rs, KP, r, a, cols, cols < K)
                sq += hv * hv
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        tl.debug_barrier()  # no thread still reads the previous call's f(x)
        for k0 in range(0, K, XB):
            cols = k0 + tl.arange(0, XB)
            cm = cols < K
            if PRO == PRO_RNORM:
                xv, av = _gemv_xsum(x, p_rs, KP, r, a, cols, cm)
            else:
                xv, av = _gemv_xload(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1,
                                     a_s2, cols, cm, PRO, X_CONTIG, X_ALIGN)
            tl.store(xs + cols, _gemv_xfn(x, xv, av, rstd, PRO), mask=cm)
    tl.debug_barrier()  # every f(x) stored before any thread reads it


@device
def gemv_ex(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, eps,
            w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2,
            y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
            PRO: tl.constexpr, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr,
            W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1,
            PROF=None, PROFILE: tl.constexpr = False, X_ALIGN: tl.constexpr = 0, UNROLL: tl.constexpr = 1,
            XS=None, X_STAGE: tl.constexpr = False, x_ready=0, X_CHUNK: tl.constexpr = 0,
            wpre=0, W_PRE: tl.constexpr = 0, ROLL: tl.constexpr = 0, KROLL: tl.constexpr = 0,
            m1=0, m2=0, m3=0, MIRRORS: tl.constexpr = 0, r=None, KP=1, p_rs=0, W_TMA: tl.constexpr = False):
    """y[N] = W[N, K] @ f(x)[K] (+ b), fp32 accumulation, with a fused prologue f (``PRO``):

    * PRO_PLAIN: f(x) = x (gemv; ``a`` and ``eps`` unused).
    * PRO_NORM: f(x) = round(a * (x * rsqrt(mean(x^2) + eps))), a = the RMSNorm weight
      (norm_gemv). Every call first sums x^2 over all K (one pass over x, fp32), then
      streams W; ``round`` is to x's dtype, as the unfused rmsnorm's stored output.
    * PRO_SWIGLU: f(x) = round(silu(x) * a), x = gate, a = up (swiglu_gemv).
    * PRO_RNORM: PRO_NORM of h = round(sum of the ``KP`` rows x[k * p_rs : k * p_rs + K] + r),
      rounded to r's dtype (reduce_norm_gemv: an all-reduce's sum in the consumer's
      prologue). Always staged (X_STAGE or not: ``XS`` must be a scratch row); x, r and a
      contiguous and X_ALIGN > 1.

    ``b`` (HAS_BIAS) is added in the epilogue: the bias of gemv / norm_gemv or the residual
    of gemv_res / swiglu_gemv (y = W @ f(x) + r). Streams W in [BLOCK_N, BLOCK_K] tiles and
    accumulates a 2-D fp32 tile, reduced once per row block, so loads stay wide and
    independent (batch-1 decode is bound by weight bandwidth). ``W_CONTIG``: columns have
    stride 1 (w_cs ignored). ``W_ALIGN`` (0 or a power of two, in elements): the caller
    guarantees w, w_rs and K are multiples of it (16-byte vector loads). ``X_CONTIG``: x
    (and a) have one strided axis. ``X_ALIGN`` (0 or a power of two): x (and a) also have
    unit stride and start on a multiple of X_ALIGN elements (wide loads, no stride
    arithmetic). The epilogue reads b before y is written, row block by
    row block, so y may be b (an in-place residual) but must not overlap x, a or W.
    ``PROFILE``: store %globaltimer at ``PROF + 4`` (prologue done) and ``PROF + 5`` (all
    row blocks stored), the megakernel's profiling stamps (megakernel.PROF_W).
    ``MIRRORS`` (0..3) with element deltas ``m1`` .. ``m3``: y is also stored at ``y + m*``
    (mirror outputs on peer ranks, _gemv_rows).

    ``X_STAGE`` (PRO_NORM / PRO_SWIGLU; ignored for PRO_PLAIN): f(x) is computed once per call,
    for all K, into ``XS`` (scratch of at least K elements of 4 bytes, 16-byte aligned, used
    by this CTA alone), and the weight loop then reads it as a plain aligned vector;
    ``x_ready`` != 0 (runtime): XS already holds this call's f(x) (the caller guarantees
    the same x, a, eps and K as the call that staged it, and x and a unchanged since), so
    the x pass and its barriers are skipped. The x pass reads x (and a) in chunks of
    ``max(BLOCK_N * BLOCK_K, X_CHUNK)`` elements; when K fits one chunk it loads them once
    (PRO_NORM's x^2 sum and f from the same registers: one round trip instead of two, or
    instead of K / chunk dependent ones for a long swiglu x). Without
    it, f is evaluated inside the weight loop by every thread that holds a column, i.e.
    once per row of the block (BLOCK_N times per element: the prologue's multiplies, exp
    and reciprocal then outnumber the FMAs; SASS of the 16 x 128 loop: 747 instructions per
    8 blocks for PRO_NORM, 1387 for PRO_SWIGLU, 364 for PRO_PLAIN). Same values: f(x) is
    stored rounded to x's dtype, exactly what the loop would have used. Two CTA barriers
    per call (before the scratch is overwritten, after it is written). PRO_NORM's x^2 pass
    then reads x in chunks of BLOCK_N * BLOCK_K (fp32 summation order only).

    ``W_PRE`` (0 or a power of two multiple of BLOCK_K, 2 * BLOCK_K for ``UNROLL`` = 2): ``wpre`` is
    W[0:BLOCK_N, 0:W_PRE] already loaded by the caller (gemv_wpre), e.g. before the task's
    waits; the first row block uses it for those columns (its dot product over them is
    summed apart and added at the end: fp32 summation order only).

    ``ROLL`` (row blocks, 0 = off): while streaming row block j, start an L2 prefetch of
    row block j + ROLL, when the rows of W are one contiguous range (W_CONTIG, W_ALIGN and
    a row stride of K; checked here at run time), so a tile of many row blocks streams
    from L2 as a task of one row block does after the kernel's task-ahead prefetch.
    ``KROLL`` (groups of UNROLL x BLOCK_K columns, 0 = off; STAGES = 1 and UNROLL >= 4 only):
    within each row block, prefetch the columns KROLL groups ahead of the loop into L2, one
    128-byte line per thread (W_CONTIG and W_ALIGN; off when a group is shorter than a line
    per row), so a tile of few long rows (the down projection: 16 x 8192) streams from L2
    too; ROLL cannot help a tile of one row block, and the task-ahead prefetch's byte cap
    covers only its first rows. Measured slower on the H200 (docs/triton.md).

    ``STAGES`` (weight-streaming pipeline depth, >= 1; the same arithmetic for every value,
    except that S >= 2 sums PRO_NORM's x^2 in chunks of BLOCK_N * BLOCK_K elements instead of
    BLOCK_K, one round trip for K up to that: fp32 summation order only):

    * 1: each iteration loads its W block and x block and consumes them; the next block's
      loads issue only after that (one block in flight per CTA). ``UNROLL`` = 2: each
      iteration loads two K blocks (both weight loads first), so two blocks are in flight,
      with one accumulator. ``UNROLL`` = 4, 8 or 16: the loop is unrolled by Triton
      (``loop_unroll_factor``) and ptxas hoists the weight loads, UNROLL blocks in flight,
      when BLOCK_K < 32 * num_warps (then x is loaded straight into the layout it is
      broadcast in; a larger x block goes through shared memory, whose bar.syncs stop
      the hoisting). Every value sums the K blocks in the same order: bit-identical.
    * S >= 2: the K loop is ``tl.range(..., num_stages=S)``: Triton's software pipeliner
      turns the W loads into asynchronous global->shared copies (``cp.async.cg``, L1
      bypassed), issued S - 1 blocks ahead, so (S - 1) * BLOCK_N * BLOCK_K weight elements
      are in flight while a block is consumed (Little's law: bytes in flight = bandwidth x
      latency; ~32-64 KB per SM on an H200). Costs (S - 1) blocks of shared memory. The x
      (and a) block for the next iteration is loaded into registers one iteration ahead
      (too narrow per thread for cp.async), so its L2 latency is hidden too. Under the
      interpreter the loop is an ordinary loop.
    * S >= 2 and ``W_TMA``: the same pipeline, but each W block is one tensor-memory-
      accelerator copy through a tensor descriptor made once per call
      (``tl.make_tensor_descriptor`` over W[N, K] with row stride ``w_rs``; rows >= N and
      columns >= K arrive as zeros, so a block may be taller than the tile). The copies are
      issued by one thread and land in shared memory, so the S - 1 blocks in flight hold no
      registers: one 8-warp CTA per SM streamed a bf16 W at 3.3-3.9 TB/s on an H200 with
      64 x 128 blocks and S = 4-6, against 2.0-2.2 TB/s for 16 x 128 register loads unrolled
      8-16 times (``bench/gemv_tma.py``). Needs W_CONTIG, W_ALIGN with a
      16-byte aligned W and row stride, W_PRE = 0, and, on a GPU, a global-scratch allocator
      for the descriptor (``triton.set_allocator``; megakernel runtime). Same arithmetic as
      the S >= 2 loop.
    """
    if W_ALIGN > 1:
        w_rs = aligned(w_rs, W_ALIGN)
        K = aligned(K, W_ALIGN)
    rstd = tl.full([], 1.0, dtype=tl.float32)
    roll_ok = 0
    if ROLL > 0 and W_CONTIG and W_ALIGN > 1:
        roll_ok = (w_rs == K).to(tl.int32)
    KR: tl.constexpr = KROLL if (W_CONTIG and W_ALIGN > 1 and STAGES <= 1 and UNROLL > 2 and
                                 UNROLL * BLOCK_K * (w.dtype.element_ty.primitive_bitwidth // 8) >= 128) else 0
    STAGED: tl.constexpr = (X_STAGE and PRO != PRO_PLAIN) or PRO == PRO_RNORM
    if PRO == PRO_RNORM:
        tl.static_assert(X_ALIGN > 1, "reduce_norm_gemv needs aligned contiguous rows")
        p_rs = aligned(p_rs, X_ALIGN)
    if PRO == PRO_NORM and not STAGED:
        # STAGES >= 2: x in blocks of BLOCK_N * BLOCK_K (the registers of one W block), so a
        # K <= BLOCK_N * BLOCK_K costs one round trip instead of K / BLOCK_K dependent ones
        # (the X_STAGE pass below reads x in such chunks too).
        NB: tl.constexpr = BLOCK_N * BLOCK_K if STAGES > 1 else BLOCK_K
        # unrolled like the W loop: UNROLL x blocks in flight, summed in the same order
        PU: tl.constexpr = 1 if STAGES > 1 else UNROLL
        rstd = _gemv_rstd(x, x_n1, x_n2, x_s0, x_s1, x_s2, K, eps, NB, PU, X_CONTIG, X_ALIGN)
    if STAGED:
        # f(x) once per call into the worker's scratch, instead of once per weight element
        # (each x column is shared by the BLOCK_N rows' threads, which would all compute it)
        xs = tl.multiple_of(XS.to(x.dtype, bitcast=True), 16)  # 16-byte aligned (the caller)
        XA: tl.constexpr = 128 // x.dtype.element_ty.primitive_bitwidth
        XB: tl.constexpr = BLOCK_N * BLOCK_K if BLOCK_N * BLOCK_K > X_CHUNK else X_CHUNK
        if x_ready == 0:
            gemv_stage(xs, x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, eps, K, PRO,
                       X_CONTIG, X_ALIGN, XB, r, KP, p_rs)
        if PROFILE:
            tl.store(PROF + 4, global_timer())
        _gemv_rows(xs, 1, K, 0, 0, 1, xs, 1, K, 0, 0, 1, rstd, w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2,
                   y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K, PRO_PLAIN, HAS_BIAS, True, W_CONTIG,
                   BLOCK_N, BLOCK_K, STAGES, XA, UNROLL, wpre, W_PRE, ROLL, roll_ok, KR, m1, m2, m3, MIRRORS,
                   W_TMA)
    else:
        if PROFILE:
            tl.store(PROF + 4, global_timer())
        _gemv_rows(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, rstd,
                   w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
                   PRO, HAS_BIAS, X_CONTIG, W_CONTIG, BLOCK_N, BLOCK_K, STAGES, X_ALIGN, UNROLL, wpre, W_PRE,
                   ROLL, roll_ok, KR, m1, m2, m3, MIRRORS, W_TMA)
    if PROFILE:
        tl.store(PROF + 5, global_timer())


@device
def gemv(x, x_n1, x_n2, x_s0, x_s1, x_s2, w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2,
         y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
         HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr,
         W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1):
    """y[N] = W[N, K] @ x[K] (+ bias), fp32 accumulation (``gemv_ex`` without prologue)."""
    gemv_ex(x, x_n1, x_n2, x_s0, x_s1, x_s2, x, x_n1, x_n2, x_s0, x_s1, x_s2, 0.0,
            w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
            PRO_PLAIN, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K, STAGES)


@device
def _cos_sin(a):
    if INTERPRET:
        c = tl.cos(a)
        s = tl.sin(a)
    else:
        c = libdevice.cos(a)
        s = libdevice.sin(a)
    return c, s


@device
def rope_cs(f, f_n1, f_n2, f_s0, f_s1, f_s2, j, m, p):
    """cos and sin of ``p * inv_freq[j]`` (fp32; p = float(pos)), HF LlamaRotaryEmbedding."""
    fr = tl.load(f + flat_off(j, f_n1, f_n2, f_s0, f_s1, f_s2), mask=m, other=0).to(tl.float32)
    return _cos_sin(p * fr)


@device
def rope(x, x_n1, x_n2, x_s0, x_s1, x_s2, f, f_n1, f_n2, f_s0, f_s1, f_s2, pos,
         y, y_n1, y_n2, y_s0, y_s1, y_s2, n, head_dim, BLOCK: tl.constexpr):
    """Rotate-half RoPE of each ``head_dim`` slice of x (n elements) at position ``pos``:
    a = float(pos) * inv_freq[j] (fp32), c = cos(a), s = sin(a);
    y[j] = x[j] * c - x[j + d/2] * s, y[j + d/2] = x[j + d/2] * c + x[j] * s
    (HF apply_rotary_pos_emb; reference.py). In place is safe."""
    half = head_dim // 2
    p = pos.to(tl.float32)
    for h in range(0, n // head_dim):
        base = h * head_dim
        for j0 in range(0, half, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < half
            c, s = rope_cs(f, f_n1, f_n2, f_s0, f_s1, f_s2, j, m, p)
            i1 = base + j
            i2 = i1 + half
            x1 = tl.load(x + flat_off(i1, x_n1, x_n2, x_s0, x_s1, x_s2), mask=m, other=0).to(tl.float32)
            x2 = tl.load(x + flat_off(i2, x_n1, x_n2, x_s0, x_s1, x_s2), mask=m, other=0).to(tl.float32)
            store(y + flat_off(i1, y_n1, y_n2, y_s0, y_s1, y_s2), x1 * c + (-x2) * s, m)
            store(y + flat_off(i2, y_n1, y_n2, y_s0, y_s1, y_s2), x2 * c + x1 * s, m)


@device
def _append_rows(k, k_n1, k_n2, k_s0, k_s1, k_s2, dst, d_g, d_d, G, D, BLOCK: tl.constexpr):
    """dst[g, :] = k[g*D:(g+1)*D] for g < G (dst already points at the cache row pos)."""
    for g in range(0, G):
        for d0 in range(0, D, BLOCK):
            d = d0 + tl.arange(0, BLOCK)
            m = d < D
            kv = tl.load(k + flat_off(g * D + d, k_n1, k_n2, k_s0, k_s1, k_s2), mask=m, other=0)
            store(dst + (g * d_g + d * d_d), kv, m)


@device
def kv_append(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, pos,
              kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, G, D, BLOCK: tl.constexpr):
    """kc[g, pos, :] = k[g*D:(g+1)*D], vc[g, pos, :] = v[g*D:(g+1)*D] for g < G.
    ``pos`` is range-checked by the caller."""
    p = pos.to(tl.int64)
    _append_rows(k, k_n1, k_n2, k_s0, k_s1, k_s2, kc + p * kc_t, kc_g, kc_d, G, D, BLOCK)
    _append_rows(v, v_n1, v_n2, v_s0, v_s1, v_s2, vc + p * vc_t, vc_g, vc_d, G, D, BLOCK)


@device
def rope_append(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
                f, f_n1, f_n2, f_s0, f_s1, f_s2, pos,
                kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, G, D, BLOCK: tl.constexpr):
    """kc[g, pos, :] = rope(k[g*D:(g+1)*D], pos), vc[g, pos, :] = v[g*D:(g+1)*D] for g < G
    (rope as in ``rope``, rounded once, to the cache dtype). ``pos`` is range-checked by the
    caller; D is even."""
    p = pos.to(tl.int64)
    pf = pos.to(tl.float32)
    half = D // 2
    kr = kc + p * kc_t
    for g in range(0, G):
        for j0 in range(0, half, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < half
            c, s = rope_cs(f, f_n1, f_n2, f_s0, f_s1, f_s2, j, m, pf)
            i1 = g * D + j
            x1 = tl.load(k + flat_off(i1, k_n1, k_n2, k_s0, k_s1, k_s2), mask=m, other=0).to(tl.float32)
            x2 = tl.load(k + flat_off(i1 + half, k_n1, k_n2, k_s0, k_s1, k_s2), mask=m, other=0).to(tl.float32)
            store(kr + (g * kc_g + j * kc_d), x1 * c + (-x2) * s, m)
            store(kr + (g * kc_g + (j + half) * kc_d), x2 * c + x1 * s, m)
    _append_rows(v, v_n1, v_n2, v_s0, v_s1, v_s2, vc + p * vc_t, vc_g, vc_d, G, D, BLOCK)


@device
def _kv_block(kb, kc_t, kc_d, vb, vc_t, vc_d, t, dd, m, KV_ALIGN: tl.constexpr):
    """One [positions, head dim] block of the K and V caches in their own dtype (attention)."""
    if KV_ALIGN > 1:
        kt = tl.load(kb + t[:, None] * kc_t + dd[None, :], mask=m, other=0)
        vt = tl.load(vb + t[:, None] * vc_t + dd[None, :], mask=m, other=0)
    else:
        kt = tl.load(kb + t[:, None] * kc_t + dd[None, :] * kc_d, mask=m, other=0)
        vt = tl.load(vb + t[:, None] * vc_t + dd[None, :] * vc_d, mask=m, other=0)
    return kt, vt


@device
def attention(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, pos,
              o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale,
              f, f_n1, f_n2, f_s0, f_s1, f_s2, ROPE: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, DOT: tl.constexpr = False,
              KV_ALIGN: tl.constexpr = 0,
              k=None, k_n1=1, k_n2=1, k_s0=0, k_s1=0, k_s2=1, v=None, v_n1=1, v_n2=1, v_s0=0, v_s1=0, v_s2=1,
              KV_NEW: tl.constexpr = False):
    """Decode GQA attention over cache positions 0..pos (inclusive), fp32:
    for query head h < HQ (q is [HQ, D]) and g = h // (HQ / G):
    o[h] = softmax(q[h] . kc[g, :pos+1]^T * scale) @ vc[g, :pos+1].

    ``ROPE`` (rope_attention): q is first rotated by RoPE at ``pos`` with frequencies
    ``f`` (inv_freq[D/2]) and rounded to q's dtype, the value the unfused rope op would
    have stored; otherwise ``f`` is unused.

    ``KV_NEW`` (rope_attention_kv; needs ``ROPE``): position ``pos`` takes its key from
    rope(k[g*D:(g+1)*D]) rounded to the K cache's dtype and its value from v[g*D:(g+1)*D]
    rounded to the V cache's dtype (what rope_append stores in row pos); the caches are
    read at positions 0 .. pos-1 only.

    The HQ/G query heads of one kv head are processed together (the cache is read once per
    kv head), with an online softmax (running max and sum) over BLOCK_T positions at a time.
    Requires D <= BLOCK_D and HQ/G <= BLOCK_Q; ``pos`` is range-checked by the caller.

    ``DOT``: the scores q . K^T and the update p @ V are ``tl.dot`` products in full fp32
    (``input_precision="ieee"``) instead of broadcast products reduced over a [Q, T, D]
    tensor: the same fp32 arithmetic in another summation order, with registers for
    [Q, T] and [T, D] tiles only, so BLOCK_T can be 4x larger at the same register cost
    (fewer serial position blocks on long contexts). Needs BLOCK_Q, BLOCK_T, BLOCK_D >= 16
    (tl.dot's minimum; padded lanes are masked).

    The K and V blocks of positions t0 + BLOCK_T .. are loaded (in the cache dtype) before
    the block t0 is reduced, so each block's load latency overlaps the previous block's
    arithmetic instead of adding up over the context (the same values, bit-identical).
    ``KV_ALIGN`` (0 or elements per 16 bytes): the caches have unit head-dim stride and
    ``kc``, ``vc``, their head and position strides are multiples of it (the table's
    ``kvaligned`` flag), so the loads are 16-byte vectors."""
    grp = HQ // G
    T = pos + 1
    qh = tl.arange(0, BLOCK_Q)
    dd = tl.arange(0, BLOCK_D)
    qm = qh < grp
    dm = dd < D
    if ROPE:
        half = D // 2
        lo = dd < half
        pd = tl.where(lo, dd + half, dd - half)  # the rotate-half partner of each lane
        c, s = rope_cs(f, f_n1, f_n2, f_s0, f_s1, f_s2, tl.where(lo, dd, dd - half), dm, pos.to(tl.float32))
        s = tl.where(lo, -s, s)
    if KV_NEW:
        TC = pos  # cache rows read; row pos comes from k and v
    else:
        TC = T
    for g in range(0, G):
        qi = (g * grp + qh)[:, None] * D + dd[None, :]
        qmask = qm[:, None] & dm[None, :]
        qv = tl.load(q + flat_off(qi, q_n1, q_n2, q_s0, q_s1, q_s2), mask=qmask, other=0).to(tl.float32)
        if ROPE:
            qpi = (g * grp + qh)[:, None] * D + pd[None, :]
            qp = tl.load(q + flat_off(qpi, q_n1, q_n2, q_s0, q_s1, q_s2), mask=qmask, other=0).to(tl.float32)
            qv = round_as(qv * c[None, :] + qp * s[None, :], q.dtype.element_ty)
        if KV_NEW:
            kl = tl.load(k + flat_off(g * D + dd, k_n1, k_n2, k_s0, k_s1, k_s2), mask=dm, other=0).to(tl.float32)
            kp = tl.load(k + flat_off(g * D + pd, k_n1, k_n2, k_s0, k_s1, k_s2), mask=dm, other=0).to(tl.float32)
            knew = round_as(kl * c + kp * s, kc.dtype.element_ty)
            vl = tl.load(v + flat_off(g * D + dd, v_n1, v_n2, v_s0, v_s1, v_s2), mask=dm, other=0).to(tl.float32)
            vnew = round_as(vl, vc.dtype.element_ty)
        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
        if KV_ALIGN > 1:
            kc_g = aligned(kc_g, KV_ALIGN)
            kc_t = aligned(kc_t, KV_ALIGN)
            vc_g = aligned(vc_g, KV_ALIGN)
            vc_t = aligned(vc_t, KV_ALIGN)
            kc_d = 1
            vc_d = 1
        kb = kc + g * kc_g
        vb = vc + g * vc_g
        # V issued with K (before the score reductions' barriers): one round trip, not two
        tn = tl.arange(0, BLOCK_T)
        knext, vnext = _kv_block(kb, kc_t, kc_d, vb, vc_t, vc_d, tn, dd, (tn < TC)[:, None] & dm[None, :], KV_ALIGN)
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < T
            kt = knext.to(tl.float32)
            vt = vnext.to(tl.float32)
            if KV_NEW:
                cur = (t == pos)[:, None]
                kt = tl.where(cur, knew[None, :], kt)
                vt = tl.where(cur, vnew[None, :], vt)
            tn = t + BLOCK_T  # the next block's loads (all masked off after the last: no traffic)
            knext, vnext = _kv_block(kb, kc_t, kc_d, vb, vc_t, vc_d, tn, dd, (tn < TC)[:, None] & dm[None, :],
                                     KV_ALIGN)
            if DOT:
                sc = tl.dot(qv, tl.trans(kt), input_precision="ieee") * scale  # [BQ, BT]
            else:
                sc = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale  # [BQ, BT]
            sc = tl.where(tm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            if DOT:
                acc = acc * alpha[:, None] + tl.dot(pr, vt, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * vt[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        store(o + flat_off(qi, o_n1, o_n2, o_s0, o_s1, o_s2), out, qmask)


@device
def silu_mul(g, g_n1, g_n2, g_s0, g_s1, g_s2, u, u_n1, u_n2, u_s0, u_s1, u_s2,
             y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr):
    """y = silu(g) * u = g * sigmoid(g) * u (fp32)."""
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        gv = tl.load(g + flat_off(i, g_n1, g_n2, g_s0, g_s1, g_s2), mask=m, other=0).to(tl.float32)
        uv = tl.load(u + flat_off(i, u_n1, u_n2, u_s0, u_s1, u_s2), mask=m, other=0).to(tl.float32)
        r = gv / (1.0 + tl.exp(-gv)) * uv
        store(y + flat_off(i, y_n1, y_n2, y_s0, y_s1, y_s2), r, m)


@device
def add(a, a_n1, a_n2, a_s0, a_s1, a_s2, b, b_n1, b_n2, b_s0, b_s1, b_s2,
        y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr):
    """y = a + b (fp32)."""
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        av = tl.load(a + flat_off(i, a_n1, a_n2, a_s0, a_s1, a_s2), mask=m, other=0).to(tl.float32)
        bv = tl.load(b + flat_off(i, b_n1, b_n2, b_s0, b_s1, b_s2), mask=m, other=0).to(tl.float32)
        store(y + flat_off(i, y_n1, y_n2, y_s0, y_s1, y_s2), av + bv, m)


@device
def reduce(p, p_rs, p_cs, KP, r, r_n1, r_n2, r_s0, r_s1, r_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n,
           HAS_RES: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr = 0):
    """y = ((P[0] + P[1]) + ...) + P[KP-1] (+ residual), partials P[KP, n], summed in index
    order in fp32 like reference.py. ``VEC`` > 0 (table flag ``vec``): every row of P, the
    residual and y are contiguous, start on a multiple of ``VEC`` elements (16 bytes) and
    ``n`` is one too, so the loads and stores are 16-byte vectors (the caller aligned the
    pointers; the generic strided addressing moved 2 bytes per access)."""
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
            pi = i * p_cs
            yi = flat_off(i, y_n1, y_n2, y_s0, y_s1, y_s2)
        acc = _sum_rows(p, p_rs, KP, pi, m)
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


@device
def copy(x, x_n1, x_n2, x_s0, x_s1, x_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr,
         VEC: tl.constexpr = 0):
    """y = x converted to y's dtype (round to nearest even). Also the body of ``put``: the
    destination pointer may address a peer's memory. ``VEC`` > 0 (table flag ``vec``): both
    regions are contiguous, start on a multiple of ``VEC`` elements and ``n`` is one too, so
    the accesses are 16-byte vectors (the caller aligned the pointers). The generic strided
    path moves 2 bytes per access: an 8 KB put to a peer takes 8 us at tp 2 on H200s."""
    if VEC > 0:
        n = aligned(n, VEC)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        if VEC > 0:  # plain i, so Triton's analysis sees the contiguity
            xi = i
            yi = i
        else:
            xi = flat_off(i, x_n1, x_n2, x_s0, x_s1, x_s2)
            yi = flat_off(i, y_n1, y_n2, y_s0, y_s1, y_s2)
        store(y + yi, tl.load(x + xi, mask=m, other=0), m)


@device
def system_fence():
    """``fence.acq_rel.sys``: orders this thread's earlier memory operations (including stores
    to peer GPUs) before its later ones at system scope. Used for ``quiet`` and ``fence``
    (nvshmem_quiet / nvshmem_fence for peer-pointer puts; stronger than fence needs). A
    no-op under the interpreter, which runs one program at a time."""
    if not INTERPRET:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


def thread0_asm(body: str) -> str:
    """PTX running ``body`` (instructions predicated with ``@%amk_q``) on thread 0 only, with a
    dummy int32 output ``$0``: Triton runs a scalar inline asm in every thread, so a
    read-modify-write must be predicated or it would be applied once per thread."""
    return ("{\n.reg .pred %amk_q;\n.reg .u32 %amk_t;\nmov.u32 %amk_t, %tid.x;\n"
            "setp.eq.u32 %amk_q, %amk_t, 0;\n" + body + "mov.u32 $0, 0;\n}")


_ASM_FENCE_SYS_ONE = tl.constexpr(thread0_asm("@%amk_q fence.acq_rel.sys;\n"))
_ASM_RED_RELAXED_SYS_ONE = tl.constexpr(thread0_asm("@%amk_q red.relaxed.sys.global.add.s32 [$1], $2;\n"))


@device
def system_fence_one():
    """``fence.acq_rel.sys`` on thread 0 only. After a CTA barrier it orders the whole CTA's
    earlier stores (peer stores included) before thread 0's later operations at system scope,
    the way NVSHMEM's block-scoped put-with-signal fences once per block. A no-op under the
    interpreter."""
    if not INTERPRET:
        tl.inline_asm_elementwise(_ASM_FENCE_SYS_ONE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@device
def red_relaxed_sys_one(ptr, amount):
    """``*ptr += amount`` as ``red.relaxed.sys`` on thread 0 only: after system_fence_one on the
    same thread it is a release at system scope (PTX memory model: a fence followed by a strong
    write is a release pattern), and several such signals do not wait for one another as
    successive ``red.release.sys`` do (each release orders itself after the earlier remote
    reduction). Interpreter: a plain atomic add."""
    if INTERPRET:
        tl.atomic_add(ptr, amount)
    else:
        tl.inline_asm_elementwise(_ASM_RED_RELAXED_SYS_ONE, "=r,l,r", [ptr, amount], dtype=tl.int32,
                                  is_pure=False, pack=1)


# ---------------------------------------------------------------- standalone test kernels
@triton.jit
def _k_embed(tab, t_rs, t_cs, tokp, y, y_n1, y_n2, y_s0, y_s1, y_s2, H, BLOCK: tl.constexpr):
    embed(tab, t_rs, t_cs, tl.load(tokp), y, y_n1, y_n2, y_s0, y_s1, y_s2, H, BLOCK)


@triton.jit
def _k_rmsnorm(x, x_n1, x_n2, x_s0, x_s1, x_s2, w, w_n1, w_n2, w_s0, w_s1, w_s2,
               y, y_n1, y_n2, y_s0, y_s1, y_s2, n, dim, eps, BLOCK: tl.constexpr):
    rmsnorm(x, x_n1, x_n2, x_s0, x_s1, x_s2, w, w_n1, w_n2, w_s0, w_s1, w_s2,
            y, y_n1, y_n2, y_s0, y_s1, y_s2, n, dim, eps, BLOCK)


@triton.jit
def _k_gemv(x, x_n1, x_n2, x_s0, x_s1, x_s2, w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2,
            y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr,
            W_CONTIG: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GEMV_STAGES: tl.constexpr = 1):
    gemv(x, x_n1, x_n2, x_s0, x_s1, x_s2, w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2,
         y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K,
         GEMV_STAGES)


@triton.jit
def _k_gemv_ex(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, eps,
               w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
               PRO: tl.constexpr, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr,
               W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GEMV_STAGES: tl.constexpr = 1,
               XS=None, X_STAGE: tl.constexpr = False, UNROLL: tl.constexpr = 1):
    gemv_ex(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, eps,
            w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
            PRO, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K, GEMV_STAGES, UNROLL=UNROLL,
            XS=XS, X_STAGE=X_STAGE)


@triton.jit
def _k_rope_append(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
                   f, f_n1, f_n2, f_s0, f_s1, f_s2, posp,
                   kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, G, D, BLOCK: tl.constexpr):
    rope_append(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
                f, f_n1, f_n2, f_s0, f_s1, f_s2, tl.load(posp),
                kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, G, D, BLOCK)


@triton.jit
def _k_rope(x, x_n1, x_n2, x_s0, x_s1, x_s2, f, f_n1, f_n2, f_s0, f_s1, f_s2, posp,
            y, y_n1, y_n2, y_s0, y_s1, y_s2, n, head_dim, BLOCK: tl.constexpr):
    rope(x, x_n1, x_n2, x_s0, x_s1, x_s2, f, f_n1, f_n2, f_s0, f_s1, f_s2, tl.load(posp),
         y, y_n1, y_n2, y_s0, y_s1, y_s2, n, head_dim, BLOCK)


@triton.jit
def _k_kv_append(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, posp,
                 kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, G, D, BLOCK: tl.constexpr):
    kv_append(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, tl.load(posp),
              kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, G, D, BLOCK)


@triton.jit
def _k_attention(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, posp,
                 o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale, f, f_n1, f_n2, f_s0, f_s1, f_s2,
                 ROPE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr,
                 DOT: tl.constexpr = False, k=None, k_n1=1, k_n2=1, k_s0=0, k_s1=0, k_s2=1,
                 v=None, v_n1=1, v_n2=1, v_s0=0, v_s1=0, v_s2=1, KV_NEW: tl.constexpr = False):
    attention(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, tl.load(posp),
              o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale, f, f_n1, f_n2, f_s0, f_s1, f_s2, ROPE,
              BLOCK_T, BLOCK_D, BLOCK_Q, DOT, 0, k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
              KV_NEW)


@triton.jit
def _k_silu_mul(g, g_n1, g_n2, g_s0, g_s1, g_s2, u, u_n1, u_n2, u_s0, u_s1, u_s2,
                y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr):
    silu_mul(g, g_n1, g_n2, g_s0, g_s1, g_s2, u, u_n1, u_n2, u_s0, u_s1, u_s2,
             y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK)


@triton.jit
def _k_add(a, a_n1, a_n2, a_s0, a_s1, a_s2, b, b_n1, b_n2, b_s0, b_s1, b_s2,
           y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr):
    add(a, a_n1, a_n2, a_s0, a_s1, a_s2, b, b_n1, b_n2, b_s0, b_s1, b_s2,
        y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK)


@triton.jit
def _k_reduce(p, p_rs, p_cs, KP, r, r_n1, r_n2, r_s0, r_s1, r_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n,
              HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    reduce(p, p_rs, p_cs, KP, r, r_n1, r_n2, r_s0, r_s1, r_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n,
           HAS_RES, BLOCK)


@triton.jit
def _k_argmax(x, x_n1, x_n2, x_s0, x_s1, x_s2, n, offset, y, y_n1, y_n2, y_s0, y_s1, y_s2,
              BLOCK: tl.constexpr):
    argmax(x, x_n1, x_n2, x_s0, x_s1, x_s2, n, offset, y, y_n1, y_n2, y_s0, y_s1, y_s2, BLOCK)


@triton.jit
def _k_argmax_combine(p, p_rs, p_cs, KP, tok, BLOCK: tl.constexpr):
    argmax_combine(p, p_rs, p_cs, KP, tok, BLOCK)


@triton.jit
def _k_copy(x, x_n1, x_n2, x_s0, x_s1, x_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr):
    copy(x, x_n1, x_n2, x_s0, x_s1, x_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK)


# ---------------------------------------------------------------- host launchers (tests)
def flat_desc(t) -> tuple[int, int, int, int, int]:
    """(n1, n2, s0, s1, s2) of a torch tensor view seen as a flat vector (``flat_off``).

    Unit axes are dropped and contiguous neighbours merged until at most 3 axes remain;
    raises ValueError for a view that needs more than 3 strided axes."""
    from lowering.triton.table import _merge, _pad3

    axes = [(int(n), int(s)) for n, s in zip(t.shape, t.stride()) if n != 1] or [(1, 0)]
    m = _merge(axes, 3)
    if m is None:
        raise ValueError(f"tensor view {tuple(t.shape)} / {t.stride()} needs more than 3 strided axes")
    n, s = _pad3(m)
    return n[1], n[2], s[0], s[1], s[2]


def _matrix(t) -> tuple[int, int, int, int]:
    """(rows, cols, row stride, col stride) of a 2-D view."""
    if t.dim() != 2:
        raise ValueError(f"expected a 2-D view, got shape {tuple(t.shape)}")
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def _cache(t) -> tuple[int, int, int, int, int, int]:
    """(G, S, D, stride G, stride S, stride D) of a 3-D cache view."""
    if t.dim() != 3:
        raise ValueError(f"expected a [G, S, D] view, got shape {tuple(t.shape)}")
    return (*t.shape, *t.stride())


_EW = 256  # elementwise block of the standalone launchers (small: the interpreter is slow)


def run_embed(table, token, y, block: int = _EW) -> None:
    """y = table[token] (table a [V, H] view, token a 1-element int32 tensor). The caller
    checks the token range (the megakernel does)."""
    _, h, rs, cs = _matrix(table)
    _k_embed[(1,)](table, rs, cs, token, y, *flat_desc(y), h, BLOCK=block)


def run_rmsnorm(x, w, y, dim: int, eps: float, block: int = _EW) -> None:
    _k_rmsnorm[(1,)](x, *flat_desc(x), w, *flat_desc(w), y, *flat_desc(y), x.numel(), dim, eps,
                     BLOCK=block)


def run_gemv(x, w, y, bias=None, block_n: int = 16, block_k: int = 64, w_align: int = 0,
             stages: int = 1) -> None:
    """y = w @ x (+ bias); w a [N, K] view (any strides); ``stages``: gemv_ex's STAGES."""
    n, k, rs, cs = _matrix(w)
    b = bias if bias is not None else y
    xd = flat_desc(x)
    _k_gemv[(1,)](x, *xd, w, rs, cs, b, *flat_desc(b), y, *flat_desc(y), n, k,
                  HAS_BIAS=bias is not None, X_CONTIG=(xd[0] == 1 and xd[2] == 0 and xd[3] == 0),
                  W_CONTIG=cs == 1, W_ALIGN=w_align, BLOCK_N=block_n, BLOCK_K=block_k, GEMV_STAGES=stages)


def _xcontig(*descs) -> bool:
    return all(d[0] == 1 and d[2] == 0 and d[3] == 0 for d in descs)


def run_gemv_ex(x, a, w, y, pro: int, eps: float = 0.0, bias=None, block_n: int = 16,
                block_k: int = 64, w_align: int = 0, stages: int = 1, x_stage: bool = False,
                unroll: int = 1) -> None:
    """y = w @ f(x) (+ bias) with prologue ``pro`` (PRO_NORM: a = norm weight; PRO_SWIGLU:
    x = gate, a = up); see ``gemv_ex`` (``stages``: its STAGES; ``x_stage``: X_STAGE, with a
    scratch of K fp32 allocated here; ``unroll``: UNROLL). norm_gemv, gemv_res and
    swiglu_gemv in one."""
    n, k, rs, cs = _matrix(w)
    b = bias if bias is not None else y
    xd, ad = flat_desc(x), flat_desc(a)
    _k_gemv_ex[(1,)](x, *xd, a, *ad, eps, w, rs, cs, b, *flat_desc(b), y, *flat_desc(y), n, k,
                     PRO=pro, HAS_BIAS=bias is not None, X_CONTIG=_xcontig(xd, ad), W_CONTIG=cs == 1,
                     W_ALIGN=w_align, BLOCK_N=block_n, BLOCK_K=block_k, GEMV_STAGES=stages,
                     XS=y.new_zeros(max(16, k)).float(), X_STAGE=x_stage,
                     UNROLL=unroll)


def run_rope_append(k, v, inv_freq, pos, kc, vc, block: int = 64) -> None:
    g, _, d, *kst = _cache(kc)
    _, _, _, *vst = _cache(vc)
    _k_rope_append[(1,)](k, *flat_desc(k), v, *flat_desc(v), inv_freq, *flat_desc(inv_freq), pos,
                         kc, *kst, vc, *vst, g, d, BLOCK=block)


def run_rope(x, inv_freq, pos, y, head_dim: int, block: int = 64) -> None:
    _k_rope[(1,)](x, *flat_desc(x), inv_freq, *flat_desc(inv_freq), pos, y, *flat_desc(y), x.numel(),
                  head_dim, BLOCK=block)


def run_kv_append(k, v, pos, kc, vc, block: int = 64) -> None:
    g, _, d, *kst = _cache(kc)
    _, _, _, *vst = _cache(vc)
    _k_kv_append[(1,)](k, *flat_desc(k), v, *flat_desc(v), pos, kc, *kst, vc, *vst, g, d, BLOCK=block)


def run_attention(q, kc, vc, pos, o, scale: float, block_t: int = 16, inv_freq=None, dot: bool = False,
                  kv_new=None) -> None:
    """attention, or rope_attention when ``inv_freq`` is given (``dot``: attention's DOT,
    blocks raised to tl.dot's minimum of 16); with ``kv_new`` = (k, v) as well,
    rope_attention_kv."""
    if kv_new is not None and inv_freq is None:
        raise ValueError("run_attention: kv_new (rope_attention_kv) needs inv_freq")
    g, _, d, *kst = _cache(kc)
    _, _, _, *vst = _cache(vc)
    hq = q.numel() // d
    f = inv_freq if inv_freq is not None else q
    kn, vn = kv_new if kv_new is not None else (q, q)
    lo = 16 if dot else 1
    _k_attention[(1,)](q, *flat_desc(q), kc, *kst, vc, *vst, pos, o, *flat_desc(o), hq, g, d, scale,
                       f, *flat_desc(f), ROPE=inv_freq is not None, BLOCK_T=max(lo, block_t),
                       BLOCK_D=max(lo, triton.next_power_of_2(d)),
                       BLOCK_Q=max(lo, triton.next_power_of_2(max(1, hq // g))), DOT=dot,
                       k=kn, **dict(zip(("k_n1", "k_n2", "k_s0", "k_s1", "k_s2"), flat_desc(kn))),
                       v=vn, **dict(zip(("v_n1", "v_n2", "v_s0", "v_s1", "v_s2"), flat_desc(vn))),
                       KV_NEW=kv_new is not None)


def run_silu_mul(g, u, y, block: int = _EW) -> None:
    _k_silu_mul[(1,)](g, *flat_desc(g), u, *flat_desc(u), y, *flat_desc(y), y.numel(), BLOCK=block)


def run_add(a, b, y, block: int = _EW) -> None:
    _k_add[(1,)](a, *flat_desc(a), b, *flat_desc(b), y, *flat_desc(y), y.numel(), BLOCK=block)


def run_reduce(p, y, residual=None, block: int = _EW) -> None:
    kp, _, rs, cs = _matrix(p)
    r = residual if residual is not None else y
    _k_reduce[(1,)](p, rs, cs, kp, r, *flat_desc(r), y, *flat_desc(y), y.numel(),
                    HAS_RES=residual is not None, BLOCK=block)


def run_argmax(x, y, offset: int, block: int = _EW) -> None:
    _k_argmax[(1,)](x, *flat_desc(x), x.numel(), offset, y, *flat_desc(y), BLOCK=block)


def run_argmax_combine(pairs, tok, block: int = 16) -> None:
    kp, _, rs, cs = _matrix(pairs)
    _k_argmax_combine[(1,)](pairs, rs, cs, kp, tok, BLOCK=block)


def run_copy(x, y, block: int = _EW) -> None:
    _k_copy[(1,)](x, *flat_desc(x), y, *flat_desc(y), y.numel(), BLOCK=block)
