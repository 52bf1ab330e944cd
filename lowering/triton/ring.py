"""The weight ring: GEMV weights streamed into shared memory ahead of the tasks that use them.

Batch-1 decode reads every weight once per step; a GEMV task that loads its weights only when
its waits hold leaves the memory system idle during every wait, every hand-off and every
non-GEMV task. With the ring (``Blocks.ring`` = S pages), each worker CTA keeps S pages of
``PR x PC`` bf16 weights (``PAGE`` bytes each) in a ring of shared-memory buffers, filled by
bulk asynchronous copies (``cp.async.bulk`` global -> shared, completing on one mbarrier per
page; PTX ISA "cp.async.bulk", "mbarrier") in the order the worker's queue will consume them.
Weights depend on nothing (layout.FLAG_W_CONST: no task of the program writes them), so pages
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

from lowering.triton.lang import INTERPRET, device, flat_off, global_timer, store_mirrored, thread0_asm

#: Fields of one stream-list entry (int64): the weight tile's byte offset in the arena, its row
#: stride in bytes, its rows N << 32 | its columns K, and one unused field.
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
# bytes have landed). The CTA's reads of the slot's previous page are complete before this
# (the caller's barrier); like a TMA pipeline's producer after its consumer's release, no
# proxy fence is needed for that write-after-read.
_EXPECT = tl.constexpr(thread0_asm(
    ".reg .b64 %amk_st;\n"
    "@%amk_q mbarrier.arrive.expect_tx.shared::cta.b64 %amk_st, [$1], $2;\n"))
_COPY = tl.constexpr(thread0_asm(
    ".reg .pred %amk_d;\nsetp.ne.s32 %amk_d, $4, 0;\nand.pred %amk_q, %amk_q, %amk_d;\n"
    "@%amk_q cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$1], [$2], $3, [$5];\n"))
_TRY_WAIT = tl.constexpr(
    "{ .reg .pred %rw_p; mbarrier.try_wait.parity.shared::cta.b64 %rw_p, [$1], $2; selp.u32 $0, 1, 0, %rw_p; }")
_LDS4 = tl.constexpr("ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];")
_PREFETCH_L1 = tl.constexpr(
    "{ .reg .pred %pl_p; setp.ne.s32 %pl_p, $2, 0; @%pl_p prefetch.global.L1 [$1]; mov.u32 $0, 0; }")


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
    """Stream-list entry ``si`` as (byte offset, row stride bytes, N << 32 | K); zeros past the
    worker's last entry ``se - 1``."""
    e = STREAMS + si.to(tl.int64) * _STREAM_W
    ok = si < se
    return tl.load(e, mask=ok, other=0), tl.load(e + 1, mask=ok, other=0), tl.load(e + 2, mask=ok, other=0)


@device
def ring_state(STREAMS, s0, se):
    """The ring's state at the start of a launch for a worker whose stream entries are
    ``s0 .. se - 1``: (pages consumed, pages issued, entry being issued, its next page's row
    block and column block, that entry, the entry after it). The next entry is loaded a whole
    entry ahead, so moving on never waits for a load."""
    z = s0 * 0
    c_off, c_rs, c_nk = stream_entry(STREAMS, s0, se)
    n_off, n_rs, n_nk = stream_entry(STREAMS, s0 + 1, se)
    return (z, z, s0, z, z, c_off, c_rs, c_nk, n_off, n_rs, n_nk)


