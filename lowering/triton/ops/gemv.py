"""The GEMV family: ``gemv``, ``norm_gemv``, ``gemv_res``, ``swiglu_gemv``, ``reduce_norm_gemv``.

y[N] = W[N, K] @ f(x)[K] (+ b), fp32 accumulation, one function for the five ops: a fused
*prologue* f (``PRO``), a *streaming core* (``gemv_stream``: W in [BLOCK_N, BLOCK_K] blocks
into a 2-D fp32 accumulator reduced once per row block, so loads stay wide and independent;
batch-1 decode is bound by weight bandwidth) with one K-loop form per pipelining scheme, and
an *epilogue* (``gemv_epilogue``: the bias or residual b added, y stored rounded to its dtype,
and at the mirror outputs). ``gemv_ex`` composes them; ``t_gemv`` is the row decoder, which
also runs the row's waits and, on the weight ring (ring.py), hands W to ``ring.gemv_ring``.

Prologues (``PRO``):

* PRO_PLAIN: f(x) = x (gemv, gemv_res).
* PRO_NORM: f(x) = round(a * (x * rsqrt(mean(x^2) + eps))), a = the RMSNorm weight
  (norm_gemv); ``round`` is to x's dtype, as the unfused rmsnorm's stored output. The x^2
  sum over all K (one pass over x, fp32) runs before W streams (``gemv_rstd``).
* PRO_SWIGLU: f(x) = round(silu(x) * a), x = gate, a = up (swiglu_gemv).
* PRO_RNORM: PRO_NORM of h = round(sum of the ``KP`` rows x[k * p_rs : k * p_rs + K] + r),
  rounded to r's dtype (reduce_norm_gemv: an all-reduce's sum in the consumer's prologue).
  Always staged (``gemv_stage``); x, r and a contiguous and X_ALIGN > 1.

The epilogue's ``b`` (HAS_BIAS) is the bias of gemv / norm_gemv / reduce_norm_gemv or the
residual of gemv_res / swiglu_gemv (y = W @ f(x) + r). It reads b before y is written, row
block by row block, so y may be b (an in-place residual) but must not overlap x, a or W.

Operands are tuples: a *flat* operand ``(p, n1, n2, s0, s1, s2)`` (lang.py's conventions),
the weight ``w = (p, row stride, column stride)``; ``p`` carries the dtype.
"""

from __future__ import annotations

import triton.language as tl

from ir.program import DTYPE_BYTES, QUANT_DTYPES
from lowering.quant import Q8_0_GROUP
from lowering.triton import layout as L
from lowering.triton import ring as RG
from lowering.triton.lang import INTERPRET, aligned, device, flat_off, global_timer, l2_prefetch_bytes
from lowering.triton.lang import round_as, store_mirrored
from lowering.triton.layout import DECODER_ARGS, GemvRoles, OpLowering, TableError, Variant, tl_dtypes
from lowering.triton.ops.reduce import sum_rows
from lowering.triton.vm import arena_ptr, fail_page, operand, operand_off, param_f, run_waits, status_ok

#: gemv prologue modes (``PRO``): plain x; RMSNorm of x times a (norm_gemv); silu(x) * a
#: (swiglu_gemv, x = gate, a = up); RMSNorm times a of the sum of the partial rows x plus a
#: residual (reduce_norm_gemv).
PRO_PLAIN = tl.constexpr(0)
PRO_NORM = tl.constexpr(1)
PRO_SWIGLU = tl.constexpr(2)
PRO_RNORM = tl.constexpr(3)


# ---------------------------------------------------------------- prologue: f(x)
@device
def _gemv_xsum(x, p_rs, KP, r, a, cols, cm):
    """reduce_norm_gemv's raw inputs at ``cols`` (fp32): h = ((P[0] + P[1]) + ...) + r, the
    partial rows x[k * p_rs + cols] summed in reduce's order and rounded to r's dtype (what
    a reduce stores), and the norm weight a. Rows, r and a contiguous and 16-byte aligned
    (the caller's hints; the variant's flags check it). ``x``, ``r``, ``a``: pointers."""
    acc = sum_rows(x, p_rs, KP, cols, cm)
    acc += tl.load(r + cols, mask=cm, other=0).to(tl.float32)
    return round_as(acc, r.dtype.element_ty), tl.load(a + cols, mask=cm, other=0).to(tl.float32)


@device
def _gemv_xload(x, a, cols, cm, PRO: tl.constexpr, X_CONTIG: tl.constexpr, X_ALIGN: tl.constexpr = 0):
    """The raw GEMV inputs at ``cols`` as fp32: (x, a); a is x itself for PRO_PLAIN.
    ``x``, ``a``: flat operands; ``X_CONTIG`` (one strided axis) and ``X_ALIGN`` (unit
    stride, start a multiple of X_ALIGN elements) as gemv_ex's."""
    xp, x_n1, x_n2, x_s0, x_s1, x_s2 = x
    ap, a_n1, a_n2, a_s0, a_s1, a_s2 = a
    if X_ALIGN > 1:
        xv = tl.load(xp + cols, mask=cm, other=0).to(tl.float32)
        av = xv
        if PRO != PRO_PLAIN:
            av = tl.load(ap + cols, mask=cm, other=0).to(tl.float32)
        return xv, av
    if X_CONTIG:
        xv = tl.load(xp + cols * x_s2, mask=cm, other=0).to(tl.float32)
    else:
        xv = tl.load(xp + flat_off(cols, x_n1, x_n2, x_s0, x_s1, x_s2), mask=cm, other=0).to(tl.float32)
    av = xv
    if PRO != PRO_PLAIN:
        if X_CONTIG:
            av = tl.load(ap + cols * a_s2, mask=cm, other=0).to(tl.float32)
        else:
            av = tl.load(ap + flat_off(cols, a_n1, a_n2, a_s0, a_s1, a_s2), mask=cm, other=0).to(tl.float32)
    return xv, av


@device
def _gemv_xfn(x, xv, av, rstd, PRO: tl.constexpr):
    """The fused prologue f on loaded values: xv itself, or f(xv, av) rounded to x's dtype
    (what the unfused rmsnorm / silu_mul would have stored). ``x`` (a pointer) only gives
    the dtype."""
    if PRO == PRO_NORM or PRO == PRO_RNORM:
        xv = round_as(av * (xv * rstd), x.dtype.element_ty)
    elif PRO == PRO_SWIGLU:
        xv = round_as(xv / (1.0 + tl.exp(-xv)) * av, x.dtype.element_ty)
    return xv


@device
def gemv_rstd(x, K, eps, NB: tl.constexpr, PU: tl.constexpr, X_CONTIG: tl.constexpr, X_ALIGN: tl.constexpr):
    """RMSNorm's 1 / sqrt(mean(x^2) + eps) over the flat operand x[0:K] (fp32), x read in
    chunks of NB elements (PU chunks unrolled), the squares summed per lane then across
    lanes."""
    sq = tl.zeros([NB], dtype=tl.float32)
    for k0 in tl.range(0, K, NB, loop_unroll_factor=PU):
        cols = k0 + tl.arange(0, NB)
        xv, _ = _gemv_xload(x, x, cols, cols < K, PRO_PLAIN, X_CONTIG, X_ALIGN)
        sq += xv * xv
    return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)


