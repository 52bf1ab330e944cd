"""End to end on the sim backend: import -> lower -> validate -> run -> compare with HF eager.

Logits are compared at positions 0, 7 and 31 (a check at position 0 alone cannot see
attention or KV-cache bugs); the prompt is fed one token per decode step.
"""

from __future__ import annotations

import json

import pytest
import torch

from amk import pipeline
from amk.cli import main
from lowering.config import LoweringConfig
from lowering.lower import lower
from models.graph import import_model

POSITIONS = (0, 7, 31)


def _compilation(name: str, R: int, **knobs) -> pipeline.Compilation:
    cfg = LoweringConfig(max_seq=32, **knobs)
    return pipeline.Compilation.build(f"config:{name}", R, cfg)


@pytest.mark.parametrize("name,R,knobs,policy,seed", [
    ("tiny-llama", 1, dict(workers=2), "random", 0),
    ("tiny-llama", 2, dict(workers=3, tile=32), "adversarial", 1),
    ("tiny-llama", 3, dict(workers=2, allreduce="twoshot"), "random", 2),
    ("tiny-llama", 4, dict(workers=2, tile=48, policy="balanced"), "adversarial", 3),
    ("tiny-qwen2", 1, dict(workers=1), "in_order", 0),
    ("tiny-qwen2", 2, dict(workers=2, allreduce="twoshot"), "adversarial", 4),
    ("tiny-qwen2", 3, dict(workers=3, tile=32), "random", 5),
    ("tiny-qwen2", 4, dict(workers=2), "adversarial", 6),
    ("tiny-qwen3", 1, dict(workers=3, tile=32), "random", 7),
    ("tiny-qwen3", 2, dict(workers=2), "random", 8),
    ("tiny-qwen3", 3, dict(workers=2, policy="balanced"), "adversarial", 9),
    ("tiny-qwen3", 4, dict(workers=1, allreduce="twoshot"), "adversarial", 10),
    ("tiny-qwen2", 3, dict(workers=2, allreduce="fused"), "adversarial", 17),
])
def test_tiny_models_match_hf_logits(name, R, knobs, policy, seed):
    s = _compilation(name, R, **knobs)
    assert s.verdict.ok, [(f.cls, f.message) for f in s.verdict.errors[:3]]
    rep = s.check(s.decoder("sim", seed=seed, policy=policy), POSITIONS, seed=seed)
    assert [p.pos for p in rep.positions] == list(POSITIONS)
    assert rep.ok, rep.failures()
    assert rep.max_abs_err < 1e-4
    assert all(p.argmax_agree for p in rep.positions)


@pytest.mark.parametrize("name,R,knobs,policy,seed", [
    ("tiny-llama", 1, dict(workers=2), "random", 11),
    ("tiny-llama", 2, dict(workers=3, tile=32), "adversarial", 12),
    ("tiny-qwen2", 1, dict(workers=3, tile=32, policy="balanced"), "adversarial", 13),
    ("tiny-qwen2", 2, dict(workers=2, allreduce="twoshot"), "random", 14),
    ("tiny-qwen3", 1, dict(workers=2), "random", 15),
    ("tiny-qwen3", 2, dict(workers=2, tile=32), "adversarial", 16),
    ("tiny-llama", 4, dict(workers=2, tile=16, allreduce="fused"), "adversarial", 18),
    ("tiny-qwen2", 3, dict(workers=2, tile=32, fuse_reduce=True), "adversarial", 19),
    ("tiny-qwen3", 2, dict(workers=3, tile=16, allreduce="fused", fuse_reduce=True), "random", 20),
])
def test_fused_tiny_models_match_hf_logits(name, R, knobs, policy, seed):
    s = _compilation(name, R, fuse=True, **knobs)
    assert s.verdict.ok, [(f.cls, f.message) for f in s.verdict.errors[:3]]
    ops = {t.op for t in s.program.tasks}
    assert {"norm_gemv", "swiglu_gemv"} <= ops and "silu_mul" not in ops
    rep = s.check(s.decoder("sim", seed=seed, policy=policy), POSITIONS, seed=seed)
    assert [p.pos for p in rep.positions] == list(POSITIONS)
    assert rep.ok, rep.failures()
    assert rep.max_abs_err < 1e-4
    assert all(p.argmax_agree for p in rep.positions)


