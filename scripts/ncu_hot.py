"""Summarize an Nsight Compute source-page CSV (``ncu -i R --page source --csv --print-source sass``):
the SASS lines with the most warp-stall samples and the stall reasons summed over the kernel.

Usage: python scripts/ncu_hot.py FILE.csv [--top 40]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    with open(a.csv, newline="") as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if "Source" in ln and "," in ln), None)
    if start is None:
        print(f"{a.csv}: no source table found; first lines:\n" + "\n".join(lines[:10]))
        return 1
    rows = list(csv.DictReader(lines[start:]))
    cols = list(rows[0].keys()) if rows else []
    samp = next((c for c in cols if "Warp Stall Sampling (All" in c), None)
    reasons = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != samp]

    def num(v: str) -> float:
        try:
            return float(v.replace(",", ""))
        except (ValueError, AttributeError):
            return 0.0

    if samp is None:
        print("columns:", cols)
        return 1
    total = sum(num(r[samp]) for r in rows) or 1.0
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples; columns with stall data: {len(reasons)}")
    by = Counter()
    for r in rows:
        for c in reasons:
            by[c] += num(r.get(c, "0"))
    for c, v in by.most_common(16):
        print(f"  {c:<60} {v:10.0f}")
    print(f"top {a.top} lines by samples:")
    src = next((c for c in cols if c.strip() == "Source"), cols[1] if len(cols) > 1 else cols[0])
    addr = next((c for c in cols if "Address" in c), None)
    for r in sorted(rows, key=lambda r: -num(r[samp]))[: a.top]:
        top = sorted(((num(r.get(c, "0")), c) for c in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.split('(')[0].strip()}={v:.0f}" for v, c in top if v)
        print(f"{100 * num(r[samp]) / total:5.1f}% {r.get(addr, '') if addr else ''} {r[src][:70]:<70} {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
