"""bench/quant_distance.py on the CPU (the sim, tiny Llama with random weights and seeded token
ids): its rows, the unquantized megakernel's perplexity against HF's in f32, its thresholds
and its one-line refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import quant_distance as qd  # noqa: E402
from ground.errors import AmkError  # noqa: E402


def test_sim_rows_of_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "d.json"
    code = qd.main(["config:tiny-llama", "--backend", "sim", "--weights", "int8,q8_0", "--tokens", "6",
                    "--text-tokens", "20", "--out", str(out)])
    res = json.loads(out.read_text())
    assert code == 0 and res["ok"] and "partial" not in res
    assert [r["weights"] for r in res["rows"]] == ["none", "int8", "q8_0"]
    none = res["rows"][0]
    # the unquantized sim in f32 is HF's model: same greedy tokens, same perplexity
    assert none["greedy_match"] == 1.0 and none["greedy_prefix"] == 6 and none["ppl_ratio"] == 1.0
    assert abs(none["ppl_ratio_hf"] - 1) < 1e-4
    assert all(r["ppl"] > 1 and 0 <= r["greedy_match"] <= 1 for r in res["rows"])
    assert "distance to the unquantized model" in capsys.readouterr().out


def test_thresholds_fail_a_row():
    code = qd.main(["config:tiny-llama", "--backend", "sim", "--weights", "int8", "--tokens", "4",
                    "--text-tokens", "12", "--max-ppl-ratio", "1.0000001", "--min-match", "1.01"])
    assert code == 1


@pytest.mark.parametrize("args,needle", [(["config:tiny-llama", "--weights", "int4", "--backend", "sim"], "--weights"),
                                         (["config:tiny-llama", "--tokens", "0", "--backend", "sim"], "--tokens"),
                                         (["config:tiny-llama", "--backend", "triton"], "CUDA GPU")])
def test_refuses_in_one_line(args, needle):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "quant_distance.py"), *args], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines and needle in lines[-1], r.stderr


def test_formats_parse():
    assert qd.parse_formats("int8, fp8") == ["int8", "fp8"]
    for bad in ("", "int8,int8", "bf16"):
        with pytest.raises(AmkError, match="--weights"):
            qd.parse_formats(bad)