@pytest.mark.parametrize("name,R,dtype", [("tiny-llama", 1, "f32"), ("tiny-qwen3", 2, "f32"),
                                           ("tiny-qwen2", 2, "bf16")])
def test_fused_logits_bit_equal_to_unfused(name, R, dtype):
    """Fused ops round their intermediates like the unfused stores (lowering/reference.py):
    fp32 programs agree bit for bit; bf16 too when no residual add is fused (R > 1)."""
    toks, keep = [5, 17, 99, 3, 250, 42, 7, 8], [0, 7]
    got = {}
    for fuse in (False, True):
        s = pipeline.Compilation.build(f"config:{name}", R, LoweringConfig(
            max_seq=8, workers=2, tile=32, dtype=dtype, fuse=fuse))
        got[fuse] = s.decoder("sim", seed=1, policy="random").teacher_forced(toks, keep)
    for k in keep:
        assert torch.equal(got[False][k], got[True][k]), k


@pytest.mark.parametrize("name,R,dtype,algo", [("tiny-llama", 2, "bf16", "fused"), ("tiny-qwen2", 3, "bf16", "oneshot"),
                                                ("tiny-qwen3", 4, "f32", "fused")])
def test_fuse_reduce_logits_bit_equal(name, R, dtype, algo):
    """fuse_reduce (reduce_norm_gemv) rounds the all-reduce's sum and the norm like the
    reduce -> norm_gemv pair: logits agree bit for bit, bf16 included."""
    toks, keep = [5, 17, 99, 3, 250, 42, 7, 8], [0, 7]
    got = {}
    for fr in (False, True):
        s = pipeline.Compilation.build(f"config:{name}", R, LoweringConfig(
            max_seq=8, workers=2, tile=32, dtype=dtype, fuse=True, allreduce=algo, fuse_reduce=fr))
        assert s.verdict.ok and any(t.op == "reduce_norm_gemv" for t in s.program.tasks) == fr
        got[fr] = s.decoder("sim", seed=3, policy="adversarial").teacher_forced(toks, keep)
    for k in keep:
        assert torch.equal(got[False][k], got[True][k]), k


def test_fused_bf16_schedule_is_close_to_fp32_hf():
    s = _compilation("tiny-llama", 2, workers=2, dtype="bf16", fuse=True)
    rep = s.check(s.decoder("sim", seed=2, policy="random"), POSITIONS)
    assert rep.ok, rep.failures()
    assert 1e-4 < max(p.rel_err for p in rep.positions) < 5e-2


def test_bf16_schedule_is_close_to_fp32_hf():
    s = _compilation("tiny-qwen3", 2, workers=2, dtype="bf16")
    rep = s.check(s.decoder("sim", seed=1, policy="random"), POSITIONS)
    assert rep.ok, rep.failures()
    assert 1e-4 < max(p.rel_err for p in rep.positions) < 5e-2  # bf16 rounding is visible


def test_greedy_generation_matches_hf_generate_tiny():
    s = _compilation("tiny-qwen2", 3, workers=2)
    dec = s.decoder("sim", seed=3, policy="adversarial")
    prompt = [256, 72, 101, 108, 108, 111]
    new = dec.generate(prompt, 12, eos=pipeline.eos_ids(s.resolved.model))
    ref = pipeline.hf_generate(s.resolved.model, prompt, 12)
    assert new == ref
    assert dec.steps == len(prompt) + len(new) - 1


def test_first_divergence():
    assert pipeline.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert pipeline.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert pipeline.first_divergence([1, 2], [1, 2, 3]) == 2


def test_correctness_report_flags_wrong_logits():
    ref = {0: torch.tensor([1.0, 2.0, 3.0])}
    good = pipeline.compare(ref, {0: torch.tensor([1.0, 2.0, 3.0 + 1e-6])}, "f32")
    assert good.ok
    bad = pipeline.compare(ref, {0: torch.tensor([1.0, 3.5, 3.0])}, "f32")
    assert not bad.ok and "position 0" in bad.failures()[0]
    nan = pipeline.compare(ref, {0: torch.tensor([float("nan"), 2.0, 3.0])}, "f32")
    assert not nan.ok


def test_decoder_refuses_positions_beyond_the_cache():
    from ground.errors import AmkError

    s = _compilation("tiny-llama", 1)
    dec = s.decoder("sim")
    with pytest.raises(AmkError, match="max_seq"):
        dec.step(1, 32)


