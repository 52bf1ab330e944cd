"""A warp-specialised GEMV stream in Gluon: the probe behind ``bench/gemv_gluon.py``.

Question: does a persistent worker whose 1-warp loader partition streams the weight tiles of
*upcoming tasks* into a ring of shared-memory pages (across task boundaries, bounded only by
free pages), while compute warps wait on each page's mbarrier, reach the HBM roofline on a
decode step's GEMVs? The megakernel's worker holds its weight stream in registers and drains
it at every task boundary and counter wait (docs/experiments.md).

Pieces:

* ``decode_matrices`` / ``build_tasks`` (CPU, no Triton): the GEMVs of one decode step of a
  decoder (Llama-3.2-1B: per layer q/k/v as one 3072 x 2048 matrix, o 2048 x 2048, gate/up as
  one 16384 x 2048, down 2048 x 8192; then the 128256 x 2048 LM head) cut into row tiles and
  assigned to the persistent CTAs in matrix order, greedily by bytes or round-robin. The
  weights live in two arenas, one per K (2048 and 8192), so one TMA descriptor per arena
  serves every matrix; a task names its arena.
* four kernels of the same page loop (``VARIANTS``):

  - ``ws``: ``gl.warp_specialize``; a 1-warp loader issues TMA copies of pages (``R x BK``
    bf16 boxes) into an S-page ring, waiting only for free pages; the default partition
    (``num_warps`` compute warps) waits for each page's "ready" mbarrier, loads it into
    registers, releases it on its "empty" mbarrier and accumulates ``w * x`` in fp32;
  - ``wscp``: the same with the loader's copies as ``cp.async`` (16-byte LDGSTS issued by the
    loader's warps, completion counted on the page's mbarrier), the plain-load route;
  - ``pipe``: no warp specialisation, the same TMA ring issued by the compute warps
    themselves S - 1 pages ahead of the page they consume (one CTA barrier per page), so the
    loader *role* is the only difference from ``ws``;
  - ``sync``: no ring, no warp specialisation: each page is a plain ``gl.load`` into registers
    followed by its multiply-adds (what a register GEMV without unrolling does).

* ``nocompute`` (``ws``, ``wscp``): the compute warps release each page unread, the weight
  stream's own ceiling; ``nocopy`` (``ws``): the loader copies only the ring's first S pages
  and then marks each page ready without copying, so the compute warps re-read pages that
  are already in shared memory: the consumer's own ceiling (what a worker gains from pages
  that landed during a wait); ``maxnreg``: the launch's register cap (128: two CTAs an SM).
* ``DEP`` (v2): each task's first page waits, before it reads its activation vector, until the
  previous matrix's tiles have all been stored (per-matrix completion counters in global
  memory, acquire polls, one release add per tile). Only the compute warps wait; in ``ws`` the
  loader keeps streaming weights meanwhile. The activation vectors are still the inputs given
  (the wait is a real dependency of the timing, not of the data), so the result stays
  checkable against torch.

``compile_offline`` compiles a variant for ``sm_<arch>`` without a GPU (Triton's own LLVM and
ptxas; needs the GPU machines' Triton 3.6, whose Gluon API this module is written for).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ground.errors import AmkError

#: Fields per task row of the int32 task table.
TASK_FIELDS = ("arena", "row0", "rows", "k", "xoff", "yoff", "matrix", "wait")
NF = len(TASK_FIELDS)
#: The kernels of the page loop (module doc).
VARIANTS = ("ws", "wscp", "pipe", "sync")


@dataclass(frozen=True)
class Matrix:
    """One GEMV of the step: y[yoff : yoff + rows] = W @ x[xoff : xoff + k].

    ``arena``: index of the weight arena (one per distinct K, rows stacked); ``row0``: the
    matrix's first row in that arena. bf16 weights: ``rows * k * 2`` bytes."""

    name: str
    rows: int
    k: int
    arena: int = 0
    row0: int = 0
    xoff: int = 0
    yoff: int = 0

    @property
    def nbytes(self) -> int:
        return self.rows * self.k * 2


