"""The ``sim`` backend: a CPU reference executor of ScheduleProgram in torch.

It runs a program for R simulated ranks (NVSHMEM PEs) x W workers (CTAs) with the
semantics of ir/program.py's docstring, in an interleaving chosen by a policy and a seed,
reading and writing exactly the regions the GPU would. Ops are computed by
lowering/reference.py. See docs/sim.md for the user-level description.

Model of execution
------------------
* Memory: one tensor per (buffer, rank) holding a copy: a local buffer has one copy on its
  owner, a symmetric buffer one copy on every rank. Unwritten float memory is NaN, unwritten
  int32 memory is ``INT_POISON``, so reading before writing shows up in the result.
* Queues: worker (r, w) runs its tasks in list order. The head task is *ready* when every
  wait ``c >= t`` (offset o) holds: ``value(c) >= (e + o) * N(c) + t`` for the rank's current
  epoch e. Ready heads are picked by the policy; running one is atomic.
* A running task reads its ``ins`` (own rank), computes, and writes ``outs``. Writes to the
  own rank land at once. Writes to another rank's copy of a symmetric buffer (puts) become
  *pending* deliveries holding a snapshot of the data taken when the task ran. Signals to
  counters of the own rank apply when the task completes; signals to other ranks' counters
  are pending too.
* A pending op may be delivered (data copied / amount added) at any later point, subject
  to NVSHMEM's ordering rules (nvshmem_put_signal, nvshmem_fence, nvshmem_quiet):
    - put-with-signal: a task's signal to a counter owned by rank d is delivered after all
      of that task's data bound for d;
    - fence: an op issued after a ``fence`` on a worker is delivered after every op the
      worker issued before that fence to the same destination rank;
    - quiet: a ``quiet`` task delivers every pending op of its worker before it completes;
    - kernel end: when a rank finishes an epoch, every op its workers issued is delivered
      before that rank starts the next epoch.
  Nothing else orders deliveries: signals may overtake unordered puts.
* Epochs: ``step(e)`` runs epoch e on every rank to completion. ``run_steps(n)`` runs n
  epochs with the ranks free to drift apart (rank r starts epoch e+1 as soon as its own
  epoch e finished), which is how the GPU runs consecutive launches. Counters persist and
  are monotone; thresholds are epoch-relative.

Policies
--------
``in_order``     deterministic: always the lowest (rank, worker) ready queue; pending ops
                 are delivered the moment they are issued.
``random``       seeded: a random ready queue; with probability ``deliver_p`` a random
                 deliverable pending op is delivered instead, so puts and signals land at
                 random later points.
``adversarial``  seeded: ranks (and workers) in a fixed random priority order, so the
                 leading rank runs as far ahead as its waits allow (ranks skewed, across
                 epochs in ``run_steps``); pending ops are delivered only when nothing else
                 can run, then one *signal* at a time with only the data the rules force
                 out before it; all other data stays pending until a quiet or the kernel
                 end. A reader that relies on anything weaker than the rules sees stale or
                 poisoned data.
"""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ir.ops import OPS, scale_index
from ir.program import FLOAT_DTYPES, Buffer, Region, ScheduleProgram
from lowering.executors import StepThroughput, TaskFailure, check_steps
from lowering.reference import INT_POISON, ReferenceOpError, op_impl, torch_dtype

POLICIES = ("in_order", "random", "adversarial")

InitFn = Callable[[Buffer, int], "torch.Tensor | None"]
EpochHook = Callable[[int, int], None]
DTYPE_SET = frozenset(("bf16", "f16", "f32", "i32", "i8", "f8e4m3"))


class SimError(RuntimeError):
    """The simulator cannot run the program (malformed program, bad input, failed op)."""


class SimRefused(SimError):
    """The validator rejected the program and ``check=True``. ``verdict`` holds its findings."""

    def __init__(self, verdict: Any):
        self.verdict = verdict
        errs = getattr(verdict, "errors", [])
        head = "; ".join(f"{f.cls}: {f.message}" for f in errs[:3])
        more = f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""
        super().__init__(f"the validator rejected the program ({len(errs)} errors): {head}{more}")


