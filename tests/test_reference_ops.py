"""lowering/reference.py against independent formulations (transformers' Llama modules, torch)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward,
)

from ir.ops import OPS
from lowering.reference import INT_POISON, IMPLS, ReferenceOpError, apply_op, torch_dtype


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _out(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype) if dtype.is_floating_point else \
        torch.full(shape, INT_POISON, dtype=dtype)


def test_every_ir_op_has_an_implementation():
    assert set(IMPLS) == set(OPS)


def test_torch_dtype_names():
    assert torch_dtype("bf16") is torch.bfloat16 and torch_dtype("i32") is torch.int32
    with pytest.raises(ValueError, match="unknown IR dtype"):
        torch_dtype("f64")


@pytest.mark.parametrize("groups,dim", [(1, 64), (4, 16), (3, 48)])
def test_rmsnorm_matches_llama_rmsnorm_fp32(groups, dim):
    g = _gen(0)
    x = torch.randn(groups, dim, generator=g) * 3
    w = torch.randn(dim, generator=g)
    hf = LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x)
    y = _out(groups * dim)
    apply_op("rmsnorm", {"dim": dim, "eps": 1e-5}, [x.reshape(-1), w], [y])
    assert torch.equal(y, want.reshape(-1))  # op for op the same arithmetic


def test_rmsnorm_bf16_rounds_once():
    g = _gen(1)
    x = torch.randn(64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    y = _out(64, dtype=torch.bfloat16)
    apply_op("rmsnorm", {"dim": 64, "eps": 1e-6}, [x, w], [y])
    xf = x.float()
    want = (w.float() * (xf * torch.rsqrt(xf.pow(2).mean() + 1e-6))).to(torch.bfloat16)
    assert torch.equal(y, want)
    # HF (bf16) rounds before the weight multiply: close, not necessarily identical.
    hf = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(w)
        assert torch.allclose(y.float(), hf(x).float(), rtol=2e-2, atol=2e-2)


def _rope_config(rope_type: str) -> LlamaConfig:
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_type == "llama3":
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       max_position_embeddings=4096, rope_parameters=params)


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
@pytest.mark.parametrize("pos", [0, 1, 7, 31, 1000, 3000])
def test_rope_matches_hf_apply_rotary_pos_emb(rope_type, pos):
    cfg = _rope_config(rope_type)
    rot = LlamaRotaryEmbedding(cfg)
    hq, hkv, hd = 4, 2, 64
    g = _gen(pos)
    q = torch.randn(1, hq, 1, hd, generator=g)
    k = torch.randn(1, hkv, 1, hd, generator=g)
    cos, sin = rot(q, torch.tensor([[pos]]))
    q_want, k_want = apply_rotary_pos_emb(q, k, cos, sin)
    posb = torch.tensor([pos], dtype=torch.int32)
    qy, ky = _out(hq * hd), _out(hkv, hd)
    apply_op("rope", {"head_dim": hd}, [q.reshape(-1), rot.inv_freq, posb], [qy])
    apply_op("rope", {"head_dim": hd}, [k.reshape(hkv, hd), rot.inv_freq, posb], [ky])
    assert torch.equal(qy, q_want.reshape(-1))
    assert torch.equal(ky, k_want.reshape(hkv, hd))


def test_rope_in_place_and_negative_position():
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    x = torch.randn(2, 8, generator=_gen(3))
    ref = _out(2, 8)
    apply_op("rope", {"head_dim": 8}, [x, inv, torch.tensor([5], dtype=torch.int32)], [ref])
    apply_op("rope", {"head_dim": 8}, [x, inv, torch.tensor([5], dtype=torch.int32)], [x])  # aliasing
    assert torch.equal(x, ref)
    with pytest.raises(ReferenceOpError, match="negative"):
        apply_op("rope", {"head_dim": 8}, [x, inv, torch.tensor([-1], dtype=torch.int32)], [ref])


class _AttnModule(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize("hq,g,pos", [(4, 2, 0), (4, 2, 9), (9, 3, 17), (3, 1, 5), (2, 2, 3)])
def test_attention_matches_hf_eager_attention(hq, g, pos):
    hd, s = 16, 32
    gen = _gen(hq * 100 + pos)
    q = torch.randn(hq, hd, generator=gen)
    kc = torch.full((g, s, hd), float("nan"))  # rows beyond pos are poison: must not be read
    vc = torch.full((g, s, hd), float("nan"))
    kc[:, : pos + 1] = torch.randn(g, pos + 1, hd, generator=gen)
    vc[:, : pos + 1] = torch.randn(g, pos + 1, hd, generator=gen)
    scale = hd ** -0.5
    want, _ = eager_attention_forward(_AttnModule(hq // g).eval(), q.reshape(1, hq, 1, hd),
                                      kc[None, :, : pos + 1], vc[None, :, : pos + 1], None, scale)
    o = _out(hq * hd)
    apply_op("attention", {"head_dim": hd, "scale": scale}, [q.reshape(-1), kc, vc,
                                                               torch.tensor([pos], dtype=torch.int32)], [o])
    assert torch.allclose(o, want.reshape(-1), rtol=1e-5, atol=1e-6)
    assert not torch.isnan(o).any()


def test_attention_gqa_mapping_is_h_div_group():
    # kv head g holds a distinctive constant value vector: head h must return kv head h // (Hq/G)'s value.
    hq, g, hd, pos = 6, 3, 4, 2
    q = torch.zeros(hq, hd)
    kc = torch.zeros(g, 8, hd)
    vc = torch.zeros(g, 8, hd)
    for j in range(g):
        vc[j, : pos + 1] = float(j + 1)
    o = _out(hq, hd)
    apply_op("attention", {"head_dim": hd, "scale": 1.0}, [q, kc, vc, torch.tensor([pos], dtype=torch.int32)], [o])
    assert o[:, 0].tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]


def test_attention_single_kv_head_cache_region_2d():
    hd, pos = 8, 3
    q = torch.randn(2, hd, generator=_gen(5))
    kc = torch.randn(16, hd, generator=_gen(6))  # [S, D]: one kv head, squeezed
    vc = torch.randn(16, hd, generator=_gen(7))
    o = _out(2 * hd)
    apply_op("attention", {"head_dim": hd, "scale": 0.5}, [q, kc, vc, torch.tensor([pos], dtype=torch.int32)], [o])
    p = torch.softmax(q @ kc[: pos + 1].T * 0.5, dim=-1)
    assert torch.allclose(o, (p @ vc[: pos + 1]).reshape(-1), atol=1e-6)


def test_kv_append_writes_only_row_pos_through_views():
    g, s, hd = 2, 8, 4
    cache = torch.zeros(3, g, s, hd)  # [layers, G, S, D]: a layer slice is a view
    vcache = torch.zeros(3, g, s, hd)
    k = torch.randn(g * hd, generator=_gen(8))
    v = torch.randn(g * hd, generator=_gen(9))
    apply_op("kv_append", {"head_dim": hd}, [k, v, torch.tensor([5], dtype=torch.int32)],
             [cache[1:2], vcache[1:2]])
    assert torch.equal(cache[1, :, 5], k.reshape(g, hd))
    assert torch.equal(vcache[1, :, 5], v.reshape(g, hd))
    cache[1, :, 5] = 0
    vcache[1, :, 5] = 0
    assert not cache.any() and not vcache.any()
    with pytest.raises(ReferenceOpError, match="out of range"):
        apply_op("kv_append", {"head_dim": hd}, [k, v, torch.tensor([s], dtype=torch.int32)],
                 [cache[1], vcache[1]])


@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(bias):
    gen = _gen(10)
    w = torch.randn(24, 40, generator=gen)
    x = torch.randn(40, generator=gen)
    b = torch.randn(24, generator=gen)
    want = F.linear(x, w, b if bias else None)
    buf = _out(100)
    apply_op("gemv", {}, [x, w] + ([b] if bias else []), [buf[10:34]])
    assert torch.allclose(buf[10:34], want, rtol=1e-5, atol=1e-5)
    assert torch.isnan(buf[:10]).all() and torch.isnan(buf[34:]).all()


def test_gemv_bf16_weights_accumulate_in_fp32():
    gen = _gen(11)
    w = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
    x = torch.randn(512, generator=gen).to(torch.bfloat16)
    y = _out(8, dtype=torch.bfloat16)
    apply_op("gemv", {}, [x, w], [y])
    want = (w.double() @ x.double()).to(torch.bfloat16)
    assert torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-2)
    one_row = _out(1)
    apply_op("gemv", {}, [x, w[3:4]], [one_row])  # N = 1 squeezes to a [K] weight
    assert torch.allclose(one_row, w[3].float() @ x.float())


def test_silu_mul_add_copy_put():
    gen = _gen(12)
    a, b = torch.randn(33, generator=gen), torch.randn(33, generator=gen)
    y = _out(33)
    apply_op("silu_mul", {}, [a, b], [y])
    assert torch.allclose(y, a * torch.sigmoid(a) * b, rtol=1e-6, atol=1e-7)
    apply_op("add", {}, [a, b], [y])
    assert torch.equal(y, a + b)
    yb = _out(3, 11, dtype=torch.bfloat16)
    apply_op("copy", {}, [a], [yb])
    assert torch.equal(yb.reshape(-1), a.to(torch.bfloat16))
    apply_op("put", {}, [b.reshape(3, 11)], [y])
    assert torch.equal(y, b)
    for op in ("quiet", "fence", "nop"):
        apply_op(op, {}, [], [])


def test_reduce_sequential_order_and_residual():
    gen = _gen(13)
    p = torch.randn(4, 16, generator=gen)
    r = torch.randn(16, generator=gen)
    y = _out(16)
    apply_op("reduce", {}, [p[None], r], [y])
    want = ((p[0] + p[1]) + p[2]) + p[3] + r
    assert torch.equal(y, want)
    apply_op("reduce", {}, [p[2:3]], [y])  # k == 1
    assert torch.equal(y, p[2])
    with pytest.raises(ReferenceOpError, match="multiple"):
        apply_op("reduce", {}, [p[:, :5]], [y])


def test_argmax_first_index_and_offset():
    x = torch.tensor([1.0, 5.0, -2.0, 5.0, 3.0])
    y = _out(2)
    apply_op("argmax", {"offset": 1000}, [x], [y])
    assert y.tolist() == [5.0, 1001.0]
    assert int(torch.argmax(x)) == 1
    x[2] = float("nan")
    apply_op("argmax", {"offset": 0}, [x], [y])
    assert math.isnan(y[0]) and y[1] == 2.0  # as torch.argmax: NaN is the maximum


def test_argmax_combine_ties_lowest_index():
    pairs = torch.tensor([[2.0, 70.0], [3.0, 90.0], [3.0, 40.0], [1.0, 5.0]])
    tok = _out(1, dtype=torch.int32)
    apply_op("argmax_combine", {}, [pairs], [tok])
    assert tok.tolist() == [40]
    # Combining per-slice argmaxes equals a global torch.argmax, ties included.
    gen = _gen(14)
    for _ in range(20):
        logits = torch.randint(0, 4, (50,), generator=gen).float()  # many ties
        parts = []
        for lo, hi in ((0, 13), (13, 31), (31, 50)):
            pr = _out(2)
            apply_op("argmax", {"offset": lo}, [logits[lo:hi]], [pr])
            parts.append(pr)
        # Slices in reverse order: the rule must not depend on pair order.
        apply_op("argmax_combine", {}, [torch.stack(parts[::-1])], [tok])
        assert tok.item() == int(torch.argmax(logits))


def test_argmax_combine_poison():
    tok = _out(1, dtype=torch.int32)
    apply_op("argmax_combine", {}, [torch.tensor([[float("nan"), 7.0], [1.0, 3.0]])], [tok])
    assert tok.item() == 7  # NaN value counts as the maximum
    apply_op("argmax_combine", {}, [torch.tensor([[2.0, float("nan")], [1.0, 3.0]])], [tok])
    assert tok.item() == INT_POISON


def test_embed_row_and_range_check():
    table = torch.randn(10, 6, generator=_gen(15))
    y = _out(6)
    apply_op("embed", {}, [table, torch.tensor([7], dtype=torch.int32)], [y])
    assert torch.equal(y, table[7])
    for bad in (10, -1, INT_POISON):
        with pytest.raises(ReferenceOpError, match="out of range"):
            apply_op("embed", {}, [table, torch.tensor([bad], dtype=torch.int32)], [y])


def test_bad_operands_raise():
    with pytest.raises(ReferenceOpError, match="rmsnorm"):
        apply_op("rmsnorm", {"dim": 7, "eps": 1e-6}, [torch.zeros(16), torch.zeros(7)], [torch.zeros(16)])
    with pytest.raises(ReferenceOpError, match="gemv"):
        apply_op("gemv", {}, [torch.zeros(5), torch.zeros(3, 4)], [torch.zeros(3)])
    with pytest.raises(ReferenceOpError, match="result has"):
        apply_op("add", {}, [torch.zeros(4), torch.zeros(4)], [torch.zeros(5)])
    with pytest.raises(KeyError, match="unknown op"):
        apply_op("softmax", {}, [], [])


# -- fused ops (norm_gemv, gemv_res, swiglu_gemv, rope_append, rope_attention) ---------------
# Each is checked against the unfused composition the lowering would emit without ``fuse``,
# with the intermediate stored in a buffer of the input dtype (as the unfused program does).

def _unfused(steps, dtype):
    """Run [(op, params, ins, n_out_or_out_tensor)] in order; an int allocates an output of
    that many elements in ``dtype``. Returns the last step's outputs."""
    outs = None
    for op, params, ins, out in steps:
        outs = [_out(out, dtype=dtype)] if isinstance(out, int) else out
        apply_op(op, params, ins, outs)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts,bias", [(2, False), (3, True), (1, False)])