@device
def gemv_stage(xs, x, a, eps, K, PRO: tl.constexpr, X_CONTIG: tl.constexpr, X_ALIGN: tl.constexpr,
               XB: tl.constexpr, r=None, KP=1, p_rs=0):
    """The GEMV prologue f(x) for all K columns, stored into the worker's scratch row ``xs``
    (its element type: x's dtype, or fp32; f(x) is already rounded to x's dtype, so both hold
    the same values), between two CTA barriers: before (no thread still reads the previous
    call's f(x)) and after (every element stored before any thread reads it). x (and a) are
    read in chunks of ``XB`` elements; when K fits one chunk they are loaded once and
    RMSNorm's sum of squares comes from the same registers. ``PRO`` and the flat operands
    ``x``, ``a`` as in gemv_ex (PRO_RNORM: x holds the ``KP`` partial rows at row stride
    ``p_rs``, ``r`` points at the residual)."""
    rstd = tl.full([], 1.0, dtype=tl.float32)
    xp = x[0]
    if K <= XB:  # one chunk: x (and a) loaded once
        cols = tl.arange(0, XB)
        cm = cols < K
        if PRO == PRO_RNORM:
            xv, av = _gemv_xsum(xp, p_rs, KP, r, a[0], cols, cm)
        else:
            xv, av = _gemv_xload(x, a, cols, cm, PRO, X_CONTIG, X_ALIGN)
        if PRO == PRO_NORM or PRO == PRO_RNORM:
            rstd = tl.rsqrt(tl.sum(xv * xv, axis=0) / K + eps)
        tl.debug_barrier()  # no thread still reads the previous call's f(x)
        tl.store(xs + cols, _gemv_xfn(xp, xv, av, rstd, PRO), mask=cm)
    else:
        if PRO == PRO_NORM:  # x^2 in chunks of XB elements
            rstd = gemv_rstd(x, K, eps, XB, 1, X_CONTIG, X_ALIGN)
        if PRO == PRO_RNORM:  # h^2 in chunks of XB elements (h summed twice: same values)
            sq = tl.zeros([XB], dtype=tl.float32)
            for k0 in range(0, K, XB):
                cols = k0 + tl.arange(0, XB)
                hv, _ = _gemv_xsum(xp, p_rs, KP, r, a[0], cols, cols < K)
                sq += hv * hv
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
        tl.debug_barrier()  # no thread still reads the previous call's f(x)
        for k0 in range(0, K, XB):
            cols = k0 + tl.arange(0, XB)
            cm = cols < K
            if PRO == PRO_RNORM:
                xv, av = _gemv_xsum(xp, p_rs, KP, r, a[0], cols, cm)
            else:
                xv, av = _gemv_xload(x, a, cols, cm, PRO, X_CONTIG, X_ALIGN)
            tl.store(xs + cols, _gemv_xfn(xp, xv, av, rstd, PRO), mask=cm)
    tl.debug_barrier()  # every f(x) stored before any thread reads it


# ---------------------------------------------------------------- streaming core
@device
def _wload(p, mask):
    """W's elements at ``p`` in W's dtype, zeros where not ``mask``. A float8e4nv W is read
    as int8 bytes (a zero of that width) and reinterpreted (the masked load's ``other``
    cannot be an fp8 constant under the interpreter). The loads carry an L2 evict-first
    policy (``createpolicy.fractional.L2::evict_first`` + ``.L2::cache_hint``): a step reads
    each weight once, so its lines go first and the code, task table, activations and KV
    caches the step reuses stay in L2 (Llama-3.2-1B shape on the H100: 3.9% faster,
    docs/experiments.md)."""
    if p.dtype.element_ty == tl.float8e4nv:
        v = tl.load(p.to(tl.pointer_type(tl.int8), bitcast=True), mask=mask, other=0, eviction_policy="evict_first")
        v = v.to(tl.float8e4nv, bitcast=True)
    else:
        v = tl.load(p, mask=mask, other=0, eviction_policy="evict_first")
    return v


#: PTX of the prmt conversion, four elements a call: the packed bytes (``$4``) biased by 0x80
#: (v + 128, unsigned), each byte placed as the lowest mantissa byte of 2^23 (selector nibbles
#: byte k, 0x00, 0x00, 0x4B of the constant: PTX ISA "prmt"), then 2^23 + 128 (0f4B000080)
#: subtracted: exact
_I8_PRMT = tl.constexpr("""{
.reg .b32 t;
xor.b32 t, $4, 0x80808080;
prmt.b32 $0, t, 0x4B000000, 0x7540;
prmt.b32 $1, t, 0x4B000000, 0x7541;
prmt.b32 $2, t, 0x4B000000, 0x7542;
prmt.b32 $3, t, 0x4B000000, 0x7543;
sub.f32 $0, $0, 0f4B000080;
sub.f32 $1, $1, 0f4B000080;
sub.f32 $2, $2, 0f4B000080;
sub.f32 $3, $3, 0f4B000080;
}""")