class SimDeadlock(SimError):
    """No queue can make progress and no pending op can unblock one.

    ``blocked``: one dict per stuck queue (rank, worker, epoch, task, counter, value,
    needed); ``counters``: every counter's value at the time.
    """

    def __init__(self, message: str, blocked: list[dict[str, Any]], counters: dict[str, int]):
        super().__init__(message)
        self.blocked = blocked
        self.counters = counters


class SimTaskError(TaskFailure, SimError):
    """An op failed while the simulator ran task ``task`` in ``epoch``."""


@dataclass
class SimStats(StepThroughput):
    """What one ``step`` / ``run_steps`` call did.

    ``seconds`` is wall-clock time of the call; ``tasks`` counts executed tasks over all
    ranks; deliveries count pending ops delivered (data puts and remote signals);
    ``max_pending`` is the largest number of simultaneously pending ops.
    """

    epochs: list[int] = field(default_factory=list)
    policy: str = "random"
    seed: int = 0
    tasks: int = 0
    data_deliveries: int = 0
    signal_deliveries: int = 0
    max_pending: int = 0
    seconds: float = 0.0


# Task kinds.
_COMPUTE, _QUIET, _FENCE, _NOP = 0, 1, 2, 3


class _CTask:
    """A task compiled for execution: views per slot, counter indices, signal routing."""

    __slots__ = ("id", "rank", "worker", "op", "params", "fn", "kind", "waits", "local_sigs",
                 "remote_sigs", "ins", "outs", "remote")

    def __init__(self):
        self.remote: list[tuple[tuple[int, int, torch.Tensor], ...]] = []


class _Pending:
    """An undelivered remote op: data (``view`` <- ``data``) or a signal (``cidx`` += ``amount``)."""

    __slots__ = ("q", "dst", "is_sig", "view", "data", "cidx", "amount", "fence", "task_seq")

    def __init__(self, q, dst, is_sig, view, data, cidx, amount, fence, task_seq):
        self.q, self.dst, self.is_sig = q, dst, is_sig
        self.view, self.data, self.cidx, self.amount = view, data, cidx, amount
        self.fence, self.task_seq = fence, task_seq

    def must_follow(self, other: "_Pending") -> bool:
        """Whether this op may only be delivered after ``other`` (issued earlier, same worker)."""
        if other.dst != self.dst:
            return False
        if other.fence < self.fence:  # nvshmem_fence: per destination PE
            return True
        # nvshmem_put_signal: the task's signal to PE d follows its own data to PE d.
        return self.is_sig and not other.is_sig and other.task_seq == self.task_seq


def _resolve_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be a float dtype (f32, bf16, f16), got {dtype}")
        return dtype
    if dtype in FLOAT_DTYPES:
        return torch_dtype(dtype)
    raise ValueError(f"dtype must be None, 'f32', 'bf16', 'f16' or a torch float dtype, got {dtype!r}")