@device
def ring_issue(A_I32, STREAMS, se, rbase, st, S: tl.constexpr, PR: tl.constexpr, PC: tl.constexpr):
    """Copy pages into the ring while a slot is free (issued - consumed < S) and the worker's
    stream list (entries up to ``se - 1``) has pages left, in ring order (page_order within
    an entry). ``st``: the state (ring_state). Page p goes to slot p % S. The caller
    guarantees that every thread has finished reading the page consumed last (a CTA
    barrier). Returns the new state; unchanged under the interpreter."""
    if not INTERPRET:
        PAGE: tl.constexpr = PR * PC * 2
        pc, pi, si, rb, cb, c_off, c_rs, c_nk, n_off, n_rs, n_nk = st
        while (pi - pc < S) & (si < se):
            cn = (c_nk >> 32).to(tl.int32)
            ck = (c_nk & 0xFFFFFFFF).to(tl.int32)
            rows = tl.minimum(PR, cn - rb * PR)
            cols = tl.minimum(PC, ck - cb * PC)
            slot = pi % S
            dst = smem_addr(rbase + slot * PAGE)
            bar = smem_addr(rbase + S * PAGE + slot * 8)
            # the arena as int32: every byte offset here is a multiple of 16 (table.ring_eligible)
            src = A_I32 + ((c_off + (rb * PR).to(tl.int64) * c_rs + cb * (PC * 2)) >> 2)
            tl.inline_asm_elementwise(_EXPECT, "=r,r,r", [bar, rows * cols * 2], dtype=tl.int32,
                                      is_pure=False, pack=1)
            if (ck <= PC) & (c_rs == ck * 2):  # whole contiguous rows: one copy
                tl.inline_asm_elementwise(_COPY, "=r,r,l,r,r,r", [dst, src, rows * cols * 2, rows * 0 + 1, bar],
                                          dtype=tl.int32, is_pure=False, pack=1)
            else:  # one copy per row, rows min(K, PC) elements apart in the page
                rstride = tl.minimum(ck, PC) * 2
                for r in tl.static_range(PR):
                    tl.inline_asm_elementwise(_COPY, "=r,r,l,r,r,r",
                                              [dst + r * rstride, src + ((r * c_rs) >> 2), cols * 2,
                                               (r < rows).to(tl.int32), bar], dtype=tl.int32, is_pure=False, pack=1)
            pi += 1
            cb += 1
            if cb * PC >= ck:
                cb = cb * 0
                rb += 1
                if rb * PR >= cn:
                    rb = rb * 0
                    si += 1
                    c_off, c_rs, c_nk = n_off, n_rs, n_nk
                    n_off, n_rs, n_nk = stream_entry(STREAMS, si + 1, se)
        st = (pc, pi, si, rb, cb, c_off, c_rs, c_nk, n_off, n_rs, n_nk)
    return st


@device
def _page_arrived(rbase, p, timeout, S: tl.constexpr, PAGE: tl.constexpr):
    """1 once page ``p`` (slot p % S, phase parity (p // S) & 1) has landed, 0 if it has not
    within ``timeout`` ns. Per thread (no CTA-wide decision; see _cta_any)."""
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
    return done


_BAR_OR = tl.constexpr(
    "{ .reg .pred %ro_i, %ro_o; setp.ne.s32 %ro_i, $1, 0; bar.red.or.pred %ro_o, 0, %ro_i; selp.s32 $0, 1, 0, %ro_o; }")


@device
def _cta_any(p):
    """1 if the int32 ``p`` is non-zero in ANY thread of the CTA (uniform), as one CTA
    barrier (``bar.red.or.pred``, PTX ISA "bar.red"): it is also the barrier after which a
    page's slot may be refilled. Interpreter: ``p != 0``."""
    if INTERPRET:
        r = (p != 0).to(tl.int32)
    else:
        r = tl.inline_asm_elementwise(_BAR_OR, "=r,r", [p], dtype=tl.int32, is_pure=False, pack=1)
    return r


