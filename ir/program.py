"""The ScheduleProgram data model: ranks, workers, buffers, regions, counters, tasks.

This module holds plain data only. Semantics (what a task may read, when remote data
becomes visible, how counters carry happens-before) are specified in docs/ir.md and
summarised here; the validator (validator/), the oracle (validator/oracle.py), the CPU
executor (lowering/sim.py) and the Triton backend all implement that one contract.

Semantics in brief
------------------
* A program describes ONE decode step (an *epoch*) for ``ranks`` GPUs (NVSHMEM PEs),
  each running ``workers`` persistent workers (CTAs). Worker ``(r, w)`` executes the tasks
  whose ``rank == r`` and ``worker == w`` in the order they appear in ``tasks``.
* The runtime launches the program once per decode step on every rank. On one rank,
  epoch ``e+1`` starts only after every task of epoch ``e`` on that rank finished (stream
  order). Ranks are NOT barrier-synchronised between epochs: rank 0 may run epoch ``e+1``
  while rank 1 still runs epoch ``e``.
* Counters are monotone (only incremented, never reset within ``max_epochs`` steps).
  A wait ``c >= t`` in epoch ``e`` blocks until the counter reached
  ``base(e) + t`` where ``base(e) = (e + offset) * N(c)``, ``N(c)`` being the sum of all
  signal amounts to ``c`` in one epoch and ``offset`` being 0, or -1 for a wait on the
  previous epoch (a credit). A wait whose ``base(e) + t`` is at or below zero is trivially
  satisfied in that epoch: ``wait(c >= 0)`` passes at once in epoch 0 and means
  ``c >= e * N(c)`` in epoch e (the same as ``wait(c >= N(c) @prev)``).
* A task may signal counters on any rank, a put included; only a remote writer's signals
  to counters of the destination rank make its data visible there (below).
* A task reads ``ins`` and writes ``outs``. It may only read memory of its own rank. It may
  write its own rank's memory, or a *symmetric* buffer's copy on another rank (a put).
* Local writes become visible to later tasks of the same worker, and to any task that
  waits on a counter this task (or a later task of the worker) signals, once the wait
  is guaranteed to include that signal.
* Remote writes (puts) are *pending* until delivered. They are delivered to a reader
  only when one of these happens-before the reader's wait:
    - the writing task's own signal to a counter owned by the destination rank
      (put-with-signal: NVSHMEM delivers the signal after the data);
    - a ``quiet`` task later on the same worker, followed (on that worker) by a signal;
    - a ``fence`` task later on the same worker, followed by a signal to a counter owned
      by the SAME destination rank (a fence orders deliveries per destination PE only).
  This follows NVSHMEM's documented ordering (nvshmem_quiet / nvshmem_fence /
  nvshmem_put_signal), not what NVLink hardware happens to do.
* Signals to remote counters are themselves remote operations: they may overtake
  earlier puts of the same worker unless ordered by the rules above.
* Region bounds may be affine in the slot symbol ``s = epoch mod slots`` (double
  buffering); ``coef == 0`` means a concrete bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

IR_VERSION = 1

BUFFER_KINDS = ("weight", "activation", "kv_cache", "io_input", "io_output", "scratch")
DTYPES = ("bf16", "f16", "f32", "i32", "i8", "f8e4m3")
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i8": 1, "f8e4m3": 1}
FLOAT_DTYPES = ("bf16", "f16", "f32")
#: Quantized weight dtypes: int8 and FP8 E4M3 (torch.float8_e4m3fn). Only a GEMV-family
#: op's weight operand may have one; the task then carries the weight's scales (per row, or
#: per group of K elements for i8) as its last input (ir/ops.py, "Quantized weights").
QUANT_DTYPES = ("i8", "f8e4m3")
COUNTER_WIDTHS = (32, 64)


@dataclass(frozen=True)
class Bound:
    """An index bound ``const + coef * s`` where ``s = epoch mod slots``.

    ``coef == 0`` is a concrete bound. Units: elements along one axis.
    """

    const: int
    coef: int = 0

    def at(self, slot: int) -> int:
        """Value of the bound for a concrete slot index."""
        return self.const + self.coef * slot

    @property
    def symbolic(self) -> bool:
        return self.coef != 0


@dataclass(frozen=True)
class Range:
    """Half-open range ``[start, stop)`` along one axis of a buffer."""

    start: Bound
    stop: Bound

    @staticmethod
    def of(start: int, stop: int) -> "Range":
        return Range(Bound(start), Bound(stop))

    def at(self, slot: int) -> tuple[int, int]:
        return self.start.at(slot), self.stop.at(slot)

    @property
    def symbolic(self) -> bool:
        return self.start.symbolic or self.stop.symbolic


@dataclass(frozen=True)
class Region:
    """A box of elements of one buffer on one rank.

    ``rank`` is the rank whose copy is addressed. For a local buffer it must equal the
    buffer's owner; for a symmetric buffer it names which PE's copy (a put writes a
    region whose rank differs from the task's rank). ``ranges`` has one entry per axis
    of the buffer's shape.
    """

    buffer: str
    rank: int
    ranges: tuple[Range, ...]

    @property
    def symbolic(self) -> bool:
        return any(r.symbolic for r in self.ranges)

    def shape(self, slot: int = 0) -> tuple[int, ...]:
        """Extent per axis (elements) at a given slot."""
        return tuple(r.stop.at(slot) - r.start.at(slot) for r in self.ranges)

    def numel(self, slot: int = 0) -> int:
        n = 1
        for d in self.shape(slot):
            n *= max(d, 0)
        return n

    def concrete(self, slot: int = 0) -> tuple[tuple[int, int], ...]:
        """The ``(start, stop)`` pairs at a given slot."""
        return tuple(r.at(slot) for r in self.ranges)


@dataclass(frozen=True)
class WeightSource:
    """Where a weight buffer's contents come from.

    ``key`` is a state-dict key of the HF model, or a derived tensor under the ``amk.``
    namespace (e.g. ``amk.rope_inv_freq``). ``ranges`` selects the slice this buffer
    holds, one (start, stop) per axis of the source tensor; empty means the whole tensor.
    """

    key: str
    ranges: tuple[tuple[int, int], ...] = ()


@dataclass
class Buffer:
    """A named tensor. ``placement`` is ``"local"`` (owned by ``rank``) or ``"symmetric"``
    (one copy on every rank's NVSHMEM symmetric heap; ``rank`` is None)."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    placement: str = "local"
    rank: int | None = 0
    source: WeightSource | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 0)


@dataclass
class Counter:
    """A monotone signal counter owned by ``rank`` with ``width`` bits."""

    name: str
    rank: int
    width: int = 32


@dataclass(frozen=True)
class Wait:
    """Block until ``counter >= (epoch + offset) * N(counter) + threshold``.

    ``offset`` is 0 (this epoch) or -1 (the previous epoch: a credit)."""

    counter: str
    threshold: int
    offset: int = 0


@dataclass(frozen=True)
class Signal:
    """Add ``amount`` to ``counter`` after the task's writes (release semantics)."""

    counter: str
    amount: int = 1


@dataclass
class Task:
    """One instruction in a worker's queue.

    ``op`` names an entry of ``ir.ops.OPS``. ``params`` values are int, float or str.
    ``group`` tags the tasks that form one collective instance (e.g. ``ar.l3.attn``):
    every rank must take part, in the same order.
    """

    id: str
    rank: int
    worker: int
    op: str
    ins: tuple[Region, ...] = ()
    outs: tuple[Region, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)
    waits: tuple[Wait, ...] = ()
    signals: tuple[Signal, ...] = ()
    group: str | None = None


@dataclass
class Target:
    """The machine a program is built for.

    ``sms``: streaming multiprocessors per GPU. ``max_workers``: co-residency limit of
    the persistent kernel per rank: how many worker CTAs may be resident at once (for the
    Triton backend up to SMs x the CTAs per SM that the compiled kernel's registers and
    shared memory allow; the runtime checks that before the first launch).
    ``backend``: ``sim`` or ``triton`` (which op set must be supported).
    """

    name: str = "generic"
    sms: int = 132
    max_workers: int = 132
    backend: str = "sim"


@dataclass
class ScheduleProgram:
    """A complete schedule for one decode step over ``ranks`` x ``workers`` queues."""

    name: str
    ranks: int
    workers: int
    target: Target = field(default_factory=Target)
    max_epochs: int = 1 << 20
    slots: int = 1
    config: dict[str, Any] = field(default_factory=dict)
    buffers: list[Buffer] = field(default_factory=list)
    counters: list[Counter] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)
    version: int = IR_VERSION

    # -- lookups (built on demand; programs are treated as immutable once built) --
    def buffer_map(self) -> dict[str, Buffer]:
        return {b.name: b for b in self.buffers}

    def counter_map(self) -> dict[str, Counter]:
        return {c.name: c for c in self.counters}

    def task_map(self) -> dict[str, Task]:
        return {t.id: t for t in self.tasks}

    def queues(self) -> dict[tuple[int, int], list[Task]]:
        """Tasks per (rank, worker), in queue order. Every (r, w) key is present."""
        q: dict[tuple[int, int], list[Task]] = {
            (r, w): [] for r in range(self.ranks) for w in range(self.workers)
        }
        for t in self.tasks:
            q.setdefault((t.rank, t.worker), []).append(t)
        return q

    def signals_per_epoch(self) -> dict[str, int]:
        """N(c): the sum of signal amounts to each counter in one epoch."""
        n = {c.name: 0 for c in self.counters}
        for t in self.tasks:
            for s in t.signals:
                n[s.counter] = n.get(s.counter, 0) + s.amount
        return n

    def iter_regions(self) -> Iterator[tuple[Task, str, Region]]:
        """Yield (task, "in"|"out", region) for every operand."""
        for t in self.tasks:
            for r in t.ins:
                yield t, "in", r
            for r in t.outs:
                yield t, "out", r

    def copy(self) -> "ScheduleProgram":
        """A deep copy (mutation-safe)."""
        return dataclasses.replace(
            self,
            target=dataclasses.replace(self.target),
            config=dict(self.config),
            buffers=[dataclasses.replace(b) for b in self.buffers],
            counters=[dataclasses.replace(c) for c in self.counters],
            tasks=[dataclasses.replace(t, params=dict(t.params)) for t in self.tasks],
        )

    def stats(self) -> dict[str, int]:
        return {
            "ranks": self.ranks,
            "workers": self.workers,
            "tasks": len(self.tasks),
            "buffers": len(self.buffers),
            "counters": len(self.counters),
        }
