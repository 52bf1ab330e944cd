"""ScheduleProgram -> device task table for the persistent Triton megakernel (host side).

The megakernel (lowering/triton/megakernel.py) reads everything it needs from a few int64
arrays built here once per compile; nothing about a task is baked into the kernel code
except the *variant* of its op (the op plus its operand dtypes and layout flags), which
selects a branch of the kernel's opcode dispatch.

Memory model: one *arena* per rank
----------------------------------
Every buffer a rank holds (its local buffers and its copy of every symmetric buffer) and
every counter live in one byte arena per rank (a torch uint8 tensor; on a multi-GPU run an
NVSHMEM symmetric allocation). Layout (``ArenaLayout``): the int32 counters first (one slot
per counter of the program, so the layout is the same on every rank), then the symmetric
buffers in program order, then the rank's local buffers; every buffer starts on a
``ALIGN``-byte boundary. Symmetric buffers therefore sit at the same offset on every rank,
as on an NVSHMEM symmetric heap. The kernel gets the arena as four typed pointers
(bf16, f16, f32, i32 views of the same bytes) and every operand is an *element offset* in
its own dtype, so no pointer casts are needed and Triton keeps the 16-byte divisibility of
the base pointers for vectorised loads.

Remote operands (a put's destination on another rank, a signal to another rank's counter)
resolve to the peer's arena through ``peer_delta[r]``: the byte distance from this rank's
arena base to rank r's arena base (a peer pointer minus the own pointer). With R = 1 there
are none. The delta must be a multiple of 16 bytes.

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
``F_P0 .. F_P0+3``    op params (ints as is; floats as their IEEE float32 bit pattern)
``F_OPND + 8*k + j``  operand k (ins then outs, IR order; a GEMV's mirror outputs after y,
                      each at y's layout on a peer): j=0 element offset at slot 0,
                      j=1 element offset added per slot (regions affine in ``s``),
                      j=2..4 extents (n0, n1, n2), j=5..7 strides (s0, s1, s2) in elements
``F_FLAGS``           bit 0: the task signals another rank (fence at system scope first);
                      bit 1: a norm_gemv / swiglu_gemv whose prologue f(x) is already in the
                      worker's scratch (staged_x_reuse; read only with ``Blocks.x_stage``);
                      bit 2: a GEMV whose W no task of the program writes (FLAG_W_CONST)
``F_W0C .. F_W0B``    copy of the first wait: counter index, N(c), offset * N(c) + threshold
``F_S0C .. F_S0S``    copy of the first signal: counter index, amount, scope
``F_PFO, F_PFN``      the weight tile of a GEMV task as one contiguous byte range for an L2
                      prefetch: offset in int32 elements (16-byte aligned) and length in
                      bytes (a multiple of 16); 0 when the op has none or it is not contiguous
``F_APFO, F_APFN``    the same for the task ``Blocks.prefetch`` places later in this worker's
                      queue (prefetch_ahead; filled by the runtime), prefetched at this task
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
of three views (the IR's interpretation of operands, lowering/reference.py):

* ``flat``: a vector of numel elements; unit axes are dropped, up to 3 axes remain
  (padded in front with extent 1, stride 0); element i is at
  ``(i // (n1*n2)) * s0 + ((i // n2) % n1) * s1 + (i % n2) * s2``.
* ``matrix``: ``[rows, cols]`` in (n1, n2) / (s1, s2), with n0 = 1. The region's last
  non-unit axis is the columns; the others merge into rows (they must be mergeable).
* ``cache``: ``[G, S, D]`` in (n0, n1, n2): D the last axis, S the one before it (never
  squeezed: a cache of one position is still a cache), G the product of the others.

Everything the kernel relies on for memory safety is checked here, always, also for
programs run without validation (``--unsafe``): regions in bounds for every slot, operand
counts and dtypes, shape rules of ir/ops.py, extents and offsets that fit int32 within a
buffer, and input/output aliasing the kernels cannot compute correctly (``IN_PLACE_OPS``).
A bad schedule may deadlock (the watchdog reports it) or race, but never makes the
kernel touch memory outside the arena.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ground.errors import AmkError
from ir.ops import OPS, squeeze
from ir.program import DTYPE_BYTES, Buffer, Region, ScheduleProgram, Task

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
# kernel may load it before the task's waits hold (megakernel.t_gemv, Blocks.w_preload).
FLAG_W_CONST = 4

WAIT_W = 4
SIG_W = 3
SCOPE_GPU = 0
SCOPE_SYS = 1

#: Byte alignment of every buffer in the arena (>= 16 for vector loads; 256 like cudaMalloc).
ALIGN = 256

#: Largest element count of one buffer: intra-buffer offsets are int32 in the kernel.
MAX_BUFFER_ELEMS = 2**31 - 1

#: How the ops view each operand role (ins then outs, IR order; optional ins included).
ROLE_VIEWS: dict[str, tuple[str, ...]] = {
    "embed": ("matrix", "flat", "flat"),
    "rmsnorm": ("flat", "flat", "flat"),
    "gemv": ("flat", "matrix", "flat", "flat"),  # x, W, [bias], y
    "norm_gemv": ("flat", "flat", "matrix", "flat", "flat"),  # x, norm_w, W, [bias], y
    "gemv_res": ("flat", "matrix", "flat", "flat"),  # x, W, r, y
    "swiglu_gemv": ("flat", "flat", "matrix", "flat", "flat"),  # g, u, W, [r], y
    "reduce_norm_gemv": ("matrix", "flat", "flat", "matrix", "flat", "flat"),  # P, r, norm_w, W, [bias], y
    "rope_append": ("flat", "flat", "flat", "flat", "cache", "cache"),
    "rope_attention": ("flat", "cache", "cache", "flat", "flat", "flat"),
    "rope_attention_kv": ("flat", "flat", "flat", "cache", "cache", "flat", "flat", "flat"),
    "rope": ("flat", "flat", "flat", "flat"),
    "kv_append": ("flat", "flat", "flat", "cache", "cache"),
    "attention": ("flat", "cache", "cache", "flat", "flat"),
    "silu_mul": ("flat", "flat", "flat"),
    "add": ("flat", "flat", "flat"),
    "reduce": ("matrix", "flat", "flat"),  # partials, [residual], y
    "argmax": ("flat", "flat"),
    "argmax_combine": ("matrix", "flat"),
    "copy": ("flat", "flat"),
    "put": ("flat", "flat"),
    "quiet": (),
    "fence": (),
    "nop": (),
}

#: Params each op needs in the row, in slot order: (name, "i" | "f").
PARAM_SLOTS: dict[str, tuple[tuple[str, str], ...]] = {
    "rmsnorm": (("dim", "i"), ("eps", "f")),
    "rope": (("head_dim", "i"),),
    "kv_append": (("head_dim", "i"),),
    "attention": (("head_dim", "i"), ("scale", "f")),
    "argmax": (("offset", "i"),),
    "norm_gemv": (("eps", "f"),),
    "reduce_norm_gemv": (("eps", "f"),),
    "rope_append": (("head_dim", "i"),),
    "rope_attention": (("head_dim", "i"), ("scale", "f")),
    "rope_attention_kv": (("head_dim", "i"), ("scale", "f")),
}

#: The GEMV family: op -> (operand index of x, of the prologue's second vector or None,
#: of W); the optional / residual operand after W is the epilogue's added vector.
#: reduce_norm_gemv's x is its partials [P, K]; its residual (the prologue's) is operand 1.
GEMV_OPS: dict[str, tuple[int, int | None, int]] = {
    "gemv": (0, None, 1),
    "norm_gemv": (0, 1, 2),
    "gemv_res": (0, None, 1),
    "swiglu_gemv": (0, 1, 2),
    "reduce_norm_gemv": (0, 2, 3),
}


class TableError(AmkError):
    """The program cannot be lowered to the Triton task table (names the task and operand)."""


def f32_bits(x: float) -> int:
    """The IEEE float32 bit pattern of ``x`` as a signed int32 (how float params are stored)."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]


