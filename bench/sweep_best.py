"""Pick the fastest correct row of megakernel_sweep.py JSON files and write its config file.

Usage: python bench/sweep_best.py SWEEP.json [SWEEP.json ...] --config-out FILE
Writes the row's config (``{"lowering": ..., "kernel": ...}``, as a sweep row records it,
without max_seq, which `amk bench` sizes to its tokens) to ``--config-out`` and prints the
`amk bench` flags that use it on one line: ``--config FILE``. Rows with an error or a wrong
verdict are skipped, and so are rows of sweeps written before their rows held the whole
config; exits 1 (printing why on stderr) when no row is usable, so a device script can stop
there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def best_row(paths: list[str]) -> dict:
    """The correct row with the lowest latency_ms_median over the files, among rows whose
    ``config`` is a whole config (a ``lowering`` and a ``kernel`` part). Raises ValueError
    naming the files when none is usable."""
    rows = []
    for p in paths:
        rows += [r for r in json.loads(Path(p).read_text()).get("rows", [])
                 if "error" not in r and r.get("correct")
                 and set(r.get("config") or {}) == {"lowering", "kernel"}]
    if not rows:
        raise ValueError(f"no correct row with a whole config (lowering and kernel knobs) in {', '.join(paths)}")
    return min(rows, key=lambda r: r["latency_ms_median"])


def config_of(row: dict) -> dict:
    """The config file of ``row``: its config, checked (lowering.config.AmkConfig), without
    max_seq. Raises AmkError for a config the knobs refuse."""
    from lowering.config import AmkConfig

    cfg = AmkConfig.from_json(row["config"], "the sweep row's config", combinations=False).to_json()
    cfg["lowering"].pop("max_seq")
    return cfg


def bench_flags(config_path: str) -> list[str]:
    """`amk bench` flags reproducing a row whose config is in ``config_path``."""
    return ["--config", config_path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--config-out", required=True)
    args = ap.parse_args(argv)
    try:
        row = best_row(args.sweeps)
    except (OSError, ValueError) as e:
        print(f"sweep_best: {e}", file=sys.stderr)
        return 1
    from ground.errors import AmkError
    from ground.files import atomic_write_text  # whole file or none

    try:
        atomic_write_text(args.config_out, json.dumps(config_of(row)) + "\n")
    except AmkError as e:
        print(f"sweep_best: {e}", file=sys.stderr)
        return 2
    print(f"sweep_best: {row['latency_ms_median']:.4f} ms", file=sys.stderr)
    print(" ".join(bench_flags(args.config_out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
