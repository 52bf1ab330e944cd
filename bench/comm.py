"""Communication micro-benchmarks for amk's multi-GPU megakernel: how fast one GPU
can signal another, and how fast an all-reduce runs *inside* a persistent Triton kernel,
next to NCCL on the same GPUs.

Usage (on a 2- or 4-GPU NVLink machine, from the repo root):

    python bench/comm.py --ranks 2 [--json FILE] [--sizes 4K,8K,16K,64K,256K,1M] [--iters N]

It starts its own R ranks (``amk.launch.spawn``) unless it already runs in one (started by
``spawn`` or ``torchrun --nproc-per-node R bench/comm.py ...``). Rank 0 prints two tables
and writes one JSON object (device, ranks, command, topology, every row's numbers and its
correctness verdict). Exit code: 0 when every verdict holds, 1 when one does not, 2 for
bad arguments. Method and how to read the tables: docs/comm.md.

What it measures
----------------
1. **Signal latency** (``signal`` rows): a ping-pong between rank 0 and rank 1 inside one
   launch of a one-CTA kernel per rank. Rank 0 signals rank 1's flag and waits for its own
   flag; rank 1 does the reverse. Counters are monotone (round trip k waits for >= k), like
   amk's epoch-relative counters. One row per (poll, signal) pair: see ``POLLS`` and
   ``SIGNALS``. Time: ``%globaltimer`` stamps taken by rank 0 every ``--pp-batch`` round
   trips after ``--pp-warm`` untimed ones; one sample = mean round trip of one batch;
   one-way = round trip / 2.
2. **All-reduce** (``allreduce`` rows) of bf16 vectors, one-shot: every rank stores its
   whole vector through peer pointers into its slot of every peer's receive buffer, then
   releases a per-(chunk, source) counter on that peer; it waits for the R-1 sources with
   acquire polls and sums its R slots in fp32 (rank order), rounding once to bf16. Several
   CTAs, one contiguous chunk each. ``loop``: N iterations inside one launch (the
   megakernel's situation); ``graph``: one launch per op, N launches in one CUDA graph.
   Baselines in the same run: NCCL ``all_reduce`` through torch.distributed, ``eager`` (CUDA
   events per call) and ``graph`` (N all_reduces captured in one CUDA graph).

Peers are reached the way the megakernel reaches them: a peer's copy of a symmetric buffer
is this rank's pointer plus a per-peer element delta (``DistContext.peer_deltas``), loaded
from a small int64 table inside the kernel.

Every wait in every kernel has a ``%globaltimer`` watchdog (``--timeout-ms``): a stuck wait
writes an error record and the kernel exits, so a broken protocol becomes a failed verdict
naming the rank, CTA, iteration and counter, never a hang.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/comm.py` from a source checkout
    sys.path.insert(0, str(ROOT))

from ground.errors import AmkError, rank_exit_code  # noqa: E402
# lowering.triton chooses Triton's CPU interpreter on a machine without a GPU; it must be
# imported before `triton` (see conftest.py).
from lowering.triton import lang as K  # noqa: E402
from lowering.triton.lang import INTERPRET, device, global_timer, thread0_asm  # noqa: E402
from lowering.triton.vm import cta_all, cta_max  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# ====================================================================== variants
#: Poll codes (device constants below). "one" = thread 0 spins in a PTX loop, the CTA
#: waits for it at the vote (bar.red); "all" = every thread spins.
P_RMW_TRITON, P_RMW_ONE, P_ACQ_SYS_ALL, P_ACQ_SYS_ONE, P_RLX_SYS_ONE, P_VOL_ONE, P_ACQ_GPU_ALL = range(7)
#: Signal codes: Triton's release atomic (bar.sync, then one thread), or thread 0's PTX.
S_ATOMIC, S_ST, S_RED = range(3)


@dataclass(frozen=True)
class Poll:
    name: str
    code: int
    num_warps: int
    doc: str


@dataclass(frozen=True)
class Signal:
    name: str
    code: int
    doc: str


POLLS = {p.name: p for p in [
    Poll("rmw_triton", P_RMW_TRITON, 4,
         "tl.atomic_add(flag, 0, sem=acquire, scope=sys) in a Triton loop (the first probe); "
         "Triton runs it on thread 0 and broadcasts the value through shared memory"),
    Poll("rmw_one", P_RMW_ONE, 4, "thread 0 spins on atom.acquire.sys.add 0 in PTX"),
    Poll("ld_acquire_sys_all", P_ACQ_SYS_ALL, 4, "all 128 threads spin on ld.acquire.sys"),
    Poll("ld_acquire_sys_warp", P_ACQ_SYS_ALL, 1, "num_warps=1: 32 threads spin on ld.acquire.sys"),
    Poll("ld_acquire_sys_one", P_ACQ_SYS_ONE, 4, "thread 0 spins on ld.acquire.sys"),
    Poll("ld_relaxed_sys_one", P_RLX_SYS_ONE, 4, "thread 0 spins on ld.relaxed.sys, then fence.acq_rel.sys"),
    Poll("ld_volatile_one", P_VOL_ONE, 4, "thread 0 spins on ld.volatile.global, then fence.acq_rel.sys"),
    Poll("ld_acquire_gpu_all", P_ACQ_GPU_ALL, 4,
         "all threads spin on ld.acquire.gpu (the megakernel's single-rank poll; GPU scope does "
         "not formally synchronise with a release from another GPU)"),
]}

SIGNALS = {s.name: s for s in [
    Signal("atomic_add_release_sys", S_ATOMIC, "tl.atomic_add(flag, 1, sem=release, scope=sys)"),
    Signal("st_release_sys", S_ST, "thread 0: st.release.sys.global.b32 (stores the new value)"),
    Signal("red_release_sys", S_RED, "thread 0: red.release.sys.global.add.s32 1"),
]}


@dataclass(frozen=True)
class ArVariant:
    """An in-kernel all-reduce flavour: how waits poll and how arrivals are signalled.
    With ``atomic_add_release_sys`` every thread runs fence.acq_rel.sys before the CTA
    barrier (the megakernel's put+signal); with the PTX signals thread 0 runs
    fence.acq_rel.sys after the barrier, then the release."""

    name: str
    poll: Poll
    signal: Signal


AR_PRESETS = {
    "lean": ("ld_acquire_sys_one", "red_release_sys"),
    "mk": ("ld_acquire_sys_all", "atomic_add_release_sys"),
}

PARTS = ("pingpong", "allreduce", "nccl")

#: All-reduce elements per inner block (4 warps x 8 bf16 = 16-byte vectors per thread).
AR_BLOCK = 1024
#: Sizes must be a multiple of this many bytes (16 bf16 elements: aligned 16-byte vectors,
#: and Triton's divisibility-by-16 specialisation of the length).
SIZE_QUANTUM = 32
MAX_SIZE = 64 << 20
ERR_W = 8
#: Error kinds written by the kernels (ERR row: kind, iteration, source, seen, needed).
KIND_TIMEOUT, KIND_ABORTED = 1, 4
KIND_NAMES = {KIND_TIMEOUT: "timed out", KIND_ABORTED: "stopped after another CTA of this rank timed out"}

# ====================================================================== PTX
_TID0 = "mov.u32 %amk_t, %tid.x;\nsetp.ne.u32 %amk_p, %amk_t, 0;\n@%amk_p bra AMK_DONE;\n"


def spin_asm(load: str, one_thread: bool, fence_after: bool) -> str:
    """PTX of a bounded spin: ``$0`` = last value read at ``[$1]`` (int32), leaving when
    ``$0 - $2 >= 0`` (wrapping, like amk's counters) or after ``$3`` ns of %globaltimer.

    ``load``: one instruction reading ``[$1]`` into ``%amk_v`` (e.g. ``ld.acquire.sys``).
    ``one_thread``: only thread 0 spins; the others return ``$2`` (satisfied) at once and
    wait for thread 0 at the caller's CTA vote. ``fence_after``: ``fence.acq_rel.sys`` after
    a successful poll (turns a relaxed / volatile poll into an acquire, PTX ISA memory
    consistency model). Labels live inside the ``{ }`` block, so the snippet may be
    instantiated several times in one kernel. The result is written last, so ``$0`` may
    share a register with an input."""
    return ("{\n.reg .pred %amk_p;\n.reg .b32 %amk_v, %amk_d;\n.reg .u32 %amk_t;\n"
            ".reg .u64 %amk_t0, %amk_t1;\n"
            "mov.b32 %amk_v, $2;\n"
            + (_TID0 if one_thread else "")
            + "mov.u64 %amk_t0, %globaltimer;\n"
            "AMK_LOOP:\n"
            f"{load}\n"
            "sub.s32 %amk_d, %amk_v, $2;\n"
            "setp.ge.s32 %amk_p, %amk_d, 0;\n"
            "@%amk_p bra AMK_OK;\n"
            "mov.u64 %amk_t1, %globaltimer;\n"
            "sub.u64 %amk_t1, %amk_t1, %amk_t0;\n"
            "setp.lt.u64 %amk_p, %amk_t1, $3;\n"
            "@%amk_p bra AMK_LOOP;\n"
            "AMK_OK:\n"
            + ("fence.acq_rel.sys;\n" if fence_after else "")
            + "AMK_DONE:\n"
            "mov.b32 $0, %amk_v;\n}")


_LD_ACQ_SYS = "ld.acquire.sys.global.b32 %amk_v, [$1];"
_ASM_RMW_ONE = tl.constexpr(spin_asm("atom.acquire.sys.global.add.s32 %amk_v, [$1], 0;", True, False))
_ASM_ACQ_SYS_ALL = tl.constexpr(spin_asm(_LD_ACQ_SYS, False, False))
_ASM_ACQ_SYS_ONE = tl.constexpr(spin_asm(_LD_ACQ_SYS, True, False))
_ASM_RLX_SYS_ONE = tl.constexpr(spin_asm("ld.relaxed.sys.global.b32 %amk_v, [$1];", True, True))
_ASM_VOL_ONE = tl.constexpr(spin_asm("ld.volatile.global.b32 %amk_v, [$1];", True, True))
_ASM_ACQ_GPU_ALL = tl.constexpr(spin_asm("ld.acquire.gpu.global.b32 %amk_v, [$1];", False, False))
_ASM_ST = tl.constexpr(thread0_asm("@%amk_q st.release.sys.global.b32 [$1], $2;\n"))
_ASM_RED = tl.constexpr(thread0_asm("@%amk_q red.release.sys.global.add.s32 [$1], 1;\n"))

_P_RMW_TRITON = tl.constexpr(P_RMW_TRITON)
_P_RMW_ONE = tl.constexpr(P_RMW_ONE)
_P_ACQ_SYS_ALL = tl.constexpr(P_ACQ_SYS_ALL)
_P_ACQ_SYS_ONE = tl.constexpr(P_ACQ_SYS_ONE)
_P_RLX_SYS_ONE = tl.constexpr(P_RLX_SYS_ONE)
_P_VOL_ONE = tl.constexpr(P_VOL_ONE)
_S_ATOMIC = tl.constexpr(S_ATOMIC)
_S_ST = tl.constexpr(S_ST)
_ERR_W = tl.constexpr(ERR_W)
_KIND_TIMEOUT = tl.constexpr(KIND_TIMEOUT)
_KIND_ABORTED = tl.constexpr(KIND_ABORTED)


# ====================================================================== device code
@device
def spin_wait(p, need, timeout, POLL: tl.constexpr):
    """This thread's last value of the int32 counter at ``p`` after waiting for
    ``*p - need >= 0`` (wrapping) with the ``POLL`` method, or giving up after ``timeout``
    ns (GPU) / polls (interpreter). Not uniform over the CTA: follow with ``cta_all``."""
    if INTERPRET:
        v = tl.load(p, volatile=True)
        it = 0
        while ((v - need) < 0) & (it < timeout):
            v = tl.load(p, volatile=True)
            it += 1
    elif POLL == _P_RMW_TRITON:
        # Triton runs a scalar atomic on thread 0 and broadcasts the result through shared
        # memory (bar.sync), so v is uniform; the timer is voted every 256 polls so every
        # thread leaves the loop at the same poll.
        v = tl.atomic_add(p, 0, sem="acquire", scope="sys")
        t0 = global_timer()
        polls = 0
        going = ((v - need) < 0).to(tl.int32)
        while going != 0:
            v = tl.atomic_add(p, 0, sem="acquire", scope="sys")
            polls += 1
            going = ((v - need) < 0).to(tl.int32)
            if (polls % 256) == 0:
                late = cta_all(((global_timer() - t0) >= timeout).to(tl.int32))
                going = going * (1 - late)
    elif POLL == _P_RMW_ONE:
        v = tl.inline_asm_elementwise(_ASM_RMW_ONE, "=r,l,r,l", [p, need, timeout], dtype=tl.int32,
                                      is_pure=False, pack=1)
    elif POLL == _P_ACQ_SYS_ALL:
        v = tl.inline_asm_elementwise(_ASM_ACQ_SYS_ALL, "=r,l,r,l", [p, need, timeout], dtype=tl.int32,
                                      is_pure=False, pack=1)
    elif POLL == _P_ACQ_SYS_ONE:
        v = tl.inline_asm_elementwise(_ASM_ACQ_SYS_ONE, "=r,l,r,l", [p, need, timeout], dtype=tl.int32,
                                      is_pure=False, pack=1)
    elif POLL == _P_RLX_SYS_ONE:
        v = tl.inline_asm_elementwise(_ASM_RLX_SYS_ONE, "=r,l,r,l", [p, need, timeout], dtype=tl.int32,
                                      is_pure=False, pack=1)
    elif POLL == _P_VOL_ONE:
        v = tl.inline_asm_elementwise(_ASM_VOL_ONE, "=r,l,r,l", [p, need, timeout], dtype=tl.int32,
                                      is_pure=False, pack=1)
    else:
        v = tl.inline_asm_elementwise(_ASM_ACQ_GPU_ALL, "=r,l,r,l", [p, need, timeout], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return v


@device
def signal(p, absval, SIG: tl.constexpr):
    """Release-signal the int32 counter at ``p`` (usually on a peer): add 1, or for
    ``st_release_sys`` store ``absval`` (the value the add would reach; valid because every
    counter here has exactly one writer). Executed once per CTA."""
    if INTERPRET:
        if SIG == _S_ST:
            tl.atomic_xchg(p, absval)
        else:
            tl.atomic_add(p, 1)
    elif SIG == _S_ATOMIC:
        tl.atomic_add(p, 1, sem="release", scope="sys")
    elif SIG == _S_ST:
        tl.inline_asm_elementwise(_ASM_ST, "=r,l,r", [p, absval], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_ASM_RED, "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


@device
def cta_min(x):
    """Minimum of a per-thread int32 over the CTA (failure paths only: it costs a reduction)."""
    return -cta_max(-x)


@device
def stamp(k):
    """%globaltimer in ns; under the interpreter the round number ``k`` (no timer there)."""
    if INTERPRET:
        t = (k * 0 + k).to(tl.int64)
    else:
        t = global_timer()
    return t


@device
def to_bf16(x):
    """fp32 -> bf16, round to nearest even (by hand under the interpreter, which truncates)."""
    if INTERPRET:
        y = K.bf16_rtne(x)
    else:
        y = x.to(tl.bfloat16)
    return y


@device
def wait_sources(CTR, row, me, R, need, timeout, abort_ptr, POLL: tl.constexpr):
    """Wait until ``CTR[row * R + s] - need >= 0`` for every source ``s != me``, one source
    after the other. Returns (ok, worst, bad, aborted): ``ok`` is 1 in every thread iff all
    waits held in every thread (CTA vote, which is also the barrier that releases the
    threads that did not poll); ``worst`` = this thread's smallest ``value - need``;
    ``bad`` = first source this thread saw short (-1 if none); ``aborted`` = the abort word
    was set when the wait began (then every poll gives up at once)."""
    ab = tl.load(abort_ptr, volatile=True)
    t = tl.where(ab != 0, 0, timeout)
    worst = tl.full([], 2 ** 30, dtype=tl.int32)
    bad = tl.full([], -1, dtype=tl.int32)
    for s in range(R):
        if s != me:
            v = spin_wait(CTR + row * R + s, need, t, POLL)
            d = v - need
            bad = tl.where((d < 0) & (bad < 0), s, bad)
            worst = tl.minimum(worst, d)
            t = tl.where(d < 0, 0, t)  # one stuck source is enough: do not wait on the others
    ok = cta_all((worst >= 0).to(tl.int32))
    return ok, worst, bad, ab


@device
def record_failure(err, i, worst, bad, need, ab, abort_ptr):
    """Write the CTA's error record (first failure only) and, for a time-out, the abort word
    (so the rank's other CTAs stop waiting). Uniform values only (CTA reductions)."""
    kind = cta_max(tl.where(ab != 0, _KIND_ABORTED, _KIND_TIMEOUT))
    seen = need + cta_min(worst)
    src = cta_max(bad)
    if tl.load(err) == 0:
        tl.store(err + 1, i.to(tl.int32))
        tl.store(err + 2, src)
        tl.store(err + 3, seen)
        tl.store(err + 4, need)
        tl.store(err, kind)
    if kind == _KIND_TIMEOUT:
        tl.store(abort_ptr, 1)


@triton.jit(do_not_specialize=["peer", "role", "n_warm", "n_iters", "batch", "timeout"])
def _k_pingpong(FLAG, DI, STAMPS, ERR, peer, role, n_warm, n_iters, batch, timeout,
                POLL: tl.constexpr, SIG: tl.constexpr):
    """Ping-pong of one CTA with rank ``peer``: role 0 signals then waits, role 1 waits then
    signals, ``n_warm + n_iters`` round trips; round trip k waits for ``FLAG >= k``. Role 0
    stores %globaltimer into ``STAMPS[j]`` after round trip ``n_warm + j * batch``.
    ``FLAG``: int32, this rank's counter; the peer's is ``FLAG + DI[peer]``.
    ``ERR``: int32[ERR_W] error record (kind, round, peer, seen, needed)."""
    timeout = timeout.to(tl.int64)
    peer_flag = FLAG + tl.load(DI + peer)
    total = n_warm + n_iters
    k = tl.full([], 1, dtype=tl.int32)
    ok = tl.full([], 1, dtype=tl.int32)
    while (k <= total) & (ok != 0):
        if role == 0:
            signal(peer_flag, k, SIG)
            v = spin_wait(FLAG, k, timeout, POLL)
            ok = cta_all(((v - k) >= 0).to(tl.int32))
        else:
            v = spin_wait(FLAG, k, timeout, POLL)
            ok = cta_all(((v - k) >= 0).to(tl.int32))
            if ok != 0:
                signal(peer_flag, k, SIG)
        if ok == 0:
            tl.store(ERR + 1, k)
            tl.store(ERR + 2, peer + k * 0)
            tl.store(ERR + 3, k + cta_min(v - k))
            tl.store(ERR + 4, k)
            tl.store(ERR, k * 0 + _KIND_TIMEOUT)
        j = k - n_warm
        if (role == 0) & (j >= 0):
            if (j % batch) == 0:
                tl.store(STAMPS + j // batch, stamp(k))
        k += 1


@triton.jit(do_not_specialize=["me", "R", "gen", "timeout"])
def _k_barrier(BAR, DI, ERR, ABORT, me, R, gen, timeout, POLL: tl.constexpr, SIG: tl.constexpr):
    """Device barrier over R ranks (one CTA): signal ``BAR[me]`` on every peer, wait until
    ``BAR[s] >= gen`` for every peer s. Launched right before a timed launch on the same
    stream, it starts the timed work on all GPUs within about one signal latency."""
    timeout = timeout.to(tl.int64)
    for p in range(R):
        if p != me:
            signal(BAR + tl.load(DI + p) + me, gen, SIG)
    ok, worst, bad, ab = wait_sources(BAR, 0, me, R, gen, timeout, ABORT, POLL)
    if ok == 0:
        record_failure(ERR, gen, worst, bad, gen, ab, ABORT)


@device
def ar_push(X, RECV, CTR, DB, DI, xrow, slot, it, c, me, R, n, lo, hi, BLOCK: tl.constexpr,
            SIG: tl.constexpr):
    """Store this CTA's chunk [lo, hi) of input row ``xrow`` into row ``slot * R + me`` of
    every peer's receive buffer, then release counter ``CTR[c * R + me]`` on every peer."""
    ar = tl.arange(0, BLOCK)
    mine = slot * R + me
    for off in range(lo, hi, BLOCK):
        idx = off + ar
        m = idx < hi
        x = tl.load(X + xrow * n + idx, mask=m)
        for p in range(R):
            if p != me:
                d = tl.multiple_of(tl.load(DB + p), 16)  # host checks: 16-element aligned
                tl.store(RECV + d + mine * n + idx, x, mask=m)
    if SIG == _S_ATOMIC:
        K.system_fence()  # every thread, before the barrier: the megakernel's put+signal
    tl.debug_barrier()  # all stores of the CTA precede the release (PTX cumulativity)
    if SIG != _S_ATOMIC:
        K.system_fence_one()
    for p in range(R):
        if p != me:
            signal(CTR + tl.load(DI + p) + c * R + me, (it + 1).to(tl.int32), SIG)


@device
def ar_reduce(X, Y, RECV, CTR, ERR, ABORT, xrow, slot, it, i, y_row, c, me, R, n, lo, hi, timeout,
              BLOCK: tl.constexpr, POLL: tl.constexpr):
    """Wait for the R-1 sources' iteration-``it`` arrivals on chunk c, then
    ``Y[y_row, lo:hi] = bf16(sum over ranks s in order of slot s (own input for s = me))``
    with fp32 accumulation. Returns 1, or 0 after recording a failure."""
    need = (it + 1).to(tl.int32)
    ok, worst, bad, ab = wait_sources(CTR, c, me, R, need, timeout, ABORT, POLL)
    if ok == 0:
        record_failure(ERR + c * _ERR_W, i, worst, bad, need, ab, ABORT)
    else:
        ar = tl.arange(0, BLOCK)
        for off in range(lo, hi, BLOCK):
            idx = off + ar
            m = idx < hi
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for s in range(R):
                if s == me:
                    v = tl.load(X + xrow * n + idx, mask=m, other=0.0)
                else:
                    v = tl.load(RECV + (slot * R + s) * n + idx, mask=m, other=0.0)
                acc += v.to(tl.float32)
            tl.store(Y + y_row * n + idx, to_bf16(acc), mask=m)
    return ok


@triton.jit(do_not_specialize=["me", "R", "k_off", "iters", "y_off", "timeout"])
def _k_allreduce(X, Y, RECV, CTR, DB, DI, EPOCH, ERR, ABORT, me, R, n, chunk, k_off, iters, y_off,
                 timeout, BLOCK: tl.constexpr, POLL: tl.constexpr, SIG: tl.constexpr,
                 PHASE: tl.constexpr):
    """One-shot all-reduce of bf16[n], ``iters`` iterations; CTA c owns elements
    [c * chunk, min((c + 1) * chunk, n)).

    Iteration i has the global index ``it = EPOCH[0] + k_off + i`` (monotone across launches:
    counters are never reset between them), reads input row ``X[it % 3]``, uses receive
    slot ``it % 2`` and writes ``Y[y_off + i]``. Counter ``CTR[c * R + s]`` on rank me counts
    source s's arrivals on chunk c: iteration ``it`` waits for ``>= it + 1``.

    Why two receive slots and no credit counter: source s overwrites slot ``it % 2`` of
    chunk c on rank d in iteration it + 2, after its own reduce of iteration it + 1, which
    waited for d's arrival of iteration it + 1 on chunk c; d's CTA c released that arrival
    after it finished reading slot ``it % 2`` (its reduce of iteration it). So that wait
    already orders d's reads before s's overwrite, as a credit would. One slot would not do:
    s's iteration it + 1 follows only d's arrival of iteration it, which d sends before it
    reads. This needs the same chunk -> CTA map on every rank (same n, chunk, grid).

    ``RECV``: bf16[2, R, n] own receive slots (symmetric); ``CTR``: int32 counters
    (symmetric); ``DB``/``DI``: int64[R] peer deltas in bf16 / int32 elements;
    ``EPOCH``: int64[1]; ``ERR``: int32[grid, ERR_W]; ``ABORT``: int32[1] (local).
    ``PHASE``: 0 push + reduce (GPU); 1 push only, 2 reduce only (interpreter tests, where
    programs run one after another)."""
    timeout = timeout.to(tl.int64)
    c = tl.program_id(0)
    lo = c * chunk
    hi = tl.minimum(lo + chunk, n)
    base = tl.load(EPOCH) + k_off
    i = tl.full([], 0, dtype=tl.int32)
    ok = tl.full([], 1, dtype=tl.int32)
    while (i < iters) & (ok != 0):
        it = base + i
        xrow = it % 3
        slot = it % 2
        if PHASE != 2:
            ar_push(X, RECV, CTR, DB, DI, xrow, slot, it, c, me, R, n, lo, hi, BLOCK, SIG)
        if PHASE != 1:
            ok = ar_reduce(X, Y, RECV, CTR, ERR, ABORT, xrow, slot, it, i, y_off + i, c, me, R, n,
                           lo, hi, timeout, BLOCK, POLL)
        i += 1


# ====================================================================== host: pure helpers
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20}


def parse_size(text: str) -> int:
    """Bytes of one ``--sizes`` item: an integer with an optional K/KB/KiB or M/MB/MiB suffix
    (binary: 4K = 4096). Raises AmkError (exit 2) for anything else, a size that is not a
    positive multiple of 32 bytes (16 bf16 elements), or one above 64 MiB."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise AmkError(f"--sizes: {text.strip()!r} is not a size (use bytes or a K/M suffix, e.g. 4K,1M)")
    size = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if size <= 0 or size % SIZE_QUANTUM:
        raise AmkError(f"--sizes: {text.strip()} = {size} bytes is not a positive multiple of "
                       f"{SIZE_QUANTUM} bytes ({SIZE_QUANTUM // 2} bf16 elements)")
    if size > MAX_SIZE:
        raise AmkError(f"--sizes: {text.strip()} is larger than {MAX_SIZE >> 20}M")
    return size


def parse_sizes(text: str) -> list[int]:
    """``--sizes`` (comma-separated, see ``parse_size``) -> sizes in bytes, duplicates dropped,
    order kept. Raises AmkError for an empty list or a bad item."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise AmkError("--sizes: no size given")
    out: list[int] = []
    for t in items:
        s = parse_size(t)
        if s not in out:
            out.append(s)
    return out


def parse_parts(text: str) -> list[str]:
    """``--parts`` -> subset of PARTS, in PARTS order. Raises AmkError naming a bad part."""
    got = [t.strip() for t in text.split(",") if t.strip()]
    for t in got:
        if t not in PARTS:
            raise AmkError(f"--parts: unknown part {t!r} (choose from {', '.join(PARTS)})")
    if not got:
        raise AmkError("--parts: nothing selected")
    return [p for p in PARTS if p in got]


def parse_ar_variants(text: str) -> list[ArVariant]:
    """``--ar-variants``: comma-separated presets (``lean``, ``mk``) or ``POLL/SIGNAL`` pairs
    of the signal-row names (e.g. ``ld_volatile_one/st_release_sys``). Raises AmkError."""
    out: list[ArVariant] = []
    for tok in [t.strip() for t in text.split(",") if t.strip()]:
        pair = AR_PRESETS.get(tok) or tuple(tok.split("/"))
        if len(pair) != 2 or pair[0] not in POLLS or pair[1] not in SIGNALS:
            raise AmkError(f"--ar-variants: {tok!r} is neither a preset ({', '.join(AR_PRESETS)}) nor "
                           f"POLL/SIGNAL with POLL in {{{', '.join(POLLS)}}} and SIGNAL in "
                           f"{{{', '.join(SIGNALS)}}}")
        if all(v.name != tok for v in out):
            out.append(ArVariant(tok, POLLS[pair[0]], SIGNALS[pair[1]]))
    if not out:
        raise AmkError("--ar-variants: no variant given")
    return out


def plan_ctas(n: int, max_ctas: int, min_chunk: int) -> tuple[int, int]:
    """(grid, chunk) for an all-reduce of ``n`` elements: chunks of at least ``min_chunk``
    elements, a multiple of 16 (aligned 16-byte vectors), at most ``max_ctas`` of them, and
    no empty CTA (grid = ceil(n / chunk)). ``n`` must be a positive multiple of 16."""
    if n <= 0 or n % 16 or max_ctas < 1 or min_chunk < 1:
        raise ValueError(f"plan_ctas: bad n={n}, max_ctas={max_ctas}, min_chunk={min_chunk}")
    grid = max(1, min(max_ctas, -(-n // min_chunk)))
    chunk = -(-n // grid)
    chunk = -(-chunk // 16) * 16
    return -(-n // chunk), chunk


@dataclass(frozen=True)
class Layout:
    """Byte offsets in the one symmetric buffer (same on every rank). Bytes
    [0, ctrl_bytes) are the control words (flags, barrier and all-reduce counters), zeroed
    before each measurement; ``recv`` holds bf16[2, R, max_elems]."""

    flags: int
    bar: int
    ctr: int
    ctrl_bytes: int
    recv: int
    total: int


def buffer_layout(ranks: int, max_elems: int, max_ctas: int, align: int = 256) -> Layout:
    """The symmetric buffer's layout for ``ranks`` ranks, vectors of up to ``max_elems``
    bf16 elements and up to ``max_ctas`` all-reduce CTAs; every region ``align``-aligned."""
    def up(x: int) -> int:
        return -(-x // align) * align
    flags = 0
    bar = up(flags + 16 * 4)
    ctr = up(bar + ranks * 4)
    ctrl = up(ctr + max_ctas * ranks * 4)
    recv = ctrl
    total = up(recv + 2 * ranks * max_elems * 2)
    return Layout(flags, bar, ctr, ctrl, recv, total)


def delta_tables(deltas: dict[int, int], ranks: int, me: int) -> tuple[list[int], list[int]]:
    """Per-peer byte deltas (``DistContext.peer_deltas``) -> (bf16, int32) element deltas
    indexed by rank (own entry 0). Raises AmkError when a delta is not a multiple of 32
    bytes (the all-reduce stores assume 16-element alignment) or a peer is missing."""
    db, di = [0] * ranks, [0] * ranks
    for p in range(ranks):
        if p == me:
            continue
        if p not in deltas:
            raise AmkError(f"rank {me}: no peer delta for rank {p}", exit_code=1)
        d = int(deltas[p])
        if d % 32:
            raise AmkError(f"rank {me}: symmetric heap of rank {p} is at a byte distance {d} that is "
                           "not a multiple of 32", exit_code=1)
        db[p], di[p] = d // 2, d // 4
    return db, di


def stats(samples: list[float]) -> dict | None:
    """{median, p10, p90, min, n} of ``samples`` (same unit; ground.timing's quantile rule), or
    None when there are none."""
    if not samples:
        return None
    from ground.timing import Timing
    t = Timing.of(list(samples))
    return {"median": round(t.median_ms, 4), "p10": round(t.p10_ms, 4), "p90": round(t.p90_ms, 4),
            "min": round(t.min_ms, 4), "n": t.n}


def make_inputs(size: int, ranks: int, seed: int = 1234):
    """Inputs of every rank: bf16[R, 3, n], n = size / 2, values in [1, 2] (positive, so the
    partial sums of any summation order are bounded by the total: see ``allreduce_check``).
    Three rows per rank, so that iteration it (row it % 3, slot it % 2) never sees the same
    data as iteration it - 2: a stale slot shows as wrong sums. Deterministic (every rank
    builds all ranks' inputs), CPU."""
    import torch
    g = torch.Generator().manual_seed(seed + size)
    return (torch.rand(ranks, 3, size // 2, generator=g) + 1.0).to(torch.bfloat16)


def reference_sum(x):
    """fp32 sums in rank order, float32[3, n], of inputs bf16[R, 3, n]: exactly what the
    kernel computes before its single rounding to bf16."""
    acc = x[0].float()
    for r in range(1, x.shape[0]):
        acc = acc + x[r].float()
    return acc


def ulp_bf16(x):
    """bf16 unit in the last place at |x| (float32 tensor; normal range): 2^(e - 8) where
    |x| = m * 2^e, m in [0.5, 1)."""
    import torch
    _, e = torch.frexp(x.abs().float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), (e - 8).to(torch.int32))


def allreduce_check(y, ref32, exact: bool, ranks: int) -> dict:
    """Correctness of all-reduce outputs ``y`` (bf16[..., n]) against fp32 reference sums
    ``ref32`` (float32, same shape or broadcastable).

    ``exact``: amk's kernels sum in rank order in fp32 and round once (RTNE), so ``y`` must
    equal ``bf16(ref32)`` bit for bit. Otherwise (NCCL: other order, possibly bf16 partial
    sums) every element must lie within ``R - 1`` bf16 ulps of ``ref32``: at most R - 1
    roundings to bf16, each at most half an ulp of a partial sum, and with positive inputs
    every partial sum is at most the total. Stale or missing data is off by about the
    input magnitude (~64 ulps and more). Returns {ok, mismatches, max_err_ulp, elements}."""
    import torch
    ref = ref32.float()
    exp = ref.to(torch.bfloat16)
    yb, eb = torch.broadcast_tensors(y.contiguous().view(torch.int16), exp.view(torch.int16))
    mism = int((yb != eb).sum().item())
    err = ((y.float() - ref).abs() / ulp_bf16(ref))
    err = torch.nan_to_num(err, nan=float("inf"))
    max_ulp = float(err.max().item()) if err.numel() else 0.0
    ok = mism == 0 if exact else max_ulp <= max(1, ranks - 1)
    return {"ok": bool(ok), "mismatches": mism, "max_err_ulp": round(max_ulp, 3), "elements": int(yb.numel())}


def describe_errors(err_rows, rank: int, what: str, unit: str = "iteration") -> list[str]:
    """One line per failed CTA of an ERR table (rows of ERR_W ints: kind, iteration,
    source, seen, needed)."""
    out = []
    for c, row in enumerate(err_rows):
        kind, i, src, seen, need = (int(v) for v in list(row)[:5])
        if kind == 0:
            continue
        name = KIND_NAMES.get(kind, f"failed (kind {kind})")
        out.append(f"rank {rank} {what} CTA {c} {unit} {i}: {name} waiting for rank {src}'s "
                   f"signal (counter {seen}, needed {need})")
    return out


_SYNC_RE = re.compile(r"^\s*(@%?\w+\s+)?((ld|st|atom|red)\.\S*(acquire|release|relaxed|volatile|sys|gpu|shared)"
                      r"|bar\.|fence\.|membar\.)")


def sync_ops(ptx: str, limit: int = 40) -> list[str]:
    """The memory-ordering instructions of a kernel's PTX (acquire/release/relaxed/volatile
    or scoped loads, stores and atomics, shared-memory traffic, barriers, fences), in
    order, at most ``limit``: what a poll or signal variant really compiled to. Inline-asm
    blocks written on one line are split at ``;``."""
    out = []
    for line in re.split(r"[;\n]", ptx):
        s = line.strip().lstrip("{").strip()
        if _SYNC_RE.match(s):
            out.append(re.sub(r"\s+", " ", s))
            if len(out) >= limit:
                break
    return out


def check_rows(per_rank: list[dict]) -> tuple[bool, str]:
    """Combine per-rank checks ({ok, detail}) into (verdict, detail): true only if every
    rank is ok; the detail lists the failing ranks' reasons (else rank 0's detail)."""
    bad = [f"rank {r}: {c.get('detail', 'failed')}" for r, c in enumerate(per_rank) if not c.get("ok")]
    if bad:
        return False, "; ".join(bad)
    return True, per_rank[0].get("detail", "ok") if per_rank else "no ranks"


def signal_row(poll: Poll, sig: Signal, per_rank: list[dict], ptx: list[str] | None = None) -> dict:
    """A ``signal`` row from every rank's ping-pong result; numbers from rank 0's stamps
    (``rt_us``: round-trip samples in us) and CUDA events (``event_rt_us``)."""
    ok, detail = check_rows(per_rank)
    rt = per_rank[0].get("rt_us") or [] if per_rank else []
    row = {"variant": f"{poll.name}/{sig.name}", "poll": poll.name, "signal": sig.name,
           "num_warps": poll.num_warps, "one_way_us": stats([x / 2 for x in rt]),
           "round_trip_us": stats(rt), "event_round_trip_us": per_rank[0].get("event_rt_us") if per_rank else None,
           "verdict": ok and bool(rt), "detail": detail if rt or not ok else "no timing samples"}
    if ptx is not None:
        row["ptx_sync_ops"] = ptx
    return row


def allreduce_row(impl: str, variant: str, mode: str, size: int, per_rank: list[dict], **extra) -> dict:
    """An ``allreduce`` row: per-op time from rank 0's samples (us), bandwidth of the median
    (size / time, GB/s), verdict over all ranks."""
    ok, detail = check_rows(per_rank)
    samples = per_rank[0].get("samples_us") or [] if per_rank else []
    st = stats(samples)
    row = {"size_bytes": size, "impl": impl, "variant": variant, "mode": mode, "per_op_us": st,
           "algbw_GBps": round(size / (st["median"] * 1e3), 3) if st and st["median"] > 0 else None,
           "verdict": ok and bool(samples), "detail": detail if samples or not ok else "no timing samples",
           "max_err_ulp": max((c.get("max_err_ulp") or 0.0) for c in per_rank) if per_rank else None}
    row.update(extra)
    return row


TARGET_SIZE = 8192


def summarize(signal_rows: list[dict], ar_rows: list[dict]) -> dict:
    """The headline facts: the fastest correct signal combination and its ratio to the first
    probe's (rmw_triton/atomic_add_release_sys); the issue's target (the in-kernel 8 KB
    all-reduce, loop mode, beats NCCL's in-graph time) as met / not met / not measured."""
    good = [r for r in signal_rows if r["verdict"] and r["one_way_us"]]
    out: dict[str, Any] = {"fastest_signal": None, "first_probe_signal": None, "target_8K": None}
    if good:
        best = min(good, key=lambda r: r["one_way_us"]["median"])
        out["fastest_signal"] = {"variant": best["variant"], "one_way_us": best["one_way_us"]["median"]}
    probe = [r for r in good if r["variant"] == "rmw_triton/atomic_add_release_sys"]
    if probe:
        out["first_probe_signal"] = {"variant": probe[0]["variant"], "one_way_us": probe[0]["one_way_us"]["median"]}
    amk = [r for r in ar_rows if r["size_bytes"] == TARGET_SIZE and r["impl"] == "amk" and r["mode"] == "loop"
           and r["verdict"] and r["per_op_us"]]
    nccl = [r for r in ar_rows if r["size_bytes"] == TARGET_SIZE and r["impl"] == "nccl" and r["mode"] == "graph"
            and r["verdict"] and r["per_op_us"]]
    if amk and nccl:
        a = min(amk, key=lambda r: r["per_op_us"]["median"])
        b = nccl[0]
        out["target_8K"] = {"amk_variant": a["variant"], "amk_loop_us": a["per_op_us"]["median"],
                            "nccl_graph_us": b["per_op_us"]["median"],
                            "met": a["per_op_us"]["median"] < b["per_op_us"]["median"]}
    else:
        out["target_8K"] = {"met": None, "why": "8K not measured with a correct amk loop row and a "
                                                "correct NCCL graph row"}
    return out


def build_report(meta: dict, signal_rows: list[dict], ar_rows: list[dict]) -> dict:
    """The JSON object: ``meta`` (device, ranks, command, topology, settings) plus the rows,
    the summary and ``all_verdicts``."""
    rep = dict(meta)
    rep["signal"] = signal_rows
    rep["allreduce"] = ar_rows
    rep["summary"] = summarize(signal_rows, ar_rows)
    rep["all_verdicts"] = all(r["verdict"] for r in signal_rows + ar_rows)
    return rep


def _fmt(st: dict | None, key: str = "median") -> str:
    return "-" if not st else f"{st[key]:.2f}"


def _size(b: int) -> str:
    return f"{b >> 20}M" if b >= 1 << 20 and b % (1 << 20) == 0 else (f"{b >> 10}K" if b % 1024 == 0 else f"{b}B")


def render(report: dict, console=None) -> None:
    """Print the report's tables (rich) and summary."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    con = console or Console(highlight=False)
    dev = report.get("device", {})
    con.print(f"[bold]amk comm bench[/]  {dev.get('name', '?')} x {report.get('ranks')}  "
              f"torch {dev.get('torch', '?')}  triton {dev.get('triton', '?')}")
    if report.get("signal"):
        t = Table(title="signal latency: ping-pong rank 0 <-> rank 1, one CTA each (us)")
        for col in ("poll", "signal", "warps", "one-way med", "p10", "p90", "round trip", "events RT", "ok"):
            t.add_column(col, justify="left" if col in ("poll", "signal") else "right")
        for r in report["signal"]:
            ev = r.get("event_round_trip_us")
            t.add_row(r["poll"], r["signal"], str(r["num_warps"]), _fmt(r["one_way_us"]),
                      _fmt(r["one_way_us"], "p10"), _fmt(r["one_way_us"], "p90"), _fmt(r["round_trip_us"]),
                      "-" if ev is None else f"{ev:.2f}", "[green]yes[/]" if r["verdict"] else "[red]NO[/]")
        con.print(t)
    if report.get("allreduce"):
        t = Table(title="all-reduce of bf16, per op (us)")
        for col in ("size", "impl", "variant", "mode", "median", "p10", "p90", "GB/s", "ok"):
            t.add_column(col, justify="left" if col in ("impl", "variant", "mode") else "right")
        for r in report["allreduce"]:
            bw = r.get("algbw_GBps")
            t.add_row(_size(r["size_bytes"]), r["impl"], r["variant"], r["mode"], _fmt(r["per_op_us"]),
                      _fmt(r["per_op_us"], "p10"), _fmt(r["per_op_us"], "p90"), "-" if bw is None else f"{bw:.1f}",
                      "[green]yes[/]" if r["verdict"] else "[red]NO[/]")
        con.print(t)
    for r in report.get("signal", []) + report.get("allreduce", []):
        if not r["verdict"]:
            name = r.get("variant")
            where = f"{_size(r['size_bytes'])} {r['impl']} {name} {r['mode']}" if "size_bytes" in r else name
            con.print(f"[red]failed[/] {escape(str(where))}: {escape(str(r['detail']))}", soft_wrap=True)
    s = report.get("summary", {})
    if s.get("fastest_signal"):
        f = s["fastest_signal"]
        con.print(f"fastest signal: {f['variant']}  {f['one_way_us']:.2f} us one-way")
    if s.get("first_probe_signal"):
        con.print(f"first probe's method: {s['first_probe_signal']['one_way_us']:.2f} us one-way")
    tg = s.get("target_8K") or {}
    if tg.get("met") is None:
        con.print(f"target (8K in-kernel all-reduce < NCCL in a CUDA graph): {tg.get('why', 'not measured')}")
    else:
        con.print(f"target (8K in-kernel all-reduce < NCCL in a CUDA graph): "
                  f"{'[green]met[/]' if tg['met'] else '[red]not met[/]'}  amk {tg['amk_variant']} "
                  f"{tg['amk_loop_us']:.2f} us vs NCCL graph {tg['nccl_graph_us']:.2f} us")
    con.print("all verdicts hold" if report.get("all_verdicts") else "[red]some verdicts failed[/]")


# ====================================================================== command line
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench/comm.py",
        description="Signal latency between GPUs and in-kernel all-reduce vs NCCL (docs/comm.md).")
    ap.add_argument("--ranks", type=int, default=None,
                    help="number of ranks (GPUs) to spawn; not needed under torchrun")
    ap.add_argument("--json", default=None, help="write the report to this file (rank 0)")
    ap.add_argument("--sizes", default="4K,8K,16K,64K,256K,1M", help="all-reduce sizes in bytes (K/M suffixes)")
    ap.add_argument("--iters", type=int, default=200,
                    help="all-reduce ops per sample (loop length, graph length, NCCL eager calls)")
    ap.add_argument("--reps", type=int, default=10, help="samples per loop / graph row")
    ap.add_argument("--pp-iters", type=int, default=2000, help="timed ping-pong round trips per variant")
    ap.add_argument("--pp-batch", type=int, default=20, help="round trips per ping-pong timing sample")
    ap.add_argument("--pp-warm", type=int, default=100, help="untimed ping-pong round trips first")
    ap.add_argument("--timeout-ms", type=float, default=2000.0, help="watchdog of every in-kernel wait")
    ap.add_argument("--ctas", type=int, default=0, help="most all-reduce CTAs (0: the number of SMs)")
    ap.add_argument("--chunk-elems", type=int, default=1024, help="fewest elements per all-reduce CTA")
    ap.add_argument("--ar-variants", default="lean,mk",
                    help="in-kernel all-reduce flavours: presets lean, mk, or POLL/SIGNAL")
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts to run: " + ",".join(PARTS))
    return ap


@dataclass
class Settings:
    """Validated command line."""

    ranks: int | None
    json: str | None
    sizes: list[int]
    iters: int
    reps: int
    pp_iters: int
    pp_batch: int
    pp_warm: int
    timeout_ns: int
    ctas: int
    chunk_elems: int
    ar_variants: list[ArVariant]
    parts: list[str]

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["ar_variants"] = {v.name: f"{v.poll.name}/{v.signal.name}" for v in self.ar_variants}
        return d


def validate(args: argparse.Namespace) -> Settings:
    """Check the parsed arguments; raises AmkError (exit 2) naming the bad option."""
    def rng(name: str, v: int, lo: int, hi: int) -> int:
        if not lo <= v <= hi:
            raise AmkError(f"--{name}: {v} is outside [{lo}, {hi}]")
        return v
    if args.ranks is not None:
        rng("ranks", args.ranks, 2, 64)
    sizes = parse_sizes(args.sizes)
    iters = rng("iters", args.iters, 1, 100_000)
    reps = rng("reps", args.reps, 1, 10_000)
    batch = rng("pp-batch", args.pp_batch, 1, 100_000)
    pp_iters = rng("pp-iters", args.pp_iters, 1, 10_000_000)
    pp_iters = -(-pp_iters // batch) * batch  # whole batches
    warm = rng("pp-warm", args.pp_warm, 1, 1_000_000)
    if not args.timeout_ms > 0 or args.timeout_ms > 600_000:
        raise AmkError(f"--timeout-ms: {args.timeout_ms} is outside (0, 600000]")
    ctas = rng("ctas", args.ctas, 0, 1024)
    chunk = rng("chunk-elems", args.chunk_elems, 16, 1 << 26)
    if iters * max(sizes) > (8 << 30):
        raise AmkError(f"--iters {iters} x largest size {max(sizes)} B needs more than 8 GiB of outputs")
    if args.json:
        parent = Path(args.json).resolve().parent
        if not parent.is_dir():
            raise AmkError(f"--json: directory {parent} does not exist")
    return Settings(args.ranks, args.json, sizes, iters, reps, pp_iters, batch, warm,
                    int(args.timeout_ms * 1e6), ctas, chunk, parse_ar_variants(args.ar_variants),
                    parse_parts(args.parts))


def main(argv: list[str] | None = None) -> int:
    """Entry point: validate, then spawn R ranks or (inside a rank) run the benchmark."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    def body() -> int:
        st = validate(args)
        from amk.launch import in_spawned_rank, spawn
        if not in_spawned_rank():
            if st.ranks is None:
                raise AmkError("give --ranks R (R >= 2 GPUs), or start the ranks with torchrun")
            return spawn(argv, st.ranks, prefix=[sys.executable, str(Path(__file__).resolve())])
        return run_rank(st, argv)

    return rank_exit_code("bench/comm.py", body)


# ====================================================================== host: GPU side
def _local(fn: Callable[[], dict]) -> dict:
    """Run one rank's part of a measurement; an exception becomes a failed result naming it
    (the rank then still joins the gather, so the ranks stay in step)."""
    try:
        return fn()
    except AmkError as e:
        return {"ok": False, "detail": str(e)}
    except Exception as e:  # reported in the row; a bug shows its type and message
        import traceback
        traceback.print_exc(file=sys.stderr)
        return {"ok": False, "detail": f"{type(e).__name__}: {e}"}


def topology() -> str:
    """``nvidia-smi topo -m`` output, or why there is none."""
    try:
        r = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "nvidia-smi not found"
    except subprocess.TimeoutExpired:
        return "nvidia-smi topo -m timed out"
    return r.stdout if r.returncode == 0 else f"nvidia-smi topo -m failed ({r.returncode}): {r.stderr.strip()}"


class CommBench:
    """One rank's side of the benchmark (see the module doc). Every measurement is
    ``reset`` (collective) -> local work (bounded: every wait has a watchdog) -> gather."""

    def __init__(self, ctx, st: Settings):
        import torch
        from lowering.triton.dist import init_nvshmem
        self.torch = torch
        self.ctx, self.st = ctx, st
        self.R, self.me = ctx.world, ctx.rank
        self.dev = ctx.device
        props = torch.cuda.get_device_properties(self.dev)
        self.sms = props.multi_processor_count
        self.max_ctas = min(st.ctas or self.sms, self.sms)  # all CTAs co-resident
        self.max_elems = max(st.sizes) // 2
        self.layout = buffer_layout(self.R, self.max_elems, self.max_ctas)
        init_nvshmem(ctx, self.layout.total)
        self.buf = ctx.symmetric_bytes(self.layout.total)
        lay = self.layout
        self.ctrl = self.buf[:lay.ctrl_bytes]
        self.flags = self.buf[lay.flags:lay.flags + 64].view(torch.int32)
        self.bar = self.buf[lay.bar:lay.bar + 4 * self.R].view(torch.int32)
        self.ctr = self.buf[lay.ctr:lay.ctr + 4 * self.R * self.max_ctas].view(torch.int32)
        self.recv = self.buf[lay.recv:lay.recv + 4 * self.R * self.max_elems].view(torch.bfloat16)
        db, di = delta_tables(ctx.peer_deltas(self.buf), self.R, self.me)
        self.db = torch.tensor(db, dtype=torch.int64, device=self.dev)
        self.di = torch.tensor(di, dtype=torch.int64, device=self.dev)
        self.err = torch.zeros(self.max_ctas, ERR_W, dtype=torch.int32, device=self.dev)
        self.bar_err = torch.zeros(1, ERR_W, dtype=torch.int32, device=self.dev)
        self.abort = torch.zeros(1, dtype=torch.int32, device=self.dev)
        self.bar_abort = torch.zeros(1, dtype=torch.int32, device=self.dev)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=self.dev)
        self.host_epoch = 0
        self.gen = 0
        self.nccl = None
        self.ptx: dict[str, list[str]] = {}
        self.broken: dict[str, str] = {}

    # ------------------------------------------------------------ plumbing
    def log(self, msg: str) -> None:
        if self.me == 0:
            print(f"[comm] {msg}", file=sys.stderr, flush=True)

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.dev)

    def reset(self) -> None:
        """Collective: all ranks idle, control words zeroed, epoch 0, before the next
        measurement. Every kernel ends (watchdog) and a kernel's end completes its stores
        to peers, so after sync + barrier nothing is in flight."""
        self.sync()
        self.ctx.barrier()
        self.ctrl.zero_()
        self.epoch.zero_()
        self.host_epoch = 0
        self.gen = 0
        self.err.zero_()
        self.bar_err.zero_()
        self.abort.zero_()
        self.bar_abort.zero_()
        self.sync()
        self.ctx.barrier()

    def device_barrier(self) -> None:
        """Enqueue the device barrier (see ``_k_barrier``) on the current stream."""
        self.gen += 1
        _k_barrier[(1,)](self.bar, self.di, self.bar_err, self.bar_abort, self.me, self.R, self.gen,
                         self.st.timeout_ns, POLL=P_ACQ_SYS_ONE, SIG=S_RED, num_warps=4)

    def barrier_errors(self) -> list[str]:
        return describe_errors(self.bar_err.tolist(), self.me, "device barrier", "generation")

    # ------------------------------------------------------------ compile
    def compile_all(self) -> None:
        """Compile every kernel with launches that do no work (zero iterations), before any
        timed or waiting launch, so that no rank waits on a peer that is still compiling.
        A variant that fails to compile is recorded in ``self.broken`` (its rows fail with
        the compiler's message; the union over ranks, so all ranks skip the same ones); the
        barrier kernel failing is fatal."""
        t0 = time.time()
        _k_barrier[(1,)](self.bar, self.di, self.bar_err, self.bar_abort, self.me, 0, 0, self.st.timeout_ns,
                         POLL=P_ACQ_SYS_ONE, SIG=S_RED, num_warps=4)
        stamps = self.torch.zeros(2, dtype=self.torch.int64, device=self.dev)
        broken: dict[str, str] = {}

        def dry(name: str, launch: Callable[[], Any]) -> None:
            try:
                self.ptx[name] = self._sync_ops(launch())
            except Exception as e:  # reported in the variant's rows
                msg = " ".join(str(e).split())
                broken[name] = f"compile failed: {type(e).__name__}: {msg[:400]}"
                self.log(f"{name}: {broken[name]}")
        if "pingpong" in self.st.parts:
            for poll in POLLS.values():
                for sig in SIGNALS.values():
                    dry(f"{poll.name}/{sig.name}", lambda: _k_pingpong[(1,)](
                        self.flags, self.di, stamps, self.err, 1 - min(self.me, 1), 0, 0, 0, self.st.pp_batch,
                        self.st.timeout_ns, POLL=poll.code, SIG=sig.code, num_warps=poll.num_warps))
        if "allreduce" in self.st.parts:
            x = self.torch.zeros(3, 16, dtype=self.torch.bfloat16, device=self.dev)
            for v in self.st.ar_variants:
                dry(f"allreduce:{v.name}", lambda: _k_allreduce[(1,)](
                    x, x, self.recv, self.ctr, self.db, self.di, self.epoch, self.err, self.abort, self.me,
                    self.R, 16, 16, 0, 0, 0, self.st.timeout_ns, BLOCK=AR_BLOCK, POLL=v.poll.code,
                    SIG=v.signal.code, PHASE=0, num_warps=v.poll.num_warps))
        self.sync()
        for other in self.ctx.all_gather_object(broken):
            for k, msg in other.items():
                self.broken.setdefault(k, msg)
        self.log(f"compiled kernels in {time.time() - t0:.1f} s")

    @staticmethod
    def _sync_ops(kernel) -> list[str]:
        try:
            return sync_ops(kernel.asm["ptx"])
        except Exception:
            return []

    # ------------------------------------------------------------ ping-pong
    def pingpong_local(self, poll: Poll, sig: Signal) -> dict:
        torch = self.torch
        st = self.st
        total = st.pp_warm + st.pp_iters
        nst = st.pp_iters // st.pp_batch + 1
        stamps = torch.zeros(nst, dtype=torch.int64, device=self.dev)
        role = self.me if self.me < 2 else None
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.device_barrier()
        e0.record()
        if role is not None:
            _k_pingpong[(1,)](self.flags, self.di, stamps, self.err, 1 - role, role, st.pp_warm, st.pp_iters,
                              st.pp_batch, st.timeout_ns, POLL=poll.code, SIG=sig.code, num_warps=poll.num_warps)
        e1.record()
        self.sync()
        problems = self.barrier_errors()
        if role is None:
            return {"ok": not problems, "detail": "; ".join(problems) or "idle rank"}
        problems += describe_errors(self.err[:1].tolist(), self.me, "ping-pong", "round trip")
        got = int(self.flags[0].item())
        if got != total:
            problems.append(f"rank {self.me}: flag is {got} after {total} round trips")
        out: dict[str, Any] = {"ok": not problems, "detail": "; ".join(problems) or f"{total} round trips"}
        if role == 0 and not problems:
            s = stamps.tolist()
            d = [(b - a) / st.pp_batch / 1e3 for a, b in zip(s, s[1:])]  # us per round trip
            if any(x <= 0 for x in d):
                out.update(ok=False, detail="globaltimer stamps not increasing")
            out["rt_us"] = d
            out["event_rt_us"] = round(e0.elapsed_time(e1) * 1e3 / total, 4)
        return out

    def run_pingpong(self) -> list[dict]:
        rows = []
        for poll in POLLS.values():
            for sig in SIGNALS.values():
                name = f"{poll.name}/{sig.name}"
                if name in self.broken:
                    rows.append(signal_row(poll, sig, [{"ok": False, "detail": self.broken[name]}] * 2))
                    continue
                self.reset()
                res = _local(lambda: self.pingpong_local(poll, sig))
                per_rank = self.ctx.all_gather_object(res)[:2]
                row = signal_row(poll, sig, per_rank, self.ptx.get(f"{poll.name}/{sig.name}"))
                rows.append(row)
                ow = row["one_way_us"]
                self.log(f"signal {row['variant']}: one-way {_fmt(ow)} us  "
                         f"{'ok' if row['verdict'] else 'FAILED: ' + row['detail']}")
        return rows

    # ------------------------------------------------------------ all-reduce (amk)
    def _ar_setup(self, size: int) -> dict:
        torch = self.torch
        x_all = make_inputs(size, self.R)
        ref = reference_sum(x_all).to(self.dev)
        n = size // 2
        grid, chunk = plan_ctas(n, self.max_ctas, self.st.chunk_elems)
        return {"size": size, "n": n, "grid": grid, "chunk": chunk, "ref": ref,
                "x": x_all[self.me].to(self.dev).contiguous(),
                "y": torch.zeros(self.st.iters, n, dtype=torch.bfloat16, device=self.dev)}

    def _ar_launch(self, s: dict, v: ArVariant, k_off: int, iters: int, y_off: int) -> None:
        _k_allreduce[(s["grid"],)](s["x"], s["y"], self.recv, self.ctr, self.db, self.di, self.epoch, self.err,
                                   self.abort, self.me, self.R, s["n"], s["chunk"], k_off, iters, y_off,
                                   self.st.timeout_ns, BLOCK=AR_BLOCK, POLL=v.poll.code, SIG=v.signal.code,
                                   PHASE=0, num_warps=v.poll.num_warps)

    def _ar_check(self, s: dict, rows: int, what: str) -> dict:
        """Errors of the last launch(es) and outputs Y[0:rows] of iterations host_epoch + i."""
        problems = self.barrier_errors()
        problems += describe_errors(self.err[:s["grid"]].tolist(), self.me, what)
        res = {"ok": True, "mismatches": 0, "max_err_ulp": 0.0}
        for k in range(3):  # rows i with (host_epoch + i) % 3 == k use input row k
            start = (k - self.host_epoch) % 3
            ys = s["y"][start:rows:3]
            if ys.shape[0]:
                c = allreduce_check(ys, s["ref"][k], exact=True, ranks=self.R)
                res["ok"] &= c["ok"]
                res["mismatches"] += c["mismatches"]
                res["max_err_ulp"] = max(res["max_err_ulp"], c["max_err_ulp"])
        if not res["ok"]:
            problems.append(f"{res['mismatches']} output elements differ from the rank-order fp32 sum "
                            f"rounded to bf16 (max error {res['max_err_ulp']} ulp)")
        self.host_epoch += rows
        return {"ok": not problems, "detail": "; ".join(problems), "max_err_ulp": res["max_err_ulp"]}

    def _clear(self) -> None:
        self.err.zero_()
        self.abort.zero_()

    def ar_loop_local(self, s: dict, v: ArVariant) -> dict:
        torch = self.torch
        N = self.st.iters
        warm = min(N, 20)
        self._clear()
        self.device_barrier()
        self._ar_launch(s, v, 0, warm, 0)
        self.epoch += warm
        self.sync()
        chk = self._ar_check(s, warm, f"{v.name} loop warm-up")
        if not chk["ok"]:
            return chk
        samples = []
        for _ in range(self.st.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._clear()
            self.device_barrier()
            e0.record()
            self._ar_launch(s, v, 0, N, 0)
            e1.record()
            self.epoch += N
            self.sync()
            chk = self._ar_check(s, N, f"{v.name} loop")
            if not chk["ok"]:
                return chk
            samples.append(e0.elapsed_time(e1) * 1e3 / N)
        return {"ok": True, "detail": f"{self.st.reps} x {N} ops bit-exact", "samples_us": samples,
                "max_err_ulp": 0.0}

    def ar_graph_local(self, s: dict, v: ArVariant) -> dict:
        torch = self.torch
        N = self.st.iters
        self._clear()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):  # NCCL's watchdog thread
            for k in range(N):
                self._ar_launch(s, v, k, 1, k)
        samples = []
        for rep in range(self.st.reps + 1):  # the first replay is a warm-up
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._clear()
            self.device_barrier()
            e0.record()
            g.replay()
            e1.record()
            self.epoch += N
            self.sync()
            chk = self._ar_check(s, N, f"{v.name} graph")
            if not chk["ok"]:
                return chk
            if rep:
                samples.append(e0.elapsed_time(e1) * 1e3 / N)
        del g
        return {"ok": True, "detail": f"{self.st.reps} x {N} launches bit-exact", "samples_us": samples,
                "max_err_ulp": 0.0}

    # ------------------------------------------------------------ all-reduce (NCCL)
    def _nccl_group(self):
        if self.nccl is None:
            import datetime

            import torch.distributed as dist
            self.nccl = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=120))
        return self.nccl

    def _nccl_check(self, s: dict, bufs, what: str) -> dict:
        problems = self.barrier_errors()
        worst = 0.0
        for k in range(3):
            rows = bufs[k::3]
            if rows.shape[0]:
                c = allreduce_check(rows, s["ref"][k], exact=False, ranks=self.R)
                worst = max(worst, c["max_err_ulp"])
                if not c["ok"]:
                    problems.append(f"{what}: max error {c['max_err_ulp']} bf16 ulp > {max(1, self.R - 1)}")
        return {"ok": not problems, "detail": "; ".join(problems), "max_err_ulp": worst}

    def nccl_eager_local(self, s: dict) -> dict:
        import torch.distributed as dist
        torch = self.torch
        grp = self._nccl_group()
        N = self.st.iters
        init = s["x"][torch.arange(N, device=self.dev) % 3]  # row i holds input row i % 3
        bufs = init.clone()
        scratch = init[0].clone()
        for _ in range(5):
            dist.all_reduce(scratch, group=grp)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(N)]
        self.device_barrier()
        for i in range(N):
            ev[i][0].record()
            dist.all_reduce(bufs[i], group=grp)
            ev[i][1].record()
        self.sync()
        res = self._nccl_check(s, bufs, "NCCL eager")
        res["samples_us"] = [a.elapsed_time(b) * 1e3 for a, b in ev]
        res["detail"] = res["detail"] or f"{N} calls within {max(1, self.R - 1)} bf16 ulp"
        return res

    def nccl_graph_capture(self, s: dict) -> dict:
        import torch.distributed as dist
        torch = self.torch
        grp = self._nccl_group()
        N = self.st.iters
        s["nccl_init"] = s["x"][torch.arange(N, device=self.dev) % 3]
        s["nccl_bufs"] = s["nccl_init"].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                dist.all_reduce(s["nccl_bufs"][0], group=grp)
        torch.cuda.current_stream().wait_stream(side)
        self.sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            for i in range(N):
                dist.all_reduce(s["nccl_bufs"][i], group=grp)
        s["nccl_graph"] = g
        return {"ok": True, "detail": "captured"}

    def nccl_graph_replay(self, s: dict) -> dict:
        torch = self.torch
        N = self.st.iters
        g, bufs, init = s["nccl_graph"], s["nccl_bufs"], s["nccl_init"]
        samples = []
        for rep in range(self.st.reps + 1):
            bufs.copy_(init)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.device_barrier()
            e0.record()
            g.replay()
            e1.record()
            self.sync()
            res = self._nccl_check(s, bufs, "NCCL graph")
            if not res["ok"]:
                return res
            if rep:
                samples.append(e0.elapsed_time(e1) * 1e3 / N)
        res["samples_us"] = samples
        res["detail"] = f"{self.st.reps} x {N} calls within {max(1, self.R - 1)} bf16 ulp"
        return res

    def run_allreduce(self) -> list[dict]:
        rows = []
        st = self.st
        for size in st.sizes:
            self.reset()
            s = _local(lambda: self._ar_setup(size))
            setup = self.ctx.all_gather_object({"ok": "n" in s, "detail": s.get("detail", "")})
            if not all(c["ok"] for c in setup):  # skipped on every rank alike
                rows.append(allreduce_row("amk", "setup", "-", size, setup))
                continue
            extra = {"ctas": s["grid"], "chunk_elems": s["chunk"]}
            if "allreduce" in st.parts:
                for v in st.ar_variants:
                    for mode, fn in (("loop", self.ar_loop_local), ("graph", self.ar_graph_local)):
                        if f"allreduce:{v.name}" in self.broken:
                            rows.append(allreduce_row("amk", v.name, mode, size, [
                                {"ok": False, "detail": self.broken[f"allreduce:{v.name}"]}], **extra))
                            continue
                        self.reset()
                        res = _local(lambda: fn(s, v))
                        row = allreduce_row("amk", v.name, mode, size, self.ctx.all_gather_object(res), **extra)
                        rows.append(row)
                        self._log_ar(row)
            if "nccl" in st.parts:
                self.reset()
                res = _local(lambda: self.nccl_eager_local(s))
                row = allreduce_row("nccl", "all_reduce", "eager", size, self.ctx.all_gather_object(res))
                rows.append(row)
                self._log_ar(row)
                self.reset()
                cap = self.ctx.all_gather_object(_local(lambda: self.nccl_graph_capture(s)))
                if all(c["ok"] for c in cap):
                    res = _local(lambda: self.nccl_graph_replay(s))
                    per_rank = self.ctx.all_gather_object(res)
                else:
                    per_rank = cap
                row = allreduce_row("nccl", "all_reduce", "graph", size, per_rank)
                rows.append(row)
                self._log_ar(row)
            s.clear()
            self.torch.cuda.empty_cache()
        return rows

    def _log_ar(self, row: dict) -> None:
        self.log(f"all-reduce {_size(row['size_bytes'])} {row['impl']} {row['variant']} {row['mode']}: "
                 f"{_fmt(row['per_op_us'])} us  {'ok' if row['verdict'] else 'FAILED: ' + row['detail']}")

    # ------------------------------------------------------------ whole run
    def meta(self, argv: list[str]) -> dict:
        torch = self.torch
        dev = {"name": torch.cuda.get_device_name(self.dev), "sms": self.sms, "torch": torch.__version__,
               "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
        try:
            dev["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:
            dev["nccl"] = None
        try:
            import nvshmem
            dev["nvshmem4py"] = getattr(nvshmem, "__version__", None)
        except Exception:
            dev["nvshmem4py"] = None
        return {"bench": "comm", "command": "python bench/comm.py " + shlex.join(argv), "ranks": self.R,
                "device": dev, "topology": topology(), "settings": self.st.to_json(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def run_rank(st: Settings, argv: list[str]) -> int:
    """One rank: initialise, measure, and on rank 0 print and write the report. Returns 0
    when every verdict holds, else 1."""
    from lowering.triton.dist import init_distributed
    if INTERPRET:
        raise AmkError("bench/comm.py needs CUDA GPUs (Triton is in interpreter mode here)")
    ctx = init_distributed(st.ranks)
    if ctx.world < 2:
        raise AmkError("the communication bench needs at least 2 ranks")
    t0 = time.time()
    bench = CommBench(ctx, st)
    meta = bench.meta(argv) if ctx.rank == 0 else {}
    bench.compile_all()
    sig_rows = bench.run_pingpong() if "pingpong" in st.parts else []
    ar_rows = bench.run_allreduce() if ("allreduce" in st.parts or "nccl" in st.parts) else []
    bench.reset()
    ok = all(r["verdict"] for r in sig_rows + ar_rows)
    if ctx.rank == 0:
        meta["wall_s"] = round(time.time() - t0, 1)
        meta["allreduce_ptx_sync_ops"] = {k: v for k, v in bench.ptx.items() if k.startswith("allreduce:")}
        rep = build_report(meta, sig_rows, ar_rows)
        render(rep)
        if st.json:
            from ground.files import atomic_write_text  # whole file or none; AmkError names it

            atomic_write_text(st.json, json.dumps(rep, indent=1) + "\n")
            print(f"wrote {st.json}")
    ctx.close()
    return 0 if ok else 1


# ====================================================================== CPU compile check
def compile_kernels(arch: int = 90) -> dict[str, str]:
    """Compile every kernel variant for ``sm_<arch>`` without a GPU (Triton + ptxas), for a
    CPU check that the inline PTX assembles. Needs ``TRITON_INTERPRET=0`` at import.
    Returns {variant name: PTX}. Raises AmkError under the interpreter."""
    if INTERPRET:
        raise AmkError("compile_kernels needs TRITON_INTERPRET=0 when bench.comm is imported")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", arch, 32)
    out = {}

    def build(fn, sig: dict, const: dict, warps: int, div16: tuple[str, ...] = ()) -> str:
        full = dict(sig)
        full.update({k: "constexpr" for k in const})
        # The runtime's specialisation: 16-byte aligned pointers, lengths divisible by 16.
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
        src = ASTSource(fn=fn, signature=full, constexprs=const, attrs=attrs)
        return triton.compile(src, target=target, options={"num_warps": warps}).asm["ptx"]

    pp_sig = {"FLAG": "*i32", "DI": "*i64", "STAMPS": "*i64", "ERR": "*i32", "peer": "i32", "role": "i32",
              "n_warm": "i32", "n_iters": "i32", "batch": "i32", "timeout": "i64"}
    for poll in POLLS.values():
        for sig in SIGNALS.values():
            out[f"pingpong:{poll.name}/{sig.name}"] = build(
                _k_pingpong, pp_sig, {"POLL": poll.code, "SIG": sig.code}, poll.num_warps)
    ar_sig = {"X": "*bf16", "Y": "*bf16", "RECV": "*bf16", "CTR": "*i32", "DB": "*i64", "DI": "*i64",
              "EPOCH": "*i64", "ERR": "*i32", "ABORT": "*i32", "me": "i32", "R": "i32", "n": "i32",
              "chunk": "i32", "k_off": "i32", "iters": "i32", "y_off": "i32", "timeout": "i64"}
    for name, (p, s) in AR_PRESETS.items():
        out[f"allreduce:{name}"] = build(_k_allreduce, ar_sig, {"BLOCK": AR_BLOCK, "POLL": POLLS[p].code,
                                                                "SIG": SIGNALS[s].code, "PHASE": 0},
                                         POLLS[p].num_warps,
                                         ("X", "Y", "RECV", "CTR", "DB", "DI", "EPOCH", "ERR", "ABORT", "n", "chunk"))
    bar_sig = {"BAR": "*i32", "DI": "*i64", "ERR": "*i32", "ABORT": "*i32", "me": "i32", "R": "i32",
               "gen": "i32", "timeout": "i64"}
    out["barrier"] = build(_k_barrier, bar_sig, {"POLL": P_ACQ_SYS_ONE, "SIG": S_RED}, 4)
    return out


if __name__ == "__main__":
    sys.exit(main())