def _views_for(task: Task) -> tuple[str, ...]:
    """Operand views for a task, accounting for optional ins (gemv bias, reduce residual)
    and mirror outputs (viewed as the first output): ``ROLE_VIEWS`` lists every role,
    optional ins included."""
    v = ROLE_VIEWS[task.op]
    spec = OPS[task.op]
    assert len(v) == spec.max_ins + len(spec.outs), task.op
    outs = v[spec.max_ins:]
    return v[:len(task.ins)] + outs + outs[:1] * (len(task.outs) - len(outs))


# ---------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One branch of the kernel's opcode dispatch: an op with concrete operand dtypes and
    layout flags (``flags`` is a sorted tuple of (name, bool)).

    gemv flags: ``bias`` (has a bias operand), ``mirror`` (y is also stored to the mirror
    outputs that follow it, gemv_mirrors), ``contig`` (weight columns have stride 1),
    ``xcontig`` (x is one strided axis), ``aligned`` (every weight row starts on a 16-byte
    boundary for every slot and K is a multiple of 16 bytes, so the kernel may promise it to
    the compiler for wide loads), ``xaligned`` (also x, and a when present, have unit stride
    and a 16-byte-aligned start for every slot: x is read with wide loads and no stride
    arithmetic), ``ring`` (W streams through the worker's weight ring: ring_eligible).
    reduce: ``residual``.
    """

    op: str
    dtypes: tuple[str, ...]
    flags: tuple[tuple[str, bool], ...] = ()

    def flag(self, name: str) -> bool:
        return dict(self.flags).get(name, False)

    def describe(self) -> str:
        f = ",".join(n for n, on in self.flags if on)
        return f"{self.op}({','.join(self.dtypes)}){'[' + f + ']' if f else ''}"


# ---------------------------------------------------------------- arena layout
@dataclass
class ArenaLayout:
    """Byte layout of one rank's arena (see the module docstring).

    ``offsets[buffer]``: byte offset of the buffer; ``counter_index[name]``: int32 slot of the
    counter; ``nbytes``: total size (a multiple of ``ALIGN``).
    """

    rank: int
    offsets: dict[str, int] = field(default_factory=dict)
    counter_index: dict[str, int] = field(default_factory=dict)
    counters_offset: int = 0
    nbytes: int = 0


def build_layout(program: ScheduleProgram, rank: int) -> ArenaLayout:
    """Place the counters and the buffers ``rank`` holds in its arena.

    Raises TableError for a buffer too large for int32 element offsets or an unknown dtype.
    """
    lay = ArenaLayout(rank=rank)
    for i, c in enumerate(program.counters):
        lay.counter_index[c.name] = i
    off = _round_up(4 * max(1, len(program.counters)), ALIGN)
    sym = [b for b in program.buffers if b.placement == "symmetric"]
    loc = [b for b in program.buffers if b.placement != "symmetric" and b.rank == rank]
    for b in sym + loc:
        if b.dtype not in DTYPE_BYTES:
            raise TableError(f"buffer {b.name}: dtype {b.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        if b.numel > MAX_BUFFER_ELEMS:
            raise TableError(f"buffer {b.name}: {b.numel} elements exceed the Triton backend's "
                             f"limit of {MAX_BUFFER_ELEMS} per buffer (int32 offsets)")
        lay.offsets[b.name] = off
        off = _round_up(off + max(b.nbytes, 1), ALIGN)
    lay.nbytes = off
    return lay


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


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


def _merge(axes: list[tuple[int, int]], keep_last: int) -> list[tuple[int, int]] | None:
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


def _pad3(axes: list[tuple[int, int]]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    axes = [(1, 0)] * (3 - len(axes)) + axes
    return (axes[0][0], axes[1][0], axes[2][0]), (axes[0][1], axes[1][1], axes[2][1])


def describe_region(reg: Region, buf: Buffer, view: str, slots: int, where: str) -> Desc:
    """The kernel descriptor of ``reg`` (a region of ``buf``) under ``view``.

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
        merged = _merge(lead, 1) if lead else [(1, 0)]
        if merged is None:
            raise TableError(f"{where}: cache region of {buf.name}: the kv-head axes {shape[:-2]} "
                             "are not evenly strided")
        n, s_ = _pad3(merged + axes[-2:])
    else:
        nz = [a for a in axes if a[0] != 1]
        if view == "matrix":
            if len(nz) <= 1:
                n, s_ = _pad3([(1, 0)] + (nz or [(1, 0)]))
            else:
                rows = _merge(nz[:-1], 1)
                if rows is None:
                    raise TableError(f"{where}: region of {buf.name} with shape {shape} cannot be "
                                     "viewed as an evenly strided [rows, cols] matrix")
                n, s_ = _pad3([(1, 0)] + rows + nz[-1:])
        else:  # flat
            m = _merge(nz, 3) if nz else [(1, 0)]
            if m is None:
                raise TableError(f"{where}: region of {buf.name} with shape {shape} has more than "
                                 "3 non-contiguous axes")
            n, s_ = _pad3(m)
    return Desc(offs[0], coef, n, s_)


# ---------------------------------------------------------------- the table
@dataclass
class TaskTable:
    """The device task table of one rank (numpy arrays; the runtime moves them to the device).

    ``order[w]`` lists the tasks of worker w in queue order (the rows, concatenated);
    ``variants[op]`` is the dispatch branch of opcode ``op``; ``task_ids[row]`` and
    ``wait_counters[i]`` map rows and wait entries back to names for error messages.
    """

    rank: int
    workers: int
    rows: np.ndarray
    qstart: np.ndarray
    waits: np.ndarray
    signals: np.ndarray
    variants: list[Variant]
    task_ids: list[str]
    task_ops: list[str]
    wait_counters: list[str]
    layout: ArenaLayout
    order: list[list[Task]]
    dims: dict[str, int] = field(default_factory=dict)
    task_ranks: list[int] = field(default_factory=list)

    @property
    def n_tasks(self) -> int:
        return len(self.task_ids)


def _check_task(task: Task, program: ScheduleProgram, bufs: dict[str, Buffer], rank: int,
                peer_delta: Mapping[int, int]) -> None:
    where = f"task {task.id}"
    spec = OPS.get(task.op)
    if spec is None:
        raise TableError(f"{where}: unknown op {task.op!r}")
    if "triton" not in spec.backends:
        raise TableError(f"{where}: op {task.op} is not implemented by the triton backend")
    if not spec.min_ins <= len(task.ins) <= spec.max_ins:
        raise TableError(f"{where}: {task.op} takes {spec.min_ins}..{spec.max_ins} inputs, "
                         f"got {len(task.ins)}")
    if not spec.min_outs <= len(task.outs) <= spec.max_outs:
        raise TableError(f"{where}: {task.op} takes {spec.arity_text()}, got {len(task.outs)} outputs")
    mirrors = len(task.outs) - len(spec.outs)
    if mirrors > MAX_MIRRORS:
        raise TableError(f"{where}: {mirrors} mirror outputs; the triton GEMV stores at most "
                         f"{MAX_MIRRORS} (one-shot all-reduce fused into the GEMV over at most "
                         f"{MAX_MIRRORS + 1} ranks)")
    if len(task.ins) + len(task.outs) > MAX_OPNDS:
        raise TableError(f"{where}: {len(task.ins) + len(task.outs)} operands; a task row holds "
                         f"at most {MAX_OPNDS}")
    # a mirror is y's region (same buffer and ranges, so the same descriptor but for the
    # peer delta): the kernel stores it at y's offsets plus one element delta
    y = task.outs[0] if task.outs else None
    for k, m in enumerate(task.outs[len(spec.outs):], 1):
        if m.buffer != y.buffer or m.ranges != y.ranges or m.rank == y.rank:
            raise TableError(f"{where}: mirror output {k} must be the first output's region "
                             f"({y.buffer} on rank {y.rank}) on another rank, got {m.buffer} "
                             f"on rank {m.rank}")
    for i, reg in enumerate(task.ins):
        b = bufs.get(reg.buffer)
        if b is None:
            raise TableError(f"{where}: input {i} names unknown buffer {reg.buffer!r}")
        if reg.rank != rank:
            raise TableError(f"{where}: reads {reg.buffer} on rank {reg.rank}; a task reads only "
                             "its own rank's memory")
        if b.placement != "symmetric" and b.rank != rank:
            raise TableError(f"{where}: reads local buffer {b.name} of rank {b.rank}")
        if b.dtype not in spec.dtypes_for_in(i):
            raise TableError(f"{where}: input {i} ({b.name}) is {b.dtype}; {task.op} "
                             f"accepts {spec.dtypes_for_in(i)}")
    for i, reg in enumerate(task.outs):
        b = bufs.get(reg.buffer)
        if b is None:
            raise TableError(f"{where}: output {i} names unknown buffer {reg.buffer!r}")
        if b.placement != "symmetric":
            if reg.rank != b.rank or b.rank != rank:
                raise TableError(f"{where}: writes local buffer {b.name} of rank {b.rank} "
                                 f"(region rank {reg.rank}) from rank {rank}")
        elif reg.rank != rank and reg.rank not in peer_delta:
            raise TableError(f"{where}: writes {b.name} on rank {reg.rank}, but no peer pointer "
                             f"for rank {reg.rank} is known (build the table with peer_delta for every peer)")
        if b.dtype not in spec.dtypes_for_out(i):
            raise TableError(f"{where}: output {i} ({b.name}) is {b.dtype}; {task.op} "
                             f"produces {spec.dtypes_for_out(i)}")
    for name, kind in PARAM_SLOTS.get(task.op, ()):
        v = task.params.get(name)
        ok = isinstance(v, int) and not isinstance(v, bool) if kind == "i" else \
            isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            raise TableError(f"{where}: param {name} must be {'an int' if kind == 'i' else 'a number'}, "
                             f"got {v!r}")
    if spec.check is not None:
        ins = [squeeze(r.shape()) for r in task.ins]
        outs = [squeeze(r.shape()) for r in task.outs]
        problems = spec.check(ins, [bufs[r.buffer].dtype for r in task.ins], outs,
                              [bufs[r.buffer].dtype for r in task.outs], task.params)
        if problems:
            raise TableError(f"{where}: {problems[0]}")


#: Ops whose kernels are safe when an output region IS an input region (element i is read
#: before it is written, by the same thread); any other overlap is refused.
IN_PLACE_OPS = frozenset({"rmsnorm", "rope", "silu_mul", "add", "reduce", "copy", "put"})

#: GEMV ops whose output may BE their epilogue vector (the residual r, last input): the
#: epilogue reads r[i] and writes y[i] in the same thread, after the whole of x and W.
RESIDUAL_IN_PLACE_OPS = frozenset({"gemv_res", "swiglu_gemv"})


def _boxes_overlap(a: Region, b: Region, slot: int) -> bool:
    if a.buffer != b.buffer or a.rank != b.rank:
        return False
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a.concrete(slot), b.concrete(slot)))


