"""The weight ring: GEMV weights streamed into shared memory ahead of the tasks that use them.

Batch-1 decode reads every weight once per step; a GEMV task that loads its weights only when
its waits hold leaves the memory system idle during every wait, every hand-off and every
non-GEMV task. With the ring (``Blocks.ring`` = S pages), each worker CTA keeps S pages of
``PR x PC`` bf16 weights (``PAGE`` bytes each) in a ring of shared-memory buffers, filled by
bulk asynchronous copies (``cp.async.bulk`` global -> shared, completing on one mbarrier per
page; PTX ISA "cp.async.bulk", "mbarrier") in the order the worker's queue will consume them.
Weights depend on nothing (table.FLAG_W_CONST: no task of the program writes them), so pages
are issued *before* the waits of the task that uses them, across task boundaries: the stream
stops only when all S pages are full, never because a counter is not yet signalled. The
GEMV (``gemv_ring``) waits on its page's mbarrier, multiplies the page by the staged f(x),
and frees the page, which is refilled at once with the next page in queue order.

One role, not two: the copies are issued by thread 0 of the worker's own warps, at the start
of every task (before its waits) and after every page a GEMV consumes. A separate loader
warp (warp specialisation) would issue the same copies; it is not needed because issuing is
never blocked by a counter: when a worker spins on a wait, the ring is already full.

Page order (``page_order``; the host's stream list and the kernel's consumer agree on it):
for a weight tile W[N, K] (row stride ``rs`` bytes), pages run over row blocks of PR rows,
and within a row block over column blocks of PC columns; a page holds
``min(PR, N - r0) x min(PC, K - c0)`` elements, its rows ``min(K, PC)`` elements apart in
shared memory. A tile with K <= PC whose rows are contiguous is one copy per page, otherwise
one copy per row.

Shared memory: the ring lives in the kernel's dynamic shared memory after Triton's own
allocation (Triton's PTX names that buffer ``global_smem``; the runtime launches the kernel
with ``RING_SMEM(S, PAGE)`` more bytes and passes the ring's byte offset ``rbase``): S pages,
then S 8-byte mbarriers. Under the Triton interpreter there is no shared memory: the loader
functions do nothing and ``gemv_ring`` reads each page's weights from global memory, with the
same page order, masks and arithmetic.
"""

from __future__ import annotations

import triton.language as tl

from lowering.triton.ops import INTERPRET, device, global_timer, store, thread0_asm, flat_off

#: Fields of one stream-list entry (int64): the weight tile's byte offset in the arena, its
#: rows N, its columns K, and its row stride in bytes.
STREAM_W = 4
_STREAM_W = tl.constexpr(STREAM_W)


def ring_smem(pages: int, page_bytes: int) -> int:
    """Dynamic shared memory (bytes) the ring adds to a launch: the pages and one mbarrier
    (8 bytes) per page."""
    return pages * page_bytes + 8 * pages


def page_order(n: int, k: int, pr: int, pc: int) -> list[tuple[int, int, int, int]]:
    """The pages of a weight tile W[n, k] in ring order: (row, column, rows, columns) of each,
    row blocks of ``pr`` rows outer, column blocks of ``pc`` columns inner (the order
    ``ring_issue`` copies and ``gemv_ring`` consumes them)."""
    return [(r0, c0, min(pr, n - r0), min(pc, k - c0)) for r0 in range(0, n, pr) for c0 in range(0, k, pc)]


_SMEM = tl.constexpr("mov.u32 $0, global_smem;")
_INIT = tl.constexpr(thread0_asm("@%amk_q mbarrier.init.shared::cta.b64 [$1], 1;\n"))
_INIT_FENCE = tl.constexpr(thread0_asm("@%amk_q fence.mbarrier_init.release.cluster;\n"))
# arm the page's mbarrier for ``bytes`` of copies (one arrival: the phase completes when the
# bytes have landed); the proxy fence orders the CTA's earlier generic reads of the page
# (ordered before this thread by the caller's barrier) before the async proxy's writes
_EXPECT = tl.constexpr(thread0_asm(
    "@%amk_q fence.proxy.async.shared::cta;\n"
    ".reg .b64 %amk_st;\n"
    "@%amk_q mbarrier.arrive.expect_tx.shared::cta.b64 %amk_st, [$1], $2;\n"))
