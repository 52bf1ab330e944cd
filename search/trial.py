"""The stages every search trial shares, a model's (search/worker.py) and a communication
pattern's (search/patterns.py): the request's target and test hooks, validation into the
trial's result, the program's summary and the cost model's predicted time."""

from __future__ import annotations

import importlib
import time
from collections import Counter
from typing import Any, Callable


def resolve_hook(name: str | None) -> Any:
    """The object a hook's dotted name ``module:attr`` names (None for no name)."""
    if not name:
        return None
    mod, _, attr = name.partition(":")
    return getattr(importlib.import_module(mod), attr)


def make_target(d: dict[str, Any]) -> Any:
    """The ir.program.Target of a request's ``target`` fields."""
    from ir.program import Target

    return Target(**{k: v for k, v in d.items() if k in ("name", "sms", "max_workers",
                                                         "backend")})


def program_summary(program: Any, seq_len: int) -> dict[str, Any]:
    """Stats, the schedule's fingerprint, per-op task counts, tasks per worker (max/min),
    collective groups and the cost-model estimate."""
    from lowering.costmodel import estimate

    per_worker = Counter((t.rank, t.worker) for t in program.tasks)
    loads = [per_worker.get((r, w), 0) for r in range(program.ranks)
             for w in range(program.workers)]
    est = estimate(program, seq_len=seq_len)
    from search.space import program_fingerprint

    return {**program.stats(), "fingerprint": program_fingerprint(program), "ops": dict(sorted(Counter(t.op for t in program.tasks).items())),
            "tasks_per_worker_max": max(loads, default=0),
            "tasks_per_worker_min": min(loads, default=0),
            "collective_groups": len({t.group for t in program.tasks if t.group}),
            "predicted_latency_ms": est.predicted_latency_s * 1e3,
            "cost_model_roofline_ms": est.roofline_s * 1e3}


def time_sim(program: Any, req: dict[str, Any], predict: Callable[..., float] | None
             ) -> dict[str, Any]:
    """The cost model's prediction (deterministic: no spread)."""
    from lowering.costmodel import estimate

    seq_len = int(req.get("seq_len", 128))
    if predict is not None:
        ms = float(predict(program, seq_len))
    else:
        ms = estimate(program, seq_len=seq_len).predicted_latency_s * 1e3
    return {"source": "predicted", "median_ms": ms, "spread_ms": 0.0, "incumbent_ms": None}


def validate_stage(program: Any, backend: str, res: dict[str, Any], times: dict[str, float]) -> bool:
    """Validate ``program`` for ``backend`` (validator.validate) into a trial's result ``res``:
    ``verdict`` (ok, classes, the first errors) and ``times["validate_s"]``; a rejected program
    also sets ``status`` rejected, the ``reason`` and one witness per error class (the cycle
    of a deadlock, the racing pair, ...). Returns whether the program was accepted."""
    from validator import validate

    t = time.perf_counter()
    verdict = validate(program, backend=backend)
    times["validate_s"] = time.perf_counter() - t
    res["verdict"] = {"ok": verdict.ok, "classes": sorted(verdict.classes),
                      "errors": [f.to_json() for f in verdict.errors[:5]],
                      "n_errors": len(verdict.errors)}
    if verdict.ok:
        return True
    first = verdict.errors[0]
    res.update(status="rejected", reason=f"validator: {', '.join(sorted(verdict.classes))}"
               f" ({len(verdict.errors)} errors; first: {first.message})"[:400])
    res["verdict"]["witnesses"] = {e["class"]: {"message": e["message"][:400],
                                                "tasks": list(e["tasks"])[:20],
                                                "witness": e["witness"]}
                                   for e in reversed([f.to_json() for f in verdict.errors])}
    return False