def _check_alias(task: Task, slots: int) -> None:
    """Refuse input/output overlaps the kernels do not handle. reference.py computes a whole
    result before writing, so any aliasing is legal in the IR; the GPU kernels write while
    they still read (gemv row blocks, attention heads, shifted elementwise blocks)."""
    for o in task.outs:
        for i in task.ins:
            for s in range(slots if (o.symbolic or i.symbolic) else 1):
                if not _boxes_overlap(o, i, s):
                    continue
                if task.op in IN_PLACE_OPS and o.concrete(s) == i.concrete(s):
                    continue
                if (task.op in RESIDUAL_IN_PLACE_OPS and i is task.ins[-1]
                        and len(task.ins) > GEMV_OPS[task.op][2] + 1 and o.concrete(s) == i.concrete(s)):
                    continue
                raise TableError(f"task {task.id}: output {o.buffer}{list(o.concrete(s))} overlaps input "
                                 f"{i.buffer}{list(i.concrete(s))} (slot {s}); the triton {task.op} kernel "
                                 "supports only " + ("identical in-place regions" if task.op in IN_PLACE_OPS
                                                     else "disjoint inputs and outputs"))


def _check_descs(task: Task, descs: list[Desc]) -> None:
    """Op-specific agreement between descriptors and the IR's interpretation
    (lowering/reference.py), beyond ir/ops.py's squeezed-shape checks."""
    where = f"task {task.id}"
    op = task.op
    if op in GEMV_OPS:
        xi, ai, wi = GEMV_OPS[op]
        yi = len(task.ins)
        x, w, y = descs[xi], descs[wi], descs[yi]
        k = descs[1].numel if op == "reduce_norm_gemv" else x.numel  # K: the residual's length
        if w.n[1] != y.numel or w.n[2] != k:
            raise TableError(f"{where}: weight region viewed as [{w.n[1]}, {w.n[2]}] does not match "
                             f"[N={y.numel}, K={k}]")
        if op == "reduce_norm_gemv" and x.n[2] != k:
            raise TableError(f"{where}: partials viewed as [{x.n[1]}, {x.n[2]}] do not match K={k}")
    elif op == "embed":
        tab, y = descs[0], descs[-1]
        if tab.n[2] != y.numel:
            raise TableError(f"{where}: table rows hold {tab.n[2]} elements, output {y.numel}")
    elif op == "reduce":
        p, y = descs[0], descs[-1]
        if p.n[2] != y.numel:
            raise TableError(f"{where}: partials viewed as [{p.n[1]}, {p.n[2]}] do not match N={y.numel}")
    elif op == "argmax_combine":
        if descs[0].n[2] != 2:
            raise TableError(f"{where}: pairs viewed as [{descs[0].n[1]}, {descs[0].n[2]}], not [k, 2]")
    elif op in ("kv_append", "attention", "rope_append", "rope_attention", "rope_attention_kv"):
        hd = int(task.params["head_dim"])
        ci = OPS[op].operand_index("kc", len(task.ins))  # the V cache follows
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