def test_reduce_norm_gemv_equals_reduce_then_norm_gemv(dtype, parts, bias):
    """The all-reduce's sum in the GEMV prologue: bit-identical to reduce (partials +
    residual, stored in the residual's dtype) followed by norm_gemv of that buffer."""
    g = _gen(22)
    k, n = 96, 40
    p = (torch.randn(parts, k, generator=g) * 3).to(dtype)
    r = torch.randn(k, generator=g).to(dtype)
    nw = torch.randn(k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = [torch.randn(n, generator=g).to(dtype)] if bias else []
    h = _unfused([("reduce", {}, [p if parts > 1 else p[0], r], k)], dtype)[0]
    want = _unfused([("norm_gemv", {"eps": 1e-6}, [h, nw, w] + b, n)], dtype)[0]
    y = _out(n, dtype=dtype)
    apply_op("reduce_norm_gemv", {"eps": 1e-6}, [p if parts > 1 else p[0], r, nw, w] + b, [y])
    assert torch.equal(y, want)
    with pytest.raises(ReferenceOpError, match="reduce_norm_gemv: partials have"):
        apply_op("reduce_norm_gemv", {"eps": 1e-6}, [p[:, :95].reshape(-1), r, nw, w], [y])


def test_reduce_norm_gemv_spec_names_bad_operands():
    from ir.ops import OPS

    spec = OPS["reduce_norm_gemv"]
    assert spec.arity_ok(4, 1) and spec.arity_ok(5, 3) and not spec.arity_ok(3, 1)
    ok = spec.check([(2, 64), (64,), (64,), (32, 64)], ["bf16"] * 4, [(32,)], ["bf16"], {"eps": 1e-5})
    assert ok == []
    errs = spec.check([(2, 48), (64,), (64,), (32, 64)], ["bf16", "f32", "bf16", "bf16"], [(32,), (16,)],
                      ["bf16", "bf16"], {"eps": 2.0})
    text = " | ".join(errs)
    for want in ("partials have width 48, residual 64", "partials are bf16, the residual f32",
                 "param eps must be in (0, 1)", "mirror output 1 is bf16 (16,)"):
        assert want in text, text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_norm_gemv_equals_rmsnorm_then_gemv(dtype, bias):
    g = _gen(20)
    k, n = 96, 40
    x = (torch.randn(k, generator=g) * 4).to(dtype)
    nw = torch.randn(k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = [torch.randn(n, generator=g).to(dtype)] if bias else []
    h = _unfused([("rmsnorm", {"dim": k, "eps": 1e-6}, [x, nw], k)], dtype)[0]
    want = _unfused([("gemv", {}, [h, w] + b, n)], dtype)[0]
    y = _out(n, dtype=dtype)
    apply_op("norm_gemv", {"eps": 1e-6}, [x, nw, w] + b, [y])
    assert torch.equal(y, want)  # the norm is rounded to x's dtype exactly like the store
    # independent check against HF's fp32 modules
    if dtype is torch.float32:
        hf = LlamaRMSNorm(k, eps=1e-6)
        with torch.no_grad():
            hf.weight.copy_(nw)
            ref = F.linear(hf(x), w, b[0] if b else None)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_norm_gemv_one_row_tile_and_bad_operands():
    g = _gen(21)
    x, nw, w = torch.randn(32, generator=g), torch.randn(32, generator=g), torch.randn(1, 32, generator=g)
    y = _out(1)
    apply_op("norm_gemv", {"eps": 1e-5}, [x, nw, w], [y])
    h = _unfused([("rmsnorm", {"dim": 32, "eps": 1e-5}, [x, nw], 32)], torch.float32)[0]
    assert torch.equal(y, torch.mv(w, h))
    with pytest.raises(ReferenceOpError, match="norm_gemv"):
        apply_op("norm_gemv", {"eps": 1e-5}, [x, nw[:16], w], [y])
    with pytest.raises(ReferenceOpError, match="norm_gemv"):
        apply_op("norm_gemv", {"eps": 1e-5}, [x, nw, torch.randn(1, 33)], [y])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_res_equals_gemv_then_add(dtype):
    g = _gen(22)
    x = torch.randn(64, generator=g).to(dtype)
    w = torch.randn(48, 64, generator=g).to(dtype)
    r = (torch.randn(48, generator=g) * 10).to(dtype)
    part = _unfused([("gemv", {}, [x, w], 48)], dtype)[0]
    want = _unfused([("add", {}, [part, r], 48)], dtype)[0]
    y = _out(48, dtype=dtype)
    apply_op("gemv_res", {}, [x, w, r], [y])
    if dtype is torch.float32:
        assert torch.equal(y, want)
    else:  # one rounding fewer (W @ x is not rounded before the add)
        exact = (w.float() @ x.float() + r.float()).to(dtype)
        assert torch.equal(y, exact)
        torch.testing.assert_close(y.float(), want.float(), rtol=2e-2, atol=2e-1)
    with pytest.raises(ReferenceOpError, match="gemv_res"):
        apply_op("gemv_res", {}, [x, w, r[:40]], [y])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resid", [False, True])
def test_swiglu_gemv_equals_silu_mul_then_gemv(dtype, resid):
    g = _gen(23)
    k, n = 80, 24
    gt = (torch.randn(k, generator=g) * 3).to(dtype)
    up = torch.randn(k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    r = [torch.randn(n, generator=g).to(dtype)] if resid else []
    m = _unfused([("silu_mul", {}, [gt, up], k)], dtype)[0]
    want = _unfused([("gemv", {}, [m, w], n)], dtype)[0]
    if resid:
        want = _unfused([("add", {}, [want, r[0]], n)], dtype)[0]
    y = _out(n, dtype=dtype)
    apply_op("swiglu_gemv", {}, [gt, up, w] + r, [y])
    if dtype is torch.float32 or not resid:
        assert torch.equal(y, want)
    else:
        exact = (w.float() @ m.float() + r[0].float()).to(dtype)
        assert torch.equal(y, exact)
    with pytest.raises(ReferenceOpError, match="swiglu_gemv"):
        apply_op("swiglu_gemv", {}, [gt, up[:8], w], [y])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,pos", [(1, 0), (2, 5), (3, 11)])
def test_rope_append_equals_rope_then_kv_append(dtype, heads, pos):
    g = _gen(24)
    hd, s = 16, 12
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    k = torch.randn(heads * hd, generator=g).to(dtype)
    v = torch.randn(heads * hd, generator=g).to(dtype)
    p = torch.tensor([pos], dtype=torch.int32)
    kc0 = torch.randn(heads, s, hd, generator=g).to(dtype)
    vc0 = torch.randn(heads, s, hd, generator=g).to(dtype)
    kr = _unfused([("rope", {"head_dim": hd}, [k, inv, p], heads * hd)], dtype)[0]
    kc_w, vc_w = kc0.clone(), vc0.clone()
    apply_op("kv_append", {"head_dim": hd}, [kr, v, p], [kc_w, vc_w])
    kc, vc = kc0.clone(), vc0.clone()
    apply_op("rope_append", {"head_dim": hd}, [k, v, inv, p], [kc, vc])
    assert torch.equal(kc, kc_w) and torch.equal(vc, vc_w)
    assert not torch.equal(kc[:, pos], kc0[:, pos]) or pos == 0  # row pos was written
    rows = [i for i in range(s) if i != pos]
    assert torch.equal(kc[:, rows], kc0[:, rows]) and torch.equal(vc[:, rows], vc0[:, rows])
    with pytest.raises(ReferenceOpError, match="rope_append"):
        apply_op("rope_append", {"head_dim": hd}, [k, v, inv, torch.tensor([s], dtype=torch.int32)], [kc, vc])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,g_,pos", [(4, 2, 0), (4, 2, 9), (3, 1, 5), (2, 2, 3)])
def test_rope_attention_equals_rope_then_attention(dtype, hq, g_, pos):
    g = _gen(25)
    hd, s = 16, 12
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    q = torch.randn(hq * hd, generator=g).to(dtype)
    kc = torch.randn(g_, s, hd, generator=g).to(dtype)
    vc = torch.randn(g_, s, hd, generator=g).to(dtype)
    p = torch.tensor([pos], dtype=torch.int32)
    prm = {"head_dim": hd, "scale": hd ** -0.5}
    qr = _unfused([("rope", {"head_dim": hd}, [q, inv, p], hq * hd)], dtype)[0]
    want = _unfused([("attention", prm, [qr, kc, vc, p], hq * hd)], dtype)[0]
    y = _out(hq * hd, dtype=dtype)
    apply_op("rope_attention", prm, [q, kc, vc, p, inv], [y])
    assert torch.equal(y, want)
    if pos > 0:  # the rotation matters: attention of the unrotated q differs
        plain = _unfused([("attention", prm, [q, kc, vc, p], hq * hd)], dtype)[0]
        assert not torch.equal(y, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,g_,pos", [(4, 2, 0), (4, 2, 9), (3, 1, 5), (2, 2, 11)])
def test_rope_attention_kv_equals_append_then_attention(dtype, hq, g_, pos):
    """rope_attention_kv over caches whose row pos is stale (poisoned) equals rope_append ->
    rope_attention bit for bit, and leaves the caches as they were."""
    g = _gen(27)
    hd, s = 16, 12
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    q = torch.randn(hq * hd, generator=g).to(dtype)
    k = torch.randn(g_ * hd, generator=g).to(dtype)
    v = torch.randn(g_ * hd, generator=g).to(dtype)
    kc = torch.randn(g_, s, hd, generator=g).to(dtype)
    vc = torch.randn(g_, s, hd, generator=g).to(dtype)
    kc[:, pos:] = float("nan")  # never read: rows pos.. are not written yet
    vc[:, pos:] = float("nan")
    p = torch.tensor([pos], dtype=torch.int32)
    prm = {"head_dim": hd, "scale": hd ** -0.5}
    kc_w, vc_w = kc.clone(), vc.clone()
    apply_op("rope_append", {"head_dim": hd}, [k, v, inv, p], [kc_w, vc_w])
    want = _out(hq * hd, dtype=dtype)
    apply_op("rope_attention", prm, [q, kc_w, vc_w, p, inv], [want])
    kc0, vc0 = kc.clone(), vc.clone()
    y = _out(hq * hd, dtype=dtype)
    apply_op("rope_attention_kv", prm, [q, k, v, kc, vc, p, inv], [y])
    assert torch.equal(y, want) and not y.isnan().any()
    assert torch.equal(kc.isnan(), kc0.isnan()) and torch.equal(kc.nan_to_num(), kc0.nan_to_num())
    with pytest.raises(ReferenceOpError, match="rope_attention_kv"):
        apply_op("rope_attention_kv", prm, [q, k, v[: hd // 2], kc, vc, p, inv], [y])


def test_fused_ops_alias_input_and_output():
    """Every op computes its whole result before writing (outs may alias ins)."""
    g = _gen(26)
    buf = torch.randn(64, generator=g)
    x, nw, w = buf.clone(), torch.randn(64, generator=g), torch.randn(64, 64, generator=g)
    want = _out(64)
    apply_op("norm_gemv", {"eps": 1e-6}, [x, nw, w], [want])
    apply_op("norm_gemv", {"eps": 1e-6}, [buf, nw, w], [buf])
    assert torch.equal(buf, want)


def test_gemv_mirror_outputs_receive_copies_of_y():
    """A GEMV-family task's outputs after y (mirror outputs, ir/ops.py) get y's values; the
    op spec checks each mirror's shape and dtype against y, and other ops take no mirrors."""
    from ir.ops import MAX_MIRRORS

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(8, generator=g), torch.randn(4, 8, generator=g)
    y, m1, m2 = torch.empty(4), torch.full((4,), float("nan")), torch.full((1, 4), float("nan"))
    apply_op("gemv", {}, [x, w], [y, m1, m2])
    assert torch.equal(m1, y) and torch.equal(m2.reshape(4), y)
    spec = OPS["gemv"]
    assert spec.arity_ok(2, 1 + MAX_MIRRORS) and not spec.arity_ok(2, 2 + MAX_MIRRORS)
    assert spec.check([(8,), (4, 8)], ["f32", "f32"], [(4,), (4,)], ["f32", "f32"], {}) == []
    errs = spec.check([(8,), (4, 8)], ["f32", "f32"], [(4,), (3,)], ["f32", "f32"], {})
    assert errs and "mirror output 1" in errs[0]
    assert spec.check([(8,), (4, 8)], ["f32", "f32"], [(4,), (4,)], ["f32", "bf16"], {})
    assert not OPS["add"].arity_ok(2, 2) and OPS["add"].arity_text() == "2 inputs and 1 output"
