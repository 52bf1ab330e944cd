"""Pick the fastest correct row of megakernel_sweep.py JSON files and turn it into `amk bench` flags.

Usage: python bench/sweep_best.py SWEEP.json [SWEEP.json ...] --config-out FILE
Writes the row's lowering knobs (without workers, dtype and max_seq, which `amk bench` sets)
to ``--config-out`` and prints the `amk bench` flags of the row on one line: ``--workers W
--config FILE --num-warps ...``. Rows with an error or a wrong verdict are skipped; exits 1
(printing why on stderr) when no row is usable, so a device script can stop there.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from amk.bench import BLOCKS_FLAGS
from lowering.config import LoweringConfig

# lowering knobs the bench takes from --config (workers / dtype / max_seq: its own flags)
CONFIG_KEYS = tuple(f.name for f in fields(LoweringConfig) if f.name not in ("workers", "dtype", "max_seq"))
# sweep-row keys -> the amk bench flag that sets each (a row records Blocks fields by name)
FLAGS = (("num_warps", "--num-warps"), ("gemv_block", "--gemv-block"), *BLOCKS_FLAGS.items())


def best_row(paths: list[str]) -> dict:
    """The correct row with the lowest latency_ms_median over the files; rows with sync_opt
    off are skipped (`amk bench` always elides waits and coalesces signals). Raises
    ValueError naming the files when none is usable."""
    rows = []
    for p in paths:
        rows += [r for r in json.loads(Path(p).read_text()).get("rows", [])
                 if "error" not in r and r.get("correct") and r.get("sync_opt", True)]
    if not rows:
        raise ValueError(f"no correct row in {', '.join(paths)}")
    return min(rows, key=lambda r: r["latency_ms_median"])


def bench_flags(row: dict, config_path: str) -> list[str]:
    """`amk bench` flags reproducing ``row`` with its lowering knobs in ``config_path``."""
    out = ["--workers", str(row["config"]["workers"]), "--config", config_path]
    for key, flag in FLAGS:
        if key in row:
            out += [flag, str(int(row[key]) if isinstance(row[key], bool) else row[key])]
    return out


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
        atomic_write_text(args.config_out, json.dumps({k: row["config"][k] for k in CONFIG_KEYS
                                                       if k in row["config"]}) + "\n")
    except AmkError as e:
        print(f"sweep_best: {e}", file=sys.stderr)
        return 2
    print(f"sweep_best: {row['latency_ms_median']:.4f} ms", file=sys.stderr)
    print(" ".join(bench_flags(row, args.config_out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
