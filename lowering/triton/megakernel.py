"""The persistent megakernel: queue loop, counter waits, opcode dispatch, signals, watchdog.

One launch runs one decode step (epoch) of one rank. Grid = number of workers; program
(CTA) ``w`` is worker ``w`` and runs its queue, rows ``qstart[w] .. qstart[w+1]-1`` of the
task table (table.py), in order:

1. **Waits.** For each wait ``(counter, N, offset, t)``: spin until
   ``counter - need >= 0`` in wrapping int32, ``need = (epoch + offset) * N + t``. On the GPU
   every thread polls with ``ld.acquire.gpu.global.b32`` (``.sys`` for multi-rank programs;
   inline PTX): a plain load with
   acquire semantics, no read-modify-write, so pollers do not serialise on the line and each
   thread's later loads are ordered after its own acquire. The outcome (satisfied, timed
   out, aborted) is reduced over the CTA (``cta_max``) so all threads branch alike. Under
   the interpreter the poll is a volatile load (programs run one after another there).
   GEMV rows run their waits inside the op (``t_gemv``): the operands are decoded first, and
   with ``W_PRELOAD`` the first weight columns loaded, while the producers still work.
2. **Op.** A flat if/elif chain on the row's runtime opcode calls the row decoder of that
   *variant* (op + operand dtypes + layout flags, all compile-time), which reads the
   operand descriptors and params from the row and calls the op's device function in
   ops.py. Position / token operands are range-checked first; a bad one is reported, never
   used as an address.
3. **Barrier + signals.** ``tl.debug_barrier()`` (bar.sync: every thread's loads and stores
   of the task are done and visible CTA-wide; also orders this task's writes before the
   next task's reads on the same worker), then each signal is one
   ``atomic_add(counter, amount, sem="release")``, scope ``gpu`` for the own rank's counters
   and ``sys`` for another rank's. A scalar atomic runs on one thread; the
   barrier before it makes the release cover the whole CTA's writes (PTX cumulativity).
   Tasks with a system-scope signal first run ``fence.acq_rel.sys`` in every thread (with
   ``LEAN_RELEASE``: on thread 0 after the barrier, then relaxed peer reductions; finish_task).

Watchdog: on the GPU every wait reads ``%globaltimer`` while it spins and gives up after
``timeout`` ns; under the interpreter it gives up after ``timeout`` polls (with one
worker in topological order a wait that fails once never succeeds). A worker that gives up
writes an error record (kind, task row, wait index, value seen, value needed, epoch) into
its row of the ``err`` array, tags the shared abort word with ``epoch + 1`` so the other
workers stop waiting at once, and leaves its queue. The host reads the records after the
launch and raises an error naming the stuck tasks (runtime.py). Every worker also stores
how many tasks it completed, which the host checks against its queue length.

Error record (int64 x ERR_W per worker): [kind, row, a, b, c, epoch, tasks done, 0];
kinds: 1 wait timed out (a = wait index, b = value seen, c = value needed), 2 position out
of range (a = pos, b = cache length), 3 token out of range (a = token, b = vocab rows),
4 aborted because another worker failed (a, b, c as for 1). The abort word follows the W
records.

The kernel source is *generated* per program (``generate_source``): the dispatch lists
only the variants the program uses, each with its dtypes and flags as constants. The
generated module imports the device functions below; ``load_kernel`` writes it to a cache
file (Triton's JIT needs a source file) and imports it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl

from lowering.triton import ops as K
from lowering.triton import ring as RG
from lowering.triton import table as T
from lowering.triton.ops import INTERPRET, device, global_timer

# Table layout as compile-time constants for the device code.
_F_OP = tl.constexpr(T.F_OP)
_F_NWAIT = tl.constexpr(T.F_NWAIT)
_F_WAIT0 = tl.constexpr(T.F_WAIT0)
_F_NSIG = tl.constexpr(T.F_NSIG)
_F_SIG0 = tl.constexpr(T.F_SIG0)
_F_P0 = tl.constexpr(T.F_P0)
_F_OPND = tl.constexpr(T.F_OPND)
_F_FLAGS = tl.constexpr(T.F_FLAGS)
_F_W0C = tl.constexpr(T.F_W0C)
_F_W0N = tl.constexpr(T.F_W0N)
_F_W0B = tl.constexpr(T.F_W0B)
_F_S0C = tl.constexpr(T.F_S0C)
_F_S0A = tl.constexpr(T.F_S0A)
_F_S0S = tl.constexpr(T.F_S0S)
_OPND_W = tl.constexpr(T.OPND_W)
_ROW = tl.constexpr(T.ROW)
# row_prefetch: one thread per 128-byte line the row can touch (plus one: a row need not
# start on a line), at offsets 0, step, ..., bytes - 1 with step <= 128
_RP_THREADS = -(-T.ROW * 8 // 128) + 1
_RP_STEP = (T.ROW * 8 - 1) // (_RP_THREADS - 1)
assert _RP_STEP <= 128
_RP_ASM = tl.constexpr(
    "{ .reg .pred %rp_p; .reg .u32 %rp_t; .reg .u64 %rp_o; mov.u32 %rp_t, %tid.x; "
    f"setp.lt.u32 %rp_p, %rp_t, {_RP_THREADS}; min.u32 %rp_t, %rp_t, {_RP_THREADS - 1}; "
    f"mul.wide.u32 %rp_o, %rp_t, {_RP_STEP}; "
    "add.u64 %rp_o, %rp_o, $1; @%rp_p prefetch.global.L1 [%rp_o]; mov.u32 $0, 0; }")
_F_PFO = tl.constexpr(T.F_PFO)
_F_PFN = tl.constexpr(T.F_PFN)
_F_APFO = tl.constexpr(T.F_APFO)
_F_APFN = tl.constexpr(T.F_APFN)
_WAIT_W = tl.constexpr(T.WAIT_W)
_SIG_W = tl.constexpr(T.SIG_W)
_SCOPE_GPU = tl.constexpr(T.SCOPE_GPU)

ERR_W = 8
_ERR_W = tl.constexpr(ERR_W)
KIND_OK, KIND_TIMEOUT, KIND_POS, KIND_TOKEN, KIND_ABORTED = 0, 1, 2, 3, 4
_KIND_TIMEOUT = tl.constexpr(KIND_TIMEOUT)
_KIND_POS = tl.constexpr(KIND_POS)
_KIND_TOKEN = tl.constexpr(KIND_TOKEN)
_KIND_ABORTED = tl.constexpr(KIND_ABORTED)


# ---------------------------------------------------------------- sync primitives
@device
def poll_load(p, SYS: tl.constexpr, RELAXED: tl.constexpr = False):
    """int32 at ``p``, one poll of a counter, executed by every thread. Scope: GPU
    (single-rank programs) or system when ``SYS`` (multi-rank programs: the releasing signal
    may come from a peer GPU, and an acquire synchronises with a release only at a scope that
    contains both threads; PTX ISA, memory consistency model). Order: acquire
    (``ld.acquire.gpu`` / ``.sys``), or with ``RELAXED`` a relaxed (strong, unordered) load
    (``ld.relaxed``), which does not invalidate the SM's L1 as the acquire does (its
    CCTL.IVALL held 10% of the Llama-3.2-1B kernel's stall samples while workers spin,
    Nsight Compute, H200); a relaxed poll that saw the value becomes an acquire with
    ``acquire_fence``. Interpreter: a volatile load."""
    if INTERPRET:
        v = tl.load(p, volatile=True)
    elif RELAXED:
        if SYS:
            v = tl.inline_asm_elementwise("ld.relaxed.sys.global.b32 $0, [$1];", "=r,l", [p],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                          dtype=tl.int32, is_pure=False, pack=1)
    elif SYS:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [p],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                      dtype=tl.int32, is_pure=False, pack=1)
    return v


@device
def acquire_fence(SYS: tl.constexpr):
    """``fence.acq_rel.gpu`` (``.sys`` when SYS) in every thread. After a relaxed read that
    observed a release, it completes the PTX memory model's acquire pattern (PTX ISA, memory
    consistency model: "a strong read followed by a fence"), so the releasing task's writes
    are visible to this thread's later loads. A no-op under the interpreter."""
    if not INTERPRET:
        if SYS:
            tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)


