"""Summaries of an Nsight Compute source-page CSV, SASS view
(``ncu -i R --page source --csv --print-source sass``; plain or gzip).

    python scripts/ncu_sass.py hot FILE.csv[.gz] [--top 40]
        the stall reasons summed over the kernel and the SASS lines with the most
        warp-stall samples
    python scripts/ncu_sass.py loops FILE.csv[.gz]
        every SASS loop (a backward branch) holding at least 1% of the samples: its size,
        global loads, executions and top stall reasons
"""

from __future__ import annotations

import argparse
import csv
import gzip
import re
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def num(v: str) -> float:
    """A CSV cell as a number (thousands separators allowed); 0 for '-' and the like."""
    try:
        return float(v.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def load(path: str) -> list[dict[str, str]]:
    """The source table's rows (dicts by column name), from the line naming 'Source' on.
    Raises ValueError when the file holds no such table."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if "Source" in ln and "," in ln), None)
    if start is None:
        raise ValueError(f"{path}: no source table found; first lines:\n" + "\n".join(lines[:10]))
    return list(csv.DictReader(lines[start:]))


def hot(rows: list[dict[str, str]], top: int) -> int:
    cols = list(rows[0].keys()) if rows else []
    if SAMPLES not in cols:
        print("columns:", cols)
        return 1
    reasons = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != SAMPLES]
    total = sum(num(r[SAMPLES]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples; columns with stall data: {len(reasons)}")
    by = Counter()
    for r in rows:
        for c in reasons:
            by[c] += num(r.get(c, "0"))
    for c, v in by.most_common(16):
        print(f"  {c:<60} {v:10.0f}")
    print(f"top {top} lines by samples:")
    for r in sorted(rows, key=lambda r: -num(r[SAMPLES]))[:top]:
        best = sorted(((num(r.get(c, "0")), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.split('(')[0].strip()}={v:.0f}" for v, c in best if v)
        print(f"{100 * num(r[SAMPLES]) / total:5.1f}% {r.get('Address', '')} {r['Source'][:70]:<70} {why}")
    return 0


def loops(rows: list[dict[str, str]]) -> int:
    ins = [(int(r["Address"], 16), r["Source"].strip(), num(r[SAMPLES]), num(r["Instructions Executed"]), r)
           for r in rows if r.get("Address", "").startswith("0x")]
    if not ins:
        print("no SASS lines")
        return 1
    base = ins[0][0]
    total = sum(x[2] for x in ins)
    index = {a: k for k, (a, *_) in enumerate(ins)}
    reasons = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    print(f"total samples {total:.0f}")
    for k, (a, text, *_) in enumerate(ins):
        m = re.search(r"BRA\s+(0x[0-9a-f]+)", text)
        if not (m and int(m.group(1), 16) <= a and int(m.group(1), 16) in index):
            continue
        seg = ins[index[int(m.group(1), 16)]:k + 1]
        samples = sum(x[2] for x in seg)
        if samples < 0.01 * total:
            continue
        by = {h: sum(num(x[4][h]) for x in seg) for h in reasons}
        best = sorted(by.items(), key=lambda kv: -kv[1])[:5]
        print(f"loop {seg[0][0] - base:#x}-{seg[-1][0] - base:#x} n={len(seg)} "
              f"ldg={sum(1 for x in seg if 'LDG' in x[1])} samples {100 * samples / total:.1f}% "
              f"exec(max)={max(x[3] for x in seg):.0f} ", ", ".join(f"{h}={v:.0f}" for h, v in best))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("view", choices=["hot", "loops"])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40, help="hot: lines to list")
    a = ap.parse_args(argv)
    try:
        rows = load(a.csv)
    except (OSError, ValueError) as err:
        print(err, file=sys.stderr)
        return 1
    return hot(rows, a.top) if a.view == "hot" else loops(rows)


if __name__ == "__main__":
    sys.exit(main())
