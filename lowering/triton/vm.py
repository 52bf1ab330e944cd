"""The megakernel's virtual machine: the device functions of its queue loop (the loop itself
is generated per program, codegen.py), the counter waits and signals, the row decoding
helpers every op family's decoder uses, and the watchdog's error records.

One launch runs one decode step (epoch) of one rank. Grid = number of workers; program
(CTA) ``w`` is worker ``w`` and runs its queue, rows ``qstart[w] .. qstart[w+1]-1`` of the
task table (layout.py), in order:

1. **Waits.** For each wait ``(counter, N, offset, t)``: spin until
   ``counter - need >= 0`` in wrapping int32, ``need = (epoch + offset) * N + t``. On the GPU
   every thread polls with ``ld.acquire.gpu.global.b32`` (``.sys`` for multi-rank programs;
   inline PTX): a plain load with
   acquire semantics, no read-modify-write, so pollers do not serialise on the line and each
   thread's later loads are ordered after its own acquire. The outcome (satisfied, timed
   out, aborted) is reduced over the CTA (``cta_max``) so all threads branch alike. Under
   the interpreter the poll is a volatile load (programs run one after another there).
   GEMV rows run their waits inside the op (ops/gemv.py ``t_gemv``): the operands are
   decoded first, and with ``W_PRELOAD`` the first weight columns loaded, while the
   producers still work.
2. **Op.** A flat if/elif chain on the row's runtime opcode calls the row decoder of that
   *variant* (op + operand dtypes + layout flags, all compile-time; the op registry,
   ops/), which reads the operand descriptors and params from the row (``operand``,
   ``param_i``, ``param_f``) and calls the op's device function. Position / token operands
   are range-checked first; a bad one is reported (``fail``), never used as an address.
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
kinds: 1 wait timed out (a = wait index, b = value seen, c = value needed; a = -1: a
weight-ring page, b pages consumed, c issued), 2 position out of range (a = pos, b = cache
length), 3 token out of range (a = token, b = vocab rows), 4 aborted because another
worker failed (a, b, c as for 1). The abort word follows the W records.
"""

from __future__ import annotations

import triton.language as tl

from lowering.triton import layout as L
from lowering.triton.lang import INTERPRET, device, global_timer, l2_prefetch_bytes, red_relaxed_sys_one
from lowering.triton.lang import system_fence, system_fence_one

