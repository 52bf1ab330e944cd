"""bench/quant.py on the CPU: its one-line refusals, the quantized roofline bytes, and the
table / JSON it builds from a measurement (a fake measurement function: the GPU run is the
one part it replaces)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import quant as bq  # noqa: E402
from ground.errors import AmkError  # noqa: E402


def _script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "quant.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.parametrize("args,needle", [(["config:tiny-llama"], "needs a CUDA GPU"),
                                         (["config:tiny-llama", "--weights", "int4"], "--weights"),
                                         (["config:tiny-llama", "--tokens", "2"], "--tokens"),
                                         (["config:tiny-llama", "--rows", "amk,vllm"], "--rows")])
def test_refuses_in_one_line(args, needle):
    r = _script(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("bench/quant.py: error:"), r.stderr


def test_rows_pick_the_row_kinds():
    assert bq.parse_rows("torchao") == {"torchao"}
    assert bq.parse_rows(" amk , hf ") == {"amk", "hf"}
    assert bq.parse_rows("amk,hf,torchao", no_baselines=True) == {"amk"}
    for bad in ("", ",", "amk,int8"):
        with pytest.raises(AmkError, match="--rows"):
            bq.parse_rows(bad)


def test_quantized_decode_bytes():
    from ground.timing import decode_weight_bytes
    from models.recipes import build_model

    m = build_model("tiny-llama").to(torch.bfloat16)
    lin = [mod for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and n.endswith("_proj")]
    full = decode_weight_bytes(m)
    n = sum(x.weight.numel() for x in lin)
    rows = sum(x.weight.shape[0] for x in lin)
    assert bq.quant_decode_bytes(m, None) == full
    assert bq.quant_decode_bytes(m, "int8") == full - n + 4 * rows
    head = m.get_output_embeddings().weight
    assert bq.quant_decode_bytes(m, "fp8", True) == full - n + 4 * rows - head.numel() + 4 * head.shape[0]


def _fake_measure(args, formats, progress, checkpoint=None):
    """What ``bench.quant.measure`` returns, from fixed numbers: one amk and one baseline row
    per format (the baseline measured ``--repeats`` times)."""
    progress("fake measurement")
    bw = 2.0e12
    rows = []
    for k, fmt in enumerate(["bf16", *formats]):
        nbytes = 2_000_000_000 // (2 if fmt != "bf16" else 1)
        floor = nbytes / bw * 1e3
        rows.append(bq.row(f"amk {fmt}", fmt, [{"latency_ms_median": 1.2 - 0.1 * k}], floor, True, "identical",
                           {"weight_bytes": nbytes}))
        runs = [{"latency_ms_median": 1.5 - 0.1 * k + 0.01 * j} for j in range(args.repeats)]
        rows.append(bq.row(("hf " if fmt == "bf16" else "torchao ") + fmt, fmt, runs, floor, fmt != "fp8",
                           "diverges at token 3" if fmt == "fp8" else "identical", {"weight_bytes": nbytes}))
    meta = {"device": "fake", "model": args.model, "command": "test"}
    return bq.build_result(meta, bw, rows, {f: {"greedy_match": 1.0} for f in formats})


def test_table_and_json_from_a_measurement(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = bq.main(["config:tiny-llama", "--weights", "int8,fp8", "--out", str(out), "--json"],
                   measure_fn=_fake_measure)
    assert code == 1  # the torchao fp8 row is wrong
    res = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == res
    methods = [r["method"] for r in res["rows"]]
    assert methods == ["amk bf16", "hf bf16", "amk int8", "torchao int8", "amk fp8", "torchao fp8"]
    hf = res["rows"][1]
    assert hf["runs_ms"] == [1.5, 1.51] and hf["latency_ms_median"] == 1.5
    amk8 = res["rows"][2]
    assert amk8["roofline_ms"] == pytest.approx(0.5) and amk8["roofline_pct"] == pytest.approx(100 * 0.5 / 1.1)
    assert res["ok"] is False and res["distance"]["int8"]["greedy_match"] == 1.0
    table = bq.result_table(res)
    assert table.row_count == 6 and "% quantized roofline" in [c.header for c in table.columns]
    # amk int8 1.1 ms against torchao int8's fastest run 1.4 and amk bf16 1.2; fp8's torchao row is wrong
    sp = {s["weights"]: s for s in res["speedups"]}
    assert sp["int8"]["amk"] == "amk int8" and sp["int8"]["vs_torchao"] == {"torchao int8": pytest.approx(1.4 / 1.1)}
    assert sp["int8"]["vs_amk_bf16"] == pytest.approx(1.2 / 1.1) and sp["fp8"]["vs_torchao"] == {}


def test_speedups_take_the_fastest_correct_amk_row():
    import report

    rows = [bq.row("amk bf16", "bf16", [{"latency_ms_median": 2.0}], 1.0, True, ""),
            bq.row("amk int8", "int8", [{"latency_ms_median": 1.5}], 0.5, True, ""),
            bq.row("amk int8 fast", "int8", [{"latency_ms_median": 1.0}], 0.5, False, "wrong"),
            bq.row("amk int8 tma", "int8", [{"latency_ms_median": 1.25}], 0.5, True, ""),
            bq.row("torchao int8", "int8", [{"latency_ms_median": 2.5}, {"latency_ms_median": 2.6}], 0.5, True, "")]
    (sp,) = report.quant_speedups({"rows": rows})
    assert sp == {"weights": "int8", "amk": "amk int8 tma", "amk_ms": 1.25, "vs_amk_bf16": 1.6,
                  "vs_torchao": {"torchao int8": 2.0}}
    assert report.speedup_line(sp) == "int8: amk int8 tma 1.250 ms against torchao int8 2.00x, amk bf16 1.60x"
    shown = [r["method"] for r in report.quant_rows({"rows": rows})]
    assert shown == ["amk bf16", "amk int8 tma", "torchao int8"]


def test_unwritable_out_is_refused_before_measuring(tmp_path):
    called = []

    def measure(args, formats, progress, checkpoint=None):
        called.append(1)
        return _fake_measure(args, formats, progress, checkpoint)

    from ground.errors import AmkError

    (tmp_path / "file").write_text("")
    with pytest.raises(AmkError, match="--out"):
        bq.main(["config:tiny-llama", "--out", str(tmp_path / "file" / "r.json")], measure_fn=measure)
    assert not called


def test_a_run_cut_off_after_a_row_leaves_that_row(tmp_path):
    """--out holds the finished rows (partial: true) when the measurement dies later."""
    out = tmp_path / "r.json"

    def measure(args, formats, progress, checkpoint):
        full = _fake_measure(args, formats, progress)
        checkpoint({**bq.build_result({"device": "fake"}, 1.0, full["rows"][:1], {}), "partial": True})
        raise KeyboardInterrupt  # the time limit's kill

    with pytest.raises(KeyboardInterrupt):
        bq.main(["config:tiny-llama", "--out", str(out)], measure_fn=measure)
    res = json.loads(out.read_text())
    assert res["partial"] is True and [r["method"] for r in res["rows"]] == ["amk bf16"]


def test_amk_variants_change_kernel_knobs_only():
    from lowering.config import KernelConfig

    base = KernelConfig(gemv_block="32x256", gemv_stages=6, gemv_tma=True)
    got = bq.parse_variants(["tma: --q-tma 1 --q-gemv-n 64", "magic:--int8-convert magic"], base)
    assert [n for n, _ in got] == ["tma", "magic"]
    assert got[0][1] == base.replace(q_tma=True, q_gemv_n=64) and got[1][1] == base.replace(int8_convert="magic")
    assert bq.parse_variants([], base) == []


@pytest.mark.parametrize("text,needle", [("--q-tma 1", "NAME"), ("a b: --q-tma 1", "NAME"),
                                         ("t: --tile 32", "not a kernel knob"),
                                         ("t: --int8-convert fast", "int8"),
                                         ("t: --q-gemv-n 3", "q_gemv_n")])
def test_amk_variant_refusals_name_the_variant(text, needle):
    from lowering.config import KernelConfig

    with pytest.raises(AmkError, match=needle):
        bq.parse_variants([text], KernelConfig(gemv_tma=True, gemv_stages=4))
    with pytest.raises(AmkError, match="new one-word NAME"):
        bq.parse_variants(["v: --q-tma 0", "v: --q-tma 1"], KernelConfig())


def test_variants_that_build_the_same_kernel_share_a_key():
    from lowering.config import KernelConfig

    base = KernelConfig(gemv_block="32x256", gemv_tma=True, gemv_stages=6)
    cvt, tma = base.replace(int8_convert="cvt"), base.replace(q_tma=True)
    assert bq.kernel_key("fp8", cvt) == bq.kernel_key("fp8", base) != bq.kernel_key("fp8", tma)
    assert bq.kernel_key("q8_0", tma) == bq.kernel_key("q8_0", base) != bq.kernel_key("q8_0", cvt)
    assert len({bq.kernel_key("int8", k) for k in (base, cvt, tma)}) == 3
