"""Device-side helpers every op family and the megakernel's VM use (``@device`` functions).

* interpreter or compiler: ``interpreting`` / ``INTERPRET`` and the ``device`` decorator;
* addressing: ``flat_off`` (a flat operand of up to three strided axes, table.py's ``flat``
  view) and ``aligned`` (an alignment fact Triton's analysis keeps);
* rounding: ``store`` (round-to-nearest-even into the pointer's dtype, as torch's ``copy_``),
  ``round_as`` and ``bf16_rtne``;
* inline PTX: ``global_timer``, the L2 prefetches, the system-scope fences and the thread-0
  relaxed reduction (``thread0_asm``).

Operand conventions of every device function (lowering/triton/ops/)
------------------------------------------------------------------
* A *flat* operand (a vector of ``n`` elements) is a typed pointer ``p`` plus
  ``(n1, n2, s0, s1, s2)``: element ``i`` lives at ``p + flat_off(i, n1, n2, s0, s1, s2)``,
  a region of up to three strided axes (table.py's ``flat`` view). A contiguous vector is
  ``(1, n, 0, 0, 1)``.
* A *matrix* operand is ``p`` plus a row stride and a column stride (elements).
* A *cache* operand ``[G, S, D]`` is ``p`` plus three strides (kv head, position, dim).
* Offsets inside one operand are int32 (table.py limits a buffer to 2^31 - 1 elements);
  base pointers carry the 64-bit part.
Block sizes are ``tl.constexpr``; extents are runtime ints, handled with masks and loops, so
one compiled kernel serves every task of a variant.

Every op computes exactly what lowering/reference.py defines for it (the ground truth):
inputs are converted to fp32, the op is computed in fp32, the result is rounded once to the
output dtype. Precision notes (where the GPU differs from the CPU reference by rounding
only): the reference sums in torch's order, the kernels sum in blocks (gemv, rmsnorm,
attention use an online softmax); with ``enable_fp_fusion`` the compiler may contract a*b+c
into an FMA. ``reduce`` sums partials in index order like the reference (bit-exact in fp32
when no FMA is involved). RoPE's cos/sin use libdevice on the GPU (accurate for large angles,
unlike the approximate ``cos.approx`` path) and numpy under the interpreter.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: The int32 written by argmax_combine for a NaN / non-integer index (reference.INT_POISON).
INT_POISON = tl.constexpr(-(2**31))


def interpreting() -> bool:
    """Whether Triton runs under the CPU interpreter (``TRITON_INTERPRET=1``). Decided when
    the jit functions are created (at import), like Triton's own choice of interpreter."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: Compile-time flag: True under the interpreter (no inline PTX, no libdevice; bf16 rounding
#: done by hand because the interpreter truncates f32 -> bf16 instead of rounding).
INTERPRET = tl.constexpr(interpreting())


def device(fn):
    """Decorator of the device functions (everything a kernel calls): ``triton.jit``, or
    under the interpreter the plain Python function. The interpreter re-patches
    ``triton.language`` on every call of a jit function (about 1 ms), which made an
    interpreted megakernel step several times slower; the calling kernel's patch already
    covers the helpers, so the semantics are the same."""
    return fn if interpreting() else triton.jit(fn)


