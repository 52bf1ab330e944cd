"""Reference (ground-truth) torch implementations of every op in ir/ops.py.

These functions define, to the bit for fp32 inputs, what each IR op computes. The CPU
executor (lowering/sim.py) runs programs with them, and the Triton instruction library
(lowering/triton/) is tested against them. They run on the CPU or any torch device.

Calling convention
------------------
``apply_op(op, params, ins, outs)``: ``ins`` and ``outs`` are tensors shaped like the
task's regions (e.g. a ``[1, 64]`` view for ``q[2:3, 0:64]``), in the order of
``OpSpec.ins`` (+ optional ins) and ``OpSpec.outs``. The op reads ``ins`` and writes its
result INTO ``outs`` (they are usually views of executor memory; they need not be
contiguous). Inputs and outputs may alias: every op computes its whole result before it
writes. Operands are interpreted by element count, as ir/ops.py's shape checks on squeezed
shapes do: a vector operand is flattened; ``gemv``'s weight is ``[N, K]`` with
``K = numel(x)``; ``reduce``'s partials are ``[k, N]`` with ``N = numel(y)``; cache regions are
``[..., S, head_dim]`` (the last axis is the head dimension, the one before it the
sequence, the product of the others the KV heads); ``reduce``'s partials may be any region
of k * N elements (``[k, rows, C]`` into y ``[rows, C]``); ``gemm``'s operands are
``[M, K]``, ``[K, N]`` and ``[M, N]`` by their element counts. A region may be strided (a
column block of a row-major buffer): the ops read and write through the views.

Numerics (shared by all float ops): inputs are converted to fp32, the op is computed in
fp32, the result is rounded once to the output's dtype. This is one rounding where HF's
bf16 modules round several times (e.g. LlamaRMSNorm casts to the input dtype before the
weight multiply; HF RoPE casts cos/sin to the activation dtype); in fp32 the formulas
below are HF's, op for op, so results agree bit for bit with HF fp32 modules on the same
device (see tests/test_reference_ops.py).

=============== ==========================================================================
op              exact definition (fp32 unless stated; y is outs[0])
=============== ==========================================================================
embed           y = table[token, :]; token = int(ins[1]) must be in [0, V) else
                ReferenceOpError (an out-of-range row is never read).
rmsnorm         per group g of ``dim`` consecutive elements of x:
                y_g = w * (x_g * rsqrt(mean(x_g ** 2) + eps))   (HF LlamaRMSNorm, fp32).
gemv            y = W @ x (+ bias): W viewed as [N, K], K = numel(x), fp32 matmul.
rope            per head slice x_h (``head_dim`` elements): f = float(pos) * inv_freq
                (fp32, [head_dim/2]); c = cos(cat(f, f)); s = sin(cat(f, f));
                y_h = x_h * c + rotate_half(x_h) * s, rotate_half(v) = cat(-v[d/2:], v[:d/2])
                (HF apply_rotary_pos_emb with LlamaRotaryEmbedding's cos/sin; attention
                scaling 1). pos must be >= 0.
kv_append       kc[g, pos, :] = k[g], vc[g, pos, :] = v[g] for every kv head g (k, v are
                [G * head_dim]); pos must be in [0, S). Only row ``pos`` is written.
attention       decode GQA over positions 0..pos (inclusive) of the cache:
                for query head h (q is [Hq, head_dim]), g = h // (Hq / G):
                a = softmax(q_h @ kc[g, :pos+1].T * scale) (fp32 softmax),
                o_h = a @ vc[g, :pos+1]. Rows beyond pos are never read.
silu_mul        y = silu(g) * u,   silu(v) = v * sigmoid(v)  (torch.nn.functional.silu).
add             y = a + b.
reduce          y = ((P[0] + P[1]) + ...) + P[k-1]  (sequential fp32 sum over k in index
                order), then + residual if given. P viewed as [k, N], N = numel(y).
argmax          y = (max(x), offset + i) as two fp32, i = the first index of the maximum
                (torch.argmax: lowest index on ties; a NaN counts as the maximum).
argmax_combine  pairs viewed as [k, 2] = (value, index); token = the smallest index among
                the pairs with the largest value (so the combination equals a global
                first-occurrence argmax); a NaN value counts as the largest. An index that
                is NaN or not an integer gives INT_POISON (the executor's unwritten-int
                sentinel) so poisoned inputs stay visible.
norm_gemv       n = w_norm * (x * rsqrt(mean(x ** 2) + eps)) over the whole x (exactly
                rmsnorm with dim = numel(x)), ROUNDED TO x's DTYPE, then y = W @ n (+ bias)
                as gemv. The rounding makes the fused op equal, bit for bit, to the
                unfused ``rmsnorm`` (into a buffer of x's dtype) -> ``gemv`` pair; in fp32 it
                is a no-op. (HF's bf16 LlamaRMSNorm rounds twice: x_hat to bf16, then
                w * x_hat to bf16; we round once, like the unfused path.)
gemv_res        y = W @ x + r: gemv's fp32 result plus r (fp32), rounded once to y's dtype.
                In fp32 this equals the unfused gemv -> add pair bit for bit; in bf16 the
                unfused pair also rounds W @ x to the partial buffer's dtype, so the two
                may differ by about one bf16 rounding.
swiglu_gemv     m = silu(g) * u (as silu_mul), ROUNDED TO g's DTYPE, then y = W @ m
                (+ r, in fp32 before the one final rounding). Without r it equals the
                unfused silu_mul -> gemv pair bit for bit (with the silu_mul output in g's
                dtype); with r, like gemv_res.
reduce_norm_gemv
                h = ((P[0] + P[1]) + ...) + r in fp32 (reduce's order), ROUNDED TO r's
                DTYPE, then norm_gemv of h. Equal bit for bit to reduce (into a buffer of
                r's dtype) -> norm_gemv of that buffer.
rope_append     k_rot = rope(k) (as rope, ``head_dim`` slices), then as kv_append:
                kc[g, pos, :] = k_rot[g] (rounded to kc's dtype), vc[g, pos, :] = v[g].
                Equal bit for bit to rope (into a buffer of kc's dtype) -> kv_append.
rope_attention  q_rot = rope(q) ROUNDED TO q's DTYPE, then attention(q_rot, kc, vc, pos)
                as above. Equal bit for bit to rope (into a buffer of q's dtype) ->
                attention.
rope_attention_kv
                as rope_attention, with row pos of the caches replaced by rope(k) rounded
                to kc's dtype and v rounded to vc's dtype (what rope_append stores there).
                Equal bit for bit to rope_append -> rope_attention.
                With the params ``parts`` P >= 2 and ``part`` c (split-KV, ir/ops.py), the
                three attention ops attend to positions [floor(c n / P), floor((c+1) n / P))
                of the n = pos + 1 only and write, per query head, the f32 partial record
                (e @ v, m, sum(e)) with s the scaled scores of those positions, m = max(s),
                e = exp(s - m); (0, -inf, 0) when the part has no position.
attention_combine
                per query head h: M = max_c m_c; w_c = exp(m_c - M) (0 for m_c = -inf);
                o_h = (sum_c w_c acc_c) / (sum_c w_c l_c) over the ``parts`` records (c in
                index order), rounded once to o's dtype.
gemm            y = a @ b (+ r): a viewed as [M, K], b as [K, N], r and y as [M, N], the
                dims from the element counts (ir.ops.gemm_dims: K^2 = numel(a) numel(b) /
                numel(y)); fp32 matmul, r added in fp32, one rounding to y's dtype.
copy            y = x, converted to y's dtype (torch ``copy_`` rounding: round to nearest even).
put             y = x (the executor decides where and when the data lands).
quiet, fence,   no data (the executor implements their ordering effects).
nop
=============== ==========================================================================
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from ir.ops import OPS, gemm_dims
from ir.program import DTYPES

#: torch dtype of each IR dtype.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "i32": torch.int32,
    "i8": torch.int8,
    "f8e4m3": torch.float8_e4m3fn,
}
assert set(TORCH_DTYPES) == set(DTYPES)
#: torch dtypes of the quantized weight dtypes (ir.program.QUANT_DTYPES).
QUANT_TORCH = frozenset((torch.int8, torch.float8_e4m3fn))


class QuantWeight:
    """A quantized GEMV weight with its scales: ``q`` int8 / float8_e4m3fn ``[N, K]`` (or
    flat), ``scale`` f32 ``[N]`` (per row) or ``[N, K / G]`` (per group of G K elements).
    ``_gemv_f32`` computes ``scale * (float(q) @ x)``, per group then summed."""

    __slots__ = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        self.q, self.scale = q, scale

    def numel(self) -> int:
        return self.q.numel()

#: Sentinel written for "no valid integer" (unwritten int memory in the sim, NaN index in
#: argmax_combine). Chosen far outside any vocabulary or position range.
INT_POISON = -(2**31)


class ReferenceOpError(ValueError):
    """An op received operands it cannot compute with (bad shape, index out of range)."""


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype for an IR dtype name (``bf16``, ``f16``, ``f32``, ``i32``, ``i8``,
    ``f8e4m3``)."""
    try:
        return TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown IR dtype {dtype!r}; expected one of {sorted(TORCH_DTYPES)}") from None


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, as fp32 (no copy when it already is one)."""
    if t.dim() != 1:
        t = t.reshape(-1)
    return t if t.dtype is torch.float32 else t.to(torch.float32)


def _store(out: torch.Tensor, value: torch.Tensor, op: str) -> None:
    """Write ``value`` (any shape with the same numel) into ``out``, casting to its dtype."""
    if value.shape != out.shape:
        if value.numel() != out.numel():
            raise ReferenceOpError(f"{op}: result has {value.numel()} elements, output region {out.numel()}")
        value = value.reshape(out.shape)
    out.copy_(value)


def _index(t: torch.Tensor, op: str, role: str) -> int:
    if t.numel() != 1:
        raise ReferenceOpError(f"{op}: {role} must hold 1 element, got {t.numel()}")
    return int(t.reshape(-1)[0].item())


def _embed(p, ins, outs):
    table, token = ins
    tab = table.reshape(-1, table.shape[-1]) if table.dim() >= 2 else table.reshape(1, -1)
    tok = _index(token, "embed", "token")
    if not 0 <= tok < tab.shape[0]:
        raise ReferenceOpError(f"embed: token {tok} out of range [0, {tab.shape[0]})")
    _store(outs[0], tab[tok], "embed")


def _rmsnorm_f32(x: torch.Tensor, w: torch.Tensor, dim: int, eps: float, op: str) -> torch.Tensor:
    """fp32 ``w * (x_g * rsqrt(mean(x_g ** 2) + eps))`` per group of ``dim`` elements, [numel(x)]."""
    if dim <= 0 or x.numel() % dim or w.numel() != dim:
        raise ReferenceOpError(f"{op}: input {x.numel()} / weight {w.numel()} elements vs dim={dim}")
    h = _f32(x).reshape(-1, dim)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (_f32(w) * h).reshape(-1)


def _rmsnorm(p, ins, outs):
    x, w = ins[0], ins[1]
    _store(outs[0], _rmsnorm_f32(x, w, int(p["dim"]), float(p["eps"]), "rmsnorm"), "rmsnorm")


def _round_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``t`` rounded to ``dtype`` and back (what storing it in a buffer does)."""
    return t if dtype is torch.float32 else t.to(dtype).to(torch.float32)