@device
def l2_prefetch(A_I32, row, AHEAD: tl.constexpr = False, CAP: tl.constexpr = 0):
    """Start an L2 prefetch of the weight tile of the task at ``row`` (table fields F_PFO /
    F_PFN), or with ``AHEAD`` of the later task whose range table.prefetch_ahead copied into
    this row (F_APFO / F_APFN: loaded in the same round trip as the row's header instead of
    one more dependent read of another row); nothing when the length is 0. One
    ``cp.async.bulk.prefetch.L2.global`` (sm_90, PTX ISA "cp.async.bulk.prefetch") issued by
    thread 0. It has no effect on memory contents, so it is safe before the task's waits
    hold: weights never change during a step. Issued ahead of time it overlaps DRAM
    streaming with waits and other tasks; the GEMV then reads its tile from L2. ``CAP``
    (bytes, a multiple of 16; 0 = none): prefetch at most the tile's first CAP bytes (a
    large tile's rest comes from its own rolling prefetch, ops.gemv_ex ``ROLL``, instead of
    flooding L2 a whole task ahead). A no-op under the interpreter."""
    if not INTERPRET:
        if AHEAD:
            n = tl.load(row + _F_APFN).to(tl.int32)
            o = tl.load(row + _F_APFO)
        else:
            n = tl.load(row + _F_PFN).to(tl.int32)
            o = tl.load(row + _F_PFO)
        if CAP > 0:
            n = tl.minimum(n, CAP)
        K.l2_prefetch_bytes(A_I32 + o, n)


@device
def row_prefetch(row):
    """Start an L1 prefetch of the task-table row at ``row`` (T.ROW int64 = 704 bytes):
    ``_RP_THREADS`` threads each issue one ``prefetch.global.L1`` (PTX ISA "prefetch") at
    byte offsets 0, ``_RP_STEP``, ..., 703 (steps of at most 128 bytes), so every 128-byte
    line the row touches is requested. Issued at the start
    of the previous task, it turns the next task's header and operand loads (a dependent
    chain otherwise served by L2 or, once the step's weight stream has evicted the table
    from L2, by DRAM) into L1 hits. No effect on memory contents; a no-op under the
    interpreter. An acquire (a wait) invalidates L1, so it helps tasks that do not wait."""
    if not INTERPRET:
        tl.inline_asm_elementwise(_RP_ASM, "=r,l", [row], dtype=tl.int32, is_pure=False, pack=1)


@device
def cta_max(x):
    """The maximum over all threads of the CTA of a per-thread int32 scalar.

    Triton treats scalars as uniform, but a value from a per-thread poll is not: threads
    leave a spin loop at different polls, and one may time out or see the abort word while
    another saw the counter satisfied. Splatting the scalar into a [1024] tensor (every
    thread owns elements for up to 32 warps) and reducing it is a real cross-thread
    reduction (redux.sync + shared memory in the PTX), so every thread takes the same branch
    afterwards and the bar.sync inside later tasks is never divergent."""
    return tl.max(tl.full([1024], 0, dtype=tl.int32) + x, axis=0)


@device
def cta_all(p):
    """1 if the int32 ``p`` is non-zero in EVERY thread of the CTA, else 0 (uniform).

    ``bar.red.and.pred``: one barrier instruction that also reduces a predicate over the
    CTA (PTX ISA, "bar.red"), far cheaper than ``cta_max``'s shuffle + shared-memory
    reduction. Every thread must reach it, like any bar.sync (callers use it only at
    CTA-uniform points). Interpreter: ``p != 0`` (one program, no threads)."""
    if INTERPRET:
        r = (p != 0).to(tl.int32)
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred %pi, %po; setp.ne.s32 %pi, $1, 0; bar.red.and.pred %po, 0, %pi; "
            "selp.s32 $0, 1, 0, %po; }", "=r,r", [p], dtype=tl.int32, is_pure=False, pack=1)
    return r


@device
def wait_counter(ctr, need, abort_ptr, abort_tag, timeout, SYS: tl.constexpr, RELAXED: tl.constexpr = False):
    """Spin until ``*ctr - need >= 0`` (wrapping int32). Returns (value seen, kind):
    kind 0 = satisfied, 1 = timed out, 4 = another worker aborted this epoch.
    ``timeout``: ns on the GPU, number of polls under the interpreter.

    Each poll is an acquire load, or with ``RELAXED`` a relaxed load, and one
    ``acquire_fence`` once the wait is over (the same synchronisation, without an L1
    invalidation per poll).

    Fast path (GPU): the first poll of every thread is voted over the CTA
    (``cta_all``); when it already satisfies the wait in all threads -- the common case
    once a worker trails its producers -- the timer, the abort word and ``cta_max`` are
    skipped. Otherwise the watched spin loop below runs as before."""
    v = poll_load(ctr, SYS, RELAXED)
    if INTERPRET:
        it = 0
        while ((v - need) < 0) & (it < timeout):
            v = poll_load(ctr, SYS, RELAXED)
            it += 1
        kind = tl.where((v - need) < 0, _KIND_TIMEOUT, 0)
    else:
        kind = tl.full([], 0, dtype=tl.int32)
        if cta_all(((v - need) >= 0).to(tl.int32)) == 0:
            t0 = global_timer()
            now = t0
            ab = abort_tag - 1
            while ((v - need) < 0) & ((now - t0) < timeout) & (ab != abort_tag):
                v = poll_load(ctr, SYS, RELAXED)
                now = global_timer()
                ab = tl.load(abort_ptr, volatile=True)
            kind = tl.where((v - need) < 0, tl.where(ab == abort_tag, _KIND_ABORTED, _KIND_TIMEOUT), 0)
            kind = cta_max(kind)  # one decision for the whole CTA (see cta_max)
        if RELAXED:
            acquire_fence(SYS)
    return v, kind


@device
def signal_counter(ctr, amount, scope, LEAN: tl.constexpr = False):
    """``*ctr += amount`` with release semantics: GPU scope for the own rank, system scope
    for a peer's counter (a single thread performs a scalar atomic). ``LEAN``
    (``Blocks.lean_release``): a peer's counter gets a relaxed ``red`` on thread 0, made a
    release by the thread-0 system fence finish_task ran before it."""
    if scope == _SCOPE_GPU:
        tl.atomic_add(ctr, amount, sem="release", scope="gpu")
    elif LEAN:
        K.red_relaxed_sys_one(ctr, amount)
    else:
        tl.atomic_add(ctr, amount, sem="release", scope="sys")


# ---------------------------------------------------------------- row decoding
@device
def _ptr(A_BF16, A_F16, A_F32, A_I32, DT: tl.constexpr):
    """The arena viewed as DT."""
    if DT == tl.bfloat16:
        p = A_BF16
    elif DT == tl.float16:
        p = A_F16
    elif DT == tl.float32:
        p = A_F32
    else:
        p = A_I32
    return p


@device
def _opnd(row, KK: tl.constexpr, slot):
    """Operand KK of a row: (element offset at this slot, n0, n1, n2, s0, s1, s2)."""
    b = row + (_F_OPND + KK * _OPND_W)
    off = tl.load(b) + tl.load(b + 1) * slot
    return (off, tl.load(b + 2).to(tl.int32), tl.load(b + 3).to(tl.int32), tl.load(b + 4).to(tl.int32),
            tl.load(b + 5).to(tl.int32), tl.load(b + 6).to(tl.int32), tl.load(b + 7).to(tl.int32))


@device
def _opnd_off(row, KK: tl.constexpr, slot):
    """Operand KK's element offset at this slot (its first field pair only)."""
    b = row + (_F_OPND + KK * _OPND_W)
    return tl.load(b) + tl.load(b + 1) * slot