# Table layout as compile-time constants for the device code.
_F_OP = tl.constexpr(L.F_OP)
_F_NWAIT = tl.constexpr(L.F_NWAIT)
_F_WAIT0 = tl.constexpr(L.F_WAIT0)
_F_NSIG = tl.constexpr(L.F_NSIG)
_F_SIG0 = tl.constexpr(L.F_SIG0)
_F_P0 = tl.constexpr(L.F_P0)
_F_OPND = tl.constexpr(L.F_OPND)
_F_FLAGS = tl.constexpr(L.F_FLAGS)
_F_W0C = tl.constexpr(L.F_W0C)
_F_W0N = tl.constexpr(L.F_W0N)
_F_W0B = tl.constexpr(L.F_W0B)
_F_S0C = tl.constexpr(L.F_S0C)
_F_S0A = tl.constexpr(L.F_S0A)
_F_S0S = tl.constexpr(L.F_S0S)
_OPND_W = tl.constexpr(L.OPND_W)
# row_prefetch: one thread per 128-byte line the row can touch (plus one: a row need not
# start on a line), at offsets 0, step, ..., bytes - 1 with step <= 128
_RP_THREADS = -(-L.ROW * 8 // 128) + 1
_RP_STEP = (L.ROW * 8 - 1) // (_RP_THREADS - 1)
assert _RP_STEP <= 128
_RP_ASM = tl.constexpr(
    "{ .reg .pred %rp_p; .reg .u32 %rp_t; .reg .u64 %rp_o; mov.u32 %rp_t, %tid.x; "
    f"setp.lt.u32 %rp_p, %rp_t, {_RP_THREADS}; min.u32 %rp_t, %rp_t, {_RP_THREADS - 1}; "
    f"mul.wide.u32 %rp_o, %rp_t, {_RP_STEP}; "
    "add.u64 %rp_o, %rp_o, $1; @%rp_p prefetch.global.L1 [%rp_o]; mov.u32 $0, 0; }")
_F_PFO = tl.constexpr(L.F_PFO)
_F_PFN = tl.constexpr(L.F_PFN)
_F_APFO = tl.constexpr(L.F_APFO)
_F_APFN = tl.constexpr(L.F_APFN)
_WAIT_W = tl.constexpr(L.WAIT_W)
_SIG_W = tl.constexpr(L.SIG_W)
_SCOPE_GPU = tl.constexpr(L.SCOPE_GPU)

ERR_W = 8
_ERR_W = tl.constexpr(ERR_W)
KIND_OK, KIND_TIMEOUT, KIND_POS, KIND_TOKEN, KIND_ABORTED = 0, 1, 2, 3, 4
_KIND_TIMEOUT = tl.constexpr(KIND_TIMEOUT)
_KIND_POS = tl.constexpr(KIND_POS)
_KIND_TOKEN = tl.constexpr(KIND_TOKEN)
_KIND_ABORTED = tl.constexpr(KIND_ABORTED)

#: Profiling stamps per task (PROFILE): 0 start, 1 waits done, 2 signals done, 3 GEMV
#: operands decoded, 4 GEMV prologue (RMSNorm pre-pass) done, 5 GEMV stores done, 6 op done
#: (before the barrier and signals); GEMV-only stamps stay 0 for other ops; on the weight ring
#: (ring.gemv_ring): 7 ns waiting for pages, 8 ns issuing copies, 9 pages consumed. Attention
#: tasks (ops/attention.py t_attention; stamp 3 stays 0): 7 position read, 8 position loop
#: starts, 9 position loop ends.
PROF_W = 10



# ---------------------------------------------------------------- sync primitives
@device
def poll_load(p, SYS: tl.constexpr):
    """int32 at ``p``, one poll of a counter, executed by every thread. Scope: GPU
    (single-rank programs) or system when ``SYS`` (multi-rank programs: the releasing signal
    may come from a peer GPU, and an acquire synchronises with a release only at a scope that
    contains both threads; PTX ISA, memory consistency model). Order: acquire
    (``ld.acquire.gpu`` / ``.sys``; relaxed polls with one acquire fence measured slower,
    docs/experiments.md). Interpreter: a volatile load."""
    if INTERPRET:
        v = tl.load(p, volatile=True)
    elif SYS:
        v = tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [p],
                                      dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [p],
                                      dtype=tl.int32, is_pure=False, pack=1)
    return v


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
    large tile's rest comes from its own rolling prefetch, ops/gemv.py ``ROLL``, instead of
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
        l2_prefetch_bytes(A_I32 + o, n)


