"""Structure checks of a ScheduleProgram, and the flat index the deeper checks run on.

``check_structure(prog, backend)`` walks the program once, checks every field against the
IR contract (ir/program.py, ir/ops.py) and, in the same pass, builds an :class:`Index`:
numpy arrays of tasks, regions, waits and signals that the deadlock, happens-before and
race checks use. It never raises on malformed input: every problem becomes a
:class:`~validator.verdict.Finding`. ``fatal`` is True when a problem makes the deeper
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

from ir.ops import OPS, squeeze
from ir.program import BUFFER_KINDS, COUNTER_WIDTHS, DTYPES, ScheduleProgram
from validator.verdict import Finding

BACKENDS = ("sim", "triton")
PERSISTENT_KINDS = ("weight", "kv_cache", "io_input")  # hold data before the epoch starts
OP_NAMES = list(OPS)
OP_ID = {n: i for i, n in enumerate(OP_NAMES)}
OP_PUT, OP_QUIET, OP_FENCE = OP_ID["put"], OP_ID["quiet"], OP_ID["fence"]
# int64-safe clamp of wait thresholds (module doc); N(c) < 2**62 or the counter overflows
THR_CLAMP_LOW, THR_CLAMP_HIGH = 1 << 61, 1 << 62
MAX_FINDINGS_PER_CLASS = 200  # report all classes; cap repeats of one class (count in stats)
USE_FAST_PATH = True  # tests switch it off to compare the two structure passes


def _is_int(x: Any) -> bool:
    return type(x) is int  # bool and float are not ints here


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
        """The concrete ``[[start, stop], ...]`` box of region ``j`` at ``slot`` (real axes only)."""
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


def _check_program(prog: Any, backend: str | None, out: _Collector) -> tuple[int, int, int, str]:
    ranks = getattr(prog, "ranks", None)
    workers = getattr(prog, "workers", None)
    slots = getattr(prog, "slots", None)
    max_epochs = getattr(prog, "max_epochs", None)
    if not _is_int(ranks) or ranks < 1:
        out.add("BadProgram", f"ranks must be a positive int, got {ranks!r}", fatal=True)
    if not _is_int(workers) or workers < 1:
        out.add("BadProgram", f"workers must be a positive int, got {workers!r}", fatal=True)
    if not _is_int(slots) or slots < 1:
        out.add("BadProgram", f"slots must be a positive int, got {slots!r}", fatal=True)
    if not _is_int(max_epochs) or max_epochs < 1:
        out.add("BadProgram", f"max_epochs must be a positive int, got {max_epochs!r}",
                fatal=True)
    for name in ("buffers", "counters", "tasks"):
        if not isinstance(getattr(prog, name, None), (list, tuple)):
            out.add("BadProgram", f"{name} must be a list", fatal=True)
    target = getattr(prog, "target", None)
    be = backend if backend is not None else getattr(target, "backend", None)
    if be not in BACKENDS:
        out.add("UnknownBackend", f"backend {be!r} is not one of {', '.join(BACKENDS)}",
                witness={"backend": be}, fatal=False)
    sms = getattr(target, "sms", None)
    mw = getattr(target, "max_workers", None)
    if not _is_int(sms) or sms < 1 or not _is_int(mw) or mw < 1:
        out.add("BadProgram", f"target needs positive int sms and max_workers, got sms={sms!r} "
                f"max_workers={mw!r}")
    elif _is_int(workers) and workers > mw:
        # The Triton runtime checks the exact limit (CTAs per SM of the compiled kernel x SMs)
        # again before its first launch; max_workers is the schedule's promise.
        out.add("TooManyWorkers",
                f"{workers} workers per rank exceed the co-residency limit {mw} "
                f"(target.max_workers): the persistent kernel's CTAs could not all be resident",
                witness={"workers": workers, "max_workers": mw, "sms": sms, "backend": be})
    ok = _is_int(ranks) and _is_int(workers) and _is_int(slots) and ranks >= 1 \
        and workers >= 1 and slots >= 1
    return (ranks if ok else 1, workers if ok else 1, slots if ok else 1, be)


def check_structure(prog: Any, backend: str | None = None) -> StructureResult:
    """Check ids, ranks, buffers, counters, regions, ops, dtypes, params and waits/signals.

    Returns the findings and, when nothing fatal was found, the :class:`Index`.
    Never raises on malformed programs (unexpected field types become findings).
    """
    out = _Collector()
    R, W, S, be = _check_program(prog, backend, out)
    if out.fatal:
        return StructureResult(out.findings, True, None, out.suppressed())
    max_epochs = prog.max_epochs

    # ---- buffers ----
    buf_id: dict[str, int] = {}
    buf_names, buf_kind, buf_dtype, buf_shape, buf_sym, buf_owner = [], [], [], [], [], []
    for b in prog.buffers:
        name = getattr(b, "name", None)
        if not isinstance(name, str) or not name:
            out.add("BadBuffer", f"buffer name must be a non-empty string, got {name!r}",
                    fatal=True)
            continue
        if name in buf_id:
            out.add("DuplicateBuffer", f"buffer {name} is declared twice", buffers=[name],
                    fatal=True)
            continue
        kind, dtype, shape = getattr(b, "kind", None), getattr(b, "dtype", None), \
            getattr(b, "shape", None)
        placement, brank = getattr(b, "placement", None), getattr(b, "rank", None)
        bad = []
        if kind not in BUFFER_KINDS:
            bad.append(f"kind {kind!r} is not one of {', '.join(BUFFER_KINDS)}")
        if dtype not in DTYPES:
            bad.append(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not isinstance(shape, (tuple, list)) or not shape or \
                not all(_is_int(d) and d >= 1 for d in shape):
            bad.append(f"shape must be a non-empty list of positive ints, got {shape!r}")
            shape = None
        if placement == "local":
            if not _is_int(brank) or not 0 <= brank < R:
                bad.append(f"local buffer owner rank {brank!r} is not in [0, {R})")
        elif placement == "symmetric":
            if brank is not None:
                bad.append(f"symmetric buffer must have rank None, got {brank!r}")
        else:
            bad.append(f"placement {placement!r} is not 'local' or 'symmetric'")
        if bad:
            out.add("BadBuffer", f"buffer {name}: " + "; ".join(bad), buffers=[name],
                    fatal=True)
            continue
        src = getattr(b, "source", None)
        if src is not None:
            _check_source(name, kind, tuple(shape), src, out)
        buf_id[name] = len(buf_names)
        buf_names.append(name)
        buf_kind.append(kind)
        buf_dtype.append(dtype)
        buf_shape.append(tuple(shape))
        buf_sym.append(placement == "symmetric")
        buf_owner.append(brank if placement == "local" else -1)

    # ---- counters ----
    ctr_id: dict[str, int] = {}
    ctr_names, ctr_rank, ctr_width = [], [], []
    for c in prog.counters:
        name = getattr(c, "name", None)
        if not isinstance(name, str) or not name:
            out.add("BadCounter", f"counter name must be a non-empty string, got {name!r}",
                    fatal=True)
            continue
        if name in ctr_id:
            out.add("DuplicateCounter", f"counter {name} is declared twice", fatal=True,
                    witness={"counter": name})
            continue
        crank, width = getattr(c, "rank", None), getattr(c, "width", None)
        if not _is_int(crank) or not 0 <= crank < R:
            out.add("BadCounter", f"counter {name}: owner rank {crank!r} is not in [0, {R})",
                    witness={"counter": name}, fatal=True)
            continue
        if width not in COUNTER_WIDTHS:
            out.add("BadCounter", f"counter {name}: width {width!r} is not one of "
                    f"{COUNTER_WIDTHS}", witness={"counter": name}, fatal=True)
            continue
        ctr_id[name] = len(ctr_names)
        ctr_names.append(name)
        ctr_rank.append(crank)
        ctr_width.append(width)

    # ---- tasks ----
    nb_axes = max((len(s) for s in buf_shape), default=1)
    if not out.fatal and USE_FAST_PATH:
        from validator.structure_fast import fast_tasks

        ok_be = np.asarray([be not in BACKENDS or be in OPS[n].backends for n in OP_NAMES])
        arrs = fast_tasks(prog, R, W, S, be, buf_id, buf_shape, buf_dtype, buf_sym,
                          buf_owner, ctr_id, ctr_rank, nb_axes, _check_params, ok_be)
        if arrs is not None:
            return _finish(prog, out, R, W, S, max_epochs, arrs, buf_names, buf_id, buf_kind,
                           buf_dtype, buf_shape, buf_sym, ctr_names, ctr_id, ctr_rank,
                           ctr_width)
    seen_ids: set[str] = set()
    task_ids: list[str] = []
    t_rank, t_worker, t_op, t_group = [], [], [], []
    r_task, r_out, r_buf, r_rank, r_operand = [], [], [], [], []
    lo_c, lo_k, hi_c, hi_k = [], [], [], []
    w_task, w_ctr, w_thr, w_off, w_thr_src = [], [], [], [], []
    s_task, s_ctr, s_amt = [], [], []
    pad = [0] * nb_axes
    pad1 = [1] * nb_axes
    shape_cache: dict[tuple, list[str]] = {}
    slot_last = S - 1

    for task in prog.tasks:
        tid = getattr(task, "id", None)
        if not isinstance(tid, str) or not tid:
            out.add("BadTask", f"task id must be a non-empty string, got {tid!r}", fatal=True)
            continue
        if tid in seen_ids:
            out.add("DuplicateTask", f"task id {tid} is used twice", tasks=[tid], fatal=True)
            continue
        seen_ids.add(tid)
        i = len(task_ids)
        trank, tworker, op = getattr(task, "rank", None), getattr(task, "worker", None), \
            getattr(task, "op", None)
        if not _is_int(trank) or not 0 <= trank < R:
            out.add("BadTask", f"task {tid}: rank {trank!r} is not in [0, {R})", tasks=[tid],
                    fatal=True)
            continue
        if not _is_int(tworker) or not 0 <= tworker < W:
            out.add("BadTask", f"task {tid}: worker {tworker!r} is not in [0, {W})",
                    tasks=[tid], fatal=True)
            continue
        spec = OPS.get(op) if isinstance(op, str) else None
        if spec is None:
            out.add("UnknownOp", f"task {tid}: op {op!r} is not an IR op", tasks=[tid],
                    witness={"op": op}, fatal=True)
            continue
        if be in BACKENDS and be not in spec.backends:
            out.add("UnsupportedOp", f"task {tid}: op {op} is not implemented by backend {be}",
                    tasks=[tid], witness={"op": op, "backend": be})
        group = getattr(task, "group", None)
        if group is not None and not isinstance(group, str):
            out.add("BadTask", f"task {tid}: group must be a string or null, got {group!r}",
                    tasks=[tid])
            group = None
        ins, outs = getattr(task, "ins", None), getattr(task, "outs", None)
        params, waits, signals = getattr(task, "params", None), getattr(task, "waits", None), \
            getattr(task, "signals", None)
        if not isinstance(ins, (tuple, list)) or not isinstance(outs, (tuple, list)) \
                or not isinstance(params, dict) or not isinstance(waits, (tuple, list)) \
                or not isinstance(signals, (tuple, list)):
            out.add("BadTask", f"task {tid}: ins, outs, waits and signals must be lists and "
                    f"params a dict", tasks=[tid], fatal=True)
            continue
        task_ids.append(tid)
        t_rank.append(trank)
        t_worker.append(tworker)
        t_op.append(OP_ID[op])
        t_group.append(group)

        # arity
        arity_ok = spec.arity_ok(len(ins), len(outs))
        if not arity_ok:
            out.add("BadArity", f"task {tid}: op {op} takes {spec.arity_text()}, "
                    f"got {len(ins)} and {len(outs)}",
                    tasks=[tid], witness={"op": op, "ins": len(ins), "outs": len(outs)})

        # regions
        shapes_ok = True
        in_shapes, in_dtypes, out_shapes, out_dtypes = [], [], [], []
        for is_out, regs in ((False, ins), (True, outs)):
            for k, reg in enumerate(regs):
                role = f"{'outs' if is_out else 'ins'}[{k}]"
                bname = getattr(reg, "buffer", None)
                bi = buf_id.get(bname) if isinstance(bname, str) else None
                if bi is None:
                    out.add("UnknownBuffer", f"task {tid}: {role} names unknown buffer "
                            f"{bname!r}", tasks=[tid], buffers=[str(bname)], fatal=True)
                    shapes_ok = False
                    continue
                shape = buf_shape[bi]
                rrank, ranges = getattr(reg, "rank", None), getattr(reg, "ranges", None)
                if not _is_int(rrank) or not 0 <= rrank < R:
                    out.add("BadRegion", f"task {tid}: {role} {bname}: rank {rrank!r} is not in "
                            f"[0, {R})", tasks=[tid], buffers=[bname], fatal=True)
                    shapes_ok = False
                    continue
                if not isinstance(ranges, (tuple, list)) or len(ranges) != len(shape):
                    n = len(ranges) if isinstance(ranges, (tuple, list)) else ranges
                    out.add("BadRegion", f"task {tid}: {role} {bname} has {n} ranges, the "
                            f"buffer has {len(shape)} axes", tasks=[tid], buffers=[bname],
                            fatal=True)
                    shapes_ok = False
                    continue
                lc, lk, hc, hk = [], [], [], []
                try:
                    for rg in ranges:
                        a, b = rg.start, rg.stop
                        lc.append(a.const)
                        lk.append(a.coef)
                        hc.append(b.const)
                        hk.append(b.coef)
                except AttributeError:
                    out.add("BadRegion", f"task {tid}: {role} {bname}: a range is not "
                            f"start/stop bounds", tasks=[tid], buffers=[bname], fatal=True)
                    shapes_ok = False
                    continue
                if not all(map(_is_int, lc + lk + hc + hk)):
                    out.add("BadRegion", f"task {tid}: {role} {bname}: bounds must be ints",
                            tasks=[tid], buffers=[bname], fatal=True)
                    shapes_ok = False
                    continue
                # bounds for every slot value: affine in s, so the two extreme slots suffice
                bad_axis = None
                for ax in range(len(shape)):
                    if lk[ax] != hk[ax]:
                        out.add("BadRegion", f"task {tid}: {role} {bname}: axis {ax} extent "
                                f"changes with the slot (start coef {lk[ax]}, stop coef "
                                f"{hk[ax]})", tasks=[tid], buffers=[bname], fatal=True)
                        bad_axis = ax
                        break
                    for s in ((0, slot_last) if slot_last else (0,)):
                        lo, hi = lc[ax] + lk[ax] * s, hc[ax] + hk[ax] * s
                        if not 0 <= lo < hi <= shape[ax]:
                            out.add("RegionOutOfBounds",
                                    f"task {tid}: {role} {bname} axis {ax} = [{lo}:{hi}) at slot "
                                    f"{s} is outside [0:{shape[ax]}) or empty", tasks=[tid],
                                    buffers=[bname],
                                    witness={"task": tid, "operand": role, "buffer": bname,
                                             "axis": ax, "slot": s, "range": [lo, hi],
                                             "dim": shape[ax]}, fatal=True)
                            bad_axis = ax
                            break
                    if bad_axis is not None:
                        break
                if bad_axis is not None:
                    shapes_ok = False
                    continue
                sym = buf_sym[bi]
                if is_out and op == "put" and not sym:
                    out.add("BadRegion", f"task {tid}: put destination {bname} is not a "
                            f"symmetric buffer (NVSHMEM puts address the symmetric heap)",
                            tasks=[tid], buffers=[bname])
                if is_out:
                    if rrank != trank and not sym:
                        out.add("RemoteWriteToLocal", f"task {tid}: {role} writes local buffer "
                                f"{bname} of rank {buf_owner[bi]} from rank {trank}; only "
                                f"symmetric buffers can be written remotely", tasks=[tid],
                                buffers=[bname], witness={"task_rank": trank,
                                                          "region_rank": rrank})
                    elif not sym and rrank != buf_owner[bi]:
                        out.add("BadRegion", f"task {tid}: {role} {bname} is local to rank "
                                f"{buf_owner[bi]} but the region names rank {rrank}",
                                tasks=[tid], buffers=[bname], fatal=True)
                else:
                    if rrank != trank or (not sym and buf_owner[bi] != trank):
                        owner = rrank if sym else buf_owner[bi]
                        out.add("RemoteRead", f"task {tid}: {role} reads {bname} on rank "
                                f"{owner} from rank {trank}; a task reads only its own rank's "
                                f"memory", tasks=[tid], buffers=[bname],
                                witness={"task_rank": trank, "region_rank": owner})
                    if not sym and rrank != buf_owner[bi]:
                        out.add("BadRegion", f"task {tid}: {role} {bname} is local to rank "
                                f"{buf_owner[bi]} but the region names rank {rrank}",
                                tasks=[tid], buffers=[bname], fatal=True)
                ext = tuple(hc[ax] - lc[ax] for ax in range(len(shape)))
                if is_out:
                    out_shapes.append(squeeze(ext))
                    out_dtypes.append(buf_dtype[bi])
                else:
                    in_shapes.append(squeeze(ext))
                    in_dtypes.append(buf_dtype[bi])
                n = len(shape)
                r_task.append(i)
                r_out.append(is_out)
                r_buf.append(bi)
                r_rank.append(rrank)
                r_operand.append(k)
                lo_c.append(lc + pad[n:])
                lo_k.append(lk + pad[n:])
                hi_c.append(hc + pad1[n:])
                hi_k.append(hk + pad[n:])

        # dtypes (per operand role), params, op shape check
        if arity_ok and shapes_ok:
            for k, dt in enumerate(in_dtypes):
                if dt not in spec.dtypes_for_in(k):
                    out.add("BadDtype", f"task {tid}: op {op} input {k} must be one of "
                            f"{'/'.join(spec.dtypes_for_in(k))}, got {dt}", tasks=[tid],
                            witness={"operand": f"ins[{k}]", "dtype": dt})
            for k, dt in enumerate(out_dtypes):
                if dt not in spec.dtypes_for_out(k):
                    out.add("BadDtype", f"task {tid}: op {op} output {k} must be one of "
                            f"{'/'.join(spec.dtypes_for_out(k))}, got {dt}", tasks=[tid],
                            witness={"operand": f"outs[{k}]", "dtype": dt})
            perr = _check_params(spec, params)
            for msg in perr:
                out.add("BadParams", f"task {tid}: {msg}", tasks=[tid],
                        witness={"params": _jsonable(params)})
            if spec.check is not None and not perr:
                try:
                    key = (op, tuple(in_shapes), tuple(in_dtypes), tuple(out_shapes),
                           tuple(out_dtypes), tuple(sorted(params.items())) if params else ())
                    msgs = shape_cache.get(key)
                except TypeError:  # unhashable param value: already a BadParams above
                    key, msgs = None, None
                if msgs is None:
                    try:
                        msgs = spec.check(in_shapes, in_dtypes, out_shapes, out_dtypes, params)
                    except Exception as exc:  # a check must not crash the validator
                        msgs = [f"{op}: shape check failed on these operands ({exc!r})"]
                    if key is not None:
                        shape_cache[key] = msgs
                for msg in msgs:
                    cls = "BadParams" if "param" in msg else "ShapeMismatch"
                    out.add(cls, f"task {tid}: {msg}", tasks=[tid],
                            witness={"op": op, "in_shapes": [list(s) for s in in_shapes],
                                     "out_shapes": [list(s) for s in out_shapes],
                                     "params": _jsonable(params)})

        # waits and signals
        for k, w in enumerate(waits):
            cname, thr, off = getattr(w, "counter", None), getattr(w, "threshold", None), \
                getattr(w, "offset", None)
            ci = ctr_id.get(cname) if isinstance(cname, str) else None
            if ci is None:
                out.add("UnknownCounter", f"task {tid}: waits on unknown counter {cname!r}",
                        tasks=[tid], witness={"counter": cname}, fatal=True)
                continue
            if not _is_int(thr) or off not in (0, -1) or not _is_int(off):
                out.add("BadWait", f"task {tid}: wait on {cname} needs an int threshold and "
                        f"offset 0 or -1, got threshold={thr!r} offset={off!r}", tasks=[tid],
                        fatal=True)
                continue
            if ctr_rank[ci] != trank:
                out.add("RemoteWait", f"task {tid} on rank {trank} waits on counter {cname} "
                        f"owned by rank {ctr_rank[ci]}; a task may only wait on its own rank's "
                        f"counters", tasks=[tid], witness={"counter": cname,
                                                            "owner": ctr_rank[ci]})
            w_task.append(i)
            w_ctr.append(ci)
            w_thr.append(min(max(thr, -THR_CLAMP_LOW), THR_CLAMP_HIGH))
            w_thr_src.append(thr)
            w_off.append(off)
        for k, sg in enumerate(signals):
            cname, amt = getattr(sg, "counter", None), getattr(sg, "amount", None)
            ci = ctr_id.get(cname) if isinstance(cname, str) else None
            if ci is None:
                out.add("UnknownCounter", f"task {tid}: signals unknown counter {cname!r}",
                        tasks=[tid], witness={"counter": cname}, fatal=True)
                continue
            if not _is_int(amt):
                out.add("BadSignal", f"task {tid}: signal amount to {cname} must be an int, "
                        f"got {amt!r}", tasks=[tid], fatal=True)
                continue
            if amt <= 0:
                out.add("NonMonotoneCounter", f"task {tid}: signal {cname} += {amt}: counters "
                        f"are monotone, an amount <= 0 is a reset or decrement", tasks=[tid],
                        witness={"counter": cname, "amount": amt}, fatal=True)
                continue
            s_task.append(i)
            s_ctr.append(ci)
            s_amt.append(amt)

    nreg = len(r_task)

    def arr2(x):
        return np.asarray(x, dtype=np.int64).reshape(nreg, nb_axes)

    arrs = dict(task_ids=task_ids, t_rank=np.asarray(t_rank, dtype=np.int64),
                t_worker=np.asarray(t_worker, dtype=np.int64),
                t_op=np.asarray(t_op, dtype=np.int64), t_group=t_group,
                r_task=np.asarray(r_task, dtype=np.int64), r_out=np.asarray(r_out, dtype=bool),
                r_buf=np.asarray(r_buf, dtype=np.int64), r_rank=np.asarray(r_rank, dtype=np.int64),
                r_operand=np.asarray(r_operand, dtype=np.int64),
                lo_c=arr2(lo_c), lo_k=arr2(lo_k), hi_c=arr2(hi_c), hi_k=arr2(hi_k),
                w_task=np.asarray(w_task, dtype=np.int64), w_ctr=np.asarray(w_ctr, dtype=np.int64),
                w_thr=np.asarray(w_thr, dtype=np.int64), w_off=np.asarray(w_off, dtype=np.int64),
                w_thr_src=w_thr_src,
                s_task=np.asarray(s_task, dtype=np.int64), s_ctr=np.asarray(s_ctr, dtype=np.int64),
                s_amt=np.asarray(s_amt, dtype=np.int64))
    return _finish(prog, out, R, W, S, max_epochs, arrs, buf_names, buf_id, buf_kind,
                   buf_dtype, buf_shape, buf_sym, ctr_names, ctr_id, ctr_rank, ctr_width)


def _finish(prog, out, R, W, S, max_epochs, a, buf_names, buf_id, buf_kind, buf_dtype,
            buf_shape, buf_sym, ctr_names, ctr_id, ctr_rank, ctr_width) -> StructureResult:
    """Counter totals and overflow, queue positions, and the Index (if nothing is fatal)."""
    s_ctr, s_amt = a["s_ctr"], a["s_amt"]
    ctr_n = np.zeros(len(ctr_names), dtype=np.int64)
    if len(s_ctr):
        if int(s_amt.max()) < (1 << 40) and len(s_amt) < (1 << 20):
            ctr_n = np.bincount(s_ctr, weights=s_amt.astype(np.float64),
                                minlength=len(ctr_names))
            ctr_n = np.rint(ctr_n).astype(np.int64)
        else:
            ctr_n = _exact_totals(s_ctr.tolist(), s_amt.tolist(), len(ctr_names))
    for ci, name in enumerate(ctr_names):
        n = int(ctr_n[ci])
        if n and n * (max_epochs + 1) > (1 << (ctr_width[ci] - 1)) - 1:
            out.add("CounterOverflow", f"counter {name}: {n} per step x (max_epochs "
                    f"{max_epochs} + 1) = {n * (max_epochs + 1)} exceeds the signed "
                    f"{ctr_width[ci]}-bit range", witness={"counter": name, "per_epoch": n,
                                                           "max_epochs": max_epochs,
                                                           "width": ctr_width[ci]},
                    fatal=n >= (1 << 62))  # beyond int64 arithmetic: no deeper analysis
    if out.fatal:
        return StructureResult(out.findings, True, None, out.suppressed())
    task_ids = a["task_ids"]
    t_rank_a, t_worker_a = a["t_rank"], a["t_worker"]
    t_chain = t_rank_a * W + t_worker_a
    n_chains = R * W
    order = np.argsort(t_chain, kind="stable")
    chain_len = np.bincount(t_chain, minlength=n_chains).astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(chain_len)))
    t_qpos = np.empty(len(task_ids), dtype=np.int64)
    t_qpos[order] = np.arange(len(task_ids)) - np.repeat(starts[:-1], chain_len)
    chain_tasks = [order[starts[c]:starts[c + 1]] for c in range(n_chains)]
    ctr_n = np.asarray(ctr_n, dtype=np.int64)
    w_thr, w_off = _normalise_waits(a["w_thr"], a["w_off"], ctr_n[a["w_ctr"]])
    idx = Index(
        prog=prog, ranks=R, workers=W, slots=S, task_ids=task_ids, t_rank=t_rank_a,
        t_worker=t_worker_a, t_chain=t_chain, t_qpos=t_qpos, t_op=a["t_op"],
        t_group=a["t_group"], chain_len=chain_len, chain_tasks=chain_tasks,
        buf_names=buf_names, buf_id=buf_id, buf_kind=buf_kind, buf_dtype=buf_dtype,
        buf_shape=buf_shape, buf_sym=np.asarray(buf_sym, dtype=bool),
        buf_persistent=np.asarray([k in PERSISTENT_KINDS for k in buf_kind], dtype=bool),
        ctr_names=ctr_names, ctr_id=ctr_id, ctr_rank=np.asarray(ctr_rank, dtype=np.int64),
        ctr_width=np.asarray(ctr_width, dtype=np.int64), ctr_n=ctr_n,
        r_task=a["r_task"], r_out=a["r_out"], r_buf=a["r_buf"], r_rank=a["r_rank"],
        r_operand=a["r_operand"], lo_c=a["lo_c"], lo_k=a["lo_k"], hi_c=a["hi_c"],
        hi_k=a["hi_k"], w_task=a["w_task"], w_ctr=a["w_ctr"], w_thr=w_thr,
        w_off=w_off, s_task=a["s_task"], s_ctr=a["s_ctr"], s_amt=a["s_amt"],
        w_thr_src=a.get("w_thr_src", a["w_thr"]), w_off_src=a["w_off"],
    )
    return StructureResult(out.findings, False, idx, out.suppressed())


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


def _exact_totals(s_ctr, s_amt, n):
    tot = [0] * n
    for c, a in zip(s_ctr, s_amt):
        tot[c] += a
    return np.asarray(tot, dtype=object)


def _check_params(spec, params: dict) -> list[str]:
    """Required params present with the declared type; every value an int, float or str."""
    errs = []
    for k, v in params.items():
        if not isinstance(k, str):
            errs.append(f"param name {k!r} is not a string")
        elif not isinstance(v, (int, float, str)):
            errs.append(f"param {k} has type {type(v).__name__}; params are int, float or str")
        elif isinstance(v, float) and not math.isfinite(v):
            errs.append(f"param {k} = {v!r} is not finite")
    for group, required in ((spec.params, True), (spec.optional_params, False)):
        for k, typ in group.items():
            if k not in params:
                if required:
                    errs.append(f"op {spec.name} needs param {k} ({typ.__name__})")
                continue
            v = params[k]
            if typ is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            elif typ is int:
                ok = _is_int(v)
            else:
                ok = isinstance(v, typ)
            if not ok:
                errs.append(f"param {k} of op {spec.name} must be {typ.__name__}, got {v!r}")
    return errs


def _check_source(name: str, kind: str, shape: tuple[int, ...], src: Any, out: _Collector):
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
        if not isinstance(rg, (tuple, list)) or len(rg) != 2 or not all(map(_is_int, rg)) \
                or not 0 <= rg[0] < rg[1]:
            out.add("BadWeightSource", f"buffer {name}: source range {rg!r} is not "
                    f"0 <= start < stop", buffers=[name], witness={"key": key})
            return
        ext.append(rg[1] - rg[0])
    n = 1
    for e in ext:
        n *= e
    m = 1
    for d in shape:
        m *= d
    if n != m:
        out.add("BadWeightSource", f"buffer {name}: source slice {list(ranges)} of {key} holds "
                f"{n} elements, the buffer {m}", buffers=[name],
                witness={"key": key, "slice_extents": ext, "shape": list(shape)})


def _jsonable(d: Any) -> Any:
    if isinstance(d, dict):
        return {str(k): _jsonable(v) for k, v in d.items()}
    if isinstance(d, (int, str)) or d is None:
        return d
    if isinstance(d, float):
        return d if math.isfinite(d) else repr(d)
    return repr(d)