def _prefetch_range(w: Desc, row: list[int], k: int, esize: int, layout: ArenaLayout,
                    buf: Buffer) -> tuple[int, int]:
    """(int32-element offset, bytes) of a GEMV weight tile as one contiguous range for the
    kernel's L2 prefetch, widened to 16-byte blocks but kept inside the buffer's
    ``ALIGN``-padded slot (so the prefetch never touches memory outside the arena); (0, 0)
    when the tile is not contiguous (strided rows or columns) or depends on the slot."""
    if w.coef or w.n[0] != 1 or not (w.s[2] == 1 or w.n[2] == 1) or not (w.n[1] == 1 or w.s[1] == w.n[2]):
        return 0, 0
    start = row[F_OPND + k * OPND_W] * esize  # bytes from the arena base (peer delta: none, weights are local)
    end = start + w.n[1] * w.n[2] * esize
    lo, hi = start // 16 * 16, -(-end // 16) * 16
    slot_end = layout.offsets[buf.name] + _round_up(max(buf.nbytes, 1), ALIGN)
    if lo < layout.offsets[buf.name] or hi > slot_end or hi - lo >= 2**31:
        return 0, 0
    return lo // 4, hi - lo


def _variant(task: Task, bufs: dict[str, Buffer], descs: list[Desc], slots: int, ring: bool = False) -> Variant:
    dtypes = tuple(bufs[r.buffer].dtype for r in (*task.ins, *task.outs))
    flags: dict[str, bool] = {}
    if task.op in GEMV_OPS:
        xi, ai, wi = GEMV_OPS[task.op]
        w = descs[wi]
        esize = DTYPE_BYTES[dtypes[wi]]
        flags["bias"] = len(task.ins) > wi + 1  # bias / residual added in the epilogue
        flags["mirror"] = len(task.outs) > 1  # y also stored to peers (gemv_mirrors)
        flags["contig"] = w.s[2] == 1 or w.n[2] == 1
        flags["xcontig"] = all(descs[j].n[0] == 1 and descs[j].n[1] == 1
                               for j in (xi, ai) if j is not None)
        vec = 16 // esize  # elements per 16 bytes
        flags["aligned"] = (flags["contig"] and _starts_aligned(w, vec, slots)
                            and (w.n[1] == 1 or w.s[1] % vec == 0) and w.n[2] % vec == 0)
        xs = [(descs[j], DTYPE_BYTES[dtypes[j]]) for j in (xi, ai) if j is not None]
        flags["xaligned"] = (flags["xcontig"] and flags["aligned"]
                             and all((d.s[2] == 1 or d.n[2] == 1) and (d.off * e) % 16 == 0
                                     and (d.coef * e) % 16 == 0 for d, e in xs))
        if task.op == "reduce_norm_gemv":
            # the kernel sums P [KP, K] rows with 16-byte loads (as reduce's ``vec``): rows
            # contiguous at a 16-byte row stride, the residual and the norm weight flat
            if not (flags["aligned"] and _rows_vec_aligned(descs[0], descs[1:3], vec_elems(dtypes[:3]), slots)):
                raise TableError(f"task {task.id}: the triton reduce_norm_gemv kernel needs contiguous "
                                 "partial rows, residual and norm weight, each row starting on a 16-byte "
                                 "boundary, and a 16-byte aligned weight (as the lowering emits)")
            flags["xcontig"] = flags["xaligned"] = True
        if ring:
            flags["ring"] = True
    elif task.op in ("attention", "rope_attention", "rope_attention_kv"):
        # the K and V caches ([G, T, D]) with unit head-dim stride and every row start on a
        # 16-byte boundary: the kernel loads them as 16-byte vectors (ops.attention KV_ALIGN)
        ci = OPS[task.op].operand_index("kc", len(task.ins))  # the V cache follows
        vec = 16 // DTYPE_BYTES[dtypes[ci]]
        flags["kvaligned"] = DTYPE_BYTES[dtypes[ci]] == DTYPE_BYTES[dtypes[ci + 1]] and all(
            d.s[2] == 1 and d.s[1] % vec == 0 and d.s[0] % vec == 0 and _starts_aligned(d, vec, slots)
            for d in descs[ci:ci + 2])
    elif task.op == "reduce":
        flags["residual"] = len(task.ins) > 1
        # P [KP, n] rows contiguous at a 16-byte row stride, residual and y flat
        flags["vec"] = _rows_vec_aligned(descs[0], descs[1:], vec_elems(dtypes), slots)
    elif task.op in ("copy", "put"):
        flags["vec"] = all(_flat_aligned(d, vec_elems(dtypes), slots) for d in descs)
    return Variant(task.op, dtypes, tuple(sorted(flags.items())))