_COPY = tl.constexpr(thread0_asm(
    ".reg .pred %amk_d;\nsetp.ne.s32 %amk_d, $4, 0;\nand.pred %amk_q, %amk_q, %amk_d;\n"
    "@%amk_q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], $3, [$5];\n"))
_TRY_WAIT = tl.constexpr(
    "{ .reg .pred %rw_p; mbarrier.try_wait.parity.shared::cta.b64 %rw_p, [$1], $2; selp.u32 $0, 1, 0, %rw_p; }")
_LDS4 = tl.constexpr("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];")
_LDG4F = tl.constexpr("ld.global.v4.f32 {$0, $1, $2, $3}, [$4];")


@device
def smem_addr(off):
    """The shared-state-space address (u32) of byte ``off`` of the kernel's dynamic shared
    memory."""
    return tl.inline_asm_elementwise(_SMEM, "=r", [], dtype=tl.int32, is_pure=True, pack=1) + off


@device
def ring_init(rbase, S: tl.constexpr, PAGE: tl.constexpr):
    """Initialise the ring's S mbarriers (thread 0; one arrival each), make them visible to
    the asynchronous proxy, and synchronise the CTA. Once per launch, before any copy."""
    if not INTERPRET:
        bars = smem_addr(rbase + S * PAGE)
        for s in tl.static_range(S):
            tl.inline_asm_elementwise(_INIT, "=r,r", [bars + 8 * s], dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise(_INIT_FENCE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()


@device
def stream_entry(STREAMS, si, se):
    """Stream-list entry ``si`` as (byte offset, N, K, row stride bytes); zeros at the end."""
    e = STREAMS + si.to(tl.int64) * _STREAM_W
    ok = si < se
    return (tl.load(e, mask=ok, other=0), tl.load(e + 1, mask=ok, other=0).to(tl.int32),
            tl.load(e + 2, mask=ok, other=0).to(tl.int32), tl.load(e + 3, mask=ok, other=0))


@device
def ring_issue(A_I32, STREAMS, se, rbase, pc, pi, si, sj, c_off, c_n, c_k, c_rs,
               S: tl.constexpr, PR: tl.constexpr, PC: tl.constexpr):
    """Copy pages into the ring while a page is free (``pi - pc < S``) and the worker's
    stream list (entries ``si`` .. ``se - 1``) has pages left. State: ``pc`` pages consumed,
    ``pi`` issued, ``sj`` pages of entry ``si`` issued, ``c_*`` that entry (stream_entry).
    Returns the new (pi, si, sj, c_off, c_n, c_k, c_rs). Page p goes to slot p % S. The
    caller guarantees that every thread has finished reading the page consumed last (a CTA
    barrier). A no-op under the interpreter."""
    if not INTERPRET:
        PAGE: tl.constexpr = PR * PC * 2
        while (pi - pc < S) & (si < se):
            nkb = tl.cdiv(c_k, PC)
            rb = sj // nkb
            cb = sj - rb * nkb
            rows = tl.minimum(PR, c_n - rb * PR)
            cols = tl.minimum(PC, c_k - cb * PC)
            slot = pi % S
            dst = smem_addr(rbase + slot * PAGE)
            bar = smem_addr(rbase + S * PAGE + slot * 8)
            # the arena as int32: every byte offset here is a multiple of 16 (table.stream_list)
            src = A_I32 + ((c_off + (rb * PR).to(tl.int64) * c_rs + cb * (PC * 2)) >> 2)
            tl.inline_asm_elementwise(_EXPECT, "=r,r,r", [bar, rows * cols * 2], dtype=tl.int32,
                                      is_pure=False, pack=1)
            if (c_k <= PC) & (c_rs == c_k * 2):  # whole contiguous rows: one copy
                tl.inline_asm_elementwise(_COPY, "=r,r,l,r,r,r", [dst, src, rows * cols * 2, rows * 0 + 1, bar],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:  # one copy per row, rows min(K, PC) elements apart in the page
                rstride = tl.minimum(c_k, PC) * 2
                for r in tl.static_range(PR):
                    tl.inline_asm_elementwise(_COPY, "=r,r,l,r,r,r",
                                              [dst + r * rstride, src + ((r * c_rs) >> 2), cols * 2, (r < rows).to(tl.int32),
                                               bar], dtype=tl.int32, is_pure=False, pack=1)
            pi += 1
            sj += 1
            if sj == tl.cdiv(c_n, PR) * nkb:
                si += 1
                sj = 0
                c_off, c_n, c_k, c_rs = stream_entry(STREAMS, si, se)
    return pi, si, sj, c_off, c_n, c_k, c_rs


@device
def ring_wait(rbase, p, timeout, S: tl.constexpr, PAGE: tl.constexpr):
    """Wait until page ``p`` (slot p % S, phase parity (p // S) & 1) has landed. Returns 0,
    or 1 if it did not within ``timeout`` ns (the same decision in every thread). Always 0
    under the interpreter."""
    kind = tl.full([], 0, dtype=tl.int32)
    if not INTERPRET:
        bar = smem_addr(rbase + S * PAGE + (p % S) * 8)
        par = (p // S) & 1
        done = tl.inline_asm_elementwise(_TRY_WAIT, "=r,r,r", [bar, par], dtype=tl.int32, is_pure=False, pack=1)
        if done == 0:
            t0 = global_timer()
            now = t0
            while (done == 0) & ((now - t0) < timeout):
                done = tl.inline_asm_elementwise(_TRY_WAIT, "=r,r,r", [bar, par], dtype=tl.int32,
                                                 is_pure=False, pack=1)
                now = global_timer()
        kind = tl.max(tl.full([1024], 0, dtype=tl.int32) + (done == 0).to(tl.int32), axis=0)
    return kind


@device
def ring_drain(rbase, pc, pi, timeout, S: tl.constexpr, PAGE: tl.constexpr):
    """Wait for every issued page not consumed (``pc`` .. ``pi - 1``): a CTA must not exit
    with copies into its shared memory in flight (after an error stopped its queue)."""
    while pc < pi:
        ring_wait(rbase, pc, timeout, S, PAGE)
        pc += 1


@device
def _bf16_lo(v):
    """The bf16 in the low half of int32 ``v`` (the lower address), widened to fp32."""
    return (v << 16).to(tl.float32, bitcast=True)


@device
def _bf16_hi(v):
    """The bf16 in the high half of int32 ``v``, widened to fp32."""
    return (v & -65536).to(tl.float32, bitcast=True)


@device
def _page_dot(rbase, slot, wp, w_rs, r0, c0, xs, N, K, after, S: tl.constexpr, PR: tl.constexpr, PC: tl.constexpr):
    """[PR, PC // 8] fp32 partial sums of one page: lane (r, j) holds
    sum_{m<8} W[r0 + r, c0 + 8j + m] * xs[c0 + 8j + m] (0 outside the tile). On the GPU W comes
    from the page in shared memory (16-byte ``ld.shared.v4``, 8 bf16 each) and xs as two
    16-byte loads; under the interpreter from W in global memory (``wp``, row stride
    ``w_rs`` elements). The xs loads are pure asm (so the copies Triton makes for each row a
    thread holds are merged into one) that takes ``after`` (the page wait's result) as an
    operand: that data dependency keeps them after the wait, hence after the staging
    barrier."""
    VC: tl.constexpr = PC // 8
    rr = tl.arange(0, PR)
    vv = tl.arange(0, VC)
    cols = c0 + 8 * vv
    vm = cols < K
    m = ((r0 + rr) < N)[:, None] & vm[None, :]
    if INTERPRET:
        wb = wp + (r0 + rr).to(tl.int64)[:, None] * w_rs + cols[None, :]
        d = tl.zeros([PR, VC], dtype=tl.float32)
        for u in tl.static_range(8):
            w = tl.load(wb + u, mask=m, other=0).to(tl.float32)
            x = tl.load(xs + cols + u, mask=vm, other=0)
            d += w * x[None, :]
    else:
        PAGE: tl.constexpr = PR * PC * 2
        page = smem_addr(rbase + slot * PAGE)
        rstride = tl.minimum(K, PC)
        addr = page + (rr[:, None] * rstride + 8 * vv[None, :]) * 2
        addr = tl.where(m, addr, page)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_LDS4, "=r,=r,=r,=r,r", [addr],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=False, pack=1)
        xp = tl.where(vm, xs + cols, xs)
        x0, x1, x2, x3 = tl.inline_asm_elementwise(_LDG4F, "=f,=f,=f,=f,l,r", [xp, after],
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
        x4, x5, x6, x7 = tl.inline_asm_elementwise(_LDG4F, "=f,=f,=f,=f,l,r", [xp + 4, after],
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
        d = _bf16_lo(w0) * x0[None, :] + _bf16_hi(w0) * x1[None, :]
        d += _bf16_lo(w1) * x2[None, :] + _bf16_hi(w1) * x3[None, :]
        d += _bf16_lo(w2) * x4[None, :] + _bf16_hi(w2) * x5[None, :]
        d += _bf16_lo(w3) * x6[None, :] + _bf16_hi(w3) * x7[None, :]
        d = tl.where(m, d, 0.0)
    return d


@device
def gemv_ring(xs, wp, w_rs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
              HAS_BIAS: tl.constexpr, m1, m2, m3, MIRRORS: tl.constexpr,
              A_I32, STREAMS, se, rbase, pc, pi, si, sj, c_off, c_n, c_k, c_rs, timeout,
              S: tl.constexpr, PR: tl.constexpr, PC: tl.constexpr):
    """y[N] = W[N, K] @ xs[K] (+ b), W bf16 streamed through the ring, xs the staged f(x)
    (fp32, 16-byte aligned, at least K + 8 readable elements: the worker's scratch row),
    fp32 accumulation. Pages are consumed in ``page_order``; after each one the CTA
    synchronises (every thread has read it) and the ring is topped up (ring_issue) into the
    freed slot. The epilogue is ops.gemv_ex's: ``b`` (HAS_BIAS) added, y stored rounded to
    its dtype, and at ``y + m1`` .. ``m3`` (MIRRORS, peer copies of y).
    Returns (status: 0 or 1 when a page never arrived, pc, pi, si, sj, c_off, c_n, c_k, c_rs)."""
    PAGE: tl.constexpr = PR * PC * 2
    VC: tl.constexpr = PC // 8
    nkb = tl.cdiv(K, PC)
    st = tl.full([], 0, dtype=tl.int32)
    r0 = N * 0
    while (r0 < N) & (st == 0):
        acc = tl.zeros([PR, VC], dtype=tl.float32)
        cb = nkb * 0
        while (cb < nkb) & (st == 0):
            st = ring_wait(rbase, pc, timeout, S, PAGE)
            if st == 0:
                acc += _page_dot(rbase, pc % S, wp, w_rs, r0, cb * PC, xs, N, K, st + pc, S, PR, PC)
                tl.debug_barrier()  # every thread has read the page: its slot may be refilled
                pc += 1
                pi, si, sj, c_off, c_n, c_k, c_rs = ring_issue(A_I32, STREAMS, se, rbase, pc, pi, si, sj, c_off, c_n,
                                                               c_k, c_rs, S, PR, PC)
            cb += 1
        if st == 0:
            rows = r0 + tl.arange(0, PR)
            rm = rows < N
            out = tl.sum(acc, axis=1)
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
        r0 += PR
    return st, pc, pi, si, sj, c_off, c_n, c_k, c_rs
