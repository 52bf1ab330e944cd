"""The Triton task table's format: row fields, operand descriptors, variants, and the type of
an op's registry entry (``OpLowering``, lowering/triton/ops/).

table.py builds the table of a ScheduleProgram in this format; the megakernel's VM (vm.py)
and the op families' row decoders (ops/) read it. Nothing about a task is baked into the
kernel code except the *variant* of its op (the op plus its operand dtypes and layout flags),
which selects a branch of the kernel's opcode dispatch.

Table layout (all int64)
------------------------
``rows[T, ROW]``: one row per task, workers' queues concatenated; ``qstart[W + 1]`` (int32)
gives worker w the rows ``qstart[w] .. qstart[w+1]-1`` in queue order.

====================  =====================================================================
row field             meaning
====================  =====================================================================
``F_OP``              variant opcode (index into ``TaskTable.variants``)
``F_NWAIT, F_WAIT0``  number of waits and index of the first in ``waits``
``F_NSIG, F_SIG0``    number of signals and index of the first in ``signals``
``F_P0 .. F_P0+3``    op params (ints as is; floats as their IEEE float32 bit pattern), in
                      the order of the op's ``OpLowering.params``
``F_OPND + 8*k + j``  operand k (ins then outs, IR order; a GEMV's mirror outputs after y,
                      each at y's layout on a peer): j=0 element offset at slot 0,
                      j=1 element offset added per slot (regions affine in ``s``),
                      j=2..4 extents (n0, n1, n2), j=5..7 strides (s0, s1, s2) in elements
``F_FLAGS``           bit 0: the task signals another rank (fence at system scope first);
                      bit 1: a GEMV whose prologue f(x) is already in the worker's scratch
                      (table.staged_x_reuse; read only with ``Blocks.x_stage`` or the ring);
                      bit 2: a GEMV whose W no task of the program writes (FLAG_W_CONST)
``F_W0C .. F_W0B``    copy of the first wait: counter index, N(c), offset * N(c) + threshold
``F_S0C .. F_S0S``    copy of the first signal: counter index, amount, scope
``F_PFO, F_PFN``      the weight tile of a GEMV task as one contiguous byte range for an L2
                      prefetch: offset in int32 elements (16-byte aligned) and length in
                      bytes (a multiple of 16); 0 when the op has none or it is not contiguous
``F_APFO, F_APFN``    the same for the task ``Blocks.prefetch`` places later in this worker's
                      queue (table.prefetch_ahead; filled by the runtime), prefetched at this task
====================  =====================================================================

``waits[NW, 4]``: (counter element index in the i32 view, N(c) = signals per epoch,
epoch offset 0 or -1, threshold). The kernel waits for ``counter - need >= 0`` in wrapping
int32 arithmetic with ``need = (epoch + offset) * N(c) + threshold`` (mod 2^32), so counters
never need resetting and may wrap: correct while a counter is less than 2^31 ahead of or
behind any value a waiter needs, which holds because ranks drift at most a step apart.
Waits with ``threshold <= 0`` are trivially satisfied (ir/program.py) and are dropped.

``signals[NS, 3]``: (counter element index, including the peer delta for a remote counter;
amount; scope: 0 = gpu (own rank's counter), 1 = sys (another rank's counter)).

Operand descriptors
-------------------
Regions are boxes in row-major buffers. Each operand role is read by the ops through one
of three views (the IR's interpretation of operands, lowering/reference.py), listed per op
in its ``OpLowering.views``:

* ``flat``: a vector of numel elements; unit axes are dropped, up to 3 axes remain
  (padded in front with extent 1, stride 0); element i is at
  ``(i // (n1*n2)) * s0 + ((i // n2) % n1) * s1 + (i % n2) * s2``.
* ``matrix``: ``[rows, cols]`` in (n1, n2) / (s1, s2), with n0 = 1. The region's last
  non-unit axis is the columns; the others merge into rows (they must be mergeable). With a
  *split* (``OpLowering.splits``: the column count the op's semantics give, e.g. gemm's K
  for a), the trailing non-unit axes holding that many elements merge into the columns
  instead, so an ``[M, 1]`` or ``[K, 1]`` tile (squeezed to a vector) keeps its one column.
* ``partials``: ``[k, row]`` where a row is ``split`` elements (reduce: numel(y)), k the
  product of the leading non-unit axes, in n0 / s0, and the row a flat vector of up to two
  strided axes in (n1, n2) / (s1, s2): partials ``[k, rows, C]`` of a ``[k, M, C]`` buffer
  are k rows of rows x C elements, contiguous or not.
* ``cache``: ``[G, S, D]`` in (n0, n1, n2): D the last axis, S the one before it (never
  squeezed: a cache of one position is still a cache), G the product of the others.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ground.errors import AmkError
from ir.program import DTYPE_BYTES, Buffer, Region, Task

# ---------------------------------------------------------------- row layout
F_OP = 0
F_NWAIT = 1
F_WAIT0 = 2
F_NSIG = 3
F_SIG0 = 4
F_P0 = 5
N_PARAMS = 4
F_OPND = F_P0 + N_PARAMS
OPND_W = 8
MAX_OPNDS = 8  # rope_attention_kv: q, k, v, kc, vc, pos, inv_freq, o
#: Mirror outputs (ir/ops.py) a GEMV row may carry: norm_gemv with a bias has 5 operands.
MAX_MIRRORS = 3
F_FLAGS = F_OPND + MAX_OPNDS * OPND_W  # bit 0: the task has a system-scope (remote) signal
# The first wait and the first signal are copied into the row (also kept in ``waits`` /
# ``signals``) so the kernel reads them with the row's other header fields in one round of
# independent loads instead of a dependent chain row -> waits[] -> counter.
F_W0C = F_FLAGS + 1  # first wait: counter element index (i32 view); 0 when none
F_W0N = F_FLAGS + 2  # first wait: N(c)
F_W0B = F_FLAGS + 3  # first wait: offset * N(c) + threshold (need = epoch * N + this)
F_S0C = F_FLAGS + 4  # first signal: counter element index (peer delta included)
F_S0A = F_FLAGS + 5  # first signal: amount
F_S0S = F_FLAGS + 6  # first signal: scope
# L2 prefetch of the task's weight tile (GEMV ops whose W tile is one contiguous range):
# int32-element offset of its first 16-byte block and its length in bytes (0: none).
F_PFO = F_FLAGS + 7
F_PFN = F_FLAGS + 8
# The same range of the task ``prefetch`` places later in the worker's queue (prefetch_ahead),
# so the kernel starts that prefetch from fields it loads with the row's header.
F_APFO = F_FLAGS + 9
F_APFN = F_FLAGS + 10
ROW = 88  # F_APFN + 1 = 84 fields, padded to 88 (704 bytes)
assert F_APFN < ROW
FLAG_SYS_SIGNAL = 1
FLAG_X_READY = 2
# The GEMV's weight operand W is in a buffer no task of the program writes (weights): the
# kernel may load it before the task's waits hold (ops/gemv.py t_gemv, Blocks.w_preload).
FLAG_W_CONST = 4

WAIT_W = 4
SIG_W = 3
SCOPE_GPU = 0
SCOPE_SYS = 1


class TableError(AmkError):
    """The program cannot be lowered to the Triton task table (names the task and operand)."""


def f32_bits(x: float) -> int:
    """The IEEE float32 bit pattern of ``x`` as a signed int32 (how float params are stored)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]



