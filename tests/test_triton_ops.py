"""The Triton instruction library (lowering/triton/ops.py), each op alone, against the
ground truth lowering/reference.py.

Every test runs on the CPU under ``TRITON_INTERPRET=1`` (set by ``lowering.triton`` when no
GPU is present) and, marked ``gpu``, compiled on a CUDA device. Only one of the two modes
exists per process (Triton decides at import), so the other parametrisation is skipped.
Operands are deliberately strided views (column slices, transposes, heads of a cache) so
the flat / matrix / cache addressing is exercised, not just contiguous vectors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from lowering.reference import INT_POISON, apply_op
from lowering.triton import standalone as O
from lowering.triton.lang import interpreting

INTERP = interpreting()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERP, reason="interpreter mode not active")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(INTERP or not torch.cuda.is_available(),
                                                   reason="needs compiled Triton on a CUDA GPU")]),
]
F32, BF16 = torch.float32, torch.bfloat16
#: GEMV pipeline depths (ops.gemv_ex STAGES): 1 = one block in flight; 2 and 3 = the
#: pipelined loop (Triton's cp.async pipeline on the GPU; the interpreter runs it as a plain
#: loop, which still checks the one-block-ahead x / a prefetch and its masks).
STAGES = [1, 2, 3]


def ref(op, params, ins, outs_like):
    """Run reference.apply_op on CPU copies; returns the outputs."""
    ins = [t.detach().cpu().clone() for t in ins]
    outs = [torch.empty(o.shape, dtype=o.dtype) for o in outs_like]
    apply_op(op, params, ins, outs)
    return outs


def close(got, want, dtype=F32, rtol=None, atol=None):
    got, want = got.detach().cpu().float(), want.float()
    if dtype == BF16:
        rtol, atol = rtol or 1.6e-2, atol or 1.6e-2
    else:
        rtol, atol = rtol or 2e-5, atol or 2e-6
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_embed(device, dt):
    g = gen(1)
    table = torch.randn(11, 40, generator=g).to(dt).to(device)
    for tok in (0, 7, 10):
        y = torch.full((2, 40), float("nan"), dtype=dt, device=device)[1]  # a row of a bigger buffer
        token = torch.tensor([tok], dtype=torch.int32, device=device)
        O.run_embed(table, token, y, block=16)
        (want,) = ref("embed", {}, [table, token], [y])
        assert torch.equal(y.cpu(), want)
    # a column slice of the table (row stride != row length) and an f32 output of a bf16 table
    y32 = torch.empty(20, dtype=F32, device=device)
    O.run_embed(table[:, 10:30], torch.tensor([3], dtype=torch.int32, device=device), y32, block=16)
    assert torch.equal(y32.cpu(), table[3, 10:30].float().cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_rmsnorm(device, dt):
    g = gen(2)
    # one group (hidden) and per-head groups (qwen3 q_norm): dim = 24 over 3 heads, block < dim
    for rows, dim in ((1, 96), (3, 24)):
        x = (torch.randn(rows * dim, generator=g) * 3).to(dt).to(device)
        w = torch.randn(dim, generator=g).to(dt).to(device)
        y = torch.empty(rows * dim, dtype=dt, device=device)
        O.run_rmsnorm(x, w, y, dim, 1e-5, block=16)
        (want,) = ref("rmsnorm", {"dim": dim, "eps": 1e-5}, [x, w], [y])
        close(y, want, dt)
    # strided input (every other element of a buffer) and in place
    buf = torch.randn(2 * 64, generator=g).to(device)
    x = buf[::2]
    (want,) = ref("rmsnorm", {"dim": 64, "eps": 1e-6}, [x, torch.ones(64)], [x])
    O.run_rmsnorm(x, torch.ones(64, device=device), x, 64, 1e-6, block=32)
    close(x, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("stages", STAGES)
def test_gemv(device, dt, stages):
    g = gen(3)
    W = torch.randn(48, 80, generator=g).to(dt).to(device)
    x = torch.randn(80, generator=g).to(dt).to(device)
    b = torch.randn(48, generator=g).to(dt).to(device)
    cases = [
        (W[5:38], x, None),                   # a row tile, contiguous rows
        (W[:, 8:72], x[8:72], b),             # a column slice: row stride 80, K = 64
        (W.t()[10:30], W[:, 3], None),        # transposed view: column stride 80, strided x
        (W[7:8], x, b[:1]),                   # a single row (N = 1)
    ]
    for w, xv, bias in cases:
        n = w.shape[0]
        y = torch.empty(n, dtype=dt, device=device)
        O.run_gemv(xv, w, y, bias=bias, block_n=8, block_k=32, stages=stages)
        ins = [xv, w] + ([bias] if bias is not None else [])
        (want,) = ref("gemv", {}, ins, [y])
        close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)
    # the aligned fast path (row stride and K multiples of 16 bytes)
    y = torch.empty(48, dtype=dt, device=device)
    O.run_gemv(x, W, y, block_n=16, block_k=64, w_align=16 // W.element_size(), stages=stages)
    (want,) = ref("gemv", {}, [x, W], [y])
    close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_rope(device, dt):
    g = gen(4)
    for hd, heads in ((16, 3), (64, 2)):
        inv = (1.0 / 10000 ** (torch.arange(0, hd, 2, dtype=F32) / hd)).to(device)
        for pos in (0, 1, 37, 4000):  # 4000 rad: the GPU must not use the approximate cos/sin
            x = torch.randn(heads * hd, generator=g).to(dt).to(device)
            p = torch.tensor([pos], dtype=torch.int32, device=device)
            y = torch.empty_like(x)
            O.run_rope(x, inv, p, y, hd, block=4)
            (want,) = ref("rope", {"head_dim": hd}, [x, inv, p], [y])
            close(y, want, dt, atol=2e-5 if dt == F32 else None)
            O.run_rope(x, inv, p, x, hd, block=64)  # in place
            close(x, want, dt, atol=2e-5 if dt == F32 else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_kv_append(device, dt):
    g = gen(5)
    G, S, D = 3, 7, 16
    big = torch.randn(4, S, D, generator=g).to(dt).to(device)
    head0 = big[0].cpu().clone()
    kc, vc = big[1:4], torch.randn(G, S, D, generator=g).to(dt).to(device)  # kc: heads 1..3 of a cache
    for pos in (0, 3, S - 1):
        k = torch.randn(G * D, generator=g).to(device)  # f32 source into a dt cache
        v = torch.randn(G * D, generator=g).to(device)
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        wk, wv = kc.cpu().clone(), vc.cpu().clone()
        apply_op("kv_append", {"head_dim": D}, [k.cpu(), v.cpu(), p.cpu()], [wk, wv])
        O.run_kv_append(k, v, p, kc, vc, block=8)
        assert torch.equal(kc.cpu(), wk) and torch.equal(vc.cpu(), wv)
    assert torch.equal(big[0].cpu(), head0)  # only the addressed heads are written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("hq,G,D", [(6, 2, 16), (3, 1, 32), (4, 4, 8)])
def test_attention(device, dt, hq, G, D):
    g = gen(6)
    S = 11
    kc = torch.randn(G, S, D, generator=g).to(dt).to(device)
    vc = torch.randn(G, S, D, generator=g).to(dt).to(device)
    scale = 1.0 / math.sqrt(D)
    for pos in (0, 4, S - 1):  # block_t = 4: one, two and three position blocks
        q = (torch.randn(hq * D, generator=g) * 2).to(dt).to(device)
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        o = torch.empty(hq * D, dtype=dt, device=device)
        O.run_attention(q, kc, vc, p, o, scale, block_t=4)
        (want,) = ref("attention", {"head_dim": D, "scale": scale}, [q, kc, vc, p], [o])
        close(o, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-5 if dt == F32 else None)
    # rows beyond pos are never read: poison them
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[:, 3:], vc2[:, 3:] = float("nan"), float("nan")
    q = torch.randn(hq * D, generator=g).to(dt).to(device)
    o = torch.empty(hq * D, dtype=dt, device=device)
    O.run_attention(q, kc2, vc2, torch.tensor([2], dtype=torch.int32, device=device), o, scale, block_t=8)
    assert not torch.isnan(o.cpu().float()).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_silu_mul_add(device, dt):
    g = gen(7)
    a = (torch.randn(300, generator=g) * 4).to(dt).to(device)
    b = torch.randn(300, generator=g).to(dt).to(device)
    y = torch.empty(300, dtype=dt, device=device)
    O.run_silu_mul(a, b, y, block=64)
    (want,) = ref("silu_mul", {}, [a, b], [y])
    close(y, want, dt, rtol=1e-5 if dt == F32 else None, atol=1e-6 if dt == F32 else None)
    O.run_add(a, b, y, block=64)
    (want,) = ref("add", {}, [a, b], [y])
    assert torch.equal(y.cpu(), want)  # one fp32 add, one rounding: exact
    # strided operands: a [3, 10] box of a [5, 12] buffer
    buf = torch.randn(5, 12, generator=g).to(device)
    box = buf[1:4, 2:12]
    out = torch.empty(30, device=device)
    O.run_add(box, box, out, block=16)
    assert torch.equal(out.cpu(), (box * 2).reshape(-1).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_reduce(device):
    g = gen(8)
    P = torch.randn(4, 3, 50, generator=g).to(device)
    res = torch.randn(50, generator=g).to(device)
    for part, r in ((P[0], res), (P[:, 1], None), (P[2, 1:2], res)):  # k = 3, 4 (strided), 1
        y = torch.empty(50, device=device)
        O.run_reduce(part, y, residual=r, block=16)
        ins = [part] + ([r] if r is not None else [])
        (want,) = ref("reduce", {}, ins, [y])
        assert torch.equal(y.cpu(), want)  # same summation order as the reference: bit-exact


@pytest.mark.parametrize("device", DEVICES)
def test_argmax(device):
    g = gen(9)
    x = torch.randn(300, generator=g)
    x[120], x[250] = 9.0, 9.0  # tie: lowest index wins, across blocks
    cases = [x, x.clone(), torch.full((70,), float("-inf")), torch.randn(5, generator=g)]
    cases[1][200] = float("nan")  # NaN counts as the maximum
    cases[1][280] = float("nan")
    for v in cases:
        v = v.to(device)
        y = torch.empty(2, device=device)
        O.run_argmax(v, y, offset=1000, block=64)
        (want,) = ref("argmax", {"offset": 1000}, [v], [y])
        torch.testing.assert_close(y.cpu(), want, equal_nan=True, rtol=0, atol=0)
    yb = torch.empty(2, device=device)
    O.run_argmax(x.to(BF16).to(device)[::3], yb, offset=0, block=32)  # strided bf16 logits
    (want,) = ref("argmax", {"offset": 0}, [x.to(BF16)[::3]], [yb])
    assert torch.equal(yb.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_combine(device):
    nan = float("nan")
    cases = [
        [[1.0, 5.0], [3.0, 9.0], [3.0, 7.0], [2.0, 1.0]],   # tie on value: smallest index 7
        [[1.0, 5.0], [nan, 9.0], [3.0, 7.0], [nan, 8.0]],   # NaN is the largest: 8
        [[4.0, 2.5], [1.0, 3.0]],                           # chosen index not an integer: poison
        [[4.0, nan], [1.0, 3.0]],                           # chosen index NaN: poison
        [[4.0, 2.5], [5.0, 3.0]],                           # a bad index that is not chosen is fine
        [[-1.0, 12.0]],
    ]
    for c in cases:
        pairs = torch.tensor(c, device=device)
        tok = torch.empty(1, dtype=torch.int32, device=device)
        O.run_argmax_combine(pairs, tok, block=2)
        (want,) = ref("argmax_combine", {}, [pairs], [tok])
        assert tok.item() == want.item(), (c, tok.item(), want.item())
    assert INT_POISON == -(2**31)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_rounding(device):
    g = gen(10)
    x = torch.randn(500, generator=g)
    # exact halfway cases between two bf16 values: round to nearest even
    base = torch.tensor([1.0, 1.0078125, -3.0, 2.0 ** -120], dtype=F32)
    half = base + base.abs() * 2.0 ** -9 * torch.tensor([1.0, 1.0, 1.0, 0.0])
    x = torch.cat([x, base, half, torch.tensor([float("inf"), float("nan"), 3.4e38])]).to(device)
    y = torch.empty(x.numel(), dtype=BF16, device=device)
    O.run_copy(x, y, block=128)
    assert torch.equal(y.cpu().view(torch.int16)[:-2], x.cpu().to(BF16).view(torch.int16)[:-2])
    assert torch.isnan(y.cpu()[-2].float())
    assert torch.equal(y.cpu()[-1:], x.cpu()[-1:].to(BF16))
    i = torch.randint(-1000, 1000, (33,), generator=g, dtype=torch.int32).to(device)
    j = torch.empty(33, dtype=torch.int32, device=device)
    O.run_copy(i, j, block=16)
    assert torch.equal(i.cpu(), j.cpu())


# ---------------------------------------------------------------- fused ops (issue 5)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("stages", STAGES)
def test_norm_gemv(device, dt, stages):
    """RMSNorm fused into the GEMV prologue: every tile normalises the whole x first."""
    g = gen(11)
    W = torch.randn(40, 96, generator=g).to(dt).to(device)
    x = (torch.randn(96, generator=g) * 3).to(dt).to(device)
    nw = torch.randn(96, generator=g).to(dt).to(device)
    b = torch.randn(40, generator=g).to(dt).to(device)
    for w, bias, bk in ((W[3:29], None, 32), (W[:9], b[:9], 64), (W[:, :], b, 128)):
        y = torch.empty(w.shape[0], dtype=dt, device=device)
        O.run_gemv_ex(x, nw, w, y, pro=1, eps=1e-5, bias=bias, block_n=8, block_k=bk, stages=stages)
        ins = [x, nw, w] + ([bias] if bias is not None else [])
        (want,) = ref("norm_gemv", {"eps": 1e-5}, ins, [y])
        close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)
    # a strided x (a column of a matrix) and norm weight
    X = torch.randn(96, 3, generator=g).to(dt).to(device)
    y = torch.empty(40, dtype=dt, device=device)
    O.run_gemv_ex(X[:, 1], X[:, 2], W, y, pro=1, eps=1e-6, block_n=16, block_k=32, stages=stages)
    (want,) = ref("norm_gemv", {"eps": 1e-6}, [X[:, 1], X[:, 2], W], [y])
    close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("stages", STAGES)
def test_gemv_res_and_swiglu_gemv(device, dt, stages):
    g = gen(12)
    W = torch.randn(36, 64, generator=g).to(dt).to(device)
    x = torch.randn(64, generator=g).to(dt).to(device)
    u = torch.randn(64, generator=g).to(dt).to(device)
    r = torch.randn(36, generator=g).to(dt).to(device)
    tol = dict(rtol=1e-4, atol=1e-4) if dt == F32 else {}
    y = torch.empty(36, dtype=dt, device=device)
    O.run_gemv_ex(x, x, W, y, pro=0, bias=r, block_n=8, block_k=32, stages=stages)  # gemv_res
    (want,) = ref("gemv_res", {}, [x, W, r], [y])
    close(y, want, dt, **tol)
    for res in (None, r):
        y = torch.empty(36, dtype=dt, device=device)
        O.run_gemv_ex(x, u, W, y, pro=2, bias=res, block_n=16, block_k=64, stages=stages)
        (want,) = ref("swiglu_gemv", {}, [x, u, W] + ([res] if res is not None else []), [y])
        close(y, want, dt, **tol)
    # in place over the residual (y IS r), as the table allows for gemv_res / swiglu_gemv
    rr = r.clone()
    (want,) = ref("gemv_res", {}, [x, W, rr], [rr])
    O.run_gemv_ex(x, x, W, rr, pro=0, bias=rr, block_n=8, block_k=32, stages=stages)
    close(rr, want, dt, **tol)


#: (N, K, BLOCK_N, BLOCK_K): ragged last row block and K block; K shorter than one block;
#: K an exact multiple of BLOCK_K (the prefetch past the last block is fully masked); a
#: single row block with N < BLOCK_N; more than 2 K blocks (the pipeline's steady state).
ODD_GEMV = [(37, 203, 16, 64), (5, 19, 8, 32), (24, 128, 8, 32), (3, 96, 16, 256), (9, 520, 8, 64)]


def _check_gemv_ex_odd_sizes(device, dt, pro: int, seed: int, **run_kw):
    """run_gemv_ex with prologue ``pro`` (0 plain, 1 norm, 2 swiglu) over every ODD_GEMV
    size, with and without the epilogue vector (bias or residual: gemv_res), contiguous and
    strided x, plain and 16-byte aligned W, against reference.py; ``run_kw`` (stages,
    x_stage, unroll) go to run_gemv_ex."""
    g = gen(seed)
    tol = dict(rtol=1e-4, atol=1e-4) if dt == F32 else {}
    for n, k, bn, bk in ODD_GEMV:
        W = torch.randn(n, k, generator=g).to(dt).to(device)
        X = (torch.randn(k, 2, generator=g) * 2).to(dt).to(device)
        a = torch.randn(k, generator=g).to(dt).to(device)
        r = torch.randn(n, generator=g).to(dt).to(device)
        vec = 16 // W.element_size()
        align = vec if k % vec == 0 else 0
        for x, bias in ((X[:, 0].contiguous(), None), (X[:, 1], r)):
            y = torch.full((n,), float("nan"), dtype=dt, device=device)
            if pro == 0:
                op, params, ins = ("gemv_res" if bias is not None else "gemv"), {}, [x, W]
            elif pro == 1:
                op, params, ins = "norm_gemv", {"eps": 1e-5}, [x, a, W]
            else:
                op, params, ins = "swiglu_gemv", {}, [x, a, W]
            O.run_gemv_ex(x, a if pro else x, W, y, pro=pro, eps=params.get("eps", 0.0), bias=bias, block_n=bn,
                          block_k=bk, w_align=align, **run_kw)
            (want,) = ref(op, params, ins + ([bias] if bias is not None else []), [y])
            assert not torch.isnan(y.cpu()).any(), (n, k, bn, bk)  # every row written
            close(y, want, dt, **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("pro", [0, 1, 2], ids=["plain", "norm", "swiglu"])
def test_gemv_ex_odd_sizes_every_prologue(device, dt, stages, pro):
    """gemv_ex at every STAGES with sizes that are not multiples of the blocks, every
    prologue (gemv / norm_gemv / swiglu_gemv), against reference.py (_check_gemv_ex_odd_sizes)."""
    _check_gemv_ex_odd_sizes(device, dt, pro, 20 + pro, stages=stages)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("unroll", [1, 2, 8])
@pytest.mark.parametrize("pro", [1, 2], ids=["norm", "swiglu"])
def test_gemv_ex_x_stage(device, dt, unroll, pro):
    """X_STAGE (f(x) staged once in a scratch vector, then a plain weight loop) against
    reference.py at every odd size, each unroll form of the weight loop
    (_check_gemv_ex_odd_sizes)."""
    _check_gemv_ex_odd_sizes(device, dt, pro, 40 + pro, x_stage=True, unroll=unroll)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_rope_append(device, dt):
    g = gen(13)
    G, S, D = 2, 9, 16
    inv = (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=F32) / D)).to(device)
    big = torch.randn(3, S, D, generator=g).to(dt).to(device)
    kc, vc = big[1:3], torch.randn(G, S, D, generator=g).to(dt).to(device)
    for pos in (0, 5, S - 1):
        k = torch.randn(G * D, generator=g).to(dt).to(device)
        v = torch.randn(G * D, generator=g).to(dt).to(device)
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        wk, wv = kc.cpu().clone(), vc.cpu().clone()
        apply_op("rope_append", {"head_dim": D}, [k.cpu(), v.cpu(), inv.cpu(), p.cpu()], [wk, wv])
        O.run_rope_append(k, v, inv, p, kc, vc, block=4)
        close(kc, wk, dt, atol=2e-5 if dt == F32 else None)
        assert torch.equal(vc.cpu(), wv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("hq,G,D", [(6, 2, 16), (2, 2, 8)])
def test_rope_attention(device, dt, hq, G, D):
    g = gen(14)
    S = 10
    inv = (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=F32) / D)).to(device)
    kc = torch.randn(G, S, D, generator=g).to(dt).to(device)
    vc = torch.randn(G, S, D, generator=g).to(dt).to(device)
    scale = 1.0 / math.sqrt(D)
    for pos in (0, 3, S - 1):
        q = (torch.randn(hq * D, generator=g) * 2).to(dt).to(device)
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        o = torch.empty(hq * D, dtype=dt, device=device)
        O.run_attention(q, kc, vc, p, o, scale, block_t=4, inv_freq=inv)
        (want,) = ref("rope_attention", {"head_dim": D, "scale": scale}, [q, kc, vc, p, inv], [o])
        close(o, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-5 if dt == F32 else None)
        # and it differs from plain attention (the rotation is really applied) for pos > 0
        if pos > 0:
            (plain,) = ref("attention", {"head_dim": D, "scale": scale}, [q, kc, vc, p], [o])
            assert not torch.allclose(o.cpu().float(), plain.float(), atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("hq,G,D", [(6, 2, 16), (2, 2, 8)])
def test_rope_attention_kv(device, dt, hq, G, D):
    """Position pos from the current k and v (the caches' rows pos.. hold NaN and must not be
    read); matches the reference and leaves the caches untouched."""
    g = gen(15)
    S = 10
    inv = (1.0 / 10000 ** (torch.arange(0, D, 2, dtype=F32) / D)).to(device)
    scale = 1.0 / math.sqrt(D)
    for pos in (0, 3, 4, S - 1):
        kc = torch.randn(G, S, D, generator=g).to(dt)
        vc = torch.randn(G, S, D, generator=g).to(dt)
        kc[:, pos:] = float("nan")
        vc[:, pos:] = float("nan")
        kc, vc = kc.to(device), vc.to(device)
        q = (torch.randn(hq * D, generator=g) * 2).to(dt).to(device)
        k = torch.randn(G * D, generator=g).to(dt).to(device)
        v = torch.randn(G * D, generator=g).to(dt).to(device)
        p = torch.tensor([pos], dtype=torch.int32, device=device)
        o = torch.empty(hq * D, dtype=dt, device=device)
        kc0 = kc.clone()
        O.run_attention(q, kc, vc, p, o, scale, block_t=4, inv_freq=inv, kv_new=(k, v))
        (want,) = ref("rope_attention_kv", {"head_dim": D, "scale": scale}, [q, k, v, kc, vc, p, inv], [o])
        assert not o.isnan().any()
        close(o, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-5 if dt == F32 else None)
        assert torch.equal(kc.isnan(), kc0.isnan())


@pytest.mark.parametrize("device", DEVICES)
def test_argmax_wide_block(device):
    """The one-pass argmax: ties across lanes and blocks keep the first index."""
    g = gen(15)
    x = torch.randn(5000, generator=g).to(device)
    x[4321] = 9.0
    x[1234] = 9.0  # an earlier tie in another lane
    x[777] = 9.0   # and in the same block as... an earlier block
    y = torch.empty(2, device=device)
    O.run_argmax(x, y, offset=10, block=512)
    assert y.cpu().tolist() == [9.0, 787.0]
    x2 = torch.full((300,), float("-inf"), device=device)
    O.run_argmax(x2, y, offset=0, block=128)
    (want,) = ref("argmax", {"offset": 0}, [x2], [y])
    assert torch.equal(y.cpu(), want)


# ---------------------------------------------------------------- GEMV pipeline, compiled offline
_COMPILE_GEMV = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lowering.triton import standalone as O

stages, bn, bk, warps = (int(v) for v in sys.argv[1:5])
fn = O._k_gemv_ex
ptrs = {"x", "a", "w", "b", "y"}
cx = dict(PRO=1, HAS_BIAS=True, X_CONTIG=True, W_CONTIG=True, W_ALIGN=8, BLOCK_N=bn, BLOCK_K=bk,
          GEMV_STAGES=stages, X_STAGE=False, UNROLL=1)
sig = {n: "constexpr" if n in cx else "*bf16" if n in ptrs else "*fp32" if n == "XS" else "fp32" if n == "eps"
       else "i32" for n in fn.arg_names}
# what the jit's specialisation gives a launch with 16-aligned pointers, row stride and K
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in ptrs | {"w_rs", "K"}}
k = triton.compile(ASTSource(fn, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=warps))
ptx = k.asm["ptx"]
out = dict(cp_async=ptx.count("cp.async.cg.shared.global"), wait_group="cp.async.wait_group" in ptx,
           v4=len(re.findall(r"ld\.global(\.[\w:]+)*\.v4", ptx)), shared=int(k.metadata.shared), local=None)
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
if os.path.exists(tool):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", subprocess.run([tool, "--dump-resource-usage", f.name],
                                                                   capture_output=True, text=True).stdout)
    if m:
        out["regs"], out["local"] = int(m.group(1)), int(m.group(2))
print(json.dumps(out))
"""


