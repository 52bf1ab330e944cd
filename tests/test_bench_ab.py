"""bench/ab.py: interleaved A/B of two commands writing `amk bench` results (CPU, fake commands)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import ab  # noqa: E402


WRITER = ("import json, sys; json.dump({'latency_ms_median': float(sys.argv[1]), "
          "'correct': True, 'roofline_pct': 50.0}, open(sys.argv[2], 'w'))")


def _writer(tmp: Path, ms: float) -> str:
    """A command line that writes an `amk bench`-like result of ``ms`` to {out}."""
    script = tmp / "writer.py"
    script.write_text(WRITER)
    return f"{sys.executable} {script} {ms} {{out}}"


def test_verdict_noise_and_difference():
    a = {"ok": 2, "fastest_ms": 1.000, "spread": 0.002}
    assert ab.verdict(a, {"ok": 2, "fastest_ms": 1.005, "spread": 0.001})[1] == "within noise"
    assert ab.verdict(a, {"ok": 2, "fastest_ms": 1.10, "spread": 0.001})[1] == "A faster"
    assert ab.verdict({"ok": 2, "fastest_ms": 1.2, "spread": 0.0}, a)[1] == "B faster"
    assert ab.verdict({"ok": 0}, a) == (None, "incomplete")


def test_main_runs_both_sides_and_keeps_every_run(tmp_path):
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), "--runs", "2",
                        "--a", _writer(tmp_path, 1.0), "--b", _writer(tmp_path, 2.0), "--out", str(out)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert [r["ms"] for r in d["a"]["runs"]] == [1.0, 1.0]
    assert d["b"]["n_runs"] == 2 and d["b"]["fastest_ms"] == 2.0
    assert d["verdict"] == "A faster" and abs(d["ratio_a_over_b"] - 0.5) < 1e-9
    assert "A/B = 0.5000: A faster" in p.stdout


def test_a_command_without_out_placeholder_is_refused(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "ab.py"), "--a", "true", "--b",
                        _writer(tmp_path, 1.0), "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--a has no {out}" in p.stderr
