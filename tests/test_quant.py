"""Quantized GEMV weights (int8, FP8 E4M3) with per-row f32 scales: the IR and its forms, the
validator and the oracle, the sim against the torch model with the same quantized weights,
the lowering knobs and `amk compile --weights`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ir.jsonio import program_from_json, program_to_json
from ir.program import Region
from ir.text import format_program, parse_program
from lowering.config import LoweringConfig, weight_knobs
from lowering.quant import dequantize, quantize_rows, scale_key

ROOT = Path(__file__).resolve().parents[1]


def _amk(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "amk", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _compilation(weights: str, tp: int = 1, **kw):
    """tiny-llama built at ``tp`` ranks with weight format ``weights`` (``q8_0``: int8 with
    32-column groups)."""
    from amk import pipeline

    cfg = LoweringConfig(**weight_knobs(weights), tile=16, workers=2, max_seq=32, **kw).validate(ranks=tp)
    return pipeline.Compilation.build("config:tiny-llama", tp, cfg)


@pytest.fixture(scope="module")
def int8_prog():
    return _compilation("int8", 2, fuse=True).program


# -- quantization math -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_int8_and_fp8(dtype):
    torch.manual_seed(0)
    w = (torch.randn(40, 72) * 0.05).to(dtype)
    w[3] = 0  # a zero row: a finite scale, zeros out
    q, s = quantize_rows(w, "i8")
    assert q.dtype is torch.int8 and s.dtype is torch.float32 and s.shape == (40,)
    assert int(q.abs().max()) <= 128 and int(q[3].abs().max()) == 0
    # absmax / 127.5 per row (torchao's symmetric int8), error at most half a step
    assert torch.allclose(s[:3], w[:3].float().abs().amax(1) / 127.5, rtol=1e-2)
    assert float((dequantize(q, s) - w.float()).abs().max()) <= float(s.max()) * 0.51
    q8, s8 = quantize_rows(w, "f8e4m3")
    assert q8.dtype is torch.float8_e4m3fn and torch.isfinite(q8.float()).all()
    assert float(q8.float().abs().max()) == 448.0  # every nonzero row's absmax maps to 448
    assert torch.isfinite(dequantize(q8, s8)).all()
    rel = (dequantize(q8, s8) - w.float()).abs().max() / w.float().abs().max()
    assert rel < 0.07  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_matches_torchao(dtype):
    """Bit for bit the q and scale of torchao's weight-only int8 / float8 per-row tensors."""
    pytest.importorskip("torchao")
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor

    torch.manual_seed(1)
    w = (torch.randn(64, 96) * 0.1).to(dtype)
    ref = Int8Tensor.from_hp(w, PerRow())
    q, s = quantize_rows(w, "i8")
    assert torch.equal(ref.qdata, q) and torch.equal(ref.scale.reshape(-1).float(), s)
    ref = Float8Tensor.from_hp(w, granularity=PerRow())
    q, s = quantize_rows(w, "f8e4m3")
    assert torch.equal(ref.qdata.float(), q.float()) and torch.equal(ref.scale.reshape(-1).float(), s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_groups_is_ggml_q8_0(dtype):
    """Bit for bit gguf-py's Q8_0 blocks (ggml's reference math): the int8 values and the f16
    block scale, a zero block included."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from lowering.quant import quantize_groups

    torch.manual_seed(2)
    w = (torch.randn(24, 96) * 0.07).to(dtype)
    w[5, 32:64] = 0
    q, s = quantize_groups(w)
    assert q.dtype is torch.int8 and s.dtype is torch.float32 and s.shape == (24, 3)
    blocks = quants.quantize(w.float().numpy(), GGMLQuantizationType.Q8_0).reshape(24 * 3, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(24, 3)
    qs = blocks[:, 2:].copy().view(np.int8).reshape(24, 96)
    assert torch.equal(q, torch.from_numpy(qs)) and torch.equal(s, torch.from_numpy(d))
    assert float(s[5, 1]) == 0 and int(q[5, 32:64].abs().max()) == 0


def test_a_q8_0_tensor_quantizes_back_to_itself():
    """What a Q8_0 GGUF stores, loaded as f32 (gguf-py's dequantize, as transformers' GGUF
    loader does), quantizes back to the same blocks: a Q8_0 checkpoint runs on its own
    weights and scales."""
    from gguf import GGMLQuantizationType, quants

    from lowering.quant import quantize_groups

    torch.manual_seed(3)
    w = torch.randn(16, 128) * 0.02
    q, s = quantize_groups(w)
    stored = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    loaded = torch.from_numpy(quants.dequantize(stored, GGMLQuantizationType.Q8_0)).reshape(16, 128)
    assert torch.equal(dequantize(q, s), loaded)
    q2, s2 = quantize_groups(loaded)
    assert torch.equal(q2, q) and torch.equal(s2, s)


def test_quantize_rows_refuses_bad_input():
    from ground.errors import AmkError

    with pytest.raises(AmkError, match="unknown quantized dtype 'i4'"):
        quantize_rows(torch.zeros(2, 2), "i4")
    with pytest.raises(AmkError, match="expected a 2-D float tensor"):
        quantize_rows(torch.zeros(4), "i8")
    from lowering.quant import quantize_groups

    with pytest.raises(AmkError, match="K = 40 in groups of 32"):
        quantize_groups(torch.zeros(2, 40))


# -- IR: text and JSON forms -----------------------------------------------------------------

def test_quantized_program_round_trips(int8_prog):
    p = int8_prog
    bufs = p.buffer_map()
    assert bufs["w.l0.q.r0"].dtype == "i8" and bufs["s.w.l0.q.r0"].dtype == "f32"
    assert bufs["s.w.l0.q.r1"].source.key == scale_key("i8", "model.layers.0.self_attn.q_proj.weight")
    # the scales split with the rows (column-parallel q) and stay whole (row-parallel o)
    assert bufs["s.w.l0.q.r1"].source.ranges == bufs["w.l0.q.r1"].source.ranges[:1]
    assert bufs["s.w.l0.attn.r1"].shape == (96,) and bufs["w.l0.attn.r1"].shape == (96, 32)
    assert bufs["s.w.l0.attn.r1"].source.ranges == ((0, 96),)
    text = format_program(p)
    assert 'buffer w.l0.q.r0 weight i8 [' in text
    assert parse_program(text) == p and format_program(parse_program(text)) == text
    assert program_from_json(json.loads(json.dumps(program_to_json(p)))) == p
    # every GEMV-family task but the (unquantized) LM head's carries the scale rows last
    for t in p.tasks:
        if (t.op.endswith("gemv") or t.op == "gemv_res") and not t.id.startswith("lm."):
            w = next(r for r in t.ins if r.buffer.startswith("w.") and bufs[r.buffer].dtype == "i8")
            s = t.ins[-1]
            assert s.buffer == "s." + w.buffer and s.ranges[0] == w.ranges[0], t.id


def test_unquantized_config_line_unchanged():
    """An unquantized lowering writes no quantization knobs (its text is what it was)."""
    from amk import pipeline

    prog = pipeline.Compilation.build("config:tiny-llama", 1, LoweringConfig(tile=16, workers=2, max_seq=32),
                                      validate=False).program
    assert "weights" not in prog.config and "quantize_lm_head" not in prog.config
    assert all(b.dtype in ("f32", "i32") for b in prog.buffers)


# -- validator and oracle --------------------------------------------------------------------

def _task_index(p, tid):
    return next(i for i, t in enumerate(p.tasks) if t.id == tid)


def _with_ins(p, tid, ins):
    q = p.copy()
    i = _task_index(q, tid)
    q.tasks[i] = dataclasses.replace(q.tasks[i], ins=tuple(ins))
    return q


def test_validator_and_oracle_accept_quantized(int8_prog):
    from validator import validate
    from validator.oracle import check

    assert validate(int8_prog).ok
    small = _compilation("fp8", 1).program
    assert validate(small).ok
    res = check(small, runs=2, exhaustive=False)
    assert not res.problems, [p.message for p in res.problems[:3]]


def test_validator_rejects_bad_scale_operands(int8_prog):
    from validator import validate
    from validator.oracle import check

    p = int8_prog
    t = p.tasks[_task_index(p, "l0.q.t0.r0")]
    cases = {
        # the quantized weight without its scales
        "has no scale input": _with_ins(p, t.id, t.ins[:-1]),
        # scales of the wrong length
        "scale input has 8 elements, the weight has N=16 rows": _with_ins(
            p, t.id, list(t.ins[:-1]) + [dataclasses.replace(t.ins[-1], ranges=t.ins[-1].ranges[:0] + (
                type(t.ins[-1].ranges[0]).of(0, 8),))]),
    }
    # a float weight with a bias and a trailing scale (a float weight's [N] f32 third input
    # alone is simply its bias)
    fl = _with_ins(p, t.id, list(t.ins) + [t.ins[-1]])
    for i, b in enumerate(fl.buffers):
        if b.name == "w.l0.q.r0":
            fl.buffers[i] = dataclasses.replace(b, dtype="f32")
    cases["only a quantized weight"] = fl
    # bf16 scales
    bs = p.copy()
    for i, b in enumerate(bs.buffers):
        if b.name == "s.w.l0.q.r0":
            bs.buffers[i] = dataclasses.replace(b, dtype="bf16")
    cases["scale input is bf16, expected f32"] = bs
    for needle, prog in cases.items():
        v = validate(prog)
        assert not v.ok and any(needle in f.message and "l0.q.t0.r0" in f.message for f in v.errors), \
            (needle, [f.message for f in v.errors[:4]])
        assert check(prog, runs=1, exhaustive=False).problems, needle


def test_scale_reads_count_in_race_analysis():
    """A task that overwrites a scale buffer unordered with the GEMV tiles reading it races."""
    from ir.program import Task
    from validator import validate

    p = _compilation("int8", 1).program
    t0, t1 = (p.tasks[_task_index(p, f"l0.q.t{i}.r0")] for i in (0, 1))
    assert (t0.worker, t1.worker) == (0, 1)
    other = Region("s.w.l0.k.r0", 0, t0.ins[-1].ranges)  # an initialised f32 weight
    bad = p.copy()
    # on worker 1 just before its q tile: after the norm both wait for, unordered with t0
    bad.tasks.insert(_task_index(bad, t1.id), Task("clobber", 0, 1, "copy", (other,), (t0.ins[-1],)))
    v = validate(bad)
    assert not v.ok
    assert any("clobber" in f.tasks and "l0.q.t0.r0" in f.tasks for f in v.errors), \
        [(f.cls, f.tasks) for f in v.errors[:5]]


def test_split_edit_cuts_the_scale(int8_prog):
    from lowering.placement import apply_edits
    from ir.edits import parse_edits
    from validator import validate

    new = apply_edits(int8_prog, parse_edits([{"op": "split", "task": "l0.q.t0.r0", "rows": 8}]))
    a, b = (new.tasks[_task_index(new, i)] for i in ("l0.q.t0_0.r0", "l0.q.t0_1.r0"))
    assert a.ins[-1].ranges[0].start.const == 0 and a.ins[-1].ranges[0].stop.const == 8
    assert b.ins[-1].ranges[0].start.const == 8 and b.ins[-1].ranges[0].stop.const == 16
    assert validate(new).ok


def test_split_and_merge_cut_group_scales_by_rows():
    """A q8_0 tile's [rows, K / 32] scale is cut and rejoined along its rows, every group kept."""
    from ir.edits import apply_edits, parse_edits
    from validator import validate

    p = _compilation("q8_0", 1).program
    new = apply_edits(p, parse_edits([{"op": "split", "task": "l0.q.t0.r0", "rows": 8}]))
    a, b = (new.tasks[_task_index(new, i)] for i in ("l0.q.t0_0.r0", "l0.q.t0_1.r0"))
    assert [(r.start.const, r.stop.const) for r in a.ins[-1].ranges] == [(0, 8), (0, 3)]
    assert [(r.start.const, r.stop.const) for r in b.ins[-1].ranges] == [(8, 16), (0, 3)]
    assert validate(new).ok
    back = apply_edits(new, parse_edits([{"op": "merge", "a": "l0.q.t0_0.r0", "b": "l0.q.t0_1.r0",
                                          "id": "l0.q.t0.r0"}]))
    assert back.tasks[_task_index(back, "l0.q.t0.r0")].ins == p.tasks[_task_index(p, "l0.q.t0.r0")].ins
    assert validate(back).ok


# -- sim against the quantized torch model ---------------------------------------------------

@pytest.mark.parametrize("weights,tp,kw", [("int8", 1, {}),
                                           ("int8", 2, {"fuse": True, "allreduce": "fused", "fuse_reduce": True}),
                                           ("fp8", 1, {"fuse": True, "quantize_lm_head": True}),
                                           ("fp8", 2, {"allreduce": "twoshot"}),
                                           ("q8_0", 1, {"fuse": True, "quantize_lm_head": True}),
                                           ("q8_0", 2, {"fuse": True, "allreduce": "fused"})])
def test_sim_matches_the_quantized_reference(weights, tp, kw):
    from amk import pipeline

    s = _compilation(weights, tp, **kw)
    rep = s.check(s.decoder("sim"), positions=(0, 5, 11))
    assert rep.ok and rep.max_abs_err < 1e-4, rep.failures()
    # ... and is measurably not the unquantized model
    plain = pipeline.check_correctness(s.resolved.model, s.decoder("sim"), s.graph.spec.vocab,
                                       "f32", (0, 5, 11))
    assert plain.max_abs_err > 1e-3


def test_quantized_copy_leaves_the_embedding():
    from lowering.quant import quantized_copy

    s = _compilation("int8", 1)
    m = s.resolved.model
    c = quantized_copy(m, "int8", quantize_lm_head=True)
    emb = "model.embed_tokens.weight"
    assert torch.equal(c.state_dict()[emb], m.state_dict()[emb])
    assert not torch.equal(c.get_output_embeddings().weight, m.get_output_embeddings().weight)
    q = c.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(q, m.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(m.state_dict()[emb], s.resolved.model.state_dict()[emb])  # untouched


# -- knobs and the command line --------------------------------------------------------------

def test_quantize_lm_head_needs_quantized_weights():
    from ground.errors import AmkError

    with pytest.raises(AmkError, match=r"--quantize-lm-head.*--weights int8 or fp8"):
        LoweringConfig(quantize_lm_head=True).validate()
    with pytest.raises(AmkError, match="weights"):
        LoweringConfig(weights="int4").validate()


def _compile(out: Path, *flags: str) -> dict:
    """``amk compile config:tiny-llama FLAGS --out OUT --json`` (tile 16, 2 workers): its
    report, checked ok and correct, and the schedule file validated again by ``amk validate``."""
    r = _amk("compile", "config:tiny-llama", *flags, "--tile", "16", "--workers", "2", "--no-tuned",
             "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["ok"] and rep["correctness"]["ok"]
    v = _amk("validate", str(out / "schedule.amk"))
    assert v.returncode == 0, v.stdout + v.stderr
    return rep


def test_cli_compile_int8(tmp_path):
    out = tmp_path / "c"
    rep = _compile(out, "--weights", "int8", "--quantize-lm-head", "1")
    qs = rep["quantization"]
    assert qs["weights"] == "int8" and qs["lm_head"] == "quantized" and qs["embedding"] == "unquantized"
    assert qs["weight_bytes"]["quantized"] > 0 and qs["weight_bytes"]["scales"] > 0
    d = qs["distance"]
    assert d["tokens"] == 64 and 0 <= d["greedy_match"] <= 1 and d["ppl_quant"] > 0 and d["text"]
    assert " i8 [" in (out / "schedule.amk").read_text()


def test_cli_compile_q8_0(tmp_path):
    """q8_0 at tp 2: per-32-column scales in the schedule and its report; the file validates;
    the sim matched the Q8_0 model (compile's check)."""
    out = tmp_path / "c"
    rep = _compile(out, "--tp", "2", "--weights", "int8", "--weight-group", "32", "--fuse", "1")
    qs = rep["quantization"]
    assert qs["weights"] == "q8_0" and qs["gemv_weights"] == "i8"
    assert qs["scale"] == "f32 (an f16 value) per 32 elements of a row"
    text = (out / "schedule.amk").read_text()
    assert "amk.scale.i8/32:model.layers.0.mlp.down_proj.weight" in text and "amk.qweight.i8/32:" in text


def test_q8_0_refuses_a_split_that_cuts_a_block():
    """tiny-qwen2 over 2 ranks: 3 of its 6 heads of 16 (48 o_proj columns) a rank, and its 224
    MLP columns 112 a rank at tile 16: one error line naming the first, exit 2; tiny-llama's
    tp 2 splits on block boundaries (test_cli_compile_q8_0)."""
    r = _amk("compile", "config:tiny-qwen2", "--tp", "2", "--weights", "int8", "--weight-group", "32", "--tile", "16",
             "--no-tuned",
             "--no-check")
    assert r.returncode == 2
    errs = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1 and "rank 0 takes columns 0:48 of model.layers.0.self_attn.o_proj.weight" in errs[0] \
        and "cuts its blocks of 32 columns" in errs[0], r.stderr


def test_validator_rejects_bad_group_scales():
    """Per-group scales on an fp8 weight, or for other rows than the weight's, are named."""
    from validator import validate

    p = _compilation("q8_0", 1).program
    t = p.tasks[_task_index(p, "l0.q.t0.r0")]
    sc = t.ins[-1]
    assert len(sc.ranges) == 2 and sc.ranges[1].stop.const == 3  # K = 96: 3 groups of 32
    f8 = p.copy()
    for i, b in enumerate(f8.buffers):
        if b.name == "w.l0.q.r0":
            f8.buffers[i] = dataclasses.replace(b, dtype="f8e4m3")
    odd = _with_ins(p, t.id, list(t.ins[:-1]) + [dataclasses.replace(sc, ranges=(type(sc.ranges[0]).of(0, 8),
                                                                              sc.ranges[1]))])
    for needle, prog in (("per-group scales need an i8 weight", f8),
                         ("has 24 elements, the weight has N=16 rows and K=96", odd)):
        v = validate(prog)
        assert not v.ok and any(needle in f.message and t.id in f.message for f in v.errors), \
            (needle, [f.message for f in v.errors[:4]])


def test_q8_0_decode_bytes_count_a_scale_per_block():
    from lowering.quant import decode_bytes

    s = _compilation("q8_0", 1)
    m = s.resolved.model
    full = decode_bytes(m, None)
    lin = [mod.weight for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear) and n.endswith("_proj")]
    n = sum(w.numel() for w in lin)
    # one f32 scale per 32 weights, as the lowering stores them
    assert decode_bytes(m, "q8_0") == full - n * (lin[0].element_size() - 1) + 4 * (n // 32)


def test_cli_refuses_bad_weight_flags():
    r = _amk("compile", "config:tiny-llama", "--weights", "int4", "--no-check")
    assert r.returncode == 2 and "int4" in r.stderr and "Traceback" not in r.stderr
    r = _amk("compile", "config:tiny-llama", "--quantize-lm-head", "1", "--no-check", "--no-tuned")
    assert r.returncode == 2 and "--quantize-lm-head" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_cli_run_quantized_schedule(tmp_path, int8_prog):
    """`amk run` seeds int8 weights over the whole int8 range: finite, nonzero logits."""
    f = tmp_path / "q.amk"
    f.write_text(format_program(int8_prog))
    r = _amk("run", str(f), "--backend", "sim", "--steps", "2", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    text = json.dumps(out)
    assert "logits.r0" in text and '"finite": true' in text.replace(": True", ": true"), text[:400]



def test_sim_refuses_a_scale_on_a_float_weight(int8_prog):
    """Without the validator (check=False) the sim still refuses an extra input on a float
    weight instead of ignoring it."""
    from lowering.sim import SimError, SimExecutor

    p = int8_prog.copy()
    for i, b in enumerate(p.buffers):
        if b.name == "w.l0.q.r0":
            p.buffers[i] = dataclasses.replace(b, dtype="f32")
    t = p.tasks[_task_index(p, "l0.q.t0.r0")]
    bad = _with_ins(p, t.id, list(t.ins) + [t.ins[-1]])
    with pytest.raises(SimError, match="l0.q.t0.r0.*only a quantized weight takes a scale"):
        SimExecutor(bad, None, check=False)


def test_cli_search_refuses_quantized_weights(tmp_path):
    r = _amk("search", "config:tiny-llama", "--backend", "sim", "--weights", "fp8", "--trials", "1",
             "--out", str(tmp_path / "s"))
    assert r.returncode == 2 and "--weights int8 / fp8" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())