class SimExecutor:
    """Run a ScheduleProgram on the CPU for all its ranks and workers.

    ``init_fn(buffer, rank)`` gives a buffer's initial contents on a rank (any shape with
    the buffer's element count; converted to the storage dtype) or None: the copy starts
    poisoned (NaN / ``INT_POISON``). Weight buffers that no task writes may share the
    returned tensor between ranks (no copy); everything else is copied.

    ``seed`` and ``policy`` (``in_order``, ``random``, ``adversarial``; see the module
    docstring) choose the interleaving. ``check=True`` runs ``validator.validate`` first and
    raises SimRefused if it rejects the program (SimError if the validator cannot be
    imported); ``check=False`` runs anything structurally executable (used to test the
    validator and to show what bad schedules do). ``dtype`` (None, ``"f32"``, ``"bf16"``,
    ``"f16"``) overrides the storage dtype of float buffers, e.g. ``"f32"`` runs a bf16
    schedule without rounding; buffers an op requires in f32 (rope inv_freq, argmax pairs)
    stay f32. ``deliver_p``: for ``random``, the probability of delivering a pending op
    instead of running a task. ``threads``: torch intra-op threads while a step runs
    (restored afterwards); 1 by default because the tasks are small ops for which thread-pool
    synchronisation costs more than it saves (on a busy 2-core machine a 64x576 GEMV took
    ~0.7 ms with 2 threads and ~3 us with 1); None leaves torch's setting alone.

    Raises SimError (a subclass) for a program the simulator cannot execute: unknown op or
    buffer, operand count, region out of bounds, reading another rank's memory, writing a
    remote copy of a local buffer, waiting on a counter of another rank.
    """

    def __init__(self, program: ScheduleProgram, init_fn: InitFn | None = None, *, seed: int = 0,
                 policy: str = "random", check: bool = True, dtype: Any = None,
                 deliver_p: float = 0.5, threads: int | None = 1):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not 0.0 <= deliver_p <= 1.0:
            raise ValueError(f"deliver_p must be in [0, 1], got {deliver_p}")
        if check:
            self._check(program)
        self.program = program
        self.policy = policy
        self.seed = seed
        self.deliver_p = deliver_p
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self.threads = threads
        self._rng = random.Random(seed)
        self._override = _resolve_dtype(dtype)
        self.R, self.W = program.ranks, program.workers
        self.slots = max(1, program.slots)
        self._bufs = program.buffer_map()
        self._structure()
        self._alloc(init_fn)
        self._compile()
        self._counters = [0] * len(self._cnames)
        self._next_epoch = 0
        self._broken: str | None = None
        # Priority of each queue for in_order / adversarial (lower runs first).
        if policy == "adversarial":
            rank_order = list(range(self.R))
            self._rng.shuffle(rank_order)
            rank_prio = {r: i for i, r in enumerate(rank_order)}
            self._prio = []
            for r in range(self.R):
                wo = list(range(self.W))
                self._rng.shuffle(wo)
                wp = {w: i for i, w in enumerate(wo)}
                self._prio.extend(rank_prio[r] * self.W + wp[w] for w in range(self.W))
        else:
            self._prio = list(range(self.R * self.W))

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _check(program: ScheduleProgram) -> None:
        try:
            from validator import validate  # lazy: the validator is a separate package
        except ImportError as e:
            raise SimError(
                f"check=True needs validator.validate, which cannot be imported ({e}); "
                "pass check=False to run an unvalidated program") from e
        if not callable(validate):
            raise SimError("check=True needs validator.validate, which is not a function here; "
                           "pass check=False to run an unvalidated program")
        verdict = validate(program)
        if not verdict.ok:
            raise SimRefused(verdict)

    def _structure(self) -> None:
        """Refuse what cannot be executed safely (torch slicing would silently clamp)."""
        p = self.program
        if self.R < 1 or self.W < 1:
            raise SimError(f"program has {self.R} ranks and {self.W} workers; need at least 1 each")
        if p.max_epochs < 1:
            raise SimError(f"program max_epochs is {p.max_epochs}")
        cmap = p.counter_map()
        for b in p.buffers:
            if b.dtype not in DTYPE_SET:
                raise SimError(f"buffer {b.name}: unknown dtype {b.dtype!r}")
            if b.placement not in ("local", "symmetric"):
                raise SimError(f"buffer {b.name}: unknown placement {b.placement!r}")
            if b.placement == "local" and (b.rank is None or not 0 <= b.rank < self.R):
                raise SimError(f"buffer {b.name}: local buffer owned by rank {b.rank}, program has {self.R} ranks")
            if any(d < 0 for d in b.shape):
                raise SimError(f"buffer {b.name}: negative extent in shape {b.shape}")
        if len(self._bufs) != len(p.buffers):
            raise SimError("duplicate buffer names")
        if len(cmap) != len(p.counters):
            raise SimError("duplicate counter names")
        for c in p.counters:
            if not 0 <= c.rank < self.R:
                raise SimError(f"counter {c.name}: owner rank {c.rank} out of range")
        for t in p.tasks:
            where = f"task {t.id}"
            if not (0 <= t.rank < self.R and 0 <= t.worker < self.W):
                raise SimError(f"{where}: (rank {t.rank}, worker {t.worker}) outside {self.R}x{self.W}")
            spec = OPS.get(t.op)
            if spec is None:
                raise SimError(f"{where}: unknown op {t.op!r}")
            if not spec.arity_ok(len(t.ins), len(t.outs)):
                raise SimError(f"{where}: op {t.op} takes {spec.arity_text()}, "
                               f"got {len(t.ins)} and {len(t.outs)}")
            if spec.scaled and len(t.ins) > spec.max_ins and scale_index(
                    spec, [self._bufs[r.buffer].dtype if r.buffer in self._bufs else "" for r in t.ins]) is None:
                raise SimError(f"{where}: op {t.op} takes at most {spec.max_ins} inputs with a float weight "
                               f"(only a quantized weight takes a scale), got {len(t.ins)}")
            for role, regs in (("in", t.ins), ("out", t.outs)):
                for reg in regs:
                    self._check_region(where, role, t.rank, reg)
            for w in t.waits:
                c = cmap.get(w.counter)
                if c is None:
                    raise SimError(f"{where}: waits on unknown counter {w.counter!r}")
                if c.rank != t.rank:
                    raise SimError(f"{where}: waits on counter {c.name} of rank {c.rank} (only own-rank counters)")
                if w.offset not in (0, -1):
                    raise SimError(f"{where}: wait offset {w.offset} (must be 0 or -1)")
            for s in t.signals:
                if s.counter not in cmap:
                    raise SimError(f"{where}: signals unknown counter {s.counter!r}")
                if s.amount < 0:
                    raise SimError(f"{where}: negative signal amount {s.amount} (counters are monotone)")

    def _check_region(self, where: str, role: str, task_rank: int, reg: Region) -> None:
        b = self._bufs.get(reg.buffer)
        if b is None:
            raise SimError(f"{where}: {role} region names unknown buffer {reg.buffer!r}")
        if len(reg.ranges) != len(b.shape):
            raise SimError(f"{where}: {role} region of {b.name} has {len(reg.ranges)} ranges, buffer has {len(b.shape)} axes")
        if not 0 <= reg.rank < self.R:
            raise SimError(f"{where}: {role} region of {b.name} addresses rank {reg.rank}")
        if b.placement == "local" and reg.rank != b.rank:
            raise SimError(f"{where}: {role} region addresses rank {reg.rank} of local buffer {b.name} (owner {b.rank})")
        if role == "in" and reg.rank != task_rank:
            raise SimError(f"{where}: reads {b.name} on rank {reg.rank}; a task reads only its own rank's memory")
        for slot in range(self.slots if reg.symbolic else 1):
            for axis, ((a, z), dim) in enumerate(zip(reg.concrete(slot), b.shape)):
                if not 0 <= a <= z <= dim:
                    raise SimError(f"{where}: {role} region {b.name}[axis {axis}: {a}:{z}] (slot {slot}) "
                                   f"outside the buffer's extent {dim}")

    def _storage_dtype(self, b: Buffer, pinned: set[str]) -> torch.dtype:
        base = torch_dtype(b.dtype)
        if self._override is None or b.dtype not in FLOAT_DTYPES or b.name in pinned:
            return base
        return self._override

    def _alloc(self, init_fn: InitFn | None) -> None:
        p = self.program
        pinned: set[str] = set()  # buffers an op role requires in f32
        written: set[str] = set()
        for t in p.tasks:
            spec = OPS[t.op]
            for i, reg in enumerate(t.ins):
                if spec.dtypes_for_in(i) == ("f32",):
                    pinned.add(reg.buffer)
            si = scale_index(spec, [self._bufs[r.buffer].dtype for r in t.ins]) if spec.scaled else None
            if si is not None:  # a quantized weight's scales stay f32 whatever the override
                pinned.add(t.ins[si].buffer)
            for i, reg in enumerate(t.outs):
                written.add(reg.buffer)
                if spec.dtypes_for_out(i) == ("f32",):
                    pinned.add(reg.buffer)
        self._mem: dict[tuple[str, int], torch.Tensor] = {}
        self._shared: set[tuple[str, int]] = set()  # storage owned by the caller's tensor
        for b in p.buffers:
            dt = self._storage_dtype(b, pinned)
            ranks = range(self.R) if b.placement == "symmetric" else [b.rank]
            for r in ranks:
                init = init_fn(b, r) if init_fn is not None else None
                if init is None:
                    fill = (float("nan") if dt.is_floating_point else
                            -128 if dt is torch.int8 else INT_POISON)
                    t = torch.full(b.shape, fill, dtype=dt)
                else:
                    if not isinstance(init, torch.Tensor):
                        raise SimError(f"init_fn returned {type(init).__name__} for buffer {b.name} rank {r}; "
                                       "expected a torch.Tensor or None")
                    if init.numel() != b.numel:
                        raise SimError(f"init_fn gave {tuple(init.shape)} ({init.numel()} elements) for buffer "
                                       f"{b.name} rank {r} of shape {b.shape}")
                    share = b.kind == "weight" and b.name not in written
                    t = init.detach().reshape(b.shape).to(device="cpu", dtype=dt)
                    if t.data_ptr() == init.data_ptr():
                        if share:
                            self._shared.add((b.name, r))
                        else:
                            t = t.clone()
                self._mem[(b.name, r)] = t

    def _view(self, reg: Region, slot: int, cache: dict) -> torch.Tensor:
        key = (reg, slot if reg.symbolic else 0)
        v = cache.get(key)
        if v is None:
            base = self._mem[(reg.buffer, reg.rank)]
            v = base[tuple(slice(a, z) for a, z in reg.concrete(slot))]
            cache[key] = v
        return v

    def _compile(self) -> None:
        p = self.program
        self._cnames = [c.name for c in p.counters]
        cidx = {n: i for i, n in enumerate(self._cnames)}
        cowner = [c.rank for c in p.counters]
        n_per_epoch = p.signals_per_epoch()
        cache: dict = {}
        self._tasks: list[_CTask] = []
        self._queues: list[list[int]] = [[] for _ in range(self.R * self.W)]
        for t in p.tasks:
            ct = _CTask()
            ct.id, ct.rank, ct.worker, ct.op = t.id, t.rank, t.worker, t.op
            ct.params = dict(t.params)
            ct.fn = op_impl(t.op)
            ct.kind = {"quiet": _QUIET, "fence": _FENCE, "nop": _NOP}.get(t.op, _COMPUTE)
            ct.waits = tuple((cidx[w.counter], n_per_epoch[w.counter],
                              w.offset * n_per_epoch[w.counter] + w.threshold) for w in t.waits)
            ct.local_sigs = tuple((cidx[s.counter], s.amount) for s in t.signals
                                  if cowner[cidx[s.counter]] == t.rank)
            ct.remote_sigs = tuple((cidx[s.counter], s.amount, cowner[cidx[s.counter]]) for s in t.signals
                                   if cowner[cidx[s.counter]] != t.rank)
            ct.ins, ct.outs, ct.remote = [], [], []
            for slot in range(self.slots):
                ct.ins.append(tuple(self._view(r, slot, cache) for r in t.ins))
                ct.outs.append(tuple(self._view(r, slot, cache) for r in t.outs))
                ct.remote.append(tuple((i, r.rank, ct.outs[slot][i]) for i, r in enumerate(t.outs)
                                       if r.rank != t.rank))
            self._tasks.append(ct)
            self._queues[t.rank * self.W + t.worker].append(len(self._tasks) - 1)

    # ------------------------------------------------------------- public API
    def read(self, buffer: str, rank: int) -> torch.Tensor:
        """A copy of ``buffer``'s contents on ``rank`` (storage dtype, the buffer's shape)."""
        return self._tensor(buffer, rank).clone()

    def write(self, buffer: str, rank: int, value: torch.Tensor) -> None:
        """Overwrite ``buffer`` on ``rank`` with ``value`` (same element count; cast to the
        storage dtype). Call between steps (e.g. token and position inputs)."""
        t = self._tensor(buffer, rank)
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value.numel() != t.numel():
            raise SimError(f"write {buffer}@{rank}: value has {value.numel()} elements, buffer {t.numel()}")
        if (buffer, rank) in self._shared:
            # Never write through into the caller's weight tensor: take a private copy and
            # rebuild the task views that pointed at the shared storage.
            self._shared.discard((buffer, rank))
            self._mem[(buffer, rank)] = t = t.clone()
            self._compile()
        t.copy_(value.detach().reshape(t.shape))

    def counter_values(self) -> dict[str, int]:
        """Current value of every counter (monotone across steps)."""
        return dict(zip(self._cnames, self._counters))

    @property
    def next_epoch(self) -> int:
        """The epoch the next ``step`` must run (epochs run in order from 0)."""
        return self._next_epoch

    def step(self, epoch: int) -> SimStats:
        """Run decode step ``epoch`` on every rank to completion (all pending ops delivered).

        Epochs must be run in order starting at 0 (counters start at 0 and thresholds are
        epoch-relative). Raises SimDeadlock if the queues get stuck, SimTaskError if an op
        fails, ValueError for an out-of-order epoch.
        """
        if epoch != self._next_epoch:
            raise ValueError(f"epochs run in order: expected epoch {self._next_epoch}, got {epoch}")
        return self.run_steps(1)

    def run_steps(self, count: int, on_start: EpochHook | None = None,
                  on_end: EpochHook | None = None) -> SimStats:
        """Run ``count`` consecutive epochs, ranks overlapping across epoch boundaries.

        Rank r starts epoch e+1 as soon as all its epoch-e tasks ran and its pending ops were
        delivered (kernel end), possibly while other ranks still run epoch e.
        ``on_start(epoch, rank)`` is called before rank starts an epoch (write its inputs
        there), ``on_end(epoch, rank)`` after it finished one (read its outputs there).
        """
        first = self._next_epoch
        check_steps(self._broken, count, first, self.program.max_epochs, SimError)
        prev_threads = torch.get_num_threads()
        if self.threads is not None and self.threads != prev_threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                stats = self._run(first, count, on_start, on_end)
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            raise
        finally:
            if torch.get_num_threads() != prev_threads:
                torch.set_num_threads(prev_threads)
        self._next_epoch = first + count
        for name, v, c in zip(self._cnames, self._counters, self.program.counters):
            if v >= 2 ** (c.width - 1):
                raise SimError(f"counter {name} reached {v}, beyond its {c.width}-bit signed range")
        return stats

    # ------------------------------------------------------------- execution
    def _run(self, first: int, count: int, on_start, on_end) -> SimStats:
        t0 = time.perf_counter()
        R, W = self.R, self.W
        nq = R * W
        stats = SimStats(epochs=list(range(first, first + count)), policy=self.policy, seed=self.seed)
        self._stats = stats
        self._pos = [0] * nq
        self._done_q = [False] * nq
        self._ready_flag = [False] * nq
        self._nready = 0
        self._heap: list[tuple[int, int]] = []
        self._rlist: list[int] = []
        self._rpos = [-1] * nq
        self._waiters: list[list[tuple[int, int, int]]] = [[] for _ in self._cnames]
        self._wseq = 0
        self._pending: list[list[_Pending]] = [[] for _ in range(nq)]
        self._npending = 0
        self._nsig = 0
        self._fence_no = [0] * nq
        self._task_seq = 0
        self._epoch = [first] * R
        self._last = first + count - 1
        self._ndone = [0] * R
        self._finished: list[int] = []
        self._ranks_left = R
        self._on_start, self._on_end = on_start, on_end
        for r in range(R):
            self._start_epoch(r, first)

        rng = self._rng
        pol = self.policy
        fin = self._finished
        while True:
            if fin:  # ranks whose queues ran out: their kernel end (flush, next epoch) is due
                if pol == "in_order" or (self._nready == 0 and not (pol == "adversarial" and self._nsig)):
                    self._finish_rank(fin.pop(0))
                    continue
                if pol == "random" and rng.random() < self.deliver_p:
                    self._finish_rank(fin.pop(rng.randrange(len(fin))))
                    continue
                if pol == "adversarial":
                    # A kernel end delivers the rank's pending puts: postpone it while other
                    # work can run; a rank with nothing in flight runs ahead at once (skew).
                    i = next((i for i, r in enumerate(fin) if not self._rank_pending(r)), -1)
                    if i >= 0:
                        self._finish_rank(fin.pop(i))
                        continue
            if self._nready:
                if pol == "random" and self._npending and rng.random() < self.deliver_p:
                    self._deliver_one_random()
                    continue
                self._exec(self._pop_ready())
                continue
            if self._nsig or (self._npending and pol == "random"):
                if pol == "adversarial":
                    self._deliver_one_signal()
                else:
                    self._deliver_one_random()
                continue
            if self._ranks_left == 0:
                break
            self._deadlock()
        stats.seconds = time.perf_counter() - t0
        return stats

    def _start_epoch(self, r: int, e: int) -> None:
        self._epoch[r] = e
        if self._on_start is not None:
            self._on_start(e, r)
        self._ndone[r] = 0
        for q in range(r * self.W, (r + 1) * self.W):
            self._pos[q] = 0
            self._done_q[q] = False
            self._advance(q)

    def _finish_rank(self, r: int) -> None:
        # Kernel end: every op this rank's workers issued is delivered.
        for q in range(r * self.W, (r + 1) * self.W):
            if self._pending[q]:
                self._flush(q)
        e = self._epoch[r]
        if self._on_end is not None:
            self._on_end(e, r)
        if e < self._last:
            self._start_epoch(r, e + 1)
        else:
            self._ranks_left -= 1

    def _advance(self, q: int) -> None:
        """Examine queue q's head: mark the queue done, ready, or waiting on a counter."""
        queue = self._queues[q]
        pos = self._pos[q]
        if pos >= len(queue):
            if not self._done_q[q]:
                self._done_q[q] = True
                r = q // self.W
                self._ndone[r] += 1
                if self._ndone[r] == self.W:
                    self._finished.append(r)
            return
        t = self._tasks[queue[pos]]
        e = self._epoch[t.rank]
        counters = self._counters
        for c, n, k in t.waits:
            thr = e * n + k
            if counters[c] < thr:
                self._wseq += 1
                heapq.heappush(self._waiters[c], (thr, self._wseq, q))
                return
        self._ready_flag[q] = True
        self._nready += 1
        if self.policy == "random":
            self._rpos[q] = len(self._rlist)
            self._rlist.append(q)
        else:
            heapq.heappush(self._heap, (self._prio[q], q))

    def _pop_ready(self) -> int:
        """Remove and return a ready queue chosen by the policy (requires _nready > 0)."""
        self._nready -= 1
        if self.policy == "random":
            lst = self._rlist
            i = self._rng.randrange(len(lst))
            q = lst[i]
            last = lst.pop()
            if last != q:
                lst[i] = last
                self._rpos[last] = i
            self._ready_flag[q] = False
            return q
        heap = self._heap
        while heap:
            _, q = heapq.heappop(heap)
            if self._ready_flag[q]:
                self._ready_flag[q] = False
                return q
        raise AssertionError("ready count and ready heap disagree")

    def _rank_pending(self, r: int) -> bool:
        return any(self._pending[q] for q in range(r * self.W, (r + 1) * self.W))

    def _add(self, c: int, amount: int) -> None:
        v = self._counters[c] + amount
        self._counters[c] = v
        h = self._waiters[c]
        while h and h[0][0] <= v:
            _, _, q = heapq.heappop(h)
            self._advance(q)

    def _exec(self, q: int) -> None:
        t = self._tasks[self._queues[q][self._pos[q]]]
        r = t.rank
        slot = self._epoch[r] % self.slots
        stats = self._stats
        stats.tasks += 1
        self._task_seq += 1
        seq = self._task_seq  # ties a task's signals to its own data (put-with-signal)
        kind = t.kind
        if kind == _COMPUTE:
            outs = t.outs[slot]
            remote = t.remote[slot]
            if remote:
                outs = list(outs)
                for i, _, view in remote:
                    outs[i] = torch.empty(view.shape, dtype=view.dtype)
            try:
                t.fn(t.params, t.ins[slot], outs)
            except (ReferenceOpError, RuntimeError, ValueError, IndexError, KeyError, TypeError) as e:
                raise SimTaskError(f"task {t.id} (op {t.op}, rank {r}, worker {t.worker}) failed in epoch "
                                   f"{self._epoch[r]}: {e}", t.id, self._epoch[r]) from e
            if remote:
                for i, dst, view in remote:
                    self._issue(_Pending(q, dst, False, view, outs[i], -1, 0, self._fence_no[q], seq))
        elif kind == _QUIET:
            if self._pending[q]:
                self._flush(q)
        elif kind == _FENCE:
            self._fence_no[q] += 1
        for c, a in t.local_sigs:
            self._add(c, a)
        for c, a, dst in t.remote_sigs:
            self._issue(_Pending(q, dst, True, None, None, c, a, self._fence_no[q], seq))
        self._pos[q] += 1
        self._advance(q)

    # ------------------------------------------------------------ deliveries
    def _issue(self, op: _Pending) -> None:
        if self.policy == "in_order":  # delivered at once
            self._apply(op)
            return
        self._pending[op.q].append(op)
        self._npending += 1
        if op.is_sig:
            self._nsig += 1
        if self._npending > self._stats.max_pending:
            self._stats.max_pending = self._npending

    def _apply(self, op: _Pending) -> None:
        if op.is_sig:
            self._stats.signal_deliveries += 1
            self._add(op.cidx, op.amount)
        else:
            self._stats.data_deliveries += 1
            op.view.copy_(op.data)

    def _deliver(self, op: _Pending) -> None:
        self._pending[op.q].remove(op)
        self._npending -= 1
        if op.is_sig:
            self._nsig -= 1
        self._apply(op)

    def _flush(self, q: int) -> None:
        """Deliver every pending op of queue q, in issue order (which satisfies every rule)."""
        ops = self._pending[q]
        self._pending[q] = []
        self._npending -= len(ops)
        self._nsig -= sum(1 for o in ops if o.is_sig)
        for op in ops:
            self._apply(op)

    @staticmethod
    def _blockers(lst: list[_Pending], i: int) -> list[_Pending]:
        """Undelivered ops that lst[i] must follow (all earlier in lst, in issue order)."""
        x = lst[i]
        return [y for y in lst[:i] if x.must_follow(y)]

    def _deliver_one_random(self) -> None:
        cands = []
        for lst in self._pending:
            for i, x in enumerate(lst):
                if not any(x.must_follow(y) for y in lst[:i]):
                    cands.append(x)
        # The oldest op of a worker is always deliverable, so cands is non-empty.
        self._deliver(cands[self._rng.randrange(len(cands))])

    def _deliver_one_signal(self) -> None:
        """Adversarial: deliver one signal, with only the data the rules force out first."""
        best: list[tuple[_Pending, list[_Pending]]] = []
        fewest = None
        for lst in self._pending:
            for i, x in enumerate(lst):
                if not x.is_sig:
                    continue
                need = self._blockers(lst, i)
                if fewest is None or len(need) < fewest:
                    fewest, best = len(need), [(x, need)]
                elif len(need) == fewest:
                    best.append((x, need))
        x, need = best[self._rng.randrange(len(best))]
        for y in need:
            self._deliver(y)
        self._deliver(x)

    def _deadlock(self) -> None:
        blocked = []
        for q in range(self.R * self.W):
            if self._done_q[q] or self._pos[q] >= len(self._queues[q]):
                continue
            t = self._tasks[self._queues[q][self._pos[q]]]
            e = self._epoch[t.rank]
            for c, n, k in t.waits:
                need = e * n + k
                if self._counters[c] < need:
                    blocked.append({"rank": t.rank, "worker": t.worker, "epoch": e, "task": t.id,
                                    "counter": self._cnames[c], "value": self._counters[c], "needed": need})
                    break
        shown = "; ".join(f"r{b['rank']}w{b['worker']} e{b['epoch']} task {b['task']} waits "
                          f"{b['counter']} >= {b['needed']} (value {b['value']})" for b in blocked[:6])
        more = f" (+{len(blocked) - 6} more)" if len(blocked) > 6 else ""
        raise SimDeadlock(f"deadlock: {len(blocked)} queues blocked: {shown}{more}", blocked,
                          self.counter_values())

    def _tensor(self, buffer: str, rank: int) -> torch.Tensor:
        b = self._bufs.get(buffer)
        if b is None:
            raise SimError(f"unknown buffer {buffer!r}")
        t = self._mem.get((buffer, rank))
        if t is None:
            raise SimError(f"buffer {buffer} has no copy on rank {rank} (local to rank {b.rank})")
        return t



def run_program(program: ScheduleProgram, steps: int, init_fn: InitFn | None = None,
                inputs: Callable[[int, int], dict[str, torch.Tensor]] | None = None,
                outputs: Sequence[str] = (), **kw: Any) -> list[dict[tuple[str, int], torch.Tensor]]:
    """Convenience: run ``steps`` epochs one at a time, writing ``inputs(epoch, rank)``
    (buffer name -> tensor) before each step and returning, per epoch, copies of the named
    ``outputs`` buffers on every rank that holds them. ``kw`` goes to SimExecutor."""
    ex = SimExecutor(program, init_fn, **kw)
    out: list[dict[tuple[str, int], torch.Tensor]] = []
    for e in range(steps):
        if inputs is not None:
            for r in range(program.ranks):
                for name, val in inputs(e, r).items():
                    ex.write(name, r, val)
        ex.step(e)
        got = {}
        for name in outputs:
            for r in range(program.ranks):
                if (name, r) in ex._mem:
                    got[(name, r)] = ex.read(name, r)
        out.append(got)
    return out