def _offline(code: str, *args) -> dict:
    """Run ``code`` (an offline sm_90 compile that prints one JSON line) in a subprocess with
    TRITON_INTERPRET=0: Triton's own LLVM and ptxas, no GPU needed."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root), TRITON_DEFAULT_FP_FUSION="1")
    res = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env=env, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _compile_gemv(stages: int, bn: int, bk: int, warps: int = 8) -> dict:
    """The standalone norm_gemv kernel (bf16, 16-byte aligned W) compiled for sm_90: async
    copies, 16-byte loads, shared memory, registers and local (spill) bytes."""
    return _offline(_COMPILE_GEMV, stages, bn, bk, warps)


def test_gemv_stages_compile_for_sm90():
    """STAGES = 1 streams W with 16-byte register loads and no async copies; STAGES = 3 makes
    Triton's pipeliner stream W with cp.async.cg (16 B) into 2 shared-memory buffers of one
    [BLOCK_N, BLOCK_K] block each; neither spills registers (8 warps, 32 x 512 bf16).
    Runs on CPU and GPU machines alike (a subprocess compiles offline), so on a GPU machine
    it checks that machine's Triton version pipelines these loads too."""
    one = _compile_gemv(1, 32, 512)
    three = _compile_gemv(3, 32, 512)
    assert one["cp_async"] == 0 and one["v4"] >= 8, one
    assert three["cp_async"] > 0 and three["wait_group"], three
    assert three["shared"] >= 2 * 32 * 512 * 2, three  # two bf16 blocks in flight
    for rep in (one, three):
        if rep["local"] is not None:
            assert rep["local"] == 0 and rep["regs"] <= 255, rep


