"""One op alone, outside the megakernel: a thin ``@triton.jit`` kernel per op family device
function and a host launcher (``run_*``) taking torch tensors (views with any strides), for
the unit tests (tests/test_triton_ops.py, CPU under ``TRITON_INTERPRET=1`` and GPU) and the
benches.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowering.triton.layout import merge_axes, pad3
from lowering.triton.ops.attention import attention, kv_append, rope, rope_append
from lowering.triton.ops.comm import copy
from lowering.triton.ops.gemm import gemm
from lowering.triton.ops.gemv import gemv, gemv_ex
from lowering.triton.ops.norm import add, embed, rmsnorm, silu_mul
from lowering.triton.ops.reduce import argmax, argmax_combine, reduce


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
    gemv((x, x_n1, x_n2, x_s0, x_s1, x_s2), (w, w_rs, w_cs), (b, b_n1, b_n2, b_s0, b_s1, b_s2),
         (y, y_n1, y_n2, y_s0, y_s1, y_s2), N, K, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K,
         GEMV_STAGES)


@triton.jit
def _k_gemv_ex(x, x_n1, x_n2, x_s0, x_s1, x_s2, a, a_n1, a_n2, a_s0, a_s1, a_s2, eps,
               w, w_rs, w_cs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
               PRO: tl.constexpr, HAS_BIAS: tl.constexpr, X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr,
               W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GEMV_STAGES: tl.constexpr = 1,
               XS=None, X_STAGE: tl.constexpr = False, UNROLL: tl.constexpr = 1):
    gemv_ex((x, x_n1, x_n2, x_s0, x_s1, x_s2), (a, a_n1, a_n2, a_s0, a_s1, a_s2), eps, (w, w_rs, w_cs),
            (b, b_n1, b_n2, b_s0, b_s1, b_s2), (y, y_n1, y_n2, y_s0, y_s1, y_s2), N, K, PRO, HAS_BIAS, X_CONTIG,
            W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K, GEMV_STAGES, UNROLL=UNROLL, XS=XS, X_STAGE=X_STAGE)


@triton.jit
def _k_gemm(a, a_rs, a_cs, b, b_rs, b_cs, r, r_rs, r_cs, y, y_rs, y_cs, M, N, K, HAS_R: tl.constexpr,
            A_CONTIG: tl.constexpr, B_CONTIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    gemm(a, a_rs, a_cs, b, b_rs, b_cs, r, r_rs, r_cs, y, y_rs, y_cs, M, N, K, HAS_R, A_CONTIG, B_CONTIG,
         BLOCK_M, BLOCK_N, BLOCK_K)


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
                 k=None, k_n1=1, k_n2=1, k_s0=0, k_s1=0, k_s2=1,
                 v=None, v_n1=1, v_n2=1, v_s0=0, v_s1=0, v_s2=1, KV_NEW: tl.constexpr = False):
    attention(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, tl.load(posp),
              o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale, f, f_n1, f_n2, f_s0, f_s1, f_s2, ROPE,
              BLOCK_T, BLOCK_D, BLOCK_Q, 0, k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
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
def _k_reduce(p, p_rs, p_n2, p_s1, p_s2, KP, r, r_n1, r_n2, r_s0, r_s1, r_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2,
              n, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    reduce(p, p_rs, p_n2, p_s1, p_s2, KP, r, r_n1, r_n2, r_s0, r_s1, r_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n,
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


# ---------------------------------------------------------------- host launchers
def flat_desc(t) -> tuple[int, int, int, int, int]:
    """(n1, n2, s0, s1, s2) of a torch tensor view seen as a flat vector (``flat_off``).

    Unit axes are dropped and contiguous neighbours merged until at most 3 axes remain;
    raises ValueError for a view that needs more than 3 strided axes."""
    axes = [(int(n), int(s)) for n, s in zip(t.shape, t.stride()) if n != 1] or [(1, 0)]
    m = merge_axes(axes, 3)
    if m is None:
        raise ValueError(f"tensor view {tuple(t.shape)} / {t.stride()} needs more than 3 strided axes")
    n, s = pad3(m)
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
    """y = rmsnorm(x) * w per group of ``dim`` elements (flat views)."""
    _k_rmsnorm[(1,)](x, *flat_desc(x), w, *flat_desc(w), y, *flat_desc(y), x.numel(), dim, eps,
                     BLOCK=block)


def run_gemv(x, w, y, bias=None, block_n: int = 16, block_k: int = 64, w_align: int = 0,
             stages: int = 1) -> None:
    """y = w @ x (+ bias); w a [N, K] view (any strides); ``stages``: ops/gemv.py gemv_ex's STAGES."""
    n, k, rs, cs = _matrix(w)
    b = bias if bias is not None else y
    xd = flat_desc(x)
    _k_gemv[(1,)](x, *xd, w, rs, cs, b, *flat_desc(b), y, *flat_desc(y), n, k,
                  HAS_BIAS=bias is not None, X_CONTIG=(xd[0] == 1 and xd[2] == 0 and xd[3] == 0),
                  W_CONTIG=cs == 1, W_ALIGN=w_align, BLOCK_N=block_n, BLOCK_K=block_k, GEMV_STAGES=stages)