def decode_matrices(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                    layers: int) -> list[Matrix]:
    """The weight GEMVs of one batch-1 decode step of a Llama-style decoder, in execution order:
    per layer ``qkv`` ((heads + 2 kv_heads) * head_dim x hidden), ``o`` (hidden x heads *
    head_dim), ``gate_up`` (2 intermediate x hidden), ``down`` (hidden x intermediate); then
    ``lm_head`` (vocab x hidden). Arenas are numbered by K in order of first use; activation
    and output offsets are packed in order (elements)."""
    shapes = []
    for i in range(layers):
        shapes += [(f"l{i}.qkv", (heads + 2 * kv_heads) * head_dim, hidden), (f"l{i}.o", hidden, heads * head_dim),
                   (f"l{i}.gate_up", 2 * intermediate, hidden), (f"l{i}.down", hidden, intermediate)]
    shapes.append(("lm_head", vocab, hidden))
    arenas: dict[int, int] = {}
    arena_rows: dict[int, int] = {}
    out, xoff, yoff = [], 0, 0
    for name, rows, k in shapes:
        a = arenas.setdefault(k, len(arenas))
        out.append(Matrix(name, rows, k, a, arena_rows.get(a, 0), xoff, yoff))
        arena_rows[a] = arena_rows.get(a, 0) + rows
        xoff += k
        yoff += rows
    return out


def model_matrices(name: str) -> list[Matrix]:
    """``decode_matrices`` of a built-in ``config:NAME`` shape (models.recipes), e.g.
    ``llama-3.2-1b``. Raises AmkError for an unknown name."""
    from models.recipes import build_config, recipe_names

    if name not in recipe_names():
        raise AmkError(f"unknown model shape {name!r}; one of: {', '.join(recipe_names())}")
    c = build_config(name)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return decode_matrices(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads,
                           head_dim, c.vocab_size, c.num_hidden_layers)