@device
def ring_drain(rbase, st, timeout, S: tl.constexpr, PAGE: tl.constexpr):
    """Wait for every issued page not consumed: a CTA must not exit with copies into its
    shared memory in flight (after an error stopped its queue). A no-op under the
    interpreter."""
    if not INTERPRET:
        pc = st[0]
        pi = st[1]
        while pc < pi:
            _page_arrived(rbase, pc, timeout, S, PAGE)
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
def _x_slice(xs, c0, K, vv):
    """The staged f(x) for lane j of a page whose first column is ``c0``: eight [PC // 8]
    fp32 vectors, x_m[j] = xs[c0 + 8j + m] (0 at and past column K)."""
    xc = xs + c0 + 8 * vv
    xm = (c0 + 8 * vv) < K
    return (tl.load(xc, mask=xm, other=0), tl.load(xc + 1, mask=xm, other=0),
            tl.load(xc + 2, mask=xm, other=0), tl.load(xc + 3, mask=xm, other=0),
            tl.load(xc + 4, mask=xm, other=0), tl.load(xc + 5, mask=xm, other=0),
            tl.load(xc + 6, mask=xm, other=0), tl.load(xc + 7, mask=xm, other=0))


@device
def _page_fma(acc, rbase, slot, wp, w_rs, r0, c0, x0, x1, x2, x3, x4, x5, x6, x7, N, K,
              S: tl.constexpr, PR: tl.constexpr, PC: tl.constexpr):
    """``acc`` ([PR, PC // 8] fp32) plus one page's products: lane (r, j) adds
    sum_{m<8} W[r0 + r, c0 + 8j + m] * x_m[j] (x_slice's x_m, 0 past column K). On the GPU W
    comes from the page in shared memory (16-byte ``ld.shared.v4``, 8 bf16 each), one fused
    multiply-add per weight into ``acc``; a lane outside the page reads the page's first
    vector instead, which adds nothing to a stored row (its x is 0 past column K, and rows
    past N are never stored). Under the interpreter W comes from global memory (``wp``, row
    stride ``w_rs``), masked to 0 outside the tile."""
    VC: tl.constexpr = PC // 8
    rr = tl.arange(0, PR)
    vv = tl.arange(0, VC)
    cols = c0 + 8 * vv
    m = ((r0 + rr) < N)[:, None] & (cols < K)[None, :]
    if INTERPRET:
        wb = wp + (r0 + rr).to(tl.int64)[:, None] * w_rs + cols[None, :]
        d = tl.load(wb, mask=m, other=0).to(tl.float32) * x0[None, :]
        d += tl.load(wb + 1, mask=m, other=0).to(tl.float32) * x1[None, :]
        d += tl.load(wb + 2, mask=m, other=0).to(tl.float32) * x2[None, :]
        d += tl.load(wb + 3, mask=m, other=0).to(tl.float32) * x3[None, :]
        d += tl.load(wb + 4, mask=m, other=0).to(tl.float32) * x4[None, :]
        d += tl.load(wb + 5, mask=m, other=0).to(tl.float32) * x5[None, :]
        d += tl.load(wb + 6, mask=m, other=0).to(tl.float32) * x6[None, :]
        d += tl.load(wb + 7, mask=m, other=0).to(tl.float32) * x7[None, :]
        acc += d
    else:
        PAGE: tl.constexpr = PR * PC * 2
        page = smem_addr(rbase + slot * PAGE)
        rstride = tl.minimum(K, PC)
        addr = page + (rr[:, None] * rstride + 8 * vv[None, :]) * 2
        addr = tl.where(m, addr, page)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_LDS4, "=r,=r,=r,=r,r", [addr],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                   is_pure=False, pack=1)
        acc += _bf16_lo(w0) * x0[None, :]
        acc += _bf16_hi(w0) * x1[None, :]
        acc += _bf16_lo(w1) * x2[None, :]
        acc += _bf16_hi(w1) * x3[None, :]
        acc += _bf16_lo(w2) * x4[None, :]
        acc += _bf16_hi(w2) * x5[None, :]
        acc += _bf16_lo(w3) * x6[None, :]
        acc += _bf16_hi(w3) * x7[None, :]
    return acc


