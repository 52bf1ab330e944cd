"""ScheduleProgram -> device task table for the persistent Triton megakernel (host side).

The megakernel (codegen.py, vm.py, ops/) reads everything it needs from a few int64 arrays
built here once per compile, in the format layout.py documents (row fields, waits, signals,
operand descriptors, variants). Each op's encoding (its operand views, param slots, variant
flags, descriptor checks, in-place rule) comes from its entry in the op registry (ops/).

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

Everything the kernel relies on for memory safety is checked here, always, also for
programs run without validation (``--unsafe``): regions in bounds for every slot, operand
counts and dtypes, shape rules of ir/ops.py, extents and offsets that fit int32 within a
buffer, and input/output aliasing the kernels cannot compute correctly (each op's
``OpLowering.in_place``). A bad schedule may deadlock (the watchdog reports it) or race, but
never makes the kernel touch memory outside the arena.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ground.errors import AmkError
from ir.ops import OPS, scale_index, squeeze
from ir.program import DTYPE_BYTES, Buffer, Region, ScheduleProgram, Task
from lowering.triton.layout import (
    F_APFN, F_APFO, F_FLAGS, F_NSIG, F_NWAIT, F_OP, F_OPND, F_P0, F_PFN, F_PFO, F_S0A, F_S0C, F_S0S, F_SIG0, F_W0B,
    F_W0C, F_W0N, F_WAIT0, FLAG_SYS_SIGNAL, FLAG_W_CONST, FLAG_X_READY, MAX_MIRRORS, MAX_OPNDS, OPND_W, ROW,
    SCOPE_GPU, SCOPE_SYS, SIG_W, WAIT_W, Desc, GemvRoles, TableError, Variant, describe_region, f32_bits,
)
from lowering.triton.ops import REGISTRY, lowering

#: Byte alignment of every buffer in the arena (>= 16 for vector loads; 256 like cudaMalloc).
ALIGN = 256

#: Largest element count of one buffer: intra-buffer offsets are int32 in the kernel.
MAX_BUFFER_ELEMS = 2**31 - 1

#: The block dims a table records (``TaskTable.dims``, the largest over its tasks; the
#: registry entries' ``dims``): attention's head_dim and GQA group, gemm's tile M, N, K.
DIMS = ("head_dim", "group", "gemm_m", "gemm_n", "gemm_k")





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
def _gemv(op: str) -> GemvRoles | None:
    """The GEMV roles of ``op``'s registry entry; None for another op or an unknown one (the
    queue-level passes run before each task's checks)."""
    entry = REGISTRY.get(op)
    return entry.gemv if entry is not None else None


def scaled_task(task: Task, bufs: Mapping[str, Buffer]) -> bool:
    """Whether ``task`` is a GEMV over a quantized weight, whose last input is then the
    weight's per-row scales (ir/ops.py)."""
    spec = OPS.get(task.op)
    return bool(spec is not None and spec.scaled and scale_index(
        spec, [bufs[r.buffer].dtype if r.buffer in bufs else "" for r in task.ins]) is not None)


def _views_for(task: Task, scaled: bool = False) -> tuple[str, ...]:
    """Operand views for a task, accounting for optional ins (gemv bias, reduce residual),
    a quantized weight's trailing scale input (``scaled``: flat) and mirror outputs (viewed
    as the first output): the registry's ``views`` list every role, optional ins included."""
    v = REGISTRY[task.op].views
    spec = OPS[task.op]
    assert len(v) == spec.max_ins + len(spec.outs), task.op
    outs = v[spec.max_ins:]
    n = len(task.ins) - scaled
    return v[:n] + ("flat",) * scaled + outs + outs[:1] * (len(task.outs) - len(outs))


def _check_task(task: Task, program: ScheduleProgram, bufs: dict[str, Buffer], rank: int,
                peer_delta: Mapping[int, int]) -> None:
    where = f"task {task.id}"
    spec = OPS.get(task.op)
    if spec is None:
        raise TableError(f"{where}: unknown op {task.op!r}")
    if "triton" not in spec.backends:
        raise TableError(f"{where}: op {task.op} is not implemented by the triton backend")
    entry = lowering(task.op, where)
    top = spec.max_ins_all if scaled_task(task, bufs) else spec.max_ins  # a quantized W's scale
    if not spec.min_ins <= len(task.ins) <= top:
        raise TableError(f"{where}: {task.op} takes {spec.min_ins}..{top} inputs, "
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
    for name, kind in entry.params:
        v = task.params.get(name, entry.param_defaults.get(name))
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


def _boxes_overlap(a: Region, b: Region, slot: int) -> bool:
    if a.buffer != b.buffer or a.rank != b.rank:
        return False
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a.concrete(slot), b.concrete(slot)))


