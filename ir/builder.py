"""A small programmatic builder for SchedulePrograms (tests, examples, the lowering).

Example::

    b = ProgramBuilder("allreduce", ranks=2, workers=1)
    b.buffer("x", "activation", "f32", (4,), rank=0)
    b.buffer("rx", "activation", "f32", (2, 4), placement="symmetric")
    b.counter("c.rx", rank=1)
    b.task("t0", 0, 0, "put", ins=["x[0:4]"], outs=["rx@1[0:1, 0:4]"], signals=["c.rx+=1"])
    prog = b.build()

Region strings: ``name[a:b, c:d]`` addresses the task's own rank (or the owner of a local
buffer); ``name@R[...]`` addresses rank R's copy of a symmetric buffer. A bound may use
the slot symbol: ``s``, ``2*s+1``, ``s+3``. Waits: ``"c>=3"`` or ``"c>=1@prev"``;
signals: ``"c+=1"``.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from ir.program import (
    Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task, Wait,
    WeightSource,
)

_REGION = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*(?:@\s*r?(\d+))?\s*\[(.*)\]\s*$")
_BOUND = re.compile(r"^\s*(?:(-?\d+)\s*\*\s*)?s\s*(?:([+-])\s*(\d+))?\s*$")
_WAIT = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*>=\s*(-?\d+)\s*(@prev)?\s*$")
_SIGNAL = re.compile(r"^\s*([A-Za-z_][\w.\-]*)\s*\+=\s*(\d+)\s*$")


def parse_bound(text: str) -> Bound:
    """Parse ``7``, ``s``, ``2*s``, ``2*s+1`` or ``s-1`` into a Bound."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return Bound(int(text))
    m = _BOUND.match(text)
    if not m:
        raise ValueError(f"bad bound {text!r}: expected an int or an affine form of s")
    coef = int(m.group(1)) if m.group(1) else 1
    const = int(m.group(3)) if m.group(3) else 0
    if m.group(2) == "-":
        const = -const
    return Bound(const, coef)


def parse_region(text: str, default_rank: int) -> Region:
    """Parse a region string (see module doc); ``default_rank`` fills a missing ``@R``."""
    m = _REGION.match(text)
    if not m:
        raise ValueError(f"bad region {text!r}: expected name[a:b, ...] or name@R[a:b, ...]")
    name, rank, body = m.group(1), m.group(2), m.group(3)
    ranges = []
    for part in body.split(","):
        if ":" not in part:
            raise ValueError(f"bad range {part!r} in region {text!r}: expected start:stop")
        a, b = part.split(":", 1)
        ranges.append(Range(parse_bound(a), parse_bound(b)))
    return Region(name, int(rank) if rank is not None else default_rank, tuple(ranges))


def parse_wait(text: str) -> Wait:
    m = _WAIT.match(text)
    if not m:
        raise ValueError(f"bad wait {text!r}: expected counter>=N or counter>=N@prev")
    return Wait(m.group(1), int(m.group(2)), -1 if m.group(3) else 0)


def parse_signal(text: str) -> Signal:
    m = _SIGNAL.match(text)
    if not m:
        raise ValueError(f"bad signal {text!r}: expected counter+=N")
    return Signal(m.group(1), int(m.group(2)))


class ProgramBuilder:
    """Accumulates buffers, counters and tasks; ``build()`` returns the program."""

    def __init__(self, name: str, ranks: int, workers: int, target: Target | None = None,
                 slots: int = 1, max_epochs: int = 1 << 20, config: dict | None = None):
        self.prog = ScheduleProgram(name=name, ranks=ranks, workers=workers,
                                    target=target or Target(), slots=slots,
                                    max_epochs=max_epochs, config=dict(config or {}))
        self._owner: dict[str, int | None] = {}

    def buffer(self, name: str, kind: str, dtype: str, shape: Iterable[int], rank: int = 0,
               placement: str = "local", source: WeightSource | None = None) -> Buffer:
        buf = Buffer(name, kind, dtype, tuple(shape), placement,
                     None if placement == "symmetric" else rank, source)
        self.prog.buffers.append(buf)
        self._owner[name] = buf.rank
        return buf

    def counter(self, name: str, rank: int, width: int = 32) -> Counter:
        c = Counter(name, rank, width)
        self.prog.counters.append(c)
        return c

    def region(self, spec: str | Region, task_rank: int) -> Region:
        if isinstance(spec, Region):
            return spec
        owner = self._owner.get(spec.split("[")[0].split("@")[0].strip())
        return parse_region(spec, owner if owner is not None else task_rank)

    def task(self, id: str, rank: int, worker: int, op: str, ins: Iterable[str | Region] = (),
             outs: Iterable[str | Region] = (), params: dict[str, Any] | None = None,
             waits: Iterable[str | Wait] = (), signals: Iterable[str | Signal] = (),
             group: str | None = None) -> Task:
        t = Task(
            id=id, rank=rank, worker=worker, op=op,
            ins=tuple(self.region(r, rank) for r in ins),
            outs=tuple(self.region(r, rank) for r in outs),
            params=dict(params or {}),
            waits=tuple(w if isinstance(w, Wait) else parse_wait(w) for w in waits),
            signals=tuple(s if isinstance(s, Signal) else parse_signal(s) for s in signals),
            group=group,
        )
        self.prog.tasks.append(t)
        return t

    def build(self) -> ScheduleProgram:
        return self.prog