def gemv_mirrors(v: Variant) -> int:
    """Mirror outputs (ir/ops.py) of a GEMV variant: its operands after x, [a], W, [bias /
    residual] and y."""
    return len(v.dtypes) - (GEMV_OPS[v.op][2] + 2 + v.flag("bias"))


def vec_elems(dtypes: Sequence[str]) -> int:
    """Elements per 16-byte vector of a ``vec`` variant: its widest operand dtype's."""
    return 16 // max(DTYPE_BYTES[d] for d in dtypes)


def _starts_aligned(d: Desc, vec: int, slots: int) -> bool:
    """The operand starts on a multiple of ``vec`` elements in every slot."""
    return all((d.off + d.coef * sl) % vec == 0 for sl in range(slots))


def _rows_vec_aligned(p: Desc, flat: Sequence[Desc], vec: int, slots: int) -> bool:
    """Partials ``p`` viewed as [KP, n] whose rows are contiguous, n elements long and a
    multiple of ``vec``, at a row stride that is one too and starting aligned in every slot,
    and every operand in ``flat`` _flat_aligned: what the kernels' 16-byte row sums need
    (reduce's ``vec`` flag, reduce_norm_gemv)."""
    return (p.n[0] == 1 and (p.s[2] == 1 or p.n[2] == 1) and p.n[2] % vec == 0
            and (p.n[1] == 1 or p.s[1] % vec == 0) and _starts_aligned(p, vec, slots)
            and all(_flat_aligned(d, vec, slots) for d in flat))


def _flat_aligned(d: Desc, vec: int, slots: int) -> bool:
    """The region's flat index i addresses element off + i (every axis of extent > 1 at its
    row-major stride), and its extent and every slot's start are multiples of ``vec``
    elements (buffer bases and peer deltas are 16-byte aligned: build_layout, build_table)."""
    (n0, n1, n2), (s0, s1, s2) = d.n, d.s
    flat = (n2 == 1 or s2 == 1) and (n1 == 1 or s1 == n2) and (n0 == 1 or s0 == n1 * n2)
    return flat and d.numel % vec == 0 and _starts_aligned(d, vec, slots)


def ring_eligible(task: Task, bufs: dict[str, Buffer], w: Desc, w_start: int, w_const: bool) -> bool:
    """Whether a GEMV task's weights may stream through the weight ring (ring.py): W is bf16,
    written by no task of the program (``w_const``: its pages are copied before the task's
    waits hold), the same region in every slot, a matrix with unit column stride, K a multiple
    of 8 elements, and its start (``w_start``, bytes from the arena base) and row stride
    multiples of 16 bytes (the bulk copies' alignment)."""
    if task.op not in GEMV_OPS or not w_const:
        return False
    if bufs[task.ins[GEMV_OPS[task.op][2]].buffer].dtype != "bf16":
        return False
    (n0, n1, n2), (_, s1, s2) = w.n, w.s
    return (w.coef == 0 and n0 == 1 and (s2 == 1 or n2 == 1) and n2 % 8 == 0 and w_start % 16 == 0
            and (n1 == 1 or (s1 * 2) % 16 == 0))


def _ring_task(t: Task, bufs: dict[str, Buffer], layout: ArenaLayout, rank: int, slots: int,
               written: set[str]) -> bool:
    """ring_eligible for task ``t`` of ``rank`` (its W region described here)."""
    if t.op not in GEMV_OPS:
        return False
    reg = t.ins[GEMV_OPS[t.op][2]]
    b = bufs[reg.buffer]
    if reg.rank != rank or b.name not in layout.offsets:
        return False
    w = describe_region(reg, b, "matrix", slots, f"task {t.id} weight")
    return ring_eligible(t, bufs, w, layout.offsets[b.name] + w.off * DTYPE_BYTES[b.dtype], b.name not in written)


def stream_list(tab: "TaskTable") -> tuple[np.ndarray, np.ndarray]:
    """The weight ring's stream list of a table: per worker, in queue order, one entry per
    ``ring`` GEMV row (its W tile's byte offset in the arena, row stride in bytes, rows N << 32
    | columns K, 0; ring.STREAM_W int64 fields), and ``sstart[W + 1]`` (int32): worker w's entries are
    ``sstart[w] .. sstart[w + 1] - 1``. The kernel copies each entry's pages in ring.page_order
    in this order, and its GEMVs consume them in the same order."""
    ring_ops = {i for i, v in enumerate(tab.variants) if v.flag("ring")}
    entries: list[list[int]] = []
    sstart = [0]
    for wk in range(tab.workers):
        for i in range(int(tab.qstart[wk]), int(tab.qstart[wk + 1])):
            row = tab.rows[i]
            if int(row[F_OP]) in ring_ops:
                wi = GEMV_OPS[tab.task_ops[i]][2]
                off, _, _, n1, n2, _, s1, _ = (int(x) for x in row[F_OPND + wi * OPND_W:F_OPND + (wi + 1) * OPND_W])
                entries.append([off * 2, s1 * 2 if n1 > 1 else n2 * 2, n1 << 32 | n2, 0])
        sstart.append(len(entries))
    streams = np.asarray(entries or [[0, 0, 0, 0]], dtype=np.int64).reshape(-1, 4)
    return streams, np.asarray(sstart, dtype=np.int32)


def elide_waits(queue: Sequence[Task]) -> list[list]:
    """The waits each task of one worker's queue still needs, in queue order: a wait on
    (counter, epoch offset) is dropped when an earlier task of the same queue already waited
    on that counter and offset for at least the same threshold. Sound because the queue
    runs in order on one CTA whose every thread polled (acquired) that counter value before,
    counters only grow within a step, and happens-before is transitive. Zero thresholds are
    dropped too (always satisfied)."""
    held: dict[tuple[str, int], int] = {}
    out = []
    for t in queue:
        live = [wt for wt in t.waits
                if wt.threshold > 0 and held.get((wt.counter, wt.offset), 0) < wt.threshold]
        for wt in t.waits:
            k = (wt.counter, wt.offset)
            held[k] = max(held.get(k, 0), wt.threshold)
        out.append(live)
    return out