def _gemv_f32(x: torch.Tensor, w: "torch.Tensor | QuantWeight", bias: torch.Tensor | None,
              op: str) -> torch.Tensor:
    """fp32 ``W @ x (+ bias)`` with W viewed as [N, numel(x)]; returns [N]. A QuantWeight:
    ``scale * (float(q) @ x) (+ bias)``, the scale applied once per row after the dot, or with
    ``N * K / G`` scales once per group of G K elements: ``sum_g scale[n, g] * (q[n, g] @
    x[g])`` (ir/ops.py, "Quantized weights")."""
    k = x.numel()
    if k == 0 or w.numel() % k:
        raise ReferenceOpError(f"{op}: weight has {w.numel()} elements, not a multiple of K={k}")
    scale = None
    if isinstance(w, QuantWeight):
        w, scale = w.q, w.scale
    w2 = w if w.dim() == 2 and w.shape[1] == k else w.reshape(-1, k)
    if w2.dtype is not torch.float32:
        w2 = w2.to(torch.float32)
    n = w2.shape[0]
    if scale is not None and scale.numel() != n:  # per group of K elements
        groups = scale.numel() // n if n else 0
        if groups < 2 or scale.numel() != n * groups or k % groups:
            raise ReferenceOpError(f"{op}: scale has {scale.numel()} elements, not N={n} or N x (K / G) "
                                   f"for K={k}")
        parts = (w2.reshape(n, groups, k // groups) * _f32(x).reshape(1, groups, k // groups)).sum(-1)
        y = (parts * _f32(scale).reshape(n, groups)).sum(-1)
        scale = None
    else:
        y = torch.mv(w2, _f32(x))
    if scale is not None:
        y *= _f32(scale)
    if bias is not None:
        if bias.numel() != y.numel():
            raise ReferenceOpError(f"{op}: bias/residual has {bias.numel()} elements, output {y.numel()}")
        y += _f32(bias)
    return y


def _gemv(p, ins, outs):
    _store(outs[0], _gemv_f32(ins[0], ins[1], ins[2] if len(ins) > 2 else None, "gemv"), "gemv")


def _norm_gemv(p, ins, outs):
    x, nw, w = ins[0], ins[1], ins[2]
    n = _rmsnorm_f32(x, nw, x.numel(), float(p["eps"]), "norm_gemv")
    n = _round_to(n, x.dtype)  # what the unfused rmsnorm's store into x's dtype does
    _store(outs[0], _gemv_f32(n, w, ins[3] if len(ins) > 3 else None, "norm_gemv"), "norm_gemv")


def _reduce_norm_gemv(p, ins, outs):
    r = ins[1]
    acc = _sum_rows_f32(ins[0], r, r.numel(), "reduce_norm_gemv", "the residual's ")
    h = acc.to(r.dtype)  # what reduce's store into r's dtype does (norm_gemv rounds to it too)
    _norm_gemv(p, [h.reshape(r.shape), *ins[2:]], outs)


def _gemv_res(p, ins, outs):
    x, w, r = ins
    _store(outs[0], _gemv_f32(x, w, r, "gemv_res"), "gemv_res")


def _swiglu_gemv(p, ins, outs):
    g, u, w = ins[0], ins[1], ins[2]
    if g.numel() != u.numel():
        raise ReferenceOpError(f"swiglu_gemv: gate has {g.numel()} elements, up {u.numel()}")
    m = _round_to(_silu_mul_f32(g, u), g.dtype)  # as the unfused silu_mul's store
    _store(outs[0], _gemv_f32(m, w, ins[3] if len(ins) > 3 else None, "swiglu_gemv"), "swiglu_gemv")


def rope_cos_sin(inv_freq: torch.Tensor, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``cat(f, f)`` with ``f = float(pos) * inv_freq`` (fp32, [head_dim]).

    Same arithmetic as transformers' LlamaRotaryEmbedding.forward (position as fp32 times
    inv_freq in fp32), with attention scaling 1.
    """
    f = torch.tensor(float(pos), dtype=torch.float32) * _f32(inv_freq)
    emb = torch.cat((f, f))
    return emb.cos(), emb.sin()


def _rope_f32(x: torch.Tensor, inv_freq: torch.Tensor, pos_t: torch.Tensor, hd: int,
              op: str) -> torch.Tensor:
    """fp32 rotate-half RoPE of each ``hd`` slice of x at position pos_t; returns [numel(x)]."""
    if hd <= 0 or x.numel() % hd or inv_freq.numel() * 2 != hd:
        raise ReferenceOpError(f"{op}: x {x.numel()} / inv_freq {inv_freq.numel()} elements vs head_dim={hd}")
    pos = _index(pos_t, op, "pos")
    if pos < 0:
        raise ReferenceOpError(f"{op}: position {pos} is negative")
    cos, sin = rope_cos_sin(inv_freq, pos)
    h = _f32(x).reshape(-1, hd)
    rot = torch.cat((-h[:, hd // 2:], h[:, : hd // 2]), dim=-1)
    return (h * cos + rot * sin).reshape(-1)


def _rope(p, ins, outs):
    x, inv_freq, pos_t = ins
    _store(outs[0], _rope_f32(x, inv_freq, pos_t, int(p["head_dim"]), "rope"), "rope")


def _cache(t: torch.Tensor, hd: int, op: str, role: str) -> torch.Tensor:
    if t.dim() < 2 or t.shape[-1] != hd:
        raise ReferenceOpError(f"{op}: {role} region of shape {tuple(t.shape)} is not [..., S, head_dim={hd}]")
    return t


def _append_rows(k: torch.Tensor, v: torch.Tensor, pos_t: torch.Tensor, hd: int,
                 outs: Sequence[torch.Tensor], op: str) -> None:
    """kc[..., pos, :] = k ; vc[..., pos, :] = v (rounded to the caches' dtypes)."""
    pos = _index(pos_t, op, "pos")
    rows = []
    for name, src, cache in (("k cache", k, outs[0]), ("v cache", v, outs[1])):
        c = _cache(cache, hd, op, name)
        if not 0 <= pos < c.shape[-2]:
            raise ReferenceOpError(f"{op}: position {pos} out of range [0, {c.shape[-2]}) of the {name}")
        row = c[..., pos, :]  # a view: [..leading.., head_dim]
        if src.numel() != row.numel():
            raise ReferenceOpError(f"{op}: {name} holds {row.numel() // hd} heads, source has {src.numel()} elements")
        rows.append((row, src))
    for row, src in rows:  # check both before writing either
        row.copy_(src.reshape(row.shape))


def _kv_append(p, ins, outs):
    k, v, pos_t = ins
    _append_rows(k, v, pos_t, int(p["head_dim"]), outs, "kv_append")


def _rope_append(p, ins, outs):
    k, v, inv_freq, pos_t = ins
    hd = int(p["head_dim"])
    _append_rows(_rope_f32(k, inv_freq, pos_t, hd, "rope_append"), v, pos_t, hd, outs, "rope_append")


def _attention_f32(q, kc, vc, pos_t, hd: int, scale: float, op: str,
                   cur: tuple[torch.Tensor, torch.Tensor] | None = None,
                   parts: tuple[int, int] | None = None) -> torch.Tensor:
    """fp32 decode GQA attention (see the module table); returns [numel(q)] (head-major).
    ``cur`` = (k, v) fp32 [G * hd] each: the keys and values of position ``pos`` in place of
    the caches' row pos (rope_attention_kv), which is then never read. ``parts`` = (P, c):
    split-KV part c of P, whose [Hq * (hd + 2)] partial records it returns instead."""
    pos = _index(pos_t, op, "pos")
    kc, vc = _cache(kc, hd, op, "k cache"), _cache(vc, hd, op, "v cache")
    s = kc.shape[-2]
    if not 0 <= pos < s or vc.shape[-2] != s:
        raise ReferenceOpError(f"{op}: position {pos} out of range [0, {s}) of the cache")
    if cur is None:
        k = kc[..., : pos + 1, :].reshape(-1, pos + 1, hd).to(torch.float32)  # [G, L, D]
        v = vc[..., : pos + 1, :].reshape(-1, pos + 1, hd).to(torch.float32)
    else:
        gk = kc.numel() // (s * hd)  # kv heads (a cache with no rows before pos is empty)
        k = kc[..., :pos, :].reshape(gk, pos, hd).to(torch.float32)
        v = vc[..., :pos, :].reshape(vc.numel() // (s * hd), pos, hd).to(torch.float32)
        if cur[0].numel() != k.shape[0] * hd or cur[1].numel() != v.shape[0] * hd:
            raise ReferenceOpError(f"{op}: k / v hold {cur[0].numel()} / {cur[1].numel()} elements, "
                                   f"the caches {k.shape[0]} heads of {hd}")
        k = torch.cat([k, cur[0].reshape(-1, 1, hd)], dim=1)
        v = torch.cat([v, cur[1].reshape(-1, 1, hd)], dim=1)
    g = k.shape[0]
    if q.numel() % hd or v.shape[0] != g:
        raise ReferenceOpError(f"{op}: q {q.numel()} elements / caches {tuple(kc.shape)}, {tuple(vc.shape)} mismatch")
    hq = q.numel() // hd
    if hq % g:
        raise ReferenceOpError(f"{op}: {hq} query heads do not split over {g} kv heads")
    qh = _f32(q).reshape(g, hq // g, hd)  # head h -> kv head h // (hq // g)
    if parts is not None:
        P, c = parts
        n = k.shape[1]
        k, v = k[:, c * n // P:(c + 1) * n // P], v[:, c * n // P:(c + 1) * n // P]
        if k.shape[1] == 0:  # an empty part: (0, -inf, 0) per head
            rec = torch.zeros(hq, hd + 2, dtype=torch.float32)
            rec[:, hd] = float("-inf")
            return rec.reshape(-1)
        scores = torch.matmul(qh, k.transpose(1, 2)) * scale  # [G, Hq/G, L_c]
        m = scores.amax(dim=-1, keepdim=True)
        e = torch.exp(scores - m)
        return torch.cat([torch.matmul(e, v), m, e.sum(dim=-1, keepdim=True)], dim=-1).reshape(-1)
    scores = torch.matmul(qh, k.transpose(1, 2)) * scale  # [G, Hq/G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.matmul(probs, v).reshape(-1)


def _kv_parts(p: dict) -> tuple[int, int] | None:
    """(parts, part) of a split-KV attention task with parts >= 2 (ir/ops.py), else None."""
    P = int(p.get("parts", 1))
    return (P, int(p.get("part", 0))) if P > 1 else None


def _attention_combine(p, ins, outs):
    hd, P = int(p["head_dim"]), int(p["parts"])
    rec = _f32(ins[0]).reshape(P, -1, hd + 2)  # [P, Hq, D + 2]
    m = rec[:, :, hd]
    big = m.amax(dim=0)  # at least one part of each head holds a position
    w = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), torch.exp(m - big))
    num = (w[:, :, None] * rec[:, :, :hd]).sum(dim=0)
    den = (w * rec[:, :, hd + 1]).sum(dim=0)
    _store(outs[0], (num / den[:, None]).reshape(-1), "attention_combine")


def _attention(p, ins, outs):
    q, kc, vc, pos_t = ins
    o = _attention_f32(q, kc, vc, pos_t, int(p["head_dim"]), float(p["scale"]), "attention",
                       parts=_kv_parts(p))
    _store(outs[0], o, "attention")


def _rope_attention(p, ins, outs):
    q, kc, vc, pos_t, inv_freq = ins
    hd = int(p["head_dim"])
    qr = _round_to(_rope_f32(q, inv_freq, pos_t, hd, "rope_attention"), q.dtype)  # as rope's store
    o = _attention_f32(qr, kc, vc, pos_t, hd, float(p["scale"]), "rope_attention", parts=_kv_parts(p))
    _store(outs[0], o, "rope_attention")


def _rope_attention_kv(p, ins, outs):
    q, k, v, kc, vc, pos_t, inv_freq = ins
    hd, op = int(p["head_dim"]), "rope_attention_kv"
    qr = _round_to(_rope_f32(q, inv_freq, pos_t, hd, op), q.dtype)
    # what rope_append would have stored in row pos of each cache
    kr = _round_to(_rope_f32(k, inv_freq, pos_t, hd, op), kc.dtype)
    vr = _round_to(_f32(v), vc.dtype)
    o = _attention_f32(qr, kc, vc, pos_t, hd, float(p["scale"]), op, cur=(kr, vr), parts=_kv_parts(p))
    _store(outs[0], o, op)


def _silu_mul_f32(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """fp32 ``silu(g) * u``, flattened."""
    return F.silu(_f32(g)) * _f32(u)


def _silu_mul(p, ins, outs):
    _store(outs[0], _silu_mul_f32(ins[0], ins[1]), "silu_mul")


def _add(p, ins, outs):
    _store(outs[0], _f32(ins[0]) + _f32(ins[1]), "add")


def _sum_rows_f32(part: torch.Tensor, resid: torch.Tensor | None, n: int, op: str,
                  width: str) -> torch.Tensor:
    """fp32 ``((P[0] + P[1]) + ...) (+ resid)`` over the rows of ``part`` viewed as [k, n]
    (reduce's order; reduce_norm_gemv sums the same way). Raises ReferenceOpError when
    ``part`` is not whole rows of ``n`` (``width``: the text before n in the message)."""
    if n == 0 or part.numel() % n:
        raise ReferenceOpError(f"{op}: partials have {part.numel()} elements, not a multiple of {width}{n}")
    rows = part.reshape(-1, n)
    acc = rows[0].to(torch.float32, copy=True)
    for i in range(1, rows.shape[0]):  # fixed order: a backend can match it bit for bit
        acc += rows[i]  # accumulates in fp32 (acc's dtype)
    if resid is not None:
        acc += _f32(resid)
    return acc


def _reduce(p, ins, outs):
    acc = _sum_rows_f32(ins[0], ins[1] if len(ins) > 1 else None, outs[0].numel(), "reduce", "N=")
    _store(outs[0], acc, "reduce")


def _gemm(p, ins, outs):
    a, b, y = ins[0], ins[1], outs[0]
    dims = gemm_dims(a.numel(), b.numel(), y.numel())
    if dims is None:
        raise ReferenceOpError(f"gemm: a ({a.numel()} elements) @ b ({b.numel()}) does not fit y "
                               f"({y.numel()}) as [M, K] @ [K, N] -> [M, N]")
    m, k, n = dims
    acc = torch.matmul(a.reshape(m, k).to(torch.float32), b.reshape(k, n).to(torch.float32))
    if len(ins) > 2:
        if ins[2].numel() != m * n:
            raise ReferenceOpError(f"gemm: r has {ins[2].numel()} elements, y [{m}, {n}]")
        acc += ins[2].reshape(m, n).to(torch.float32)
    _store(y, acc, "gemm")


def _argmax(p, ins, outs):
    x = _f32(ins[0])
    if x.numel() == 0:
        raise ReferenceOpError("argmax: empty input")
    i = int(torch.argmax(x).item())  # first maximum; NaN is the maximum
    val = x[i]
    _store(outs[0], torch.stack((val, torch.tensor(float(int(p["offset"]) + i)))), "argmax")


def _argmax_combine(p, ins, outs):
    pairs = ins[0].reshape(-1, 2).to(torch.float32)
    if pairs.shape[0] == 0:
        raise ReferenceOpError("argmax_combine: no pairs")
    vals, idx = pairs[:, 0], pairs[:, 1]
    nan = torch.isnan(vals)
    best = nan if bool(nan.any()) else vals == vals.max()
    cand = idx[best]
    if bool(torch.isnan(cand).any()) or bool((cand != torch.round(cand)).any()):
        tok = INT_POISON
    else:
        tok = int(cand.min().item())
    _store(outs[0], torch.tensor([tok], dtype=torch.int64), "argmax_combine")


def _copy(p, ins, outs):
    _store(outs[0], ins[0], "copy")


def _nothing(p, ins, outs):
    return None


OpFn = Callable[[dict, Sequence[torch.Tensor], Sequence[torch.Tensor]], None]

#: The implementation of each op (argument order: params, ins, outs).
IMPLS: dict[str, OpFn] = {
    "embed": _embed,
    "rmsnorm": _rmsnorm,
    "gemv": _gemv,
    "rope": _rope,
    "kv_append": _kv_append,
    "attention": _attention,
    "silu_mul": _silu_mul,
    "add": _add,
    "reduce": _reduce,
    "argmax": _argmax,
    "argmax_combine": _argmax_combine,
    "norm_gemv": _norm_gemv,
    "reduce_norm_gemv": _reduce_norm_gemv,
    "gemv_res": _gemv_res,
    "swiglu_gemv": _swiglu_gemv,
    "rope_append": _rope_append,
    "rope_attention": _rope_attention,
    "rope_attention_kv": _rope_attention_kv,
    "attention_combine": _attention_combine,
    "gemm": _gemm,
    "copy": _copy,
    "put": _copy,
    "quiet": _nothing,
    "fence": _nothing,
    "nop": _nothing,
}


def op_impl(op: str) -> OpFn:
    """The implementation of IR op ``op``, mirror outputs included: after the op has written
    its outputs, every output beyond the op's own (ir/ops.py, "Mirror outputs") receives a
    copy of the first. Raises KeyError for an op that ir/ops.py does not define."""
    try:
        fn = IMPLS[op]
    except KeyError:
        raise KeyError(f"unknown op {op!r}") from None
    n_own = len(OPS[op].outs)
    if not OPS[op].mirrors:
        return fn
    wi = OPS[op].w_index

    def run(params: dict, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        if wi is not None and wi < len(ins) and ins[wi].dtype in QUANT_TORCH:
            # a quantized weight: its per-row scales are the last input (ir/ops.py)
            if len(ins) <= wi + 1:
                raise ReferenceOpError(f"{op}: a quantized weight needs its scale input")
            ins = list(ins)
            ins[wi] = QuantWeight(ins[wi], ins.pop())
        fn(params, ins, outs[:n_own])
        for m in outs[n_own:]:
            if m.numel() != outs[0].numel():
                raise ReferenceOpError(f"{op}: mirror output has {m.numel()} elements, "
                                       f"the first output {outs[0].numel()}")
            m.copy_(outs[0].reshape(m.shape))

    return run


def apply_op(op: str, params: dict[str, Any], ins: Sequence[torch.Tensor],
             outs: Sequence[torch.Tensor]) -> None:
    """Compute IR op ``op`` on ``ins`` and write the result into the ``outs`` tensors
    (mirror outputs: copies of the first, op_impl).

    See the module docstring for each op's exact definition. Raises ReferenceOpError for
    operands the op cannot use (wrong element counts, token or position out of range),
    KeyError for an op that ir/ops.py does not define.
    """
    fn = op_impl(op)
    with torch.no_grad():
        fn(params, ins, outs)