@device
def row_prefetch(row):
    """Start an L1 prefetch of the task-table row at ``row`` (layout.ROW int64 = 704 bytes):
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
def wait_counter(ctr, need, abort_ptr, abort_tag, timeout, SYS: tl.constexpr):
    """Spin until ``*ctr - need >= 0`` (wrapping int32). Returns (value seen, kind):
    kind 0 = satisfied, 1 = timed out, 4 = another worker aborted this epoch.
    ``timeout``: ns on the GPU, number of polls under the interpreter.

    Each poll is an acquire load (poll_load).

    Fast path (GPU): the first poll of every thread is voted over the CTA
    (``cta_all``); when it already satisfies the wait in all threads -- the common case
    once a worker trails its producers -- the timer, the abort word and ``cta_max`` are
    skipped. Otherwise the watched spin loop below runs as before."""
    v = poll_load(ctr, SYS)
    if INTERPRET:
        it = 0
        while ((v - need) < 0) & (it < timeout):
            v = poll_load(ctr, SYS)
            it += 1
        kind = tl.where((v - need) < 0, _KIND_TIMEOUT, 0)
    else:
        kind = tl.full([], 0, dtype=tl.int32)
        if cta_all(((v - need) >= 0).to(tl.int32)) == 0:
            t0 = global_timer()
            now = t0
            ab = abort_tag - 1
            while ((v - need) < 0) & ((now - t0) < timeout) & (ab != abort_tag):
                v = poll_load(ctr, SYS)
                now = global_timer()
                ab = tl.load(abort_ptr, volatile=True)
            kind = tl.where((v - need) < 0, tl.where(ab == abort_tag, _KIND_ABORTED, _KIND_TIMEOUT), 0)
            kind = cta_max(kind)  # one decision for the whole CTA (see cta_max)
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
        red_relaxed_sys_one(ctr, amount)
    else:
        tl.atomic_add(ctr, amount, sem="release", scope="sys")


# ---------------------------------------------------------------- row decoding (the op families' decoders, ops/)
@device
def arena_ptr(A_BF16, A_F16, A_F32, A_I32, DT: tl.constexpr):
    """The arena viewed as DT (int8 / float8e4nv, the quantized weights: the i32 view's base
    reinterpreted, so offsets count bytes)."""
    if DT == tl.bfloat16:
        p = A_BF16
    elif DT == tl.float16:
        p = A_F16
    elif DT == tl.float32:
        p = A_F32
    elif DT == tl.int8:
        p = A_I32.to(tl.pointer_type(tl.int8), bitcast=True)
    elif DT == tl.float8e4nv:
        p = A_I32.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    else:
        p = A_I32
    return p


@device
def operand(row, KK: tl.constexpr, slot):
    """Operand KK of a row: (element offset at this slot, n0, n1, n2, s0, s1, s2)."""
    b = row + (_F_OPND + KK * _OPND_W)
    off = tl.load(b) + tl.load(b + 1) * slot
    return (off, tl.load(b + 2).to(tl.int32), tl.load(b + 3).to(tl.int32), tl.load(b + 4).to(tl.int32),
            tl.load(b + 5).to(tl.int32), tl.load(b + 6).to(tl.int32), tl.load(b + 7).to(tl.int32))


@device
def operand_off(row, KK: tl.constexpr, slot):
    """Operand KK's element offset at this slot (its first field pair only)."""
    b = row + (_F_OPND + KK * _OPND_W)
    return tl.load(b) + tl.load(b + 1) * slot


@device
def param_i(row, J: tl.constexpr):
    """Param slot J of the row as an int32."""
    return tl.load(row + (_F_P0 + J)).to(tl.int32)


@device
def param_f(row, J: tl.constexpr):
    """Param slot J of the row as a float32 (stored as its bit pattern, layout.f32_bits)."""
    return tl.load(row + (_F_P0 + J)).to(tl.int32).to(tl.float32, bitcast=True)


@device
def status_ok():
    """The status of an op that ran: 0."""
    return tl.full([], 0, dtype=tl.int32)


@device
def fail(err, kind, a, b):
    """Record fields a, b of an op's refusal in the worker's error record; returns the
    status ``kind`` (stored with the row by finish_task)."""
    tl.store(err + 2, a.to(tl.int64))
    tl.store(err + 3, b.to(tl.int64))
    return tl.full([], 0, dtype=tl.int32) + kind


@device
def fail_position(err, pos, length):
    """A position operand outside the KV cache [0, length) (length 0: a negative one)."""
    return fail(err, _KIND_POS, pos, length)


@device
def fail_token(err, tok, rows):
    """A token operand outside the embedding table's ``rows``."""
    return fail(err, _KIND_TOKEN, tok, rows)


@device
def fail_page(err, i, consumed, issued, epoch, abort_ptr):
    """Record a weight-ring page that never arrived (ring.gemv_ring) as a timeout of wait -1
    of row ``i`` (pages consumed, pages issued) and tag the abort word. Returns 0: stop."""
    tl.store(err + 1, i.to(tl.int64))
    tl.store(err + 2, -1)
    tl.store(err + 3, consumed.to(tl.int64))
    tl.store(err + 4, issued.to(tl.int64))
    tl.store(err + 5, epoch)
    tl.store(err + 0, epoch * 0 + _KIND_TIMEOUT)
    tl.store(abort_ptr, epoch + 1)
    return tl.full([], 0, dtype=tl.int32)


# ---------------------------------------------------------------- the queue loop's steps
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
def run_waits(nw, w0, wc, wn, wb, WAITS, A_I32, err, i, epoch, abort_ptr, timeout, SYS: tl.constexpr):
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
        v, kind = wait_counter(A_I32 + ctr, need, abort_ptr, epoch + 1, timeout, SYS)
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
            system_fence()
    tl.debug_barrier()
    if LEAN:
        if (fl & 1) != 0:
            system_fence_one()
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