@device
def _param_i(row, J: tl.constexpr):
    return tl.load(row + (_F_P0 + J)).to(tl.int32)


@device
def _param_f(row, J: tl.constexpr):
    return tl.load(row + (_F_P0 + J)).to(tl.int32).to(tl.float32, bitcast=True)


@device
def _ok():
    return tl.full([], 0, dtype=tl.int32)


@device
def _fail(err, kind, a, b):
    tl.store(err + 2, a.to(tl.int64))
    tl.store(err + 3, b.to(tl.int64))
    return tl.full([], 0, dtype=tl.int32) + kind


@device
def t_embed(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DTAB: tl.constexpr, DTOK: tl.constexpr,
            DY: tl.constexpr, BLOCK: tl.constexpr):
    to, tn0, tn1, tn2, ts0, ts1, ts2 = _opnd(row, 0, slot)
    ko, kn0, kn1, kn2, ks0, ks1, ks2 = _opnd(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 2, slot)
    tok = tl.load(_ptr(A_BF16, A_F16, A_F32, A_I32, DTOK) + ko).to(tl.int32)
    if (tok < 0) | (tok >= tn1):
        st = _fail(err, _KIND_TOKEN, tok, tn1)
    else:
        K.embed(_ptr(A_BF16, A_F16, A_F32, A_I32, DTAB) + to, ts1, ts2, tok,
                _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, tn2, BLOCK)
        st = _ok()
    return st


@device
def t_rmsnorm(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DW: tl.constexpr,
              DY: tl.constexpr, BLOCK: tl.constexpr):
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = _opnd(row, 0, slot)
    wo, wn0, wn1, wn2, ws0, ws1, ws2 = _opnd(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 2, slot)
    K.rmsnorm(_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2,
              _ptr(A_BF16, A_F16, A_F32, A_I32, DW) + wo, wn1, wn2, ws0, ws1, ws2,
              _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
              xn0 * xn1 * xn2, _param_i(row, 0), _param_f(row, 1), BLOCK)
    return _ok()


@device
def t_gemv(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DA: tl.constexpr,
           DW: tl.constexpr, DB: tl.constexpr, DY: tl.constexpr, PRO: tl.constexpr, HAS_BIAS: tl.constexpr,
           X_CONTIG: tl.constexpr, W_CONTIG: tl.constexpr, W_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, STAGES: tl.constexpr = 1, PROF=None, PROFILE: tl.constexpr = False,
           X_ALIGN: tl.constexpr = 0, UNROLL: tl.constexpr = 1, XS=None, X_STAGE: tl.constexpr = False,
           X_CHUNK: tl.constexpr = 0, W_PRE: tl.constexpr = 0, ROLL: tl.constexpr = 0, KROLL: tl.constexpr = 0, fl=0,
           nw=0, w0=0, wc=0, wn=0, wb=0, WAITS=None, i=0, epoch=0, abort_ptr=None, timeout=0, SYS: tl.constexpr = False, RELAXED: tl.constexpr = False,
           MIRRORS: tl.constexpr = 0, W_TMA: tl.constexpr = False, RING: tl.constexpr = False,
           STREAMS=None, se=0, rbase=0, rst=None, RING_S: tl.constexpr = 1, RING_PR: tl.constexpr = 4,
           RING_PC: tl.constexpr = 2048):
    """gemv, norm_gemv, gemv_res, swiglu_gemv, reduce_norm_gemv (ops.gemv_ex; ``PRO`` the prologue, ``STAGES``
    its weight-streaming pipeline depth, ``X_STAGE`` its f(x) staged once in the worker's
    scratch ``XS``, skipped when the row's ``FLAG_X_READY`` says an earlier task of this
    worker left the same f(x) there). Operands: x, [a (norm weight / up) when PRO != plain], W, [b (bias /
    residual)], y; PRO_RNORM: partials [KP, K], residual, a (norm weight), W, [bias], y.

    Runs the row's waits itself (``nw`` .. ``RELAXED``: run_waits's arguments, ``fl`` the row
    flags) after decoding the operands, so the decode overlaps the wait. ``W_PRE`` > 0: the
    first ``W_PRE`` columns of the first row block of W are loaded before the waits when the
    row's ``FLAG_W_CONST`` says no task writes W (weights do not change during a step, so
    the load needs no happens-before edge; the table proves it per program), and after them
    otherwise: the wait and the x pass then overlap that part of the weight stream.
    ``MIRRORS`` (0..3, table.gemv_mirrors): operands after y are its mirror outputs (same
    layout, on peers); each row block of y is stored there too, at y's offsets plus the
    mirror's element delta (the peer stores of a fused one-shot all-reduce).
    ``W_TMA``: W's blocks come through a tensor descriptor (ops.gemv_ex; the variant is
    contiguous and 16-byte aligned, Blocks.gemv_tma).
    ``RING`` (a ``ring`` variant, Blocks.ring): W's pages come through the worker's weight
    ring (ring.gemv_ring) after f(x) is staged as fp32 into the scratch row; ``STREAMS``,
    ``se``, ``rbase`` and ``rst`` (the ring's state, ring.ring_state) as ring.ring_issue's,
    ``RING_S`` / ``RING_PR`` / ``RING_PC`` its pages and page shape. Returns (1 if the waits
    held else 0, op status, the ring state, unchanged without ``RING``); a page that never
    arrived is reported as a timeout of wait -1."""
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = _opnd(row, 0, slot)
    ro = xo * 0
    if PRO == K.PRO_PLAIN:
        ao, an1, an2, as0, as1, as2 = xo, xn1, xn2, xs0, xs1, xs2
        WI: tl.constexpr = 1
    elif PRO == K.PRO_RNORM:  # x = the partials [KP = xn1, K] at row stride xs1; then r, a
        ro = _opnd_off(row, 1, slot)
        ao, an0, an1, an2, as0, as1, as2 = _opnd(row, 2, slot)
        WI: tl.constexpr = 3
    else:
        ao, an0, an1, an2, as0, as1, as2 = _opnd(row, 1, slot)
        WI: tl.constexpr = 2
    if X_ALIGN > 1:
        xo = K.aligned(xo, X_ALIGN)
        ao = K.aligned(ao, X_ALIGN)
        ro = K.aligned(ro, X_ALIGN)
    if PRO == K.PRO_PLAIN:
        ap = _ptr(A_BF16, A_F16, A_F32, A_I32, DX) + ao
    else:
        ap = _ptr(A_BF16, A_F16, A_F32, A_I32, DA) + ao
    wo, wn0, wn1, wn2, ws0, ws1, ws2 = _opnd(row, WI, slot)
    if W_ALIGN > 1:
        wo = K.aligned(wo, W_ALIGN)
    if HAS_BIAS:
        bo, bn0, bn1, bn2, bs0, bs1, bs2 = _opnd(row, WI + 1, slot)
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, WI + 2, slot)
        bp = _ptr(A_BF16, A_F16, A_F32, A_I32, DB) + bo
    else:
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, WI + 1, slot)
        bp = _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo
        bn1, bn2, bs0, bs1, bs2 = yn1, yn2, ys0, ys1, ys2
    YI: tl.constexpr = WI + 2 if HAS_BIAS else WI + 1
    m1 = yo * 0
    m2 = m1
    m3 = m1
    if MIRRORS > 0:
        m1 = _opnd_off(row, YI + 1, slot) - yo
    if MIRRORS > 1:
        m2 = _opnd_off(row, YI + 2, slot) - yo
    if MIRRORS > 2:
        m3 = _opnd_off(row, YI + 3, slot) - yo
    if PRO == K.PRO_NORM or PRO == K.PRO_RNORM:
        eps = _param_f(row, 0)
    else:
        eps = 0.0
    if RING or (X_STAGE and PRO != K.PRO_PLAIN) or PRO == K.PRO_RNORM:  # table.FLAG_X_READY (staged_x_reuse)
        x_ready = (fl >> 1) & 1
    else:
        x_ready = 0
    wp = _ptr(A_BF16, A_F16, A_F32, A_I32, DW) + wo
    if W_PRE > 0 and not RING:  # table.FLAG_W_CONST: W is written by no task, so it may be read before the waits
        w_const = (fl >> 2) & 1
        wpre = K.gemv_wpre(wp, ws1, ws2, wn1, wn2, w_const, W_CONTIG, W_ALIGN, BLOCK_N, W_PRE)
    else:
        w_const = 1
        wpre = 0
    ok = run_waits(nw, w0, wc, wn, wb, WAITS, A_I32, err, i, epoch, abort_ptr, timeout, SYS, RELAXED)
    if ok != 0:
        if PROFILE:
            tl.store(PROF + 1, global_timer())
            tl.store(PROF + 3, global_timer())
        if W_PRE > 0 and not RING:
            if w_const == 0:  # W may be written in this step: read it only now
                wpre = K.gemv_wpre(wp, ws1, ws2, wn1, wn2, w_const + 1, W_CONTIG, W_ALIGN, BLOCK_N, W_PRE)
    if RING:
        if ok != 0:
            XB: tl.constexpr = BLOCK_N * BLOCK_K if BLOCK_N * BLOCK_K > X_CHUNK else X_CHUNK
            xsr = tl.multiple_of(XS, 16)  # fp32 f(x), 16-byte aligned (runtime)
            if x_ready == 0:
                K.gemv_stage(xsr, _ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2, ap, an1, an2,
                             as0, as1, as2, eps, wn2, PRO, X_CONTIG, X_ALIGN, XB,
                             _ptr(A_BF16, A_F16, A_F32, A_I32, DX) + ro, xn1, xs1)
            if PROFILE:
                tl.store(PROF + 4, global_timer())
            bad, rst = RG.gemv_ring(
                xsr, wp, ws1, bp, bn1, bn2, bs0, bs1, bs2, _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo,
                yn1, yn2, ys0, ys1, ys2, wn1, wn2, HAS_BIAS, m1, m2, m3, MIRRORS, A_I32, STREAMS, se, rbase,
                rst, timeout, RING_S, RING_PR, RING_PC, PROF, PROFILE)
            if PROFILE:
                tl.store(PROF + 5, global_timer())
            if bad != 0:  # a weight page never arrived: reported as a timeout of wait -1
                tl.store(err + 1, i.to(tl.int64))
                tl.store(err + 2, -1)
                tl.store(err + 3, rst[0].to(tl.int64))
                tl.store(err + 4, rst[1].to(tl.int64))
                tl.store(err + 5, epoch)
                tl.store(err + 0, epoch * 0 + _KIND_TIMEOUT)
                tl.store(abort_ptr, epoch + 1)
                ok = ok * 0
    elif ok != 0:
        K.gemv_ex(_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2, ap, an1, an2, as0, as1, as2,
                  eps, wp, ws1, ws2, bp, bn1, bn2, bs0, bs1, bs2,
                  _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, wn1, wn2,
                  PRO, HAS_BIAS, X_CONTIG, W_CONTIG, W_ALIGN, BLOCK_N, BLOCK_K, STAGES, PROF, PROFILE, X_ALIGN,
                  UNROLL, XS, X_STAGE, x_ready, X_CHUNK, wpre, W_PRE, ROLL, KROLL, m1, m2, m3, MIRRORS,
                  _ptr(A_BF16, A_F16, A_F32, A_I32, DX) + ro, xn1, xs1, W_TMA)
    return ok, _ok(), rst