def test_hf_reference_emits_no_future_warning():
    """The HF reference hands its DynamicCache through the current keyword (``cache`` in
    transformers 5.x, where ``past_key_values`` raises a FutureWarning on every call)."""
    import warnings

    s = _compilation("tiny-llama", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        rep = s.check(s.decoder("sim"), POSITIONS)
        ref = pipeline.hf_generate(s.resolved.model, [256, 72, 105], 4)
    assert rep.ok and len(ref) == 4
    kw = pipeline.hf_cache_kwargs(s.resolved.model, "C")
    assert kw == {"cache": "C"} or kw == {"past_key_values": "C"}


def test_correctness_reports_progress_per_position():
    s = _compilation("tiny-qwen2", 2)
    seen: list[tuple[str, int, int]] = []
    rep = s.check(s.decoder("sim"), POSITIONS, progress=lambda *a: seen.append(a))
    assert rep.ok
    assert [d for p, d, _ in seen if p == "schedule"] == list(range(1, 33))
    assert [d for p, d, _ in seen if p == "hf"] == list(range(1, 33))
    assert {t for _, _, t in seen} == {32} and seen[-1][0] == "hf"


def test_compilation_lowers_from_shapes_alone():
    """weights=False: the graph comes from a meta-device model; the program is the one a
    compilation with weights builds, and the weights load when an executor needs them."""
    from ir.text import format_program

    cfg = LoweringConfig(max_seq=32, workers=2)
    meta = pipeline.Compilation.build("config:tiny-qwen3", 2, cfg, weights=False)
    full = pipeline.Compilation.build("config:tiny-qwen3", 2, cfg)
    assert not meta.has_weights and full.has_weights
    assert format_program(meta.program) == format_program(full.program)
    rep = meta.check(meta.decoder("sim"), POSITIONS)
    assert meta.has_weights and rep.ok and "load weights" in meta.timings


def test_check_is_skipped_when_memory_is_short(monkeypatch):
    cfg = LoweringConfig(max_seq=32)
    s = pipeline.Compilation.build("config:tiny-llama", 2, cfg, weights=False)
    need, detail = pipeline.check_memory(s)
    params = sum(p.numel() for p in s.resolved.model.parameters())
    assert need >= params * 4 + pipeline.MEMORY_HEADROOM
    assert detail.startswith(f"fp32 HF model {params * 4 / 2**30:.1f} GiB")
    assert pipeline.check_skip_reason(s, available=need) is None
    why = pipeline.check_skip_reason(s, available=need - 1)
    assert why.startswith(f"it needs about {need / 2**30:.1f} GiB (fp32 HF model") and \
        "of memory is available" in why
    assert pipeline.check_skip_reason(s, no_check=True) == "--no-check"


def test_cli_compile_skips_the_check_beyond_available_memory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "available_memory", lambda: 256 << 20)
    rc = main(["compile", "config:tiny-llama", "--tp", "2", "--out", str(tmp_path)])
    assert rc == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "correctness check skipped: it needs about 0.5 GiB" in err
    assert "0.2 GiB of memory is available" in err
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["ok"] and rep["correctness"]["ok"] is None
    assert rep["correctness"]["skipped"].startswith("it needs about")
    assert "load weights" not in rep["timings_s"]
    assert (tmp_path / "schedule.amk").is_file()


# -- the real SmolLM2-135M checkpoint -------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    res = pipeline.resolve("smollm2-135m")
    prompt = [int(t) for t in res.tokenizer("The capital of France is")["input_ids"]]
    return res, prompt


def _smollm2_decode(smollm2, R, n, seed=0, sim_policy="random", **knobs):
    res, prompt = smollm2
    cfg = LoweringConfig(max_seq=len(prompt) + n, **knobs)
    s = pipeline.Compilation.build("smollm2-135m", R, cfg, resolved=res)
    assert s.verdict.ok, [(f.cls, f.message) for f in s.verdict.errors[:3]]
    dec = s.decoder("sim", seed=seed, policy=sim_policy)
    return dec.generate(prompt, n, eos=pipeline.eos_ids(res.model)), dec


@pytest.fixture(scope="module")
def smollm2_ref32(smollm2):
    res, prompt = smollm2
    return pipeline.hf_generate(res.model, prompt, 32)