# ---------------------------------------------------------------- descriptors
@dataclass(frozen=True)
class Desc:
    """An operand as the kernel sees it: element offsets (const + coef * slot) in the
    operand's dtype, extents (n0, n1, n2) and strides (s0, s1, s2) in elements."""

    off: int
    coef: int
    n: tuple[int, int, int]
    s: tuple[int, int, int]

    @property
    def numel(self) -> int:
        return self.n[0] * self.n[1] * self.n[2]

    def fields(self) -> list[int]:
        return [self.off, self.coef, *self.n, *self.s]


def _strides(shape: Sequence[int]) -> list[int]:
    st, acc = [], 1
    for d in reversed(shape):
        st.append(acc)
        acc *= d
    return st[::-1]


def merge_axes(axes: list[tuple[int, int]], keep_last: int) -> list[tuple[int, int]] | None:
    """Merge adjacent (extent, stride) axes, outermost first, until ``keep_last`` or fewer
    remain; only axes that are contiguous with each other merge. None if impossible."""
    axes = list(axes)
    while len(axes) > keep_last:
        for i in range(len(axes) - 1):
            (n_o, s_o), (n_i, s_i) = axes[i], axes[i + 1]
            if s_o == n_i * s_i:
                axes[i:i + 2] = [(n_o * n_i, s_i)]
                break
        else:
            return None
    return axes


