"""The config a command runs when no ``--config`` names one: the tuned entry of the model's
shape on this GPU at this tp (search/tunedb.py), else a cost-model heuristic.

``heuristic_config`` derives a config from the shape, the GPU's SM count and tp with rules
fitted to the measured best configs (H100 / H200, docs/experiments.md, docs/benchmarks.md,
bench/configs/*.json), not from a table of known models:

* workers: one per SM (every measured config ran 132 workers on 132 SMs).
* weight stream: TMA copies in 32 x 256 boxes, 6 stages, tile 32, no task-ahead prefetch when a
  rank's bf16 weights are large (``TMA_MIN_BYTES``): Llama-3.1-8B on one H200 6.24 -> 5.28 ms,
  tp 2 3.82 -> 3.42, tp 4 2.90 -> 2.74 (16, 8 and 4 GB per rank; ``tma*_tp1.json``). Otherwise
  the register path: 16-row tiles, 16 x K blocks (K the largest power of two <= 128 dividing
  the hidden size: Llama-3.2-1B 16x128, SmolLM2 16x64), unrolled 8 times, w_preload 8 x K,
  prefetch 1, roll 1 (``llama-3.2-1b-late.json``, ``smollm2-135m-late.json``).
* stage tiles: the q/k/v and gate/up stages get tiles that make one wave of tasks over the
  workers, or two when one wave's tile would exceed ``QKV_MAX_ROWS`` / ``GATE_UP_MAX_ROWS``
  rows (rounded up to a multiple of 4): Llama-3.2-1B 24 / 64, Llama-3.1-8B tp 1 24 / 56 (two
  waves; 24 vs 32 and 56 vs 64 within noise, ``tma2_tp1.json``), tp 2 24 / 56, tp 4 12 / 28.
  LM-head tiles move ``LM_HEAD_TASK_BYTES`` each (1B: 256 rows of 2048, 8B: 128 of 4096;
  8016 LM-head tasks -> 1002 took 1.665 -> 1.431 ms with the capped prefetch).
* wave: when one wave of LM-head tiles fits that byte budget (a small model: SmolLM2's 384
  rows of 576) every stage is sized to one wave (``wave``, policy balanced: SmolLM2 1.209 ->
  1.119 ms); for larger vocabularies wave made 976-row LM-head tiles and was slower
  (Llama-3.2-1B), so the tiles above and policy stage.
* fuse on; late_append where attention has no q/k norm (1B 1.209 -> 1.188 ms, SmolLM2 0.900
  -> 0.843); attn_split = the GQA group (one task per query head: SmolLM2 1.70 -> 1.49 ms,
  1B 2.49 -> 2.34 at 128 tokens).
* tp > 1: fuse_reduce (tp 2 3.933 -> 3.815 ms) and tile_reduce 256 (4.33 -> 4.21 ms); the
  fused all-reduce at tp 2 (4.137 -> 4.048 ms) but one-shot above (tp 4 fused was 10% slower
  before lean_release and the tp 4 best, ``llama-3.1-8b-tp4-fr.json``, is one-shot).
* prefetch_cap 65536 on the register path outside wave mode (1B, with tile_gate_up and roll).
* attn_kv_split left at 1: split-KV attention is 3-5% slower at the 128-token context the
  rules are fitted to and 1.35x faster at 1024 positions (H100, 1B; docs/experiments.md).

The tile is lowered until the MLP columns and vocabulary split over tp ranks at it
(lowering.partition.check_split), so the config lowers wherever the model splits.
"""

from __future__ import annotations

from typing import Any

from search.tunedb import GpuKey, ShapeKey, TuneDB, kernel_fingerprint

#: SMs assumed without a GPU (H100 / H200: 132).
DEFAULT_SMS = 132
#: Per-rank weight bytes from which the TMA weight stream is used (measured faster at 4, 8 and
#: 16 GB per rank on Llama-3.1-8B; the register path measured at <= 2.5 GB, Llama-3.2-1B).
TMA_MIN_BYTES = 3 << 30
#: Largest q/k/v tile before the stage is split into two waves (8B tp 1: 48 -> 2 x 24).
QKV_MAX_ROWS = 32
#: Largest gate/up tile before two waves (1B: 64 in one wave; 8B tp 1: 112 -> 2 x 56).
GATE_UP_MAX_ROWS = 64
#: Bytes of W per LM-head task (1B: 256 x 2048 x 2; 8B: 128 x 4096 x 2).
LM_HEAD_TASK_BYTES = 1 << 20
#: Columns per all-reduce reduce tile at tp > 1 (8B hidden 4096: 16 reduce tasks).
TILE_REDUCE = 256


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, m: int) -> int:
    return _ceil(a, m) * m


def _wave_tile(rows: int, workers: int, max_rows: int) -> int:
    """Tile rows for a stage of ``rows`` rows: one wave of tasks over ``workers``, or the
    fewest waves that keep a tile within ``max_rows``; a multiple of 4."""
    waves = 1
    while True:
        t = _round_up(max(1, _ceil(rows, workers * waves)), 4)
        if t <= max_rows or t <= 4:
            return t
        waves += 1