def _check_alias(task: Task, slots: int) -> None:
    """Refuse input/output overlaps the kernels do not handle (the op's ``in_place`` rule).
    reference.py computes a whole result before writing, so any aliasing is legal in the IR;
    the GPU kernels write while they still read (gemv row blocks, attention heads, shifted
    elementwise blocks)."""
    entry = REGISTRY[task.op]
    for o in task.outs:
        for i in task.ins:
            for s in range(slots if (o.symbolic or i.symbolic) else 1):
                if not _boxes_overlap(o, i, s):
                    continue
                if entry.in_place == "same" and o.concrete(s) == i.concrete(s):
                    continue
                if (entry.in_place == "residual" and i is task.ins[-1]
                        and len(task.ins) > entry.gemv.w + 1 and o.concrete(s) == i.concrete(s)):
                    continue
                raise TableError(f"task {task.id}: output {o.buffer}{list(o.concrete(s))} overlaps input "
                                 f"{i.buffer}{list(i.concrete(s))} (slot {s}); the triton {task.op} kernel "
                                 "supports only " + ("identical in-place regions" if entry.in_place == "same"
                                                     else "disjoint inputs and outputs"))


def _variant(task: Task, bufs: dict[str, Buffer], descs: list[Desc], slots: int, ring: bool = False) -> Variant:
    """The task's dispatch variant: its op, operand dtypes and the layout flags of its
    registry entry; ``ring``: the GEMV streams W through the weight ring."""
    entry = REGISTRY[task.op]
    dtypes = tuple(bufs[r.buffer].dtype for r in (*task.ins, *task.outs))
    flags = dict(entry.flags(task, dtypes, descs, slots)) if entry.flags is not None else {}
    if ring:
        flags["ring"] = True
    return Variant(task.op, dtypes, tuple(sorted(flags.items())))


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


def ring_eligible(task: Task, bufs: dict[str, Buffer], w: Desc, w_start: int, w_const: bool) -> bool:
    """Whether a GEMV task's weights may stream through the weight ring (ring.py): W is bf16,
    written by no task of the program (``w_const``: its pages are copied before the task's
    waits hold), the same region in every slot, a matrix with unit column stride, K a multiple
    of 8 elements, and its start (``w_start``, bytes from the arena base) and row stride
    multiples of 16 bytes (the bulk copies' alignment)."""
    g = _gemv(task.op)
    if g is None or not w_const:
        return False
    if bufs[task.ins[g.w].buffer].dtype != "bf16":
        return False
    (n0, n1, n2), (_, s1, s2) = w.n, w.s
    return (w.coef == 0 and n0 == 1 and (s2 == 1 or n2 == 1) and n2 % 8 == 0 and w_start % 16 == 0
            and (n1 == 1 or (s1 * 2) % 16 == 0))


def _ring_task(t: Task, bufs: dict[str, Buffer], layout: ArenaLayout, rank: int, slots: int,
               written: set[str]) -> bool:
    """ring_eligible for task ``t`` of ``rank`` (its W region described here)."""
    g = _gemv(t.op)
    if g is None:
        return False
    reg = t.ins[g.w]
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
                wi = _gemv(tab.task_ops[i]).w
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
        g = _gemv(t.op)
        if (g is not None and g.staged) or t.id in ring:
            key = (t.op, tuple(t.ins[:g.w]), t.params.get("eps"), t.id in ring)
        out.append(key is not None and key == staged)
        if key is not None:
            staged = key
        if staged is not None and any(_boxes_overlap(o, r, s) for o in t.outs for r in staged[1]
                                      for s in range(slots)):
            staged = None
    return out


