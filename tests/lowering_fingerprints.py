"""Fingerprints of the lowered programs of a fixed set of models and configs.

A refactor of the lowering, the IR or the models must leave every lowered program
byte-identical: ``python tests/lowering_fingerprints.py --write`` records the SHA-256 of each
program's text form in ``tests/data/lowering_fingerprints.json``, and
``tests/test_lowering_fingerprints.py`` recomputes and compares them. Models are built from
shapes alone (the meta device), so the Llama-3.2-1B shape costs no weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "lowering_fingerprints.json"

#: (model, tp, config fields): tiny Llama / Qwen2 / Qwen3, the SmolLM2 and Llama-3.2-1B shapes,
#: tp 1-3, each knob family on and off.
CASES: list[tuple[str, int, dict]] = [
    ("config:tiny-llama", 1, {}),
    ("config:tiny-llama", 2, {"fuse": True}),
    ("config:tiny-llama", 3, {"policy": "balanced", "tile": 16}),
    ("config:tiny-qwen2", 1, {"fuse": True, "wave": True}),
    ("config:tiny-qwen2", 2, {"allreduce": "twoshot", "tile": 16}),
    ("config:tiny-qwen3", 1, {"fuse": True, "attn_split": 2, "late_append": True}),
    ("config:tiny-qwen3", 2, {"fuse": True, "allreduce": "fused", "fuse_reduce": True}),
    ("config:smollm2-135m", 1, {"fuse": True, "tile": 32, "policy": "stage"}),
    ("config:smollm2-135m", 2, {"fuse": True, "tile": 32, "tile_qkv": 24, "tile_gate_up": 64}),
    ("config:smollm2-135m", 3, {"tile": 64, "policy": "round_robin"}),
    ("config:llama-3.2-1b", 1, {"fuse": True, "tile": 16, "policy": "stage", "attn_split": 4, "tile_qkv": 24,
                                "tile_gate_up": 64, "tile_lm_head": 256, "late_append": True, "workers": 132}),
    ("config:llama-3.2-1b", 2, {"fuse": True, "tile": 32, "allreduce": "oneshot", "workers": 132}),
]


def case_key(model: str, tp: int, cfg: dict) -> str:
    """A stable name of one case."""
    return f"{model} tp{tp} " + ",".join(f"{k}={v}" for k, v in sorted(cfg.items()))


def fingerprint(model: str, tp: int, cfg: dict) -> str:
    """SHA-256 of the text form of the program lowered for ``model`` at ``tp`` ranks."""
    from amk import pipeline
    from ir.text import format_program
    from lowering.config import LoweringConfig

    s = pipeline.Compilation.build(model, tp, LoweringConfig(**cfg).validate(), validate=False, weights=False)
    return hashlib.sha256(format_program(s.program).encode()).hexdigest()


def compute() -> dict[str, str]:
    """Every case's fingerprint."""
    return {case_key(m, tp, c): fingerprint(m, tp, c) for m, tp, c in CASES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"record the fingerprints in {DATA}")
    a = ap.parse_args(argv)
    got = compute()
    if a.write:
        from ground.files import atomic_write_text

        atomic_write_text(DATA, json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got)} fingerprints to {DATA}")
        return 0
    want = json.loads(DATA.read_text())
    bad = sorted(k for k in want if got.get(k) != want[k])
    for k in bad:
        print(f"changed: {k}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
