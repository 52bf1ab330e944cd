"""Structure checks of a ScheduleProgram, and the flat index the deeper checks run on.

``check_structure(prog, backend)`` checks every field against the IR contract
(ir/program.py, ir/ops.py): the program's sizes and target, its buffers and counters here,
its tasks in validator/structure_tasks.py (numpy expressions over flat columns, one pass
for valid and malformed programs alike). From the same columns it builds an
:class:`Index`: numpy arrays of tasks, regions, waits and signals that the deadlock,
happens-before and race checks use. It never raises on malformed input: every problem
becomes a :class:`~validator.verdict.Finding`. ``fatal`` is True when a problem makes the deeper
analysis meaningless (an unknown buffer or counter, a rank out of range, a non-int bound,
a non-positive signal amount, ...); the other structure errors are still reported and the
deeper checks still run.

Error classes (``Finding.cls``) raised here: BadProgram, UnknownBackend, TooManyWorkers,
DuplicateBuffer, BadBuffer, BadWeightSource, DuplicateCounter, BadCounter, CounterOverflow,
DuplicateTask, BadTask, UnknownOp, UnsupportedOp, BadArity, UnknownBuffer, BadRegion,
RegionOutOfBounds, RemoteRead, RemoteWriteToLocal, BadDtype, BadParams, ShapeMismatch,
UnknownCounter, BadWait, RemoteWait, BadSignal, NonMonotoneCounter.

Waits are stored *normalised* in the Index (``w_thr``, ``w_off``; the values as written are
``w_thr_src`` / ``w_off_src``, for messages): a wait ``c >= t`` with ``t <= 0`` on a counter
with ``N(c) > 0`` becomes the same absolute condition with ``1 <= t' <= N(c)`` and offset
``offset - k`` (``t = t' - k N(c)``): ``wait(c >= 0)`` is ``wait(c >= N(c) @prev)``. Every
epoch's absolute threshold ``(e + offset) N(c) + t`` is unchanged, and the happens-before
reasoning (validator/hb.py) then judges the wait on the first epoch in which it is not
satisfied at once. Thresholds are clamped to [-2**61, 2**62] so that int64 arithmetic cannot
overflow; a clamped threshold means the same (never reached, or satisfied at once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ir.program import BUFFER_KINDS, COUNTER_WIDTHS, DTYPES, ScheduleProgram
from validator.structure_tasks import (  # noqa: F401 -- hb.py and races.py import OP_*
    BACKENDS, OP_FENCE, OP_PUT, OP_QUIET, Declared, Geometry, check_tasks, is_int,
)
from validator.verdict import Finding

PERSISTENT_KINDS = ("weight", "kv_cache", "io_input")  # hold data before the epoch starts
MAX_FINDINGS_PER_CLASS = 200  # report all classes; cap repeats of one class (count in stats)


@dataclass
class Index:
    """Flat, numpy view of a structurally sound program (built by ``check_structure``).

    Tasks are numbered in program order (``i``). ``chain = rank * workers + worker``;
    ``qpos`` is the task's position in its worker queue. Regions are numbered ``j`` with
    per-axis bound arrays of shape ``[n_regions, max_axes]``: ``lo_c + lo_k * s`` and
    ``hi_c + hi_k * s`` (s = epoch mod slots); padded axes hold ``[0, 1)``.
    """

    prog: ScheduleProgram
    ranks: int
    workers: int
    slots: int
    task_ids: list[str]
    t_rank: np.ndarray
    t_worker: np.ndarray
    t_chain: np.ndarray
    t_qpos: np.ndarray
    t_op: np.ndarray
    t_group: list[str | None]
    chain_len: np.ndarray
    chain_tasks: list[np.ndarray]
    buf_names: list[str]
    buf_id: dict[str, int]
    buf_kind: list[str]
    buf_dtype: list[str]
    buf_shape: list[tuple[int, ...]]
    buf_sym: np.ndarray
    buf_persistent: np.ndarray
    ctr_names: list[str]
    ctr_id: dict[str, int]
    ctr_rank: np.ndarray
    ctr_width: np.ndarray
    ctr_n: np.ndarray  # N(c): signal amount per epoch
    r_task: np.ndarray
    r_out: np.ndarray  # bool: written (True) or read (False)
    r_buf: np.ndarray
    r_rank: np.ndarray
    r_operand: np.ndarray  # operand index within ins / outs
    lo_c: np.ndarray
    lo_k: np.ndarray
    hi_c: np.ndarray
    hi_k: np.ndarray
    w_task: np.ndarray
    w_ctr: np.ndarray
    w_thr: np.ndarray  # normalised (module doc): 1 <= w_thr <= N(c) unless t > N(c) or N(c) = 0
    w_off: np.ndarray  # normalised: 0, -1, -2, ...
    s_task: np.ndarray
    s_ctr: np.ndarray
    s_amt: np.ndarray
    w_thr_src: Any = None  # thresholds as written (Python ints; may exceed int64)
    w_off_src: np.ndarray | None = None  # offsets as written (0 or -1)

    def region_box(self, j: int, slot: int = 0) -> list[list[int]]:
        """The concrete ``[[start, stop], ...]`` box of region ``j`` at ``slot`` (real axes
        only)."""
        nax = len(self.buf_shape[int(self.r_buf[j])])
        lo = self.lo_c[j, :nax] + self.lo_k[j, :nax] * slot
        hi = self.hi_c[j, :nax] + self.hi_k[j, :nax] * slot
        return [[int(a), int(b)] for a, b in zip(lo, hi)]

    def region_text(self, j: int) -> str:
        """Region ``j`` as ``name@rR[a:b, ...]`` with symbolic bounds spelled in ``s``."""
        nax = len(self.buf_shape[int(self.r_buf[j])])

        def bound(c: int, k: int) -> str:
            if k == 0:
                return str(c)
            head = "s" if k == 1 else f"{k}*s"
            return head if c == 0 else f"{head}{'+' if c > 0 else '-'}{abs(c)}"

        axes = ", ".join(f"{bound(int(self.lo_c[j, a]), int(self.lo_k[j, a]))}:"
                         f"{bound(int(self.hi_c[j, a]), int(self.hi_k[j, a]))}" for a in range(nax))
        return f"{self.buf_names[int(self.r_buf[j])]}@r{int(self.r_rank[j])}[{axes}]"


@dataclass
class StructureResult:
    findings: list[Finding] = field(default_factory=list)
    fatal: bool = False
    index: Index | None = None
    suppressed: dict[str, int] = field(default_factory=dict)


class _Collector:
    """Collects findings, capping repeats of one class so a huge bad program stays readable."""

    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.count: dict[str, int] = {}
        self.fatal = False

    def add(self, cls: str, message: str, tasks=(), buffers=(), witness=None, fatal=False):
        if fatal:
            self.fatal = True
        n = self.count.get(cls, 0) + 1
        self.count[cls] = n
        if n <= MAX_FINDINGS_PER_CLASS:
            self.findings.append(Finding(cls, message, list(tasks), list(buffers), witness or {}))

    def suppressed(self) -> dict[str, int]:
        return {c: n - MAX_FINDINGS_PER_CLASS for c, n in self.count.items()
                if n > MAX_FINDINGS_PER_CLASS}


def check_structure(prog: Any, backend: str | None = None) -> StructureResult:
    """Check ids, ranks, buffers, counters, regions, ops, dtypes, params and waits/signals.

    ``backend`` overrides ``prog.target.backend`` for the op-support check. Returns the
    findings and, when nothing fatal was found, the :class:`Index`. Never raises on
    malformed programs (unexpected field types become findings).
    """
    out = _Collector()
    geo = _check_program(prog, backend, out)
    if out.fatal:
        return StructureResult(out.findings, True, None, out.suppressed())
    decl = Declared()
    _check_buffers(prog.buffers, geo.ranks, decl, out)
    _check_counters(prog.counters, geo.ranks, decl, out)
    arrs = check_tasks(prog.tasks, geo, decl, out)
    ctr_n = _counter_totals(arrs["s_ctr"], arrs["s_amt"], decl, prog.max_epochs, out)
    if out.fatal:
        return StructureResult(out.findings, True, None, out.suppressed())
    return StructureResult(out.findings, False, _index(prog, geo, decl, arrs, ctr_n),
                           out.suppressed())


# ------------------------------------------------------------------------------------------
# the program, its buffers and counters
# ------------------------------------------------------------------------------------------

def _check_program(prog: Any, backend: str | None, out: _Collector) -> Geometry:
    """Sizes, the three lists and the target. Sizes that are not positive ints are fatal
    (the returned geometry then holds 1 for each)."""
    sizes = {k: getattr(prog, k, None) for k in ("ranks", "workers", "slots", "max_epochs")}
    for k, v in sizes.items():
        if not is_int(v) or v < 1:
            out.add("BadProgram", f"{k} must be a positive int, got {v!r}", fatal=True)
    for name in ("buffers", "counters", "tasks"):
        if not isinstance(getattr(prog, name, None), (list, tuple)):
            out.add("BadProgram", f"{name} must be a list", fatal=True)
    target = getattr(prog, "target", None)
    be = backend if backend is not None else getattr(target, "backend", None)
    _check_target(target, be, sizes["workers"], out)
    ok = all(is_int(sizes[k]) and sizes[k] >= 1 for k in ("ranks", "workers", "slots"))
    if not ok:
        return Geometry(1, 1, 1, be)
    return Geometry(sizes["ranks"], sizes["workers"], sizes["slots"], be)


def _check_target(target: Any, be: Any, workers: Any, out: _Collector) -> None:
    """The backend is known; sms and max_workers are positive ints; the workers fit."""
    if be not in BACKENDS:
        out.add("UnknownBackend", f"backend {be!r} is not one of {', '.join(BACKENDS)}",
                witness={"backend": be}, fatal=False)
    sms = getattr(target, "sms", None)
    mw = getattr(target, "max_workers", None)
    if not is_int(sms) or sms < 1 or not is_int(mw) or mw < 1:
        out.add("BadProgram", f"target needs positive int sms and max_workers, got sms={sms!r} "
                f"max_workers={mw!r}")
    elif is_int(workers) and workers > mw:
        # The Triton runtime checks the exact limit (CTAs per SM of the compiled kernel x SMs)
        # again before its first launch; max_workers is the schedule's promise.
        out.add("TooManyWorkers",
                f"{workers} workers per rank exceed the co-residency limit {mw} "
                f"(target.max_workers): the persistent kernel's CTAs could not all be resident",
                witness={"workers": workers, "max_workers": mw, "sms": sms, "backend": be})


def _new_name(obj: Any, what: str, seen: dict, out: _Collector, where) -> str | None:
    """The name of a buffer or counter (``what``), or None after a fatal Bad<what> (not a
    non-empty string) or Duplicate<what> (in ``seen``) finding; ``where(name)``: the
    duplicate finding's buffers or witness."""
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        out.add(f"Bad{what}", f"{what.lower()} name must be a non-empty string, got {name!r}",
                fatal=True)
        return None
    if name in seen:
        out.add(f"Duplicate{what}", f"{what.lower()} {name} is declared twice", fatal=True,
                **where(name))
        return None
    return name