@pytest.mark.skipif(not INTERP, reason="interpreter mode not active")
def test_megakernel_fused_gemvs_pipelined():
    """The megakernel with Blocks(gemv_stages=S) runs the fused GEMVs (norm_gemv prologue,
    swiglu_gemv, gemv_res epilogue) of a lowered tiny Llama and matches the sim backend for
    S = 3 (S = 1 is test_triton_megakernel.py's fused test), with GEMV_K = 64 below the
    model's K (96 hidden: one full and one ragged block; the MLP's K: several blocks)."""
    from lowering.sim import SimExecutor
    from lowering.triton import TritonExecutor
    from lowering.triton.runtime import Blocks
    from tests.test_triton_megakernel import TOKENS, lowered, run_decode

    prog, init, _ = lowered("tiny-llama", workers=3, dtype="f32", fuse=True)
    assert {"norm_gemv", "gemv_res", "swiglu_gemv"} <= {t.op for t in prog.tasks}
    want = run_decode(SimExecutor(prog, init, check=False, policy="in_order"), TOKENS[:2])
    ex = TritonExecutor(prog, init, check=False, blocks=Blocks(gemv_n=32, gemv_k=64, gemv_stages=3))
    assert ex._launch_options()["GEMV_STAGES"] == 3
    for (lg, nt), (ls, ns) in zip(run_decode(ex, TOKENS[:2]), want):
        torch.testing.assert_close(lg, ls, rtol=1e-4, atol=2e-5)
        assert nt == ns


