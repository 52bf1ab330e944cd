"""The attention family: ``rope``, ``kv_append``, ``rope_append``, ``attention``,
``rope_attention``, ``rope_attention_kv``, ``attention_combine``.

RoPE is HF's rotate-half convention (LlamaRotaryEmbedding, apply_rotary_pos_emb): angle
``float(pos) * inv_freq[j]`` in fp32, cos / sin from libdevice on the GPU (accurate for large
angles) and numpy under the interpreter. Caches are ``[G, S, D]`` operands (layout.py's
``cache`` view); a position operand is range-checked by the row decoder before it is used
as an address (vm.fail_position). Attention is decode GQA with an online softmax
(``attention``); the fused ops rotate q (rope_attention) or also take the current token's
key and value from k and v instead of the caches (rope_attention_kv).
"""

from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from ir.ops import OPS
from ir.program import DTYPE_BYTES
from lowering.triton import layout as L
from lowering.triton.lang import INTERPRET, aligned, device, flat_off, global_timer, round_as, store
from lowering.triton.layout import DECODER_ARGS, OpLowering, plain_call, TableError, Variant, tl_dtypes
from lowering.triton.vm import arena_ptr, fail_position, operand, param_f, param_i, status_ok


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
def _kv_start(kb, kc_t, kc_d, vb, vc_t, vc_d, lo, dd, dmv, TE, KV_ALIGN: tl.constexpr, BLOCK_T: tl.constexpr,
              PROF, PROFILE: tl.constexpr):
    """The loads of the first position block (K with V: one round trip, not two), then the
    profiling stamp ``PROF + 8`` as the position loop starts."""
    tn = lo + tl.arange(0, BLOCK_T)
    knext, vnext = _kv_block(kb, kc_t, kc_d, vb, vc_t, vc_d, tn, dd, (tn < TE)[:, None] & dmv[None, :], KV_ALIGN)
    if PROFILE:
        tl.store(PROF + 8, global_timer())
    return knext, vnext


@device
def _kv_take(knext, vnext, kb, kc_t, kc_d, vb, vc_t, vc_d, t, dd, dmv, TE, pos, knew, vnew,
             KV_NEW: tl.constexpr, KV_ALIGN: tl.constexpr, BLOCK_T: tl.constexpr):
    """The position block t's K and V (loaded one block earlier) in fp32, with row pos taken
    from ``knew`` / ``vnew`` under KV_NEW (already rounded to the caches' dtype), and the
    next block's loads issued (all masked off after the last block: no traffic)."""
    kt = knext.to(tl.float32)
    vt = vnext.to(tl.float32)
    if KV_NEW:
        cur = (t == pos)[:, None]
        kt = tl.where(cur, knew[None, :], kt)
        vt = tl.where(cur, vnew[None, :], vt)
    tn = t + BLOCK_T
    knext, vnext = _kv_block(kb, kc_t, kc_d, vb, vc_t, vc_d, tn, dd, (tn < TE)[:, None] & dmv[None, :], KV_ALIGN)
    return kt, vt, knext, vnext


@device
def _head_off(i0, n1, n2, s0, s1, s2, d, HEADVEC: tl.constexpr):
    """Element offsets of the flat indices ``i0 + d`` (the lanes d of one head, or of one
    split-KV record, starting at flat index i0) in a region as ``flat_off``'s. ``HEADVEC``
    (the table's ``headvec`` flag: the region's last extent is a multiple of the head's
    length and i0 of it, so a head never crosses that axis): the head's first offset plus d
    strides, one division per head instead of one per lane."""
    if HEADVEC:
        off = flat_off(i0, n1, n2, s0, s1, s2) + d * s2
    else:
        off = flat_off(i0 + d, n1, n2, s0, s1, s2)
    return off


@device
def _rope_lanes(f, f_n1, f_n2, f_s0, f_s1, f_s2, dd, dm, D, pos, HEADVEC: tl.constexpr = False):
    """RoPE over a [D] head vector as lanes: each lane's rotate-half partner ``pd`` and the
    cos / signed sin it takes, so rope(x)[d] = x[d] * c[d] + x[pd[d]] * s[d] (HF
    apply_rotary_pos_emb). ``HEADVEC``: as ``_head_off``, for inv_freq's D/2 elements."""
    half = D // 2
    lo = dd < half
    pd = tl.where(lo, dd + half, dd - half)
    j = tl.where(lo, dd, dd - half)
    fr = tl.load(f + _head_off(0, f_n1, f_n2, f_s0, f_s1, f_s2, j, HEADVEC), mask=dm, other=0)
    c, s = _cos_sin(pos.to(tl.float32) * fr.to(tl.float32))
    return pd, c, tl.where(lo, -s, s)


