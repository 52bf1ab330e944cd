"""Lowering of the communication patterns (models/collectives.py) to one ScheduleProgram.

``lower_pattern(pattern, config)`` turns a pattern (global shapes, world size R, dtype) and a
``CollectiveConfig`` (lowering/config.py) into a program of R ranks x W workers made of
``gemm`` tiles, ``put`` tasks with per-source signals, ``reduce`` and ``rmsnorm`` tasks, and a
``Binding`` that says where each rank's operands and output live. One epoch (``step(e)``) is
one call of the original function; the caller writes the inputs before it and reads the
output after it (``Binding.write_inputs`` / ``Binding.read_output``).

Buffers: every operand (``x``, ``w``, ``g``, ``o``) is an ``io_input`` buffer of its rank,
exactly the operand's shape; what peers put lands in *symmetric* staging buffers that are
double buffered (``slots = 2``, region bound ``s = epoch mod 2``): every rank waits for data
from every other rank in each epoch, so no rank can be two epochs ahead of a peer's read of a
slot. The output is an ``io_output`` buffer (the two-shot all-reduce's is symmetric: peers
put its rows; ``Binding.read_output`` picks the epoch's slot).

Synchronisation: a rank's data arrives at a peer in *chunks* (``chunks`` pieces of its row
block, aligned to ``tile_m`` where the rows allow), each put signalling a counter of the
destination owned for that (source, chunk) alone: a counter shared by several sources could
be satisfied by a fast source's next-epoch signal standing in for a slow one's. Every wait
asks for all of its counter's signals of the epoch (``(epoch) * N(c) + N(c)``).

The patterns (R ranks, rank r; "block j" = the rows rank j owns):

* all-gather + matmul: rank r puts its ``x`` block, chunk by chunk, into every peer's gathered
  buffer ``G[M, K]`` (peers r+1, r+2, ... in that order); the GEMM tiles of its own block read
  ``x`` and start at once, then the tiles of block r-1, r-2, ... (the order in which the
  peers' puts reach it), each waiting only for the chunks holding its rows.
* matmul + reduce-scatter: rank r computes the tiles of block r+1 first, then r+2, ...,
  its own block last (at any moment the ranks send to different peers, and the own block,
  which needs no transfer, overlaps the last transfers); each tile of block j is put into
  rank j's staging ``P[r]`` right after it on the same worker (with ``direct``, the tile
  stores it there itself and signals rank j: no put task). Rank j reduces its R partials
  chunk by chunk as they complete (``reduce`` over ``P[0:R, rows, 0:N]``) into ``y``.
* matmul + all-reduce: ``oneshot``: every tile is put into every peer's ``P[r]`` (chunks of M
  in order), every rank reduces all rows; ``twoshot``: the reduce-scatter above, then each
  rank puts its reduced rows to every peer's output. With RMSNorm, one-shot normalises each
  reduce task's rows right after it, on its worker; two-shot normalises after the
  all-gather, every rank all rows with its own ``g`` (ranks may hold different ``g``, which
  the original function allows).
* Ulysses combine: rank r puts rows ``j*S/R ..`` of ``o`` into rank j's ``G[S/R, R*C]`` at
  columns ``r*C ..`` (a strided column block). Each output tile multiplies its own piece at
  once and each peer's piece as it arrives (one GEMM per source, the running sum in an fp32
  accumulator; the tile's GEMMs stay on one worker, so queue order carries the sum), or
  with ``whole_k`` runs one GEMM over all R*C columns once every piece arrived.

Work is placed on the workers of a rank round-robin in the order above. Every program passes
``validator.validate`` (tests/test_collectives_lowering.py checks each pattern at R = 2, 3, 4
under several configs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from ground.errors import AmkError
from ir.builder import ProgramBuilder
from ir.program import Bound, Range, Region, ScheduleProgram, Signal, Target, Wait
from lowering.config import CollectiveConfig
from lowering.partition import split_aligned, tiles
from models.collectives import (
    AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter, Pattern, UlyssesCombine,
)

SLOT = Range(Bound(0, 1), Bound(1, 1))  # s:s+1, this epoch's staging slot
#: a wait threshold filled in at the end with all of the counter's signals of one epoch
_ALL = -(1 << 30)


def _r(a: int, b: int) -> Range:
    return Range(Bound(a), Bound(b))


@dataclass(frozen=True)
class Binding:
    """Where a lowered pattern's operands and outputs live, per rank.

    ``inputs[r][name]``: the region of operand ``name`` (``x``, ``w``, ``g``, ``o``; the
    pattern's ``operands()``) on rank r, a whole ``io_input`` buffer of the operand's shape;
    ``outputs[r]``: the region of rank r's output (the pattern's ``output_shape()``), which
    may depend on the slot ``epoch mod slots``; ``slots``: the program's slot count.
    """

    pattern: Pattern
    inputs: tuple[dict[str, Region], ...]
    outputs: tuple[Region, ...]
    slots: int

    def write_inputs(self, executor: Any, rank: int, values: dict[str, torch.Tensor]) -> None:
        """Write rank ``rank``'s operands (``values[name]``, each of the operand's shape) into an
        executor (``SimExecutor`` or ``TritonExecutor``: ``write(buffer, rank, tensor)``). Call
        before the epoch that uses them. Raises AmkError for a missing operand or a shape that
        differs from the pattern's."""
        want = self.pattern.operands()
        for name, shape in want.items():
            if name not in values:
                raise AmkError(f"{self.pattern.kind}: rank {rank} has no operand {name!r}")
            t = values[name]
            if tuple(t.shape) != shape:
                raise AmkError(f"{self.pattern.kind}: rank {rank} operand {name!r} has shape "
                               f"{tuple(t.shape)}, expected {shape}")
            executor.write(self.inputs[rank][name].buffer, rank, t)

    def read_output(self, executor: Any, rank: int, epoch: int) -> torch.Tensor:
        """Rank ``rank``'s output of epoch ``epoch`` (the pattern's output shape, the buffer's
        dtype), read after that epoch and before the next one."""
        reg = self.outputs[rank]
        full = executor.read(reg.buffer, rank)
        idx = tuple(slice(a, b) for a, b in reg.concrete(epoch % self.slots))
        return full[idx].reshape(self.pattern.output_shape())