@device
def _w_f32(v, I8M: tl.constexpr = 0):
    """Loaded weight elements ``v`` as fp32. An int8 ``v`` converts as ``I8M`` says (its
    index in lowering.config.INT8_CONVERTS, the int8_convert knob): 0, the conversion (I2F,
    which issues on a quarter-rate pipe: 16 a clock per SM on sm_90, CUDA C++ Programming
    Guide, arithmetic instruction throughput); 1, the sign-extended byte added to the bit
    pattern of 1.5 * 2^23, whose last mantissa bits it then holds (|v| < 2^22), and
    1.5 * 2^23 subtracted; 2, four bytes at a time by _I8_PRMT (on a GPU; under the
    interpreter as 1). Every way is exact."""
    if I8M > 0 and v.dtype.is_int8():
        if I8M == 2 and not INTERPRET:
            return tl.inline_asm_elementwise(_I8_PRMT, "=f,=f,=f,=f,r", [v], dtype=tl.float32, is_pure=True,
                                             pack=4)
        return (v.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
    return v.to(tl.float32)


@device
def _gemv_wload(w, rows, rm, cols, cm, W_CONTIG: tl.constexpr, sc=None, GROUP: tl.constexpr = 0, K=0,
                I8M: tl.constexpr = 0, k0=0):
    """The fp32 weight block W[rows, cols] (zeros outside the masks; an int8 / float8e4nv W
    converted as it loads) and, with ``GROUP`` > 0, its per-group scales, not yet applied
    (_acc_block applies them to the groups' sums): W is int8 with one scale per GROUP
    columns of a row, ``sc`` the flat [rows, K / GROUP] scales (f16; ir/ops.py), and
    ``cols`` is ``k0 + arange(BK)`` with ``k0`` a multiple of BK; the block's scales come
    back as fp32 [rows, 1] when BK <= GROUP (the block lies inside one group of each row),
    else [rows, BK / GROUP] (_group_scales). Without groups the scales are 0 (unused).
    ``I8M``: how an int8 W converts (_w_f32)."""
    wp, w_rs, w_cs = w
    if W_CONTIG:
        p = wp + rows[:, None] * w_rs + cols[None, :]
    else:
        p = wp + rows[:, None] * w_rs + cols[None, :] * w_cs
    m = rm[:, None] & cm[None, :]
    wv = _w_f32(_wload(p, m), I8M)
    s = 0.0
    if GROUP > 0:
        s = _group_scales(sc, _scale_rows(sc, rows, K, GROUP), rm, K, k0, cols.shape[0], GROUP)
    return wv, s


@device
def _scale_rows(sc, rows, K, GROUP: tl.constexpr):
    """The element offset of each row's first scale in the [rows, K / GROUP] scales ``sc``,
    computed once per row block: the table (the gscale flag) promises that a row's groups
    lie along the view's last axis, so group g of a row is g * s2 further (no index
    division per block)."""
    scp, sc_n1, sc_n2, sc_s0, sc_s1, sc_s2 = sc
    return flat_off(rows * (K // GROUP), sc_n1, sc_n2, sc_s0, sc_s1, sc_s2)


@device
def _group_scales(sc, srow, rm, K, k0, BK: tl.constexpr, GROUP: tl.constexpr):
    """The fp32 scales of the K block at ``k0`` (a multiple of BK) of the rows whose first
    scales lie at ``srow`` (_scale_rows), masked by ``rm`` and wholly masked off once ``k0``
    >= K (a block past the end reads nothing): [rows, 1] when BK <= GROUP, else
    [rows, BK / GROUP], loaded as [rows, BK / GROUP, 1] and reduced over the last axis, so
    that they arrive in the layout of _acc_block's per-group sums (a plain
    [rows, BK / GROUP] load took a shared-memory layout conversion and a CTA barrier every
    block)."""
    scp, sc_n1, sc_n2, sc_s0, sc_s1, sc_s2 = sc
    if BK <= GROUP:
        s = tl.load(scp + srow + (k0 // GROUP) * sc_s2, mask=rm & (srow * 0 + k0 < K),
                    other=0).to(tl.float32)[:, None]
    else:
        NG: tl.constexpr = BK // GROUP
        g = k0 // GROUP + tl.arange(0, NG)
        s = tl.sum(tl.load(scp + srow[:, None, None] + g[None, :, None] * sc_s2,
                           mask=rm[:, None, None] & (g * GROUP < K)[None, :, None], other=0).to(tl.float32), axis=2)
    return s


@device
def _acc_block(acc, wv, f, s, GROUP: tl.constexpr = 0):
    """``acc`` plus one K block's products of ``wv`` [BN, BK] and ``f`` [BK] (fp32).
    ``GROUP`` == 0: ``acc`` is [BN, BK], a multiply-add per element. ``GROUP`` > 0 (int8
    with per-group scales ``s`` from _gemv_wload): ``acc`` is [BN, max(BK / GROUP, 1)];
    each group's GROUP products are summed first and the sum is scaled once, a multiply a
    group instead of a scale multiply per weight (llama.cpp's Q8_0 dot products do the
    same)."""
    BN: tl.constexpr = wv.shape[0]
    BK: tl.constexpr = wv.shape[1]
    if GROUP == 0:  # (one return: the compiler visits what follows a return in a static branch)
        acc = acc + wv * f[None, :]
    elif BK <= GROUP:
        acc = acc + tl.sum(wv * f[None, :], axis=1, keep_dims=True) * s
    else:
        acc = acc + tl.sum(tl.reshape(wv * f[None, :], [BN, BK // GROUP, GROUP]), axis=2) * s
    return acc


@device
def gemv_wpre(w, N, K, ok, W_CONTIG: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
              PK: tl.constexpr):
    """W[0:BLOCK_N, 0:PK] in W's own dtype (unconverted: half the registers of fp32 for bf16),
    zeros outside [N, K] and everywhere when ``ok`` == 0 (then no memory is read): the block
    gemv_ex's ``wpre`` takes, loaded early so that its latency overlaps other work.
    ``W_CONTIG`` / ``W_ALIGN``: as gemv_ex."""
    wp, w_rs, w_cs = w
    if W_ALIGN > 1:
        w_rs = aligned(w_rs, W_ALIGN)
        K = aligned(K, W_ALIGN)
    rows = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, PK)
    if W_CONTIG:
        p = wp + rows[:, None] * w_rs + cols[None, :]
    else:
        p = wp + rows[:, None] * w_rs + cols[None, :] * w_cs
    n = tl.where(ok != 0, N, 0)  # ok == 0: every row masked off
    return _wload(p, (rows < n)[:, None] & (cols < K)[None, :])


@device
def _kblocks_pair(acc, x, a, rstd, w, rows, rm, kb, K, PRO: tl.constexpr, X_CONTIG: tl.constexpr,
                  W_CONTIG: tl.constexpr, BLOCK_K: tl.constexpr, X_ALIGN: tl.constexpr, sc=None,
                  GROUP: tl.constexpr = 0, I8M: tl.constexpr = 0):
    """STAGES 1, UNROLL 2: each iteration loads two K blocks, both weight loads first, so two
    blocks are in flight per CTA, with one [BLOCK_N, BLOCK_K] accumulator."""
    for k0 in range(kb, K, 2 * BLOCK_K):
        c0 = k0 + tl.arange(0, BLOCK_K)
        c1 = c0 + BLOCK_K
        w0, s0 = _gemv_wload(w, rows, rm, c0, c0 < K, W_CONTIG, sc, GROUP, K, I8M, k0)
        w1, s1 = _gemv_wload(w, rows, rm, c1, c1 < K, W_CONTIG, sc, GROUP, K, I8M, k0 + BLOCK_K)
        x0, a0 = _gemv_xload(x, a, c0, c0 < K, PRO, X_CONTIG, X_ALIGN)
        x1, a1 = _gemv_xload(x, a, c1, c1 < K, PRO, X_CONTIG, X_ALIGN)
        acc = _acc_block(acc, w0, _gemv_xfn(x[0], x0, a0, rstd, PRO), s0, GROUP)
        acc = _acc_block(acc, w1, _gemv_xfn(x[0], x1, a1, rstd, PRO), s1, GROUP)
    return acc


@device
def _kblocks_unrolled(acc, x, a, rstd, w, rows, rm, kb, K, PRO: tl.constexpr, X_CONTIG: tl.constexpr,
                      W_CONTIG: tl.constexpr, BLOCK_K: tl.constexpr, X_ALIGN: tl.constexpr, UNROLL: tl.constexpr,
                      sc=None, GROUP: tl.constexpr = 0, I8M: tl.constexpr = 0):
    """STAGES 1, UNROLL 4, 8 or 16: the loop unrolled by the compiler, straight-line code in
    which ptxas issues all UNROLL weight loads ahead of the FMAs, provided x needs no layout
    conversion (its bar.syncs would fence the loads): BLOCK_K < 32 * num_warps
    (docs/triton.md)."""
    for k0 in tl.range(kb, K, BLOCK_K, loop_unroll_factor=UNROLL):
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < K
        wv, sv = _gemv_wload(w, rows, rm, cols, cm, W_CONTIG, sc, GROUP, K, I8M, k0)
        xv, av = _gemv_xload(x, a, cols, cm, PRO, X_CONTIG, X_ALIGN)
        acc = _acc_block(acc, wv, _gemv_xfn(x[0], xv, av, rstd, PRO), sv, GROUP)
    return acc


@device
def _kblocks_plain(acc, x, a, rstd, w, rows, rm, kb, K, PRO: tl.constexpr, X_CONTIG: tl.constexpr,
                   W_CONTIG: tl.constexpr, BLOCK_K: tl.constexpr, X_ALIGN: tl.constexpr, sc=None,
                   GROUP: tl.constexpr = 0, I8M: tl.constexpr = 0):
    """STAGES 1: each iteration loads its W block and x block and consumes them; the next
    block's loads issue only after that (one block in flight per CTA)."""
    for k0 in range(kb, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < K
        xv, av = _gemv_xload(x, a, cols, cm, PRO, X_CONTIG, X_ALIGN)
        xv = _gemv_xfn(x[0], xv, av, rstd, PRO)
        wv, sv = _gemv_wload(w, rows, rm, cols, cm, W_CONTIG, sc, GROUP, K, I8M, k0)
        acc = _acc_block(acc, wv, xv, sv, GROUP)
    return acc


@device
def _kblocks_pipelined(acc, x, a, rstd, w, wd, rows, rm, n0, kb, K, PRO: tl.constexpr, X_CONTIG: tl.constexpr,
                       W_CONTIG: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, W_TMA: tl.constexpr,
                       sc=None, GROUP: tl.constexpr = 0, I8M: tl.constexpr = 0):
    """STAGES >= 2: Triton's software pipeliner streams W (``W_TMA``: through the tensor
    descriptor ``wd``, one copy per block; rows >= N and columns >= K arrive as zeros); the
    x (and a) block for the next iteration is loaded into registers one iteration ahead.
    Per-group scales (``GROUP`` > 0) of 4 bytes (f32, as the lowering stores them) are loaded
    in the block that uses them, so the pipeliner streams them with W, STAGES - 1 blocks
    ahead (``SPIPE``); 2-byte ones (f16), which it leaves alone (a copy moves at least 4
    bytes a thread), are loaded one block ahead into registers instead (``SAHEAD``): loaded
    in the block that used them, every block waited a memory round trip for them."""
    cols = kb + tl.arange(0, BLOCK_K)
    xv, av = _gemv_xload(x, a, cols, cols < K, PRO, X_CONTIG)
    SPIPE: tl.constexpr = GROUP > 0 and not W_TMA and sc[0].dtype.element_ty.primitive_bitwidth >= 32
    SAHEAD: tl.constexpr = GROUP > 0 and not W_TMA and not SPIPE
    if SPIPE or SAHEAD:
        srow = _scale_rows(sc, rows, K, GROUP)
    if SAHEAD:
        snext = _group_scales(sc, srow, rm, K, kb, BLOCK_K, GROUP)
    for k0 in tl.range(kb, K, BLOCK_K, num_stages=STAGES):
        cols = k0 + tl.arange(0, BLOCK_K)
        cm = cols < K
        # next iteration's x / a (all masked off after the last block: no traffic)
        xn, an = _gemv_xload(x, a, cols + BLOCK_K, (cols + BLOCK_K) < K, PRO, X_CONTIG)
        f = _gemv_xfn(x[0], xv, av, rstd, PRO)
        if W_TMA:  # one TMA copy per block; rows >= N and columns >= K arrive as zeros
            wv = _w_f32(wd.load([n0, k0]), I8M)
            sv = 0.0
        elif SPIPE:  # this block's scales, a load the pipeliner turns into copies ahead with W's
            sv = _group_scales(sc, srow, rm, K, k0, BLOCK_K, GROUP)
            wv, _ = _gemv_wload(w, rows, rm, cols, cm, W_CONTIG, None, 0, K, I8M, k0)
        elif SAHEAD:  # this block's scales came with the last one; the next block's go out now
            sv = snext
            snext = _group_scales(sc, srow, rm, K, k0 + BLOCK_K, BLOCK_K, GROUP)
            wv, _ = _gemv_wload(w, rows, rm, cols, cm, W_CONTIG, None, 0, K, I8M, k0)
        else:
            wv, sv = _gemv_wload(w, rows, rm, cols, cm, W_CONTIG, sc, GROUP, K, I8M, k0)
        acc = _acc_block(acc, wv, f, sv, GROUP)
        xv = xn
        av = an
    return acc


@device
def _gemv_roll(w, n0, N, K, ROLL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Start an L2 prefetch of the row block ``ROLL`` blocks after the one at ``n0`` (the
    rows of W are one contiguous range: the caller checked)."""
    wp, w_rs, w_cs = w
    nxt = n0 + ROLL * BLOCK_N
    if nxt < N:
        l2_prefetch_bytes(wp + nxt.to(tl.int64) * w_rs,
                          tl.minimum(N - nxt, BLOCK_N) * K * (wp.dtype.element_ty.primitive_bitwidth // 8))


@device
def gemv_epilogue(out, rows, rm, b, y, m1, m2, m3, HAS_BIAS: tl.constexpr, MIRRORS: tl.constexpr):
    """y[rows] = out (+ b[rows]) rounded to y's dtype, where ``rm``; also at ``y + m1``
    (``m2``, ``m3``) for MIRRORS (0..3) mirror outputs (their element deltas: peer copies
    of y). ``b``, ``y``: flat operands."""
    if HAS_BIAS:
        bp, b_n1, b_n2, b_s0, b_s1, b_s2 = b
        out += tl.load(bp + flat_off(rows, b_n1, b_n2, b_s0, b_s1, b_s2), mask=rm, other=0).to(tl.float32)
    yp, y_n1, y_n2, y_s0, y_s1, y_s2 = y
    store_mirrored(yp + flat_off(rows, y_n1, y_n2, y_s0, y_s1, y_s2), out, rm, m1, m2, m3, MIRRORS)


@device
def gemv_stream(x, a, rstd, w, b, y, N, K, PRO: tl.constexpr, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr,
                W_CONTIG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                X_ALIGN: tl.constexpr, UNROLL: tl.constexpr, wpre, W_PRE: tl.constexpr, ROLL: tl.constexpr, roll_ok,
                m1, m2, m3, MIRRORS: tl.constexpr, W_TMA: tl.constexpr, sc=None, HAS_SCALE: tl.constexpr = False,
                GROUP: tl.constexpr = 0, I8M: tl.constexpr = 0):
    """The streaming core: y[rows] = W[rows, :] @ f(x) (+ b) for every BLOCK_N rows, f the
    prologue ``PRO`` with the RMSNorm factor ``rstd`` already known; the K loop of each row
    block is one of the ``_kblocks_*`` forms (gemv_ex's STAGES / UNROLL), then
    gemv_epilogue. ``W_PRE`` > 0: ``wpre`` holds W[0:BLOCK_N, 0:W_PRE] (gemv_wpre); the
    first row block takes those columns from it and streams only the rest. ``ROLL`` > 0 and
    ``roll_ok``: at each row block, start an L2 prefetch of the row block ``ROLL`` blocks
    later. ``W_TMA`` (STAGES >= 2; W contiguous with
    a 16-byte aligned start and row stride: the caller checked): W's blocks come through a
    tensor descriptor (TMA copies into shared memory; gemv_ex). ``HAS_SCALE``: W is
    quantized (int8 / float8e4nv, converted to fp32 as it loads) and each row's dot product
    is multiplied once by its scale ``sc[rows]`` (a flat f32 operand) before the epilogue;
    with ``GROUP`` > 0 (int8, one scale per GROUP columns of a row: ``sc`` [N, K / GROUP])
    each group's products are summed and scaled once (_acc_block) instead. ``I8M``: how an int8 W
    converts (_w_f32)."""
    tl.static_assert(GROUP == 0 or (HAS_SCALE and W_PRE == 0 and not W_TMA),
                     "per-group scales need HAS_SCALE, no W_PRE and no W_TMA")
    ROW_SCALE: tl.constexpr = HAS_SCALE and GROUP == 0
    # the accumulator's columns: one a weight column, or one a group of them (_acc_block)
    ACC_K: tl.constexpr = BLOCK_K if GROUP == 0 else max(BLOCK_K // GROUP, 1)
    wp, w_rs, w_cs = w
    wd = None
    if W_TMA:
        tl.static_assert(STAGES > 1 and W_CONTIG and W_PRE == 0, "W_TMA needs STAGES >= 2, W_CONTIG, no W_PRE")
        # a one-row W may have any row stride; TMA wants a 16-byte multiple (K is one)
        wd = tl.make_tensor_descriptor(wp, shape=[N, K], strides=[tl.where(N > 1, w_rs, K), 1],
                                       block_shape=[BLOCK_N, BLOCK_K])
    pre = tl.zeros([BLOCK_N], dtype=tl.float32)
    if W_PRE > 0:
        pc = tl.arange(0, W_PRE)
        px, pa = _gemv_xload(x, a, pc, pc < K, PRO, X_CONTIG, X_ALIGN)
        pre = tl.sum(_w_f32(wpre, I8M) * _gemv_xfn(x[0], px, pa, rstd, PRO)[None, :], axis=1)
    for n0 in range(0, N, BLOCK_N):
        if ROLL > 0:  # a large tile keeps its own stream ahead in L2
            if roll_ok != 0:
                _gemv_roll(w, n0, N, K, ROLL, BLOCK_N)
        rows = n0 + tl.arange(0, BLOCK_N)
        rm = rows < N
        acc = tl.zeros([BLOCK_N, ACC_K], dtype=tl.float32)
        kb = 0
        if W_PRE > 0:
            if n0 == 0:
                # at most K: an unrolled loop's remainder would start below a start above its
                # end (the GPU build summed columns twice when W_PRE > K)
                kb = tl.minimum(K, W_PRE)
        if STAGES <= 1 and UNROLL == 2:
            acc = _kblocks_pair(acc, x, a, rstd, w, rows, rm, kb, K, PRO, X_CONTIG, W_CONTIG, BLOCK_K, X_ALIGN,
                                sc, GROUP, I8M)
        elif STAGES <= 1 and UNROLL > 2:
            acc = _kblocks_unrolled(acc, x, a, rstd, w, rows, rm, kb, K, PRO, X_CONTIG, W_CONTIG, BLOCK_K, X_ALIGN,
                                    UNROLL, sc, GROUP, I8M)
        elif STAGES <= 1:
            acc = _kblocks_plain(acc, x, a, rstd, w, rows, rm, kb, K, PRO, X_CONTIG, W_CONTIG, BLOCK_K, X_ALIGN,
                                 sc, GROUP, I8M)
        else:
            acc = _kblocks_pipelined(acc, x, a, rstd, w, wd, rows, rm, n0, kb, K, PRO, X_CONTIG, W_CONTIG, BLOCK_K,
                                     STAGES, W_TMA, sc, GROUP, I8M)
        out = tl.sum(acc, axis=1)
        if W_PRE > 0:
            if n0 == 0:
                out += pre
        if ROW_SCALE:  # a quantized W: its per-row scale, once per row after the dot product
            scp, sc_n1, sc_n2, sc_s0, sc_s1, sc_s2 = sc
            out *= tl.load(scp + flat_off(rows, sc_n1, sc_n2, sc_s0, sc_s1, sc_s2), mask=rm, other=0)
        gemv_epilogue(out, rows, rm, b, y, m1, m2, m3, HAS_BIAS, MIRRORS)


@device
def gemv_ex(x, a, eps, w, b, y, N, K, PRO: tl.constexpr, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr,
            W_CONTIG: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            STAGES: tl.constexpr = 1, PROF=None, PROFILE: tl.constexpr = False, X_ALIGN: tl.constexpr = 0,
            UNROLL: tl.constexpr = 1, XS=None, X_STAGE: tl.constexpr = False, x_ready=0, X_CHUNK: tl.constexpr = 0,
            wpre=0, W_PRE: tl.constexpr = 0, ROLL: tl.constexpr = 0,
            m1=0, m2=0, m3=0, MIRRORS: tl.constexpr = 0, r=None, KP=1, p_rs=0, W_TMA: tl.constexpr = False,
            sc=None, HAS_SCALE: tl.constexpr = False, SCALE_GROUP: tl.constexpr = 0,
            I8_CVT: tl.constexpr = 0):
    """y[N] = W[N, K] @ f(x)[K] (+ b), fp32 accumulation, f the prologue ``PRO`` (module
    doc): the prologue (gemv_rstd or gemv_stage), then the streaming core (gemv_stream) and
    its epilogue. ``x``, ``a`` (the prologue's second vector; x itself for PRO_PLAIN), ``b``
    (HAS_BIAS; else y), ``y``: flat operands; ``w``: (pointer, row stride, column stride).

    ``W_CONTIG``: columns have stride 1 (the column stride is ignored). ``W_ALIGN`` (0 or a
    power of two, in elements): the caller guarantees W's start, row stride and K are
    multiples of it (16-byte vector loads). ``X_CONTIG``: x (and a) have one strided axis.
    ``X_ALIGN`` (0 or a power of two): x (and a) also have unit stride and start on a
    multiple of X_ALIGN elements (wide loads, no stride arithmetic). ``PROFILE``: store
    %globaltimer at ``PROF + 4`` (prologue done) and ``PROF + 5`` (all row blocks stored),
    the megakernel's profiling stamps (vm.PROF_W). ``HAS_SCALE``: W is int8 / float8e4nv
    with per-row fp32 scales ``sc`` (a flat operand): ``y = sc * (float(W) @ f(x)) (+ b)``
    (gemv_stream; not with ``W_TMA``); ``SCALE_GROUP`` > 0: an int8 W with one scale per
    SCALE_GROUP columns of a row (gemv_stream; not with ``W_TMA`` or ``W_PRE``); ``I8_CVT``: how an int8
    W converts to fp32 (gemv_stream, _w_f32). ``MIRRORS`` (0..3) with element deltas
    ``m1`` .. ``m3``: y is also stored at ``y + m*`` (gemv_epilogue).

    ``X_STAGE`` (PRO_NORM / PRO_SWIGLU; ignored for PRO_PLAIN; PRO_RNORM always stages):
    f(x) is computed once per call, for all K, into ``XS`` (scratch of at least K elements
    of 4 bytes, 16-byte aligned, used by this CTA alone; gemv_stage), and the weight loop
    then reads it as a plain aligned vector; ``x_ready`` != 0 (runtime): XS already holds
    this call's f(x) (the caller guarantees the same x, a, eps and K as the call that staged
    it, and x and a unchanged since), so the x pass and its barriers are skipped. The x pass
    reads x (and a) in chunks of ``max(BLOCK_N * BLOCK_K, X_CHUNK)`` elements. Without it, f
    is evaluated inside the weight loop by every thread that holds a column, i.e. once per
    row of the block (BLOCK_N times per element: the prologue's multiplies, exp and
    reciprocal then outnumber the FMAs; SASS of the 16 x 128 loop: 747 instructions per 8
    blocks for PRO_NORM, 1387 for PRO_SWIGLU, 364 for PRO_PLAIN). Same values: f(x) is
    stored rounded to x's dtype, exactly what the loop would have used.

    ``W_PRE`` (0 or a power of two multiple of BLOCK_K, 2 * BLOCK_K for ``UNROLL`` = 2):
    ``wpre`` is W[0:BLOCK_N, 0:W_PRE] already loaded by the caller (gemv_wpre), e.g. before
    the task's waits; the first row block uses it for those columns (its dot product over
    them is summed apart and added at the end: fp32 summation order only).

    ``ROLL`` (row blocks, 0 = off): while streaming row block j, start an L2 prefetch of
    row block j + ROLL, when the rows of W are one contiguous range (W_CONTIG, W_ALIGN and
    a row stride of K; checked here at run time), so a tile of many row blocks streams
    from L2 as a task of one row block does after the kernel's task-ahead prefetch.

    ``STAGES`` (weight-streaming pipeline depth, >= 1; the same arithmetic for every value,
    except that S >= 2 sums PRO_NORM's x^2 in chunks of BLOCK_N * BLOCK_K elements instead of
    BLOCK_K, one round trip for K up to that: fp32 summation order only):

    * 1: _kblocks_plain (one block in flight per CTA). ``UNROLL`` = 2: _kblocks_pair (two
      blocks in flight, one accumulator). ``UNROLL`` = 4, 8 or 16: _kblocks_unrolled, the
      loop unrolled by Triton (``loop_unroll_factor``) and the weight loads hoisted by
      ptxas, UNROLL blocks in flight, when BLOCK_K < 32 * num_warps (then x is loaded
      straight into the layout it is broadcast in; a larger x block goes through shared
      memory, whose bar.syncs stop the hoisting). Every value sums the K blocks in the same
      order: bit-identical.
    * S >= 2: _kblocks_pipelined, the K loop as ``tl.range(..., num_stages=S)``: Triton's
      software pipeliner turns the W loads into asynchronous global->shared copies
      (``cp.async.cg``, L1 bypassed), issued S - 1 blocks ahead, so (S - 1) * BLOCK_N *
      BLOCK_K weight elements are in flight while a block is consumed (Little's law: bytes
      in flight = bandwidth x latency; ~32-64 KB per SM on an H200). Costs (S - 1) blocks of
      shared memory. The x (and a) block for the next iteration is loaded into registers one
      iteration ahead (too narrow per thread for cp.async), so its L2 latency is hidden too.
      Under the interpreter the loop is an ordinary loop.
    * S >= 2 and ``W_TMA``: the same pipeline, but each W block is one tensor-memory-
      accelerator copy through a tensor descriptor made once per call
      (``tl.make_tensor_descriptor`` over W[N, K]; rows >= N and columns >= K arrive as
      zeros, so a block may be taller than the tile). The copies are issued by one thread
      and land in shared memory, so the S - 1 blocks in flight hold no registers: one 8-warp
      CTA per SM streamed a bf16 W at 3.3-3.9 TB/s on an H200 with 64 x 128 blocks and
      S = 4-6, against 2.0-2.2 TB/s for 16 x 128 register loads unrolled 8-16 times
      (``bench/gemv_tma.py``). Needs W_CONTIG, W_ALIGN with a 16-byte aligned W and row
      stride, W_PRE = 0, and, on a GPU, a global-scratch allocator for the descriptor
      (``triton.set_allocator``; runtime.tma_scratch).
    """
    wp, w_rs, w_cs = w
    if W_ALIGN > 1:
        w_rs = aligned(w_rs, W_ALIGN)
        K = aligned(K, W_ALIGN)
    w = (wp, w_rs, w_cs)
    rstd = tl.full([], 1.0, dtype=tl.float32)
    roll_ok = 0
    if ROLL > 0 and W_CONTIG and W_ALIGN > 1:
        roll_ok = (w_rs == K).to(tl.int32)
    STAGED: tl.constexpr = (X_STAGE and PRO != PRO_PLAIN) or PRO == PRO_RNORM
    if PRO == PRO_RNORM:
        tl.static_assert(X_ALIGN > 1, "reduce_norm_gemv needs aligned contiguous rows")
        p_rs = aligned(p_rs, X_ALIGN)
    if PRO == PRO_NORM and not STAGED:
        # STAGES >= 2: x in blocks of BLOCK_N * BLOCK_K (the registers of one W block), so a
        # K <= BLOCK_N * BLOCK_K costs one round trip instead of K / BLOCK_K dependent ones
        # (the X_STAGE pass reads x in such chunks too).
        NB: tl.constexpr = BLOCK_N * BLOCK_K if STAGES > 1 else BLOCK_K
        # unrolled like the W loop: UNROLL x blocks in flight, summed in the same order
        PU: tl.constexpr = 1 if STAGES > 1 else UNROLL
        rstd = gemv_rstd(x, K, eps, NB, PU, X_CONTIG, X_ALIGN)
    if STAGED:
        # f(x) once per call into the worker's scratch, instead of once per weight element
        # (each x column is shared by the BLOCK_N rows' threads, which would all compute it)
        xs = tl.multiple_of(XS.to(x[0].dtype, bitcast=True), 16)  # 16-byte aligned (the caller)
        XA: tl.constexpr = 128 // x[0].dtype.element_ty.primitive_bitwidth
        XB: tl.constexpr = BLOCK_N * BLOCK_K if BLOCK_N * BLOCK_K > X_CHUNK else X_CHUNK
        if x_ready == 0:
            gemv_stage(xs, x, a, eps, K, PRO, X_CONTIG, X_ALIGN, XB, r, KP, p_rs)
        if PROFILE:
            tl.store(PROF + 4, global_timer())
        f = (xs, 1, K, 0, 0, 1)
        gemv_stream(f, f, rstd, w, b, y, N, K, PRO_PLAIN, HAS_BIAS, True, W_CONTIG, BLOCK_N, BLOCK_K, STAGES, XA,
                    UNROLL, wpre, W_PRE, ROLL, roll_ok, m1, m2, m3, MIRRORS, W_TMA, sc, HAS_SCALE, SCALE_GROUP, I8_CVT)
    else:
        if PROFILE:
            tl.store(PROF + 4, global_timer())
        gemv_stream(x, a, rstd, w, b, y, N, K, PRO, HAS_BIAS, X_CONTIG, W_CONTIG, BLOCK_N, BLOCK_K, STAGES,
                    X_ALIGN, UNROLL, wpre, W_PRE, ROLL, roll_ok, m1, m2, m3, MIRRORS, W_TMA, sc, HAS_SCALE,
                    SCALE_GROUP, I8_CVT)
    if PROFILE:
        tl.store(PROF + 5, global_timer())


@device
def gemv(x, w, b, y, N, K, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr,
         W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1):
    """y[N] = W[N, K] @ x[K] (+ bias), fp32 accumulation (``gemv_ex`` without prologue)."""
    gemv_ex(x, x, 0.0, w, b, y, N, K, PRO_PLAIN, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K, STAGES)


# ---------------------------------------------------------------- row decoder
@device
def t_gemv(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DA: tl.constexpr,
           DW: tl.constexpr, DB: tl.constexpr, DY: tl.constexpr, PRO: tl.constexpr, HAS_BIAS: tl.constexpr,
           X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1, PROF=None, PROFILE: tl.constexpr = False,
           X_ALIGN: tl.constexpr = 0, UNROLL: tl.constexpr = 1, XS=None, X_STAGE: tl.constexpr = False,
           X_CHUNK: tl.constexpr = 0, W_PRE: tl.constexpr = 0, ROLL: tl.constexpr = 0, fl=0,
           nw=0, w0=0, wc=0, wn=0, wb=0, WAITS=None, i=0, epoch=0, abort_ptr=None, timeout=0, SYS: tl.constexpr = False,
           MIRRORS: tl.constexpr = 0, W_TMA: tl.constexpr = False,
           RING: tl.constexpr = False, STREAMS=None, se=0, rbase=0, rst=None, RING_S: tl.constexpr = 1,
           RING_PR: tl.constexpr = 4, RING_PC: tl.constexpr = 2048, HAS_SCALE: tl.constexpr = False,
           SCALE_GROUP: tl.constexpr = 0, I8_CVT: tl.constexpr = 0, DS: tl.constexpr = tl.float32):
    """The row decoder of the five GEMV ops (gemv_ex; ``PRO`` the prologue, ``STAGES`` its
    weight-streaming pipeline depth, ``X_STAGE`` its f(x) staged once in the worker's
    scratch ``XS``, skipped when the row's ``FLAG_X_READY`` says an earlier task of this
    worker left the same f(x) there). Operands: x, [a (norm weight / up) when PRO != plain], W, [b (bias /
    residual)], y; PRO_RNORM: partials [KP, K], residual, a (norm weight), W, [bias], y.

    Runs the row's waits itself (``nw`` .. ``SYS``: vm.run_waits's arguments, ``fl`` the
    row flags) after decoding the operands, so the decode overlaps the wait. ``W_PRE`` > 0:
    the first ``W_PRE`` columns of the first row block of W are loaded before the waits when
    the row's ``FLAG_W_CONST`` says no task writes W (weights do not change during a step,
    so the load needs no happens-before edge; the table proves it per program), and after
    them otherwise: the wait and the x pass then overlap that part of the weight stream.
    ``MIRRORS`` (0..3, gemv_mirrors): operands after y are its mirror outputs (same
    layout, on peers); each row block of y is stored there too, at y's offsets plus the
    mirror's element delta (the peer stores of a fused one-shot all-reduce).
    ``W_TMA``: W's blocks come through a tensor descriptor (gemv_ex; the variant is
    contiguous and 16-byte aligned, Blocks.gemv_tma).
    ``RING`` (a ``ring`` variant, Blocks.ring): W's pages come through the worker's weight
    ring (ring.gemv_ring) after f(x) is staged as fp32 into the scratch row; ``STREAMS``,
    ``se``, ``rbase`` and ``rst`` (the ring's state, ring.ring_state) as ring.ring_issue's,
    ``RING_S`` / ``RING_PR`` / ``RING_PC`` its pages and page shape. Returns (1 if the waits
    held else 0, op status, the ring state, unchanged without ``RING``); a page that never
    arrived is reported as a timeout of wait -1 (vm.fail_page). ``HAS_SCALE``: W is quantized
    (int8 / float8e4nv) and the operand after [b] holds its per-row fp32 scales (ir/ops.py;
    gemv_ex); never on the ring. ``SCALE_GROUP`` > 0: one scale per SCALE_GROUP columns of a
    row instead (int8; the kernel's W_PRELOAD is then not used: its columns would need them).
    ``DS``: the scales' dtype (fp32; per-group ones may be f16). ``I8_CVT``: how an int8 W
    converts to fp32 (gemv_ex)."""
    tl.static_assert(not (RING and HAS_SCALE), "the weight ring streams bf16 weights only")
    WPRE: tl.constexpr = W_PRE if SCALE_GROUP == 0 else 0
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = operand(row, 0, slot)
    ro = xo * 0
    if PRO == PRO_PLAIN:
        ao, an1, an2, as0, as1, as2 = xo, xn1, xn2, xs0, xs1, xs2
        WI: tl.constexpr = 1
    elif PRO == PRO_RNORM:  # x = the partials [KP = xn1, K] at row stride xs1; then r, a
        ro = operand_off(row, 1, slot)
        ao, an0, an1, an2, as0, as1, as2 = operand(row, 2, slot)
        WI: tl.constexpr = 3
    else:
        ao, an0, an1, an2, as0, as1, as2 = operand(row, 1, slot)
        WI: tl.constexpr = 2
    if X_ALIGN > 1:
        xo = aligned(xo, X_ALIGN)
        ao = aligned(ao, X_ALIGN)
        ro = aligned(ro, X_ALIGN)
    if PRO == PRO_PLAIN:
        ap = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + ao
    else:
        ap = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DA) + ao
    wo, wn0, wn1, wn2, ws0, ws1, ws2 = operand(row, WI, slot)
    if W_ALIGN > 1:
        wo = aligned(wo, W_ALIGN)
    SI: tl.constexpr = WI + 2 if HAS_BIAS else WI + 1  # the scale (HAS_SCALE), else y
    YI: tl.constexpr = SI + 1 if HAS_SCALE else SI
    if HAS_BIAS:
        bo, bn0, bn1, bn2, bs0, bs1, bs2 = operand(row, WI + 1, slot)
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, YI, slot)
        bp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DB) + bo
    else:
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, YI, slot)
        bp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo
        bn1, bn2, bs0, bs1, bs2 = yn1, yn2, ys0, ys1, ys2
    if HAS_SCALE:
        so, sn0, sn1, sn2, ss0, ss1, ss2 = operand(row, SI, slot)
        sc = (arena_ptr(A_BF16, A_F16, A_F32, A_I32, DS) + so, sn1, sn2, ss0, ss1, ss2)
    else:
        sc = None
    m1 = yo * 0
    m2 = m1
    m3 = m1
    if MIRRORS > 0:
        m1 = operand_off(row, YI + 1, slot) - yo
    if MIRRORS > 1:
        m2 = operand_off(row, YI + 2, slot) - yo
    if MIRRORS > 2:
        m3 = operand_off(row, YI + 3, slot) - yo
    if PRO == PRO_NORM or PRO == PRO_RNORM:
        eps = param_f(row, 0)
    else:
        eps = 0.0
    if RING or (X_STAGE and PRO != PRO_PLAIN) or PRO == PRO_RNORM:  # layout.FLAG_X_READY (staged_x_reuse)
        x_ready = (fl >> 1) & 1
    else:
        x_ready = 0
    wp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DW) + wo
    w = (wp, ws1, ws2)
    if WPRE > 0 and not RING:  # layout.FLAG_W_CONST: W is written by no task, so it may be read before the waits
        w_const = (fl >> 2) & 1
        wpre = gemv_wpre(w, wn1, wn2, w_const, W_CONTIG, W_ALIGN, BLOCK_N, WPRE)
    else:
        w_const = 1
        wpre = 0
    ok = run_waits(nw, w0, wc, wn, wb, WAITS, A_I32, err, i, epoch, abort_ptr, timeout, SYS)
    if ok != 0:
        if PROFILE:
            tl.store(PROF + 1, global_timer())
            tl.store(PROF + 3, global_timer())
        if WPRE > 0 and not RING:
            if w_const == 0:  # W may be written in this step: read it only now
                wpre = gemv_wpre(w, wn1, wn2, w_const + 1, W_CONTIG, W_ALIGN, BLOCK_N, WPRE)
    # the other operands' pointers after the waits (x, a, the residual r: the partials' dtype)
    x = (arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2)
    a = (ap, an1, an2, as0, as1, as2)
    rp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + ro
    yp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo
    if RING:
        if ok != 0:
            XB: tl.constexpr = BLOCK_N * BLOCK_K if BLOCK_N * BLOCK_K > X_CHUNK else X_CHUNK
            xsr = tl.multiple_of(XS, 16)  # fp32 f(x), 16-byte aligned (runtime)
            if x_ready == 0:
                gemv_stage(xsr, x, a, eps, wn2, PRO, X_CONTIG, X_ALIGN, XB, rp, xn1, xs1)
            if PROFILE:
                tl.store(PROF + 4, global_timer())
            bad, rst = RG.gemv_ring(
                xsr, wp, ws1, bp, bn1, bn2, bs0, bs1, bs2, yp,
                yn1, yn2, ys0, ys1, ys2, wn1, wn2, HAS_BIAS, m1, m2, m3, MIRRORS, A_I32, STREAMS, se, rbase,
                rst, timeout, RING_S, RING_PR, RING_PC, PROF, PROFILE)
            if PROFILE:
                tl.store(PROF + 5, global_timer())
            if bad != 0:  # a weight page never arrived: reported as a timeout of wait -1
                ok = fail_page(err, i, rst[0], rst[1], epoch, abort_ptr)
    elif ok != 0:
        gemv_ex(x, a, eps, w, (bp, bn1, bn2, bs0, bs1, bs2), (yp, yn1, yn2, ys0, ys1, ys2), wn1, wn2,
                PRO, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K, STAGES, PROF, PROFILE, X_ALIGN,
                UNROLL, XS, X_STAGE, x_ready, X_CHUNK, wpre, WPRE, ROLL, m1, m2, m3, MIRRORS,
                rp, xn1, xs1, W_TMA, sc, HAS_SCALE, SCALE_GROUP, I8_CVT)
    return ok, status_ok(), rst


# ---------------------------------------------------------------- table encoding and dispatch
#: The operand roles of each GEMV op (layout.GemvRoles).
ROLES: dict[str, GemvRoles] = {
    "gemv": GemvRoles(x=0, a=None, w=1, k=0),
    "norm_gemv": GemvRoles(x=0, a=1, w=2, k=0, staged=True),
    "gemv_res": GemvRoles(x=0, a=None, w=1, k=0),
    "swiglu_gemv": GemvRoles(x=0, a=1, w=2, k=0, staged=True),
    # x: the partials [P, K]; K: the residual's length
    "reduce_norm_gemv": GemvRoles(x=0, a=2, w=3, k=1, staged=True, always_staged=True),
}

_PRO = {"gemv": "PRO_PLAIN", "norm_gemv": "PRO_NORM", "gemv_res": "PRO_PLAIN", "swiglu_gemv": "PRO_SWIGLU",
        "reduce_norm_gemv": "PRO_RNORM"}


def gemv_mirrors(v: Variant) -> int:
    """Mirror outputs (ir/ops.py) of a GEMV variant: its operands after x, [a], W, [bias /
    residual] and y."""
    return len(v.dtypes) - (ROLES[v.op].w + 2 + v.flag("bias") + v.flag("scale"))


def _call(v: Variant) -> str:
    d = tl_dtypes(v)
    g = ROLES[v.op]
    bias = v.flag("bias")
    da = d[g.a] if g.a is not None else d[g.x]
    db = d[g.w + 1] if bias else d[-1]
    align = 16 // DTYPE_BYTES[v.dtypes[g.w]] if v.flag("aligned") else 0
    xalign = 16 // DTYPE_BYTES[v.dtypes[g.x]] if v.flag("xaligned") else 0
    scale = v.flag("scale")
    # contiguous W with a 16-byte aligned start and row stride: TMA copies where the kernel
    # knobs say (a quantized W: Q_TMA; with per-group scales: register loads)
    tma = "False" if not v.flag("aligned") or v.flag("gscale") else "Q_TMA" if scale else "GEMV_TMA"
    group = f", SCALE_GROUP={Q8_0_GROUP}" if v.flag("gscale") else ""
    if scale:  # the last input, after W and its bias / residual
        group += f", DS={d[g.w + 1 + bias]}"
    if scale and v.dtypes[g.w] == "i8":
        group += ", I8_CVT=I8_CVT"
    rows = "GEMV_NQ" if scale else "GEMV_N"  # a quantized W's block rows: the q_gemv_n knob
    return (f"t_gemv({DECODER_ARGS}, {d[g.x]}, {da}, {d[g.w]}, {db}, {d[-1]}, {_PRO[v.op]}, {bias}, "
            f"{v.flag('xcontig')}, {v.flag('contig')}, {align}, {rows}, GEMV_K, GEMV_STAGES, "
            f"PROF + i.to(tl.int64) * PROF_W, PROFILE, {xalign}, GEMV_UNROLL, XSW, X_STAGE, X_CHUNK, "
            f"MIRRORS={gemv_mirrors(v)}, W_TMA={tma}, RING={v.flag('ring')}"
            + (f", HAS_SCALE=True{group})" if scale else ")"))


def _flags(task, dtypes, descs, slots) -> dict[str, bool]:
    """``bias`` (a bias / residual operand after W, added in the epilogue), ``mirror`` (y is
    also stored to the mirror outputs that follow it, gemv_mirrors), ``contig`` (weight
    columns have stride 1), ``xcontig`` (x, and a when present, are one strided axis),
    ``aligned`` (every weight row starts on a 16-byte boundary for every slot and K is a
    multiple of 16 bytes, so the kernel may promise it to the compiler for wide loads),
    ``xaligned`` (also x, and a, have unit stride and a 16-byte-aligned start for every
    slot: x is read with wide loads and no stride arithmetic), ``scale`` (only for an int8 /
    fp8 W: its scales are the last input), ``gscale`` (only then, and only for scales per
    group of ``Q8_0_GROUP`` columns, the one group size the kernel is built for; f32, or f16
    in a hand-written schedule: the lowering stores f32). The table
    adds ``ring`` (W streams through the worker's weight ring: table.ring_eligible). Raises
    TableError for per-group scales of another group size, or whose view splits a row's
    groups over more than its last axis."""
    g = ROLES[task.op]
    w = descs[g.w]
    esize = DTYPE_BYTES[dtypes[g.w]]
    flags = {}
    scaled = dtypes[g.w] in QUANT_DTYPES  # the last input: W's per-row scales
    flags["bias"] = len(task.ins) - scaled > g.w + 1  # bias / residual added in the epilogue
    if scaled:  # only then: an unquantized variant keeps its flags (and its generated code)
        flags["scale"] = True
        n, k, ns = descs[len(task.ins)].numel, w.n[2], descs[len(task.ins) - 1].numel
        if len(task.ins[-1].ranges) == 2:  # one scale per group of columns: [N, K / G] (ir/ops.py)
            if ns * Q8_0_GROUP != n * k or dtypes[len(task.ins) - 1] not in ("f16", "f32"):
                raise TableError(f"task {task.id}: the triton GEMV kernel takes one f32 scale per row or "
                                 f"one f16 / f32 scale per {Q8_0_GROUP} columns, not {ns} "
                                 f"{dtypes[len(task.ins) - 1]} scales for [{n}, {k}]")
            sd = descs[len(task.ins) - 1]
            if sd.n[2] % (k // Q8_0_GROUP):  # _scale_rows: a row's groups along the last axis
                raise TableError(f"task {task.id}: the per-group scales' view {sd.n} splits a row's "
                                 f"{k // Q8_0_GROUP} groups over more than its last axis")
            flags["gscale"] = True
        elif dtypes[len(task.ins) - 1] != "f32":
            raise TableError(f"task {task.id}: the triton GEMV kernel takes per-row scales in f32 only")
    flags["mirror"] = len(task.outs) > 1  # y also stored to peers (gemv_mirrors)
    flags["contig"] = w.s[2] == 1 or w.n[2] == 1
    flags["xcontig"] = all(descs[j].n[0] == 1 and descs[j].n[1] == 1 for j in (g.x, g.a) if j is not None)
    vec = 16 // esize  # elements per 16 bytes
    flags["aligned"] = (flags["contig"] and L.starts_aligned(w, vec, slots)
                        and (w.n[1] == 1 or w.s[1] % vec == 0) and w.n[2] % vec == 0)
    xs = [(descs[j], DTYPE_BYTES[dtypes[j]]) for j in (g.x, g.a) if j is not None]
    flags["xaligned"] = (flags["xcontig"] and flags["aligned"]
                         and all((d.s[2] == 1 or d.n[2] == 1) and (d.off * e) % 16 == 0
                                 and (d.coef * e) % 16 == 0 for d, e in xs))
    return flags


def _flags_rnorm(task, dtypes, descs, slots) -> dict[str, bool]:
    """_flags, and the kernel's 16-byte row sums of the partials P [KP, K] (as reduce's
    ``vec``): rows contiguous at a 16-byte row stride, the residual and the norm weight
    flat. Raises TableError otherwise."""
    flags = _flags(task, dtypes, descs, slots)
    if not (flags["aligned"] and L.rows_vec_aligned(descs[0], descs[1:3], L.vec_elems(dtypes[:3]), slots)):
        raise TableError(f"task {task.id}: the triton reduce_norm_gemv kernel needs contiguous "
                         "partial rows, residual and norm weight, each row starting on a 16-byte "
                         "boundary, and a 16-byte aligned weight (as the lowering emits)")
    flags["xcontig"] = flags["xaligned"] = True
    return flags


def _check(task, descs, where) -> None:
    """W viewed as [N, K] matches y's N and the input's K."""
    g = ROLES[task.op]
    w, y = descs[g.w], descs[len(task.ins)]
    k = descs[g.k].numel
    if w.n[1] != y.numel or w.n[2] != k:
        raise TableError(f"{where}: weight region viewed as [{w.n[1]}, {w.n[2]}] does not match "
                         f"[N={y.numel}, K={k}]")


def _check_rnorm(task, descs, where) -> None:
    """_check, and the partials viewed as [KP, K]."""
    _check(task, descs, where)
    x, k = descs[0], descs[1].numel
    if x.n[2] != k:
        raise TableError(f"{where}: partials viewed as [{x.n[1]}, {x.n[2]}] do not match K={k}")


LOWERINGS = (
    OpLowering("gemv", ("flat", "matrix", "flat", "flat"), t_gemv, _call,  # x, W, [bias], y
               flags=_flags, check=_check, gemv=ROLES["gemv"], imports=("PRO_PLAIN",)),
    OpLowering("norm_gemv", ("flat", "flat", "matrix", "flat", "flat"), t_gemv, _call,  # x, norm_w, W, [bias], y
               params=(("eps", "f"),), flags=_flags, check=_check, gemv=ROLES["norm_gemv"], imports=("PRO_NORM",)),
    OpLowering("gemv_res", ("flat", "matrix", "flat", "flat"), t_gemv, _call,  # x, W, r, y
               flags=_flags, check=_check, in_place="residual", gemv=ROLES["gemv_res"], imports=("PRO_PLAIN",)),
    OpLowering("swiglu_gemv", ("flat", "flat", "matrix", "flat", "flat"), t_gemv, _call,  # g, u, W, [r], y
               flags=_flags, check=_check, in_place="residual", gemv=ROLES["swiglu_gemv"],
               imports=("PRO_SWIGLU",)),
    OpLowering("reduce_norm_gemv", ("matrix", "flat", "flat", "matrix", "flat", "flat"), t_gemv, _call,
               params=(("eps", "f"),), flags=_flags_rnorm, check=_check_rnorm,  # P, r, norm_w, W, [bias], y
               gemv=ROLES["reduce_norm_gemv"], imports=("PRO_RNORM",)),
)