@device
def _positions(pos, KV_NEW: tl.constexpr, PARTIAL: tl.constexpr, parts, part):
    """The positions [lo, hi) a task attends to (all of 0..pos, or split-KV part ``part`` of
    ``parts``) and TE: the cache rows below it read from the caches (row pos comes from k and
    v with KV_NEW)."""
    T = pos + 1
    if KV_NEW:
        TC = pos
    else:
        TC = T
    if PARTIAL:
        lo = (part * T) // parts
        hi = ((part + 1) * T) // parts
    else:
        lo = pos * 0
        hi = T
    return lo, hi, tl.minimum(TC, hi)


@device
def _kv_new(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, g, D, dd, dm, pd, c, s,
            KT: tl.constexpr, VT: tl.constexpr, HEADVEC: tl.constexpr, KV_NEW: tl.constexpr):
    """With KV_NEW, KV head g's key at the current position, rope(k[g*D:(g+1)*D]) rounded to
    the K cache's dtype KT, and its value v[g*D:(g+1)*D] rounded to VT: what rope_append
    stores in row pos (else ``c`` twice, unused: a typed value that the compiler drops).
    ``HEADVEC``: as ``_head_off``."""
    if KV_NEW:
        kl = tl.load(k + _head_off(g * D, k_n1, k_n2, k_s0, k_s1, k_s2, dd, HEADVEC), mask=dm,
                     other=0).to(tl.float32)
        kp = tl.load(k + _head_off(g * D, k_n1, k_n2, k_s0, k_s1, k_s2, pd, HEADVEC), mask=dm,
                     other=0).to(tl.float32)
        vl = tl.load(v + _head_off(g * D, v_n1, v_n2, v_s0, v_s1, v_s2, dd, HEADVEC), mask=dm,
                     other=0).to(tl.float32)
        knew = round_as(kl * c + kp * s, KT)
        vnew = round_as(vl, VT)
    else:
        knew = c
        vnew = c
    return knew, vnew


