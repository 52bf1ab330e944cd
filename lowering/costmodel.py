"""A simple roofline cost model of a ScheduleProgram: PREDICTED decode-step latency.

Batch-1 decode is memory bound, so the model charges bytes, not FLOPs:

    t_rank = max( bytes_rank / hbm_bw ,
                  max_w (tasks_{rank,w} * task_overhead + serial_{rank,w} * head_latency
                         + flops_{rank,w} / (gemm_flops / sms)) )
             + sync_sites * cross_rank_latency
    predicted step latency = max over ranks of t_rank

``bytes_rank``: bytes every task of the rank reads and writes (``task_bytes``: the weight
rows a GEMV tile streams, one embedding row, the KV-cache rows attention reads at the given
sequence length, activations). ``task_overhead``: the per-task cost of the persistent
kernel's queue loop (decode the table entry, wait, dispatch, release). ``sync_sites``: the
number of cross-rank collectives (each all-reduce / argmax exchange costs at least one
one-way signal latency, since the next stage waits for peers). ``serial``: the dependent
per-head passes of the small per-head ops (``serial_passes``): the kernel's ``rmsnorm`` over
heads (q/k norm), ``rope``, ``kv_append`` and ``rope_append`` loop over heads one after the
other, each pass a few dependent global-memory round trips, so they are latency bound: in an
H100 profile of Qwen3-1.7B a q_norm over 16 heads took ~30 us, a rope ~13 us and a kv_append
over 8 heads ~12 us, for a few KB each. ``flops``: the ``gemm`` tiles of the communication
patterns (lowering/collectives.py) are compute bound where decode's GEMVs are not: a tile
``[m, k] @ [k, n]`` costs ``2 m n k`` flops (``gemm_flops_of``), run by its worker (one CTA on
one SM) at ``gemm_flops / target.sms``, one SM's share of the GPU's peak; its bytes (the a and
b tiles it reads, the y tile it writes) are charged at ``hbm_bw`` like every other task's.

Default constants (all labelled assumptions, overridable): ``hbm_bw`` 3.0e12 B/s (the copy
bandwidth ``amk bench`` measures on an H100, docs/benchmarks.md; published peak is 3.35 TB/s),
``task_overhead`` 0.5 us, ``head_latency`` 0.8 us per head pass (fits the Qwen3-1.7B
profile above: 32 passes ~ 26 us, 16 ~ 13 us), ``cross_rank_latency`` 3 us (published NVLink one-way latencies are
1-3 us; bench/comm.py measures 1.35-1.6 us one-way on H200s, docs/comm.md), ``gemm_flops``
989e12 flop/s (the dense BF16 tensor-core peak of an H100 SXM, NVIDIA's H100 datasheet; the
H200 has the same). These are
predictions for ranking configurations and for the roofline distance, never a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ir.ops import OPS
from ir.program import DTYPE_BYTES, Buffer, ScheduleProgram, Task

DEFAULT_HBM_BW = 3.0e12
DEFAULT_TASK_OVERHEAD_S = 0.5e-6
DEFAULT_CROSS_RANK_LATENCY_S = 3e-6
DEFAULT_HEAD_LATENCY_S = 0.8e-6
DEFAULT_GEMM_FLOPS = 989e12


def _region_bytes(region, buffers: dict[str, Buffer]) -> int:
    buf = buffers.get(region.buffer)
    if buf is None:
        return 0
    return region.numel() * DTYPE_BYTES.get(buf.dtype, 4)


def task_bytes(task: Task, buffers: dict[str, Buffer], seq_len: int) -> int:
    """Bytes a task moves through HBM (reads + writes) at sequence length ``seq_len``.

    ``embed`` reads one table row (not the whole declared table region); ``kv_append`` and
    ``rope_append`` write one row per KV head of each cache; ``attention``,
    ``rope_attention`` and ``rope_attention_kv`` read ``seq_len`` rows of each cache region
    (the last one also its current k and v), a split-KV part (param ``parts``) its share of
    them, rounded up; sync tasks move nothing;
    every other op moves its whole regions (the fused GEMVs: their vectors, weight tile
    and residual; a norm_gemv tile re-reads the whole normalised input, which it does).
    Small operands (pos, inv_freq) of the cache ops are not counted.
    """
    op = task.op
    if op in ("quiet", "fence", "nop"):
        return 0
    if op == "embed":
        row = task.outs[0].numel()
        return 2 * row * DTYPE_BYTES.get(buffers[task.outs[0].buffer].dtype, 4)
    if op in ("kv_append", "attention", "rope_append", "rope_attention", "rope_attention_kv"):
        append = op in ("kv_append", "rope_append")
        parts = max(1, int(task.params.get("parts", 1)))
        total = 0
        spec = OPS[op]
        regs = dict(zip(spec.ins + spec.outs, (*task.ins, *task.outs)))
        caches = (regs["kc"], regs["vc"])
        vectors = [regs[role] for role in ("q", "k", "v", "o") if role in regs]
        for reg in caches:
            shape = reg.shape()
            s = shape[-2] if len(shape) >= 2 else 1
            per_row = _region_bytes(reg, buffers) // max(s, 1)
            total += per_row * (1 if append else -(-max(1, min(seq_len, s)) // parts))
        for reg in vectors:
            total += _region_bytes(reg, buffers)
        return total
    return sum(_region_bytes(r, buffers) for r in task.ins) + \
        sum(_region_bytes(r, buffers) for r in task.outs)


def serial_passes(task: Task) -> int:
    """Dependent passes of ``task``'s per-head (per-group) loop in the kernel (0 for every
    other op): ``rmsnorm`` 2 per group of ``dim`` elements (sum of squares, then scale and
    store; a full-width norm is one group), ``rope`` 1 per head, ``kv_append`` and
    ``rope_append`` 2 per KV head (the k and the v row)."""
    op = task.op
    if op == "rmsnorm":
        dim = int(task.params.get("dim", 0) or 0)
        return 2 * (task.ins[0].numel() // dim) if dim > 0 else 0
    if op == "rope":
        hd = int(task.params.get("head_dim", 0) or 0)
        return task.ins[0].numel() // hd if hd > 0 else 0
    if op in ("kv_append", "rope_append"):
        hd = int(task.params.get("head_dim", 0) or 0)
        return 2 * (task.ins[0].numel() // hd) if hd > 0 else 0
    return 0


def gemm_flops_of(task: Task) -> int:
    """Flops of a ``gemm`` task (``2 m n k``; 0 for every other op). Its a, b and y regions hold
    m*k, k*n and m*n elements, whose product is (m n k)^2 (ir.ops.gemm_dims)."""
    if task.op != "gemm" or len(task.ins) < 2 or not task.outs:
        return 0
    from ir.ops import gemm_dims

    dims = gemm_dims(task.ins[0].numel(), task.ins[1].numel(), task.outs[0].numel())
    if dims is None:
        return 0
    m, k, n = dims
    return 2 * m * n * k


@dataclass
class CostEstimate:
    """A predicted decode-step latency (seconds) with its parts, per rank."""

    predicted_latency_s: float
    roofline_s: float
    per_rank: list[dict[str, Any]]
    assumptions: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": "predicted (roofline cost model, not a measurement)",
            "predicted_latency_us": self.predicted_latency_s * 1e6,
            "roofline_us": self.roofline_s * 1e6,
            "per_rank": self.per_rank,
            "assumptions": self.assumptions,
        }


def estimate(program: ScheduleProgram, seq_len: int = 1, hbm_bw: float = DEFAULT_HBM_BW,
             task_overhead_s: float = DEFAULT_TASK_OVERHEAD_S,
             cross_rank_latency_s: float = DEFAULT_CROSS_RANK_LATENCY_S,
             head_latency_s: float = DEFAULT_HEAD_LATENCY_S,
             gemm_flops: float = DEFAULT_GEMM_FLOPS) -> CostEstimate:
    """Predict the latency of one decode step at sequence length ``seq_len`` (tokens in the
    KV cache including the new one). ``roofline_s`` is the pure bandwidth bound (max over
    ranks of bytes / hbm_bw); ``predicted_latency_s`` adds task, per-head serial
    (``serial_passes`` x ``head_latency_s``), GEMM compute (``gemm_flops_of`` at
    ``gemm_flops / target.sms`` per worker) and sync overheads."""
    buffers = program.buffer_map()
    per_rank = []
    groups_per_rank: dict[int, set[str]] = {r: set() for r in range(program.ranks)}
    by_rank_bytes = [0] * program.ranks
    by_worker = {(r, w): 0 for r in range(program.ranks) for w in range(program.workers)}
    serial = {(r, w): 0 for r in range(program.ranks) for w in range(program.workers)}
    flops = {(r, w): 0 for r in range(program.ranks) for w in range(program.workers)}
    per_worker_flops = gemm_flops / max(1, int(program.target.sms))
    for t in program.tasks:
        flops[(t.rank, t.worker)] = flops.get((t.rank, t.worker), 0) + gemm_flops_of(t)
        by_rank_bytes[t.rank] += task_bytes(t, buffers, seq_len)
        by_worker[(t.rank, t.worker)] = by_worker.get((t.rank, t.worker), 0) + 1
        serial[(t.rank, t.worker)] = serial.get((t.rank, t.worker), 0) + serial_passes(t)
        if t.group and program.ranks > 1:
            groups_per_rank[t.rank].add(t.group)
    worst = 0.0
    roof = 0.0
    for r in range(program.ranks):
        bw_t = by_rank_bytes[r] / hbm_bw
        max_tasks = max((by_worker[(r, w)] for w in range(program.workers)), default=0)
        ovh_t = max((by_worker[(r, w)] * task_overhead_s + serial[(r, w)] * head_latency_s
                     + flops[(r, w)] / per_worker_flops for w in range(program.workers)), default=0.0)
        compute_t = max((flops[(r, w)] / per_worker_flops for w in range(program.workers)), default=0.0)
        sync_t = len(groups_per_rank[r]) * cross_rank_latency_s
        t = max(bw_t, ovh_t) + sync_t
        per_rank.append({"rank": r, "bytes": by_rank_bytes[r], "bandwidth_us": bw_t * 1e6,
                         "max_tasks_per_worker": max_tasks, "task_overhead_us": ovh_t * 1e6,
                         "gemm_compute_us": compute_t * 1e6,
                         "sync_sites": len(groups_per_rank[r]), "sync_us": sync_t * 1e6,
                         "predicted_us": t * 1e6})
        worst = max(worst, t)
        roof = max(roof, bw_t)
    return CostEstimate(worst, roof, per_rank, {
        "hbm_bw_bytes_per_s": hbm_bw, "task_overhead_s": task_overhead_s,
        "cross_rank_latency_s": cross_rank_latency_s, "head_latency_s": head_latency_s,
        "gemm_flops_per_s": gemm_flops, "seq_len": seq_len})