def run_gemm(a, b, y, r=None, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> None:
    """y = a @ b (+ r): a [M, K], b [K, N], r and y [M, N] 2-D views of any strides (ops/gemm.py
    ``gemm``; blocks powers of two >= 16, one program walks the whole tile)."""
    m, k, a_rs, a_cs = _matrix(a)
    k2, n, b_rs, b_cs = _matrix(b)
    if k2 != k or tuple(y.shape) != (m, n) or (r is not None and tuple(r.shape) != (m, n)):
        raise ValueError(f"run_gemm: a {tuple(a.shape)} @ b {tuple(b.shape)} -> y {tuple(y.shape)}"
                         + (f" + r {tuple(r.shape)}" if r is not None else "") + " do not fit")
    rr = r if r is not None else y
    _k_gemm[(1,)](a, a_rs, a_cs, b, b_rs, b_cs, rr, rr.stride(0), rr.stride(1), y, y.stride(0), y.stride(1),
                  m, n, k, HAS_R=r is not None, A_CONTIG=a_cs == 1, B_CONTIG=b_cs == 1,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def _xcontig(*descs) -> bool:
    return all(d[0] == 1 and d[2] == 0 and d[3] == 0 for d in descs)


def run_gemv_ex(x, a, w, y, pro: int, eps: float = 0.0, bias=None, block_n: int = 16,
                block_k: int = 64, w_align: int = 0, stages: int = 1, x_stage: bool = False,
                unroll: int = 1) -> None:
    """y = w @ f(x) (+ bias) with prologue ``pro`` (PRO_NORM: a = norm weight; PRO_SWIGLU:
    x = gate, a = up); see ops/gemv.py ``gemv_ex`` (``stages``: its STAGES; ``x_stage``: X_STAGE, with a
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
    """kc[:, pos] = rope(k), vc[:, pos] = v (caches [G, S, D] views; pos a 1-element int32 tensor)."""
    g, _, d, *kst = _cache(kc)
    _, _, _, *vst = _cache(vc)
    _k_rope_append[(1,)](k, *flat_desc(k), v, *flat_desc(v), inv_freq, *flat_desc(inv_freq), pos,
                         kc, *kst, vc, *vst, g, d, BLOCK=block)


def run_rope(x, inv_freq, pos, y, head_dim: int, block: int = 64) -> None:
    """y = rope(x) per ``head_dim`` slice at position pos (a 1-element int32 tensor)."""
    _k_rope[(1,)](x, *flat_desc(x), inv_freq, *flat_desc(inv_freq), pos, y, *flat_desc(y), x.numel(),
                  head_dim, BLOCK=block)


def run_kv_append(k, v, pos, kc, vc, block: int = 64) -> None:
    """kc[:, pos] = k, vc[:, pos] = v (caches [G, S, D] views; pos a 1-element int32 tensor)."""
    g, _, d, *kst = _cache(kc)
    _, _, _, *vst = _cache(vc)
    _k_kv_append[(1,)](k, *flat_desc(k), v, *flat_desc(v), pos, kc, *kst, vc, *vst, g, d, BLOCK=block)


def run_attention(q, kc, vc, pos, o, scale: float, block_t: int = 16, inv_freq=None, kv_new=None) -> None:
    """attention, or rope_attention when ``inv_freq`` is given; with ``kv_new`` = (k, v) as
    well, rope_attention_kv."""
    if kv_new is not None and inv_freq is None:
        raise ValueError("run_attention: kv_new (rope_attention_kv) needs inv_freq")
    g, _, d, *kst = _cache(kc)
    _, _, _, *vst = _cache(vc)
    hq = q.numel() // d
    f = inv_freq if inv_freq is not None else q
    kn, vn = kv_new if kv_new is not None else (q, q)
    _k_attention[(1,)](q, *flat_desc(q), kc, *kst, vc, *vst, pos, o, *flat_desc(o), hq, g, d, scale,
                       f, *flat_desc(f), ROPE=inv_freq is not None, BLOCK_T=block_t,
                       BLOCK_D=triton.next_power_of_2(d),
                       BLOCK_Q=triton.next_power_of_2(max(1, hq // g)),
                       k=kn, **dict(zip(("k_n1", "k_n2", "k_s0", "k_s1", "k_s2"), flat_desc(kn))),
                       v=vn, **dict(zip(("v_n1", "v_n2", "v_s0", "v_s1", "v_s2"), flat_desc(vn))),
                       KV_NEW=kv_new is not None)


def run_silu_mul(g, u, y, block: int = _EW) -> None:
    """y = silu(g) * u."""
    _k_silu_mul[(1,)](g, *flat_desc(g), u, *flat_desc(u), y, *flat_desc(y), y.numel(), BLOCK=block)


def run_add(a, b, y, block: int = _EW) -> None:
    """y = a + b."""
    _k_add[(1,)](a, *flat_desc(a), b, *flat_desc(b), y, *flat_desc(y), y.numel(), BLOCK=block)


def run_reduce(p, y, residual=None, block: int = _EW) -> None:
    """y = the sum of the partials p[k] (+ residual): p a [KP, N] view or a [KP, rows, C] one
    (each partial a [rows, C] view of any strides) with N = rows * C = y.numel()."""
    if p.dim() not in (2, 3):
        raise ValueError(f"expected a [KP, N] or [KP, rows, C] view, got shape {tuple(p.shape)}")
    kp, rs = p.shape[0], p.stride(0)
    rows, cols, s1, s2 = (1, p.shape[1], 0, p.stride(1)) if p.dim() == 2 else (*p.shape[1:], *p.stride()[1:])
    r = residual if residual is not None else y
    _k_reduce[(1,)](p, rs, cols, s1, s2, kp, r, *flat_desc(r), y, *flat_desc(y), y.numel(),
                    HAS_RES=residual is not None, BLOCK=block)


def run_argmax(x, y, offset: int, block: int = _EW) -> None:
    """y = (max(x), offset + first argmax(x)) as two fp32."""
    _k_argmax[(1,)](x, *flat_desc(x), x.numel(), offset, y, *flat_desc(y), BLOCK=block)


def run_argmax_combine(pairs, tok, block: int = 16) -> None:
    """tok = the index of the (value, index) pair of ``pairs`` ([KP, 2]) with the largest value."""
    kp, _, rs, cs = _matrix(pairs)
    _k_argmax_combine[(1,)](pairs, rs, cs, kp, tok, BLOCK=block)


def run_copy(x, y, block: int = _EW) -> None:
    """y = x converted to y's dtype."""
    _k_copy[(1,)](x, *flat_desc(x), y, *flat_desc(y), y.numel(), BLOCK=block)