@device
def t_rope(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DF: tl.constexpr,
           DP: tl.constexpr, DY: tl.constexpr, BLOCK: tl.constexpr):
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = _opnd(row, 0, slot)
    fo, fn0, fn1, fn2, fs0, fs1, fs2 = _opnd(row, 1, slot)
    po, pn0, pn1, pn2, ps0, ps1, ps2 = _opnd(row, 2, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 3, slot)
    pos = tl.load(_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po).to(tl.int32)
    if pos < 0:
        st = _fail(err, _KIND_POS, pos, pos * 0)
    else:
        K.rope(_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2,
               _ptr(A_BF16, A_F16, A_F32, A_I32, DF) + fo, fn1, fn2, fs0, fs1, fs2, pos,
               _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
               xn0 * xn1 * xn2, _param_i(row, 0), BLOCK)
        st = _ok()
    return st


@device
def t_kv_append(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DK: tl.constexpr, DV: tl.constexpr,
                DF: tl.constexpr, DP: tl.constexpr, DKC: tl.constexpr, DVC: tl.constexpr,
                ROPE: tl.constexpr, BLOCK: tl.constexpr):
    """kv_append (operands k, v, pos, kc, vc) or, with ROPE, rope_append (k, v, inv_freq,
    pos, kc, vc)."""
    ko, kn0, kn1, kn2, ks0, ks1, ks2 = _opnd(row, 0, slot)
    vo, vn0, vn1, vn2, vs0, vs1, vs2 = _opnd(row, 1, slot)
    if ROPE:
        fo, fn0, fn1, fn2, fs0, fs1, fs2 = _opnd(row, 2, slot)
        PI: tl.constexpr = 3
    else:
        PI: tl.constexpr = 2
    po, pn0, pn1, pn2, ps0, ps1, ps2 = _opnd(row, PI, slot)
    co, cg, cs, cd, cgs, css, cds = _opnd(row, PI + 1, slot)
    uo, ug, us, ud, ugs, uss, uds = _opnd(row, PI + 2, slot)
    pos = tl.load(_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po).to(tl.int32)
    if (pos < 0) | (pos >= cs):
        st = _fail(err, _KIND_POS, pos, cs)
    else:
        if ROPE:
            K.rope_append(_ptr(A_BF16, A_F16, A_F32, A_I32, DK) + ko, kn1, kn2, ks0, ks1, ks2,
                          _ptr(A_BF16, A_F16, A_F32, A_I32, DV) + vo, vn1, vn2, vs0, vs1, vs2,
                          _ptr(A_BF16, A_F16, A_F32, A_I32, DF) + fo, fn1, fn2, fs0, fs1, fs2, pos,
                          _ptr(A_BF16, A_F16, A_F32, A_I32, DKC) + co, cgs, css, cds,
                          _ptr(A_BF16, A_F16, A_F32, A_I32, DVC) + uo, ugs, uss, uds, cg, cd, BLOCK)
        else:
            K.kv_append(_ptr(A_BF16, A_F16, A_F32, A_I32, DK) + ko, kn1, kn2, ks0, ks1, ks2,
                        _ptr(A_BF16, A_F16, A_F32, A_I32, DV) + vo, vn1, vn2, vs0, vs1, vs2, pos,
                        _ptr(A_BF16, A_F16, A_F32, A_I32, DKC) + co, cgs, css, cds,
                        _ptr(A_BF16, A_F16, A_F32, A_I32, DVC) + uo, ugs, uss, uds, cg, cd, BLOCK)
        st = _ok()
    return st


