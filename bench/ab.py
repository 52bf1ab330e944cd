"""Interleaved A/B of two command lines that each write an `amk bench` result file.

Usage (on a GPU machine, from the repository root):
    python bench/ab.py --a "CMD_A" --b "CMD_B" [--runs 2] [--label-a A] [--label-b B] --out FILE

Each command is a shell line holding ``{out}``, the path of the result JSON it must write
(``amk bench ... --out {out}``; an older tree's ``--json {out}``). The runs alternate
A, B, A, B, ... so that clock and thermal drift fall on both sides alike. The table gives
every run's ms/token, correctness and % of roofline (each run's own bandwidth measurement),
then per side the fastest run and the spread between its runs (the noise), and the ratio
of the fastest runs. The JSON holds the same and each run's command.

"Within noise" (printed as the verdict): the fastest runs differ by no more than the larger
of the two sides' spreads, or by at most 1% where both spreads are smaller.

Typical use: the same measurement from two source trees (``git archive OLD | tar -x -C
.before`` beside the working tree; A runs ``cd .before && PYTHONPATH=$PWD python -m amk ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/ab.py` from a source checkout
    sys.path.insert(0, str(ROOT))

from ground.files import atomic_write_json  # noqa: E402

NOISE_FLOOR = 0.01  # relative difference always called noise (run-to-run spread seen on H100/H200)


def run_once(cmd: str, out: Path, timeout_s: float) -> dict:
    """Run one shell command that writes an `amk bench` result to ``out``; return its row.

    The row: ``ms`` (latency_ms_median), ``correct``, ``roofline_pct``, ``wall_s``, ``rc``,
    ``error`` (the output's last lines when the command failed or wrote no file)."""
    line = cmd.replace("{out}", str(out))
    t0 = time.perf_counter()
    try:
        p = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=timeout_s)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        rc, tail = 124, f"timed out after {timeout_s:.0f} s"
    row = {"command": line, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    try:
        res = json.loads(out.read_text())
    except (OSError, ValueError):
        row["error"] = tail
        return row
    row.update(ms=res.get("latency_ms_median"), correct=res.get("correct"),
               roofline_pct=res.get("roofline_pct"), device=res.get("device"))
    if rc:
        row["error"] = tail
    return row


def summarise(rows: list[dict]) -> dict:
    """Fastest ms and relative spread ((max - min) / min) of one side's successful runs."""
    ms = [r["ms"] for r in rows if isinstance(r.get("ms"), (int, float))]
    if not ms:
        return {"n_runs": len(rows), "ok": 0}
    return {"n_runs": len(rows), "ok": len(ms), "fastest_ms": min(ms),
            "spread": (max(ms) - min(ms)) / min(ms),
            "all_correct": all(r.get("correct") is True for r in rows)}


def verdict(a: dict, b: dict) -> tuple[float | None, str]:
    """Ratio fastest(A) / fastest(B) and 'within noise' / 'A faster' / 'B faster'."""
    if not a.get("ok") or not b.get("ok"):
        return None, "incomplete"
    ratio = a["fastest_ms"] / b["fastest_ms"]
    noise = max(a["spread"], b["spread"], NOISE_FLOOR)
    if abs(ratio - 1.0) <= noise:
        return ratio, "within noise"
    return ratio, "B faster" if ratio > 1.0 else "A faster"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="command A (shell line with {out})")
    ap.add_argument("--b", required=True, help="command B (shell line with {out})")
    ap.add_argument("--label-a", default="A")
    ap.add_argument("--label-b", default="B")
    ap.add_argument("--runs", type=int, default=2, help="runs per side (default 2)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--out", required=True, help="result JSON")
    args = ap.parse_args(argv)
    for name in ("a", "b"):
        if "{out}" not in getattr(args, name):
            print(f"bench/ab.py: --{name} has no {{out}}: the command must write its result there",
                  file=sys.stderr)
            return 2
    if args.runs < 1:
        print("bench/ab.py: --runs must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    work = out.parent / (out.stem + ".runs")
    work.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {"a": [], "b": []}
    for i in range(args.runs):
        for side in ("a", "b"):
            r = run_once(getattr(args, side), work / f"{side}{i}.json", args.timeout)
            rows[side].append(r)
            label = args.label_a if side == "a" else args.label_b
            print(f"[ab] {label} run {i}: {r.get('ms')} ms, correct={r.get('correct')}, "
                  f"rc={r['rc']}, {r['wall_s']} s", file=sys.stderr, flush=True)
    sa, sb = summarise(rows["a"]), summarise(rows["b"])
    ratio, word = verdict(sa, sb)
    print(f"{'side':<10} {'run':>3} {'ms/token':>9} {'correct':>8} {'% roofline':>10}")
    for side, label in (("a", args.label_a), ("b", args.label_b)):
        for i, r in enumerate(rows[side]):
            ms = f"{r['ms']:.4f}" if isinstance(r.get("ms"), (int, float)) else "-"
            pct = f"{r['roofline_pct']:.1f}" if isinstance(r.get("roofline_pct"), (int, float)) else "-"
            print(f"{label:<10} {i:>3} {ms:>9} {str(r.get('correct')):>8} {pct:>10}")
    for label, s in ((args.label_a, sa), (args.label_b, sb)):
        if s.get("ok"):
            print(f"{label}: fastest {s['fastest_ms']:.4f} ms, spread {100 * s['spread']:.2f}%")
    print(f"A/B = {ratio:.4f}: {word}" if ratio else f"verdict: {word}")
    atomic_write_json(out, {"a": {"label": args.label_a, "runs": rows["a"], **sa},
                            "b": {"label": args.label_b, "runs": rows["b"], **sb},
                            "ratio_a_over_b": ratio, "verdict": word,
                            "noise_floor": NOISE_FLOOR, "host": os.uname().nodename})
    return 0 if word != "incomplete" else 1


if __name__ == "__main__":
    sys.exit(main())
