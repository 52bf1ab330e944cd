"""The config a command runs by default: the one place ``amk compile``, ``generate``, ``bench``
and ``search`` decide it (docs/tuning.md).

* ``--config FILE``: the file, flags over it (the tuning database is not read).
* ``--no-tuned``: the knobs' plain defaults (and the command's own), flags over them.
* otherwise: ``search.heuristic.resolve_config`` for the model's shapes, the run's dtype, tp
  and the GPU (``gpu_for``): the tuned entry of the database (``--db DIR``, $AMK_TUNE_DB, the
  user cache, the shipped entries) or the cost-model heuristic; flags override it, the
  command's defaults fill what it leaves out (max_seq always: the command knows its length).

Each returns the AmkConfig and one line saying where it came from (the commands print it to
stderr and put it into their --json result as ``config_source``).
"""

from __future__ import annotations

import argparse
from typing import Any

#: What --no-tuned / --config give as their config_source line.
NO_TUNED = "config: the knobs' defaults (--no-tuned)"


def add_args(p: argparse.ArgumentParser, gpu: bool = False) -> None:
    """``--db DIR`` and ``--no-tuned`` (and, for a command that needs no GPU, ``--gpu
    NAME[:SMS]``: whose tuned entry to take)."""
    p.add_argument("--db", metavar="DIR", default=None,
                   help="user tuning database (default $AMK_TUNE_DB, else $XDG_CACHE_HOME/amk/tuned or "
                        "~/.cache/amk/tuned); without --config the config is its entry for this model, "
                        "GPU and --tp (or a shipped one), else a cost-model heuristic (docs/tuning.md)")
    p.add_argument("--no-tuned", action="store_true",
                   help="no tuned entry or heuristic: the knobs' plain defaults (flags still apply)")
    if gpu:
        p.add_argument("--gpu", metavar="NAME[:SMS]", default=None,
                       help="the GPU whose tuned entry to use, as torch names it (e.g. 'NVIDIA H100 80GB "
                            "HBM3:132'); default the local GPU, if any")


def gpu_for(args: argparse.Namespace, local: bool = True):
    """The GpuKey of a run: ``--gpu NAME[:SMS]`` if given, else (``local``) the local GPU,
    else None. AmkError for a bad --gpu."""
    from search.tunedb import GpuKey

    text = getattr(args, "gpu", None)
    if text:
        return GpuKey.parse(text)
    return GpuKey.local() if local else None


def run_dtype(args: argparse.Namespace, defaults: dict[str, Any] | None) -> str:
    """The lowering dtype of a run with no --config: --dtype, the command's default, else the
    knob's default."""
    from lowering.config import LoweringConfig

    return getattr(args, "dtype", None) or (defaults or {}).get("dtype") or LoweringConfig().dtype


def command_config(args: argparse.Namespace, command: str, spec: Any, tp: int, gpu: Any,
                   defaults: dict[str, Any] | None = None, combinations: bool = True,
                   max_workers: int | None = None):
    """(AmkConfig, source line) of a command line for a model of shapes ``spec`` (ModelSpec;
    None: not known, the defaults) at ``tp`` ranks on ``gpu`` (GpuKey or None). ``defaults``:
    the command's own lowering defaults (as lowering.config.config_from_args);
    ``max_workers``: the target's limit, which the base config's workers (one per SM) are
    capped at. AmkError for a bad flag, config file or database entry."""
    from lowering.config import config_from_args

    path = getattr(args, "config", None)
    if path or getattr(args, "no_tuned", False) or spec is None:
        cfg = config_from_args(args, command, ranks=tp, defaults=defaults, combinations=combinations)
        return cfg, (f"config: {path}" if path else NO_TUNED)
    from search.heuristic import resolve_config
    from search.tunedb import open_db

    base, line = resolve_config(spec, run_dtype(args, defaults), tp, gpu, open_db(getattr(args, "db", None)))
    base["lowering"].pop("max_seq", None)
    if max_workers is not None and base["lowering"].get("workers", 0) > max_workers:
        base["lowering"]["workers"] = max_workers
    cfg = config_from_args(args, command, ranks=tp, defaults=defaults, combinations=combinations, base=base)
    return cfg, line


def snap_to_space(lowering: dict[str, Any], space: Any) -> dict[str, Any]:
    """The point of a search space (search/space.py SearchSpace) nearest a lowering config:
    each searched knob at its value when allowed, else the nearest allowed value (integers by
    |log ratio|; others: the knob's default). Knobs the space does not search are left out."""
    import math

    out = {}
    for k in space.knobs:
        v = lowering.get(k.name, k.default)
        if v in k.values:
            out[k.name] = v
        elif isinstance(v, int) and not isinstance(v, bool) and v > 0:
            ints = [c for c in k.values if isinstance(c, int) and not isinstance(c, bool) and c > 0]
            out[k.name] = min(ints, key=lambda c: abs(math.log(c / v))) if ints else k.default
        else:
            out[k.name] = k.default
    return out


__all__ = ["NO_TUNED", "add_args", "command_config", "gpu_for", "run_dtype", "snap_to_space"]
