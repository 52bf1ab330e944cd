"""Hand-built reference schedules: small, valid, multi-rank. Used by docs, tests and the
adversarial corpus as seeds.

``allreduce``: one-shot all-reduce of an ``n``-element vector over ``ranks`` ranks. Every
rank puts its vector into slot ``r`` of every peer's symmetric receive buffer with a
put-with-signal, copies it into its own slot, waits for every peer's signal, and sums.
Receive-buffer reuse across decode steps is made safe either by double buffering
(``reuse="slots"``: slot ``s = epoch mod 2``) or by credits (``reuse="credit"``: the reader
returns a credit to every writer after its reduce, and a writer waits for the previous
epoch's credit before its put).
"""

from __future__ import annotations

from ir.builder import ProgramBuilder
from ir.program import ScheduleProgram, Target


def allreduce(ranks: int = 2, n: int = 8, workers: int = 1, reuse: str = "slots",
              dtype: str = "f32") -> ScheduleProgram:
    """A valid one-shot all-reduce program; ``y = sum over ranks of x``, on every rank.

    Buffers: ``x.rR`` (io_input, local, [n]), ``rx`` (symmetric, [2, ranks, n] with slots
    or [ranks, n] with credits), ``y.rR`` (io_output, local, [n]).

    Counters with slots: ``c.rx.rD.fromS`` (owned by D, counts S's arrivals). One counter
    per source is needed: ranks drift across epochs, so with one shared arrival counter a
    fast peer's next-epoch signal could satisfy this epoch's wait before a slow peer's data
    arrived (unsafe for 3+ ranks). With credits: ``c.rx.rR`` (owned by R, counts arrivals;
    a peer cannot run ahead without R's credit) and ``c.cr.rR`` (credits returned to R).
    """
    if reuse not in ("slots", "credit"):
        raise ValueError(f"reuse must be 'slots' or 'credit', got {reuse!r}")
    slots = 2 if reuse == "slots" else 1
    b = ProgramBuilder(f"allreduce-{ranks}r-{reuse}", ranks=ranks, workers=workers,
                       target=Target(name="generic", sms=132, max_workers=132),
                       slots=slots, config={"allreduce": "oneshot", "reuse": reuse})
    rx_shape = (2, ranks, n) if slots == 2 else (ranks, n)
    b.buffer("rx", "activation", dtype, rx_shape, placement="symmetric")
    for r in range(ranks):
        b.buffer(f"x.r{r}", "io_input", dtype, (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", dtype, (n,), rank=r)
        if reuse == "credit":
            b.counter(f"c.rx.r{r}", rank=r)
            b.counter(f"c.cr.r{r}", rank=r)
        else:
            for src in range(ranks):
                if src != r:
                    b.counter(f"c.rx.r{r}.from{src}", rank=r)

    def arrival(dst: int, src: int) -> str:
        return f"c.rx.r{dst}" if reuse == "credit" else f"c.rx.r{dst}.from{src}"

    def slot_region(dst: int, src: int) -> str:
        if slots == 2:
            return f"rx@{dst}[s:s+1, {src}:{src + 1}, 0:{n}]"
        return f"rx@{dst}[{src}:{src + 1}, 0:{n}]"

    all_slots = f"rx[s:s+1, 0:{ranks}, 0:{n}]" if slots == 2 else f"rx[0:{ranks}, 0:{n}]"
    for r in range(ranks):
        peers = [p for p in range(ranks) if p != r]
        for p in peers:
            waits = [f"c.cr.r{r}>={ranks - 1}@prev"] if reuse == "credit" else []
            b.task(f"put.r{r}.to{p}", r, 0, "put", ins=[f"x.r{r}[0:{n}]"],
                   outs=[slot_region(p, r)], waits=waits, signals=[f"{arrival(p, r)}+=1"],
                   group="ar0")
        b.task(f"self.r{r}", r, 0, "copy", ins=[f"x.r{r}[0:{n}]"], outs=[slot_region(r, r)],
               group="ar0")
        if reuse == "credit":
            sig = [f"c.cr.r{p}+=1" for p in peers]
            waits = [f"c.rx.r{r}>={ranks - 1}"]
        else:
            sig, waits = [], [f"{arrival(r, p)}>=1" for p in peers]
        b.task(f"sum.r{r}", r, 0, "reduce", ins=[all_slots], outs=[f"y.r{r}[0:{n}]"],
               waits=waits, signals=sig, group="ar0")
    return b.build()