def pad3(axes: list[tuple[int, int]]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((n0, n1, n2), (s0, s1, s2)) of at most three (extent, stride) axes, padded in front
    with extent 1, stride 0."""
    axes = [(1, 0)] * (3 - len(axes)) + axes
    return (axes[0][0], axes[1][0], axes[2][0]), (axes[0][1], axes[1][1], axes[2][1])


def split_axes(axes: list[tuple[int, int]], cols: int) -> int | None:
    """The index j at which the (extent, stride) axes ``axes`` (no extent 1) split into
    leading axes and trailing ones holding ``cols`` elements, or None when no suffix does
    (unique: every extent is > 1)."""
    n = 1
    for j in range(len(axes), -1, -1):
        if n == cols:
            return j
        if j == 0 or n > cols:
            return None
        n *= axes[j - 1][0]
    return None


def describe_region(reg: Region, buf: Buffer, view: str, slots: int, where: str,
                    split: int | None = None) -> Desc:
    """The kernel descriptor of ``reg`` (a region of ``buf``) under ``view`` (``split``: the
    column count of a ``matrix`` or the row length of a ``partials`` view, module doc).

    Offsets are relative to the buffer start, in elements. Raises TableError when a region
    is out of bounds at some slot, changes extent with the slot, is not affine in the slot,
    or cannot be expressed in the view (e.g. a matrix whose rows are not evenly strided).
    """
    if len(reg.ranges) != len(buf.shape):
        raise TableError(f"{where}: region of {buf.name} has {len(reg.ranges)} ranges, "
                         f"buffer has {len(buf.shape)} axes")
    nslots = slots if reg.symbolic else 1
    for s in range(nslots):
        for axis, ((a, z), dim) in enumerate(zip(reg.concrete(s), buf.shape)):
            if not 0 <= a <= z <= dim:
                raise TableError(f"{where}: region {buf.name}[axis {axis}: {a}:{z}] (slot {s}) is "
                                 f"outside the buffer's extent {dim}")
    shape = reg.shape(0)
    if any(d == 0 for d in shape):
        raise TableError(f"{where}: region of {buf.name} is empty (shape {shape})")
    for s in range(1, nslots):
        if reg.shape(s) != shape:
            raise TableError(f"{where}: region of {buf.name} changes extent with the slot "
                             f"({shape} at slot 0, {reg.shape(s)} at slot {s})")
    st = _strides(buf.shape)
    offs = [sum(a * k for (a, _), k in zip(reg.concrete(s), st)) for s in range(nslots)]
    coef = offs[1] - offs[0] if nslots > 1 else 0
    if any(o != offs[0] + coef * s for s, o in enumerate(offs)):
        raise TableError(f"{where}: region of {buf.name} is not affine in the slot")
    axes = list(zip(shape, st))
    if view == "cache":
        if len(axes) < 2:
            raise TableError(f"{where}: cache region of {buf.name} must have a sequence and a "
                             f"head axis, got shape {shape}")
        lead = [a for a in axes[:-2] if a[0] != 1]
        merged = merge_axes(lead, 1) if lead else [(1, 0)]
        if merged is None:
            raise TableError(f"{where}: cache region of {buf.name}: the kv-head axes {shape[:-2]} "
                             "are not evenly strided")
        n, s_ = pad3(merged + axes[-2:])
    elif split is not None and view in ("matrix", "partials"):
        nz = [a for a in axes if a[0] != 1]
        j = split_axes(nz, split)
        if j is None:
            raise TableError(f"{where}: region of {buf.name} with shape {shape} has no trailing axes "
                             f"holding {split} elements (the {'columns' if view == 'matrix' else 'row'} "
                             "the op reads)")
        lead = merge_axes(nz[:j], 1) if j else [(1, 0)]
        tail = merge_axes(nz[j:], 1 if view == "matrix" else 2) if j < len(nz) else [(1, 1)]
        if lead is None or tail is None:
            raise TableError(f"{where}: region of {buf.name} with shape {shape} cannot be viewed as an "
                             f"evenly strided {'[rows, cols]' if view == 'matrix' else '[k, row]'} "
                             f"{'matrix' if view == 'matrix' else 'stack of partial rows'} with "
                             f"{split}-element {'rows' if view == 'matrix' else 'partial rows'}")
        n, s_ = pad3(([(1, 0)] if view == "matrix" else []) + lead + tail)
        if view == "partials" and len(tail) == 1:  # the row's one axis is n2
            n, s_ = (lead[0][0], 1, tail[0][0]), (lead[0][1], 0, tail[0][1])
    elif view == "partials":
        raise TableError(f"{where}: a partials view needs the row length (OpLowering.splits)")
    else:
        nz = [a for a in axes if a[0] != 1]
        if view == "matrix":
            if len(nz) <= 1:
                n, s_ = pad3([(1, 0)] + (nz or [(1, 0)]))
            else:
                rows = merge_axes(nz[:-1], 1)
                if rows is None:
                    raise TableError(f"{where}: region of {buf.name} with shape {shape} cannot be "
                                     "viewed as an evenly strided [rows, cols] matrix")
                n, s_ = pad3([(1, 0)] + rows + nz[-1:])
        else:  # flat
            m = merge_axes(nz, 3) if nz else [(1, 0)]
            if m is None:
                raise TableError(f"{where}: region of {buf.name} with shape {shape} has more than "
                                 "3 non-contiguous axes")
            n, s_ = pad3(m)
    return Desc(offs[0], coef, n, s_)


# ---------------------------------------------------------------- alignment (the variant flags of ops/)
def vec_elems(dtypes: Sequence[str]) -> int:
    """Elements per 16-byte vector of a ``vec`` variant: its widest operand dtype's."""
    return 16 // max(DTYPE_BYTES[d] for d in dtypes)


def starts_aligned(d: Desc, vec: int, slots: int) -> bool:
    """The operand starts on a multiple of ``vec`` elements in every slot."""
    return all((d.off + d.coef * sl) % vec == 0 for sl in range(slots))


def rows_vec_aligned(p: Desc, flat: Sequence[Desc], vec: int, slots: int) -> bool:
    """Partials ``p`` viewed as [KP, n] whose rows are contiguous, n elements long and a
    multiple of ``vec``, at a row stride that is one too and starting aligned in every slot,
    and every operand in ``flat`` flat_aligned: what reduce_norm_gemv's 16-byte row sums
    need (``reduce``'s partials are a ``partials`` view: partials_vec_aligned)."""
    return (p.n[0] == 1 and (p.s[2] == 1 or p.n[2] == 1) and p.n[2] % vec == 0
            and (p.n[1] == 1 or p.s[1] % vec == 0) and starts_aligned(p, vec, slots)
            and all(flat_aligned(d, vec, slots) for d in flat))


def partials_vec_aligned(p: Desc, flat: Sequence[Desc], vec: int, slots: int) -> bool:
    """Partials ``p`` under the ``partials`` view ([k, row] in n0 / s0 and the row in
    (n1, n2)) whose rows are contiguous, a multiple of ``vec`` elements long, at a row
    stride that is one too and starting aligned in every slot, and every operand in ``flat``
    flat_aligned: what ``reduce``'s 16-byte row sums need (its ``vec`` flag)."""
    (k, n1, n2), (s0, s1, s2) = p.n, p.s
    return ((n2 == 1 or s2 == 1) and (n1 == 1 or s1 == n2) and (n1 * n2) % vec == 0
            and (k == 1 or s0 % vec == 0) and starts_aligned(p, vec, slots)
            and all(flat_aligned(d, vec, slots) for d in flat))


def flat_aligned(d: Desc, vec: int, slots: int) -> bool:
    """The region's flat index i addresses element off + i (every axis of extent > 1 at its
    row-major stride), and its extent and every slot's start are multiples of ``vec``
    elements (buffer bases and peer deltas are 16-byte aligned: table.build_layout,
    table.build_table)."""
    (n0, n1, n2), (s0, s1, s2) = d.n, d.s
    flat = (n2 == 1 or s2 == 1) and (n1 == 1 or s1 == n2) and (n0 == 1 or s0 == n1 * n2)
    return flat and d.numel % vec == 0 and starts_aligned(d, vec, slots)


# ---------------------------------------------------------------- variants and registry entries
@dataclass(frozen=True)
class Variant:
    """One branch of the kernel's opcode dispatch: an op with concrete operand dtypes and
    layout flags (``flags`` is a sorted tuple of (name, bool)). Each op family names its
    flags (its ``OpLowering.flags``, lowering/triton/ops/): the GEMV family ``bias``,
    ``mirror``, ``contig``, ``xcontig``, ``aligned``, ``xaligned``, ``scale``, ``gscale`` and
    ``ring``; attention ``kvaligned``, ``partial`` and ``headvec``; ``reduce``
    ``residual`` and ``vec``; ``copy`` / ``put`` ``vec``; ``gemm`` ``residual``, ``acontig``,
    ``bcontig``, ``aaligned`` and ``baligned``.
    """

    op: str
    dtypes: tuple[str, ...]
    flags: tuple[tuple[str, bool], ...] = ()

    def flag(self, name: str) -> bool:
        return dict(self.flags).get(name, False)

    def describe(self) -> str:
        f = ",".join(n for n, on in self.flags if on)
        return f"{self.op}({','.join(self.dtypes)}){'[' + f + ']' if f else ''}"


#: IR dtype names -> the Triton dtypes the generated dispatch passes to the row decoders.
TL_DTYPE = {"bf16": "tl.bfloat16", "f16": "tl.float16", "f32": "tl.float32", "i32": "tl.int32",
            "i8": "tl.int8", "f8e4m3": "tl.float8e4nv"}

#: The arguments every row decoder takes first (locals of the generated kernel): the arena's
#: four typed views, the task's row, the epoch's slot and the worker's error record.
DECODER_ARGS = "A_BF16, A_F16, A_F32, A_I32, row, slot, err"


def tl_dtypes(v: Variant) -> list[str]:
    """The Triton dtype of each operand of ``v`` (generated source)."""
    return [TL_DTYPE[x] for x in v.dtypes]


def plain_call(decoder: str, block: str, extra: tuple[str, ...] = ()):
    """A dispatch-call builder (an OpLowering's ``call``) for a row decoder whose arguments
    are DECODER_ARGS, every operand's dtype in order, ``extra`` and the block constexpr
    ``block``: ``decoder(DECODER_ARGS, d0, d1, ..., *extra, block)``. ``decoder`` may name
    the op as ``{op}`` (``t_{op}``)."""
    def call(v: Variant) -> str:
        return f"{decoder.format(op=v.op)}({', '.join([DECODER_ARGS, *tl_dtypes(v), *extra, block])})"
    return call


@dataclass(frozen=True)
class GemvRoles:
    """The operands of a GEMV-family op (ops/gemv.py), as indices among the task's inputs:
    ``x`` the input vector (reduce_norm_gemv: the partials [P, K]), ``a`` the prologue's
    second vector (the norm weight, or swiglu's up) or None, ``w`` the weight matrix
    W [N, K] (an input after ``w`` is the epilogue's bias or residual), ``k`` the input whose
    length is K (x, or reduce_norm_gemv's residual). ``staged``: the prologue f(x) is
    computed once into the worker's scratch when ``Blocks.x_stage`` is on
    (table.staged_x_reuse); ``always_staged``: also when it is off."""

    x: int
    a: int | None
    w: int
    k: int
    staged: bool = False
    always_staged: bool = False


#: ``OpLowering.flags``: (task, operand dtypes, operand descriptors, slots) -> variant flags.
FlagsFn = Callable[[Task, tuple[str, ...], list[Desc], int], dict[str, bool]]
#: ``OpLowering.check``: (task, operand descriptors, "task ID") -> None, or raises TableError.
CheckFn = Callable[[Task, list[Desc], str], None]
#: ``OpLowering.dims``: (task, operand descriptors) -> block dims the kernel must cover.
DimsFn = Callable[[Task, list[Desc]], dict[str, int]]
#: ``OpLowering.splits``: task -> per operand (ins then outs) the column count of its
#: ``matrix`` view or the row length of its ``partials`` view, None for the default.
SplitsFn = Callable[[Task], Sequence["int | None"]]


@dataclass(frozen=True)
class OpLowering:
    """How the Triton backend runs one IR op: one entry of the op registry
    (lowering/triton/ops/, keyed by ``op``, an op of ir/ops.py's OPS).

    Table encoding (table.build_table):

    * ``views``: the view of each operand role (``flat``, ``matrix`` or ``cache``), the
      op's ins (optional ins included) then its outs; mirror outputs take the first output's.
    * ``params``: the params stored in the row's param fields, in slot order, as
      (name, ``"i"`` for an int or ``"f"`` for a float); ``param_defaults``: the value stored
      for each of them that is an optional param of the op (ir/ops.py) when a task omits it.
    * ``flags``: the variant's layout flags (FlagsFn); None: the op has none. May raise
      TableError for an operand layout the kernel cannot run.
    * ``check``: op-specific agreement of the descriptors with the IR's interpretation
      (lowering/reference.py) beyond ir/ops.py's shape check (CheckFn); None: nothing more.
    * ``in_place``: the input/output overlap the kernel computes correctly: ``""`` none,
      ``"same"`` an output region that IS an input region (element i read before it is
      written, by the same thread), ``"residual"`` (GEMV family) the output may be the
      epilogue's vector, the last input after W.
    * ``dims``: block dims the kernel must cover for the task (DimsFn, e.g. attention's
      ``head_dim`` and GQA ``group``); None: none.
    * ``splits``: per operand, the column count of a ``matrix`` view or the row length of a
      ``partials`` view from the op's semantics (SplitsFn; gemm's K and N, reduce's
      numel(y)); None: the views' defaults (a ``partials`` view needs one).

    Dispatch (codegen.py): ``decoder``, the ``@device`` row decoder of the op in its family
    module, which reads the operands and params from the row and calls the op's device
    function, and ``call``, its call for a variant in the generated dispatch (it may use the
    kernel's constexprs and ``imports``, further names of the decoder's module).

    ``gemv``: the GEMV family's operand roles (GemvRoles), None for other ops. A GEMV's
    decoder runs the row's waits itself (after decoding its operands, so the decode and an
    early weight load overlap the wait); its call takes the VM's wait arguments and returns
    (waits held, status, weight-ring state).
    """

    op: str
    views: tuple[str, ...]
    decoder: Callable
    call: Callable[[Variant], str]
    params: tuple[tuple[str, str], ...] = ()
    param_defaults: dict[str, int | float] = field(default_factory=dict, compare=False)
    flags: FlagsFn | None = None
    check: CheckFn | None = None
    in_place: str = ""
    dims: DimsFn | None = None
    splits: SplitsFn | None = None
    gemv: GemvRoles | None = None
    imports: tuple[str, ...] = ()

    @property
    def decoder_name(self) -> str:
        """The row decoder's name in its module (the generated source imports it)."""
        return getattr(self.decoder, "fn", self.decoder).__name__

    @property
    def module(self) -> str:
        """The module that holds the row decoder (the op family)."""
        return getattr(self.decoder, "fn", self.decoder).__module__

    @property
    def own_waits(self) -> bool:
        """Whether the row decoder runs the row's waits itself (the GEMV family)."""
        return self.gemv is not None


def vec_arg(v: Variant) -> int:
    """Elements per 16-byte vector for a variant with the ``vec`` flag (``reduce``, ``copy``,
    ``put``), else 0: the generic strided path (generated source)."""
    return vec_elems(v.dtypes) if v.flag("vec") else 0