# Tile sides chosen by size: 64 x 64 unless a rank would then hold fewer GEMM tiles than half
# its workers, where 32 x 32 (4x the tiles) fills more of them. Measured on 2 x H100
# (bench/results/h100x2/2026-11-26-dist-tiles/): 32 x 32 beat 64 x 64 at 256^3 and 512^3
# (all-gather + matmul 0.016 / 0.025 ms against 0.025 / 0.028), 64 x 64 beat 128 x 128 and
# 32 x 32 from 1024^3 on for most patterns.
SIZE_TILE = 64
SMALL_TILE = 32


def gemm_extent(pattern: Pattern) -> tuple[int, int]:
    """(rows, columns) of the GEMM output one rank computes: all-gather + matmul, matmul +
    reduce-scatter and matmul + all-reduce compute the whole ``[M, N]`` (of gathered rows, or
    partial sums), the Ulysses combine its ``[S/R, N]``."""
    if isinstance(pattern, UlyssesCombine):
        return pattern.s // pattern.world, pattern.n
    d = pattern.dims()
    return d["M"], d["N"]


def size_tile(pattern: Pattern, workers: int) -> int:
    """The tile side that ``tile_m`` / ``tile_n`` = 0 stand for (``SIZE_TILE`` or, when a
    rank's GEMM would have fewer than ``workers / 2`` tiles of that side, ``SMALL_TILE``)."""
    rows, cols = gemm_extent(pattern)
    n = -(-rows // SIZE_TILE) * -(-cols // SIZE_TILE)
    return SMALL_TILE if 2 * n < workers else SIZE_TILE


def resolve_config(pattern: Pattern, cfg: CollectiveConfig, target: Target) -> CollectiveConfig:
    """``cfg`` with ``workers`` 0 made the target's SM count and ``tile_m`` / ``tile_n`` 0 made
    ``size_tile``'s choice: the values a program is lowered with."""
    workers = cfg.workers or target.sms
    side = size_tile(pattern, workers)
    return replace(cfg, workers=workers, tile_m=cfg.tile_m or side, tile_n=cfg.tile_n or side)


class _Emit:
    """Buffers, counters and tasks of one pattern's program; round-robin worker placement."""

    def __init__(self, pattern: Pattern, cfg: CollectiveConfig, target: Target):
        cfg = resolve_config(pattern, cfg, target)
        self.p, self.cfg, self.R = pattern, cfg, pattern.world
        self.W = cfg.workers
        if self.W > target.max_workers:
            raise AmkError(f"collective config: field 'workers' (--workers): {self.W} workers per rank exceed "
                           f"the target's {target.max_workers} co-resident workers ({target.name})")
        self.dt = pattern.dtype
        self.slots = 2 if self.R > 1 else 1
        dims = "x".join(f"{k}{v}" for k, v in pattern.dims().items())
        self.b = ProgramBuilder(f"{pattern.kind}-{dims}-{self.R}r-{self.dt}", ranks=self.R, workers=self.W,
                                target=target, slots=self.slots,
                                config={"pattern": pattern.kind, **cfg.to_json(), "workers": self.W})
        self.cursor = [0] * self.R
        self.counters: set[str] = set()
        self.inputs: list[dict[str, Region]] = [{} for _ in range(self.R)]
        self.group = pattern.kind

    # -- declarations ------------------------------------------------------------------
    def local(self, name: str, kind: str, shape: Sequence[int], rank: int, dtype: str | None = None) -> str:
        buf = f"{name}.r{rank}"
        self.b.buffer(buf, kind, dtype or self.dt, tuple(shape), rank=rank)
        return buf

    def symmetric(self, name: str, shape: Sequence[int], kind: str = "activation") -> str:
        self.b.buffer(name, kind, self.dt, (self.slots, *shape), placement="symmetric")
        return name

    def operand(self, name: str, rank: int) -> str:
        """The io_input buffer of operand ``name`` on ``rank`` (recorded in the binding)."""
        shape = self.p.operands()[name]
        buf = self.local(name, "io_input", shape, rank)
        self.inputs[rank][name] = Region(buf, rank, tuple(_r(0, d) for d in shape))
        return buf

    def counter(self, name: str, rank: int) -> str:
        if name not in self.counters:
            self.counters.add(name)
            self.b.counter(name, rank)
        return name

    # -- tasks -------------------------------------------------------------------------
    def worker(self, rank: int) -> int:
        w = self.cursor[rank] % self.W
        self.cursor[rank] += 1
        return w

    def task(self, id: str, rank: int, worker: int, op: str, ins: Sequence[Region], outs: Sequence[Region],
             waits: Sequence[str] = (), signals: Sequence[str] = (), params: dict | None = None,
             comm: bool = False) -> None:
        self.b.task(id, rank, worker, op, ins=list(ins), outs=list(outs), params=params,
                    waits=[Wait(c, _ALL) for c in dict.fromkeys(waits)],
                    signals=[Signal(c, 1) for c in signals], group=self.group if comm else None)

    def build(self) -> ScheduleProgram:
        """The program: every wait asks for all of its counter's signals of one epoch, and
        ``max_epochs`` (calls before the executor must be rebuilt) is lowered where a
        counter's signals per epoch would otherwise leave its 32-bit signed range (large
        sizes with small tiles: 4,096 signals per epoch allow 524,286 calls)."""
        prog = self.b.build()
        n = prog.signals_per_epoch()
        most = max(n.values(), default=1)
        prog.max_epochs = max(1, min(prog.max_epochs, (2 ** 31 - 1) // most - 1))
        for t in prog.tasks:
            if t.waits:
                t.waits = tuple(Wait(w.counter, n[w.counter]) for w in t.waits)
        waited = {w.counter for t in prog.tasks for w in t.waits}
        for t in prog.tasks:
            t.signals = tuple(s for s in t.signals if s.counter in waited)
        prog.counters = [c for c in prog.counters if c.name in waited]
        return prog

    # -- shapes ------------------------------------------------------------------------
    def chunks(self, rows: int) -> list[tuple[int, int]]:
        """``[0, rows)`` in at most ``chunks`` pieces, aligned to ``tile_m`` where possible."""
        parts = min(self.cfg.chunks, rows)
        return [c for c in split_aligned(rows, parts, self.cfg.tile_m) if c[1] > c[0]]

    def row_tiles(self, chunks: list[tuple[int, int]], tile: int) -> list[tuple[int, int, int]]:
        """(chunk index, a, b) of the row tiles of each chunk (a tile never spans two)."""
        return [(k, a, b) for k, (c0, c1) in enumerate(chunks) for a, b in tiles(c0, c1, tile)]

    def col_tiles(self, n: int) -> list[tuple[int, int]]:
        return tiles(0, n, self.cfg.tile_n)

    def peers(self, r: int) -> list[int]:
        """The other ranks, nearest first: r+1, r+2, ... (mod R)."""
        return [(r + d) % self.R for d in range(1, self.R)]

    def sources(self, r: int) -> list[int]:
        """Every rank, in the order their data reaches r when each sends to r+1 first:
        r itself, r-1, r-2, ... (mod R)."""
        return [(r - d) % self.R for d in range(self.R)]


def _overlapping(chunks: list[tuple[int, int]], a: int, b: int) -> list[int]:
    return [k for k, (c0, c1) in enumerate(chunks) if c0 < b and a < c1]


# ----------------------------------------------------------------------------- patterns
def _allgather_matmul(e: _Emit, p: AllGatherMatmul) -> list[Region]:
    R, M, N, K = e.R, p.m, p.n, p.k
    mr = M // R
    g = e.symmetric("G", (M, K)) if R > 1 else None
    chunks = e.chunks(mr)
    outs = []
    for r in range(R):
        x, w = e.operand("x", r), e.operand("w", r)
        y = e.local("y", "io_output", (M, N), r)
        outs.append(Region(y, r, (_r(0, M), _r(0, N))))
        for q in e.peers(r):
            for k, (c0, c1) in enumerate(chunks):
                c = e.counter(f"c.ag.r{q}.from{r}.k{k}", q)
                e.task(f"ag.put.r{r}.to{q}.k{k}", r, e.worker(r), "put",
                       [Region(x, r, (_r(c0, c1), _r(0, K)))],
                       [Region(g, q, (SLOT, _r(r * mr + c0, r * mr + c1), _r(0, K)))], signals=[c], comm=True)
        for s in e.sources(r):
            for i, (a, b) in enumerate(tiles(0, mr, e.cfg.tile_m)):
                if s == r:
                    src, waits = Region(x, r, (_r(a, b), _r(0, K))), []
                else:
                    src = Region(g, r, (SLOT, _r(s * mr + a, s * mr + b), _r(0, K)))
                    waits = [f"c.ag.r{r}.from{s}.k{k}" for k in _overlapping(chunks, a, b)]
                for n0, n1 in e.col_tiles(N):
                    e.task(f"ag.gemm.r{r}.from{s}.m{a}.n{n0}", r, e.worker(r), "gemm",
                           [src, Region(w, r, (_r(0, K), _r(n0, n1)))],
                           [Region(y, r, (_r(s * mr + a, s * mr + b), _r(n0, n1)))], waits=waits)
    return outs


def _reduce_rows(e: _Emit, r: int, tag: str, stage: str, rows: list[tuple[int, int, int]], n: int,
                 waits_of, dst_of, norm: tuple[str, str, float] | None, after=None) -> int:
    """Rank r's reduce tasks over ``stage``'s ``[0:R, a:b, 0:n]`` (block-relative rows
    ``rows``: (chunk, a, b)), each into ``dst_of(a, b)``; with ``norm`` (the sum's buffer, g,
    eps) the sum goes to ``norm[0]`` rows and an rmsnorm task on the same worker writes
    ``dst_of``; ``after(worker, a, b, region)`` adds tasks behind each (the all-gather's
    puts). Returns the number of reduce tasks."""
    R = e.R
    for k, a, b in rows:
        wk = e.worker(r)
        ins = [Region(stage, r, (SLOT, _r(0, R), _r(a, b), _r(0, n)))]
        dst = dst_of(a, b)
        if norm is None:
            e.task(f"{tag}.red.r{r}.m{a}", r, wk, "reduce", ins, [dst], waits=waits_of(k), comm=True)
        else:
            h, gbuf, eps = norm
            hreg = Region(h, r, (_r(a, b), _r(0, n)))
            e.task(f"{tag}.red.r{r}.m{a}", r, wk, "reduce", ins, [hreg], waits=waits_of(k), comm=True)
            e.task(f"{tag}.norm.r{r}.m{a}", r, wk, "rmsnorm", [hreg, Region(gbuf, r, (_r(0, n),))], [dst],
                   params={"dim": n, "eps": float(eps)})
        if after is not None:
            after(wk, a, b, dst)
    return len(rows)


def _scatter_tiles(e: _Emit, tag: str, r: int, j: int, lo: int, length: int, x: str, w: str, K: int, N: int,
                   stage: str, tmp: str | None) -> list[tuple[int, int]]:
    """Rank r's GEMM tiles of the rows ``[lo, lo + length)`` of x destined for rank j: into
    its own staging ``stage[r]`` when j == r (signalling ``c.{tag}.own.r{r}.k``), else into
    rank j's ``stage[r]`` (signalling ``c.{tag}.r{j}.from{r}.k``): stored there by the tile
    itself when ``tmp`` is None (``direct``), else into ``tmp`` and put by a task right after
    it on the same worker. Returns the chunks of the block."""
    chunks = e.chunks(length)
    for k, a, b in e.row_tiles(chunks, e.cfg.tile_m):
        for n0, n1 in e.col_tiles(N):
            wk = e.worker(r)
            ins = [Region(x, r, (_r(lo + a, lo + b), _r(0, K))), Region(w, r, (_r(0, K), _r(n0, n1)))]
            at = (SLOT, _r(r, r + 1), _r(a, b), _r(n0, n1))
            gid = f"{tag}.gemm.r{r}.m{lo + a}.n{n0}"
            if j == r:
                e.task(gid, r, wk, "gemm", ins, [Region(stage, r, at)],
                       signals=[e.counter(f"c.{tag}.own.r{r}.k{k}", r)])
            elif tmp is None:
                e.task(gid, r, wk, "gemm", ins, [Region(stage, j, at)],
                       signals=[e.counter(f"c.{tag}.r{j}.from{r}.k{k}", j)], comm=True)
            else:
                t = Region(tmp, r, (_r(lo + a, lo + b), _r(n0, n1)))
                e.task(gid, r, wk, "gemm", ins, [t])
                e.task(f"{tag}.put.r{r}.to{j}.m{a}.n{n0}", r, wk, "put", [t], [Region(stage, j, at)],
                       signals=[e.counter(f"c.{tag}.r{j}.from{r}.k{k}", j)], comm=True)
    return chunks


def _arrivals(tag: str, r: int, R: int, k: int) -> list[str]:
    """The counters a reduce of chunk k on rank r waits for: its own tiles and every peer's."""
    return [f"c.{tag}.own.r{r}.k{k}"] + [f"c.{tag}.r{r}.from{q}.k{k}" for q in range(R) if q != r]


def _matmul_reduce_scatter(e: _Emit, p: MatmulReduceScatter) -> list[Region]:
    R, M, N, K = e.R, p.m, p.n, p.k
    mr = M // R
    outs = []
    if R == 1:
        return _single(e, "rs", p.m, N, K, "x")
    stage = e.symmetric("P", (R, mr, N))
    for r in range(R):
        x, w = e.operand("x", r), e.operand("w", r)
        y = e.local("y", "io_output", (mr, N), r)
        tmp = None if e.cfg.direct else e.local("T", "activation", (M, N), r)
        outs.append(Region(y, r, (_r(0, mr), _r(0, N))))
        for j in e.peers(r) + [r]:
            chunks = _scatter_tiles(e, "rs", r, j, j * mr, mr, x, w, K, N, stage, tmp)
        rows = e.row_tiles(chunks, e.cfg.reduce_rows or e.cfg.tile_m)
        _reduce_rows(e, r, "rs", stage, rows, N, lambda k, r=r: _arrivals("rs", r, R, k),
                     lambda a, b, y=y, r=r: Region(y, r, (_r(a, b), _r(0, N))), None)
    return outs


def _single(e: _Emit, tag: str, M: int, N: int, K: int, xname: str, norm: tuple | None = None) -> list[Region]:
    """R = 1: ``y = x @ w`` in tiles (then RMSNorm by rows with ``norm`` = (g name, eps))."""
    r = 0
    x, w = e.operand(xname, r), e.operand("w", r)
    gbuf = e.operand("g", r) if norm else None
    y = e.local("y", "io_output", (M, N), r)
    if norm is None:
        for a, b in tiles(0, M, e.cfg.tile_m):
            for n0, n1 in e.col_tiles(N):
                e.task(f"{tag}.gemm.m{a}.n{n0}", r, e.worker(r), "gemm",
                       [Region(x, r, (_r(a, b), _r(0, K))), Region(w, r, (_r(0, K), _r(n0, n1)))],
                       [Region(y, r, (_r(a, b), _r(n0, n1)))])
        return [Region(y, r, (_r(0, M), _r(0, N)))]
    h = e.local("h", "activation", (M, N), r)
    cnt = e.counter("c.own.r0", r)
    for a, b in tiles(0, M, e.cfg.tile_m):
        for n0, n1 in e.col_tiles(N):
            e.task(f"{tag}.gemm.m{a}.n{n0}", r, e.worker(r), "gemm",
                   [Region(x, r, (_r(a, b), _r(0, K))), Region(w, r, (_r(0, K), _r(n0, n1)))],
                   [Region(h, r, (_r(a, b), _r(n0, n1)))], signals=[cnt])
    for a, b in tiles(0, M, e.cfg.reduce_rows or e.cfg.tile_m):
        e.task(f"{tag}.norm.m{a}", r, e.worker(r), "rmsnorm",
               [Region(h, r, (_r(a, b), _r(0, N))), Region(gbuf, r, (_r(0, N),))],
               [Region(y, r, (_r(a, b), _r(0, N)))], waits=[cnt], params={"dim": N, "eps": float(norm[1])})
    return [Region(y, r, (_r(0, M), _r(0, N)))]


def _matmul_allreduce(e: _Emit, p: MatmulAllReduce) -> list[Region]:
    R, M, N, K = e.R, p.m, p.n, p.k
    if R == 1:
        return _single(e, "ar", M, N, K, "x", ("g", p.eps) if p.norm else None)
    if e.cfg.allreduce == "oneshot":
        return _allreduce_oneshot(e, p)
    return _allreduce_twoshot(e, p)


def _allreduce_oneshot(e: _Emit, p: MatmulAllReduce) -> list[Region]:
    R, M, N, K = e.R, p.m, p.n, p.k
    stage = e.symmetric("P", (R, M, N))
    chunks = e.chunks(M)
    outs = []
    for r in range(R):
        x, w = e.operand("x", r), e.operand("w", r)
        gbuf = e.operand("g", r) if p.norm else None
        y = e.local("y", "io_output", (M, N), r)
        outs.append(Region(y, r, (_r(0, M), _r(0, N))))
        for k, a, b in e.row_tiles(chunks, e.cfg.tile_m):
            for n0, n1 in e.col_tiles(N):
                wk = e.worker(r)
                own = Region(stage, r, (SLOT, _r(r, r + 1), _r(a, b), _r(n0, n1)))
                e.task(f"ar.gemm.r{r}.m{a}.n{n0}", r, wk, "gemm",
                       [Region(x, r, (_r(a, b), _r(0, K))), Region(w, r, (_r(0, K), _r(n0, n1)))], [own],
                       signals=[e.counter(f"c.ar.own.r{r}.k{k}", r)])
                for q in e.peers(r):
                    dst = Region(stage, q, (SLOT, _r(r, r + 1), _r(a, b), _r(n0, n1)))
                    e.task(f"ar.put.r{r}.to{q}.m{a}.n{n0}", r, wk, "put", [own], [dst],
                           signals=[e.counter(f"c.ar.r{q}.from{r}.k{k}", q)], comm=True)
        norm = (e.local("h", "activation", (M, N), r), gbuf, p.eps) if p.norm else None
        rows = e.row_tiles(chunks, e.cfg.reduce_rows or e.cfg.tile_m)
        _reduce_rows(e, r, "ar", stage, rows, N, lambda k, r=r: _arrivals("ar", r, R, k),
                     lambda a, b, y=y, r=r: Region(y, r, (_r(a, b), _r(0, N))), norm)
    return outs


def _allreduce_twoshot(e: _Emit, p: MatmulAllReduce) -> list[Region]:
    R, M, N, K = e.R, p.m, p.n, p.k
    blocks = split_aligned(M, R, e.cfg.tile_m)
    bmax = max(b - a for a, b in blocks)
    stage = e.symmetric("P", (R, bmax, N))
    # the all-gathered sums: the output itself, or (RMSNorm) what each rank normalises with its g
    out = e.symmetric("H" if p.norm else "Y", (M, N), kind="activation" if p.norm else "io_output")
    owners = [j for j in range(R) if blocks[j][1] > blocks[j][0]]
    rr = e.cfg.reduce_rows or e.cfg.tile_m
    outs, ys, gs = [], {}, {}
    for r in range(R):
        x, w = e.operand("x", r), e.operand("w", r)
        if p.norm:
            gs[r] = e.operand("g", r)
            ys[r] = e.local("y", "io_output", (M, N), r)
            outs.append(Region(ys[r], r, (_r(0, M), _r(0, N))))
        else:
            outs.append(Region(out, r, (SLOT, _r(0, M), _r(0, N))))
        tmp = None if e.cfg.direct else e.local("T", "activation", (M, N), r)
        chunks = []
        for j in [q for q in e.peers(r) + [r] if q in owners]:
            lo, hi = blocks[j]
            chunks = _scatter_tiles(e, "ar", r, j, lo, hi - lo, x, w, K, N, stage, tmp)
        if r not in owners:
            continue
        lo, hi = blocks[r]

        def gather(wk: int, a: int, b: int, dst: Region, r=r, lo=lo) -> None:
            for q in e.peers(r):
                e.task(f"ar.ag.r{r}.to{q}.m{lo + a}", r, wk, "put", [dst],
                       [Region(out, q, (SLOT, _r(lo + a, lo + b), _r(0, N)))],
                       signals=[e.counter(f"c.ag.r{q}.from{r}", q)], comm=True)
            if p.norm:
                _norm(e, r, wk, f"ar.norm.r{r}.m{lo + a}", dst, gs[r], Region(ys[r], r, (_r(lo + a, lo + b), _r(0, N))),
                      N, p.eps)

        _reduce_rows(e, r, "ar", stage, e.row_tiles(chunks, rr), N, lambda k, r=r: _arrivals("ar", r, R, k),
                     lambda a, b, r=r, lo=lo: Region(out, r, (SLOT, _r(lo + a, lo + b), _r(0, N))), None, gather)
    for r in range(R):
        peers = [q for q in owners if q != r]
        if not p.norm:
            # the kernel of rank r ends only once every peer's rows have landed in its output
            if peers:
                e.task(f"ar.ag.done.r{r}", r, e.worker(r), "nop", [], [],
                       waits=[f"c.ag.r{r}.from{q}" for q in peers], comm=True)
            continue
        for q in peers:  # every rank normalises the peers' rows with its own g
            lo, hi = blocks[q]
            for a, b in tiles(lo, hi, rr):
                _norm(e, r, e.worker(r), f"ar.norm.r{r}.m{a}", Region(out, r, (SLOT, _r(a, b), _r(0, N))), gs[r],
                      Region(ys[r], r, (_r(a, b), _r(0, N))), N, p.eps, waits=[f"c.ag.r{r}.from{q}"])
    return outs


def _norm(e: _Emit, r: int, wk: int, id: str, src: Region, g: str, dst: Region, n: int, eps: float,
          waits: Sequence[str] = ()) -> None:
    """An rmsnorm task over the rows of ``src`` (each of ``n`` elements) with rank r's ``g``."""
    e.task(id, r, wk, "rmsnorm", [src, Region(g, r, (_r(0, n),))], [dst], waits=waits,
           params={"dim": n, "eps": float(eps)})


def _ulysses_combine(e: _Emit, p: UlyssesCombine) -> list[Region]:
    R, S, C, N = e.R, p.s, p.c, p.n
    sr = S // R
    if R == 1:
        return _single(e, "ul", S, N, C, "o")
    g = e.symmetric("G", (sr, R * C))
    chunks = e.chunks(sr)
    outs = []
    for r in range(R):
        o, w = e.operand("o", r), e.operand("w", r)
        y = e.local("y", "io_output", (sr, N), r)
        outs.append(Region(y, r, (_r(0, sr), _r(0, N))))
        for j in e.peers(r):
            for k, (c0, c1) in enumerate(chunks):
                e.task(f"ul.put.r{r}.to{j}.k{k}", r, e.worker(r), "put",
                       [Region(o, r, (_r(j * sr + c0, j * sr + c1), _r(0, C)))],
                       [Region(g, j, (SLOT, _r(c0, c1), _r(r * C, (r + 1) * C)))],
                       signals=[e.counter(f"c.ul.r{j}.from{r}.k{k}", j)], comm=True)
        mt = tiles(0, sr, e.cfg.tile_m)
        ct = e.col_tiles(N)
        if e.cfg.whole_k:
            for k, (c0, c1) in enumerate(chunks):
                e.task(f"ul.own.r{r}.k{k}", r, e.worker(r), "copy",
                       [Region(o, r, (_r(r * sr + c0, r * sr + c1), _r(0, C)))],
                       [Region(g, r, (SLOT, _r(c0, c1), _r(r * C, (r + 1) * C)))],
                       signals=[e.counter(f"c.ul.own.r{r}.k{k}", r)])
            for a, b in mt:
                waits = [c for k in _overlapping(chunks, a, b)
                         for c in [f"c.ul.own.r{r}.k{k}"] + [f"c.ul.r{r}.from{q}.k{k}" for q in e.peers(r)]]
                for n0, n1 in ct:
                    e.task(f"ul.gemm.r{r}.m{a}.n{n0}", r, e.worker(r), "gemm",
                           [Region(g, r, (SLOT, _r(a, b), _r(0, R * C))), Region(w, r, (_r(0, R * C), _r(n0, n1)))],
                           [Region(y, r, (_r(a, b), _r(n0, n1)))], waits=waits)
            continue
        acc = e.local("acc", "activation", (2, sr, N), r, dtype="f32")
        # one worker per output tile: its R GEMMs run in queue order (the running sum needs no wait)
        place = {(a, n0): e.worker(r) for a, _ in mt for n0, _ in ct}
        for i, s in enumerate(e.sources(r)):
            last = i == R - 1
            for a, b in mt:
                if s == r:
                    src, waits = Region(o, r, (_r(r * sr + a, r * sr + b), _r(0, C))), []
                else:
                    src = Region(g, r, (SLOT, _r(a, b), _r(s * C, (s + 1) * C)))
                    waits = [f"c.ul.r{r}.from{s}.k{k}" for k in _overlapping(chunks, a, b)]
                for n0, n1 in ct:
                    ins = [src, Region(w, r, (_r(s * C, (s + 1) * C), _r(n0, n1)))]
                    if i:
                        ins.append(Region(acc, r, (_r((i - 1) % 2, (i - 1) % 2 + 1), _r(a, b), _r(n0, n1))))
                    dst = Region(y, r, (_r(a, b), _r(n0, n1))) if last else \
                        Region(acc, r, (_r(i % 2, i % 2 + 1), _r(a, b), _r(n0, n1)))
                    e.task(f"ul.gemm.r{r}.from{s}.m{a}.n{n0}", r, place[(a, n0)], "gemm", ins, [dst], waits=waits)
    return outs


_LOWER = {
    AllGatherMatmul: _allgather_matmul,
    MatmulReduceScatter: _matmul_reduce_scatter,
    MatmulAllReduce: _matmul_allreduce,
    UlyssesCombine: _ulysses_combine,
}


def lower_pattern(pattern: Pattern, config: CollectiveConfig | None = None,
                  target: Target | None = None) -> tuple[ScheduleProgram, Binding]:
    """Lower ``pattern`` (models/collectives.py; its world size is the program's ranks) to a
    ScheduleProgram with ``config``'s tiles, workers, chunks and algorithm (defaults when
    None) for ``target`` (``Target()``: 132 SMs, the sim backend, when None; ``workers`` 0
    means one per SM of it, tiles 0 ``size_tile``'s side; ``resolve_config``). Returns the program and the Binding of its operands and outputs.

    Raises AmkError (exit code 2) for a pattern whose shapes do not fit (``Pattern.check``),
    a bad knob value, or more workers than the target can hold.
    """
    pattern.check()
    cfg = (config or CollectiveConfig()).validate("collective config", combinations=False)
    fn = _LOWER.get(type(pattern))
    if fn is None:
        raise AmkError(f"no lowering for the pattern {pattern.kind!r}")
    e = _Emit(pattern, cfg, target or Target())
    outs = fn(e, pattern)
    prog = e.build()
    return prog, Binding(pattern, tuple(e.inputs), tuple(outs), prog.slots)


__all__ = ["Binding", "gemm_extent", "lower_pattern", "resolve_config", "size_tile"]
