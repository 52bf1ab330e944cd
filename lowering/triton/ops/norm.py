"""The norm and elementwise family: ``embed``, ``rmsnorm``, ``silu_mul``, ``add``.

Flat operands (lang.py's conventions), fp32 arithmetic, one rounding to the output dtype.
``embed``'s token is range-checked by the row decoder before it is used as an address
(vm.fail_token).
"""

from __future__ import annotations

import triton.language as tl

from lowering.triton.lang import device, flat_off, store
from lowering.triton.layout import OpLowering, plain_call, TableError
from lowering.triton.vm import arena_ptr, fail_token, operand, param_f, param_i, status_ok


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


# ---------------------------------------------------------------- row decoders
@device
def t_embed(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DTAB: tl.constexpr, DTOK: tl.constexpr,
            DY: tl.constexpr, BLOCK: tl.constexpr):
    """embed (table, token, y); an out-of-range token is refused (vm.fail_token)."""
    to, tn0, tn1, tn2, ts0, ts1, ts2 = operand(row, 0, slot)
    ko, kn0, kn1, kn2, ks0, ks1, ks2 = operand(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 2, slot)
    tok = tl.load(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DTOK) + ko).to(tl.int32)
    if (tok < 0) | (tok >= tn1):
        st = fail_token(err, tok, tn1)
    else:
        embed(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DTAB) + to, ts1, ts2, tok,
              arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, tn2, BLOCK)
        st = status_ok()
    return st


@device
def t_rmsnorm(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DW: tl.constexpr,
              DY: tl.constexpr, BLOCK: tl.constexpr):
    """rmsnorm (x, w, y; params dim, eps)."""
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = operand(row, 0, slot)
    wo, wn0, wn1, wn2, ws0, ws1, ws2 = operand(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 2, slot)
    rmsnorm(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2,
            arena_ptr(A_BF16, A_F16, A_F32, A_I32, DW) + wo, wn1, wn2, ws0, ws1, ws2,
            arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
            xn0 * xn1 * xn2, param_i(row, 0), param_f(row, 1), BLOCK)
    return status_ok()


@device
def t_silu_mul(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DG: tl.constexpr, DU: tl.constexpr,
               DY: tl.constexpr, BLOCK: tl.constexpr):
    """silu_mul (g, u, y)."""
    go, gn0, gn1, gn2, gs0, gs1, gs2 = operand(row, 0, slot)
    uo, un0, un1, un2, us0, us1, us2 = operand(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 2, slot)
    silu_mul(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DG) + go, gn1, gn2, gs0, gs1, gs2,
             arena_ptr(A_BF16, A_F16, A_F32, A_I32, DU) + uo, un1, un2, us0, us1, us2,
             arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
             yn0 * yn1 * yn2, BLOCK)
    return status_ok()


@device
def t_add(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DA: tl.constexpr, DB: tl.constexpr,
          DY: tl.constexpr, BLOCK: tl.constexpr):
    """add (a, b, y)."""
    ao, an0, an1, an2, as0, as1, as2 = operand(row, 0, slot)
    bo, bn0, bn1, bn2, bs0, bs1, bs2 = operand(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 2, slot)
    add(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DA) + ao, an1, an2, as0, as1, as2,
        arena_ptr(A_BF16, A_F16, A_F32, A_I32, DB) + bo, bn1, bn2, bs0, bs1, bs2,
        arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
        yn0 * yn1 * yn2, BLOCK)
    return status_ok()


# ---------------------------------------------------------------- table encoding and dispatch
_call_embed = plain_call("t_embed", "BLOCK")
_call_rmsnorm = plain_call("t_rmsnorm", "BLOCK")
_call_elementwise = plain_call("t_{op}", "BLOCK")


def _check_embed(task, descs, where) -> None:
    """The table's rows hold as many elements as the output."""
    tab, y = descs[0], descs[-1]
    if tab.n[2] != y.numel:
        raise TableError(f"{where}: table rows hold {tab.n[2]} elements, output {y.numel}")


LOWERINGS = (
    OpLowering("embed", ("matrix", "flat", "flat"), t_embed, _call_embed, check=_check_embed),
    OpLowering("rmsnorm", ("flat", "flat", "flat"), t_rmsnorm, _call_rmsnorm,
               params=(("dim", "i"), ("eps", "f")), in_place="same"),
    OpLowering("silu_mul", ("flat", "flat", "flat"), t_silu_mul, _call_elementwise, in_place="same"),
    OpLowering("add", ("flat", "flat", "flat"), t_add, _call_elementwise, in_place="same"),
)
