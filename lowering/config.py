"""The knobs: ``LoweringConfig`` (how the lowering schedules a decode step: the search surface)
and ``KernelConfig`` (how the Triton megakernel runs it), together an ``AmkConfig``, read from
one JSON file and from generated command-line flags.

Each knob is declared once, with its description, flag and allowed values, by
``lowering.knobs.knob``; the flags of ``amk compile / generate / run / bench / search`` and of
the bench scripts, the checks and their messages, and the tables of docs/lowering.md and
docs/triton.md come from those declarations (``python scripts/knob_docs.py`` writes the
tables). A config file is::

    {"lowering": {"tile": 16, "fuse": true, ...}, "kernel": {"gemv_block": "16x128", ...}}

with either part optional and fields left out at their defaults. A file holding only lowering
fields at the top level (the older form, e.g. a search's best config written before the
kernel part existed) is read as the lowering part. ``--config FILE`` plus flags: the flags
override the file. A third part, ``"collective"``, holds the ``CollectiveConfig`` of a lowered
communication pattern (``amk dist``; lowering/collectives.py); AmkConfig leaves it out.

``validate`` refuses a bad value (naming the field and its flag) and, unless
``combinations=False``, a combination in which a knob does nothing (``--late-append 1``
without ``--fuse 1``, ``--fuse-reduce 1`` at ``--tp 1``, ``--x-reuse 1`` without
``--x-stage 1``, ...; ``lowering.knobs.inert``). Every lowering knob changes the lowered
program where it acts (tests/test_lowering.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, fields
from dataclasses import replace as dc_replace
from pathlib import Path
from typing import Any

from ground.errors import AmkError
from lowering.knobs import (check_fields, check_inert, equal, given, knob, knob_named, knobs_of, on, one_of,
                            positive)

POLICIES = ("round_robin", "balanced", "stage")
ALLREDUCE_ALGOS = ("oneshot", "fused", "twoshot")
DTYPES = ("f32", "bf16")
#: weight formats of the GEMV weights: none / bf16 = unquantized (the weights in ``dtype``),
#: int8 / fp8 = quantized per output row (lowering/quant.py)
WEIGHT_FORMATS = ("none", "bf16", "int8", "fp8")
#: int8 -> fp32 conversions of the GEMV (KernelConfig.int8_convert); the index is the kernel's I8_CVT
INT8_CONVERTS = ("cvt", "magic", "prmt")


class _Knobs:
    """What LoweringConfig and KernelConfig share: checks, JSON and copies."""

    def validate(self, source: str = "config", ranks: int | None = None, combinations: bool = True):
        """Return self, or raise AmkError (exit code 2) naming the bad field and its flag; with
        ``combinations``, also a knob that does nothing here (at ``ranks`` ranks when given)."""
        check_fields(self, source)
        self._rules(source)
        if combinations:
            check_inert(self, source, ranks)
        return self

    def _rules(self, source: str) -> None:
        """Rules between fields that are not 'does nothing' (a value other knobs forbid)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, source: str = "config", ranks: int | None = None,
                  combinations: bool = True):
        """Build from a dict (missing fields take defaults) and validate. Raises AmkError
        naming an unknown or ill-typed field."""
        part = "lowering" if cls is LoweringConfig else "kernel"
        if not isinstance(obj, dict):
            raise AmkError(f"{source}: expected a JSON object of {part} knobs, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        other = KernelConfig if cls is LoweringConfig else LoweringConfig
        for k in obj:
            if k not in known:
                hint = (f" ({k!r} is a {'kernel' if part == 'lowering' else 'lowering'} knob: put it "
                        f"under \"{'kernel' if part == 'lowering' else 'lowering'}\")"
                        if k in {f.name for f in fields(other)} else "")
                raise AmkError(f"{source}: unknown field {k!r}{hint}; known {part} fields: "
                               f"{', '.join(sorted(known))}")
        return cls(**obj).validate(source, ranks, combinations)

    def replace(self, **changes: Any):
        """A copy with ``changes`` applied (None values ignored); each value is checked
        (AmkError), combinations are not."""
        return dc_replace(self, **{k: v for k, v in changes.items() if v is not None}).validate(
            combinations=False)

    @classmethod
    def from_file(cls, path: str | Path):
        """This part of a config file (``AmkConfig.from_file``)."""
        cfg = AmkConfig.from_file(path)
        return cfg.lowering if cls is LoweringConfig else cfg.kernel


@dataclass(frozen=True)
class LoweringConfig(_Knobs):
    """The lowering's knobs (the search surface; docs/lowering.md lists them). Construct with
    ``LoweringConfig(...)`` then call ``validate()``, or use ``from_json`` which validates."""

    tile: int = knob(64, "Rows per GEMV tile (q/k/v, o, gate/up, down, LM head) and columns per "
                     "all-reduce reduce tile (unless tile_reduce); also the alignment of the MLP-column "
                     "and vocabulary splits over ranks.", lo=1)
    workers: int = knob(4, "Persistent workers (CTAs) per rank.", lo=1, hi=1024)
    policy: str = knob("round_robin", "Tile -> worker assignment: round_robin (tile i of a stage on worker "
                       "i mod W), balanced (greedy: the worker with the fewest bytes moved so far) or stage "
                       "(greedy within each stage, then overall, so a stage's tiles spread evenly).",
                       choices=POLICIES)
    allreduce: str = knob("oneshot", "Cross-rank reduction: oneshot (each rank puts its partial into every "
                          "peer's receive buffer, then reduces locally), fused (oneshot with the puts fused "
                          "into the GEMV tiles: no put stage) or twoshot (reduce-scatter, then all-gather).",
                          choices=ALLREDUCE_ALGOS, multi_rank=True)
    max_seq: int = knob(256, "KV-cache length in tokens (positions 0 .. max_seq - 1 can be decoded).", lo=1)
    dtype: str = knob("f32", "Dtype of weights, activations and KV cache.", choices=DTYPES)
    weights: str = knob("none", "GEMV weights (q/k/v, o, gate/up, down): none or bf16 = in dtype (unquantized), "
                        "int8 or fp8 (E4M3) = quantized at compile time, symmetric, per output row with f32 "
                        "scales (torchao's weight-only math) unless weight_group says otherwise; the "
                        "embedding table is never quantized.",
                        choices=WEIGHT_FORMATS)
    quantize_lm_head: bool = knob(False, "Quantize the LM head's weight too (a tied head gets its own quantized "
                                  "copy of the embedding table's rows).",
                                  needs=(one_of("weights", ("int8", "fp8")),))
    weight_group: int = knob(0, "K elements per scale of int8 weights: 0 = one f32 scale per output row; 32 = "
                             "one scale per 32 columns of a row with ggml's Q8_0 math (GGUF's Q8_0 blocks, "
                             "their f16 scales stored as f32: a Q8_0 checkpoint keeps its own weights and "
                             "scales).", choices=(0, 32),
                             needs=(one_of("weights", ("int8",)),))
    fuse: bool = knob(False, "Emit the fused ops: RMSNorm into the following GEMVs (norm_gemv), RoPE into "
                      "the KV append and attention (rope_append, rope_attention), SiLU x up into the down "
                      "GEMV (swiglu_gemv) and, at one rank, the residual add into the o / down GEMVs "
                      "(gemv_res); fewer stages and tasks, the same results.")
    wave: bool = knob(False, "Size each GEMV stage's tiles to one wave of workers: ceil(rows / workers) "
                      "rounded up to a multiple of tile (tile is then the granularity); with fuse, gate "
                      "and up tiles are sized over gate + up together.")
    attn_split: int = knob(1, "Attention tasks per KV head: its query heads split into this many "
                           "contiguous groups, each one task on its own worker (capped at the group size).",
                           lo=1)
    attn_kv_split: int = knob(1, "Attention tasks per query-head group along the positions (flash-decoding's "
                              "split-KV): each attends to a contiguous share of the positions 0..pos on its own "
                              "worker and writes a partial record (sum, max, sum of exponentials); one "
                              "attention_combine task per group merges them. More parallel work for the "
                              "~100 workers idle during attention, one hand-off more.", lo=1, hi=16)  # ops/attention.py MAX_KV_PARTS
    tile_qkv: int = knob(0, "Rows per q/k/v tile (q, k and v are one narrow stage: a tile that fits it "
                         "in one round of workers trades a second task for a longer first one).",
                         lo=1, zero="tile")
    tile_gate_up: int = knob(0, "Rows per gate/up tile (the MLP's input stage streams the most bytes of a "
                             "layer; larger tiles there cut the per-task cost).", lo=1, zero="tile")
    tile_lm_head: int = knob(0, "Rows per LM-head tile; the vocabulary split over ranks stays aligned "
                             "to tile.", lo=1, zero="tile")
    late_append: bool = knob(False, "Attention reads the current token's key and value straight from the "
                             "k / v projections (rope_attention_kv) and the rank's rope_append (one task per "
                             "8 KV heads) runs later, in a worker's slack: one hand-off less on the step's "
                             "critical path (models without q/k norm).", needs=(on("fuse"),))
    tile_reduce: int = knob(0, "Columns per all-reduce reduce tile (a reduce tile moves a few hundred "
                            "bytes: fewer, wider tiles cut the per-task cost).", lo=1, zero="tile",
                            multi_rank=True)
    fuse_reduce: bool = knob(False, "The RMSNorm + GEMV tiles after a one-shot all-reduce sum its partials "
                             "and the residual themselves (reduce_norm_gemv) and wait on the partials, not "
                             "on the reduce stage: one hand-off less per all-reduce.",
                             needs=(on("fuse"), one_of("allreduce", ("oneshot", "fused"))), multi_rank=True)
    down_split_k: int = knob(1, "Down-projection tiles cut along K (the MLP's columns) into this many chunks, "
                             "each chunk's tiles waiting only on the gate/up tiles of its columns and "
                             "writing a partial that the next RMSNorm + GEMV tiles sum with the residual "
                             "(reduce_norm_gemv): the down stage starts before the gate/up stage ends and "
                             "spreads its long K = MLP rows over more workers.", lo=1, hi=8,
                             needs=(on("fuse"),), single_rank=True)

    @property
    def weight_format(self) -> str:
        """The weight format the knobs name (lowering/quant.py's formats): ``q8_0`` for int8
        weights with 32-column groups, else ``weights`` itself."""
        return "q8_0" if self.weights == "int8" and self.weight_group == 32 else self.weights


def weight_knobs(fmt: str) -> dict[str, Any]:
    """The ``weights`` and ``weight_group`` knob values of weight format ``fmt``, the inverse
    of LoweringConfig.weight_format: ``q8_0`` is int8 with 32-column groups."""
    return {"weights": "int8", "weight_group": 32} if fmt == "q8_0" else {"weights": fmt, "weight_group": 0}


def _gemv_block(value: str) -> tuple[int, int] | None:
    """(N, K) of an ``NxK`` text, None when it is not one."""
    try:
        n, k = (int(v) for v in value.lower().split("x"))
    except (AttributeError, ValueError):
        return None
    return n, k


def _check_gemv_block(value: str) -> str | None:
    nk = _gemv_block(value)
    if nk is None:
        return f"expected NxK, e.g. 32x512, got {value!r}"
    for v, what in zip(nk, "NK"):
        if v < 1 or v & (v - 1):
            return f"{what} must be a power of two, got {v}"
    return None


def _check_pow2_or_zero(value: int) -> str | None:
    return None if value == 0 or not value & (value - 1) else f"must be 0 or a power of two, got {value}"


@dataclass(frozen=True)
class KernelConfig(_Knobs):
    """The Triton megakernel's knobs (docs/triton.md lists them): its warps, block sizes and
    code options. ``lowering.triton.blocks.kernel_options`` turns them into the executor's
    ``num_warps`` and ``Blocks``."""

    num_warps: int = knob(8, "Warps per worker CTA.", pow2=True, lo=1, hi=32, metavar="W")
    gemv_block: str = knob("32x512", "GEMV block: rows x columns of W (N x K elements) streamed per "
                           "iteration.", check=_check_gemv_block, values="NxK, powers of two", metavar="NxK")
    gemv_stages: int = knob(1, "GEMV weight pipeline depth: 1 = one block in flight; S >= 2 = S - 1 blocks "
                            "in flight through asynchronous copies into S - 1 shared-memory buffers.",
                            lo=1, hi=8, metavar="S")
    gemv_unroll: int = knob(1, "The GEMV's K loop unrolled U times, U weight blocks in flight (above 2 it "
                            "needs a K block below 32 x num_warps, e.g. 16x128 at 8 warps).",
                            choices=(1, 2, 4, 8, 16), metavar="U", needs=(equal("gemv_stages", 1),))
    prefetch: int = knob(0, "L2 prefetch look-ahead in tasks: at the start of task i the worker starts an L2 "
                         "bulk prefetch of task i + D's GEMV weight tile, so weight streaming overlaps waits "
                         "and other tasks.", lo=1, hi=8, zero="off", metavar="D")
    prefetch_cap: int = knob(0, "The task-ahead L2 prefetch covers at most a tile's first BYTES.",
                             lo=16, multiple=16, zero="the whole tile", metavar="BYTES",
                             needs=(positive("prefetch"),))
    prefetch_rows: int = knob(0, "The task-ahead L2 prefetch covers at most a tile's first N weight rows "
                              "(unlike prefetch_cap it keeps a wide tile's whole first row block).",
                              lo=1, zero="no limit", metavar="N", needs=(positive("prefetch"),))
    roll: int = knob(0, "A GEMV tile of several row blocks prefetches the row block B blocks ahead into L2 "
                     "while it streams.", lo=1, hi=8, zero="off", metavar="B")
    attention_block: int = knob(32, "Decode attention: cache positions per block of its online softmax (a "
                                "context of <= T positions takes one block; lowered where [Q, T, D] would "
                                "exceed ~64 fp32 registers per thread).", pow2=True, lo=1, metavar="T")
    row_prefetch: bool = knob(True, "At the start of each task, prefetch the next task's table row into "
                              "L1, so its decode does not wait on L2 or DRAM.")
    x_stage: bool = knob(True, "norm_gemv and swiglu_gemv compute their prologue f(x) (RMSNorm, SiLU x up) "
                         "once per task into a per-worker scratch row instead of inside the weight loop.")
    x_reuse: bool = knob(True, "A GEMV whose f(x) the worker's previous staging task already left in the "
                         "scratch (same x, nothing waited on or written since) skips the x pass.",
                         needs=(on("x_stage"),))
    x_chunk: int = knob(8192, "Elements of x the staging pass loads at once (at least N x K of "
                        "gemv_block); an x that fits is loaded once.", pow2=True, lo=1, metavar="E")
    w_preload: int = knob(0, "Columns of its first weight row block a GEMV task loads before its waits "
                          "(weights only), so the waits, the decode and the x pass overlap that part of "
                          "the weight stream.", check=_check_pow2_or_zero, metavar="E",
                          values="0 (off) or a power of two >= K of gemv_block (2 x K with gemv_unroll 2)")
    lean_release: bool = knob(True, "A task that signals a peer fences at system scope once (thread 0, "
                              "after the barrier) and signals each peer with a relaxed red, instead of a "
                              "fence in every thread and one release per peer.")
    gemv_tma: bool = knob(False, "GEMVs whose W is contiguous and 16-byte aligned stream it with TMA copies "
                          "into gemv_stages - 1 shared-memory buffers that hold no registers (needs "
                          "gemv_stages 2..8, w_preload 0, N and K of gemv_block at most 256).")
    q_tma: bool = knob(False, "Quantized GEMV weights with one scale per row (int8 / fp8) stream with TMA "
                       "copies too, as gemv_tma streams bf16 ones (needs gemv_tma).", needs=(on("gemv_tma"),))
    q_gemv_n: int = knob(0, "Rows of the GEMV block for quantized weights, whose bytes per element are half "
                         "bf16's: twice gemv_block's N keeps as many bytes in flight per block.",
                         pow2=True, lo=1, hi=256, zero="gemv_block's N", metavar="N")
    int8_convert: str = knob("prmt", "How an int8 weight becomes fp32 in the GEMV: prmt (four bytes biased at "
                             "once, each placed in the mantissa of 2^23 by one PRMT, 2^23 + 128 subtracted: exact; "
                             "2% faster than magic on Llama-3.1-8B in two calls), magic (the sign-extended byte "
                             "added to the bits of 1.5 x 2^23, then 1.5 x 2^23 subtracted: an integer and an fp32 "
                             "add, exact; 3% faster than cvt on Llama-3.2-1B, 12% on Llama-3.1-8B with q_tma) "
                             "or cvt (the I2F conversion, a quarter-rate pipe).", choices=INT8_CONVERTS)
    ring: int = knob(0, "Weight ring: GEMV tasks whose bf16 weights no task writes stream them through S "
                     "shared-memory pages per worker, copied ahead of the tasks that use them, across "
                     "their waits.", lo=1, hi=32, zero="off", metavar="S")
    ring_rows: int = knob(4, "Rows of a weight-ring page.", pow2=True, lo=1, hi=64, metavar="R",
                          needs=(positive("ring"),))
    ring_cols: int = knob(2048, "Columns of a weight-ring page (a page is ring_rows x ring_cols bf16).",
                          pow2=True, lo=8, hi=8192, metavar="C", needs=(positive("ring"),))
    maxnreg: int = knob(0, "ptxas's register cap per thread; automatic: none while the workers fit one "
                        "CTA per SM, else the most that lets ceil(workers / SMs) CTAs share an SM.",
                        lo=24, hi=255, zero="automatic", metavar="R")
    elide_waits: bool = knob(True, "Skip a wait that an earlier task of the same worker already did.")
    coalesce_signals: bool = knob(True, "Release several consecutive tiles' signals with one atomic.")

    @property
    def gemv_n(self) -> int:
        """Rows of the GEMV block (N of gemv_block)."""
        return _gemv_block(self.gemv_block)[0]

    @property
    def gemv_k(self) -> int:
        """Columns of the GEMV block (K of gemv_block)."""
        return _gemv_block(self.gemv_block)[1]

    def _rules(self, source: str) -> None:
        least = self.gemv_k * (2 if self.gemv_unroll == 2 else 1)
        if self.w_preload and self.w_preload < least:
            raise AmkError(f"{source}: field 'w_preload' (--w-preload): must be 0 or a power of two of at "
                           f"least --gemv-block K = {self.gemv_k} ({2 * self.gemv_k} with --gemv-unroll 2), "
                           f"got {self.w_preload}")
        if self.gemv_tma:
            if self.gemv_stages < 2:
                raise AmkError(f"{source}: --gemv-tma 1 needs --gemv-stages 2..8 (its copies are pipelined), "
                               f"got --gemv-stages {self.gemv_stages}")
            if self.w_preload:
                raise AmkError(f"{source}: --gemv-tma 1 needs --w-preload 0 (the first block would be loaded "
                               f"twice), got --w-preload {self.w_preload}")
            if self.gemv_n > 256 or self.gemv_k > 256:
                raise AmkError(f"{source}: --gemv-tma 1 needs N and K of --gemv-block at most 256 (a TMA "
                               f"box's limit), got --gemv-block {self.gemv_block}")


#: the parts a config file may have; ``collective`` is CollectiveConfig's (collective_part)
PARTS = frozenset({"lowering", "kernel", "collective"})
#: all-reduce algorithms of the matmul + all-reduce pattern (CollectiveConfig.allreduce)
COLLECTIVE_ALLREDUCE = ("oneshot", "twoshot")
#: the knobs of CollectiveConfig that act only for some patterns (models/collectives.py kinds)
_PATTERN_KNOBS = {
    "allreduce": ("matmul_allreduce",),
    "reduce_rows": ("matmul_reduce_scatter", "matmul_allreduce"),
    "whole_k": ("ulysses_combine",),
    "direct": ("matmul_reduce_scatter", "matmul_allreduce"),
}


@dataclass(frozen=True)
class CollectiveConfig(_Knobs):
    """The knobs of a lowered communication pattern (lowering/collectives.py; docs/lowering.md,
    "Communication patterns", lists them): a config file's ``"collective"`` part. Construct
    and call ``validate()``, or use ``from_json`` which validates."""

    tile_m: int = knob(0, "Rows per GEMM tile (0: chosen by size, lowering.collectives.size_tile).", lo=1,
                       zero="by size")
    tile_n: int = knob(0, "Columns per GEMM tile (0: chosen by size, as tile_m).", lo=1, zero="by size")
    workers: int = knob(0, "Persistent workers (CTAs) per rank.", lo=1, hi=1024,
                        zero="one per SM of the target")
    chunks: int = knob(4, "Pieces (aligned to tile_m where the rows allow) in which each rank's row block is "
                       "sent and signalled: a GEMM tile (all-gather, Ulysses) or a reduce task (reduce-scatter, "
                       "all-reduce) waits only for the pieces of its rows, so it starts before the whole block "
                       "arrived; more pieces mean more puts, signals and counters.", lo=1, hi=64)
    reduce_rows: int = knob(0, "Rows per reduce task (and RMSNorm task) of the reduce-scatter and the "
                            "all-reduce.", lo=1, zero="tile_m")
    allreduce: str = knob("oneshot", "Matmul + all-reduce: oneshot (every rank puts each partial tile to every "
                          "peer, then reduces all rows) or twoshot (reduce-scatter of row blocks, then an "
                          "all-gather of the reduced rows: 2 (R-1)/R of the partial's bytes per rank "
                          "instead of R-1 times them).", choices=COLLECTIVE_ALLREDUCE)
    whole_k: bool = knob(False, "Ulysses combine: each output tile waits for every rank's piece and runs one GEMM "
                         "over all R*C columns, instead of one GEMM per piece as it arrives (summed in an fp32 "
                         "accumulator).")
    direct: bool = knob(False, "Reduce-scatter (and the two-shot all-reduce's): a GEMM tile of another rank's rows "
                        "stores them straight into that rank's staging buffer and signals it (a remote store in "
                        "the tile's epilogue) instead of writing them locally for a put task to send.")

    def validate(self, source: str = "config", pattern: str | None = None,
                 combinations: bool = True) -> "CollectiveConfig":
        """Return self, or raise AmkError (exit code 2) naming the bad field and its flag; with
        ``pattern`` (a models.collectives kind) and ``combinations``, also a knob that does
        nothing for that pattern."""
        check_fields(self, source)
        if combinations and pattern is not None:
            for name, why in self.inert_for(pattern):
                raise AmkError(f"{source}: {why}")
        return self

    def inert_for(self, pattern: str) -> list[tuple[str, str]]:
        """(knob, why) of the knobs set away from their defaults that do nothing for the
        pattern kind ``pattern`` (e.g. ``allreduce`` for an all-gather + matmul)."""
        out = []
        for k in knobs_of(self):
            kinds = _PATTERN_KNOBS.get(k.name)
            v = getattr(self, k.name)
            if kinds and pattern not in kinds and k.acts(v):
                off = "0" if k.kind is bool else str(k.default)
                out.append((k.name, f"{k.flag} {v if k.kind is not bool else int(v)} does nothing for "
                                    f"{pattern} (only for {' and '.join(kinds)}): set {k.flag} {off}"))
        if pattern == "matmul_allreduce" and self.direct and self.allreduce == "oneshot":
            out.append(("direct", "--direct 1 does nothing for matmul_allreduce with --allreduce oneshot (each tile "
                                  "goes to every peer by puts): set --allreduce twoshot or --direct 0"))
        return out

    @classmethod
    def from_json(cls, obj: Any, source: str = "config", pattern: str | None = None,
                  combinations: bool = True) -> "CollectiveConfig":
        """Build from a dict of collective knobs (missing fields take defaults) and validate.
        Raises AmkError naming an unknown or ill-typed field."""
        if not isinstance(obj, dict):
            raise AmkError(f"{source}: expected a JSON object of collective knobs, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        for k in obj:
            if k not in known:
                raise AmkError(f"{source}: unknown field {k!r}; known collective fields: {', '.join(sorted(known))}")
        return cls(**obj).validate(source, pattern, combinations)

    @classmethod
    def from_file(cls, path: str | Path, pattern: str | None = None) -> "CollectiveConfig":
        """The ``"collective"`` part of a config file (``{"collective": {...}, "kernel": {...}}``;
        a flat object is read as collective fields). Raises AmkError for a missing file, bad
        JSON (line:column), an unknown field or a bad value."""
        return cls.from_json(collective_part(_read_json(path), str(path)), str(path), pattern)


def collective_part(obj: Any, source: str) -> dict[str, Any]:
    """The collective knobs of a config file's JSON value: its ``"collective"`` part when it is
    made of parts (``lowering`` / ``kernel`` / ``collective``), else the object itself."""
    if not isinstance(obj, dict):
        raise AmkError(f"{source}: expected a JSON object {{\"collective\": {{...}}}}, got {type(obj).__name__}")
    if obj and set(obj) <= PARTS:
        part = obj.get("collective", {})
        if not isinstance(part, dict):
            raise AmkError(f"{source}: \"collective\" must be a JSON object of collective knobs, got "
                           f"{type(part).__name__}")
        return dict(part)
    return dict(obj)


def collective_from_args(args: argparse.Namespace, command: str, pattern: str | None = None) -> CollectiveConfig:
    """The CollectiveConfig of a command line: ``--config FILE``'s collective part overridden
    by the flags ``lowering.knobs.add_flags(parser, CollectiveConfig)`` added and the command
    line gave; validated (with ``pattern``: also the knobs that do nothing for it). Errors
    name the file or ``command``, the field and its flag (AmkError, exit code 2)."""
    path = getattr(args, "config", None)
    part = collective_part(_read_json(path), str(path)) if path else {}
    CollectiveConfig.from_json(part, str(path) if path else command, combinations=False)
    flags = given(args, CollectiveConfig)
    for name, v in flags.items():
        why = knob_named(CollectiveConfig, name).problem(v)
        if why:
            raise AmkError(f"{command}: {knob_named(CollectiveConfig, name).flag}: {why}")
    part.update(flags)
    source = (f"{command} --config {path}" if flags else str(path)) if path else command
    return CollectiveConfig.from_json(part, source, pattern)


def model_inert(qk_norm: bool, lowering: dict[str, Any]) -> list[tuple[str, str]]:
    """(knob, why) of the lowering knobs in ``lowering`` (a LoweringConfig's JSON) that do
    nothing for a model whose attention has a q/k norm (``qk_norm``, Qwen3): ``late_append``,
    because the fused attention does not take the norm and the lowering keeps the unfused
    attention there. Empty when every knob acts."""
    if qk_norm and lowering.get("late_append"):
        return [("late_append", "its attention has a q/k norm, which the fused attention does not take")]
    return []


def _read_json(path: str | Path) -> Any:
    """A JSON file's value. Raises AmkError for a missing file or bad JSON (with line:column)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise AmkError(f"{p}: cannot read config file: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise AmkError(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None


def split_parts(obj: Any, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(lowering fields, kernel fields) of a config file's JSON value: ``{"lowering": {...},
    "kernel": {...}}`` (either part optional; a ``"collective"`` part is CollectiveConfig's and
    left out here), or a flat object of lowering fields (the older form). Raises AmkError for
    anything else."""
    if not isinstance(obj, dict):
        raise AmkError(f"{source}: expected a JSON object {{\"lowering\": {{...}}, \"kernel\": {{...}}}}, "
                       f"got {type(obj).__name__}")
    if obj and set(obj) <= PARTS:
        parts = []
        for name in ("lowering", "kernel"):
            part = obj.get(name, {})
            if not isinstance(part, dict):
                raise AmkError(f"{source}: \"{name}\" must be a JSON object of {name} knobs, got "
                               f"{type(part).__name__}")
            parts.append(dict(part))
        return parts[0], parts[1]
    return dict(obj), {}


@dataclass(frozen=True)
class AmkConfig:
    """Both knob sets: ``lowering`` (LoweringConfig) and ``kernel`` (KernelConfig); the JSON
    form is ``{"lowering": {...}, "kernel": {...}}``."""

    lowering: LoweringConfig = field(default_factory=LoweringConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)

    def validate(self, source: str = "config", ranks: int | None = None,
                 combinations: bool = True) -> "AmkConfig":
        """Return self, or raise AmkError naming the bad field or the combination that does
        nothing (see the parts' ``validate``)."""
        self.lowering.validate(source, ranks, combinations)
        self.kernel.validate(source, ranks, combinations)
        return self

    def to_json(self) -> dict[str, Any]:
        return {"lowering": self.lowering.to_json(), "kernel": self.kernel.to_json()}

    @classmethod
    def from_json(cls, obj: Any, source: str = "config", ranks: int | None = None,
                  combinations: bool = True) -> "AmkConfig":
        """Build from a config file's JSON value (see ``split_parts``) and validate."""
        low, ker = split_parts(obj, source)
        return cls(LoweringConfig.from_json(low, source, ranks, combinations),
                   KernelConfig.from_json(ker, source, ranks, combinations))

    @classmethod
    def from_file(cls, path: str | Path, ranks: int | None = None, combinations: bool = True) -> "AmkConfig":
        """Read a config file. Raises AmkError for a missing file, bad JSON (line:column), an
        unknown field, a bad value or (``combinations``) a knob that does nothing."""
        return cls.from_json(_read_json(path), str(path), ranks, combinations)


def file_fields(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """(lowering fields, kernel fields) of ``--config FILE`` as written (empty without one)."""
    path = getattr(args, "config", None)
    if not path:
        return {}, {}
    return split_parts(_read_json(path), str(path))


def config_from_args(args: argparse.Namespace, command: str, ranks: int | None = None,
                     defaults: dict[str, Any] | None = None, combinations: bool = True,
                     base: dict[str, Any] | None = None) -> AmkConfig:
    """The AmkConfig of a command line: ``--config FILE`` (``args.config``), overridden by the
    knob flags in ``args`` (lowering.knobs.add_flags: present only when given), with
    ``defaults`` (a command's own lowering defaults, e.g. ``amk bench``'s one worker per SM)
    for lowering fields that neither sets. ``base``: an AmkConfig JSON that stands in for the
    file when there is no ``--config`` (the tuned or heuristic config, search/defaults.py); a
    knob of it that the flags leave without effect is set back (``--fuse 0`` over a base with
    late_append). Validated at ``ranks`` ranks; errors name the file or ``command``, the field
    and its flag (AmkError, exit code 2)."""
    low, ker = file_fields(args)
    path = getattr(args, "config", None)
    src_file = str(path) if path else None
    from_base: tuple[set, set] = (set(), set())
    if base is not None and not src_file:
        low, ker = split_parts(base, f"{command}: base config")
        from_base = (set(low), set(ker))
    # each part as the file has it, checked on its own first: a file's mistake names the file
    LoweringConfig.from_json(low, src_file or command, combinations=False)
    KernelConfig.from_json(ker, src_file or command, combinations=False)
    flags_low, flags_ker = given(args, LoweringConfig), given(args, KernelConfig)
    for cls, vals in ((LoweringConfig, flags_low), (KernelConfig, flags_ker)):
        for name, v in vals.items():
            why = knob_named(cls, name).problem(v)
            if why:
                raise AmkError(f"{command}: {knob_named(cls, name).flag}: {why}")
    for k, v in (defaults or {}).items():
        low.setdefault(k, v)
    low.update(flags_low)
    ker.update(flags_ker)
    if base is not None and not src_file:
        low, ker = _settle_base(low, ker, (from_base[0] - set(flags_low), from_base[1] - set(flags_ker)), ranks)
    source = (f"{command} --config {src_file}" if (flags_low or flags_ker) else src_file) if src_file \
        else command
    return AmkConfig(LoweringConfig.from_json(low, source, ranks, combinations),
                     KernelConfig.from_json(ker, source, ranks, combinations))


def _settle_base(low: dict[str, Any], ker: dict[str, Any], from_base: tuple[set, set],
                 ranks: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Set back the knobs a base config set (``from_base``: its lowering and kernel field
    names) that do nothing next to the flags; the flags' own inert knobs and the defaults'
    stay, for validate to refuse as without a base."""
    from lowering.knobs import inert

    for cls, part, names in ((LoweringConfig, low, from_base[0]), (KernelConfig, ker, from_base[1])):
        for _ in range(len(knobs_of(cls)) + 1):
            try:
                obj = cls(**part)
            except TypeError:
                break  # an unknown field: from_json names it
            reset = {k.name: False if k.kind is bool else k.default
                     for k, _ in inert(obj, ranks) if k.name in names and part.get(k.name) != k.default}
            if not reset:
                break
            part.update(reset)
    return low, ker


def sets(args: argparse.Namespace, name: str) -> bool:
    """Whether ``--config FILE`` or a flag in ``args`` sets the knob ``name`` explicitly."""
    if getattr(args, name, None) is not None:
        return True
    low, ker = file_fields(args)
    return name in low or name in ker


__all__ = ["ALLREDUCE_ALGOS", "AmkConfig", "COLLECTIVE_ALLREDUCE", "CollectiveConfig", "DTYPES", "WEIGHT_FORMATS",
           "KernelConfig", "LoweringConfig", "POLICIES", "collective_from_args", "collective_part",
           "config_from_args", "file_fields", "knobs_of", "sets", "split_parts", "weight_knobs"]
