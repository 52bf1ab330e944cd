"""Argument checks shared by the commands, run before any heavy import or model load.

Two stages, so that a mistake is refused in the time it takes to see it:

* ``check_counts(tp, workers)``: plain range checks of ``--tp`` / ``--workers``; imports
  nothing beyond the standard library (no torch, no transformers), so ``amk compile MODEL
  --tp 0`` exits 2 in well under a second.
* ``check_model_split(model_arg, tp, config)``: reads the model's config only (no weights)
  and checks that ``tp`` ranks can split its query heads, MLP columns, vocabulary rows and
  hidden size as the lowering needs (``lowering.partition.check_split``). Returns notes for
  splits that lower but leave ranks idle in a stage (ranks without query heads).

Every refusal is an ``AmkError`` (exit code 2) with one line naming the flag and the counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ground.errors import AmkError

# The largest tensor-parallel degree a refusal suggests looking at (amk info's TP_MAX).
EVEN_TP_MAX = 8


def check_counts(tp: int | None = None, workers: int | None = None,
                 max_workers: int | None = None, workers_flag: str = "--workers") -> None:
    """Raise AmkError when ``tp`` (ranks) or ``workers`` (per rank) is below 1, or
    ``workers`` exceeds ``max_workers`` (the target's co-residency limit). None: not given."""
    if tp is not None and tp < 1:
        raise AmkError(f"--tp must be >= 1, got {tp}")
    if workers is not None:
        if workers < 1:
            raise AmkError(f"{workers_flag} must be >= 1, got {workers}")
        if max_workers is not None and workers > max_workers:
            raise AmkError(f"{workers_flag} {workers} exceeds the target's limit of "
                           f"{max_workers} co-resident workers per rank")


@dataclass
class ModelSplit:
    """What ``check_model_split`` found: the model's source (``models.sources.ModelSource``),
    its ``ModelSpec`` and notes about the split (one line each, for stderr)."""

    source: Any
    spec: Any
    notes: list[str] = field(default_factory=list)


def model_spec(model_arg: str):
    """(source, ModelSpec) of a MODEL argument from its config alone (no weights read).
    Raises AmkError for a bad argument or an unsupported model."""
    from models.graph import spec_from_config
    from models.sources import load_config, parse_model_arg

    source = parse_model_arg(model_arg)
    return source, spec_from_config(load_config(source))


def check_split(spec: Any, name: str, tp: int, tile: int = 64,
                allreduce: str = "oneshot") -> list[str]:
    """Check that ``tp`` ranks can split a model of shapes ``spec`` (a ModelSpec) with the
    lowering's ``tile`` and all-reduce algorithm; returns notes. Raises AmkError naming the
    model's counts, why the split fails, and the largest ``--tp`` that works."""
    from lowering.partition import check_split as split_check, max_ranks
    from models.features import tp_degrees

    counts = (spec.heads, spec.kv_heads, spec.intermediate, spec.vocab, spec.hidden)
    try:
        return split_check(*counts, tp, tile, allreduce)
    except ValueError as err:
        best = max_ranks(*counts, tile, allreduce, limit=tp)
        even = tp_degrees(spec.heads, spec.kv_heads, EVEN_TP_MAX)
        raise AmkError(
            f"--tp {tp}: {name} ({spec.heads} query heads, {spec.kv_heads} KV heads, "
            f"{spec.intermediate} MLP columns, {spec.vocab} vocabulary rows, hidden "
            f"{spec.hidden}) cannot be split over {tp} ranks: {err}; the most it splits over "
            f"is --tp {best} (even head splits: {', '.join(map(str, even))})") from None


def check_model_split(model_arg: str, tp: int, config: Any = None) -> ModelSplit:
    """``check_split`` for a MODEL argument, reading only its config. ``config``: the
    LoweringConfig (its ``tile`` and ``allreduce``; default LoweringConfig()). Raises
    AmkError for a bad argument, an unsupported model, a split that does not fit, or a knob
    that does nothing for this model (``late_append`` where attention has a q/k norm: the
    lowering keeps the unfused attention there)."""
    from lowering.config import LoweringConfig, model_inert

    cfg = config or LoweringConfig()
    source, spec = model_spec(model_arg)
    for name, why in model_inert(spec.qk_norm, cfg.to_json()):
        flag = "--" + name.replace("_", "-")
        raise AmkError(f"{flag} 1 does nothing for {model_arg}: {why} (set {flag} 0)")
    notes = check_split(spec, model_arg, tp, cfg.tile, cfg.allreduce)
    return ModelSplit(source, spec, notes)