@device
def t_attention(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DQ: tl.constexpr, DKC: tl.constexpr,
                DVC: tl.constexpr, DP: tl.constexpr, DF: tl.constexpr, DO: tl.constexpr, ROPE: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, DOT: tl.constexpr = False,
                KV_ALIGN: tl.constexpr = 0, DK: tl.constexpr = None, DV: tl.constexpr = None,
                KV_NEW: tl.constexpr = False):
    """attention (q, kc, vc, pos, o) or, with ROPE, rope_attention (q, kc, vc, pos,
    inv_freq, o) or, with ROPE and KV_NEW, rope_attention_kv (q, k, v, kc, vc, pos, inv_freq,
    o; DK, DV: the dtypes of k and v). ``KV_ALIGN``: the table's ``kvaligned`` flag
    (ops.attention)."""
    qo, qn0, qn1, qn2, qs0, qs1, qs2 = _opnd(row, 0, slot)
    if KV_NEW:
        CI: tl.constexpr = 3  # the caches follow q, k, v
    else:
        CI: tl.constexpr = 1
    co, cg, cs, cd, cgs, css, cds = _opnd(row, CI, slot)
    uo, ug, us, ud, ugs, uss, uds = _opnd(row, CI + 1, slot)
    po, pn0, pn1, pn2, ps0, ps1, ps2 = _opnd(row, CI + 2, slot)
    if ROPE:
        fo, fn0, fn1, fn2, fs0, fs1, fs2 = _opnd(row, CI + 3, slot)
        oo, on0, on1, on2, os0, os1, os2 = _opnd(row, CI + 4, slot)
        fp = _ptr(A_BF16, A_F16, A_F32, A_I32, DF) + fo
    else:
        oo, on0, on1, on2, os0, os1, os2 = _opnd(row, CI + 3, slot)
        fo, fn1, fn2, fs0, fs1, fs2 = oo, on1, on2, os0, os1, os2
        fp = _ptr(A_BF16, A_F16, A_F32, A_I32, DO) + fo
    if KV_NEW:
        ko, kn0, kn1, kn2, ks0, ks1, ks2 = _opnd(row, 1, slot)
        vo, vn0, vn1, vn2, vs0, vs1, vs2 = _opnd(row, 2, slot)
        kp = _ptr(A_BF16, A_F16, A_F32, A_I32, DK) + ko
        vp = _ptr(A_BF16, A_F16, A_F32, A_I32, DV) + vo
    else:  # unused
        kn1, kn2, ks0, ks1, ks2 = qn1, qn2, qs0, qs1, qs2
        vn1, vn2, vs0, vs1, vs2 = qn1, qn2, qs0, qs1, qs2
        kp = _ptr(A_BF16, A_F16, A_F32, A_I32, DQ) + qo
        vp = kp
    if KV_ALIGN > 1:
        co = K.aligned(co, KV_ALIGN)
        uo = K.aligned(uo, KV_ALIGN)
    pos = tl.load(_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po).to(tl.int32)
    if (pos < 0) | (pos >= cs):
        st = _fail(err, _KIND_POS, pos, cs)
    else:
        hq = (qn0 * qn1 * qn2) // cd
        K.attention(_ptr(A_BF16, A_F16, A_F32, A_I32, DQ) + qo, qn1, qn2, qs0, qs1, qs2,
                    _ptr(A_BF16, A_F16, A_F32, A_I32, DKC) + co, cgs, css, cds,
                    _ptr(A_BF16, A_F16, A_F32, A_I32, DVC) + uo, ugs, uss, uds, pos,
                    _ptr(A_BF16, A_F16, A_F32, A_I32, DO) + oo, on1, on2, os0, os1, os2,
                    hq, cg, cd, _param_f(row, 1), fp, fn1, fn2, fs0, fs1, fs2, ROPE,
                    BLOCK_T, BLOCK_D, BLOCK_Q, DOT, KV_ALIGN,
                    kp, kn1, kn2, ks0, ks1, ks2, vp, vn1, vn2, vs0, vs1, vs2, KV_NEW)
        st = _ok()
    return st


@device
def t_silu_mul(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DG: tl.constexpr, DU: tl.constexpr,
               DY: tl.constexpr, BLOCK: tl.constexpr):
    go, gn0, gn1, gn2, gs0, gs1, gs2 = _opnd(row, 0, slot)
    uo, un0, un1, un2, us0, us1, us2 = _opnd(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 2, slot)
    K.silu_mul(_ptr(A_BF16, A_F16, A_F32, A_I32, DG) + go, gn1, gn2, gs0, gs1, gs2,
               _ptr(A_BF16, A_F16, A_F32, A_I32, DU) + uo, un1, un2, us0, us1, us2,
               _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
               yn0 * yn1 * yn2, BLOCK)
    return _ok()


@device
def t_add(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DA: tl.constexpr, DB: tl.constexpr,
          DY: tl.constexpr, BLOCK: tl.constexpr):
    ao, an0, an1, an2, as0, as1, as2 = _opnd(row, 0, slot)
    bo, bn0, bn1, bn2, bs0, bs1, bs2 = _opnd(row, 1, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 2, slot)
    K.add(_ptr(A_BF16, A_F16, A_F32, A_I32, DA) + ao, an1, an2, as0, as1, as2,
          _ptr(A_BF16, A_F16, A_F32, A_I32, DB) + bo, bn1, bn2, bs0, bs1, bs2,
          _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2,
          yn0 * yn1 * yn2, BLOCK)
    return _ok()


@device
def t_reduce(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DP: tl.constexpr, DR: tl.constexpr,
             DY: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr = 0):
    po, pn0, pn1, pn2, ps0, ps1, ps2 = _opnd(row, 0, slot)
    if HAS_RES:
        ro, rn0, rn1, rn2, rs0, rs1, rs2 = _opnd(row, 1, slot)
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 2, slot)
        if VEC > 0:
            ro = K.aligned(ro, VEC)
        rp = _ptr(A_BF16, A_F16, A_F32, A_I32, DR) + ro
    else:
        yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 1, slot)
        rp = _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo
        rn1, rn2, rs0, rs1, rs2 = yn1, yn2, ys0, ys1, ys2
    if VEC > 0:
        po = K.aligned(po, VEC)
        yo = K.aligned(yo, VEC)
    K.reduce(_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po, ps1, ps2, pn1, rp, rn1, rn2, rs0, rs1, rs2,
             _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, yn0 * yn1 * yn2,
             HAS_RES, BLOCK, VEC)
    return _ok()


@device
def t_argmax(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DY: tl.constexpr,
             BLOCK: tl.constexpr):
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = _opnd(row, 0, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 1, slot)
    K.argmax(_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2, xn0 * xn1 * xn2,
             _param_i(row, 0), _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, BLOCK)
    return _ok()


@device
def t_argmax_combine(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DP: tl.constexpr, DT: tl.constexpr,
                     BLOCK: tl.constexpr):
    po, pn0, pn1, pn2, ps0, ps1, ps2 = _opnd(row, 0, slot)
    to, tn0, tn1, tn2, ts0, ts1, ts2 = _opnd(row, 1, slot)
    K.argmax_combine(_ptr(A_BF16, A_F16, A_F32, A_I32, DP) + po, ps1, ps2, pn1,
                     _ptr(A_BF16, A_F16, A_F32, A_I32, DT) + to, BLOCK)
    return _ok()