@device
def attention(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, pos,
              o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale,
              f, f_n1, f_n2, f_s0, f_s1, f_s2, ROPE: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, KV_ALIGN: tl.constexpr = 0,
              k=None, k_n1=1, k_n2=1, k_s0=0, k_s1=0, k_s2=1, v=None, v_n1=1, v_n2=1, v_s0=0, v_s1=0, v_s2=1,
              KV_NEW: tl.constexpr = False, PARTIAL: tl.constexpr = False, parts=1, part=0,
              PROF=None, PROFILE: tl.constexpr = False, HEADVEC: tl.constexpr = False):
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

    Requires D <= BLOCK_D and HQ/G <= BLOCK_Q; ``pos`` is range-checked by the caller. With
    BLOCK_Q = 1 (one query head per KV head: the tasks of ``attn_split``, or an MHA model)
    the heads run ``_attention_1q``. Otherwise the HQ/G query heads of one KV head are
    processed together (the cache is read once per KV head) with an online softmax (running
    max and sum) over BLOCK_T positions at a time, in [Q, T, D] products.

    The K and V blocks of positions t0 + BLOCK_T .. are loaded (in the cache dtype) before
    the block t0 is reduced, so each block's load latency overlaps the previous block's
    arithmetic instead of adding up over the context. ``KV_ALIGN`` (0 or elements per 16
    bytes): the caches have unit head-dim stride and ``kc``, ``vc``, their head and position
    strides and ``D`` are multiples of it (the table's ``kvaligned`` flag), so the loads are
    vectors of up to 16 bytes.

    ``PARTIAL`` (split-KV, ir/ops.py): part ``part`` of ``parts`` attends to positions
    [part * T // parts, (part + 1) * T // parts) of the T = pos + 1 only and stores, per query
    head, the f32 record (acc, m, l) of head_dim + 2 elements instead of acc / l.

    ``HEADVEC`` (the table's ``headvec`` flag): q, k, v, inv_freq and o address a head's lanes
    from its first element (``_head_off``).

    ``PROFILE``: %globaltimer at ``PROF + 8`` as the position loop starts and ``PROF + 9``
    as it ends (the last KV head's; the megakernel's attention stamps, vm.PROF_W)."""
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    if KV_ALIGN > 1:  # the K/V blocks' head-dim mask, D restated as a multiple of KV_ALIGN (the
        # flag says it is): with a bare run-time D it split every block load into 16-bit loads
        dmv = dd < aligned(D, KV_ALIGN)
        kc_g = aligned(kc_g, KV_ALIGN)
        kc_t = aligned(kc_t, KV_ALIGN)
        vc_g = aligned(vc_g, KV_ALIGN)
        vc_t = aligned(vc_t, KV_ALIGN)
        kc_d = 1
        vc_d = 1
    else:
        dmv = dm
    if ROPE:
        pd, c, s = _rope_lanes(f, f_n1, f_n2, f_s0, f_s1, f_s2, dd, dm, D, pos, HEADVEC)
    else:  # unused
        pd = dd
        c = dd.to(tl.float32)
        s = c
    lo, hi, TE = _positions(pos, KV_NEW, PARTIAL, parts, part)
    if BLOCK_Q == 1:
        for g in range(0, G):
            _attention_1q(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc + g * kc_g, kc_t, kc_d, vc + g * vc_g, vc_t, vc_d,
                          pos, o, o_n1, o_n2, o_s0, o_s1, o_s2, g, D, scale, ROPE, BLOCK_T, KV_ALIGN,
                          k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, KV_NEW, PARTIAL,
                          dd, dm, dmv, pd, c, s, lo, hi, TE, PROF, PROFILE, HEADVEC)
    else:
        _attention_group(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d,
                         pos, o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale, ROPE, BLOCK_T, BLOCK_Q,
                         KV_ALIGN, k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, KV_NEW,
                         PARTIAL, dd, dm, dmv, pd, c, s, lo, hi, TE, PROF, PROFILE, HEADVEC)


@device
def _attention_group(q, q_n1, q_n2, q_s0, q_s1, q_s2, kc, kc_g, kc_t, kc_d, vc, vc_g, vc_t, vc_d, pos,
                     o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, G, D, scale, ROPE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, KV_ALIGN: tl.constexpr,
                     k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
                     KV_NEW: tl.constexpr, PARTIAL: tl.constexpr, dd, dm, dmv, pd, c, s, lo, hi, TE,
                     PROF, PROFILE: tl.constexpr, HEADVEC: tl.constexpr):
    """``attention`` for HQ/G <= BLOCK_Q query heads per KV head, each KV head's heads
    together: [Q, T, D] scores and value sums with one running max and sum per query head.
    ``dd`` .. ``TE``: attention's head-dim lanes and masks, RoPE lanes and positions."""
    grp = HQ // G
    qh = tl.arange(0, BLOCK_Q)
    qm = qh < grp
    for g in range(0, G):
        qi = (g * grp + qh)[:, None] * D + dd[None, :]
        qmask = qm[:, None] & dm[None, :]
        qv = tl.load(q + flat_off(qi, q_n1, q_n2, q_s0, q_s1, q_s2), mask=qmask, other=0).to(tl.float32)
        if ROPE:
            qpi = (g * grp + qh)[:, None] * D + pd[None, :]
            qp = tl.load(q + flat_off(qpi, q_n1, q_n2, q_s0, q_s1, q_s2), mask=qmask, other=0).to(tl.float32)
            qv = round_as(qv * c[None, :] + qp * s[None, :], q.dtype.element_ty)
        knew, vnew = _kv_new(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, g, D, dd, dm,
                             pd, c, s, kc.dtype.element_ty, vc.dtype.element_ty, HEADVEC, KV_NEW)
        m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, dd.shape[0]], dtype=tl.float32)
        kb = kc + g * kc_g
        vb = vc + g * vc_g
        knext, vnext = _kv_start(kb, kc_t, kc_d, vb, vc_t, vc_d, lo, dd, dmv, TE, KV_ALIGN, BLOCK_T, PROF, PROFILE)
        for t0 in range(lo, hi, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tm = t < hi
            kt, vt, knext, vnext = _kv_take(knext, vnext, kb, kc_t, kc_d, vb, vc_t, vc_d, t, dd, dmv, TE, pos,
                                            knew, vnew, KV_NEW, KV_ALIGN, BLOCK_T)
            sc = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale  # [BQ, BT]
            sc = tl.where(tm[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            acc = acc * alpha[:, None] + tl.sum(pr[:, :, None] * vt[None, :, :], axis=1)
            m_i = m_new
        if PROFILE:
            tl.store(PROF + 9, global_timer())
        if PARTIAL:  # the head's record: acc[0:D], then m, then l
            ri = (g * grp + qh) * (D + 2)
            store(o + flat_off(ri[:, None] + dd[None, :], o_n1, o_n2, o_s0, o_s1, o_s2), acc, qmask)
            store(o + flat_off(ri + D, o_n1, o_n2, o_s0, o_s1, o_s2), m_i, qm)
            store(o + flat_off(ri + D + 1, o_n1, o_n2, o_s0, o_s1, o_s2), l_i, qm)
        else:
            out = acc / l_i[:, None]
            store(o + flat_off(qi, o_n1, o_n2, o_s0, o_s1, o_s2), out, qmask)


@device
def _attention_1q(q, q_n1, q_n2, q_s0, q_s1, q_s2, kb, kc_t, kc_d, vb, vc_t, vc_d, pos,
                  o, o_n1, o_n2, o_s0, o_s1, o_s2, g, D, scale, ROPE: tl.constexpr,
                  BLOCK_T: tl.constexpr, KV_ALIGN: tl.constexpr,
                  k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2,
                  KV_NEW: tl.constexpr, PARTIAL: tl.constexpr, dd, dm, dmv, pd, c, s, lo, hi, TE,
                  PROF, PROFILE: tl.constexpr, HEADVEC: tl.constexpr):
    """``attention`` of query head g over KV head g (kb, vb: its cache rows) when each KV head
    has one query head. ``dd`` .. ``TE``: attention's head-dim lanes and masks, RoPE lanes and
    positions.

    Each of the BLOCK_T position slots of a [BLOCK_T, D] block keeps its own running max, sum
    and [D] accumulator (slot i sees positions lo + i, lo + i + BLOCK_T, ...), so a block
    costs one dot product per row (a reduction inside a warp) and element-wise updates: no
    layout conversion and no CTA barrier in the position loop, where the [Q, T, D] form
    moves its scores, softmax and value sums between layouts through shared memory. The
    slots are merged once at the end as split-KV parts are (attention_combine):
    m = max_i m_i, w_i = exp(m_i - m), l = sum_i w_i l_i, acc = sum_i w_i acc_i (Dao et al.,
    "Flash-Decoding for long-context inference", 2023, inside one CTA). fp32; the sums are
    reassociated against the sequential online softmax, equal to rounding."""
    qv = tl.load(q + _head_off(g * D, q_n1, q_n2, q_s0, q_s1, q_s2, dd, HEADVEC), mask=dm, other=0).to(tl.float32)
    if ROPE:
        qp = tl.load(q + _head_off(g * D, q_n1, q_n2, q_s0, q_s1, q_s2, pd, HEADVEC), mask=dm,
                     other=0).to(tl.float32)
        qv = round_as(qv * c + qp * s, q.dtype.element_ty)
    knew, vnew = _kv_new(k, k_n1, k_n2, k_s0, k_s1, k_s2, v, v_n1, v_n2, v_s0, v_s1, v_s2, g, D, dd, dm,
                         pd, c, s, kb.dtype.element_ty, vb.dtype.element_ty, HEADVEC, KV_NEW)
    m_s = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    l_s = tl.zeros([BLOCK_T], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T, dd.shape[0]], dtype=tl.float32)
    knext, vnext = _kv_start(kb, kc_t, kc_d, vb, vc_t, vc_d, lo, dd, dmv, TE, KV_ALIGN, BLOCK_T, PROF, PROFILE)
    for t0 in range(lo, hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        kt, vt, knext, vnext = _kv_take(knext, vnext, kb, kc_t, kc_d, vb, vc_t, vc_d, t, dd, dmv, TE, pos,
                                        knew, vnew, KV_NEW, KV_ALIGN, BLOCK_T)
        sc = tl.where(t < hi, tl.sum(kt * qv[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_s, sc)
        m_ok = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slot with no position yet: no NaN
        alpha = tl.exp(m_s - m_ok)
        pr = tl.exp(sc - m_ok)
        l_s = l_s * alpha + pr
        acc = acc * alpha[:, None] + pr[:, None] * vt
        m_s = m_new
    if PROFILE:
        tl.store(PROF + 9, global_timer())
    m_h = tl.max(m_s, axis=0)
    w = tl.exp(m_s - tl.where(m_h == float("-inf"), 0.0, m_h))  # an empty part: every w is 0
    l_h = tl.sum(w * l_s, axis=0)
    acc_h = tl.sum(acc * w[:, None], axis=0)
    if PARTIAL:  # the head's record: acc[0:D], then m, then l
        ri = g * (D + 2)
        store(o + _head_off(ri, o_n1, o_n2, o_s0, o_s1, o_s2, dd, HEADVEC), acc_h, dm)
        store(o + flat_off(ri + D, o_n1, o_n2, o_s0, o_s1, o_s2), m_h, None)
        store(o + flat_off(ri + D + 1, o_n1, o_n2, o_s0, o_s1, o_s2), l_h, None)
    else:
        store(o + _head_off(g * D, o_n1, o_n2, o_s0, o_s1, o_s2, dd, HEADVEC), acc_h / l_h, dm)



#: Most split-KV parts attention_combine merges (its BLOCK_P; lowering.config caps
#: attn_kv_split at this).
MAX_KV_PARTS = tl.constexpr(16)


@device
def attention_combine(p, p_n1, p_n2, p_s0, p_s1, p_s2, o, o_n1, o_n2, o_s0, o_s1, o_s2, HQ, D, P,
                      BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    """o[h] = sum_c w_c acc_c / sum_c w_c l_c, w_c = exp(m_c - max_c m_c), for query head
    h < HQ over the P <= BLOCK_P split-KV records (acc[D], m, l) of p ([P, HQ, D + 2] f32,
    flat); an empty part's m = -inf weighs 0. The P records of a head are loaded at once (one
    round trip, not P) and reduced as a tree (fp32; the reference sums in index order)."""
    R = D + 2
    dd = tl.arange(0, BLOCK_D)
    dm = dd < D
    cc = tl.arange(0, BLOCK_P)
    cm = cc < P
    for h in range(0, HQ):
        base = (cc * HQ + h) * R
        m = tl.load(p + flat_off(base + D, p_n1, p_n2, p_s0, p_s1, p_s2), mask=cm, other=float("-inf"))
        lc = tl.load(p + flat_off(base + D + 1, p_n1, p_n2, p_s0, p_s1, p_s2), mask=cm, other=0)
        a = tl.load(p + flat_off(base[:, None] + dd[None, :], p_n1, p_n2, p_s0, p_s1, p_s2),
                    mask=cm[:, None] & dm[None, :], other=0)
        w = tl.exp(m - tl.max(m, axis=0))
        num = tl.sum(w[:, None] * a, axis=0)
        den = tl.sum(w * lc, axis=0)
        store(o + flat_off(h * D + dd, o_n1, o_n2, o_s0, o_s1, o_s2), num / den, dm)


# ---------------------------------------------------------------- row decoders
@device
def t_rope(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DF: tl.constexpr,
           DP: tl.constexpr, DY: tl.constexpr, BLOCK: tl.constexpr):
    """rope (x, inv_freq, pos, y; param head_dim); a negative position is refused."""
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = operand(row, 0, slot)
    fo, fn0, fn1, fn2, fs0, fs1, fs2 = operand(row, 1, slot)
    po, pn0, pn1, pn2, ps0, ps1, ps2 = operand(row, 2, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 3, slot)
    pos = tl.load(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po).to(tl.int32)
    if pos < 0:
        st = fail_position(err, pos, pos * 0)
    else:
        rope(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2,
             arena_ptr(A_BF16, A_F16, A_F32, A_I32, DF) + fo, fn1, fn2, fs0, fs1, fs2, pos,
             arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
             xn0 * xn1 * xn2, param_i(row, 0), BLOCK)
        st = status_ok()
    return st


@device
def t_kv_append(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DK: tl.constexpr, DV: tl.constexpr,
                DF: tl.constexpr, DP: tl.constexpr, DKC: tl.constexpr, DVC: tl.constexpr,
                ROPE: tl.constexpr, BLOCK: tl.constexpr):
    """kv_append (operands k, v, pos, kc, vc) or, with ROPE, rope_append (k, v, inv_freq,
    pos, kc, vc)."""
    ko, kn0, kn1, kn2, ks0, ks1, ks2 = operand(row, 0, slot)
    vo, vn0, vn1, vn2, vs0, vs1, vs2 = operand(row, 1, slot)
    if ROPE:
        fo, fn0, fn1, fn2, fs0, fs1, fs2 = operand(row, 2, slot)
        PI: tl.constexpr = 3
    else:
        PI: tl.constexpr = 2
    po, pn0, pn1, pn2, ps0, ps1, ps2 = operand(row, PI, slot)
    co, cg, cs, cd, cgs, css, cds = operand(row, PI + 1, slot)
    uo, ug, us, ud, ugs, uss, uds = operand(row, PI + 2, slot)
    pos = tl.load(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po).to(tl.int32)
    if (pos < 0) | (pos >= cs):
        st = fail_position(err, pos, cs)
    else:
        if ROPE:
            rope_append(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DK) + ko, kn1, kn2, ks0, ks1, ks2,
                        arena_ptr(A_BF16, A_F16, A_F32, A_I32, DV) + vo, vn1, vn2, vs0, vs1, vs2,
                        arena_ptr(A_BF16, A_F16, A_F32, A_I32, DF) + fo, fn1, fn2, fs0, fs1, fs2, pos,
                        arena_ptr(A_BF16, A_F16, A_F32, A_I32, DKC) + co, cgs, css, cds,
                        arena_ptr(A_BF16, A_F16, A_F32, A_I32, DVC) + uo, ugs, uss, uds, cg, cd, BLOCK)
        else:
            kv_append(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DK) + ko, kn1, kn2, ks0, ks1, ks2,
                      arena_ptr(A_BF16, A_F16, A_F32, A_I32, DV) + vo, vn1, vn2, vs0, vs1, vs2, pos,
                      arena_ptr(A_BF16, A_F16, A_F32, A_I32, DKC) + co, cgs, css, cds,
                      arena_ptr(A_BF16, A_F16, A_F32, A_I32, DVC) + uo, ugs, uss, uds, cg, cd, BLOCK)
        st = status_ok()
    return st


@device
def t_attention(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DQ: tl.constexpr, DKC: tl.constexpr,
                DVC: tl.constexpr, DP: tl.constexpr, DF: tl.constexpr, DO: tl.constexpr, ROPE: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, KV_ALIGN: tl.constexpr = 0,
                DK: tl.constexpr = None, DV: tl.constexpr = None,
                KV_NEW: tl.constexpr = False, PARTIAL: tl.constexpr = False, PROF=None,
                PROFILE: tl.constexpr = False, HEADVEC: tl.constexpr = False):
    """attention (q, kc, vc, pos, o) or, with ROPE, rope_attention (q, kc, vc, pos,
    inv_freq, o) or, with ROPE and KV_NEW, rope_attention_kv (q, k, v, kc, vc, pos, inv_freq,
    o; DK, DV: the dtypes of k and v). ``KV_ALIGN``: the table's ``kvaligned`` flag
    (attention); ``PARTIAL``: its ``partial`` flag (a split-KV part: params parts, part).
    ``HEADVEC``: the table's ``headvec`` flag (attention's).
    ``PROFILE``: %globaltimer at ``PROF + 7`` once the position operand is read and
    range-checked, then attention's stamps 8 and 9 (vm.PROF_W)."""
    qo, qn0, qn1, qn2, qs0, qs1, qs2 = operand(row, 0, slot)
    if KV_NEW:
        CI: tl.constexpr = 3  # the caches follow q, k, v
    else:
        CI: tl.constexpr = 1
    co, cg, cs, cd, cgs, css, cds = operand(row, CI, slot)
    uo, ug, us, ud, ugs, uss, uds = operand(row, CI + 1, slot)
    po, pn0, pn1, pn2, ps0, ps1, ps2 = operand(row, CI + 2, slot)
    if ROPE:
        fo, fn0, fn1, fn2, fs0, fs1, fs2 = operand(row, CI + 3, slot)
        oo, on0, on1, on2, os0, os1, os2 = operand(row, CI + 4, slot)
        fp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DF) + fo
    else:
        oo, on0, on1, on2, os0, os1, os2 = operand(row, CI + 3, slot)
        fo, fn1, fn2, fs0, fs1, fs2 = oo, on1, on2, os0, os1, os2
        fp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DO) + fo
    if KV_NEW:
        ko, kn0, kn1, kn2, ks0, ks1, ks2 = operand(row, 1, slot)
        vo, vn0, vn1, vn2, vs0, vs1, vs2 = operand(row, 2, slot)
        kp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DK) + ko
        vp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DV) + vo
    else:  # unused
        kn1, kn2, ks0, ks1, ks2 = qn1, qn2, qs0, qs1, qs2
        vn1, vn2, vs0, vs1, vs2 = qn1, qn2, qs0, qs1, qs2
        kp = arena_ptr(A_BF16, A_F16, A_F32, A_I32, DQ) + qo
        vp = kp
    if KV_ALIGN > 1:
        co = aligned(co, KV_ALIGN)
        uo = aligned(uo, KV_ALIGN)
    pos = tl.load(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po).to(tl.int32)
    if (pos < 0) | (pos >= cs):
        st = fail_position(err, pos, cs)
    else:
        if PROFILE:  # in the branch: after the position's load has returned
            tl.store(PROF + 7, global_timer())
        hq = (qn0 * qn1 * qn2) // cd
        attention(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DQ) + qo, qn1, qn2, qs0, qs1, qs2,
                  arena_ptr(A_BF16, A_F16, A_F32, A_I32, DKC) + co, cgs, css, cds,
                  arena_ptr(A_BF16, A_F16, A_F32, A_I32, DVC) + uo, ugs, uss, uds, pos,
                  arena_ptr(A_BF16, A_F16, A_F32, A_I32, DO) + oo, on1, on2, os0, os1, os2,
                  hq, cg, cd, param_f(row, 1), fp, fn1, fn2, fs0, fs1, fs2, ROPE,
                  BLOCK_T, BLOCK_D, BLOCK_Q, KV_ALIGN,
                  kp, kn1, kn2, ks0, ks1, ks2, vp, vn1, vn2, vs0, vs1, vs2, KV_NEW,
                  PARTIAL, param_i(row, 2), param_i(row, 3), PROF, PROFILE, HEADVEC)
        st = status_ok()
    return st


