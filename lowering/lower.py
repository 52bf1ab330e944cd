"""Lowering: ModelGraph -> tensor-parallel, tiled ScheduleProgram for R ranks x W workers.

Design (docs/lowering.md has the full description with a picture of one layer):

* Column-parallel q/k/v (split by query heads; a rank projects every KV head its query heads
  use, so a KV head whose group spans two ranks is replicated) and gate/up (split by
  intermediate columns). Row-parallel o_proj and down_proj: each rank multiplies its column
  slice and produces a partial sum of the hidden vector, combined across ranks by an
  all-reduce made of puts, signals and local ``reduce`` tasks (algorithm: ``oneshot`` or
  ``twoshot``, a config knob), fused with the residual add.
* Vocabulary-parallel LM head: each rank computes the logits of its vocabulary rows, takes
  their argmax (value, global index), exchanges the pair with every peer and combines them
  (``argmax_combine``) into the next token, replicated on every rank.
* GEMVs are tiled by ``tile`` weight rows; tiles are assigned to workers by ``policy``.
  Small ops run as single tasks; chains of small ops that depend on each other (q_norm ->
  rope, k_norm -> rope -> kv_append, gate tile -> up tile -> silu_mul tile) run on one worker
  so queue order replaces a counter. With a q/k norm the q and kv chains are split per KV
  head (``_qk_norm_attention``), so the heads' latency-bound chains run on different workers.
* Synchronisation: one monotone counter per sync point per rank, waited on with a full
  threshold (the number of producer signals per epoch), epoch-relative so it never needs a
  reset. A wait is omitted only when every producer precedes the consumer on the same worker.
  Cross-rank arrivals use one counter per (site, source rank, destination rank): a shared
  counter fed by several sources could be satisfied by a fast peer's signal of the NEXT step
  standing in for a slow peer's signal of this one. Receive buffers are double buffered
  (``slots = 2``, region bound ``s = epoch mod 2``); a rank can be at most one step ahead of
  a peer's read of a slot because every rank waits for every other rank's data each step.

Every program this module emits is meant to pass ``validator.validate``; the tests check it
for every tiny recipe x R in 1..4 x several configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ground.errors import AmkError
from ir.program import (
    Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task,
    Wait, WeightSource,
)
from lowering.config import LoweringConfig
from lowering.costmodel import task_bytes
from lowering.partition import Partition, check_split, partition, split_aligned, tiles
from lowering.quant import GROUP, IR_DTYPE, is_quantized, qweight_key, scale_key
from models.graph import GraphOp, ModelGraph

SLOT = Range(Bound(0, 1), Bound(1, 1))  # s:s+1, the current receive slot
#: Logits per LM-head argmax task (rounded down to whole GEMV tiles): one task over 128K
#: logits takes 221 us on an H200 (docs/experiments.md); chunks of 4K run in parallel, each
#: as soon as its tiles are done.
ARGMAX_CHUNK = 4096
#: KV heads per late-append task (``late_append``): the kernel's rope_append handles one head
#: after another, ~1.3 us a head on an H100, so 8 heads (~11 us, Llama-3.2-1B's whole rank)
#: fit the slack at the end of the gate/up stage; more heads take more tasks.
LATE_APPEND_HEADS = 8
#: Columns per reduce task of down_split_k's partials (at least the GEMV tile): a reduce moves
#: a few KB and sits off the critical path, so few wide tasks (8 for a 2048 hidden size) cost
#: the workers least; at the GEMV tile a 16-row tile gave 128 a layer.
SPLIT_REDUCE_COLS = 256
#: The ``balanced`` policy's per-task fixed cost in bytes: ~3 us of per-task overhead
#: (GPU profiles, docs/experiments.md) at the ~32 GB/s share of HBM bandwidth one H200 SM has.
TASK_FIXED_BYTES = 96 * 1024


def _r(a: int, b: int) -> Range:
    return Range(Bound(a), Bound(b))


@dataclass(frozen=True)
class Ready:
    """A value is ready on its rank once ``counter >= threshold`` (this epoch).

    ``workers``: the workers of that rank whose tasks signal the counter; a consumer on the
    only such worker needs no wait (queue order). Empty for remote producers."""

    counter: str
    threshold: int
    workers: frozenset[int]


@dataclass
class Loc:
    """Where a vector value lives on one rank: ``buffer[lead..., offset:offset+length]``."""

    buffer: str
    rank: int
    offset: int
    length: int
    ready: tuple[Ready, ...]
    lead: tuple[Range, ...] = ()
    #: a one-shot all-reduce's result: (the receive rows [P, length], the residual, the
    #: Ready of both), so a consumer may sum them itself (LoweringConfig.fuse_reduce)
    sum_of: tuple[Region, Region, tuple[Ready, ...]] | None = None

    def region(self, a: int | None = None, b: int | None = None) -> Region:
        a = 0 if a is None else a
        b = self.length if b is None else b
        if not (0 <= a <= b <= self.length):
            raise ValueError(f"slice [{a}, {b}) outside value of {self.length} in {self.buffer}")
        return Region(self.buffer, self.rank, self.lead + (_r(self.offset + a, self.offset + b),))


class _Emitter:
    """Accumulates buffers, counters and tasks; assigns workers by the policy."""

    def __init__(self, name: str, ranks: int, cfg: LoweringConfig, target: Target,
                 config: dict[str, Any]):
        self.R, self.W, self.cfg = ranks, cfg.workers, cfg
        self.prog = ScheduleProgram(name=name, ranks=ranks, workers=cfg.workers, target=target,
                                    slots=2 if ranks > 1 else 1, config=config)
        self.buffers: dict[str, Buffer] = {}
        self.counters: dict[str, Counter] = {}
        self.load = [[0] * cfg.workers for _ in range(ranks)]   # bytes per worker
        self.cursor = [0] * ranks                               # round-robin position
        self.stage_load: list[dict] = [{} for _ in range(ranks)]  # policy stage: bytes per (ready set, worker)
        self.seq_est = max(1, cfg.max_seq // 2)                 # for byte estimates
        self.signal_workers: dict[str, set[int]] = {}

    # -- declarations ------------------------------------------------------------------
    def buffer(self, name: str, kind: str, dtype: str, shape: Sequence[int], rank: int | None,
               source: WeightSource | None = None) -> str:
        if name in self.buffers:
            raise AssertionError(f"duplicate buffer {name}")
        placement = "symmetric" if rank is None else "local"
        buf = Buffer(name, kind, dtype, tuple(int(d) for d in shape), placement, rank, source)
        self.buffers[name] = buf
        self.prog.buffers.append(buf)
        return name

    def counter(self, name: str, rank: int) -> str:
        if name not in self.counters:
            c = Counter(name, rank)
            self.counters[name] = c
            self.prog.counters.append(c)
        return name

    # -- placement ---------------------------------------------------------------------
    def place(self, rank: int, cost: int, ready: Sequence[Ready] = (), least_loaded: bool = False,
              among: Iterable[int] | None = None) -> int:
        """Worker for the next unit of work (one tile or one fused chain) on ``rank``.
        ``ready``: the values the work waits for; work with the same ``ready`` is one stage
        (it can all run at once), which the ``stage`` policy balances by itself.
        ``least_loaded``: the worker with the fewest bytes so far whatever the policy (work
        off the critical path, placed into a worker's slack). ``among`` (when not empty): the
        one of these workers with the fewest bytes so far, whatever the policy: work that
        belongs beside its producers (a lone task placed by the policy goes to the rank's
        least-loaded workers, which then run a series of such tasks one after another)."""
        loads = self.load[rank]
        if among:
            w = min(among, key=lambda i: (loads[i], i))
        elif least_loaded or self.cfg.policy == "balanced":  # least bytes so far, lowest index on ties
            w = min(range(self.W), key=lambda i: (loads[i], i))
        elif self.cfg.policy == "round_robin":
            w = self.cursor[rank] % self.W
            self.cursor[rank] += 1
        else:  # stage: least bytes in this stage, then least bytes so far
            key = tuple(sorted((rd.counter, rd.threshold) for rd in ready))
            st = self.stage_load[rank].setdefault(key, [0] * self.W)
            w = min(range(self.W), key=lambda i: (st[i], loads[i], i))
            st[w] += cost + TASK_FIXED_BYTES
        # Every task also costs a fixed amount, charged in bytes: without it a run of tiny
        # tasks (all-reduce reduce tiles) all lands on the one least-loaded worker and runs
        # back to back (measured: 128 reduce tiles spread over 70 us instead of ~7 us).
        loads[w] += cost + TASK_FIXED_BYTES
        return w

    def cost(self, op: str, ins: Sequence[Region], outs: Sequence[Region]) -> int:
        t = Task("_", 0, 0, op, tuple(ins), tuple(outs))
        return task_bytes(t, self.buffers, self.seq_est)

    # -- tasks -------------------------------------------------------------------------
    def task(self, id: str, rank: int, worker: int, op: str, ins: Sequence[Region],
             outs: Sequence[Region], params: dict | None = None,
             ready: Sequence[Ready] = (), signals: Sequence[str] = (),
             group: str | None = None) -> Task:
        need: dict[str, int] = {}
        for rd in ready:
            if rd.workers and rd.workers == {worker}:
                continue  # every producer precedes this task on its own queue
            need[rd.counter] = max(need.get(rd.counter, 0), rd.threshold)
        t = Task(id=id, rank=rank, worker=worker, op=op, ins=tuple(ins), outs=tuple(outs),
                 params=dict(params or {}),
                 waits=tuple(Wait(c, th) for c, th in need.items()),
                 signals=tuple(Signal(c, 1) for c in signals), group=group)
        self.prog.tasks.append(t)
        for c in signals:
            if self.counters[c].rank == rank:
                self.signal_workers.setdefault(c, set()).add(worker)
        return t

    def finish(self) -> ScheduleProgram:
        """Drop signals to counters nobody waits on (and those counters)."""
        waited = {w.counter for t in self.prog.tasks for w in t.waits}
        for t in self.prog.tasks:
            if any(s.counter not in waited for s in t.signals):
                t.signals = tuple(s for s in t.signals if s.counter in waited)
        self.prog.counters = [c for c in self.prog.counters if c.name in waited]
        return self.prog


@dataclass
class Prologue:
    """The input of a GEMV tile together with the op that fuses its producer into the tile:
    ``gemv`` (ins: x), ``norm_gemv`` (ins: x, norm weight; params eps), ``reduce_norm_gemv``
    (ins: partials, residual, norm weight; params eps) or ``swiglu_gemv`` (ins: gate, up).
    ``length``: K, the elements the tile multiplies (like Loc.length). ``chunks``: where the
    producer signals per column chunk (down_split_k), each chunk's ``(k0, k1, ready)``; a
    consumer of the whole waits on ``ready`` (every chunk's)."""

    op: str
    ins: tuple[Region, ...]
    ready: tuple[Ready, ...]
    length: int
    params: dict
    chunks: tuple[tuple[int, int, tuple[Ready, ...]], ...] = ()

    def chunk(self, k0: int, k1: int, ready: tuple[Ready, ...]) -> "Prologue":
        """This input restricted to its elements [k0, k1) (each operand's last axis sliced),
        ready once ``ready`` holds."""
        ins = tuple(Region(g.buffer, g.rank, g.ranges[:-1] + (_r(g.ranges[-1].start.const + k0,
                                                                    g.ranges[-1].start.const + k1),))
                    for g in self.ins)
        return Prologue(self.op, ins, ready, k1 - k0, dict(self.params))


def _prologue(x: Loc | Prologue) -> Prologue:
    """A plain vector value as the input of an unfused ``gemv``."""
    if isinstance(x, Prologue):
        return x
    return Prologue("gemv", (x.region(),), x.ready, x.length, {})


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise AmkError(f"lowering: unexpected graph: {msg}")


def _layer_plan(graph: ModelGraph, layer: int) -> dict[str, GraphOp]:
    """The ops of one decoder layer by role, checked against the structure lower() handles."""
    ops = graph.layer_ops(layer)
    plan: dict[str, GraphOp] = {}
    for op in ops:
        key = op.name.split(".", 1)[1] if "." in op.name else op.name
        plan[key] = op
    want = ["ln1", "q", "k", "v", "rope_q", "rope_k", "kv_append", "attn", "o", "res1", "ln2",
            "gate", "up", "swiglu", "down", "res2"]
    if graph.spec.qk_norm:
        want += ["q_norm", "k_norm"]
    missing = [k for k in want if k not in plan]
    _expect(not missing, f"layer {layer} lacks ops {missing}")
    extra = [k for k in plan if k not in want]
    _expect(not extra, f"layer {layer} has ops the lowering does not handle: {extra}")
    kinds = {"ln1": "rmsnorm", "q": "linear", "k": "linear", "v": "linear", "rope_q": "rope",
             "rope_k": "rope", "kv_append": "kv_append", "attn": "attention", "o": "linear",
             "res1": "add", "ln2": "rmsnorm", "gate": "linear", "up": "linear",
             "swiglu": "swiglu", "down": "linear", "res2": "add", "q_norm": "rmsnorm",
             "k_norm": "rmsnorm"}
    for k in want:
        _expect(plan[k].op == kinds[k], f"op {plan[k].name} is {plan[k].op}, expected {kinds[k]}")
    return plan


class _Lowerer:
    #: With a q/k norm, one q chain and one kv chain per local KV head (_qk_norm_attention).
    #: False emits the former form, one q chain and one kv chain over all of a rank's heads,
    #: kept as the baseline the cost-model tests compare against; not a knob.
    split_qk_chains = True

    def __init__(self, graph: ModelGraph, ranks: int, cfg: LoweringConfig, target: Target):
        self.g, self.spec, self.R, self.cfg = graph, graph.spec, ranks, cfg
        sp = self.spec
        try:
            self.part: Partition = partition(sp.heads, sp.kv_heads, sp.intermediate, sp.vocab,
                                             ranks, align=cfg.tile)
        except ValueError as e:
            raise AmkError(f"cannot split {graph.name} over {ranks} ranks: {e}") from None
        config = dict(cfg.to_json())
        if not is_quantized(cfg.weights):  # unquantized programs keep their config line
            config.pop("weights"), config.pop("quantize_lm_head")
        if not cfg.weight_group:  # as do per-row quantized ones
            config.pop("weight_group")
        if cfg.down_split_k == 1:  # likewise for programs without split-K down tiles
            config.pop("down_split_k")
        config["model"] = graph.name
        name = f"{graph.name}-tp{ranks}-w{cfg.workers}"
        self.e = _Emitter(name, ranks, cfg, target, config)
        self.dt = cfg.dtype
        #: the IR dtype of quantized GEMV weights (None: unquantized) and each quantized
        #: weight buffer's scale buffer
        self.qdt = IR_DTYPE.get(cfg.weight_format)
        self.qgroup = GROUP.get(cfg.weight_format, 0)  # K elements per scale (0: per row)
        self.scales: dict[str, str] = {}
        self.D = sp.head_dim
        self.H = sp.hidden
        self.S = cfg.max_seq
        #: late_append: the KV appends of the current layer, emitted after its gate/up tiles
        self.late_appends: list[Callable[[], None]] = []
        #: down_split_k: the reduce tiles of the last down projection, emitted late
        self.pending_reduces: list[Callable[[], None]] = []
        #: down_split_k where it acts (one rank, fused ops), else 1
        self.down_split = cfg.down_split_k if ranks == 1 and cfg.fuse else 1
        self.pending_combines: list[tuple] = []  # _attend's split-KV combines, emitted by _combines

    # -- helpers -------------------------------------------------------------------------
    def weight(self, name: str, rank: int, key: str, shape: Sequence[int],
               ranges: tuple[tuple[int, int], ...] = (), dtype: str | None = None) -> str:
        src = WeightSource(key, tuple(ranges))
        return self.e.buffer(f"{name}.r{rank}", "weight", dtype or self.dt, shape, rank, src)

    def gemv_weight(self, name: str, rank: int, key: str, shape: Sequence[int],
                    ranges: tuple[tuple[int, int], ...] = ()) -> str:
        """A GEMV weight [n, k]: in the lowering dtype, or quantized (``weights`` knob) with
        its scales ``s.<name>.r<rank>``: f32 [n], the rows of ``ranges``, or per group of
        ``qgroup`` columns f16 [n, k / qgroup], whose columns must start and end on group
        boundaries (AmkError otherwise: a split along K that cuts a group)."""
        if self.qdt is None:
            return self.weight(name, rank, key, shape, ranges)
        g = self.qgroup
        rows = tuple(ranges[0]) if ranges else (0, int(shape[0]))
        if not g:
            wb = self.weight(name, rank, key, shape, ranges, dtype=self.qdt)
            self.scales[wb] = self.e.buffer(f"s.{name}.r{rank}", "weight", "f32", (shape[0],), rank,
                                            WeightSource(scale_key(self.qdt, key), (rows,)))
            return wb
        cols = tuple(ranges[1]) if len(ranges) > 1 else (0, int(shape[1]))
        if cols[0] % g or cols[1] % g:
            raise AmkError(f"--weight-group {g}: rank {rank} takes columns {cols[0]}:{cols[1]} of {key}, "
                           f"which cuts its blocks of {g} columns (another --tp, or for the MLP a --tile that "
                           f"is a multiple of {g}, splits on block boundaries)")
        wb = self.weight(name, rank, qweight_key(self.qdt, key, g), shape, (rows, cols), dtype=self.qdt)
        # f16 values (GGUF's, quant.quantize_groups) stored as f32: 4-byte scales stream with
        # the weights through the GEMV's pipelined copies (ops/gemv.py _kblocks_pipelined)
        self.scales[wb] = self.e.buffer(f"s.{name}.r{rank}", "weight", "f32", (shape[0], shape[1] // g), rank,
                                        WeightSource(scale_key(self.qdt, key, g), (rows, (cols[0] // g, cols[1] // g))))
        return wb

    def scale_in(self, wbuf: str, r: int, a: int, b: int) -> list[Region]:
        """The scale operand of a GEMV tile over rows [a, b) of ``wbuf`` (ir/ops.py: the
        last input; per group: all of the rows' groups), or nothing for an unquantized
        weight."""
        sb = self.scales.get(wbuf)
        if sb is None:
            return []
        shape = self.e.buffers[sb].shape
        return [Region(sb, r, (_r(a, b),) + tuple(_r(0, d) for d in shape[1:]))]

    def act(self, name: str, rank: int, n: int) -> str:
        return self.e.buffer(f"{name}.r{rank}", "activation", self.dt, (n,), rank)

    def ready(self, counter: str, n: int) -> Ready:
        """Ready once ``counter`` got its ``n`` signals, from the workers signalled so far."""
        return Ready(counter, n, frozenset(self.e.signal_workers.get(counter, set())))

    # -- stages --------------------------------------------------------------------------
    def lower(self) -> ScheduleProgram:
        sp, e = self.spec, self.e
        self.tok, self.pos, self.inv = {}, {}, {}
        for r in range(self.R):
            self.tok[r] = e.buffer(f"token.r{r}", "io_input", "i32", (1,), r)
            self.pos[r] = e.buffer(f"pos.r{r}", "io_input", "i32", (1,), r)
            self.inv[r] = self.weight("rope.inv_freq", r, "amk.rope_inv_freq",
                                      (self.D // 2,), dtype="f32")
        x = self.embed()
        for i in range(sp.layers):
            x = self.layer(i, x)
        head_op = self.g.ops[-1]
        norm_op = self.g.ops[-2]
        _expect(head_op.op == "lm_head" and norm_op.op == "rmsnorm",
                "the graph must end with rmsnorm, lm_head")
        xf = self.norm_in("final_norm", norm_op, x)
        self.lm_head(head_op, xf)
        self.emit_pending_reduces()  # the last layer's: their sum is the final norm's, unread
        prog = e.finish()
        # Counters are never reset within max_epochs steps: cap it so that the busiest
        # counter's N(c) * (max_epochs + 1) stays within int32 (the validator's overflow rule).
        n_max = max(prog.signals_per_epoch().values(), default=1) or 1
        prog.max_epochs = min(prog.max_epochs, (2**31 - 1) // n_max - 1)
        return prog

    def embed(self) -> dict[int, Loc]:
        op = self.g.ops[0]
        _expect(op.op == "embed", "the graph must start with embed")
        V, H = op.weights["table"].shape
        out = {}
        self.table = {}
        for r in range(self.R):
            tab = self.weight("embed", r, op.weights["table"].key, (V, H))
            self.table[r] = tab
            y = self.act("x.l0", r, H)
            c = self.e.counter(f"c.embed.r{r}", r)
            ins = [Region(tab, r, (_r(0, V), _r(0, H))), Region(self.tok[r], r, (_r(0, 1),))]
            outs = [Region(y, r, (_r(0, H),))]
            w = self.e.place(r, self.e.cost("embed", ins, outs))
            self.e.task(f"embed.r{r}", r, w, "embed", ins, outs, signals=[c])
            out[r] = Loc(y, r, 0, H, (self.ready(c, 1),))
        return out

    def rmsnorm(self, name: str, op: GraphOp, x: dict[int, Loc]) -> dict[int, Loc]:
        """A full-width RMSNorm, one task per rank."""
        H = op.params["dim"]
        out = {}
        for r in range(self.R):
            w = self.weight(f"w.{name}", r, op.weights["w"].key, (H,))
            y = self.act(f"{name}", r, H)
            c = self.e.counter(f"c.{name}.r{r}", r)
            ins = [x[r].region(), Region(w, r, (_r(0, H),))]
            outs = [Region(y, r, (_r(0, H),))]
            wk = self.e.place(r, self.e.cost("rmsnorm", ins, outs), x[r].ready)
            self.e.task(f"{name}.r{r}", r, wk, "rmsnorm", ins, outs,
                        {"dim": H, "eps": float(op.params["eps"])}, ready=x[r].ready, signals=[c])
            out[r] = Loc(y, r, 0, H, (self.ready(c, 1),))
        return out

    def norm_in(self, name: str, op: GraphOp, x: dict[int, Loc]) -> dict[int, Loc | Prologue]:
        """A full-width RMSNorm of ``x``: with ``fuse``, a ``norm_gemv`` prologue for the
        GEMV tiles that consume it (no task of its own); otherwise one rmsnorm task per rank.
        With ``fuse_reduce`` and an ``x`` that is a one-shot all-reduce's result (Loc.sum_of),
        a ``reduce_norm_gemv`` prologue that sums the received partials and the residual."""
        if not self.cfg.fuse:
            return self.rmsnorm(name, op, x)
        H = op.params["dim"]
        eps = {"eps": float(op.params["eps"])}
        out: dict[int, Loc | Prologue] = {}
        for r in range(self.R):
            _expect(x[r].length == H, f"{name}: norm dim {H} but the input has {x[r].length}")
            w = self.weight(f"w.{name}", r, op.weights["w"].key, (H,))
            nw = Region(w, r, (_r(0, H),))
            # at one rank only down_split_k's partials have a sum_of: always summed here
            if x[r].sum_of is not None and (self.cfg.fuse_reduce or self.R == 1):
                part, resid, ready = x[r].sum_of
                out[r] = Prologue("reduce_norm_gemv", (part, resid, nw), ready, H, dict(eps))
            else:
                out[r] = Prologue("norm_gemv", (x[r].region(), nw), x[r].ready, H, dict(eps))
        return out

    def stage_tile(self, rows: int, tile: int = 0) -> int:
        """GEMV tile rows for a stage of ``rows`` rows: ``tile`` (a stage's own knob, e.g.
        tile_gate_up; 0 = the config's ``tile``), or with the ``wave`` knob ceil(rows /
        workers) rounded up to a multiple of it (one tile per worker)."""
        t = tile or self.cfg.tile
        if not self.cfg.wave:
            return t
        per_worker = -(-rows // self.cfg.workers)  # ceil
        return max(t, -(-per_worker // t) * t)

    def gemv_tiles(self, tag: str, r: int, x: Loc | Prologue, wbuf: str, k: int,
                   rows: tuple[int, int], y: Callable[[int, int], Region], bias: str | None,
                   counter: str, fuse: Callable[[int, int, int], None] | None = None,
                   resid: Loc | None = None, stage_rows: int | None = None, tile: int = 0,
                   mirrors: Callable[[int, int], list[Region]] | None = None,
                   peer_counters: Sequence[str] = ()) -> int:
        """GEMV tiles over local weight rows ``rows`` of ``wbuf`` ([n, k]); output rows
        [a, b) of the tile go to ``y(a, b)`` (row indices local to wbuf). ``x`` is a value
        (op ``gemv``) or a Prologue (its op: ``norm_gemv`` / ``swiglu_gemv``). ``resid``: add
        ``resid[a:b]`` in the tile's epilogue (``gemv`` becomes ``gemv_res``; swiglu_gemv
        gets its ``r``). ``fuse(worker, a, b)`` may emit follow-up tasks of the tile on the
        same worker (it then signals). ``stage_rows``: rows of the whole stage this call is
        part of (for the ``wave`` tile size; default: ``rows``). ``tile``: the stage's own
        tile rows (0: the config's ``tile``; stage_tile). ``mirrors(a, b)``: more regions that
        receive a copy of the tile's output (ir/ops.py mirror outputs: peer stores), and
        ``peer_counters``: the peers' counters each tile also signals once (put-with-signal).
        Returns the number of tiles (each signals ``counter`` once)."""
        src = _prologue(x)
        op = src.op
        if resid is not None:
            _expect(bias is None and op in ("gemv", "swiglu_gemv"),
                    f"{tag}: no fused residual for {op} with a bias")
            op = "gemv_res" if op == "gemv" else op
        ready = tuple(src.ready) + (tuple(resid.ready) if resid is not None else ())
        n = 0
        size = self.stage_tile(stage_rows if stage_rows is not None else rows[1] - rows[0], tile)
        for a, b in tiles(rows[0], rows[1], size):
            ins = list(src.ins) + [Region(wbuf, r, (_r(a, b), _r(0, k)))]
            if bias:
                ins.append(Region(bias, r, (_r(a, b),)))
            if resid is not None:
                ins.append(resid.region(a, b))
            ins += self.scale_in(wbuf, r, a, b)
            outs = [y(a, b)] + (mirrors(a, b) if mirrors else [])
            w = self.e.place(r, self.e.cost(op, ins, outs), ready)
            sig = [] if fuse else [counter, *peer_counters]
            self.e.task(f"{tag}.t{n}.r{r}", r, w, op, ins, outs, dict(src.params), ready=ready,
                        signals=sig)
            if fuse:
                fuse(w, a, b)
            n += 1
        return n

    def layer(self, i: int, x: dict[int, Loc]) -> dict[int, Loc]:
        plan = _layer_plan(self.g, i)
        xn = self.norm_in(f"l{i}.ln1", plan["ln1"], x)
        attn = self.attention(i, plan, xn)
        self.emit_pending_reduces()  # before the o tiles that add their result
        h = self.row_parallel(f"l{i}.attn", plan["o"], attn, x, self.part_heads)
        hn = self.norm_in(f"l{i}.ln2", plan["ln2"], h)
        m = self.mlp_in(i, plan, hn)
        for emit in self.late_appends:  # after the o and gate/up tiles: never ahead of one in a queue
            emit()
        self.late_appends = []
        return self.row_parallel(f"l{i}.mlp", plan["down"], m, h, self.part_cols)

    def emit_pending_reduces(self) -> None:
        """Emit the previous layer's down_split_k reduce tiles (``_row_split_k``)."""
        for emit in self.pending_reduces:
            emit()
        self.pending_reduces = []

    def part_heads(self, r: int) -> tuple[int, int]:
        h0, h1 = self.part.shards[r].q_heads
        return h0 * self.D, h1 * self.D

    def part_cols(self, r: int) -> tuple[int, int]:
        return self.part.shards[r].cols

    def attention(self, i: int, plan: dict[str, GraphOp],
                  xn: dict[int, Loc | Prologue]) -> dict[int, Loc]:
        """q/k/v projections, [q/k norm], RoPE, KV append and GQA attention per rank.
        With ``fuse`` and no q/k norm, RoPE is fused into rope_append / rope_attention (one
        pair per KV head on one worker). Returns each contributing rank's attention output
        (its query heads) as a Loc."""
        e, D, H, S = self.e, self.D, self.H, self.S
        out: dict[int, Loc] = {}
        for r in range(self.R):
            sh = self.part.shards[r]
            if sh.n_q == 0:
                continue
            h0, h1 = sh.q_heads
            g0, g1 = sh.kv_heads
            nq, nkv = sh.n_q * D, sh.n_kv * D
            bufs = {}
            for role, (lo, hi) in (("q", (h0 * D, h1 * D)), ("k", (g0 * D, g1 * D)),
                                   ("v", (g0 * D, g1 * D))):
                op = plan[role]
                wb = self.gemv_weight(f"w.l{i}.{role}", r, op.weights["w"].key, (hi - lo, H),
                                      ((lo, hi), (0, H)))
                bb = None
                if "bias" in op.weights:
                    bb = self.weight(f"b.l{i}.{role}", r, op.weights["bias"].key, (hi - lo,),
                                     ((lo, hi),))
                bufs[role] = (wb, bb, hi - lo, self.act(f"{role}.l{i}", r, hi - lo))
            cq = e.counter(f"c.l{i}.q.r{r}", r)
            ckv = e.counter(f"c.l{i}.kv.r{r}", r)
            nt = {}
            qkv_rows = sum(bufs[role][2] for role in ("q", "k", "v"))
            for role, c in (("q", cq), ("k", ckv), ("v", ckv)):
                wb, bb, n, yb = bufs[role]
                nt[role] = self.gemv_tiles(f"l{i}.{role}", r, xn[r], wb, H, (0, n),
                                           lambda a, b, yb=yb: Region(yb, r, (_r(a, b),)), bb, c,
                                           stage_rows=qkv_rows, tile=self.cfg.tile_qkv)
            if self.cfg.fuse and "q_norm" not in plan and "k_norm" not in plan:
                out[r] = self._rope_attention(i, r, bufs, [self.ready(cq, nt["q"])],
                                              [self.ready(ckv, nt["k"] + nt["v"])])
                continue
            if self.split_qk_chains and ("q_norm" in plan or "k_norm" in plan):
                out[r] = self._qk_norm_attention(i, r, plan, bufs, [self.ready(cq, nt["q"])],
                                                 [self.ready(ckv, nt["k"] + nt["v"])])
                continue
            # q chain: [q_norm] -> rope, on one worker (a q/k norm: _qk_norm_attention)
            q_in = bufs["q"][3]
            qr = self.act(f"qr.l{i}", r, nq)
            cqr = e.counter(f"c.l{i}.qr.r{r}", r)
            chain = self.norm_rope(i, r, plan, "q", q_in, nq, qr)
            self.chain(i, r, chain, [self.ready(cq, nt["q"])], cqr)
            # kv chain: [k_norm] -> rope -> kv_append, on one worker
            k_in, v_b = bufs["k"][3], bufs["v"][3]
            kr = self.act(f"kr.l{i}", r, nkv)
            kc = e.buffer(f"kc.l{i}.r{r}", "kv_cache", self.dt, (sh.n_kv, S, D), r)
            vc = e.buffer(f"vc.l{i}.r{r}", "kv_cache", self.dt, (sh.n_kv, S, D), r)
            ckc = e.counter(f"c.l{i}.kvc.r{r}", r)
            chain = self.norm_rope(i, r, plan, "k", k_in, nkv, kr)
            cache = (_r(0, sh.n_kv), _r(0, S), _r(0, D))
            chain.append(("kv_append", [Region(kr, r, (_r(0, nkv),)), Region(v_b, r, (_r(0, nkv),)),
                                        Region(self.pos[r], r, (_r(0, 1),))],
                          [Region(kc, r, cache), Region(vc, r, cache)], {"head_dim": D}, "kv_append"))
            self.chain(i, r, chain, [self.ready(ckv, nt["k"] + nt["v"])], ckc)
            # attention: attn_split tasks per local KV head (its query heads of this rank)
            a = self.act(f"a.l{i}", r, nq)
            ca = e.counter(f"c.l{i}.attn.r{r}", r)
            rdy = [self.ready(cqr, 1), self.ready(ckc, 1)]
            n_att = sum(self._attention_tasks(i, r, j, g, qr, kc, vc, a, ca, rdy)
                        for j, g in enumerate(range(g0, g1)))
            self._combines()
            out[r] = Loc(a, r, 0, nq, (self.ready(ca, n_att),))
        return out

    def norm_rope(self, i: int, r: int, plan: dict[str, GraphOp], role: str, src: str, n: int,
                  out: str, rows: tuple[int, int] | None = None, norm: tuple[str, str] | None = None,
                  tag: str = "") -> list:
        """The chain steps ``[<role>_norm ->] rope`` of the ``n`` elements of rank ``r``'s
        ``src`` into ``out`` (``role``: ``q`` or ``k``; the norm when the layer has one).
        ``rows``: only elements [a, b) of the three vectors (whole heads; default all n);
        ``norm``: the (normalised buffer, norm weight) already declared for the rank (default:
        declared here); ``tag``: appended to the step tags (``q_norm<tag>``, ``rope_q<tag>``)."""
        D = self.D
        a, b = rows if rows is not None else (0, n)
        steps = []
        if f"{role}_norm" in plan:
            nb, wn = norm if norm is not None else self.qk_norm_buffers(i, r, plan, role, n)
            steps.append(("rmsnorm", [Region(src, r, (_r(a, b),)), Region(wn, r, (_r(0, D),))],
                          [Region(nb, r, (_r(a, b),))], {"dim": D, "eps": self.spec.eps},
                          f"{role}_norm{tag}"))
            src = nb
        steps.append(("rope", [Region(src, r, (_r(a, b),)), Region(self.inv[r], r, (_r(0, D // 2),)),
                               Region(self.pos[r], r, (_r(0, 1),))],
                      [Region(out, r, (_r(a, b),))], {"head_dim": D}, f"rope_{role}{tag}"))
        return steps

    def qk_norm_buffers(self, i: int, r: int, plan: dict[str, GraphOp], role: str,
                        n: int) -> tuple[str, str]:
        """Rank r's ``<role>n.l{i}`` ([n] activation: the normalised q or k) and its
        ``w.l{i}.<role>_norm`` ([head_dim] weight) buffers."""
        nb = self.act(f"{role}n.l{i}", r, n)
        wn = self.weight(f"w.l{i}.{role}_norm", r, plan[f"{role}_norm"].weights["w"].key, (self.D,))
        return nb, wn

    def _attention_tasks(self, i: int, r: int, j: int, g: int, qr: str, kc: str, vc: str, a: str,
                         ca: str, rdy: list[Ready]) -> int:
        """Rank r's ``attn_split`` attention tasks of KV head g (local index j): each reads its
        query heads' rows of ``qr``, cache head j of ``kc``/``vc`` and the position, writes the
        same rows of ``a``, waits on ``rdy`` and signals ``ca``. Returns how many it emitted."""
        D, S = self.D, self.S
        h0 = self.part.shards[r].q_heads[0]
        groups = self.attn_head_groups(r, g)
        head = (_r(j, j + 1), _r(0, S), _r(0, D))
        for s, (lo, hi) in enumerate(groups):
            qa, qb = (lo - h0) * D, (hi - h0) * D
            ins = [Region(qr, r, (_r(qa, qb),)), Region(kc, r, head), Region(vc, r, head),
                   Region(self.pos[r], r, (_r(0, 1),))]
            tag = f".s{s}" if len(groups) > 1 else ""
            self._attend(i, r, f"l{i}.attn.kv{g}{tag}.r{r}", "attention", ins, a, qa, qb,
                         {"head_dim": D, "scale": float(self.spec.attn_scale)}, rdy, ca)
        return len(groups)

    def _qk_norm_attention(self, i: int, r: int, plan: dict[str, GraphOp], bufs: dict,
                           q_ready: list[Ready], kv_ready: list[Ready]) -> Loc:
        """Attention of rank r for a layer with a per-head q/k RMSNorm (Qwen3), one
        independent pipeline per local KV head g (local index j):

        * a q chain on one worker: q_norm -> rope of g's query heads, rows
          [(lo - h0) * D, (hi - h0) * D) of q; signals ``c.l{i}.qr.kv{g}.r{r}``;
        * a kv chain on one worker: k_norm -> rope -> kv_append of head g alone (k and v rows
          [j * D, (j + 1) * D), cache head j); signals ``c.l{i}.kvc.kv{g}.r{r}``;
        * g's ``attn_split`` attention tasks, each waiting on g's two counters only.

        These ops loop over heads serially inside one task, so one chain over all of the
        rank's heads put every head's latency on the critical path; per KV head the chains
        run on different workers at once. The writes are disjoint (whole heads), so the
        chains need no ordering among themselves."""
        e, D, S = self.e, self.D, self.S
        sh = self.part.shards[r]
        h0 = sh.q_heads[0]
        g0, g1 = sh.kv_heads
        nq, nkv = sh.n_q * D, sh.n_kv * D
        q_in, k_in, v_b = bufs["q"][3], bufs["k"][3], bufs["v"][3]
        qr = self.act(f"qr.l{i}", r, nq)
        qn = self.qk_norm_buffers(i, r, plan, "q", nq) if "q_norm" in plan else None
        kr = self.act(f"kr.l{i}", r, nkv)
        kn = self.qk_norm_buffers(i, r, plan, "k", nkv) if "k_norm" in plan else None
        kc = e.buffer(f"kc.l{i}.r{r}", "kv_cache", self.dt, (sh.n_kv, S, D), r)
        vc = e.buffer(f"vc.l{i}.r{r}", "kv_cache", self.dt, (sh.n_kv, S, D), r)
        pos = Region(self.pos[r], r, (_r(0, 1),))
        heads = {g: self.part.kv_group_heads(r, g) for g in range(g0, g1)}
        q_done: dict[int, str] = {}
        kv_done: dict[int, str] = {}
        for g, (lo, hi) in heads.items():  # q chains first: the q tiles finish first
            q_done[g] = e.counter(f"c.l{i}.qr.kv{g}.r{r}", r)
            steps = self.norm_rope(i, r, plan, "q", q_in, nq, qr, ((lo - h0) * D, (hi - h0) * D),
                                   qn, f".kv{g}")
            self.chain(i, r, steps, q_ready, q_done[g])
        for j, g in enumerate(range(g0, g1)):
            kv_done[g] = e.counter(f"c.l{i}.kvc.kv{g}.r{r}", r)
            a, b = j * D, (j + 1) * D
            steps = self.norm_rope(i, r, plan, "k", k_in, nkv, kr, (a, b), kn, f".kv{g}")
            head = (_r(j, j + 1), _r(0, S), _r(0, D))
            steps.append(("kv_append", [Region(kr, r, (_r(a, b),)), Region(v_b, r, (_r(a, b),)), pos],
                          [Region(kc, r, head), Region(vc, r, head)], {"head_dim": D},
                          f"kv_append.kv{g}"))
            self.chain(i, r, steps, kv_ready, kv_done[g])
        a_b = self.act(f"a.l{i}", r, nq)
        ca = e.counter(f"c.l{i}.attn.r{r}", r)
        n_att = sum(self._attention_tasks(i, r, j, g, qr, kc, vc, a_b, ca,
                                          [self.ready(q_done[g], 1), self.ready(kv_done[g], 1)])
                    for j, g in enumerate(range(g0, g1)))
        self._combines()
        return Loc(a_b, r, 0, nq, (self.ready(ca, n_att),))

    def attn_head_groups(self, r: int, g: int) -> list[tuple[int, int]]:
        """Rank r's global query heads of KV head g as ``attn_split`` contiguous [lo, hi)
        groups of near-equal size (fewer when the group has fewer heads)."""
        lo, hi = self.part.kv_group_heads(r, g)
        n = min(self.cfg.attn_split, hi - lo)
        cuts = [lo + (hi - lo) * k // n for k in range(n + 1)]
        return [(cuts[k], cuts[k + 1]) for k in range(n)]

    def _attend(self, i: int, r: int, tid: str, op: str, ins: list[Region], a: str, qa: int, qb: int,
                params: dict, ready: list[Ready], ca: str) -> None:
        """The attention of rank r's query rows [qa, qb) of ``a`` (one query-head group, task
        id ``tid``): one ``op`` task, or with ``attn_kv_split`` P >= 2 (flash-decoding's
        split-KV, ir/ops.py) P part tasks, each placed on its own worker, writing f32 partial
        records into ``ap.l{i}.r{r}`` ([P, query heads of the rank, head_dim + 2]) and
        signalling a counter of the group, and one ``attention_combine`` into ``a`` waiting
        on them, emitted by ``_combines`` after every group's parts. Either way the group
        signals ``ca`` once."""
        e, D = self.e, self.D
        P = min(self.cfg.attn_kv_split, self.S)
        if P == 1:
            outs = [Region(a, r, (_r(qa, qb),))]
            w = e.place(r, e.cost(op, ins, outs), ready)
            e.task(tid, r, w, op, ins, outs, params, ready=ready, signals=[ca])
            return
        nh = self.part.shards[r].n_q
        ap = f"ap.l{i}.r{r}"
        if ap not in e.buffers:
            e.buffer(ap, "activation", "f32", (P, nh, D + 2), r)
        h0, h1 = qa // D, qb // D
        cp = e.counter(f"c.l{i}.attp.{tid.split('.', 1)[1]}", r)
        for c in range(P):
            outs = [Region(ap, r, (_r(c, c + 1), _r(h0, h1), _r(0, D + 2)))]
            w = e.place(r, e.cost(op, ins, outs) // P, ready)
            e.task(f"{tid}.p{c}", r, w, op, ins, outs, dict(params, parts=P, part=c), ready=ready, signals=[cp])
        cins = [Region(ap, r, (_r(0, P), _r(h0, h1), _r(0, D + 2)))]
        self.pending_combines.append((tid, r, w, cins, [Region(a, r, (_r(qa, qb),))], P, cp, ca))

    def _combines(self) -> None:
        """Emit the ``attention_combine`` tasks ``_attend`` deferred, each on the worker of its
        group's last part. They come after every part of the layer in each worker's queue: a
        combine queued before another group's part would hold that part back until its own
        parts were done, chaining the groups one after another. And each goes where a part
        ran, not to the least-loaded worker: a combine's cost is small against the workers'
        differences in load, so the same few workers stayed least loaded and ran a layer's
        combines one after another (H100, Llama-3.2-1B: about +14 us a layer)."""
        e = self.e
        for tid, r, last, cins, couts, P, cp, ca in self.pending_combines:
            crdy = [self.ready(cp, P)]
            w = e.place(r, e.cost("attention_combine", cins, couts), crdy, among=(last,))
            e.task(f"{tid}.combine", r, w, "attention_combine", cins, couts, {"head_dim": self.D, "parts": P},
                   ready=crdy, signals=[ca])
        self.pending_combines.clear()

    def _rope_attention(self, i: int, r: int, bufs: dict, q_ready: list[Ready],
                        kv_ready: list[Ready]) -> Loc:
        """Fused attention of rank r: per local KV head g, ``rope_append`` (rope(k_g) and v_g
        into row pos of the caches) then ``rope_attention`` of g's query heads. With one
        attention task per KV head (``attn_split`` 1 or no GQA), both run on one worker so
        queue order orders the cache write before its read; with several, each attention
        task runs on its own worker and waits on a counter the rank's appends signal. With
        ``late_append``: ``rope_attention_kv`` tasks and one later append (``_late_append``)."""
        e, D, S = self.e, self.D, self.S
        sh = self.part.shards[r]
        h0 = sh.q_heads[0]
        g0, g1 = sh.kv_heads
        nq = sh.n_q * D
        q_b, k_b, v_b = bufs["q"][3], bufs["k"][3], bufs["v"][3]
        kc = e.buffer(f"kc.l{i}.r{r}", "kv_cache", self.dt, (sh.n_kv, S, D), r)
        vc = e.buffer(f"vc.l{i}.r{r}", "kv_cache", self.dt, (sh.n_kv, S, D), r)
        a = self.act(f"a.l{i}", r, nq)
        ca = e.counter(f"c.l{i}.attn.r{r}", r)
        inv = Region(self.inv[r], r, (_r(0, D // 2),))
        pos = Region(self.pos[r], r, (_r(0, 1),))
        groups = {g: self.attn_head_groups(r, g) for g in range(g0, g1)}
        params = {"head_dim": D, "scale": float(self.spec.attn_scale)}
        # several tasks read a KV head's cache row pos: the appends signal a counter
        split = any(len(v) > 1 for v in groups.values()) or self.cfg.attn_kv_split > 1
        n_att = 0

        def att_regions(j: int, lo: int, hi: int) -> tuple[list[Region], list[Region]]:
            head = (_r(j, j + 1), _r(0, S), _r(0, D))
            qa, qb = (lo - h0) * D, (hi - h0) * D
            return ([Region(q_b, r, (_r(qa, qb),)), Region(kc, r, head), Region(vc, r, head), pos, inv],
                    [Region(a, r, (_r(qa, qb),))])

        if self.cfg.late_append:
            # rope_attention_kv tasks wait on the q/k/v tiles only; the rank's one append waits
            # on all of them and is emitted later (layer(): after the gate/up tiles)
            ready = list(q_ready) + list(kv_ready)
            for j, g in enumerate(range(g0, g1)):
                kv = [Region(k_b, r, (_r(j * D, (j + 1) * D),)), Region(v_b, r, (_r(j * D, (j + 1) * D),))]
                for s, (lo, hi) in enumerate(groups[g]):
                    att_ins, _ = att_regions(j, lo, hi)
                    att_ins = att_ins[:1] + kv + att_ins[1:]  # q, k, v, kc, vc, pos, inv_freq
                    tag = f".s{s}" if len(groups[g]) > 1 else ""
                    self._attend(i, r, f"l{i}.attn.kv{g}{tag}.r{r}", "rope_attention_kv", att_ins, a,
                                 (lo - h0) * D, (hi - h0) * D, params, ready, ca)
                    n_att += 1
            self._combines()
            app = (k_b, v_b, kc, vc, inv, pos, sh.n_kv, [self.ready(ca, n_att)])
            self.late_appends.append(lambda: self._late_append(i, r, *app))
            return Loc(a, r, 0, nq, (self.ready(ca, n_att),))
        ckc = e.counter(f"c.l{i}.kvc.r{r}", r) if split else None

        for j, g in enumerate(range(g0, g1)):
            head = (_r(j, j + 1), _r(0, S), _r(0, D))
            app_ins = [Region(k_b, r, (_r(j * D, (j + 1) * D),)),
                       Region(v_b, r, (_r(j * D, (j + 1) * D),)), inv, pos]
            app_outs = [Region(kc, r, head), Region(vc, r, head)]
            if not split:
                att_ins, att_outs = att_regions(j, *groups[g][0])
                w = e.place(r, e.cost("rope_append", app_ins, app_outs)
                            + e.cost("rope_attention", att_ins, att_outs), list(kv_ready) + list(q_ready))
                e.task(f"l{i}.rope_append.kv{g}.r{r}", r, w, "rope_append", app_ins, app_outs,
                       {"head_dim": D}, ready=kv_ready)
                e.task(f"l{i}.attn.kv{g}.r{r}", r, w, "rope_attention", att_ins, att_outs, params,
                       ready=q_ready, signals=[ca])
                n_att += 1
                continue
            w = e.place(r, e.cost("rope_append", app_ins, app_outs), kv_ready)
            e.task(f"l{i}.rope_append.kv{g}.r{r}", r, w, "rope_append", app_ins, app_outs,
                   {"head_dim": D}, ready=kv_ready, signals=[ckc])
        if split:
            # every attention task waits for all of the rank's appends (one counter)
            rdy = list(q_ready) + [self.ready(ckc, g1 - g0)]
            for j, g in enumerate(range(g0, g1)):
                for s, (lo, hi) in enumerate(groups[g]):
                    att_ins, _ = att_regions(j, lo, hi)
                    self._attend(i, r, f"l{i}.attn.kv{g}.s{s}.r{r}", "rope_attention", att_ins, a,
                                 (lo - h0) * D, (hi - h0) * D, params, rdy, ca)
                    n_att += 1
            self._combines()
        return Loc(a, r, 0, nq, (self.ready(ca, n_att),))

    def _late_append(self, i: int, r: int, k_b: str, v_b: str, kc: str, vc: str, inv: Region, pos: Region,
                     n_kv: int, done: list[Ready]) -> None:
        """late_append: rank r's ``rope_append`` of its ``n_kv`` KV heads (k and v rows of
        buffers ``k_b`` / ``v_b`` into row pos of caches ``kc`` / ``vc``), waiting on all of
        its attention tasks (``done``), each on the worker with the fewest bytes so far.
        Emitted after the gate/up tiles, so it fills that worker's slack at the end of the
        gate/up stage (one append per KV head placed by the stage policy lengthens the gate/up
        stage by its 3.8 us in an H200 profile). One task per LATE_APPEND_HEADS heads: the
        kernel appends one head after another (~1.3 us a head on an H100), and one task of
        SmolLM2-1.7B's 32 heads took 41 us, delaying its worker's down tile by ~14 us a layer."""
        D, S, e = self.D, self.S, self.e
        chunks = [(a, min(a + LATE_APPEND_HEADS, n_kv)) for a in range(0, n_kv, LATE_APPEND_HEADS)]
        for c, (a, b) in enumerate(chunks):
            rows, cache = (_r(a * D, b * D),), (_r(a, b), _r(0, S), _r(0, D))
            ins = [Region(k_b, r, rows), Region(v_b, r, rows), inv, pos]
            outs = [Region(kc, r, cache), Region(vc, r, cache)]
            w = e.place(r, e.cost("rope_append", ins, outs), done, least_loaded=True)
            tag = f".c{c}" if len(chunks) > 1 else ""
            e.task(f"l{i}.rope_append{tag}.r{r}", r, w, "rope_append", ins, outs, {"head_dim": D}, ready=done)

    def chain(self, i: int, r: int, steps: list, ready: list[Ready], counter: str) -> None:
        """Emit dependent single tasks on one worker; the last one signals ``counter``."""
        cost = sum(self.e.cost(op, ins, outs) for op, ins, outs, _, _ in steps)
        w = self.e.place(r, cost, ready)
        for k, (op, ins, outs, params, tag) in enumerate(steps):
            last = k == len(steps) - 1
            self.e.task(f"l{i}.{tag}.r{r}", r, w, op, ins, outs, params,
                        ready=ready if k == 0 else (), signals=[counter] if last else [])

    def mlp_in(self, i: int, plan: dict[str, GraphOp],
               hn: dict[int, Loc | Prologue]) -> dict[int, Loc | Prologue]:
        """gate/up column tiles and silu_mul, each tile's three tasks on one worker. With
        ``fuse``: no silu_mul task; returns a ``swiglu_gemv`` prologue (gate, up) that the
        down projection's tiles apply. With ``fuse`` and ``wave`` the gate and up tiles are
        independent tasks (each waits on the input and signals the counter itself), sized
        for one wave over the stage's 2n rows and placed apart, so a stage of fewer rows
        than two tiles per worker runs in one round instead of gate then up."""
        e, H = self.e, self.H
        out: dict[int, Loc] = {}
        for r in range(self.R):
            c0, c1 = self.part.shards[r].cols
            n = c1 - c0
            if n == 0:
                continue
            wg = self.gemv_weight(f"w.l{i}.gate", r, plan["gate"].weights["w"].key, (n, H),
                                  ((c0, c1), (0, H)))
            wu = self.gemv_weight(f"w.l{i}.up", r, plan["up"].weights["w"].key, (n, H),
                                  ((c0, c1), (0, H)))
            gb, ub = self.act(f"g.l{i}", r, n), self.act(f"u.l{i}", r, n)
            mb = None if self.cfg.fuse else self.act(f"m.l{i}", r, n)
            wave = mb is None and self.cfg.wave
            col_tiles = list(tiles(0, n, self.stage_tile(2 * n if wave else n, self.cfg.tile_gate_up)))
            # down_split_k: tile j signals its column chunk's counter (chunks of whole tiles)
            nchunks = min(self.down_split, len(col_tiles)) if mb is None else 1
            chunk_of = [j * nchunks // len(col_tiles) for j in range(len(col_tiles))]
            cms = ([e.counter(f"c.l{i}.act.k{c}.r{r}", r) for c in range(nchunks)] if nchunks > 1
                   else [e.counter(f"c.l{i}.act.r{r}", r)])
            signals = [0] * nchunks
            src = _prologue(hn[r])

            def step(tag: str, wb: str, yb: str, a: int, b: int, t: int) -> tuple:
                return (src.op, list(src.ins) + [Region(wb, r, (_r(a, b), _r(0, H)))] + self.scale_in(wb, r, a, b),
                        [Region(yb, r, (_r(a, b),))], dict(src.params), f"{tag}.t{t}")

            if wave:  # gate and up tiles apart, one wave over 2n rows
                for tag, wb, yb in (("gate", wg, gb), ("up", wu, ub)):
                    for j, (a, b) in enumerate(col_tiles):
                        self.chain(i, r, [step(tag, wb, yb, a, b, j)], list(src.ready), cms[chunk_of[j]])
                        signals[chunk_of[j]] += 1
            else:
                for j, (a, b) in enumerate(col_tiles):  # gate + up tile per worker
                    steps = [step(tag, wb, yb, a, b, j) for tag, wb, yb in (("gate", wg, gb), ("up", wu, ub))]
                    if mb is not None:
                        steps.append(("silu_mul", [Region(gb, r, (_r(a, b),)), Region(ub, r, (_r(a, b),))],
                                      [Region(mb, r, (_r(a, b),))], {}, f"silu.t{j}"))
                    self.chain(i, r, steps, list(src.ready), cms[chunk_of[j]])
                    signals[chunk_of[j]] += 1
            readies = [self.ready(c, k) for c, k in zip(cms, signals)]
            if mb is None:
                chunks = ()
                if nchunks > 1:
                    bounds = [(min(a for (a, _), c in zip(col_tiles, chunk_of) if c == k),
                               max(b for (_, b), c in zip(col_tiles, chunk_of) if c == k)) for k in range(nchunks)]
                    chunks = tuple((k0, k1, (rd,)) for (k0, k1), rd in zip(bounds, readies))
                out[r] = Prologue("swiglu_gemv", (Region(gb, r, (_r(0, n),)), Region(ub, r, (_r(0, n),))),
                                  tuple(readies), n, {}, chunks)
            else:
                out[r] = Loc(mb, r, 0, n, tuple(readies))
        return out

    # -- row-parallel linear + all-reduce + residual ---------------------------------------
    def row_parallel(self, site: str, op: GraphOp, xin: dict[int, Loc | Prologue], resid: dict[int, Loc],
                     cols_of: Callable[[int], tuple[int, int]]) -> dict[int, Loc]:
        """``resid + W @ x`` with W split by columns over ranks (rank r holds W[:, cols_of(r)]
        and the matching slice of x). Returns the result, replicated on every rank."""
        e, H = self.e, self.H
        contrib = [r for r in range(self.R) if r in xin]
        if self.R == 1 and isinstance(xin.get(0), Prologue) and xin[0].chunks:
            return self._row_split_k(site, op, xin[0], resid[0])
        wbuf = {}
        for r in contrib:
            c0, c1 = cols_of(r)
            wbuf[r] = self.gemv_weight(f"w.{site}", r, op.weights["w"].key, (H, c1 - c0),
                                       ((0, H), (c0, c1)))
        if self.R == 1:
            return self._row_single(site, xin, resid, wbuf)
        if self.cfg.allreduce in ("oneshot", "fused"):
            return self._row_oneshot(site, xin, resid, wbuf, contrib)
        return self._row_twoshot(site, xin, resid, wbuf, contrib)

    def _row_single(self, site, xin, resid, wbuf) -> dict[int, Loc]:
        """R = 1: each GEMV tile is followed on its worker by the residual add of its rows
        (with ``fuse``: the add is the tile's epilogue, gemv_res / swiglu_gemv with r)."""
        e, H, r = self.e, self.H, 0
        out = self.act(f"{site}.out", r, H)
        cnt = e.counter(f"c.{site}.out.r{r}", r)
        if r not in xin:  # a model with no heads / columns cannot happen at R = 1
            raise AmkError(f"lowering: {site} has no work on the only rank")
        k = xin[r].length
        if self.cfg.fuse:
            n = self.gemv_tiles(f"{site}.w", r, xin[r], wbuf[r], k, (0, H),
                                lambda a, b: Region(out, r, (_r(a, b),)), None, cnt,
                                resid=resid[r])
            return {r: Loc(out, r, 0, H, (self.ready(cnt, n),))}
        part = self.act(f"{site}.part", r, H)

        def fuse(w: int, a: int, b: int) -> None:
            e.task(f"{site}.add.{a}.r{r}", r, w, "add",
                   [Region(part, r, (_r(a, b),)), resid[r].region(a, b)],
                   [Region(out, r, (_r(a, b),))], ready=resid[r].ready, signals=[cnt])

        n = self.gemv_tiles(f"{site}.w", r, xin[r], wbuf[r], k, (0, H),
                            lambda a, b: Region(part, r, (_r(a, b),)), None, cnt, fuse=fuse)
        return {r: Loc(out, r, 0, H, (self.ready(cnt, n),))}

    def _row_split_k(self, site: str, op: GraphOp, x: Prologue, resid: Loc) -> dict[int, Loc]:
        """R = 1, ``x`` produced in column chunks (down_split_k): per chunk, GEMV tiles over
        W[:, k0:k1] (its own weight buffer) that wait only on that chunk and write partial
        row c of ``kp.<site>`` [chunks, H]; then reduce tiles sum the partials and the
        residual into the result, whose ``sum_of`` lets the next RMSNorm + GEMV tiles sum them
        themselves (norm_in) instead of waiting on the reduce tiles."""
        e, H, r = self.e, self.H, 0
        S = len(x.chunks)
        kp = e.buffer(f"kp.{site}.r{r}", "activation", self.dt, (S, H), r)
        ready = []
        for c, (k0, k1, rdy) in enumerate(x.chunks):
            wb = self.gemv_weight(f"w.{site}.k{c}", r, op.weights["w"].key, (H, k1 - k0), ((0, H), (k0, k1)))
            cnt = e.counter(f"c.{site}.part.k{c}.r{r}", r)
            n = self.gemv_tiles(f"{site}.k{c}", r, x.chunk(k0, k1, rdy), wb, k1 - k0, (0, H),
                                lambda a, b, c=c: Region(kp, r, (_r(c, c + 1), _r(a, b))), None, cnt)
            ready.append(self.ready(cnt, n))
        out = self.act(f"{site}.out", r, H)
        cnt = e.counter(f"c.{site}.red.r{r}", r)
        rdy = [*resid.ready, *ready]
        cols = tiles(0, H, max(self.cfg.tile, SPLIT_REDUCE_COLS))

        def emit() -> None:
            for n, (a, b) in enumerate(cols):
                ins = [Region(kp, r, (_r(0, S), _r(a, b))), resid.region(a, b)]
                outs = [Region(out, r, (_r(a, b),))]
                w = e.place(r, e.cost("reduce", ins, outs), rdy)
                e.task(f"{site}.red.t{n}.r{r}", r, w, "reduce", ins, outs, ready=rdy, signals=[cnt])

        # emitted after the next layer's q/k/v tiles (layer, lower): a reduce ahead of one in a
        # worker's queue would hold it until the last partial; its result is needed only by
        # the o tiles' residual add. Its workers are not known yet: every consumer waits.
        self.pending_reduces.append(emit)
        return {r: Loc(out, r, 0, H, (Ready(cnt, len(cols), frozenset()),),
                       sum_of=(Region(kp, r, (_r(0, S), _r(0, H))), resid.region(), tuple(rdy)))}

    def _partials(self, site: str, xin, wbuf, contrib, buf: str, idx: dict[int, int],
                  arrive: dict[tuple[int, int], str] | None = None) -> tuple[dict[int, Ready], dict[int, int]]:
        """Each contributor writes its partial into its own row of ``buf`` (slot s); with
        ``arrive`` ((source, peer) -> the peer's arrival counter) each tile also stores its
        rows into that row of every peer's ``buf`` and signals the peers' counters (the
        fused all-reduce). Returns each contributor's local Ready and its number of tiles."""
        e, H, R = self.e, self.H, self.R
        ready, ntiles = {}, {}
        for r in contrib:
            c = e.counter(f"c.{site}.part.r{r}", r)
            k = xin[r].length
            row = lambda a, b, r=r, p=r: Region(buf, p, (SLOT, _r(idx[r], idx[r] + 1), _r(a, b)))  # noqa: E731
            peers = [p for p in range(R) if p != r] if arrive is not None else []
            n = self.gemv_tiles(f"{site}.w", r, xin[r], wbuf[r], k, (0, H), row, None, c,
                                mirrors=(lambda a, b, r=r, peers=peers: [row(a, b, r, p) for p in peers])
                                if peers else None,
                                peer_counters=[arrive[(r, p)] for p in peers])
            ready[r], ntiles[r] = self.ready(c, n), n
        return ready, ntiles

    def _row_oneshot(self, site, xin, resid, wbuf, contrib) -> dict[int, Loc]:
        """One-shot all-reduce: every contributor puts its whole partial into its row of every
        peer's receive buffer (put-with-signal to a per-source arrival counter on the peer);
        every rank then reduces all rows + residual in column tiles. With ``allreduce``
        ``fused`` the GEMV tiles store their rows to the peers themselves (mirror outputs)
        and each signals the peers' arrival counters: no put tasks."""
        e, H, R, P = self.e, self.H, self.R, len(contrib)
        idx = {r: k for k, r in enumerate(contrib)}
        rx = e.buffer(f"rx.{site}", "activation", self.dt, (2, P, H), None)
        fused = self.cfg.allreduce == "fused"
        arrive: dict[tuple[int, int], str] = {}
        if fused:
            arrive = {(r, p): e.counter(f"c.{site}.from{r}.r{p}", p)
                      for r in contrib for p in range(R) if p != r}
        part, ntiles = self._partials(site, xin, wbuf, contrib, rx, idx, arrive if fused else None)
        for r in contrib:
            for p in range(R):
                if p == r or fused:
                    continue
                c = e.counter(f"c.{site}.from{r}.r{p}", p)
                arrive[(r, p)] = c
                src = Region(rx, r, (SLOT, _r(idx[r], idx[r] + 1), _r(0, H)))
                dst = Region(rx, p, (SLOT, _r(idx[r], idx[r] + 1), _r(0, H)))
                w = e.place(r, e.cost("put", [src], [dst]), [part[r]])
                e.task(f"{site}.put.r{r}.to{p}", r, w, "put", [src], [dst],
                       ready=[part[r]], signals=[c], group=f"ar.{site}")
        out = {}
        cols = tiles(0, H, self.cfg.tile_reduce or self.cfg.tile)
        for r in range(R):
            y = self.act(f"{site}.out", r, H)
            cnt = e.counter(f"c.{site}.red.r{r}", r)
            rdy = list(resid[r].ready)
            if r in part:
                rdy.append(part[r])
            # the peer's tiles (fused) or its one put signal the arrival counter: remote
            # producers, so no worker of this rank skips the wait (empty workers)
            rdy += [Ready(arrive[(q, r)], ntiles[q] if fused else 1, frozenset()) for q in contrib if q != r]
            for n, (a, b) in enumerate(cols):
                ins = [Region(rx, r, (SLOT, _r(0, P), _r(a, b))), resid[r].region(a, b)]
                outs = [Region(y, r, (_r(a, b),))]
                w = e.place(r, e.cost("reduce", ins, outs), rdy)
                e.task(f"{site}.red.t{n}.r{r}", r, w, "reduce", ins, outs, ready=rdy,
                       signals=[cnt], group=f"ar.{site}")
            out[r] = Loc(y, r, 0, H, (self.ready(cnt, len(cols)),),
                         sum_of=(Region(rx, r, (SLOT, _r(0, P), _r(0, H))), resid[r].region(), tuple(rdy)))
        return out

    def _row_twoshot(self, site, xin, resid, wbuf, contrib) -> dict[int, Loc]:
        """Two-shot all-reduce: reduce-scatter (contributor r puts column block b of its
        partial to rank b; rank b reduces block b + residual) then all-gather (rank b puts its
        reduced block to every peer). Result on every rank in the symmetric gather buffer."""
        e, H, R, P = self.e, self.H, self.R, len(contrib)
        idx = {r: k for k, r in enumerate(contrib)}
        rs = e.buffer(f"rs.{site}", "activation", self.dt, (2, P, H), None)
        ag = e.buffer(f"ag.{site}", "activation", self.dt, (2, H), None)
        part, _ = self._partials(site, xin, wbuf, contrib, rs, idx)
        blocks = split_aligned(H, R, self.cfg.tile)
        owners = [b for b in range(R) if blocks[b][1] > blocks[b][0]]
        arrive: dict[tuple[int, int], str] = {}
        for r in contrib:
            for b in owners:
                if b == r:
                    continue
                c = e.counter(f"c.{site}.rs.from{r}.r{b}", b)
                arrive[(r, b)] = c
                lo, hi = blocks[b]
                src = Region(rs, r, (SLOT, _r(idx[r], idx[r] + 1), _r(lo, hi)))
                dst = Region(rs, b, (SLOT, _r(idx[r], idx[r] + 1), _r(lo, hi)))
                w = e.place(r, e.cost("put", [src], [dst]), [part[r]])
                e.task(f"{site}.rs.r{r}.to{b}", r, w, "put", [src], [dst], ready=[part[r]],
                       signals=[c], group=f"ar.{site}")
        red: dict[int, Ready] = {}
        for b in owners:
            lo, hi = blocks[b]
            cnt = e.counter(f"c.{site}.red.r{b}", b)
            rdy = list(resid[b].ready)
            if b in part:
                rdy.append(part[b])
            rdy += [Ready(arrive[(q, b)], 1, frozenset()) for q in contrib if q != b]
            n = 0
            for a, c_ in tiles(lo, hi, self.cfg.tile_reduce or self.cfg.tile):
                ins = [Region(rs, b, (SLOT, _r(0, P), _r(a, c_))), resid[b].region(a, c_)]
                outs = [Region(ag, b, (SLOT, _r(a, c_)))]
                w = e.place(b, e.cost("reduce", ins, outs), rdy)
                e.task(f"{site}.red.t{n}.r{b}", b, w, "reduce", ins, outs, ready=rdy,
                       signals=[cnt], group=f"ar.{site}")
                n += 1
            red[b] = self.ready(cnt, n)
        gathered: dict[tuple[int, int], str] = {}
        for b in owners:
            lo, hi = blocks[b]
            for p in range(R):
                if p == b:
                    continue
                c = e.counter(f"c.{site}.ag.from{b}.r{p}", p)
                gathered[(b, p)] = c
                src = Region(ag, b, (SLOT, _r(lo, hi)))
                dst = Region(ag, p, (SLOT, _r(lo, hi)))
                w = e.place(b, e.cost("put", [src], [dst]), [red[b]])
                e.task(f"{site}.ag.r{b}.to{p}", b, w, "put", [src], [dst], ready=[red[b]],
                       signals=[c], group=f"ar.{site}")
        out = {}
        for r in range(R):
            rdy = [red[r]] if r in red else []
            rdy += [Ready(gathered[(b, r)], 1, frozenset()) for b in owners if b != r]
            out[r] = Loc(ag, r, 0, H, tuple(rdy), lead=(SLOT,))
        return out

    # -- LM head + cross-rank argmax -------------------------------------------------------
    def lm_head(self, op: GraphOp, xf: dict[int, Loc]) -> None:
        """Vocabulary-parallel LM head and greedy token. Each rank's vocabulary rows are cut
        into chunks of about ``ARGMAX_CHUNK`` logits (whole GEMV tiles); a chunk's ``argmax``
        task (emitted after all of the rank's tiles, so it never stands in a worker's queue
        ahead of a tile) writes one (max, index) pair. Rank r's pairs are rows off[r] ..
        off[r] + n[r] of one pair table; with R > 1 each rank puts its rows to every peer
        (one put per peer, after its last chunk) and every rank combines all pairs into the
        same token (``argmax_combine``: largest value, smallest index among ties, so the
        result equals one argmax over the whole vocabulary)."""
        e, H, R = self.e, self.H, self.R
        key = op.weights["w"].key
        tied = key == self.g.ops[0].weights["table"].key
        spans, lm_tile = {}, {}
        for r in range(R):
            v0, v1 = self.part.shards[r].vocab
            lm_tile[r] = t = self.stage_tile(v1 - v0, self.cfg.tile_lm_head)
            step = max(t, ARGMAX_CHUNK // t * t)
            spans[r] = [(a, min(a + step, v1 - v0)) for a in range(0, v1 - v0, step)]
        off, total = {}, 0
        for r in range(R):
            off[r], total = total, total + len(spans[r])
        if R > 1:
            pairs = e.buffer("am.pairs", "activation", "f32", (2, total, 2), None)
            prow = lambda r, a, b: Region(pairs, r, (SLOT, _r(a, b), _r(0, 2)))  # noqa: E731
        else:
            pairs = e.buffer("am.pair.r0", "activation", "f32", (total, 2), 0)
            prow = lambda r, a, b: Region(pairs, r, (_r(a, b), _r(0, 2)))  # noqa: E731
        last_worker: dict[int, int] = {}
        for r in range(R):
            v0, v1 = self.part.shards[r].vocab
            nv = v1 - v0
            logits = e.buffer(f"logits.r{r}", "io_output", self.dt, (nv,), r)
            done = e.counter(f"c.am.r{r}", r)
            if self.qdt is not None and self.cfg.quantize_lm_head:  # tied: a quantized copy
                wb, base = self.gemv_weight("w.lm_head", r, key, (nv, H), ((v0, v1), (0, H))), 0
            elif tied:  # read the vocabulary rows straight from the full embedding table
                wb, base = self.table[r], v0
            else:
                wb, base = self.weight("w.lm_head", r, key, (nv, H), ((v0, v1), (0, H))), 0
            chunks = []
            for j, (a, b) in enumerate(spans[r]):
                c = e.counter(f"c.lm.k{j}.r{r}", r)
                n = self.gemv_tiles(f"lm.k{j}", r, xf[r], wb, H, (base + a, base + b),
                                    lambda p, q, lg=logits, base=base: Region(lg, r, (_r(p - base, q - base),)),
                                    None, c, stage_rows=v1 - v0, tile=self.cfg.tile_lm_head)
                chunks.append((j, a, b, c, n))
            # Every argmax after every LM-head tile: a worker runs its queue in order, so an
            # argmax queued between two of its tiles would hold the later tiles until the whole
            # chunk is done (in an H200 profile the LM head then spans 282-349 us for about
            # 170 us of tile time per worker).
            # Each argmax on a worker that ran one of its chunk's tiles (the least loaded of
            # them), not the least-loaded worker of the rank: that left the few workers without
            # a tile to run every chunk's argmax one after another (H100, Llama-3.2-1B, one
            # wave of 126 tiles on 132 workers: 32 argmax tasks on 6 workers, a 28 us tail).
            for j, a, b, c, n in chunks:
                src = [Region(logits, r, (_r(a, b),))]
                dst = [prow(r, off[r] + j, off[r] + j + 1)]
                w = e.place(r, e.cost("argmax", src, dst), [self.ready(c, n)], among=e.signal_workers.get(c))
                e.task(f"lm.argmax.k{j}.r{r}", r, w, "argmax", src, dst, {"offset": int(v0 + a)},
                       ready=[self.ready(c, n)], signals=[done], group="am" if R > 1 else None)
                last_worker[r] = w
            mine = prow(r, off[r], off[r] + len(spans[r]))
            for p in range(R):
                if p == r:
                    continue
                ca = e.counter(f"c.am.from{r}.r{p}", p)
                dst = prow(p, off[r], off[r] + len(spans[r]))
                e.task(f"lm.put.r{r}.to{p}", r, last_worker[r], "put", [mine], [dst],
                       ready=[self.ready(done, len(spans[r]))], signals=[ca], group="am")
        for r in range(R):
            nxt = e.buffer(f"next.r{r}", "io_output", "i32", (1,), r)
            rdy = [self.ready(f"c.am.r{r}", len(spans[r]))]
            rdy += [Ready(f"c.am.from{q}.r{r}", 1, frozenset()) for q in range(R) if q != r]
            e.task(f"lm.combine.r{r}", r, last_worker[r], "argmax_combine", [prow(r, 0, total)],
                   [Region(nxt, r, (_r(0, 1),))], ready=rdy, group="am" if R > 1 else None)


def lower(graph: ModelGraph, ranks: int, workers: int | None = None,
          config: LoweringConfig | None = None, target: Target | None = None) -> ScheduleProgram:
    """Lower a decode-step graph to a ScheduleProgram for ``ranks`` ranks.

    ``workers`` overrides ``config.workers`` when given. ``target`` defaults to a generic
    H100-like target (132 SMs, sim backend). Buffers: ``token.r{r}``, ``pos.r{r}`` (io_input
    [1] i32: the token to embed and its position), ``logits.r{r}`` (io_output: logits of
    rank r's vocabulary rows, in order), ``next.r{r}`` (io_output [1] i32: the greedy next
    token, identical on every rank), KV caches ``kc.l{i}.r{r}`` / ``vc.l{i}.r{r}`` (kv_cache
    [G_r, max_seq, head_dim]) and weights whose ``source`` names the state-dict key and slice.
    Raises AmkError for a bad config, too many workers for the target, or a model that cannot
    be split over ``ranks`` ranks.
    """
    if ranks < 1:
        raise AmkError(f"--tp must be >= 1, got {ranks}")
    cfg = (config or LoweringConfig())
    if workers is not None:
        cfg = cfg.replace(workers=workers)
    cfg.validate(combinations=False)  # a knob that does nothing lowers to the same program
    target = target or Target()
    if cfg.workers > target.max_workers:
        raise AmkError(f"{cfg.workers} workers per rank exceed target {target.name}'s "
                       f"co-residency limit of {target.max_workers}")
    if graph.spec.max_position and cfg.max_seq > graph.spec.max_position:
        raise AmkError(f"max_seq {cfg.max_seq} exceeds the model's max_position_embeddings "
                       f"{graph.spec.max_position}")
    sp = graph.spec
    try:  # before any emission: a split the schedule cannot express is refused, not lowered
        check_split(sp.heads, sp.kv_heads, sp.intermediate, sp.vocab, sp.hidden, ranks,
                    cfg.tile, cfg.allreduce)
    except ValueError as e:
        raise AmkError(f"cannot split {graph.name} over {ranks} ranks: {e}") from None
    return _Lowerer(graph, ranks, cfg, target).lower()


CORPUS_CONFIGS = (dict(tile=32, workers=2),
                  dict(tile=48, workers=3, policy="balanced"),
                  dict(tile=64, workers=1, allreduce="twoshot"))


def lowered_corpus_seeds(max_programs: int | None = None, full: bool = False) -> list[ScheduleProgram]:
    """Real lowerings for the adversarial corpus (must-accept seeds): tiny recipes with one
    layer and max_seq 8. Default: 6 programs covering R = 1..4, both all-reduce algorithms and
    both policies; ``full=True``: every tiny recipe x R in 1..4 x ``CORPUS_CONFIGS`` (36).
    Builds graphs from configs only (no weights are allocated)."""
    from models.graph import build_graph, spec_from_config
    from models.recipes import build_config

    if full:
        combos = [(n, r, k) for n in ("tiny-llama", "tiny-qwen2", "tiny-qwen3")
                  for r in (1, 2, 3, 4) for k in CORPUS_CONFIGS]
    else:
        combos = [("tiny-llama", 2, dict(tile=32, workers=2)),
                  ("tiny-qwen2", 2, dict(tile=48, workers=3, policy="balanced")),
                  ("tiny-qwen3", 3, dict(tile=32, workers=2, allreduce="twoshot")),
                  ("tiny-llama", 4, dict(tile=64, workers=2)),
                  ("tiny-qwen2", 1, dict(tile=64, workers=2)),
                  ("tiny-qwen3", 2, dict(tile=64, workers=1, allreduce="twoshot"))]
    graphs = {}
    out = []
    for name, ranks, knobs in combos:
        if name not in graphs:
            cfgd = build_config(name)
            cfgd.num_hidden_layers = 1
            graphs[name] = build_graph(spec_from_config(cfgd), name=name)
        out.append(lower(graphs[name], ranks, config=LoweringConfig(max_seq=8, **knobs)))
        if max_programs and len(out) >= max_programs:
            break
    return out