@device
def t_copy(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DY: tl.constexpr,
           BLOCK: tl.constexpr, VEC: tl.constexpr = 0):
    """copy and put (a put's destination offset already includes the peer's arena delta)."""
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = _opnd(row, 0, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = _opnd(row, 1, slot)
    if VEC > 0:
        xo = K.aligned(xo, VEC)
        yo = K.aligned(yo, VEC)
    K.copy(_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2,
           _ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, yn0 * yn1 * yn2, BLOCK, VEC)
    return _ok()


@device
def t_fence():
    """quiet and fence: a system-scope fence in every thread (peer stores are plain stores,
    so ordering them is all nvshmem_quiet / nvshmem_fence mean here)."""
    K.system_fence()
    return _ok()


@device
def t_nop():
    return _ok()


@device
def worker_loop_prologue(ERR, EPOCH, QSTART, slots):
    """(worker id, first row, end row, err row pointer, epoch, slot, abort word pointer)."""
    w = tl.program_id(0)
    err = ERR + w * _ERR_W
    tl.store(err + tl.arange(0, _ERR_W), tl.zeros([_ERR_W], dtype=tl.int64))
    tl.debug_barrier()  # the zeroing (spread over threads) lands before any record field
    epoch = tl.load(EPOCH)
    slot = epoch % slots
    i = tl.load(QSTART + w)
    end = tl.load(QSTART + w + 1)
    abort_ptr = ERR + tl.num_programs(0) * _ERR_W
    return w, i, end, err, epoch, slot, abort_ptr


@device
def task_header(row):
    """The row fields every task needs, loaded together (independent loads, one round trip):
    (opcode, n waits, first wait index, first wait's counter / N / base, n signals, first
    signal index, first signal's counter / amount / scope, flags)."""
    op = tl.load(row + _F_OP)
    nw = tl.load(row + _F_NWAIT)
    w0 = tl.load(row + _F_WAIT0)
    wc = tl.load(row + _F_W0C)
    wn = tl.load(row + _F_W0N)
    wb = tl.load(row + _F_W0B)
    ns = tl.load(row + _F_NSIG)
    s0 = tl.load(row + _F_SIG0)
    sc = tl.load(row + _F_S0C)
    sa = tl.load(row + _F_S0A)
    ss = tl.load(row + _F_S0S)
    fl = tl.load(row + _F_FLAGS)
    return op, nw, w0, wc, wn, wb, ns, s0, sc, sa, ss, fl


@device
def run_waits(nw, w0, wc, wn, wb, WAITS, A_I32, err, i, epoch, abort_ptr, timeout, SYS: tl.constexpr,
              RELAXED: tl.constexpr = False):
    """Run every wait of a row; returns 1 if they all held, 0 after recording a failure.
    The first wait comes from the row header (wc, wn, wb: need = epoch * wn + wb), the
    others from ``WAITS``."""
    ok = tl.full([], 1, dtype=tl.int32)
    j = nw * 0
    ctr = wc
    need = (epoch * wn + wb).to(tl.int32)
    while (j < nw) & (ok != 0):
        if j > 0:
            wp = WAITS + (w0 + j) * _WAIT_W
            ctr = tl.load(wp)
            need = ((epoch + tl.load(wp + 2)) * tl.load(wp + 1) + tl.load(wp + 3)).to(tl.int32)
        v, kind = wait_counter(A_I32 + ctr, need, abort_ptr, epoch + 1, timeout, SYS, RELAXED)
        if kind != 0:
            tl.store(err + 1, i.to(tl.int64))
            tl.store(err + 2, (w0 + j).to(tl.int64))
            tl.store(err + 3, v.to(tl.int64))
            tl.store(err + 4, need.to(tl.int64))
            tl.store(err + 5, epoch)
            tl.store(err + 0, kind.to(tl.int64))
            if kind == _KIND_TIMEOUT:
                tl.store(abort_ptr, epoch + 1)
            ok = ok * 0
        j += 1
    return ok


@device
def finish_task(ns, s0, sc, sa, ss, fl, SIGS, A_I32, err, i, epoch, abort_ptr, st, LEAN: tl.constexpr = False):
    """After the op: barrier, then either record the op's failure or release the signals.
    Returns 1 to go on, 0 to stop. The first signal comes from the row header (sc, sa, ss),
    so on the common path the release atomic follows the barrier with no table load.
    A row with a system-scope signal (FLAG_SYS_SIGNAL) fences at system scope first: in every
    thread before the barrier, or with ``LEAN`` (``Blocks.lean_release``) once, on thread 0
    after it, whose peer signals are then relaxed reductions (signal_counter)."""
    if (fl & 1) != 0:
        if not LEAN:
            K.system_fence()
    tl.debug_barrier()
    if LEAN:
        if (fl & 1) != 0:
            K.system_fence_one()
    ok = tl.full([], 1, dtype=tl.int32)
    if st != 0:
        tl.store(err + 1, i.to(tl.int64))
        tl.store(err + 5, epoch)
        tl.store(err + 0, st.to(tl.int64))
        tl.store(abort_ptr, epoch + 1)
        ok = ok * 0
    else:
        if ns > 0:
            signal_counter(A_I32 + sc, sa.to(tl.int32), ss, LEAN)
        for k in range(1, ns):
            sp = SIGS + (s0 + k) * _SIG_W
            signal_counter(A_I32 + tl.load(sp), tl.load(sp + 1).to(tl.int32), tl.load(sp + 2), LEAN)
    return ok


# ---------------------------------------------------------------- code generation
TL_DTYPE = {"bf16": "tl.bfloat16", "f16": "tl.float16", "f32": "tl.float32", "i32": "tl.int32"}
#: Profiling stamps per task (PROFILE): 0 start, 1 waits done, 2 signals done, 3 GEMV
#: operands decoded, 4 GEMV prologue (RMSNorm pre-pass) done, 5 GEMV stores done, 6 op done
#: (before the barrier and signals); GEMV-only stamps stay 0 for other ops; on the weight ring
#: (ring.gemv_ring): 7 ns waiting for pages, 8 ns issuing copies, 9 pages consumed.
PROF_W = 10

_COMMON = "A_BF16, A_F16, A_F32, A_I32, row, slot, err"


def _vec(v: T.Variant) -> int:
    """Elements per 16-byte vector for a variant with the table's ``vec`` flag, else 0: the
    generic strided path."""
    return T.vec_elems(v.dtypes) if v.flag("vec") else 0


def _call(v: T.Variant) -> str:
    """The dispatch call for one variant (generated source)."""
    d = [TL_DTYPE[x] for x in v.dtypes]
    op = v.op
    if op == "embed":
        return f"t_embed({_COMMON}, {d[0]}, {d[1]}, {d[2]}, BLOCK)"
    if op == "rmsnorm":
        return f"t_rmsnorm({_COMMON}, {d[0]}, {d[1]}, {d[2]}, BLOCK)"
    if op in T.GEMV_OPS:
        xi, ai, wi = T.GEMV_OPS[op]
        pro = {"norm_gemv": "K.PRO_NORM", "swiglu_gemv": "K.PRO_SWIGLU",
               "reduce_norm_gemv": "K.PRO_RNORM"}.get(op, "K.PRO_PLAIN")
        bias = v.flag("bias")
        da = d[ai] if ai is not None else d[xi]
        db = d[wi + 1] if bias else d[-1]
        align = 16 // T.DTYPE_BYTES[v.dtypes[wi]] if v.flag("aligned") else 0
        xalign = 16 // T.DTYPE_BYTES[v.dtypes[xi]] if v.flag("xaligned") else 0
        tma = v.flag("aligned")  # contiguous W with a 16-byte aligned start and row stride
        return (f"t_gemv({_COMMON}, {d[xi]}, {da}, {d[wi]}, {db}, {d[-1]}, {pro}, {bias}, "
                f"{v.flag('xcontig')}, {v.flag('contig')}, {align}, GEMV_N, GEMV_K, GEMV_STAGES, "
                f"PROF + i.to(tl.int64) * PROF_W, PROFILE, {xalign}, GEMV_UNROLL, XSW, X_STAGE, X_CHUNK, "
                f"MIRRORS={T.gemv_mirrors(v)}, W_TMA={'GEMV_TMA' if tma else 'False'}, RING={v.flag('ring')})")
    if op == "rope":
        return f"t_rope({_COMMON}, {d[0]}, {d[1]}, {d[2]}, {d[3]}, ROPE_BLOCK)"
    if op == "kv_append":
        return f"t_kv_append({_COMMON}, {d[0]}, {d[1]}, tl.float32, {d[2]}, {d[3]}, {d[4]}, False, ROPE_BLOCK)"
    if op == "rope_append":
        return f"t_kv_append({_COMMON}, {d[0]}, {d[1]}, {d[2]}, {d[3]}, {d[4]}, {d[5]}, True, ROPE_BLOCK)"
    if op in ("attention", "rope_attention"):
        kva = 16 // T.DTYPE_BYTES[v.dtypes[1]] if v.flag("kvaligned") else 0
        rope = op == "rope_attention"
        return (f"t_attention({_COMMON}, {d[0]}, {d[1]}, {d[2]}, {d[3]}, {d[4]}, {d[5] if rope else d[4]}, "
                f"{rope}, ATT_T, ATT_D, ATT_Q, ATT_DOT, {kva})")
    if op == "rope_attention_kv":  # q, k, v, kc, vc, pos, inv_freq, o
        kva = 16 // T.DTYPE_BYTES[v.dtypes[3]] if v.flag("kvaligned") else 0
        return (f"t_attention({_COMMON}, {d[0]}, {d[3]}, {d[4]}, {d[5]}, {d[6]}, {d[7]}, "
                f"True, ATT_T, ATT_D, ATT_Q, ATT_DOT, {kva}, {d[1]}, {d[2]}, True)")
    if op in ("silu_mul", "add"):
        return f"t_{op}({_COMMON}, {d[0]}, {d[1]}, {d[2]}, BLOCK)"
    if op == "reduce":
        res = v.flag("residual")
        dr = d[1] if res else d[-1]
        return f"t_reduce({_COMMON}, {d[0]}, {dr}, {d[-1]}, {res}, BLOCK, {_vec(v)})"
    if op == "argmax":
        return f"t_argmax({_COMMON}, {d[0]}, {d[1]}, BLOCK)"
    if op == "argmax_combine":
        return f"t_argmax_combine({_COMMON}, {d[0]}, {d[1]}, PAIR_BLOCK)"
    if op in ("copy", "put"):
        return f"t_copy({_COMMON}, {d[0]}, {d[1]}, BLOCK, {_vec(v)})"
    if op in ("quiet", "fence"):
        return "t_fence()"
    if op == "nop":
        return "t_nop()"
    raise T.TableError(f"no Triton implementation for op {op!r}")


_TEMPLATE = '''\
# Generated by amk (lowering/triton/megakernel.py) -- do not edit.
# The persistent megakernel of program {name!r}, rank {rank}: {ntasks} tasks on {workers} worker(s).
# Dispatch variants (opcode: op(operand dtypes)[flags]):
{variant_lines}
import triton
import triton.language as tl

from lowering.triton import ops as K
from lowering.triton import ring as RG
from lowering.triton.megakernel import (
    finish_task, global_timer, l2_prefetch, row_prefetch, run_waits, task_header, worker_loop_prologue, t_add, t_argmax,
    t_argmax_combine, t_attention,
    t_copy, t_embed, t_fence, t_gemv, t_kv_append, t_nop, t_reduce, t_rmsnorm, t_rope, t_silu_mul,
)


@triton.jit
def amk_megakernel(A_BF16, A_F16, A_F32, A_I32, TASKS, WAITS, SIGS, QSTART, ERR, EPOCH, slots, timeout,
                   PROF, XS, xs_w, STREAMS, SSTART, rbase, BLOCK: tl.constexpr, GEMV_N: tl.constexpr, GEMV_K: tl.constexpr,
                   ROPE_BLOCK: tl.constexpr, ATT_T: tl.constexpr, ATT_D: tl.constexpr,
                   ATT_Q: tl.constexpr, PAIR_BLOCK: tl.constexpr, GEMV_STAGES: tl.constexpr = 1,
                   PREFETCH: tl.constexpr = 0, PROFILE: tl.constexpr = False, GEMV_UNROLL: tl.constexpr = 1,
                   ATT_DOT: tl.constexpr = False, ROW_PREFETCH: tl.constexpr = False,
                   X_STAGE: tl.constexpr = False, POLL_RELAXED: tl.constexpr = False,
                   X_CHUNK: tl.constexpr = 0, W_PRELOAD: tl.constexpr = 0, PREFETCH_CAP: tl.constexpr = 0,
                   ROLL: tl.constexpr = 0, KROLL: tl.constexpr = 0, LEAN_RELEASE: tl.constexpr = False,
                   GEMV_TMA: tl.constexpr = False, RING: tl.constexpr = 0, RING_PR: tl.constexpr = 4,
                   RING_PC: tl.constexpr = 2048):
    PROF_W: tl.constexpr = {prof_w}
    w, i, end, err, epoch, slot, abort_ptr = worker_loop_prologue(ERR, EPOCH, QSTART, slots)
    XSW = XS + w.to(tl.int64) * xs_w  # this worker's GEMV f(x) scratch (X_STAGE)
    ok = tl.full([], 1, dtype=tl.int32)
    done = epoch * 0
    # the weight ring (ring.py): this worker's stream entries and the ring's state
    se = tl.full([], 0, dtype=tl.int32)
    sfirst = se
    if RING > 0:
        sfirst = tl.load(SSTART + w)
        se = tl.load(SSTART + w + 1)
    rst = RG.ring_state(STREAMS, sfirst, se)
    if RING > 0:
        RG.ring_init(rbase, RING, RING_PR * RING_PC * 2)
        rst = RG.ring_issue(A_I32, STREAMS, se, rbase, rst, RING, RING_PR, RING_PC)
    if PREFETCH > 0:  # the first PREFETCH tasks' weight tiles; then task i + PREFETCH at task i
        for d in tl.static_range(PREFETCH):
            if i + d < end:
                l2_prefetch(A_I32, TASKS + (i + d).to(tl.int64) * {row}, False, PREFETCH_CAP)
    while (i < end) & (ok != 0):
        row = TASKS + i.to(tl.int64) * {row}
        if ROW_PREFETCH:  # the next task's table row into L1 while this task runs
            if i + 1 < end:
                row_prefetch(row + {row})
        if PROFILE:
            tl.store(PROF + i.to(tl.int64) * PROF_W, global_timer())
        op, nw, w0, wc, wn, wb, ns, s0, sc, sa, ss, fl = task_header(row)
        if RING > 0:  # top the ring up before this task's waits: weights wait on nothing
            rst = RG.ring_issue(A_I32, STREAMS, se, rbase, rst, RING, RING_PR, RING_PC)
        if PREFETCH > 0:  # task i + PREFETCH's tile, its range in this row (table.prefetch_ahead)
            l2_prefetch(A_I32, row, True, PREFETCH_CAP)
        st = tl.full([], 0, dtype=tl.int32)
{dispatch}
        if ok != 0:
            if PROFILE:
                tl.store(PROF + i.to(tl.int64) * PROF_W + 6, global_timer())
            ok = finish_task(ns, s0, sc, sa, ss, fl, SIGS, A_I32, err, i, epoch, abort_ptr, st, LEAN_RELEASE)
            done += ok.to(tl.int64)
            if PROFILE:
                tl.store(PROF + i.to(tl.int64) * PROF_W + 2, global_timer())
        i += 1
    if RING > 0:  # no copy into this CTA's shared memory may outlive it
        RG.ring_drain(rbase, rst, timeout, RING, RING_PR * RING_PC * 2)
    tl.store(err + 6, done)
'''


#: The GEMV call's extra arguments: it runs the row's waits itself (t_gemv).
_GEMV_WAITS = ("W_PRE=W_PRELOAD, ROLL=ROLL, KROLL=KROLL, fl=fl, nw=nw, w0=w0, wc=wc, wn=wn, wb=wb, WAITS=WAITS, i=i, epoch=epoch, "
               "abort_ptr=abort_ptr, timeout=timeout, SYS={sys}, RELAXED=POLL_RELAXED, STREAMS=STREAMS, se=se, "
               "rbase=rbase, rst=rst, RING_S=RING, RING_PR=RING_PR, RING_PC=RING_PC")
#: What every GEMV call returns: its waits' and op's status, then the weight ring's state.
_GEMV_OUT = "ok, st, rst"


def _dispatch(variants: list[T.Variant], sys_waits: bool) -> str:
    """The generated loop body after the row header: GEMV variants first (each runs its own
    waits, see t_gemv), then every other variant after ``run_waits``."""
    ind = lambda n, text: "\n".join(" " * n + ln for ln in text.splitlines())  # noqa: E731
    gemv = [(c, v) for c, v in enumerate(variants) if v.op in T.GEMV_OPS]
    rest = [(c, v) for c, v in enumerate(variants) if v.op not in T.GEMV_OPS]
    waits = ("ok = run_waits(nw, w0, wc, wn, wb, WAITS, A_I32, err, i, epoch, abort_ptr, timeout, "
             f"{bool(sys_waits)}, POLL_RELAXED)\nif ok != 0:\n    if PROFILE:\n"
             "        tl.store(PROF + i.to(tl.int64) * PROF_W + 1, global_timer())\n")
    waits += "\n".join(f"    {'if' if j == 0 else 'elif'} op == {c}:\n        st = {_call(v)}"
                        for j, (c, v) in enumerate(rest)) or "    pass"
    if not gemv:
        return ind(8, waits)
    extra = _GEMV_WAITS.format(sys=bool(sys_waits))
    cond = " | ".join(f"(op == {c})" for c, _ in gemv)
    body = "\n".join(f"    {'if' if j == 0 else 'elif'} op == {c}:\n        {_GEMV_OUT} = {_call(v)[:-1]}, {extra})"
                      for j, (c, v) in enumerate(gemv))
    return ind(8, f"if {cond}:\n{body}\nelse:\n{ind(4, waits)}")


def generate_source(tab: T.TaskTable, name: str, sys_waits: bool = False) -> str:
    """The Python/Triton source of the megakernel for one task table (see module doc).
    ``sys_waits``: poll counters with system-scope acquires (multi-rank programs)."""
    lines = [f"#   {code}: {v.describe()}" for code, v in enumerate(tab.variants)]
    return _TEMPLATE.format(name=name, rank=tab.rank, ntasks=tab.n_tasks, workers=tab.workers,
                            variant_lines="\n".join(lines) or "#   (none)", row=T.ROW,
                            dispatch=_dispatch(tab.variants, sys_waits), prof_w=PROF_W)


def cache_dir() -> Path:
    """Where generated kernels are written: ``$AMK_CACHE_DIR/triton`` or the temp dir."""
    base = os.environ.get("AMK_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "amk-cache")
    d = Path(base) / "triton"
    d.mkdir(parents=True, exist_ok=True)
    return d


def load_kernel(source: str):
    """Write ``source`` to the cache (named by its hash) and import it; returns the jit
    kernel ``amk_megakernel``. Identical sources share one module (and one compile)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    mod_name = f"amk_megakernel_{digest}"
    mod = sys.modules.get(mod_name)
    if mod is None:
        path = cache_dir() / f"{mod_name}.py"
        if not path.exists() or path.read_text() != source:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = mod
        spec.loader.exec_module(mod)
    return mod.amk_megakernel


# ---------------------------------------------------------------- offline compile (no GPU)
#: Kernel argument types for an offline compile (pointer args are 16-byte aligned views).
_ARG_TYPES = {"A_BF16": "*bf16", "A_F16": "*fp16", "A_F32": "*fp32", "A_I32": "*i32", "TASKS": "*i64",
              "WAITS": "*i64", "SIGS": "*i64", "QSTART": "*i32", "ERR": "*i64", "EPOCH": "*i64",
              "slots": "i32", "timeout": "i64", "PROF": "*i64", "XS": "*fp32", "xs_w": "i32",
              "STREAMS": "*i64", "SSTART": "*i32", "rbase": "i32"}


def compile_offline(source: str, constexprs: dict[str, int], arch: int = 90, num_warps: int = 4,
                    maxnreg: int | None = None) -> dict:
    """Compile a generated megakernel for ``sm_<arch>`` without a GPU (Triton's own LLVM and
    ptxas) and report what the GPU run depends on: shared memory, registers and spills per
    thread (from cuobjdump when Triton ships it) and whether the PTX holds the acquire
    polls, the global timer, the release signals and barriers.

    Must run in a process with ``TRITON_INTERPRET=0`` (the jit functions must be compiled
    ones); ``python -m lowering.triton.megakernel FILE`` does that. Raises RuntimeError
    otherwise. ``maxnreg``: ptxas's register cap per thread (None: its own choice).
    """
    if INTERPRET:
        raise RuntimeError("compile_offline needs TRITON_INTERPRET=0 in this process")
    import re
    import shutil
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_kernel(source)
    constexprs = {"PROFILE": False, "GEMV_STAGES": 1, "PREFETCH": 0, **constexprs}
    sig = {n: ("constexpr" if n in constexprs else _ARG_TYPES[n]) for n in fn.arg_names}
    # pointers are 16-byte aligned; xs_w (scratch row, elements) is a multiple of 16 (runtime)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if _ARG_TYPES.get(n, "")[:1] == "*" or n == "xs_w"}
    k = triton.compile(ASTSource(fn, sig, constexprs=dict(constexprs), attrs=attrs),
                       target=GPUTarget("cuda", arch, 32),
                       options=dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {})))
    ptx = k.asm["ptx"]
    out = dict(arch=arch, num_warps=num_warps, maxnreg=maxnreg, shared=int(k.metadata.shared),
               acquire_polls="ld.acquire.gpu.global.b32" in ptx, global_timer="%globaltimer" in ptx,
               relaxed_polls="ld.relaxed.gpu.global.b32" in ptx, acquire_fence="fence.acq_rel.gpu" in ptx,
               relaxed_polls_sys="ld.relaxed.sys.global.b32" in ptx,
               acquire_polls_sys="ld.acquire.sys.global.b32" in ptx,
               l2_prefetch="cp.async.bulk.prefetch.L2" in ptx, async_copy="cp.async" in ptx,
               tma_copies=ptx.count("cp.async.bulk.tensor"),
               ring_copies=ptx.count("cp.async.bulk.shared::cluster.global"),
               ring_waits=ptx.count("mbarrier.try_wait.parity"), ring_page_loads=ptx.count("ld.shared.v4.b32 {"),
               row_prefetch="prefetch.global.L1" in ptx, line_prefetch="prefetch.global.L2 " in ptx,
               release_gpu="gpu.release.add" in ptx, release_sys="sys.release.add" in ptx,
               relaxed_red_sys="red.relaxed.sys.global.add" in ptx,
               barrier="bar.sync" in ptx, vector_loads=bool(re.search(r"ld\.global(\.\w+)*\.v4", ptx)),
               vector_stores=bool(re.search(r"st\.global(\.\w+)*\.v4", ptx)),
               regs=None, local_bytes=None)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if tool and "cubin" in k.asm:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            res = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True)
        m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res.stdout)
        if m:
            out["regs"], out["local_bytes"] = int(m.group(1)), int(m.group(2))
    return out


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m lowering.triton.megakernel",
                                 description="Compile a generated megakernel source offline (no GPU needed).")
    ap.add_argument("source", help="a kernel source written by TritonExecutor.emit_source")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--num-warps", type=int, default=None, help="default: the emitted launch's, else 4")
    ap.add_argument("--constexprs", default="{}", help="JSON: block sizes overriding the emitted launch's")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap per thread")
    a = ap.parse_args(argv)
    text = Path(a.source).read_text()
    cx, warps, maxnreg = launch_meta(text)
    cx.update(json.loads(a.constexprs))
    print(json.dumps(compile_offline(text, cx, a.arch, a.num_warps or warps, a.maxnreg or maxnreg)))
    return 0


def launch_meta(source: str) -> tuple[dict, int, int | None]:
    """(constexprs, num_warps, maxnreg) of an emitted kernel source: its ``# amk-launch:``
    line (TritonExecutor.emit_source) over the default Blocks' sizes; 4 warps and no
    register cap where the line does not say."""
    import json

    from lowering.triton.runtime import Blocks

    b = Blocks()
    cx = dict(BLOCK=b.elementwise, GEMV_N=b.gemv_n, GEMV_K=b.gemv_k, ROPE_BLOCK=b.rope, ATT_T=b.attention_t,
              ATT_D=b.attention_d, ATT_Q=b.attention_q, PAIR_BLOCK=b.pairs)
    warps, maxnreg = 4, None
    for line in source.splitlines():
        if line.startswith("# amk-launch: "):
            meta = json.loads(line[len("# amk-launch: "):])
            cx.update(meta.get("constexprs", {}))
            warps = meta.get("num_warps", warps)
            maxnreg = meta.get("maxnreg")
    return cx, warps, maxnreg


if __name__ == "__main__":
    sys.exit(_main())