@device
def t_attention_combine(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DP: tl.constexpr, DO: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """attention_combine (p, o; params head_dim, parts)."""
    po, pn0, pn1, pn2, ps0, ps1, ps2 = operand(row, 0, slot)
    oo, on0, on1, on2, os0, os1, os2 = operand(row, 1, slot)
    hd = param_i(row, 0)
    attention_combine(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po, pn1, pn2, ps0, ps1, ps2,
                      arena_ptr(A_BF16, A_F16, A_F32, A_I32, DO) + oo, on1, on2, os0, os1, os2,
                      (on0 * on1 * on2) // hd, hd, param_i(row, 1), BLOCK_D, MAX_KV_PARTS)
    return status_ok()


# ---------------------------------------------------------------- table encoding and dispatch
def _kc(task) -> int:
    """The operand index of the task's K cache (the V cache follows)."""
    return OPS[task.op].operand_index("kc", len(task.ins))


_call_rope = plain_call("t_rope", "ROPE_BLOCK")


def _call_kv_append(v: Variant) -> str:
    d = tl_dtypes(v)
    return f"t_kv_append({DECODER_ARGS}, {d[0]}, {d[1]}, tl.float32, {d[2]}, {d[3]}, {d[4]}, False, ROPE_BLOCK)"


_call_rope_append = plain_call("t_kv_append", "ROPE_BLOCK", ("True",))


#: The attention calls' profiling arguments: this task row's stamps (vm.PROF_W).
_PROF_ARGS = "PROF=PROF + i.to(tl.int64) * PROF_W, PROFILE=PROFILE"


def _headvec_arg(v: Variant) -> str:
    """The HEADVEC argument of an attention call (only when the flag is on: the other
    variants' calls stay as they were)."""
    return ", HEADVEC=True" if v.flag("headvec") else ""


def _call_attention(v: Variant) -> str:
    d = tl_dtypes(v)
    kva = 16 // DTYPE_BYTES[v.dtypes[1]] if v.flag("kvaligned") else 0
    rope = v.op == "rope_attention"
    tail = ", None, None, False, True" if v.flag("partial") else ""
    return (f"t_attention({DECODER_ARGS}, {d[0]}, {d[1]}, {d[2]}, {d[3]}, {d[4]}, {d[5] if rope else d[4]}, "
            f"{rope}, ATT_T, ATT_D, ATT_Q, {kva}{tail}, {_PROF_ARGS}{_headvec_arg(v)})")


def _call_attention_kv(v: Variant) -> str:  # q, k, v, kc, vc, pos, inv_freq, o
    d = tl_dtypes(v)
    kva = 16 // DTYPE_BYTES[v.dtypes[3]] if v.flag("kvaligned") else 0
    tail = ", True" if v.flag("partial") else ""
    return (f"t_attention({DECODER_ARGS}, {d[0]}, {d[3]}, {d[4]}, {d[5]}, {d[6]}, {d[7]}, "
            f"True, ATT_T, ATT_D, ATT_Q, {kva}, {d[1]}, {d[2]}, True{tail}, {_PROF_ARGS}{_headvec_arg(v)})")


_call_attention_combine = plain_call("t_attention_combine", "ATT_D")


def _flags_attention(task, dtypes, descs, slots) -> dict[str, bool]:
    """``kvaligned``: the K and V caches ([G, T, D]) have unit head-dim stride, every row
    starts on a 16-byte boundary and D is a multiple of 16 bytes, so the kernel loads them as
    16-byte vectors (attention's KV_ALIGN). ``partial`` (set only when on, so unsplit
    variants are unchanged): a split-KV part (params parts >= 2), which stores partial
    records (attention's PARTIAL). ``headvec`` (set only when on): ``_head_vectors``
    (attention's HEADVEC)."""
    ci = _kc(task)
    vec = 16 // DTYPE_BYTES[dtypes[ci]]
    flags = {"kvaligned": DTYPE_BYTES[dtypes[ci]] == DTYPE_BYTES[dtypes[ci + 1]] and all(
        d.s[2] == 1 and d.s[1] % vec == 0 and d.s[0] % vec == 0 and d.n[2] % vec == 0
        and L.starts_aligned(d, vec, slots) for d in descs[ci:ci + 2])}
    partial = int(task.params.get("parts", 1)) > 1
    if partial:
        flags["partial"] = True
    if _head_vectors(task, descs, partial):
        flags["headvec"] = True
    return flags


def _head_vectors(task, descs, partial: bool) -> bool:
    """Whether q, the current k and v, inv_freq and o never split a head over their views'
    last axis: each view's last extent a multiple of the length the kernel indexes it by
    (head_dim; head_dim + 2 for a split-KV part's records; head_dim / 2 for inv_freq), so a
    head's lanes are its first element plus unit steps of that axis's stride (_head_off)."""
    hd = int(task.params["head_dim"])
    n = len(descs)
    lens = {0: hd, n - 1: hd + 2 if partial else hd}
    if task.op != "attention":
        lens[n - 2] = hd // 2
    if task.op == "rope_attention_kv":
        lens[1] = lens[2] = hd
    return all(descs[i].n[2] % ln == 0 for i, ln in lens.items())


def _check(task, descs, where) -> None:
    """The caches viewed as [G, S, head_dim], alike; the sources hold G heads (appends) or
    whole query heads that split over G (attention); RoPE needs an even head_dim."""
    op = task.op
    hd = int(task.params["head_dim"])
    ci = _kc(task)
    caches = descs[ci:ci + 2]
    if op.startswith("rope_") and hd % 2:
        raise TableError(f"{where}: head_dim={hd} must be even for RoPE")
    for c in caches:
        if c.n[2] != hd:
            raise TableError(f"{where}: cache head axis has {c.n[2]} elements, head_dim={hd}")
    if caches[0].n[:2] != caches[1].n[:2]:
        raise TableError(f"{where}: k and v cache regions differ: {caches[0].n} vs {caches[1].n}")
    src = descs[0]
    g = caches[0].n[0]
    if op in ("kv_append", "rope_append"):
        for d in descs[:2]:
            if d.numel != g * hd:
                raise TableError(f"{where}: cache holds {g} heads, source has {d.numel} elements")
    else:
        if src.numel % hd or (src.numel // hd) % g:
            raise TableError(f"{where}: {src.numel // hd} query heads do not split over {g} kv heads")
        if op == "rope_attention_kv":
            for d in descs[1:3]:
                if d.numel != g * hd:
                    raise TableError(f"{where}: caches hold {g} heads, current k / v has {d.numel} elements")


def _check_combine(task, descs, where) -> None:
    """At most MAX_KV_PARTS parts (the kernel's BLOCK_P)."""
    if int(task.params["parts"]) > MAX_KV_PARTS.value:
        raise TableError(f"{where}: attention_combine of {task.params['parts']} parts; the triton backend "
                         f"merges at most {MAX_KV_PARTS.value}")


def _dims_combine(task, descs) -> dict[str, int]:
    """attention_combine's head_dim (ATT_D covers it)."""
    return {"head_dim": int(task.params["head_dim"]), "group": 1}


def _dims(task, descs) -> dict[str, int]:
    """The head_dim and the GQA group (query heads per kv head) the kernel's attention
    blocks must cover (ATT_D, ATT_Q)."""
    hd = int(task.params["head_dim"])
    return {"head_dim": hd, "group": descs[0].numel // hd // descs[_kc(task)].n[0]}


_HD = (("head_dim", "i"),)
_HD_SCALE = (("head_dim", "i"), ("scale", "f"), ("parts", "i"), ("part", "i"))
_SPLIT_KV_DEFAULTS = {"parts": 1, "part": 0}

LOWERINGS = (
    OpLowering("rope", ("flat", "flat", "flat", "flat"), t_rope, _call_rope, params=_HD, in_place="same"),
    OpLowering("kv_append", ("flat", "flat", "flat", "cache", "cache"), t_kv_append, _call_kv_append,
               params=_HD, check=_check),
    OpLowering("rope_append", ("flat", "flat", "flat", "flat", "cache", "cache"), t_kv_append, _call_rope_append,
               params=_HD, check=_check),
    OpLowering("attention", ("flat", "cache", "cache", "flat", "flat"), t_attention, _call_attention,
               params=_HD_SCALE, param_defaults=_SPLIT_KV_DEFAULTS, flags=_flags_attention, check=_check,
               dims=_dims),
    OpLowering("rope_attention", ("flat", "cache", "cache", "flat", "flat", "flat"), t_attention, _call_attention,
               params=_HD_SCALE, param_defaults=_SPLIT_KV_DEFAULTS, flags=_flags_attention, check=_check,
               dims=_dims),
    OpLowering("rope_attention_kv", ("flat", "flat", "flat", "cache", "cache", "flat", "flat", "flat"), t_attention,
               _call_attention_kv, params=_HD_SCALE, param_defaults=_SPLIT_KV_DEFAULTS, flags=_flags_attention,
               check=_check, dims=_dims),
    OpLowering("attention_combine", ("flat", "flat"), t_attention_combine, _call_attention_combine,
               params=(("head_dim", "i"), ("parts", "i")), check=_check_combine, dims=_dims_combine),
)