@pytest.mark.skipif(not INTERP, reason="interpreter mode not active")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_megakernel_fused_gemvs_tma(dtype):
    """Blocks(gemv_tma=True): every aligned contiguous GEMV variant of a fused tiny Llama
    streams W through a tensor descriptor (ops.gemv_ex W_TMA), with 64-row blocks taller
    than the 32-row tiles (TMA fills rows past N with zeros) and K blocks that leave a
    ragged last block, and matches the sim backend, logits and tokens, for f32 and bf16."""
    from lowering.sim import SimExecutor
    from lowering.triton import TritonExecutor
    from lowering.triton.runtime import Blocks
    from tests.test_triton_megakernel import TOKENS, lowered, run_decode

    prog, init, _ = lowered("tiny-llama", workers=3, dtype=dtype, fuse=True)
    want = run_decode(SimExecutor(prog, init, check=False, policy="in_order"), TOKENS[:2])
    ex = TritonExecutor(prog, init, check=False, blocks=Blocks(gemv_n=64, gemv_k=64, gemv_stages=3, gemv_tma=True))
    assert ex._launch_options()["GEMV_TMA"] is True
    assert "W_TMA=GEMV_TMA" in ex.source  # the GEMV variants take the descriptor path
    tol = dict(rtol=1e-4, atol=2e-5) if dtype == "f32" else dict(rtol=2e-2, atol=2e-2)
    for (lg, nt), (ls, ns) in zip(run_decode(ex, TOKENS[:2]), want):
        torch.testing.assert_close(lg, ls, **tol)
        assert nt == ns