def _check_buffers(buffers: list, R: int, decl: Declared, out: _Collector) -> None:
    """Names (non-empty, unique), kind, dtype, shape, placement and weight source of every
    buffer; the sound ones are numbered into ``decl``."""
    for b in buffers:
        name = _new_name(b, "Buffer", decl.buf_id, out, lambda n: {"buffers": [n]})
        if name is None:
            continue
        bad = _buffer_problems(b, R)
        if bad:
            out.add("BadBuffer", f"buffer {name}: " + "; ".join(bad), buffers=[name],
                    fatal=True)
            continue
        kind, shape, placement = b.kind, tuple(b.shape), b.placement
        src = getattr(b, "source", None)
        if src is not None:
            _check_source(name, kind, shape, src, out)
        decl.buf_id[name] = len(decl.buf_names)
        decl.buf_names.append(name)
        decl.buf_kind.append(kind)
        decl.buf_dtype.append(b.dtype)
        decl.buf_shape.append(shape)
        decl.buf_sym.append(placement == "symmetric")
        decl.buf_owner.append(b.rank if placement == "local" else -1)


def _buffer_problems(b: Any, R: int) -> list[str]:
    """What is wrong with buffer ``b``'s kind, dtype, shape and placement (empty: nothing)."""
    kind, dtype, shape = getattr(b, "kind", None), getattr(b, "dtype", None), \
        getattr(b, "shape", None)
    placement, brank = getattr(b, "placement", None), getattr(b, "rank", None)
    bad = []
    if kind not in BUFFER_KINDS:
        bad.append(f"kind {kind!r} is not one of {', '.join(BUFFER_KINDS)}")
    if dtype not in DTYPES:
        bad.append(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, (tuple, list)) or not shape or \
            not all(is_int(d) and d >= 1 for d in shape):
        bad.append(f"shape must be a non-empty list of positive ints, got {shape!r}")
    if placement == "local":
        if not is_int(brank) or not 0 <= brank < R:
            bad.append(f"local buffer owner rank {brank!r} is not in [0, {R})")
    elif placement == "symmetric":
        if brank is not None:
            bad.append(f"symmetric buffer must have rank None, got {brank!r}")
    else:
        bad.append(f"placement {placement!r} is not 'local' or 'symmetric'")
    return bad


