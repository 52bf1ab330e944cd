"""bench/quant_formats.py: the grouped int8 / fp8 and Q8_0 math, and the script end to end on
the tiny recipe (CPU), its rows against lowering.quant's own distance, and its bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ground.errors import AmkError
from lowering.quant import dequantize, quantize_rows

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_quant_formats", ROOT / "bench" / "quant_formats.py")
qf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qf)


def script(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "bench/quant_formats.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("fmt,qdtype", [("int8", "i8"), ("fp8", "f8e4m3")])
def test_fake_quant_groups_are_rows_of_each_group(fmt, qdtype):
    torch.manual_seed(0)
    w = torch.randn(6, 80) * torch.logspace(-3, 0, 80)  # magnitudes that differ along K
    assert torch.equal(qf.fake_quant(w, fmt, 0), dequantize(*quantize_rows(w, qdtype)))
    got = qf.fake_quant(w, fmt, 32)  # 80 = 32 + 32 + a last group of 16
    for lo, hi in ((0, 32), (32, 64), (64, 80)):
        assert torch.equal(got[:, lo:hi], dequantize(*quantize_rows(w[:, lo:hi], qdtype)))
    # finer scales: a smaller error on this weight than per row
    assert (got - w).norm() < (qf.fake_quant(w, fmt, 0) - w).norm()


def test_fake_quant_q8_0_is_gguf_blocks():
    torch.manual_seed(1)
    w = torch.randn(4, 64) * 0.05
    got = qf.fake_quant(w, "q8_0")
    blocks = w.reshape(-1, 32)
    d = blocks.abs().amax(1, keepdim=True) / 127  # ggml: d = absmax / 127, stored as f16
    want = torch.round(blocks / d).clamp(-127, 127) * d.half().float()
    assert torch.equal(got, want.reshape(4, 64))
    with pytest.raises(AmkError, match="K = 40 is not a multiple of the 32-element block"):
        qf.fake_quant(torch.randn(2, 40), "q8_0")


def test_fp8_scale_factor_keeps_the_error_size():
    """The --spread realisations: the same relative error, a different rounding."""
    torch.manual_seed(2)
    w = torch.randn(64, 256) * 0.02
    e = [float((qf.fake_quant(w, "fp8", 0, 2 ** (j / 4)) - w).norm() / w.norm()) for j in range(4)]
    assert max(e) / min(e) < 1.1 and len({round(x, 6) for x in e}) == 4
    assert torch.equal(qf.fake_quant(w, "fp8", 0, 1.0), qf.fake_quant(w, "fp8", 0))


def test_fp8_mse_scale_is_the_least_error_candidate():
    torch.manual_seed(3)
    w = torch.randn(8, 96) * 0.03
    for g in (0, 32):
        got = qf.fake_quant(w, "fp8-mse", g)
        n = g or 96
        err = ((got - w) ** 2).reshape(-1, n).sum(1)
        for j in range(qf.MSE_CANDIDATES):  # no candidate scale does better on any group
            cand = ((qf.fake_quant(w, "fp8", g, 2 ** (j / qf.MSE_CANDIDATES)) - w) ** 2).reshape(-1, n).sum(1)
            assert (err <= cand).all()
        assert (err < ((qf.fake_quant(w, "fp8", g) - w) ** 2).reshape(-1, n).sum(1)).any()


def test_script_on_the_tiny_recipe(tmp_path):
    out = tmp_path / "r" / "formats.json"
    r = script("config:tiny-llama", "--tokens", "8", "--groups", "0,32", "--heads", "0", "--spread", "2",
               "--breakdown", "--out", out)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "distance to the unquantized fp32 model" in r.stdout and "realisations" in r.stdout
    res = json.loads(out.read_text())
    assert res["command"].startswith("python bench/quant_formats.py config:tiny-llama")
    got = [(x["format"], x["group"], x["head"]) for x in res["rows"]]
    assert got == [("bf16 (unquantized)", None, None), ("int8", 0, 0), ("int8", 32, 0), ("fp8", 0, 0),
                   ("fp8", 32, 0), ("fp8-mse", 0, 0), ("fp8-mse", 32, 0), ("q8_0", 32, 0)]
    assert res["rows"][5]["rel_rms_error"] <= res["rows"][3]["rel_rms_error"]
    assert len(res["reference_tokens"]) == 8 and len(res["base_margins"]) == 8
    # the per-row rows are lowering.quant's own quantized model and distance
    from amk import pipeline
    from lowering import quant

    m = pipeline.resolve("config:tiny-llama").model
    tok = pipeline.resolve("config:tiny-llama").tokenizer
    d = quant.distance(m, quant.quantized_copy(m, "fp8"), tok(quant.EVAL_PROMPT)["input_ids"],
                       tok((ROOT / quant.EVAL_TEXT).read_text())["input_ids"], 8)
    fp8 = res["rows"][3]
    assert fp8["ppl"] == pytest.approx(d["ppl_quant"], rel=1e-6) and fp8["greedy_match"] == d["greedy_match"]
    assert len(fp8["flips"]) == round(8 * (1 - fp8["greedy_match"]))
    # realisation 0 is the plain row; the spread covers int8, fp8 and fp8-mse at both groups
    assert [(s["format"], s["group"]) for s in res["spread"]] == [
        ("int8", 0), ("int8", 32), ("fp8", 0), ("fp8", 32), ("fp8-mse", 0), ("fp8-mse", 32)]
    assert res["spread"][5]["runs"][0]["ppl"] == pytest.approx(res["rows"][6]["ppl"], rel=1e-6)
    assert res["spread"][2]["runs"][0]["ppl"] == pytest.approx(fp8["ppl"], rel=1e-6)
    b = res["breakdown"]["fp8"]
    assert len(b["layer"]) == 2 and set(b["kind"]) == {"q_proj+k_proj+v_proj", "o_proj", "gate_proj+up_proj",
                                                       "down_proj"}


@pytest.mark.parametrize("args,line", [
    (("--groups", "0,-32"), "--groups: expected a comma list of distinct integers >= 0, got '0,-32'"),
    (("--formats", "int4"), "--formats: expected a comma list of int8, fp8, fp8-mse, q8_0, got 'int4'"),
    (("--heads", "2"), "--heads: expected a comma list of distinct integers 0..1, got '2'"),
    (("--spread", "1"), "--spread must be 0 or >= 2, got 1"),
])
def test_script_refuses_bad_input(args, line):
    r = script("config:tiny-llama", *args, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"bench/quant_formats.py: error: {line}", r.stderr
