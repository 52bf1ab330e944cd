"""Every command's default config: the tuned entry for the model, GPU and tp, else the
cost-model heuristic (search/defaults.py); --config replaces it, flags override it,
--no-tuned gives the knobs' plain defaults. Runs ``amk compile`` in a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from search import tunedb
from search.tunedb import Entry, GpuKey, ShapeKey, kernel_fingerprint

ROOT = Path(__file__).resolve().parents[1]
GPU = GpuKey("NVIDIA H100 80GB HBM3", 132)


def amk(*argv: str, env_extra: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if k != "AMK_TUNE_DB"}  # not this machine's database
    env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env_extra or {})})
    return subprocess.run([sys.executable, "-m", "amk", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def tiny_shape(dtype: str = "f32") -> ShapeKey:
    from amk.checks import model_spec

    return ShapeKey.from_spec(model_spec("config:tiny-llama")[1], dtype)


def put(db_dir: Path, config: dict, ms: float = 0.25, tp: int = 1) -> Path:
    e = Entry(shape=tiny_shape(), gpu=GPU, tp=tp, fingerprint=kernel_fingerprint(), config=config, ms=ms,
              baseline_ms=0.5, baseline="torch.compile (default)", ratio=0.5 / ms, roofline_pct=10.0, correct=True,
              date="2026-11-27", command="amk tune config:tiny-llama", commit=None)
    ok, msg = tunedb.TuneDB(db_dir, None).put(e)
    assert ok, msg
    return db_dir / e.file_name()


def report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def test_compile_uses_the_heuristic_an_entry_or_the_plain_defaults(tmp_path):
    db = tmp_path / "db"
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # no user database of this machine's
    gpu = ["--gpu", f"{GPU.name}:{GPU.sms}"]
    # no entry: the heuristic, named on stderr and in report.json
    r = amk("compile", "config:tiny-llama", "--no-check", "--db", str(db), *gpu, "--out", str(tmp_path / "h"),
            "--json", env_extra=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "config: cost-model heuristic (no tuned entry for hidden 96, 2 layers" in r.stderr
    assert f"on {GPU.name} (132 SMs) tp 1; `amk tune` finds one)" in r.stderr
    rep = report(tmp_path / "h")
    assert rep["config_source"].startswith("config: cost-model heuristic")
    assert json.loads(r.stdout)["config_source"] == rep["config_source"]
    assert rep["config"]["workers"] == 132 and rep["config"]["fuse"] is True
    # an entry for this shape, GPU and tp: its config, and the line naming it
    path = put(db, {"lowering": {"tile": 8, "workers": 3, "policy": "stage", "fuse": True, "attn_split": 2,
                                 "late_append": True},
                    "kernel": {}})
    r = amk("compile", "config:tiny-llama", "--no-check", "--db", str(db), *gpu, "--out", str(tmp_path / "e"),
            env_extra=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("config:"))
    assert line == (f"config: tuned entry for {tiny_shape().describe()} on {GPU.describe()} tp 1: 0.25 ms/token, "
                    f"2.00 x the fastest baseline, 2026-11-27 ({path})")
    rep = report(tmp_path / "e")
    assert (rep["config"]["tile"], rep["config"]["workers"], rep["config"]["attn_split"]) == (8, 3, 2)
    assert rep["workers"] == 3
    sched = (tmp_path / "e" / "schedule.amk").read_text()
    assert "tile=8" in sched.replace(" ", "") or '"tile": 8' in sched
    # a flag overrides the entry; --fuse 0 drops the entry's knobs that need fuse
    r = amk("compile", "config:tiny-llama", "--no-check", "--db", str(db), *gpu, "--workers", "5", "--fuse", "0",
            "--out", str(tmp_path / "f"), env_extra=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    rep = report(tmp_path / "f")
    assert (rep["config"]["tile"], rep["config"]["workers"], rep["config"]["fuse"]) == (8, 5, False)
    assert rep["config"]["late_append"] is False
    # another GPU: no entry of it, the heuristic
    r = amk("compile", "config:tiny-llama", "--no-check", "--db", str(db), "--gpu", "Other GPU:100",
            "--out", str(tmp_path / "o"), env_extra=cache)
    assert r.returncode == 0 and "cost-model heuristic" in r.stderr
    assert report(tmp_path / "o")["config"]["workers"] == 100
    # --no-tuned: the old defaults
    r = amk("compile", "config:tiny-llama", "--no-check", "--db", str(db), *gpu, "--no-tuned",
            "--out", str(tmp_path / "n"), env_extra=cache)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "config: the knobs' defaults (--no-tuned)" in r.stderr
    from lowering.config import LoweringConfig

    assert report(tmp_path / "n")["config"] == LoweringConfig().to_json()


def test_amk_tune_db_env_is_read(tmp_path):
    db = tmp_path / "envdb"
    put(db, {"lowering": {"tile": 8, "workers": 2}, "kernel": {}})
    r = amk("compile", "config:tiny-llama", "--no-check", "--gpu", f"{GPU.name}:132", "--out", str(tmp_path / "o"),
            env_extra={"AMK_TUNE_DB": str(db)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "config: tuned entry" in r.stderr and report(tmp_path / "o")["config"]["workers"] == 2


def test_a_malformed_entry_is_one_line_exit_2(tmp_path):
    p = tmp_path / tunedb.file_name(tiny_shape(), GPU, 1)
    p.write_text('{"shape": {"hidden": -1}}')
    r = amk("compile", "config:tiny-llama", "--no-check", "--db", str(tmp_path), "--gpu", f"{GPU.name}:132",
            "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert str(p) in r.stderr and "shape.hidden" in r.stderr and "Traceback" not in r.stderr


def test_bad_gpu_flag(tmp_path):
    r = amk("compile", "config:tiny-llama", "--no-check", "--gpu", "Mystery", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--gpu 'Mystery': give the SM count too" in r.stderr


def test_bench_config_resolution_without_a_gpu(tmp_path, monkeypatch):
    """amk bench's config (amk.bench.run_config): the heuristic with the bench's defaults
    for what it leaves out (max_seq from the tokens); --no-tuned is bench_config's."""
    from amk.bench import bench_config, run_config
    from amk.cli import build_parser

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("AMK_TUNE_DB", raising=False)
    args = build_parser().parse_args(["bench", "config:llama-3.2-1b", "--tokens", "300"])
    cfg, line = run_config(args, GpuKey("NVIDIA H200", 132))
    assert line.startswith("config: cost-model heuristic")
    assert (cfg.lowering.tile_qkv, cfg.lowering.tile_gate_up, cfg.lowering.tile_lm_head) == (24, 64, 256)
    assert (cfg.lowering.max_seq, cfg.lowering.dtype, cfg.lowering.workers) == (316, "bf16", 132)
    assert cfg.kernel.gemv_block == "16x128"
    args = build_parser().parse_args(["bench", "config:llama-3.2-1b", "--no-tuned"])
    cfg, line = run_config(args, GpuKey("NVIDIA H200", 132))
    assert cfg == bench_config(args, 132) and "--no-tuned" in line


def test_search_triton_starts_from_the_resolved_config(tmp_path, monkeypatch):
    from amk.cli import build_parser
    from amk.commands.search import _settings_from_args

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("AMK_TUNE_DB", raising=False)
    args = build_parser().parse_args(["search", "config:llama-3.2-1b", "--backend", "triton", "--out",
                                      str(tmp_path / "s"), "--gpu", "NVIDIA H200:132"])
    s = _settings_from_args(args)
    assert s.config_source.startswith("config: cost-model heuristic")
    assert s.kernel["gemv_block"] == "16x128" and s.start["fuse"] is True
    assert s.start["workers"] == 128  # the space's workers are powers of two: nearest 132
    args = build_parser().parse_args(["search", "config:llama-3.2-1b", "--backend", "triton", "--no-tuned",
                                      "--out", str(tmp_path / "s")])
    s = _settings_from_args(args)
    assert s.start is None and s.kernel == {} and s.config_source is None