def coalesced_signals(queue: Sequence[Task], live: Sequence[Sequence]) -> list[list[tuple[str, int]]]:
    """The (counter, amount) signals each task of one worker's queue releases when a task's
    signals are deferred onto the next task of the queue: allowed when the next task has no
    waits left (``live``, from elide_waits: it cannot block, so the deferred signal is only
    delayed by that task's run time, never withheld) and signals every counter the deferred
    ones do (the same stage). One release atomic then covers several tiles (amounts are
    summed), which saves a system/GPU-scope release per task. Valid only where the queue
    runs back to back on one worker."""
    out: list[list[tuple[str, int]]] = []
    pending: dict[str, int] = {}
    for j, t in enumerate(queue):
        merged = dict(pending)
        for sg in t.signals:
            merged[sg.counter] = merged.get(sg.counter, 0) + sg.amount
        nxt = queue[j + 1] if j + 1 < len(queue) else None
        if (nxt is not None and not live[j + 1] and merged
                and set(merged) <= {sg.counter for sg in nxt.signals}):
            pending = merged
            out.append([])
        else:
            pending = {}
            out.append(list(merged.items()))
    return out


#: GEMV ops with a prologue f(x) that the kernel stages into the worker's scratch
#: (ops.gemv_ex X_STAGE); plain gemv / gemv_res read x directly.
STAGED_PROLOGUE_OPS = frozenset({"norm_gemv", "swiglu_gemv", "reduce_norm_gemv"})


def staged_x_reuse(queue: Sequence[Task], slots: int = 1, ring: frozenset = frozenset()) -> list[bool]:
    """Per task of one worker's queue: True when its prologue f(x) (norm_gemv: RMSNorm of x
    by the weight a; swiglu_gemv: silu(gate) * up) is already in the worker's scratch,
    staged by the last staging task ``i`` before it, so the kernel can skip the x pass.

    Needs the same op, the same prologue inputs (every operand before W: x and a, and
    reduce_norm_gemv's residual) and the same eps as ``i``, and those unchanged since ``i``
    read them. The last holds because every task after ``i`` up to
    this one has no wait left after ``elide_waits`` and writes nothing overlapping x or a:
    in a race-free program (the validator's verdict) every write W of x or a is ordered
    with both reads; if W happens before this task, that order comes from a wait of a task
    in ``i+1 ..`` this one, or through program order from ``i`` or earlier. The first is
    excluded (their waits were all held by tasks up to ``i``, so the same waits order W
    before ``i`` too), and a write by a task in between is excluded by the overlap test.
    So W happened before ``i`` as well, or after this task. Valid only where the queue
    runs back to back on one worker (the scratch is the worker's).

    ``ring``: ids of the tasks on the weight ring (ring_eligible), which stage every GEMV's
    f(x), plain x included, as fp32 (ring.gemv_ring); a ring task reuses only a ring task's
    scratch and the other staging tasks only another's (they store f(x) in x's dtype)."""
    live = elide_waits(queue)
    out: list[bool] = []
    staged = None  # (op, prologue inputs, eps, on the ring) of the last staging task, while still valid
    for t, lw in zip(queue, live):
        if lw:
            staged = None
        key = None
        if t.op in STAGED_PROLOGUE_OPS or t.id in ring:
            key = (t.op, tuple(t.ins[:GEMV_OPS[t.op][2]]), t.params.get("eps"), t.id in ring)
        out.append(key is not None and key == staged)
        if key is not None:
            staged = key
        if staged is not None and any(_boxes_overlap(o, r, s) for o in t.outs for r in staged[1]
                                      for s in range(slots)):
            staged = None
    return out


