"""The GEMM family: ``gemm``, y[M, N] = a[M, K] @ b[K, N] (+ r[M, N]), fp32 accumulation.

One task is one output tile of any size: the device function walks it in
``BLOCK_M x BLOCK_N`` blocks (the kernel's ``GEMM_M`` / ``GEMM_N`` constexprs), each an fp32
accumulator fed by ``tl.dot`` over ``BLOCK_K`` steps of K. Edges are masked (rows past M,
columns past N, the K tail load as zeros), so a tile with M < 16 (decode-sized row blocks)
runs in a 16-row block with its extra rows masked off. bf16 and f16 operands of one dtype go
to the tensor cores as they are; f32 operands, or a and b of different dtypes, are
converted to fp32 and multiplied with ``input_precision="ieee"`` (no TF32), like
reference.py's fp32 matmul. The residual r is added in fp32 and y rounded once to its
dtype (lang.store).

Operands are ``matrix`` views (layout.py) split by the op's semantics (``OpLowering.splits``:
a's columns are K, b's, r's and y's are N, from ir.ops.gemm_dims), each a pointer plus a row
and a column stride: a row block of an activation, a column block ``w[0:K, c0:c1]`` of a
weight, a column block ``G[rows, c0:c1]`` of a gathered buffer, an ``[M, 1]`` or ``[1, N]``
tile.
"""

from __future__ import annotations

import triton.language as tl

from ir.ops import gemm_dims
from ir.program import DTYPE_BYTES
from lowering.triton import layout as L
from lowering.triton.lang import aligned, device, dot_acc, store
from lowering.triton.layout import DECODER_ARGS, OpLowering, TableError, Variant, tl_dtypes
from lowering.triton.vm import arena_ptr, operand, status_ok