def _check_counters(counters: list, R: int, decl: Declared, out: _Collector) -> None:
    """Names (non-empty, unique), owner rank and width of every counter; the sound ones are
    numbered into ``decl``."""
    for c in counters:
        name = _new_name(c, "Counter", decl.ctr_id, out, lambda n: {"witness": {"counter": n}})
        if name is None:
            continue
        crank, width = getattr(c, "rank", None), getattr(c, "width", None)
        if not is_int(crank) or not 0 <= crank < R:
            out.add("BadCounter", f"counter {name}: owner rank {crank!r} is not in [0, {R})",
                    witness={"counter": name}, fatal=True)
            continue
        if width not in COUNTER_WIDTHS:
            out.add("BadCounter", f"counter {name}: width {width!r} is not one of "
                    f"{COUNTER_WIDTHS}", witness={"counter": name}, fatal=True)
            continue
        decl.ctr_id[name] = len(decl.ctr_names)
        decl.ctr_names.append(name)
        decl.ctr_rank.append(crank)
        decl.ctr_width.append(width)


def _check_source(name: str, kind: str, shape: tuple[int, ...], src: Any, out: _Collector):
    """A weight buffer's checkpoint source: a key and a slice holding the buffer's elements."""
    key, ranges = getattr(src, "key", None), getattr(src, "ranges", None)
    if kind != "weight":
        out.add("BadWeightSource", f"buffer {name}: only weight buffers have a source "
                f"(kind is {kind})", buffers=[name])
        return
    if not isinstance(key, str) or not key:
        out.add("BadWeightSource", f"buffer {name}: source key must be a non-empty string",
                buffers=[name])
        return
    if not isinstance(ranges, (tuple, list)):
        out.add("BadWeightSource", f"buffer {name}: source ranges must be a list",
                buffers=[name])
        return
    if not ranges:
        return  # the whole tensor; its shape is only known when the checkpoint is loaded
    ext = []
    for rg in ranges:
        if not isinstance(rg, (tuple, list)) or len(rg) != 2 or not all(map(is_int, rg)) \
                or not 0 <= rg[0] < rg[1]:
            out.add("BadWeightSource", f"buffer {name}: source range {rg!r} is not "
                    f"0 <= start < stop", buffers=[name], witness={"key": key})
            return
        ext.append(rg[1] - rg[0])
    n, m = math.prod(ext), math.prod(shape)
    if n != m:
        out.add("BadWeightSource", f"buffer {name}: source slice {list(ranges)} of {key} holds "
                f"{n} elements, the buffer {m}", buffers=[name],
                witness={"key": key, "slice_extents": ext, "shape": list(shape)})