def build_table(program: ScheduleProgram, rank: int, order: Sequence[Sequence[Task]],
                layout: ArenaLayout | None = None, peer_delta: Mapping[int, int] | None = None,
                variants: list[Variant] | None = None, elide: bool = True,
                coalesce: bool = True, reuse_x: bool = False, ring: bool = False) -> TaskTable:
    """Build the task table of ``rank`` with ``order[w]`` as worker w's queue.

    ``order`` is usually ``[queue for (r, w) in program.queues() if r == rank]`` (one queue
    per worker, the program's own assignment) or ``[linearize(program, rank)]`` (one worker).
    ``peer_delta`` maps another rank to the byte distance from this rank's arena to that
    rank's arena (remote puts and signals; R = 1 needs none). ``variants``: an existing
    opcode list to extend (so several tables can share one kernel). ``elide``: drop waits an
    earlier task of the same queue already did (elide_waits). ``coalesce``: defer a task's
    signals onto the next task of its queue where that is safe (coalesced_signals); only
    where each queue runs back to back on one worker, not when queues are interleaved later
    (merge_tables of several ranks' linear queues). ``reuse_x``: set ``FLAG_X_READY`` on the
    GEMV tasks whose staged prologue the previous staging task of the queue left in the
    worker's scratch (staged_x_reuse); same condition on the queues as ``coalesce``.
    ``ring``: GEMV tasks whose W may stream through the weight ring (ring_eligible) get the
    ``ring`` variant flag (their pages are listed by stream_list).

    Raises TableError naming the task and operand for anything the kernel could not execute
    safely (see the module docstring).
    """
    peer_delta = dict(peer_delta or {})
    for r, d in peer_delta.items():
        if d % 16:
            raise TableError(f"peer delta of rank {r} is {d} bytes, not a multiple of 16")
    layout = layout or build_layout(program, rank)
    bufs = program.buffer_map()
    cmap = program.counter_map()
    n_epoch = program.signals_per_epoch()
    slots = max(1, program.slots)
    variants = list(variants or [])
    vindex = {v: i for i, v in enumerate(variants)}
    rows: list[list[int]] = []
    waits: list[list[int]] = []
    sigs: list[list[int]] = []
    task_ids: list[str] = []
    task_ops: list[str] = []
    wait_counters: list[str] = []
    qstart = [0]
    dims = {"head_dim": 1, "group": 1}
    written = {r.buffer for t in program.tasks for r in t.outs}  # any rank: puts write peers' buffers
    for w, queue in enumerate(order):
        live_waits = elide_waits(queue) if elide else [[wt for wt in t.waits if wt.threshold > 0] for t in queue]
        for t in queue:
            for sg in t.signals:
                if sg.counter not in cmap:
                    raise TableError(f"task {t.id}: signals unknown counter {sg.counter!r}")
                if sg.amount < 0:
                    raise TableError(f"task {t.id}: negative signal amount {sg.amount}")
        signals = (coalesced_signals(queue, live_waits) if coalesce
                   else [[(sg.counter, sg.amount) for sg in t.signals] for t in queue])
        on_ring = frozenset(t.id for t in queue if ring and _ring_task(t, bufs, layout, rank, slots, written))
        x_ready = staged_x_reuse(queue, slots, on_ring) if reuse_x else [False] * len(queue)
        for ti, t in enumerate(queue):
            if t.rank != rank:
                raise TableError(f"task {t.id} belongs to rank {t.rank}, not rank {rank}")
            _check_task(t, program, bufs, rank, peer_delta)
            views = _views_for(t)
            descs: list[Desc] = []
            row = [0] * ROW
            for k, (reg, view) in enumerate(zip((*t.ins, *t.outs), views)):
                b = bufs[reg.buffer]
                d = describe_region(reg, b, view, slots, f"task {t.id} operand {k}")
                descs.append(d)
                esize = DTYPE_BYTES[b.dtype]
                base = layout.offsets[b.name]
                if reg.rank != rank:
                    base += peer_delta[reg.rank]
                if base % esize:
                    raise TableError(f"task {t.id}: buffer {b.name} is not {esize}-byte aligned")
                f = d.fields()
                f[0] += base // esize
                row[F_OPND + k * OPND_W:F_OPND + (k + 1) * OPND_W] = f
            _check_descs(t, descs)
            _check_alias(t, slots)
            if x_ready[ti]:
                row[F_FLAGS] |= FLAG_X_READY
            if t.op in GEMV_OPS:
                wi = GEMV_OPS[t.op][2]
                wbuf = bufs[t.ins[wi].buffer]
                if wbuf.name not in written:
                    row[F_FLAGS] |= FLAG_W_CONST
                row[F_PFO], row[F_PFN] = _prefetch_range(descs[wi], row, wi, DTYPE_BYTES[wbuf.dtype], layout, wbuf)
            for j, (name, kind) in enumerate(PARAM_SLOTS.get(t.op, ())):
                v = t.params[name]
                row[F_P0 + j] = int(v) if kind == "i" else f32_bits(v)
            if t.op in ("attention", "rope_attention", "rope_attention_kv"):
                hd = int(t.params["head_dim"])
                ci = OPS[t.op].operand_index("kc", len(t.ins))
                dims["head_dim"] = max(dims["head_dim"], hd)
                dims["group"] = max(dims["group"], descs[0].numel // hd // descs[ci].n[0])
            v = _variant(t, bufs, descs, slots, t.id in on_ring)
            if v not in vindex:
                vindex[v] = len(variants)
                variants.append(v)
            row[F_OP] = vindex[v]
            live = live_waits[ti]
            row[F_NWAIT], row[F_WAIT0] = len(live), len(waits)
            for wt in live:
                c = cmap.get(wt.counter)
                if c is None:
                    raise TableError(f"task {t.id}: waits on unknown counter {wt.counter!r}")
                if c.rank != rank:
                    raise TableError(f"task {t.id}: waits on counter {c.name} of rank {c.rank}; "
                                     "a task waits only on its own rank's counters")
                if wt.offset not in (0, -1):
                    raise TableError(f"task {t.id}: wait offset {wt.offset} is not 0 or -1")
                waits.append([layout.counters_offset // 4 + layout.counter_index[c.name],
                              n_epoch[c.name], wt.offset, wt.threshold])
                if len(waits) - 1 == row[F_WAIT0]:  # the first: also inline in the row
                    row[F_W0C], row[F_W0N] = waits[-1][0], waits[-1][1]
                    row[F_W0B] = wt.offset * n_epoch[c.name] + wt.threshold
                wait_counters.append(c.name)
            row[F_NSIG], row[F_SIG0] = len(signals[ti]), len(sigs)
            for name, amount in signals[ti]:
                c = cmap[name]
                idx = layout.counters_offset // 4 + layout.counter_index[c.name]
                if c.rank == rank:
                    sigs.append([idx, amount, SCOPE_GPU])
                elif c.rank in peer_delta:
                    sigs.append([idx + peer_delta[c.rank] // 4, amount, SCOPE_SYS])
                    row[F_FLAGS] |= FLAG_SYS_SIGNAL
                else:
                    raise TableError(f"task {t.id}: signals counter {c.name} of rank {c.rank}, but no "
                                     f"peer pointer for rank {c.rank} is known")
                if len(sigs) - 1 == row[F_SIG0]:  # the first: also inline in the row
                    row[F_S0C], row[F_S0A], row[F_S0S] = sigs[-1]
            rows.append(row)
            task_ids.append(t.id)
            task_ops.append(t.op)
        qstart.append(len(rows))
    return TaskTable(
        rank=rank,
        workers=len(order),
        rows=np.asarray(rows, dtype=np.int64).reshape(-1, ROW),
        qstart=np.asarray(qstart, dtype=np.int32),
        waits=np.asarray(waits or [[0] * WAIT_W], dtype=np.int64).reshape(-1, WAIT_W),
        signals=np.asarray(sigs or [[0] * SIG_W], dtype=np.int64).reshape(-1, SIG_W),
        variants=variants,
        task_ids=task_ids,
        task_ops=task_ops,
        wait_counters=wait_counters,
        layout=layout,
        order=[list(q) for q in order],
        dims=dims,
        task_ranks=[rank] * len(task_ids),
    )


def prefetch_ahead(tab: TaskTable, ahead: int, cap_rows: int = 0) -> None:
    """Copy each row's weight-tile range (F_PFO / F_PFN) into the F_APFO / F_APFN fields of
    the row ``ahead`` places earlier in the same worker's queue (0, 0 where no such task
    is), in place: the kernel's L2 prefetch at task i then uses task i + ahead's range
    from row i itself. ``ahead`` = 0 clears the fields. ``cap_rows`` > 0: the range covers
    at most the tile's first ``cap_rows`` weight rows (a tile's bytes / its rows, rounded
    up to 16 bytes), so a tall tile is not prefetched whole a task ahead while a wide one
    (the down projection's 16 x 8192 rows) still is. A prefetch is only a hint to the
    memory system, so the pairing needs no ordering argument."""
    rows = tab.rows
    rows[:, F_APFO] = 0
    rows[:, F_APFN] = 0
    if ahead <= 0:
        return
    n = rows[:, F_PFN].copy()
    if cap_rows > 0:
        for i, op in enumerate(tab.task_ops):
            if n[i] and op in GEMV_OPS:
                tile_rows = max(1, int(rows[i, F_OPND + GEMV_OPS[op][2] * OPND_W + 3]))  # the W operand's n1
                if tile_rows > cap_rows:
                    n[i] = min(int(n[i]), -(-int(n[i]) * cap_rows // tile_rows // 16) * 16)
    for w in range(tab.workers):
        a, b = int(tab.qstart[w]), int(tab.qstart[w + 1])
        if b - a > ahead:
            rows[a:b - ahead, F_APFO] = rows[a + ahead:b, F_PFO]
            rows[a:b - ahead, F_APFN] = n[a + ahead:b]


def shift_layout(layout: ArenaLayout, base: int) -> ArenaLayout:
    """``layout`` with every byte offset moved by ``base`` (a multiple of ``ALIGN``): rank r's
    slice of an arena that holds several ranks' slices (co-located ranks on one device)."""
    if base % ALIGN:
        raise TableError(f"arena slice base {base} is not a multiple of {ALIGN} bytes")
    return ArenaLayout(rank=layout.rank, offsets={k: v + base for k, v in layout.offsets.items()},
                       counter_index=dict(layout.counter_index),
                       counters_offset=layout.counters_offset + base, nbytes=layout.nbytes)


def merge_tables(tables: Sequence[TaskTable], queues: Sequence[Sequence[tuple[int, int]]]) -> TaskTable:
    """One task table for one kernel launch from several tables (several ranks run by one
    process). ``queues[w]`` lists worker w's rows as (table index, row index). Every table
    must have been built with the previous one's ``variants`` (``build_table(...,
    variants=)``), so opcodes agree; the last table's list is the merged one. Wait and
    signal indices in the rows are rebased onto the concatenated ``waits`` / ``signals``.
    """
    if len(tables) == 1 and [list(q) for q in queues] == [
            [(0, i) for i in range(int(tables[0].qstart[w]), int(tables[0].qstart[w + 1]))]
            for w in range(tables[0].workers)]:
        return tables[0]
    wbase, sbase, nw, ns = [], [], 0, 0
    for t in tables:
        wbase.append(nw)
        sbase.append(ns)
        nw += len(t.wait_counters)
        ns += int(t.rows[:, F_NSIG].sum()) if t.n_tasks else 0
    flat = [[task for wq in t.order for task in wq] for t in tables]
    rows, ids, ops, ranks, order, qstart = [], [], [], [], [], [0]
    for q in queues:
        worker_tasks = []
        for ti, i in q:
            t = tables[ti]
            row = t.rows[i].copy()
            row[F_WAIT0] += wbase[ti]
            row[F_SIG0] += sbase[ti]
            rows.append(row)
            ids.append(t.task_ids[i])
            ops.append(t.task_ops[i])
            ranks.append(t.rank)
            worker_tasks.append(flat[ti][i])
        order.append(worker_tasks)
        qstart.append(len(rows))
    waits = [t.waits[:len(t.wait_counters)] for t in tables]
    sigs = [t.signals[:int(t.rows[:, F_NSIG].sum())] if t.n_tasks else t.signals[:0] for t in tables]
    dims = {k: max(t.dims.get(k, 1) for t in tables) for k in ("head_dim", "group")}
    return TaskTable(
        rank=tables[0].rank,
        workers=len(queues),
        rows=np.asarray(rows, dtype=np.int64).reshape(-1, ROW),
        qstart=np.asarray(qstart, dtype=np.int32),
        waits=np.concatenate(waits) if nw else np.zeros((1, WAIT_W), dtype=np.int64),
        signals=np.concatenate(sigs) if ns else np.zeros((1, SIG_W), dtype=np.int64),
        variants=list(tables[-1].variants),
        task_ids=ids,
        task_ops=ops,
        wait_counters=[c for t in tables for c in t.wait_counters],
        layout=tables[0].layout,
        order=order,
        dims=dims,
        task_ranks=ranks,
    )


# ---------------------------------------------------------------- linearization
class LinearizeError(AmkError):
    """No single-worker order exists: the queues deadlock (names the blocked tasks)."""


def linearize(program: ScheduleProgram, rank: int | None = None, *,
              strict: bool = True) -> list[Task]:
    """Merge the program's queues into one order that a single worker can run.

    Greedy monotone simulation of one epoch over ALL ranks' queues (counters are monotone
    and waits are ``>=``, so running any ready task never disables another, and the greedy
    run finds a complete order iff one exists): repeatedly run the head of any queue whose
    waits hold, in (rank, worker) order. Counters are epoch-relative: a wait with offset 0
    needs ``t`` signals of this epoch; a ``@prev`` credit wait needs ``t - N(c)`` (the
    previous epoch ran to completion), so the order is valid for every epoch. Remote data
    is treated as delivered at once (a single worker runs everything in sequence).

    Returns the tasks of ``rank`` in that order (all tasks if ``rank`` is None). With
    ``strict`` a stuck simulation raises LinearizeError naming the blocked tasks and
    counter values; with ``strict=False`` the blocked tasks are appended in queue order so
    that the kernel's watchdog reports the bad wait at run time (for ``--unsafe`` runs).
    """
    n_epoch = program.signals_per_epoch()
    queues = [q for _, q in sorted(program.queues().items())]
    pos = [0] * len(queues)
    value: dict[str, int] = {c.name: 0 for c in program.counters}
    out: list[Task] = []

    def ready(t: Task) -> bool:
        for wt in t.waits:
            if wt.threshold <= 0:
                continue
            need = wt.threshold - (n_epoch.get(wt.counter, 0) if wt.offset < 0 else 0)
            if value.get(wt.counter, 0) < need:
                return False
        return True

    progress = True
    while progress:
        progress = False
        for qi, q in enumerate(queues):
            while pos[qi] < len(q) and ready(q[pos[qi]]):
                t = q[pos[qi]]
                out.append(t)
                for s in t.signals:
                    value[s.counter] = value.get(s.counter, 0) + s.amount
                pos[qi] += 1
                progress = True
    stuck = [(q, pos[qi]) for qi, q in enumerate(queues) if pos[qi] < len(q)]
    if stuck:
        if strict:
            blocked = []
            for q, i in stuck:
                t = q[i]
                need = ", ".join(f"{w.counter}>={w.threshold}{'@prev' if w.offset < 0 else ''}"
                                 f" (has {value.get(w.counter, 0)})" for w in t.waits if not
                                 value.get(w.counter, 0) >= w.threshold
                                 - (n_epoch.get(w.counter, 0) if w.offset < 0 else 0))
                blocked.append(f"{t.id} [rank {t.rank} worker {t.worker}] waits {need}")
            raise LinearizeError("schedule deadlocks: no task can run; blocked: " + "; ".join(blocked))
        for q, i in stuck:
            out.extend(q[i:])
    if rank is not None:
        out = [t for t in out if t.rank == rank]
    return out