def test_blocks_gemv_tma_rules():
    """gemv_tma is refused, with the rule named, without a pipeline (gemv_stages 1), with
    w_preload, or with a block wider than a TMA box (256)."""
    from lowering.triton.runtime import Blocks, TritonError

    Blocks(gemv_n=64, gemv_k=128, gemv_stages=4, gemv_tma=True)
    for kw, msg in ((dict(gemv_stages=1), "--gemv-stages 2..8"), (dict(gemv_stages=4, w_preload=1024), "--w-preload 0"),
                    (dict(gemv_stages=4, gemv_k=512), "at most 256")):
        with pytest.raises(TritonError, match=msg):
            Blocks(**{"gemv_n": 64, "gemv_k": 128, **kw, "gemv_tma": True})


_COMPILE_MEGAKERNEL = r"""
import json, re, sys
import triton
from lowering.triton import offline as M

seen = {}
_compile = triton.compile
def spy(*a, **kw):
    k = _compile(*a, **kw)
    seen["ptx"] = k.asm["ptx"]
    return k
M.triton.compile = spy
cx = json.loads(sys.argv[2])
text = open(sys.argv[1]).read()
meta = json.loads([l for l in text.splitlines() if l.startswith("# amk-launch: ")][0][len("# amk-launch: "):])
rep = M.compile_offline(text, {**meta["constexprs"], **cx}, 90, int(sys.argv[3]),
                        int(sys.argv[4]) if len(sys.argv) > 4 else None)
rep["cp_async"] = seen["ptx"].count("cp.async.cg.shared.global")
rep["tma_copies"] = seen["ptx"].count("cp.async.bulk.tensor")
print(json.dumps(rep))
"""