# ------------------------------------------------------------------------------------------
# counter totals, queues and the Index
# ------------------------------------------------------------------------------------------

def _counter_totals(s_ctr: np.ndarray, s_amt: np.ndarray, decl: Declared, max_epochs: int,
                    out: _Collector) -> np.ndarray:
    """``N(c)``, the amount signalled to each counter per step, and CounterOverflow where
    ``N(c) * (max_epochs + 1)`` leaves the counter's signed range."""
    n_ctr = len(decl.ctr_names)
    ctr_n = np.zeros(n_ctr, dtype=np.int64)
    if len(s_ctr):
        if int(s_amt.max()) < (1 << 40) and len(s_amt) < (1 << 20):
            ctr_n = np.bincount(s_ctr, weights=s_amt.astype(np.float64), minlength=n_ctr)
            ctr_n = np.rint(ctr_n).astype(np.int64)
        else:
            ctr_n = _exact_totals(s_ctr.tolist(), s_amt.tolist(), n_ctr)
    for ci, name in enumerate(decl.ctr_names):
        n, width = int(ctr_n[ci]), decl.ctr_width[ci]
        if n and n * (max_epochs + 1) > (1 << (width - 1)) - 1:
            out.add("CounterOverflow", f"counter {name}: {n} per step x (max_epochs "
                    f"{max_epochs} + 1) = {n * (max_epochs + 1)} exceeds the signed "
                    f"{width}-bit range", witness={"counter": name, "per_epoch": n,
                                                   "max_epochs": max_epochs, "width": width},
                    fatal=n >= (1 << 62))  # beyond int64 arithmetic: no deeper analysis
    return ctr_n


