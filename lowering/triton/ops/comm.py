"""The communication family: ``copy`` and ``put`` (one device function: a put's destination
offset already includes the peer's arena delta, so the put is a plain store to a peer's
memory over NVLink), ``quiet`` and ``fence`` (a system-scope fence), ``nop`` (no data; the
VM runs its waits and signals).
"""

from __future__ import annotations

import triton.language as tl

from lowering.triton import layout as L
from lowering.triton.lang import aligned, device, flat_off, store, system_fence
from lowering.triton.layout import DECODER_ARGS, OpLowering, Variant, tl_dtypes, vec_arg
from lowering.triton.vm import arena_ptr, operand, status_ok


@device
def copy(x, x_n1, x_n2, x_s0, x_s1, x_s2, y, y_n1, y_n2, y_s0, y_s1, y_s2, n, BLOCK: tl.constexpr,
         VEC: tl.constexpr = 0):
    """y = x converted to y's dtype (round to nearest even). Also the body of ``put``: the
    destination pointer may address a peer's memory. ``VEC`` > 0 (table flag ``vec``): both
    regions are contiguous, start on a multiple of ``VEC`` elements and ``n`` is one too, so
    the accesses are 16-byte vectors (the caller aligned the pointers). The generic strided
    path moves 2 bytes per access (an 8 KB put to a peer took 8 us)."""
    if VEC > 0:
        n = aligned(n, VEC)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        if VEC > 0:  # plain i, so Triton's analysis sees the contiguity
            xi = i
            yi = i
        else:
            xi = flat_off(i, x_n1, x_n2, x_s0, x_s1, x_s2)
            yi = flat_off(i, y_n1, y_n2, y_s0, y_s1, y_s2)
        store(y + yi, tl.load(x + xi, mask=m, other=0), m)


# ---------------------------------------------------------------- row decoders
@device
def t_copy(A_BF16, A_F16, A_F32, A_I32, row, slot, err, DX: tl.constexpr, DY: tl.constexpr,
           BLOCK: tl.constexpr, VEC: tl.constexpr = 0):
    """copy and put (a put's destination offset already includes the peer's arena delta)."""
    xo, xn0, xn1, xn2, xs0, xs1, xs2 = operand(row, 0, slot)
    yo, yn0, yn1, yn2, ys0, ys1, ys2 = operand(row, 1, slot)
    if VEC > 0:
        xo = aligned(xo, VEC)
        yo = aligned(yo, VEC)
    copy(arena_ptr(A_BF16, A_F16, A_F32, A_I32, DX) + xo, xn1, xn2, xs0, xs1, xs2,
         arena_ptr(A_BF16, A_F16, A_F32, A_I32, DY) + yo, yn1, yn2, ys0, ys1, ys2, yn0 * yn1 * yn2, BLOCK, VEC)
    return status_ok()


@device
def t_fence():
    """quiet and fence: a system-scope fence in every thread (peer stores are plain stores,
    so ordering them is all nvshmem_quiet / nvshmem_fence mean here)."""
    system_fence()
    return status_ok()


@device
def t_nop():
    """nop: no data (the VM runs the row's waits and signals)."""
    return status_ok()


# ---------------------------------------------------------------- table encoding and dispatch
def _call_copy(v: Variant) -> str:
    d = tl_dtypes(v)
    return f"t_copy({DECODER_ARGS}, {d[0]}, {d[1]}, BLOCK, {vec_arg(v)})"


def _call_fence(v: Variant) -> str:
    return "t_fence()"


def _call_nop(v: Variant) -> str:
    return "t_nop()"


def _flags_copy(task, dtypes, descs, slots) -> dict[str, bool]:
    """``vec``: both regions are flat and 16-byte aligned in every slot (16-byte loads and
    stores)."""
    return {"vec": all(L.flat_aligned(d, L.vec_elems(dtypes), slots) for d in descs)}


LOWERINGS = (
    OpLowering("copy", ("flat", "flat"), t_copy, _call_copy, flags=_flags_copy, in_place="same"),
    OpLowering("put", ("flat", "flat"), t_copy, _call_copy, flags=_flags_copy, in_place="same"),
    OpLowering("quiet", (), t_fence, _call_fence),
    OpLowering("fence", (), t_fence, _call_fence),
    OpLowering("nop", (), t_nop, _call_nop),
)