def rank_weight_bytes(shape: ShapeKey, tp: int) -> int:
    """GEMV weight bytes one of ``tp`` ranks streams per decode step (q/k/v, o, gate/up,
    down over the layers and the LM head, split evenly)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * shape.intermediate
    elems = shape.layers * per_layer + shape.vocab * shape.hidden
    return elems * (2 if shape.dtype == "bf16" else 4) // tp


def _split_tile(shape: ShapeKey, tp: int, tile: int, allreduce: str) -> int:
    """The largest power-of-two tile <= ``tile`` at which the model splits over ``tp`` ranks
    (``tile`` itself when none does: the command's split check then names the problem)."""
    from lowering.partition import check_split

    t = tile
    while t >= 1:
        try:
            check_split(shape.heads, shape.kv_heads, shape.intermediate, shape.vocab, shape.hidden, tp, t,
                        allreduce)
            return t
        except ValueError:
            t //= 2
    return tile


def heuristic_config(shape: ShapeKey, gpu: GpuKey | None, tp: int, qk_norm: bool = False) -> dict:
    """An AmkConfig JSON (``{"lowering": {...}, "kernel": {...}}``) for a model of shapes
    ``shape`` on ``gpu`` (None: DEFAULT_SMS SMs) at ``tp`` ranks, by the module's rules.
    ``qk_norm``: the model's attention has a q/k norm (no late_append). Holds the knobs the
    rules set (others at their defaults; max_seq left to the command) and passes
    ``AmkConfig.from_json(...).validate(ranks=tp)``."""
    sms = gpu.sms if gpu is not None else DEFAULT_SMS
    workers = sms
    bpe = 2 if shape.dtype == "bf16" else 4
    tma = shape.dtype == "bf16" and rank_weight_bytes(shape, tp) >= TMA_MIN_BYTES
    allreduce = "fused" if tp == 2 else "oneshot"
    tile = _split_tile(shape, tp, 32 if tma else 16, allreduce)

    q_heads = _ceil(shape.heads, tp)
    kv_heads = _ceil(shape.kv_heads, tp)
    qkv_rows = (q_heads + 2 * kv_heads) * shape.head_dim
    mlp_rows = _ceil(shape.intermediate, tp)
    vocab_rows = _ceil(shape.vocab, tp)
    lm_budget = max(tile, LM_HEAD_TASK_BYTES // (shape.hidden * bpe) // tile * tile)
    lm_one_wave = _round_up(_ceil(vocab_rows, workers), tile)
    gate_up_wave = _round_up(_ceil(2 * mlp_rows, workers), tile)
    wave = not tma and lm_one_wave <= lm_budget and gate_up_wave <= GATE_UP_MAX_ROWS

    low: dict[str, Any] = {"tile": tile, "workers": workers, "dtype": shape.dtype, "fuse": True,
                           "attn_split": max(1, shape.heads // shape.kv_heads),
                           "late_append": not qk_norm}
    if wave:
        low.update(policy="balanced", wave=True)
    else:
        low.update(policy="stage", tile_qkv=_wave_tile(qkv_rows, workers, QKV_MAX_ROWS),
                   tile_gate_up=_wave_tile(mlp_rows, workers, GATE_UP_MAX_ROWS),
                   tile_lm_head=min(lm_budget, lm_one_wave))
    if tp > 1:
        low.update(allreduce=allreduce, fuse_reduce=True, tile_reduce=min(TILE_REDUCE, shape.hidden))

    if tma:
        ker: dict[str, Any] = {"num_warps": 8, "gemv_block": "32x256", "gemv_stages": 6, "gemv_tma": True}
    else:
        k = 128
        while k > 1 and shape.hidden % k:
            k //= 2
        ker = {"num_warps": 8, "gemv_block": f"16x{k}", "gemv_unroll": 8, "prefetch": 1,
               "w_preload": 8 * k, "roll": 1}
        if not wave:
            ker["prefetch_cap"] = 65536
    return {"lowering": low, "kernel": ker}


def heuristic_line(shape: ShapeKey, gpu: GpuKey | None, tp: int) -> str:
    where = gpu.describe() if gpu is not None else f"an unknown GPU ({DEFAULT_SMS} SMs assumed)"
    return (f"config: cost-model heuristic (no tuned entry for {shape.describe()} on {where} tp {tp}; "
            "`amk tune` finds one)")


def resolve_config(spec: Any, dtype: str, tp: int, gpu: GpuKey | None, db: TuneDB) -> tuple[dict, str]:
    """The base config of a run of model ``spec`` (a ModelSpec) in ``dtype`` at ``tp`` ranks on
    ``gpu``: the tuned entry of ``db.lookup`` (its config, and the line ``config: tuned entry
    for <shape> on <GPU> tp R: X ms/token, Y x the fastest baseline, <date> (<file>)``), else
    ``heuristic_config`` (and ``config: cost-model heuristic (no tuned entry for ...; `amk tune`
    finds one)``). The config's lowering dtype is ``dtype``; late_append is off for a model
    with a q/k norm (where it does nothing). AmkError for an unreadable entry file."""
    shape = ShapeKey.from_spec(spec, dtype)
    entry = db.lookup(shape, gpu, tp)
    if entry is None:
        return heuristic_config(shape, gpu, tp, qk_norm=bool(spec.qk_norm)), heuristic_line(shape, gpu, tp)
    from lowering.config import split_parts

    low, ker = split_parts(entry.config, f"{entry.path}: field 'config'")
    cfg = {"lowering": low, "kernel": ker}
    cfg["lowering"]["dtype"] = dtype
    if spec.qk_norm:
        cfg["lowering"]["late_append"] = False
    line = (f"config: tuned entry for {shape.describe()} on {entry.gpu.describe()} tp {tp}: "
            f"{entry.describe()} ({entry.path})")
    return cfg, line


__all__ = ["DEFAULT_SMS", "heuristic_config", "heuristic_line", "rank_weight_bytes", "resolve_config",
           "kernel_fingerprint"]