@device
def gemv_ring(xs, wp, w_rs, b, b_n1, b_n2, b_s0, b_s1, b_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, N, K,
              HAS_BIAS: tl.constexpr, m1, m2, m3, MIRRORS: tl.constexpr,
              A_I32, STREAMS, se, rbase, st, timeout, S: tl.constexpr, PR: tl.constexpr, PC: tl.constexpr,
              PROF=None, PROFILE: tl.constexpr = False):
    """y[N] = W[N, K] @ xs[K] (+ b), W bf16 streamed through the ring, xs the staged f(x)
    (fp32), fp32 accumulation. Pages are consumed in ``page_order``; xs's slice for a page is
    loaded once per tile when K <= PC (every page shares it), else before each page's wait;
    after each page one CTA barrier (which also decides, for
    every thread alike, whether a page timed out) frees its slot and the ring is topped up
    (ring_issue). The epilogue is ops/gemv.py gemv_epilogue's: ``b`` (HAS_BIAS) added, y stored rounded to
    its dtype, and at ``y + m1`` .. ``m3`` (MIRRORS, peer copies of y).
    ``PROFILE``: store at ``PROF + 7`` / ``+ 8`` / ``+ 9`` the ns this task spent waiting for
    pages, the ns spent issuing copies, and its page count (vm.PROF_W).
    Returns (status: 0, or 1 when a page never arrived; the ring state)."""
    PAGE: tl.constexpr = PR * PC * 2
    VC: tl.constexpr = PC // 8
    vv = tl.arange(0, VC)
    if not INTERPRET:  # xs into L1 (no acquire poll runs inside a GEMV to invalidate it)
        ln = tl.arange(0, 256)
        tl.inline_asm_elementwise(_PREFETCH_L1, "=r,l,r", [xs + ln * 32, (ln * 32 < K).to(tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    # one page's slice of x serves every page of the tile when K <= PC (one column page a
    # row block): loaded once, before the first page's wait
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_slice(xs, K * 0, K, vv)
    bad = tl.full([], 0, dtype=tl.int32)
    r0 = N * 0
    t_wait = tl.full([], 0, dtype=tl.int64)
    t_issue = t_wait
    npages = bad
    while (r0 < N) & (bad == 0):
        rows = r0 + tl.arange(0, PR)
        rm = rows < N
        if HAS_BIAS:  # loaded before the row block's pages: its latency overlaps them
            bv = tl.load(b + flat_off(rows, b_n1, b_n2, b_s0, b_s1, b_s2), mask=rm, other=0).to(tl.float32)
        acc = tl.zeros([PR, VC], dtype=tl.float32)
        c0 = K * 0
        while (c0 < K) & (bad == 0):
            if K > PC:  # several column pages a row block: this page's slice of x
                x0, x1, x2, x3, x4, x5, x6, x7 = _x_slice(xs, c0, K, vv)
            pc = st[0]
            if INTERPRET:
                arrived = tl.full([], 1, dtype=tl.int32)
            else:
                if PROFILE:
                    t0 = global_timer()
                arrived = _page_arrived(rbase, pc, timeout, S, PAGE)
                if PROFILE:
                    t_wait += global_timer() - t0
            acc = _page_fma(acc, rbase, pc % S, wp, w_rs, r0, c0, x0, x1, x2, x3, x4, x5, x6, x7, N, K, S, PR, PC)
            bad = _cta_any(1 - arrived)  # the barrier: every thread has read the page
            if bad == 0:
                st = (pc + 1, st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9], st[10])
                if PROFILE:
                    t1 = global_timer()
                st = ring_issue(A_I32, STREAMS, se, rbase, st, S, PR, PC)
                if PROFILE:
                    t_issue += global_timer() - t1
                    npages += 1
            c0 += PC
        if bad == 0:
            out = tl.sum(acc, axis=1)
            if HAS_BIAS:
                out += bv
            store_mirrored(y + flat_off(rows, y_n1, y_n2, y_s0, y_s1, y_s2), out, rm, m1, m2, m3, MIRRORS)
        r0 += PR
    if PROFILE:
        tl.store(PROF + 7, t_wait)
        tl.store(PROF + 8, t_issue)
        tl.store(PROF + 9, npages.to(tl.int64))
    return bad, st