# ---------------------------------------------------------------- addressing
@device
def aligned(v, A: tl.constexpr):
    """``v`` (a non-negative integer scalar that the caller knows is a multiple of ``A``)
    with that fact visible to Triton's alignment analysis, so loads through it can be
    16-byte vectors. The value is restated as ``(v // A) * A`` as well as hinted with
    ``tl.multiple_of``: on Triton 3.6 (the GPU machines' version) a bare ``multiple_of`` on
    an offset loaded from the task table is lost, and the megakernel's GEMV weights were
    loaded 2 bytes at a time (SASS: LDG.E.U16 only). The arithmetic costs a few integer
    instructions per task."""
    return tl.multiple_of((v // A) * A, A)


@device
def flat_off(i, n1, n2, s0, s1, s2):
    """Element offset of flat index ``i`` (any int tensor) in a region of up to 3 strided
    axes with extents (n0, n1, n2) and strides (s0, s1, s2); n0 is implied."""
    q = i // n2
    return (q // n1) * s0 + (q % n1) * s1 + (i % n2) * s2


# ---------------------------------------------------------------- rounding
@device
def bf16_rtne(v):
    """fp32 -> bf16 with round-to-nearest-even done on the bits (NaN stays a quiet NaN).
    Only used under the interpreter, whose own f32 -> bf16 cast truncates."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(v != v, (b >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@device
def store(ptr, val, mask):
    """``tl.store(ptr, val converted to ptr's dtype, mask)`` with round-to-nearest-even, the
    rounding of torch's ``copy_`` (reference.py) on the GPU and under the interpreter."""
    if INTERPRET:
        if ptr.dtype.element_ty == tl.bfloat16:
            if val.dtype != tl.bfloat16:
                val = bf16_rtne(val.to(tl.float32))
    tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)


@device
def store_mirrored(ptr, val, mask, m1, m2, m3, MIRRORS: tl.constexpr):
    """``store(ptr, val, mask)``, and the same at ``ptr + m1`` (``m2``, ``m3``) for MIRRORS
    (0..3) mirror outputs: element deltas to the peer copies of a GEMV's y (the fused
    all-reduce's stores)."""
    store(ptr, val, mask)
    if MIRRORS > 0:
        store(ptr + m1, val, mask)
    if MIRRORS > 1:
        store(ptr + m2, val, mask)
    if MIRRORS > 2:
        store(ptr + m3, val, mask)


@device
def round_as(v, DT: tl.constexpr):
    """fp32 ``v`` rounded (nearest even) to dtype DT and widened back to fp32: the value an
    unfused schedule would have stored in a DT buffer and read again (fused prologues)."""
    if DT == tl.float32:
        r = v
    elif INTERPRET and DT == tl.bfloat16:
        r = bf16_rtne(v).to(tl.float32)
    else:
        r = v.to(DT).to(tl.float32)
    return r


@device
def dot_acc(av, bv, acc):
    """``acc + av @ bv`` in fp32 (tl.dot; blocks of at least 16 x 16): bf16 / f16 blocks of
    one dtype on the tensor cores, anything else (f32, mixed dtypes) converted to fp32 and
    multiplied exactly (no TF32). Under the interpreter always in fp32 (its dot of bf16
    blocks multiplies their raw bits; the products of bf16 / f16 values are exact in fp32
    either way)."""
    if INTERPRET:
        acc = tl.dot(av.to(tl.float32), bv.to(tl.float32), acc, input_precision="ieee")
    elif av.dtype == bv.dtype and av.dtype != tl.float32:
        acc = tl.dot(av, bv, acc)
    else:
        acc = tl.dot(av.to(tl.float32), bv.to(tl.float32), acc, input_precision="ieee")
    return acc


# ---------------------------------------------------------------- inline PTX
@device
def global_timer():
    """%globaltimer in ns (GPU only): the megakernel's watchdog and profiling stamps."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@device
def l2_prefetch_bytes(p, n):
    """Start an L2 prefetch of the ``n`` bytes at ``p`` (both multiples of 16; nothing when
    n <= 0): one ``cp.async.bulk.prefetch.L2.global`` (sm_90, PTX ISA
    "cp.async.bulk.prefetch") issued by thread 0, with an L2 evict-first cache policy (its
    callers prefetch weights, read once a step: ops/gemv.py ``_wload``). A hint with no
    effect on memory contents. A no-op under the interpreter."""
    if not INTERPRET:
        if n > 0:
            tl.inline_asm_elementwise(
                "{ .reg .pred %pf_p; .reg .u32 %pf_t; .reg .b64 %pf_c; mov.u32 %pf_t, %tid.x; setp.eq.u32 %pf_p, %pf_t, 0; "
                "createpolicy.fractional.L2::evict_first.b64 %pf_c, 1.0; "
                "@%pf_p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, %pf_c; mov.u32 $0, 0; }",
                "=r,l,r", [p, n.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@device
def system_fence():
    """``fence.acq_rel.sys``: orders this thread's earlier memory operations (including stores
    to peer GPUs) before its later ones at system scope. Used for ``quiet`` and ``fence``
    (nvshmem_quiet / nvshmem_fence for peer-pointer puts; stronger than fence needs). A
    no-op under the interpreter, which runs one program at a time."""
    if not INTERPRET:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


def thread0_asm(body: str) -> str:
    """PTX running ``body`` (instructions predicated with ``@%amk_q``) on thread 0 only, with a
    dummy int32 output ``$0``: Triton runs a scalar inline asm in every thread, so a
    read-modify-write must be predicated or it would be applied once per thread."""
    return ("{\n.reg .pred %amk_q;\n.reg .u32 %amk_t;\nmov.u32 %amk_t, %tid.x;\n"
            "setp.eq.u32 %amk_q, %amk_t, 0;\n" + body + "mov.u32 $0, 0;\n}")


_ASM_FENCE_SYS_ONE = tl.constexpr(thread0_asm("@%amk_q fence.acq_rel.sys;\n"))

_ASM_RED_RELAXED_SYS_ONE = tl.constexpr(thread0_asm("@%amk_q red.relaxed.sys.global.add.s32 [$1], $2;\n"))


@device
def system_fence_one():
    """``fence.acq_rel.sys`` on thread 0 only. After a CTA barrier it orders the whole CTA's
    earlier stores (peer stores included) before thread 0's later operations at system scope,
    the way NVSHMEM's block-scoped put-with-signal fences once per block. A no-op under the
    interpreter."""
    if not INTERPRET:
        tl.inline_asm_elementwise(_ASM_FENCE_SYS_ONE, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@device
def red_relaxed_sys_one(ptr, amount):
    """``*ptr += amount`` as ``red.relaxed.sys`` on thread 0 only: after system_fence_one on the
    same thread it is a release at system scope (PTX memory model: a fence followed by a strong
    write is a release pattern), and several such signals do not wait for one another as
    successive ``red.release.sys`` do (each release orders itself after the earlier remote
    reduction). Interpreter: a plain atomic add."""
    if INTERPRET:
        tl.atomic_add(ptr, amount)
    else:
        tl.inline_asm_elementwise(_ASM_RED_RELAXED_SYS_ONE, "=r,l,r", [ptr, amount], dtype=tl.int32,
                                  is_pure=False, pack=1)