@dataclass
class TaskList:
    """Per-CTA task lists of GEMV row tiles.

    ``table``: ``ntasks x NF`` int32 rows (``TASK_FIELDS``), CTA c's tasks at rows
    ``starts[c] : starts[c + 1]`` in execution order (matrix order); ``wait`` is the matrix whose
    tiles must all be stored before the task reads its activation vector (the previous matrix
    at the CTA's first tile of a matrix, else -1). ``tiles[m]``: tiles of matrix m (the
    completion count a waiter needs). ``cta_bytes``: weight bytes per CTA."""

    matrices: list[Matrix]
    ctas: int
    tile: int
    table: list[list[int]]
    starts: list[int]
    tiles: list[int]
    cta_bytes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Weight bytes the step reads (each tile once)."""
        return sum(r[2] * r[3] * 2 for r in self.table)

    def arena_rows(self) -> list[int]:
        """Rows of each weight arena."""
        n: dict[int, int] = {}
        for m in self.matrices:
            n[m.arena] = max(n.get(m.arena, 0), m.row0 + m.rows)
        return [n[a] for a in sorted(n)]

    def arena_k(self) -> list[int]:
        """K (columns) of each weight arena."""
        return [next(m.k for m in self.matrices if m.arena == a) for a in range(len(self.arena_rows()))]


def build_tasks(matrices: list[Matrix], ctas: int, tile: int, page_rows: int, page_cols: int,
                policy: str = "greedy") -> TaskList:
    """Cut every matrix into tiles of ``tile`` rows (a matrix's last tile may be shorter) and
    assign them to ``ctas`` CTAs in matrix order: ``greedy`` gives each tile to the CTA with
    the fewest weight bytes so far (lowest index on ties), ``rr`` deals them round-robin,
    continuing the rotation across matrices.

    Raises AmkError when a tile's rows are not a multiple of ``page_rows``, a K is not a
    multiple of ``page_cols``, or an argument is out of range."""
    if ctas < 1 or tile < 1 or page_rows < 1 or page_cols < 1:
        raise AmkError(f"ctas, tile and page shape must be positive (got {ctas}, {tile}, {page_rows}x{page_cols})")
    if policy not in ("greedy", "rr"):
        raise AmkError(f"unknown assignment policy {policy!r}; one of: greedy, rr")
    if tile % page_rows:
        raise AmkError(f"tile of {tile} rows is not a multiple of the page's {page_rows} rows")
    per: list[list[list[int]]] = [[] for _ in range(ctas)]
    load = [(0, c) for c in range(ctas)]
    cta_bytes = [0] * ctas
    tiles: list[int] = []
    rr = 0
    for mi, m in enumerate(matrices):
        if m.rows % page_rows:
            raise AmkError(f"matrix {m.name} has {m.rows} rows, not a multiple of the page's {page_rows} rows")
        if m.k % page_cols:
            raise AmkError(f"matrix {m.name} has K = {m.k}, not a multiple of the page's {page_cols} columns")
        seen: set[int] = set()
        n = 0
        for r0 in range(0, m.rows, tile):
            rows = min(tile, m.rows - r0)
            if policy == "greedy":
                b, c = heapq.heappop(load)
                heapq.heappush(load, (b + rows * m.k * 2, c))
            else:
                c = rr % ctas
                rr += 1
            wait = mi - 1 if mi > 0 and c not in seen else -1
            seen.add(c)
            per[c].append([m.arena, m.row0 + r0, rows, m.k, m.xoff, m.yoff + r0, mi, wait])
            cta_bytes[c] += rows * m.k * 2
            n += 1
        tiles.append(n)
    table, starts = [], [0]
    for lst in per:
        table += lst
        starts.append(len(table))
    return TaskList(matrices, ctas, tile, table, starts, tiles, cta_bytes)


@dataclass(frozen=True)
class Variant:
    """One kernel configuration: ``kind`` (``VARIANTS``), ring pages ``stages`` (``ws``,
    ``wscp``, ``pipe``), page shape ``rows x cols`` (bf16), compute warps ``warps``, loader
    warps ``loader_warps`` and registers ``loader_regs`` (``ws``, ``wscp``), ``dep`` (v2
    completion-counter waits), ``x_f32`` (activation vectors in fp32, else bf16), ``compute``
    (False: ``ws``/``wscp`` compute warps release every page unread, no multiply-adds: the
    weight stream's own ceiling, output not computed), ``copy`` (False: ``ws``'s loader copies
    only the first ``stages`` pages, then marks pages ready without copying: the compute
    warps' own ceiling on resident pages, output not checked), ``maxnreg`` (registers per thread
    for the launch, None: Triton's choice; 128 lets two 8-warp CTAs share an SM)."""

    kind: str = "ws"
    stages: int = 4
    rows: int = 32
    cols: int = 256
    warps: int = 4
    loader_warps: int = 1
    loader_regs: int = 40
    dep: bool = False
    x_f32: bool = False
    compute: bool = True
    copy: bool = True
    maxnreg: int | None = None

    def label(self) -> str:
        s = f"{self.kind}:{self.rows}x{self.cols}"
        if self.kind != "sync":
            s += f":S{self.stages}"
        s += f":w{self.warps}"
        if self.kind in ("ws", "wscp"):
            s += f":l{self.loader_warps}"
        s += f":m{self.maxnreg}" if self.maxnreg else ""
        s += (":dep" if self.dep else "") + ("" if self.compute else ":nocompute") + ("" if self.copy else ":nocopy")
        return s + (":xf32" if self.x_f32 else "")

    def spec(self) -> str:
        """The ``parse_variant`` spec of this variant (``x_f32`` is a flag, not part of it)."""
        s = f"{self.kind}:{self.rows}x{self.cols}"
        if self.kind != "sync":
            s += f":{self.stages}"
        s += f":w{self.warps}:l{self.loader_warps}:r{self.loader_regs}" + (f":m{self.maxnreg}" if self.maxnreg else "")
        return (s + (":dep" if self.dep else "") + ("" if self.compute else ":nocompute")
                + ("" if self.copy else ":nocopy"))

    @property
    def checked(self) -> bool:
        """Whether the variant computes y from the given weights (so torch can check it)."""
        return self.compute and self.copy

    @property
    def page_bytes(self) -> int:
        return self.rows * self.cols * 2

    def check(self) -> None:
        """Raise AmkError for a configuration the kernels cannot run (one line naming it)."""
        if self.kind not in VARIANTS:
            raise AmkError(f"unknown variant kind {self.kind!r}; one of: {', '.join(VARIANTS)}")
        p2 = lambda v: v > 0 and v & (v - 1) == 0  # gl.arange needs powers of two
        if not (p2(self.rows) and p2(self.cols)) or self.cols < 8:
            raise AmkError(f"page shape {self.rows}x{self.cols}: rows and cols must be powers of two, cols >= 8")
        if self.kind in ("ws", "pipe") and (self.rows > 256 or self.cols > 256):
            raise AmkError(f"page shape {self.rows}x{self.cols}: a TMA box has at most 256 rows and 256 columns")
        if self.warps not in (1, 2, 4, 8, 16):
            raise AmkError(f"compute warps {self.warps}: one of 1, 2, 4, 8, 16")
        if self.kind != "sync" and not 2 <= self.stages <= 32:
            raise AmkError(f"ring pages {self.stages}: 2..32")
        if self.kind != "sync" and self.stages * self.page_bytes > 200 * 1024:
            raise AmkError(f"ring of {self.stages} x {self.page_bytes // 1024} KiB pages exceeds 200 KiB "
                           "of shared memory")
        if not self.compute and self.kind not in ("ws", "wscp"):
            raise AmkError(f"nocompute needs a warp-specialised kind (ws, wscp), not {self.kind}")
        if not self.copy and (self.kind != "ws" or not self.compute):
            raise AmkError(f"nocopy needs the TMA loader (ws) and the compute warps (not nocompute), "
                           f"got {self.kind}{'' if self.compute else ' with nocompute'}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise AmkError(f"register cap {self.maxnreg}: 24..255 per thread")
        if self.loader_warps not in (1, 2, 4):
            raise AmkError(f"loader warps {self.loader_warps}: one of 1, 2, 4")


def parse_variant(spec: str, warps: int = 4, dep: bool = False, x_f32: bool = False) -> Variant:
    """``KIND:RxC[:S][:wN][:lN][:rN][:mN][:dep][:nocompute][:nocopy]`` (e.g. ``ws:32x256:6:w4:l1``,
    ``sync:64x256:w8``; S ring pages, N compute warps, loader warps and registers, the launch's
    register cap) into a checked
    Variant; ``warps``, ``dep``, ``x_f32`` are the defaults for parts the spec leaves out.
    Raises AmkError naming the spec and the bad part."""
    parts = spec.strip().split(":")
    try:
        kind = parts[0]
        r, c = (int(v) for v in parts[1].lower().split("x"))
        kw: dict = dict(kind=kind, rows=r, cols=c, warps=warps, dep=dep, x_f32=x_f32)
        for p in parts[2:]:
            if p.startswith("w"):
                kw["warps"] = int(p[1:])
            elif p.startswith("l"):
                kw["loader_warps"] = int(p[1:])
            elif p.startswith("r"):
                kw["loader_regs"] = int(p[1:])
            elif p.startswith("m"):
                kw["maxnreg"] = int(p[1:])
            elif p == "dep":
                kw["dep"] = True
            elif p == "nocompute":
                kw["compute"] = False
            elif p == "nocopy":
                kw["copy"] = False
            else:
                kw["stages"] = int(p.lstrip("S"))
    except (IndexError, ValueError):
        raise AmkError(f"variant {spec!r}: expected KIND:RxC[:S][:wN][:lN][:rN][:mN][:dep][:nocompute][:nocopy], "
                       "e.g. ws:32x256:6:w4") from None
    v = Variant(**kw)
    try:
        v.check()
    except AmkError as e:
        raise AmkError(f"variant {spec!r}: {e}") from None
    return v


def threads_per_col(cols: int) -> int:
    """Threads of a warp along a page row: 16-byte vectors (8 bf16) per thread, at most 32."""
    return min(32, cols // 8)


# ------------------------------------------------------------------------------------------ kernels
# Gluon is imported lazily: the task builder above must stay usable on machines whose Triton
# has no Gluon (or a different Gluon API); the kernels target the GPU machines' Triton 3.6.
_KERNELS: dict | None = None


def kernels() -> dict:
    """The Gluon jit functions by variant kind (built on first use)."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _build_kernels()
    return _KERNELS


def _build_kernels() -> dict:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
    )

    @gluon.jit
    def _al(v, A: gl.constexpr):
        # restate a table value's alignment so loads vectorise (Triton 3.6 drops a bare
        # multiple_of on a loaded value; lang.aligned does the same for the megakernel)
        return gl.multiple_of((v // A) * A, A)

    @gluon.jit
    def _task_dims(T, t, R: gl.constexpr, BK: gl.constexpr):
        # task t's rows, K (whole pages of BK columns) and its x / y offsets (TASK_FIELDS)
        return (gl.load(T + t * 8 + 2), _al(gl.load(T + t * 8 + 3), BK),
                _al(gl.load(T + t * 8 + 4), 8), _al(gl.load(T + t * 8 + 5), R))

    @gluon.jit
    def _wait_dep(T, t, TILES, CTR, epoch, DEP: gl.constexpr):
        # v2: the task's activation vector is ready once every tile of the matrix it waits for
        # has been stored (monotone counters: epoch * tiles after this launch's stores)
        if DEP:
            wm = gl.load(T + t * 8 + 7)
            if wm >= 0:
                target = gl.load(TILES + wm) * epoch
                while gl.atomic_add(CTR + wm, 0, sem="acquire", scope="gpu") < target:
                    pass

    @gluon.jit
    def _signal(T, t, CTR, DEP: gl.constexpr):
        if DEP:
            gl.thread_barrier()  # every compute warp's stores of the tile precede the release
            gl.atomic_add(CTR + gl.load(T + t * 8 + 6), 1, sem="release", scope="gpu")

    @gluon.jit
    def _page_dot(w, X, xoff, kb, acc, BK: gl.constexpr, BL: gl.constexpr):
        cols = xoff + kb * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, BL))
        x = gl.load(X + cols).to(gl.float32)
        return acc + w.to(gl.float32) * gl.expand_dims(x, 0)

    @gluon.jit
    def _store_rows(Y, yoff, acc, R: gl.constexpr, BL: gl.constexpr):
        rows = yoff + gl.arange(0, R, layout=gl.SliceLayout(1, BL))
        gl.store(Y + rows, gl.sum(acc, axis=1))

    @gluon.jit
    def _compute(T, lo, hi, X, Y, TILES, CTR, epoch, pages, ready, empty,
                 R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, BL: gl.constexpr, DEP: gl.constexpr,
                 COMPUTE: gl.constexpr):
        # the default partition: consume the ring in the loader's order, release each page
        # as soon as it sits in registers (without COMPUTE: release it unread, the stream alone)
        i = 0
        for t in range(lo, hi):
            rows, K, xoff, yoff = _task_dims(T, t, R, BK)
            _wait_dep(T, t, TILES, CTR, epoch, DEP)
            for rb in range(0, rows, R):
                acc = gl.zeros([R, BK], gl.float32, BL)
                for kb in range(0, K // BK):
                    s = i % S
                    mbarrier.wait(ready.index(s), (i // S) & 1)
                    if COMPUTE:
                        w = pages.index(s).load(BL)
                        # order the generic-proxy reads before the loader's next async write
                        fence_async_shared()
                        mbarrier.arrive(empty.index(s), count=1)
                        acc = _page_dot(w, X, xoff, kb, acc, BK, BL)
                    else:
                        mbarrier.arrive(empty.index(s), count=1)
                    i += 1
                _store_rows(Y, yoff + rb, acc, R, BL)
            _signal(T, t, CTR, DEP)

    @gluon.jit
    def _load_tma(T, lo, hi, d0, d1, pages, ready, empty, R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
                  COPY: gl.constexpr):
        # the loader partition (1 warp): copy pages of the CTA's whole task list into the ring,
        # waiting for nothing but a free page (without COPY: only the first S pages; later
        # pages are marked ready as they are, so the compute warps re-read resident pages)
        i = 0
        for t in range(lo, hi):
            arena = gl.load(T + t * 8 + 0)
            row0 = _al(gl.load(T + t * 8 + 1), R)
            rows = gl.load(T + t * 8 + 2)
            K = _al(gl.load(T + t * 8 + 3), BK)
            for rb in range(0, rows, R):
                for kb in range(0, K // BK):
                    s = i % S
                    mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
                    if COPY or i < S:
                        mbarrier.expect(ready.index(s), R * BK * 2)
                        if arena == 0:
                            tma.async_copy_global_to_shared(d0, [row0 + rb, kb * BK], ready.index(s), pages.index(s))
                        else:
                            tma.async_copy_global_to_shared(d1, [row0 + rb, kb * BK], ready.index(s), pages.index(s))
                    else:
                        mbarrier.arrive(ready.index(s), count=1)
                    i += 1

    @gluon.jit
    def _load_cp(T, lo, hi, W0, W1, pages, ready, empty, R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr,
                 LW: gl.constexpr, LTC: gl.constexpr):
        # the loader partition with cp.async: LW warps, 16-byte copies, R / SUB sub-blocks per
        # page so a thread holds few addresses; completion counted on the page's mbarrier
        LL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LTC, LTC], [LW, 1], [1, 0])
        SUB: gl.constexpr = (32 // LTC) * LW
        i = 0
        for t in range(lo, hi):
            arena = gl.load(T + t * 8 + 0)
            row0 = _al(gl.load(T + t * 8 + 1), R)
            rows = gl.load(T + t * 8 + 2)
            K = _al(gl.load(T + t * 8 + 3), BK)
            base = gl.where(arena == 0, W0, W1)
            for rb in range(0, rows, R):
                for kb in range(0, K // BK):
                    s = i % S
                    mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
                    page = pages.index(s)
                    for j in gl.static_range(R // SUB):
                        r = row0 + rb + j * SUB + gl.arange(0, SUB, layout=gl.SliceLayout(1, LL))
                        c = kb * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, LL))
                        ptr = base + gl.expand_dims(r.to(gl.int64) * K, 1) + gl.expand_dims(c, 0)
                        async_copy.async_copy_global_to_shared(page.slice(j * SUB, SUB, dim=0), ptr)
                    async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                    i += 1

    @gluon.jit(do_not_specialize=["epoch"])  # a new epoch per launch: no recompiles
    def _gemv_ws(T, TSTART, X, Y, TILES, CTR, epoch, d0, d1,
                 R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, TC: gl.constexpr,
                 DEP: gl.constexpr, LREGS: gl.constexpr, COMPUTE: gl.constexpr, COPY: gl.constexpr,
                 num_warps: gl.constexpr):
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [num_warps, 1], [1, 0])
        pid = gl.program_id(0)
        lo = gl.load(TSTART + pid)
        hi = gl.load(TSTART + pid + 1)
        pages = gl.allocate_shared_memory(gl.bfloat16, [S, R, BK], d0.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(S):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_compute, (T, lo, hi, X, Y, TILES, CTR, epoch, pages, ready, empty, R, BK, S, BL, DEP, COMPUTE)),
            (_load_tma, (T, lo, hi, d0, d1, pages, ready, empty, R, BK, S, COPY)),
        ], [1], [LREGS])

    @gluon.jit(do_not_specialize=["epoch"])  # a new epoch per launch: no recompiles
    def _gemv_wscp(T, TSTART, X, Y, TILES, CTR, epoch, W0, W1,
                   R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, TC: gl.constexpr,
                   DEP: gl.constexpr, LREGS: gl.constexpr, LW: gl.constexpr, COMPUTE: gl.constexpr,
                   num_warps: gl.constexpr):
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [num_warps, 1], [1, 0])
        SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        pid = gl.program_id(0)
        lo = gl.load(TSTART + pid)
        hi = gl.load(TSTART + pid + 1)
        pages = gl.allocate_shared_memory(gl.bfloat16, [S, R, BK], SL)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(S):
            mbarrier.init(ready.index(s), count=LW * 32)  # every loader thread's copies arrive
            mbarrier.init(empty.index(s), count=1)
        gl.warp_specialize([
            (_compute, (T, lo, hi, X, Y, TILES, CTR, epoch, pages, ready, empty, R, BK, S, BL, DEP, COMPUTE)),
            (_load_cp, (T, lo, hi, W0, W1, pages, ready, empty, R, BK, S, LW, TC)),
        ], [LW], [LREGS])

    @gluon.jit
    def _issue(T, t, p, hi, d0, d1, pages, ready, R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, i):
        # copy page p of task t (if t < hi) into slot i % S; returns the next (t, p)
        if t < hi:
            arena = gl.load(T + t * 8 + 0)
            row0 = _al(gl.load(T + t * 8 + 1), R)
            nk = gl.load(T + t * 8 + 3) // BK
            npages = (gl.load(T + t * 8 + 2) // R) * nk
            s = i % S
            mbarrier.expect(ready.index(s), R * BK * 2)
            coord_r = row0 + (p // nk) * R
            coord_k = (p % nk) * BK
            if arena == 0:
                tma.async_copy_global_to_shared(d0, [coord_r, coord_k], ready.index(s), pages.index(s))
            else:
                tma.async_copy_global_to_shared(d1, [coord_r, coord_k], ready.index(s), pages.index(s))
            p += 1
            if p == npages:
                t += 1
                p = 0
        return t, p

    @gluon.jit(do_not_specialize=["epoch"])  # a new epoch per launch: no recompiles
    def _gemv_pipe(T, TSTART, X, Y, TILES, CTR, epoch, d0, d1,
                   R: gl.constexpr, BK: gl.constexpr, S: gl.constexpr, TC: gl.constexpr,
                   DEP: gl.constexpr, num_warps: gl.constexpr):
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [num_warps, 1], [1, 0])
        pid = gl.program_id(0)
        lo = gl.load(TSTART + pid)
        hi = gl.load(TSTART + pid + 1)
        pages = gl.allocate_shared_memory(gl.bfloat16, [S, R, BK], d0.layout)
        ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
        for j0 in gl.static_range(S):
            mbarrier.init(ready.index(j0), count=1)
        fence_async_shared()
        # the issue cursor (task it, page ip) runs S - 1 pages ahead of the consumer
        it = lo
        ip = 0
        for j in gl.static_range(S - 1):
            it, ip = _issue(T, it, ip, hi, d0, d1, pages, ready, R, BK, S, j)
        i = 0
        for t in range(lo, hi):
            rows, K, xoff, yoff = _task_dims(T, t, R, BK)
            _wait_dep(T, t, TILES, CTR, epoch, DEP)
            for rb in range(0, rows, R):
                acc = gl.zeros([R, BK], gl.float32, BL)
                for kb in range(0, K // BK):
                    # slot (i - 1) % S was read by every warp before this barrier: refill it
                    gl.thread_barrier()
                    fence_async_shared()
                    it, ip = _issue(T, it, ip, hi, d0, d1, pages, ready, R, BK, S, i + S - 1)
                    s = i % S
                    mbarrier.wait(ready.index(s), (i // S) & 1)
                    w = pages.index(s).load(BL)
                    acc = _page_dot(w, X, xoff, kb, acc, BK, BL)
                    i += 1
                _store_rows(Y, yoff + rb, acc, R, BL)
            _signal(T, t, CTR, DEP)

    @gluon.jit(do_not_specialize=["epoch"])  # a new epoch per launch: no recompiles
    def _gemv_sync(T, TSTART, X, Y, TILES, CTR, epoch, W0, W1,
                   R: gl.constexpr, BK: gl.constexpr, TC: gl.constexpr, DEP: gl.constexpr,
                   num_warps: gl.constexpr):
        BL: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [num_warps, 1], [1, 0])
        pid = gl.program_id(0)
        lo = gl.load(TSTART + pid)
        hi = gl.load(TSTART + pid + 1)
        for t in range(lo, hi):
            arena = gl.load(T + t * 8 + 0)
            row0 = _al(gl.load(T + t * 8 + 1), R)
            rows, K, xoff, yoff = _task_dims(T, t, R, BK)
            base = gl.where(arena == 0, W0, W1)
            _wait_dep(T, t, TILES, CTR, epoch, DEP)
            for rb in range(0, rows, R):
                acc = gl.zeros([R, BK], gl.float32, BL)
                r = row0 + rb + gl.arange(0, R, layout=gl.SliceLayout(1, BL))
                for kb in range(0, K // BK):
                    c = kb * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, BL))
                    w = gl.load(base + gl.expand_dims(r.to(gl.int64) * K, 1) + gl.expand_dims(c, 0))
                    acc = _page_dot(w, X, xoff, kb, acc, BK, BL)
                _store_rows(Y, yoff + rb, acc, R, BL)
            _signal(T, t, CTR, DEP)

    return dict(ws=_gemv_ws, wscp=_gemv_wscp, pipe=_gemv_pipe, sync=_gemv_sync)


def smem_layout(v: Variant):
    """The pages' NVMMA shared layout (what the TMA descriptors carry): no swizzle, so a warp's
    16-byte loads along a page row hit consecutive banks."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def launch_args(v: Variant) -> tuple[dict, dict]:
    """(constexprs, options) of a variant's launch: block sizes and the compile options
    (``num_warps``: the compute warps; a warp-specialised kernel adds its loader's warpgroup)."""
    cx = dict(R=v.rows, BK=v.cols, TC=threads_per_col(v.cols), DEP=v.dep)
    if v.kind != "sync":
        cx["S"] = v.stages
    if v.kind in ("ws", "wscp"):
        cx["LREGS"] = v.loader_regs
        cx["COMPUTE"] = v.compute
    if v.kind == "ws":
        cx["COPY"] = v.copy
    if v.kind == "wscp":
        cx["LW"] = v.loader_warps
    return cx, dict(num_warps=v.warps, **({"maxnreg": v.maxnreg} if v.maxnreg else {}))


def compile_offline(v: Variant, arch: int = 90, asm: bool = False) -> dict:
    """Compile variant ``v`` for ``sm_<arch>`` without a GPU (Triton's own LLVM and ptxas)
    and report what the GPU run depends on: shared memory, registers and spills per thread
    (cuobjdump, when Triton ships it), whether the kernel is partitioned into warp groups
    (``ttg.warp_specialize`` in the TTGIR, ``setmaxnreg`` in the PTX), TMA copies
    (``cp.async.bulk.tensor``), cp.async copies, mbarrier waits and 16-byte shared loads
    (the compute warps reading pages).

    ``asm``: also return the PTX and TTGIR texts (keys ``ptx``, ``ttgir``).
    Needs ``TRITON_INTERPRET=0`` and a Triton with Gluon's 3.6 API (the GPU machines')."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    v.check()
    fn = kernels()[v.kind]
    cx, opts = launch_args(v)
    types = dict(T="*i32", TSTART="*i32", X="*fp32" if v.x_f32 else "*bf16", Y="*fp32", TILES="*i32",
                 CTR="*i32", epoch="i32", W0="*bf16", W1="*bf16")
    desc = f"tensordesc<bf16[{v.rows}, {v.cols}],{smem_layout(v)!r}>"
    sig = {}
    for n in fn.arg_names:
        if n == "num_warps" or n in cx:
            sig[n] = "constexpr"
        elif n in ("d0", "d1"):
            sig[n] = desc
        else:
            sig[n] = types[n]
    consts = {**cx, "num_warps": v.warps}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    k = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", arch, 32), options=opts)
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    out = dict(variant=v.label(), arch=arch, shared=int(k.metadata.shared), num_warps=int(k.metadata.num_warps),
               warp_specialize="ttg.warp_specialize" in ttgir, setmaxnreg=ptx.count("setmaxnreg"),
               tma_copies=ptx.count("cp.async.bulk.tensor"), cp_async=len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
               mbarrier_waits=ptx.count("mbarrier.try_wait"), page_loads=ptx.count("ld.shared.v4"),
               global_vector_loads=len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
               acquire="acquire" in ptx, regs=None, local_bytes=None)
    from lowering.triton.offline import resource_usage

    out.update(resource_usage(k))
    if asm:
        out.update(ptx=ptx, ttgir=ttgir)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m lowering.triton.gluon_probe SPEC [SPEC ...] [--arch 90]``: compile each
    variant offline and print one JSON object per line; exit 2 (one line) for a bad spec."""
    import argparse
    import json

    from lowering.triton.lang import INTERPRET

    ap = argparse.ArgumentParser(prog="python -m lowering.triton.gluon_probe",
                                 description="Compile Gluon GEMV-stream variants offline (no GPU needed).")
    ap.add_argument("specs", nargs="+", help="variants, e.g. ws:32x256:6:w4 pipe:32x256:6 sync:32x256")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dep", action="store_true", help="v2: completion-counter waits")
    a = ap.parse_args(argv)
    if INTERPRET:
        raise AmkError("the offline compile needs TRITON_INTERPRET=0 (the Triton interpreter is on)")
    for s in a.specs:
        print(json.dumps(compile_offline(parse_variant(s, dep=a.dep), a.arch)), flush=True)
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "python -m lowering.triton.gluon_probe")
