"""bench/suite.py: every suite file parses, every step's command parses with its program's own
parser (amk bench also checks its config, block flags and split), nothing runs on a GPU; the
runner records each step's exit code, kills a step at its timeout and stamps bench results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import suite  # noqa: E402

from ground.errors import AmkError  # noqa: E402

NAMES = suite.suite_names()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "suite.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_named_suites_exist():
    assert {"one-gpu", "one-gpu-small", "tp2", "tp2-small", "tp4", "comm"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_step_parses_and_writes_under_out(name):
    s = suite.load_suite(name)
    assert sum(st.timeout_s for st in s.steps) <= suite.BUDGET_S
    for step in s.steps:
        ns = suite.parse_step(step)
        outs = [v for f, v in zip(step.argv, step.argv[1:]) if f in ("--out", "--json")]
        outs += [a.split("=", 1)[1] for a in step.argv if a.startswith("--junitxml=")]  # pytest
        assert outs and all(v.startswith("{out}/") for v in outs), step.argv
        if step.argv[0] == "amk":
            assert ns.command == "bench" and ns.out.startswith("OUT/")
            if ns.tp > 1:
                assert s.gpus >= ns.tp


def test_dry_run_cli_lists_every_step():
    r = run_cli("tp2", "--dry-run", "--out", "/tmp/x")
    assert r.returncode == 0, r.stderr
    assert "--out /tmp/x/llama-3.1-8b-tp2.json" in r.stdout
    r = run_cli("--list")
    assert r.returncode == 0 and all(f"{n}:" in r.stdout for n in NAMES)


def _suite_dir(tmp_path, steps, gpus=1):
    d = tmp_path / "suites"
    d.mkdir(exist_ok=True)
    (d / "t.json").write_text(json.dumps({"description": "test", "gpus": gpus, "steps": steps}))
    return d


@pytest.mark.parametrize("run, message", [
    ("amk bench config:llama-3.2-1b --gemv-blok 16x128 --out {out}/x.json", "unrecognized arguments: --gemv-blok"),
    ("amk bench config:llama-3.2-1b --gemv-block 3x128 --out {out}/x.json", "power of two"),
    ("amk bench config:llama-3.2-1b --config bench/configs/nope.json --out {out}/x.json", "nope.json"),
    ("amk bench config:tiny-qwen3 --tp 100 --out {out}/x.json", "cannot be split over 100 ranks"),
    ("amk bench config:llama-3.2-1b", "--out {out}/NAME.json"),
    ("bench/comm.py --ranks 2 --iters many --json {out}/c.json", "many"),
    ("bench/megakernel_sweep.py config:llama-3.2-1b --no-such-flag", "--no-such-flag"),
    ("bench/nope.py", "does not exist"),
    ("python -c 1", "a step runs amk, pytest or a bench/*.py script"),
])
def test_a_bad_step_fails_in_one_line_naming_it(tmp_path, run, message):
    d = _suite_dir(tmp_path, [{"name": "bad", "timeout_s": 10, "run": run}])
    r = run_cli("t", "--dry-run", "--suites", str(d))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and message in r.stderr and "Traceback" not in r.stderr


def test_bad_suite_files(tmp_path):
    d = _suite_dir(tmp_path, [{"name": "a", "timeout_s": 400, "run": "bench/report.py --check"},
                              {"name": "b", "timeout_s": 400, "run": "bench/report.py --check"}])
    r = run_cli("t", "--dry-run", "--suites", str(d))
    assert r.returncode == 2 and "800 s" in r.stderr
    r = run_cli("nosuch", "--suites", str(d))
    assert r.returncode == 2 and "no suite 'nosuch'" in r.stderr and "t" in r.stderr
    (d / "t.json").write_text('{"description": "x", "gpus": 1, "steps": [}')
    r = run_cli("t", "--suites", str(d))
    assert r.returncode == 2 and "t.json" in r.stderr


def test_runs_steps_records_them_and_kills_at_timeout(tmp_path):
    d = _suite_dir(tmp_path, [
        {"name": "page", "timeout_s": 120, "run": "bench/report.py --out {out}/page.md"},
        {"name": "slow", "timeout_s": 0.001, "run": "bench/report.py --out {out}/never.md"},
    ])
    out = tmp_path / "out"
    r = run_cli("t", "--suites", str(d), "--out", str(out))
    assert r.returncode == 1, r.stdout + r.stderr
    assert (out / "page.md").read_text() == (ROOT / "docs" / "benchmarks.md").read_text()
    rec = json.loads((out / "suite-t.json").read_text())
    assert [(s["name"], s["exit_code"] == 0, s["timed_out"]) for s in rec["steps"]] == [
        ("page", True, False), ("slow", False, True)]
    assert rec["date"] and "1 of 2 steps exited 0" in r.stdout


def test_stamp_results_marks_bench_results_only(tmp_path):
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({"command": "amk bench config:x --out b.json", "latency_ms_median": 1.0}))
    other = tmp_path / "c.json"
    other.write_text(json.dumps({"bench": "comm"}))
    suite.stamp_results(["amk", "bench", "--out", str(bench)], "2026-01-02", "abc")
    suite.stamp_results(["bench/comm.py", "--out", str(other)], "2026-01-02", "abc")
    assert json.loads(bench.read_text())["date"] == "2026-01-02"
    assert json.loads(bench.read_text())["commit"] == "abc"
    assert "date" not in json.loads(other.read_text())


def test_gpu_tag_needs_a_gpu_or_out(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(AmkError, match="no CUDA GPU"):
        suite.gpu_tag()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert suite.gpu_tag() == "h200x2"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert suite.gpu_tag() == "h100"