@device
def gemm(a, a_rs, a_cs, b, b_rs, b_cs, r, r_rs, r_cs, y, y_rs, y_cs, M, N, K,
         HAS_R: tl.constexpr, A_CONTIG: tl.constexpr, B_CONTIG: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[M, N] = a[M, K] @ b[K, N] (+ r[M, N]) with fp32 accumulation, y rounded once.

    Each operand is a typed pointer plus a row and a column stride (elements); ``A_CONTIG`` /
    ``B_CONTIG``: a's / b's column stride is 1 (the kernel then indexes columns directly,
    so Triton's analysis sees contiguous rows and can vectorise the loads). Blocks of
    BLOCK_M x BLOCK_N (each >= 16, tl.dot's minimum) with K in BLOCK_K steps; masks cover
    every edge. y must not overlap a, b or r (the table refuses it)."""
    for m0 in range(0, M, BLOCK_M):
        rm = m0 + tl.arange(0, BLOCK_M)
        mm = rm < M
        for n0 in range(0, N, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            nm = rn < N
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                km = rk < K
                if A_CONTIG:
                    ap = a + rm[:, None] * a_rs + rk[None, :]
                else:
                    ap = a + rm[:, None] * a_rs + rk[None, :] * a_cs
                if B_CONTIG:
                    bp = b + rk[:, None] * b_rs + rn[None, :]
                else:
                    bp = b + rk[:, None] * b_rs + rn[None, :] * b_cs
                av = tl.load(ap, mask=mm[:, None] & km[None, :], other=0)
                bv = tl.load(bp, mask=km[:, None] & nm[None, :], other=0)
                acc = dot_acc(av, bv, acc)
            om = mm[:, None] & nm[None, :]
            if HAS_R:
                acc += tl.load(r + rm[:, None] * r_rs + rn[None, :] * r_cs, mask=om, other=0).to(tl.float32)
            store(y + rm[:, None] * y_rs + rn[None, :] * y_cs, acc, om)


# ---------------------------------------------------------------- row decoder
@device
def t_gemm(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DA: tl.constexpr, DB: tl.constexpr,
           DR: tl.constexpr, DY: tl.constexpr, HAS_R: tl.constexpr, A_CONTIG: tl.constexpr,
           B_CONTIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           A_ALIGN: tl.constexpr = 0, B_ALIGN: tl.constexpr = 0):
    """gemm (a, b, [r], y): matrix operands [rows, cols] in (n1, n2) / (s1, s2), so
    M = a's n1, K = a's n2, N = b's n2 (the table split them by ir.ops.gemm_dims).
    ``A_ALIGN`` > 0 (the variant's ``aaligned`` flag): a's start, row stride and K are
    multiples of A_ALIGN elements (16 bytes) and its columns contiguous, restated with
    lang.aligned so its rows load as 16-byte vectors; ``B_ALIGN`` the same for b (start,
    row stride, N)."""
    ao, an0, an1, an2, as0, as1, as2 = operand(row, 0, slot)
    bo, bn0, bn1, bn2, bs0, bs1, bs2 = operand(row, 1, slot)
    if A_ALIGN > 0:
        ao = aligned(ao, A_ALIGN)
        as1 = aligned(as1, A_ALIGN)
        an2 = aligned(an2, A_ALIGN)
    if B_ALIGN > 0:
        bo = aligned(bo, B_ALIGN)
        bs1 = aligned(bs1, B_ALIGN)
        bn2 = aligned(bn2, B_ALIGN)
    if HAS_R:
        ro, rn0, rn1, rn2, rs0, rs1, rs2 = operand(row, 2, slot)
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 3, slot)
        rp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DR) + ro
    else:
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 2, slot)
        rp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo
        rs1, rs2 = ys1, ys2
    gemm(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DA) + ao, as1, as2,
         arena_ptr(A_BF16, A_F16, A_F32, A_I32, DB) + bo, bs1, bs2, rp, rs1, rs2,
         arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, ys1, ys2, an1, bn2, an2,
         HAS_R, A_CONTIG, B_CONTIG, BLOCK_M, BLOCK_N, BLOCK_K)
    return status_ok()


# ---------------------------------------------------------------- table encoding and dispatch
def _call(v: Variant) -> str:
    d = tl_dtypes(v)
    res = v.flag("residual")
    dr = d[2] if res else d[-1]
    a_align = 16 // DTYPE_BYTES[v.dtypes[0]] if v.flag("aaligned") else 0
    b_align = 16 // DTYPE_BYTES[v.dtypes[1]] if v.flag("baligned") else 0
    return (f"t_gemm({DECODER_ARGS}, {d[0]}, {d[1]}, {dr}, {d[-1]}, {res}, {v.flag('acontig')}, "
            f"{v.flag('bcontig')}, GEMM_M, GEMM_N, GEMM_K, {a_align}, {b_align})")


def _dims_of(task) -> tuple[int, int, int]:
    """(M, K, N) of a gemm task from its regions' element counts (ir.ops.gemm_dims); the
    table ran the op's shape check first, so they fit."""
    dims = gemm_dims(task.ins[0].numel(), task.ins[1].numel(), task.outs[0].numel())
    if dims is None:
        raise TableError(f"task {task.id}: gemm operands do not fit [M, K] @ [K, N] -> [M, N]")
    return dims


def _splits(task) -> list[int]:
    """Columns of each operand's matrix view: a's are K, b's, r's and y's are N."""
    _, k, n = _dims_of(task)
    return [k, n] + [n] * (len(task.ins) - 2) + [n]


def _aligned(d, dtype: str, slots: int) -> bool:
    """A matrix operand with unit column stride whose start (every slot), row stride and
    column count are multiples of 16 bytes (buffer bases are 16-byte aligned: table.py)."""
    vec = 16 // DTYPE_BYTES[dtype]
    return ((d.s[2] == 1 or d.n[2] == 1) and L.starts_aligned(d, vec, slots)
            and (d.n[1] == 1 or d.s[1] % vec == 0) and d.n[2] % vec == 0)


def _flags(task, dtypes, descs, slots) -> dict[str, bool]:
    """``residual`` (an r operand added before the rounding), ``acontig`` / ``bcontig``: a's /
    b's columns have stride 1 (or there is one column); ``aaligned`` / ``baligned``: also
    16-byte aligned starts, row strides and column counts (16-byte vector loads)."""
    a, b = descs[0], descs[1]
    return {"residual": len(task.ins) > 2, "acontig": a.s[2] == 1 or a.n[2] == 1,
            "bcontig": b.s[2] == 1 or b.n[2] == 1, "aaligned": _aligned(a, dtypes[0], slots),
            "baligned": _aligned(b, dtypes[1], slots)}


def _check(task, descs, where) -> None:
    """Every operand's matrix view is the [rows, cols] its role has (M, K, N)."""
    m, k, n = _dims_of(task)
    roles = ["a", "b"] + ["r"] * (len(task.ins) - 2) + ["y"]
    want = {"a": (m, k), "b": (k, n), "r": (m, n), "y": (m, n)}
    for role, d in zip(roles, descs):
        if (d.n[1], d.n[2]) != want[role]:
            raise TableError(f"{where}: gemm operand {role} viewed as [{d.n[1]}, {d.n[2]}], expected "
                             f"{list(want[role])}")


def _dims(task, descs) -> dict[str, int]:
    """The tile's M, N and K: the kernel's gemm blocks need not be larger (runtime)."""
    m, k, n = _dims_of(task)
    return {"gemm_m": m, "gemm_n": n, "gemm_k": k}


LOWERINGS = (
    OpLowering("gemm", ("matrix", "matrix", "matrix", "matrix"), t_gemm, _call,  # a, b, [r], y
               flags=_flags, check=_check, dims=_dims, splits=_splits),
)