class _TableBuilder:
    """The rows, waits and signals of one rank's task table, queue by queue (build_table)."""

    def __init__(self, program: ScheduleProgram, rank: int, layout: ArenaLayout, peer_delta: dict[int, int],
                 variants: list[Variant] | None):
        self.program, self.rank, self.layout, self.peer_delta = program, rank, layout, peer_delta
        self.bufs = program.buffer_map()
        self.cmap = program.counter_map()
        self.n_epoch = program.signals_per_epoch()
        self.slots = max(1, program.slots)
        self.variants = list(variants or [])
        self.vindex = {v: i for i, v in enumerate(self.variants)}
        self.rows: list[list[int]] = []
        self.waits: list[list[int]] = []
        self.sigs: list[list[int]] = []
        self.task_ids: list[str] = []
        self.task_ops: list[str] = []
        self.wait_counters: list[str] = []
        self.qstart = [0]
        self.dims = {k: 1 for k in DIMS}
        self.written = {r.buffer for t in program.tasks for r in t.outs}  # any rank: puts write peers' buffers

    def add_queue(self, queue: Sequence[Task], elide: bool, coalesce: bool, reuse_x: bool, ring: bool) -> None:
        """Append one worker's queue (build_table's options)."""
        live_waits = elide_waits(queue) if elide else [[wt for wt in t.waits if wt.threshold > 0] for t in queue]
        for t in queue:
            for sg in t.signals:
                if sg.counter not in self.cmap:
                    raise TableError(f"task {t.id}: signals unknown counter {sg.counter!r}")
                if sg.amount < 0:
                    raise TableError(f"task {t.id}: negative signal amount {sg.amount}")
        signals = (coalesced_signals(queue, live_waits) if coalesce
                   else [[(sg.counter, sg.amount) for sg in t.signals] for t in queue])
        on_ring = frozenset(t.id for t in queue if ring and _ring_task(t, self.bufs, self.layout, self.rank,
                                                                        self.slots, self.written))
        x_ready = staged_x_reuse(queue, self.slots, on_ring) if reuse_x else [False] * len(queue)
        for ti, t in enumerate(queue):
            row = self._task_row(t, x_ready[ti], t.id in on_ring)
            self._encode_waits(t, row, live_waits[ti])
            self._encode_signals(t, row, signals[ti])
            self.rows.append(row)
            self.task_ids.append(t.id)
            self.task_ops.append(t.op)
        self.qstart.append(len(self.rows))

    def _task_row(self, t: Task, x_ready: bool, on_ring: bool) -> list[int]:
        """Task ``t``'s row but for its waits and signals: operands, flags, the weight tile's
        prefetch range, params and variant opcode, after every safety check."""
        if t.rank != self.rank:
            raise TableError(f"task {t.id} belongs to rank {t.rank}, not rank {self.rank}")
        _check_task(t, self.program, self.bufs, self.rank, self.peer_delta)
        entry = REGISTRY[t.op]
        row = [0] * ROW
        descs = self._encode_operands(t, row)
        if entry.check is not None:
            entry.check(t, descs, f"task {t.id}")
        _check_alias(t, self.slots)
        if x_ready:
            row[F_FLAGS] |= FLAG_X_READY
        if entry.gemv is not None:
            wi = entry.gemv.w
            wbuf = self.bufs[t.ins[wi].buffer]
            if wbuf.name not in self.written:
                row[F_FLAGS] |= FLAG_W_CONST
            row[F_PFO], row[F_PFN] = _prefetch_range(descs[wi], row, wi, DTYPE_BYTES[wbuf.dtype], self.layout, wbuf)
        for j, (name, kind) in enumerate(entry.params):
            v = t.params.get(name, entry.param_defaults.get(name))
            row[F_P0 + j] = int(v) if kind == "i" else f32_bits(v)
        if entry.dims is not None:
            for k, d in entry.dims(t, descs).items():
                self.dims[k] = max(self.dims.get(k, 1), d)
        v = _variant(t, self.bufs, descs, self.slots, on_ring)
        if v not in self.vindex:
            self.vindex[v] = len(self.variants)
            self.variants.append(v)
        row[F_OP] = self.vindex[v]
        return row

    def _encode_operands(self, t: Task, row: list[int]) -> list[Desc]:
        """Write the descriptor of every operand of ``t`` (its registry views) into ``row``,
        offsets from the arena base (a remote operand's through the peer delta); returns
        the descriptors (offsets from the buffer start)."""
        descs: list[Desc] = []
        entry = REGISTRY[t.op]
        splits = list(entry.splits(t)) if entry.splits is not None else []
        for k, (reg, view) in enumerate(zip((*t.ins, *t.outs), _views_for(t, scaled_task(t, self.bufs)))):
            b = self.bufs[reg.buffer]
            d = describe_region(reg, b, view, self.slots, f"task {t.id} operand {k}",
                                splits[k] if k < len(splits) else None)
            descs.append(d)
            esize = DTYPE_BYTES[b.dtype]
            base = self.layout.offsets[b.name]
            if reg.rank != self.rank:
                base += self.peer_delta[reg.rank]
            if base % esize:
                raise TableError(f"task {t.id}: buffer {b.name} is not {esize}-byte aligned")
            f = d.fields()
            f[0] += base // esize
            row[F_OPND + k * OPND_W:F_OPND + (k + 1) * OPND_W] = f
        return descs

    def _encode_waits(self, t: Task, row: list[int], live: Sequence) -> None:
        """Append the task's live waits to ``waits``; the first also goes into the row."""
        row[F_NWAIT], row[F_WAIT0] = len(live), len(self.waits)
        for wt in live:
            c = self.cmap.get(wt.counter)
            if c is None:
                raise TableError(f"task {t.id}: waits on unknown counter {wt.counter!r}")
            if c.rank != self.rank:
                raise TableError(f"task {t.id}: waits on counter {c.name} of rank {c.rank}; "
                                 "a task waits only on its own rank's counters")
            if wt.offset not in (0, -1):
                raise TableError(f"task {t.id}: wait offset {wt.offset} is not 0 or -1")
            n = self.n_epoch[c.name]
            self.waits.append([self.layout.counters_offset // 4 + self.layout.counter_index[c.name],
                               n, wt.offset, wt.threshold])
            if len(self.waits) - 1 == row[F_WAIT0]:  # the first: also inline in the row
                row[F_W0C], row[F_W0N] = self.waits[-1][0], self.waits[-1][1]
                row[F_W0B] = wt.offset * n + wt.threshold
            self.wait_counters.append(c.name)

    def _encode_signals(self, t: Task, row: list[int], signals: Sequence[tuple[str, int]]) -> None:
        """Append the task's (counter, amount) signals to ``signals`` (a peer's counter at
        system scope, through the peer delta); the first also goes into the row."""
        row[F_NSIG], row[F_SIG0] = len(signals), len(self.sigs)
        for name, amount in signals:
            c = self.cmap[name]
            idx = self.layout.counters_offset // 4 + self.layout.counter_index[c.name]
            if c.rank == self.rank:
                self.sigs.append([idx, amount, SCOPE_GPU])
            elif c.rank in self.peer_delta:
                self.sigs.append([idx + self.peer_delta[c.rank] // 4, amount, SCOPE_SYS])
                row[F_FLAGS] |= FLAG_SYS_SIGNAL
            else:
                raise TableError(f"task {t.id}: signals counter {c.name} of rank {c.rank}, but no "
                                 f"peer pointer for rank {c.rank} is known")
            if len(self.sigs) - 1 == row[F_SIG0]:  # the first: also inline in the row
                row[F_S0C], row[F_S0A], row[F_S0S] = self.sigs[-1]

    def table(self, order: Sequence[Sequence[Task]]) -> TaskTable:
        """The TaskTable of the queues added (``order``: them, in worker order)."""
        return TaskTable(
            rank=self.rank,
            workers=len(order),
            rows=np.asarray(self.rows, dtype=np.int64).reshape(-1, ROW),
            qstart=np.asarray(self.qstart, dtype=np.int32),
            waits=np.asarray(self.waits or [[0] * WAIT_W], dtype=np.int64).reshape(-1, WAIT_W),
            signals=np.asarray(self.sigs or [[0] * SIG_W], dtype=np.int64).reshape(-1, SIG_W),
            variants=self.variants,
            task_ids=self.task_ids,
            task_ops=self.task_ops,
            wait_counters=self.wait_counters,
            layout=self.layout,
            order=[list(q) for q in order],
            dims=self.dims,
            task_ranks=[self.rank] * len(self.task_ids),
        )


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
    tb = _TableBuilder(program, rank, layout or build_layout(program, rank), peer_delta, variants)
    for queue in order:
        tb.add_queue(queue, elide, coalesce, reuse_x, ring)
    return tb.table(order)


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
            g = _gemv(op)
            if n[i] and g is not None:
                tile_rows = max(1, int(rows[i, F_OPND + g.w * OPND_W + 3]))  # the W operand's n1
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
    dims = {k: max(t.dims.get(k, 1) for t in tables) for k in DIMS}
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