def _exact_totals(s_ctr: list, s_amt: list, n: int) -> np.ndarray:
    tot = [0] * n
    for c, a in zip(s_ctr, s_amt):
        tot[c] += a
    return np.asarray(tot, dtype=object)


def _queues(t_chain: np.ndarray, n_chains: int):
    """Per task its position in its worker queue, and per chain its length and tasks."""
    n = len(t_chain)
    order = np.argsort(t_chain, kind="stable")
    chain_len = np.bincount(t_chain, minlength=n_chains).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(chain_len)))
    t_qpos = np.empty(n, dtype=np.int64)
    t_qpos[order] = np.arange(n) - np.repeat(starts[:-1], chain_len)
    chain_tasks = [order[starts[c]:starts[c + 1]] for c in range(n_chains)]
    return t_qpos, chain_len, chain_tasks


def _index(prog: Any, geo: Geometry, decl: Declared, a: dict, ctr_n: np.ndarray) -> Index:
    """The Index of a program without fatal problems (waits normalised, module doc)."""
    R, W = geo.ranks, geo.workers
    t_chain = a["t_rank"] * W + a["t_worker"]
    t_qpos, chain_len, chain_tasks = _queues(t_chain, R * W)
    ctr_n = np.asarray(ctr_n, dtype=np.int64)
    w_thr, w_off = _normalise_waits(a["w_thr"], a["w_off"], ctr_n[a["w_ctr"]])
    return Index(
        prog=prog, ranks=R, workers=W, slots=geo.slots, task_ids=a["task_ids"],
        t_rank=a["t_rank"], t_worker=a["t_worker"], t_chain=t_chain, t_qpos=t_qpos,
        t_op=a["t_op"], t_group=a["t_group"], chain_len=chain_len, chain_tasks=chain_tasks,
        buf_names=decl.buf_names, buf_id=decl.buf_id, buf_kind=decl.buf_kind,
        buf_dtype=decl.buf_dtype, buf_shape=decl.buf_shape,
        buf_sym=np.asarray(decl.buf_sym, dtype=bool),
        buf_persistent=np.asarray([k in PERSISTENT_KINDS for k in decl.buf_kind], dtype=bool),
        ctr_names=decl.ctr_names, ctr_id=decl.ctr_id,
        ctr_rank=np.asarray(decl.ctr_rank, dtype=np.int64),
        ctr_width=np.asarray(decl.ctr_width, dtype=np.int64), ctr_n=ctr_n,
        r_task=a["r_task"], r_out=a["r_out"], r_buf=a["r_buf"], r_rank=a["r_rank"],
        r_operand=a["r_operand"], lo_c=a["lo_c"], lo_k=a["lo_k"], hi_c=a["hi_c"],
        hi_k=a["hi_k"], w_task=a["w_task"], w_ctr=a["w_ctr"], w_thr=w_thr,
        w_off=w_off, s_task=a["s_task"], s_ctr=a["s_ctr"], s_amt=a["s_amt"],
        w_thr_src=a["w_thr_src"], w_off_src=a["w_off"],
    )


def _normalise_waits(thr: np.ndarray, off: np.ndarray, n: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Thresholds ``t <= 0`` on counters with ``N > 0`` rewritten as ``t' = t + k N`` in
    ``[1, N]`` with offset ``off - k``: the same absolute threshold ``(e + off) N + t`` in
    every epoch (``wait(c >= 0)`` is ``wait(c >= N @prev)``). Other waits are unchanged."""
    low = (thr <= 0) & (n > 0)
    if not low.any():
        return thr, off
    k = np.where(low, (n - thr) // np.maximum(n, 1), 0)
    return thr + k * n, off - k