@pytest.mark.skipif(not INTERP, reason="the offline compile runs where the tests use the interpreter")
def test_megakernel_gemv_stages_compile_for_sm90(tmp_path):
    """GEMV_STAGES reaches every GEMV variant of the generated megakernel: a fused bf16
    tiny Llama (norm_gemv, gemv_res, swiglu_gemv) compiled for sm_90 at 8 warps and 32 x 512
    blocks has async weight copies with GEMV_STAGES = 3 and none with 1, and no spills."""
    from lowering.triton import TritonExecutor
    from tests.test_triton_megakernel import lowered

    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True)
    src = TritonExecutor(prog, init, check=False).emit_source(tmp_path / "kernel.py")
    reps = {s: _offline(_COMPILE_MEGAKERNEL, src, json.dumps({"GEMV_N": 32, "GEMV_K": 512, "GEMV_STAGES": s}), 8)
            for s in (1, 3)}
    assert reps[1]["cp_async"] == 0 and reps[1]["vector_loads"], reps[1]
    # 3 GEMV variants, each with a prologue and a steady-state copy of its W block
    assert reps[3]["cp_async"] >= 3 * 2, reps[3]
    for rep in reps.values():
        if rep["regs"] is not None:
            assert rep["regs"] <= 255 and rep["local_bytes"] == 0, rep


