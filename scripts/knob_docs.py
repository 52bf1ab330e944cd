"""The knob tables of the docs, made from the knobs' declarations (lowering/config.py).

Usage: python scripts/knob_docs.py [--write]
Each table sits between ``<!-- knobs:CLASS -->`` and ``<!-- /knobs:CLASS -->`` in its doc
(LoweringConfig and CollectiveConfig: docs/lowering.md, KernelConfig: docs/triton.md). Without ``--write``: exit 1
and name each table that differs from the declarations (tests/test_knobs.py runs this check);
with it, rewrite them.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (class name, the doc that holds its table)
TABLES = (("LoweringConfig", "docs/lowering.md"), ("KernelConfig", "docs/triton.md"),
          ("CollectiveConfig", "docs/lowering.md"))


def _block(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- knobs:{name} -->\n)(.*?)(<!-- /knobs:{name} -->)", re.S)


def table(name: str) -> str:
    """The generated table of config class ``name``."""
    from lowering import config
    from lowering.knobs import markdown_table

    return markdown_table(getattr(config, name))


def stale() -> list[str]:
    """The docs whose table differs from the declarations (or that lack its markers)."""
    out = []
    for name, doc in TABLES:
        m = _block(name).search((ROOT / doc).read_text())
        if m is None or m.group(2) != table(name):
            out.append(f"{doc} ({name})")
    return out


def write() -> None:
    """Rewrite every table between its markers."""
    for name, doc in TABLES:
        path = ROOT / doc
        text = path.read_text()
        if _block(name).search(text) is None:
            raise SystemExit(f"{doc}: no <!-- knobs:{name} --> ... <!-- /knobs:{name} --> markers")
        path.write_text(_block(name).sub(lambda m: m.group(1) + table(name) + m.group(3), text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the tables")
    args = ap.parse_args(argv)
    if args.write:
        write()
        return 0
    bad = stale()
    for doc in bad:
        print(f"knob table out of date: {doc}; run python scripts/knob_docs.py --write", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
