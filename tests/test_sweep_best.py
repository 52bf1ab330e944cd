"""bench/sweep_best.py: the fastest correct sweep row becomes a config file that `amk bench` reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import sweep_best  # noqa: E402


def _row(ms, correct=True, **kernel):
    low = {"tile": 16, "workers": 132, "policy": "balanced", "fuse": True, "wave": False, "attn_split": 4,
           "tile_qkv": 24, "tile_gate_up": 32, "tile_lm_head": 128, "dtype": "bf16", "max_seq": 256,
           "allreduce": "oneshot"}
    ker = {"num_warps": 8, "gemv_block": "16x128", "gemv_unroll": 8, "prefetch": 1, "w_preload": 1024,
           "prefetch_cap": 65536, "roll": 1, **kernel}
    return {"config": {"lowering": low, "kernel": ker}, "latency_ms_median": ms, "correct": correct}


def test_best_row_becomes_a_config_file(tmp_path, capsys):
    from amk.bench import bench_config
    from amk.cli import build_parser

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    old = {"config": {"tile": 16}, "num_warps": 8, "latency_ms_median": 0.5, "correct": True}  # an older row
    a.write_text(json.dumps({"rows": [_row(1.30, correct=False), _row(1.40), {"error": "x"}, old]}))
    b.write_text(json.dumps({"rows": [_row(1.35, roll=2), _row(1.20, elide_waits=False)]}))
    cfg = tmp_path / "best.json"
    assert sweep_best.main([str(a), str(b), "--config-out", str(cfg)]) == 0
    flags = capsys.readouterr().out.split()
    assert flags == ["--config", str(cfg)]
    written = json.loads(cfg.read_text())
    assert "max_seq" not in written["lowering"] and written["kernel"]["elide_waits"] is False
    full = bench_config(build_parser().parse_args(["bench", "config:llama-3.2-1b", *flags]), 114)
    assert (full.lowering.workers, full.lowering.tile_qkv, full.lowering.max_seq) == (132, 24, 256)
    k = full.kernel
    assert (k.roll, k.w_preload, k.prefetch_cap, k.gemv_unroll, k.gemv_block, k.elide_waits) == \
        (1, 1024, 65536, 8, "16x128", False)


def test_no_usable_row_exits_1(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"rows": [_row(1.0, correct=False), {"error": "boom"},
                                      {"config": {"tile": 16}, "latency_ms_median": 1.0, "correct": True}]}))
    assert sweep_best.main([str(a), "--config-out", str(tmp_path / "c.json")]) == 1
    assert "no correct row with a whole config" in capsys.readouterr().err