@pytest.mark.skipif(not INTERP, reason="the offline compile runs where the tests use the interpreter")
def test_megakernel_gemv_tma_compile_for_sm90(tmp_path):
    """GEMV_TMA with GEMV_STAGES = 5 and 64 x 128 blocks (bf16 fused tiny Llama, 8 warps,
    sm_90): the GEMV variants stream W with TMA copies (cp.async.bulk.tensor), 4 blocks of
    16 KB in shared memory, no cp.async register-path copies of W, and no spills."""
    from lowering.triton import TritonExecutor
    from tests.test_triton_megakernel import lowered

    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True)
    src = TritonExecutor(prog, init, check=False).emit_source(tmp_path / "kernel.py")
    rep = _offline(_COMPILE_MEGAKERNEL, src, json.dumps({"GEMV_N": 64, "GEMV_K": 128, "GEMV_STAGES": 5,
                                                         "GEMV_TMA": True}), 8)
    assert rep["tma_copies"] >= 3, rep  # at least one per GEMV variant
    assert rep["shared"] >= 4 * 64 * 128 * 2, rep
    if rep["regs"] is not None:
        assert rep["regs"] <= 255 and rep["local_bytes"] == 0, rep


@pytest.mark.skipif(not INTERP, reason="the offline compile runs where the tests use the interpreter")
def test_megakernel_unroll_compiles_for_sm90(tmp_path):
    """GEMV_UNROLL = 2 and GEMV_UNROLL = 8 over 16 x 128 blocks compile for sm_90 at 8 warps
    with no spills (32-position attention blocks, the kernel's register high-water mark), and
    ROW_PREFETCH (on by default) puts the L1 prefetch of the next table row in the PTX."""
    from lowering.triton import TritonExecutor
    from tests.test_triton_megakernel import lowered

    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True)
    src = TritonExecutor(prog, init, check=False).emit_source(tmp_path / "kernel.py")
    base = {"GEMV_N": 16, "GEMV_K": 512, "GEMV_UNROLL": 2, "ATT_D": 64}
    bcast = _offline(_COMPILE_MEGAKERNEL, src, json.dumps({**base, "ATT_T": 32, "ATT_Q": 4}), 8)
    # the best flags of 2026-11-21 (docs/experiments.md): 16 x 128 blocks unrolled 8 times, no row prefetch
    u8 = _offline(_COMPILE_MEGAKERNEL, src, json.dumps({**base, "GEMV_K": 128, "GEMV_UNROLL": 8,
                                                        "ROW_PREFETCH": False}), 8)
    for rep in (bcast, u8):
        if rep["regs"] is not None:
            assert rep["regs"] <= 255 and rep["local_bytes"] == 0, rep
    # Blocks.row_prefetch is on by default: the emitted launch carries ROW_PREFETCH
    assert bcast["row_prefetch"] and not u8["row_prefetch"], (bcast, u8)
    # the register cap that lets two 8-warp workers share an SM (runtime.register_cap)
    capped = _offline(_COMPILE_MEGAKERNEL, src, json.dumps({**base, "GEMV_K": 128, "GEMV_UNROLL": 8}), 8, 128)
    assert capped["maxnreg"] == 128
    if capped["regs"] is not None:
        assert capped["regs"] <= 128, capped
