"""LoweringConfig: the knobs the lowering honours (the search surface), with JSON I/O.

Every knob changes the lowered program (tests/test_lowering.py checks that); a knob the
lowering ignored would not exist here.

============  =========================================================================
knob          meaning
============  =========================================================================
tile          rows per GEMV tile (q/k/v, o, gate/up, down, lm_head) and columns per
              all-reduce reduce tile (unless ``tile_reduce``); also the alignment of the
              MLP-column and vocabulary splits over ranks
workers       persistent workers (CTAs) per rank
policy        tile -> worker assignment: ``round_robin`` (tile i of a stage -> worker
              i mod W), ``balanced`` (greedy: the worker with the fewest bytes moved so
              far gets the next tile) or ``stage`` (greedy per stage: the worker with the
              fewest bytes in the tile's stage, i.e. among the work waiting on the same
              values, then the fewest so far; ``balanced`` lets the whole step's totals
              pile a stage's tiles up: Llama-3.2-1B layer 8's 130 q/k/v tiles landed two on
              12 workers and none on 14)
allreduce     cross-rank reduction algorithm: ``oneshot`` (every rank puts its partial
              into every peer's receive buffer, then reduces locally), ``fused`` (one-shot
              with the puts fused into the GEMV tiles: each tile stores its rows of the
              partial into its own and every peer's receive buffer, mirror outputs of
              ir/ops.py, and signals each peer; no put stage, the reduce waits on the
              tiles) or ``twoshot`` (reduce-scatter: each rank reduces one column block,
              then all-gathers it)
max_seq       KV-cache length in tokens (positions 0 .. max_seq-1 can be decoded)
dtype         dtype of weights, activations and KV cache: ``f32`` or ``bf16``
fuse          emit fused ops (ir/ops.py): RMSNorm into the following GEMVs
              (``norm_gemv``), RoPE into KV append / attention (``rope_append``,
              ``rope_attention``), SiLU*mul into the down GEMV (``swiglu_gemv``) and, at one
              rank, the residual add into the o / down GEMVs (``gemv_res`` / swiglu_gemv's
              ``r``). Fewer stages and tasks; same results (see lowering/reference.py for
              the exact rounding). Default off.
wave          size each GEMV stage's tiles to fill one wave of workers: a stage of n rows
              (q+k+v together, a gate/up tile pair, o, down, the LM head) gets tiles of
              ``ceil(n / workers)`` rows rounded up to a multiple of ``tile`` (``tile`` is
              then the granularity). Fewer, larger tasks: each worker streams one tile per
              stage instead of paying the per-task cost several times. With ``fuse`` the
              gate and up tiles are separate tasks on separate workers, sized over gate+up
              together (2 x the MLP width). Default off.
tile_qkv      rows per q/k/v tile (0, the default: ``tile``): q, k and v together are a
              narrow stage (Llama-3.2-1B: 3072 rows, 192 16-row tiles, two rounds over 132
              workers, the second 45% full); a tile that fits the stage in one round (24
              rows: 130 tiles) trades a second task for a longer first one
tile_gate_up  rows per gate/up tile (0, the default: ``tile``): the MLP's input stage streams
              the most bytes of a layer, so larger tiles there cut the per-task cost where the
              stage has rounds to spare, while the narrower stages keep ``tile``
tile_lm_head  rows per LM-head tile (0, the default: ``tile``); the vocabulary split over
              ranks stays aligned to ``tile``
attn_split    attention tasks per KV head: the query heads attending with one KV head are
              split into this many contiguous groups, each one task on its own worker
              (capped at the GQA group size; 1 = one task per KV head, the default). The
              decode step's attention is one serial phase whose length grows with the
              context; splitting it over more workers shortens it. With ``fuse``, the
              KV head's ``rope_append`` then signals a counter the attention tasks wait on
              instead of sharing their worker.
tile_reduce   columns per all-reduce reduce tile (0, the default: ``tile``). A reduce
              tile moves a few hundred bytes, so at ``tile`` 16 the reduce of a 4096-wide
              hidden state is 256 tasks, each a wait, a task header and a signal, and the
              next stage waits for all 256 signals (Llama-3.1-8B at tp 2: 7.5 us per
              reduce stage); fewer, wider tiles cut that
late_append   with ``fuse`` (and no q/k norm): attention reads the current token's key and
              value straight from the k / v projections (``rope_attention_kv``, waiting on
              the q/k/v tiles only), and the rank's ``rope_append`` into the caches (one
              task, after the attention tasks) runs on the least-loaded worker behind its
              gate/up tiles, in that worker's slack, instead of between the projections and
              the attention: one hand-off less on the step's critical path. Default off.
fuse_reduce   with ``fuse``, at R > 1 and a one-shot all-reduce (``oneshot`` / ``fused``):
              the GEMV tiles that consume an all-reduce through an RMSNorm (the next
              layer's q/k/v, the gate/up tiles, the LM head) sum the received partials and
              the residual themselves (``reduce_norm_gemv``) and wait on the partials'
              arrival instead of on the reduce stage; the reduce tasks still write the
              residual stream, now off the critical path (its next reader is the next
              all-reduce). One hand-off and a reduce less per all-reduce. No effect at
              R = 1, with ``twoshot`` or without ``fuse``. Default off.
============  =========================================================================
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ground.errors import AmkError

POLICIES = ("round_robin", "balanced", "stage")
ALLREDUCE_ALGOS = ("oneshot", "fused", "twoshot")
DTYPES = ("f32", "bf16")


@dataclass(frozen=True)
class LoweringConfig:
    """Knobs of the lowering (see the module table). Construct with ``LoweringConfig(...)``
    then call ``validate()``, or use ``from_json`` which validates."""

    tile: int = 64
    workers: int = 4
    policy: str = "round_robin"
    allreduce: str = "oneshot"
    max_seq: int = 256
    dtype: str = "f32"
    fuse: bool = False
    wave: bool = False
    attn_split: int = 1
    tile_qkv: int = 0
    tile_gate_up: int = 0
    tile_lm_head: int = 0
    late_append: bool = False
    tile_reduce: int = 0
    fuse_reduce: bool = False

    def validate(self, source: str = "config") -> "LoweringConfig":
        """Return self, or raise AmkError naming the bad field and the allowed values."""
        def bad(field: str, why: str) -> AmkError:
            return AmkError(f"{source}: field {field!r}: {why}")

        for names, low, note in ((("tile", "workers", "max_seq", "attn_split"), 1, ""),
                                 (("tile_qkv", "tile_gate_up", "tile_lm_head", "tile_reduce"), 0,
                                  " (0: the same as tile)")):
            for name in names:
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, int):
                    raise bad(name, f"expected an integer, got {v!r}")
                if v < low:
                    raise bad(name, f"must be >= {low}{note}, got {v}")
        for name in ("fuse", "wave", "late_append", "fuse_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"expected true or false, got {getattr(self, name)!r}")
        if self.workers > 1024:
            raise bad("workers", f"at most 1024 workers per rank, got {self.workers}")
        for name, allowed in (("policy", POLICIES), ("allreduce", ALLREDUCE_ALGOS),
                              ("dtype", DTYPES)):
            v = getattr(self, name)
            if v not in allowed:
                raise bad(name, f"expected one of {', '.join(allowed)}, got {v!r}")
        return self

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, source: str = "config") -> "LoweringConfig":
        """Build from a dict (missing fields take defaults). Raises AmkError naming an unknown
        or ill-typed field."""
        if not isinstance(obj, dict):
            raise AmkError(f"{source}: expected a JSON object of lowering knobs, "
                           f"got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        for k in obj:
            if k not in known:
                raise AmkError(f"{source}: unknown field {k!r}; known fields: "
                               f"{', '.join(sorted(known))}")
        return cls(**obj).validate(source)

    @classmethod
    def from_file(cls, path: str | Path) -> "LoweringConfig":
        """Read a JSON file. Raises AmkError for a missing file or bad JSON (with line:column)."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise AmkError(f"{p}: cannot read config file: {e.strerror or e}") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise AmkError(f"{p}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        return cls.from_json(obj, source=str(p))

    def replace(self, **changes: Any) -> "LoweringConfig":
        """A copy with ``changes`` applied (None values ignored), validated."""
        d = self.to_json()
        d.update({k: v for k, v in changes.items() if v is not None})
        return LoweringConfig.from_json(d)
