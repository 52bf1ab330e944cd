"""The Triton instruction library (lowering/triton/ops.py), each op alone, against the
ground truth lowering/reference.py.

Every test runs on the CPU under ``TRITON_INTERPRET=1`` (set by ``lowering.triton`` when no
GPU is present) and, marked ``gpu``, compiled on a CUDA device. Only one of the two modes
exists per process (Triton decides at import), so the other parametrisation is skipped.
Operands are deliberately strided views (column slices, transposes, heads of a cache) so
the flat / matrix / cache addressing is exercised, not just contiguous vectors.
"""

from __future__ import annotations

import math

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from lowering.reference import INT_POISON, apply_op
from lowering.triton import ops as O

INTERP = O.interpreting()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERP, reason="interpreter mode not active")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(INTERP or not torch.cuda.is_available(),
                                                   reason="needs compiled Triton on a CUDA GPU")]),
]
F32, BF16 = torch.float32, torch.bfloat16


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
def test_gemv(device, dt):
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
        O.run_gemv(xv, w, y, bias=bias, block_n=8, block_k=32)
        ins = [xv, w] + ([bias] if bias is not None else [])
        (want,) = ref("gemv", {}, ins, [y])
        close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)
    # the aligned fast path (row stride and K multiples of 16 bytes)
    y = torch.empty(48, dtype=dt, device=device)
    O.run_gemv(x, W, y, block_n=16, block_k=64, w_align=16 // W.element_size())
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
def test_norm_gemv(device, dt):
    """RMSNorm fused into the GEMV prologue: every tile normalises the whole x first."""
    g = gen(11)
    W = torch.randn(40, 96, generator=g).to(dt).to(device)
    x = (torch.randn(96, generator=g) * 3).to(dt).to(device)
    nw = torch.randn(96, generator=g).to(dt).to(device)
    b = torch.randn(40, generator=g).to(dt).to(device)
    for w, bias, bk in ((W[3:29], None, 32), (W[:9], b[:9], 64), (W[:, :], b, 128)):
        y = torch.empty(w.shape[0], dtype=dt, device=device)
        O.run_gemv_ex(x, nw, w, y, pro=1, eps=1e-5, bias=bias, block_n=8, block_k=bk)
        ins = [x, nw, w] + ([bias] if bias is not None else [])
        (want,) = ref("norm_gemv", {"eps": 1e-5}, ins, [y])
        close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)
    # a strided x (a column of a matrix) and norm weight
    X = torch.randn(96, 3, generator=g).to(dt).to(device)
    y = torch.empty(40, dtype=dt, device=device)
    O.run_gemv_ex(X[:, 1], X[:, 2], W, y, pro=1, eps=1e-6, block_n=16, block_k=32)
    (want,) = ref("norm_gemv", {"eps": 1e-6}, [X[:, 1], X[:, 2], W], [y])
    close(y, want, dt, rtol=1e-4 if dt == F32 else None, atol=1e-4 if dt == F32 else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16])
def test_gemv_res_and_swiglu_gemv(device, dt):
    g = gen(12)
    W = torch.randn(36, 64, generator=g).to(dt).to(device)
    x = torch.randn(64, generator=g).to(dt).to(device)
    u = torch.randn(64, generator=g).to(dt).to(device)
    r = torch.randn(36, generator=g).to(dt).to(device)
    tol = dict(rtol=1e-4, atol=1e-4) if dt == F32 else {}
    y = torch.empty(36, dtype=dt, device=device)
    O.run_gemv_ex(x, x, W, y, pro=0, bias=r, block_n=8, block_k=32)  # gemv_res
    (want,) = ref("gemv_res", {}, [x, W, r], [y])
    close(y, want, dt, **tol)
    for res in (None, r):
        y = torch.empty(36, dtype=dt, device=device)
        O.run_gemv_ex(x, u, W, y, pro=2, bias=res, block_n=16, block_k=64)
        (want,) = ref("swiglu_gemv", {}, [x, u, W] + ([res] if res is not None else []), [y])
        close(y, want, dt, **tol)
    # in place over the residual (y IS r), as the table allows for gemv_res / swiglu_gemv
    rr = r.clone()
    (want,) = ref("gemv_res", {}, [x, W, rr], [rr])
    O.run_gemv_ex(x, x, W, rr, pro=0, bias=rr, block_n=8, block_k=32)
    close(rr, want, dt, **tol)


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
