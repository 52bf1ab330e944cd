"""bench/sweep_best.py: the fastest correct sweep row becomes `amk bench` flags that parse."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import sweep_best  # noqa: E402


def _row(ms, correct=True, **kw):
    row = {"config": {"tile": 16, "workers": 132, "policy": "balanced", "fuse": True, "wave": False,
                      "attn_split": 4, "tile_qkv": 24, "tile_gate_up": 32, "tile_lm_head": 128,
                      "dtype": "bf16", "max_seq": 256, "allreduce": "oneshot"},
           "num_warps": 8, "gemv_block": "16x128", "gemv_stages": 1, "gemv_unroll": 8, "prefetch": 1,
           "attention_t": 32, "sync_opt": True, "row_prefetch": True,
           "maxnreg": 0, "x_stage": True, "x_reuse": True, "x_chunk": 8192, "w_preload": 1024,
           "prefetch_cap": 65536, "prefetch_rows": 0, "roll": 1,
           "latency_ms_median": ms, "correct": correct}
    row.update(kw)
    return row


def test_best_row_becomes_bench_flags(tmp_path, capsys):
    from amk.cli import build_parser
    from amk.bench import backend_options

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"rows": [_row(1.30, correct=False), _row(1.40), {"error": "x"}]}))
    b.write_text(json.dumps({"rows": [_row(1.35, roll=2), _row(1.10, sync_opt=False)]}))
    cfg = tmp_path / "best.json"
    assert sweep_best.main([str(a), str(b), "--config-out", str(cfg)]) == 0
    flags = capsys.readouterr().out.split()
    assert json.loads(cfg.read_text()) == {"tile": 16, "policy": "balanced", "allreduce": "oneshot", "fuse": True,
                                           "wave": False, "attn_split": 4, "tile_qkv": 24, "tile_gate_up": 32,
                                           "tile_lm_head": 128}
    args = build_parser().parse_args(["bench", "config:llama-3.2-1b", *flags])
    blk = backend_options(args)["blocks"]
    assert args.workers == 132 and args.config == str(cfg)
    assert (blk.roll, blk.w_preload, blk.prefetch_cap, blk.gemv_unroll, blk.gemv_n, blk.gemv_k) == \
        (2, 1024, 65536, 8, 16, 128)


def test_no_usable_row_exits_1(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"rows": [_row(1.0, correct=False), {"error": "boom"}]}))
    assert sweep_best.main([str(a), "--config-out", str(tmp_path / "c.json")]) == 1
    assert "no correct row" in capsys.readouterr().err