def test_smollm2_tp2_16_tokens_identical_to_hf(smollm2, smollm2_ref32):
    res, _ = smollm2
    new, dec = _smollm2_decode(smollm2, 2, 16, seed=1)
    assert new == smollm2_ref32[:16], (new, smollm2_ref32[:16])
    assert res.tokenizer.decode(new).startswith(" Paris")


def test_smollm2_tp2_fused_16_tokens_identical_to_hf(smollm2, smollm2_ref32):
    new, dec = _smollm2_decode(smollm2, 2, 16, seed=5, sim_policy="adversarial", fuse=True)
    assert new == smollm2_ref32[:16], (new, smollm2_ref32[:16])


@pytest.mark.slow
@pytest.mark.parametrize("R,seed,sim_policy,knobs", [
    (1, 0, "random", dict(workers=4)),
    (2, 2, "adversarial", dict(workers=4)),
    (3, 3, "random", dict(workers=3, allreduce="twoshot")),
    (4, 4, "adversarial", dict(workers=2, policy="balanced")),
])
def test_smollm2_32_tokens_identical_to_hf_all_tp(smollm2, smollm2_ref32, R, seed, sim_policy,
                                                  knobs):
    new, _ = _smollm2_decode(smollm2, R, 32, seed=seed, sim_policy=sim_policy, **knobs)
    assert new == smollm2_ref32


# -- random-weight models with real shapes (2 layers to fit CI) ------------------------------
def _shaped_model(kind: str):
    """Published shapes with the layer count cut to 2 (every width, head count, vocab and RoPE
    setting kept): llama-3.2-1b, qwen2.5-0.5b, and Qwen3-0.6B (hidden 1024, 16 x 128 heads,
    8 KV heads, intermediate 3072, vocab 151936, q/k norm)."""
    from transformers import AutoModelForCausalLM

    from models.recipes import _randomize_bias_and_norms, _qwen3, build_config

    if kind == "qwen3-0.6b":
        cfg = _qwen3(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                     num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
                     initializer_range=0.02)
    else:
        cfg = build_config(kind)
        cfg.num_hidden_layers = 2
        if hasattr(cfg, "layer_types") and cfg.layer_types:
            cfg.layer_types = cfg.layer_types[:2]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        _randomize_bias_and_norms(model, std=0.02)
    return model.eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-3.2-1b", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_shaped_models_logits_at_0_7_31(kind):
    model = _shaped_model(kind)
    g = import_model(model, name=kind)
    prog = lower(g, 2, config=LoweringConfig(max_seq=32, workers=4, tile=128))
    verdict, _ = pipeline.validate_program(prog)
    assert verdict.ok, [(f.cls, f.message) for f in verdict.errors[:3]]
    ex = pipeline.make_executor(prog, g, model.state_dict(), "sim", seed=5, policy="random",
                                check=False)
    rep = pipeline.check_correctness(model, pipeline.Decoder(prog, ex), g.spec.vocab)
    print(kind, json.dumps([p.to_json() for p in rep.positions]))
    assert rep.ok, rep.failures()
    assert all(p.argmax_agree for p in rep.positions)


# -- CLI --------------------------------------------------------------------------------------
def test_cli_compile_writes_schedule_and_report(tmp_path, capsys):
    out = tmp_path / "o"
    rc = main(["compile", "config:tiny-qwen3", "--tp", "2", "--workers", "2", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["ok"] and rep["ranks"] == 2 and rep["workers"] == 2
    assert rep["validation"]["ok"] and rep["validation"]["seconds"] >= 0
    assert rep["counts"]["tasks"] > 0 and len(rep["counts"]["tasks_per_rank"]) == 2
    assert [p["pos"] for p in rep["correctness"]["positions"]] == list(POSITIONS)
    assert rep["cost"]["seq_len_1"]["predicted_latency_us"] > 0
    assert "predicted" in rep["cost"]["seq_len_1"]["label"]
    from ir.io import load_program

    a = load_program(out / "schedule.amk")
    b = load_program(out / "schedule.json")
    assert a == b and len(a.tasks) == rep["counts"]["tasks"]


def test_cli_compile_fails_with_exit_1_on_wrong_logits(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(pipeline.REL_TOL, "f32", -1.0)
    rc = main(["compile", "config:tiny-llama", "--tp", "2", "--out", str(tmp_path)])
    assert rc == 1
    assert "correctness check failed" in capsys.readouterr().err
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["ok"] is False and "correctness" in rep["failure"]


def test_cli_compile_fails_with_exit_1_when_rejected(tmp_path, monkeypatch, capsys):
    from validator.verdict import Finding, Verdict

    monkeypatch.setattr(pipeline, "validate_program",
                        lambda p: (Verdict([Finding("Deadlock", "planted")]), 0.0))
    rc = main(["compile", "config:tiny-llama", "--out", str(tmp_path)])
    assert rc == 1
    assert "Deadlock" in capsys.readouterr().err
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["validation"]["ok"] is False


def test_cli_bad_config_and_unsupported_model(tmp_path, capsys):
    bad = tmp_path / "k.json"
    bad.write_text('{"tile": -1}')
    assert main(["compile", "config:tiny-llama", "--config", str(bad)]) == 2
    assert "'tile'" in capsys.readouterr().err
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, hidden_act="gelu")
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "gelu")
    assert main(["compile", str(tmp_path / "gelu")]) == 2
    err = capsys.readouterr().err
    assert "hidden_act" in err and "gelu" in err


def test_cli_generate_verify_json(capsys):
    rc = main(["generate", "config:tiny-qwen2", "--prompt", "Hello", "--max-new-tokens", "6",
               "--tp", "3", "--workers", "2", "--verify", "--json", "--sim-policy", "adversarial"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["match"] is True and out["first_divergence"] is None
    assert out["tokens"] == out["reference_tokens"] and len(out["tokens"]) == 6
    assert isinstance(out["text"], str)


def test_validator_refuses_a_fused_allreduce_tile_without_its_peer_signal():
    """allreduce ``fused``: a GEMV tile's peer stores (mirror outputs) are pending remote
    writes like a put's. Move one tile's signal to the peer onto another tile (the counts
    still add up, so no deadlock): the peer's reduce may then read the first tile's rows
    before they are delivered, and the validator names that race."""
    import dataclasses

    from ir.program import Signal

    s = _compilation("tiny-llama", 2, workers=3, tile=32, allreduce="fused")
    assert s.verdict.ok
    p = s.program
    tiles = [i for i, t in enumerate(p.tasks) if len(t.outs) > 1
             and any(sg.counter == "c.l0.attn.from0.r1" for sg in t.signals)]
    assert len(tiles) >= 2
    a, b = p.tasks[tiles[0]], p.tasks[tiles[1]]
    p.tasks[tiles[0]] = dataclasses.replace(a, signals=tuple(sg for sg in a.signals
                                                             if sg.counter != "c.l0.attn.from0.r1"))
    p.tasks[tiles[1]] = dataclasses.replace(b, signals=tuple(
        Signal(sg.counter, 2) if sg.counter == "c.l0.attn.from0.r1" else sg for sg in b.signals))
    verdict, _ = pipeline.validate_program(p)
    assert not verdict.ok
    assert any(f.cls == "RemoteReadBeforeDelivery" and a.id in f.message for f in verdict.errors), \
        [(f.cls, f.message) for f in verdict.errors[:3]]


def test_validator_refuses_a_reduce_norm_gemv_that_skips_a_peer_wait():
    """fuse_reduce: a reduce_norm_gemv tile reads the peers' rows of the receive buffer
    itself. Drop the wait on one peer's arrival counter from every task of the tile's worker
    (the tile and the reduce task queued before it, whose wait would otherwise order the
    tile's read by program order): the tile may then read that peer's rows before they are
    delivered, and the validator refuses the program, naming the tile."""
    import dataclasses

    s = _compilation("tiny-llama", 2, workers=3, tile=32, fuse=True, allreduce="fused", fuse_reduce=True)
    assert s.verdict.ok
    p, arrive = s.program, "c.l0.attn.from1.r0"
    tile = next(t for t in p.tasks if t.op == "reduce_norm_gemv" and t.rank == 0
                and any(w.counter == arrive for w in t.waits))
    for i, t in enumerate(p.tasks):
        if (t.rank, t.worker) == (0, tile.worker):
            p.tasks[i] = dataclasses.replace(t, waits=tuple(w for w in t.waits if w.counter != arrive))
    verdict, _ = pipeline.validate_program(p)
    assert not verdict.ok
    assert any(tile.id in f.message for f in verdict.errors), [(f.cls, f.message) for f in verdict.errors[:3]]
