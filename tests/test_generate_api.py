"""The Python API (amk/api.py), the prefill (amk/prefill.py) and sampling (amk/sampling.py)
on the sim backend with the tiny built-in configs.

* sampling: top_k=1 equals greedy; with a fixed seed the tokens equal a reference sampler
  written here from the definitions over the same logits; both ranks of tp 2 draw the same
  token, and ranks that draw differently are an error;
* prefill: the logits after the prefill match token-by-token feeding and the greedy
  continuation is identical (tiny-llama, tiny-qwen2, tiny-qwen3 at tp 1 and 2);
* compile, generate, save, load (no lowering, no validation), generate again; a missing or
  corrupt saved directory is one AmkError line.
"""

from __future__ import annotations

import json

import pytest
import torch

import amk
from amk.prefill import Prefiller, cache_slots
from amk.sampling import Sampler, SamplingParams, sample
from ground.errors import AmkError
from lowering.config import LoweringConfig

CFG = LoweringConfig(max_seq=32, workers=2, tile=32)
PROMPT = [256, 72, 101, 108, 108, 111, 32, 119, 111, 114]


@pytest.fixture(scope="module")
def models():
    """Compiled tiny models, one per (name, tp), built on first use."""
    cache = {}

    def get(name: str = "tiny-llama", tp: int = 1):
        if (name, tp) not in cache:
            cache[name, tp] = amk.compile(f"config:{name}", tp=tp, backend="sim", config=CFG)
        return cache[name, tp]
    return get


# -- the reference sampler, from the definitions ----------------------------------------------
def reference_sample(logits: torch.Tensor, temperature: float, top_k: int | None,
                     top_p: float | None, g: torch.Generator) -> int:
    """Temperature scaling; top-k: keep the k largest logits (and ties with the k-th);
    top-p: keep the smallest set of most probable tokens whose cumulative probability is
    >= p; then one torch.multinomial draw with ``g``."""
    x = logits.double() / temperature
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None and top_k < x.numel():
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        keep &= x >= kth
    if top_p is not None:
        p = torch.softmax(x.masked_fill(~keep, float("-inf")), 0)
        order = sorted(range(x.numel()), key=lambda i: -float(p[i]))
        chosen, mass = set(), 0.0
        for i in order:  # smallest prefix reaching top_p
            if mass >= top_p:
                break
            chosen.add(i)
            mass += float(p[i])
        keep &= torch.tensor([i in chosen for i in range(x.numel())])
    probs = torch.softmax(x.masked_fill(~keep, float("-inf")).float(), 0)
    return int(torch.multinomial(probs, 1, generator=g)[0])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 20, None),
                                                     (1.3, None, 0.8), (0.9, 50, 0.9), (2.0, 3, 0.5)])
def test_sample_equals_the_reference_sampler(temperature, top_k, top_p):
    gl = torch.Generator().manual_seed(11)
    params = SamplingParams(True, temperature, top_k, top_p)
    g_amk, g_ref = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(40):
        logits = torch.randn(300, generator=gl) * 3
        assert sample(logits, params, g_amk) == reference_sample(logits, temperature, top_k, top_p, g_ref)


class Recording(Sampler):
    """A Sampler that records, per rank, the logits it was given and the token it drew."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[int, torch.Tensor, int]] = []

    def pick(self, rank, logits):
        tok = super().pick(rank, logits)
        self.seen.append((rank, logits.clone(), tok))
        return tok


def test_generated_tokens_equal_the_reference_sampler_over_the_same_logits(models, monkeypatch):
    m = models("tiny-qwen2", 1)
    rec = []

    import amk.sampling as sm
    monkeypatch.setattr(sm, "Sampler", lambda *a, **kw: rec.append(Recording(*a, **kw)) or rec[-1])
    out = m.generate(PROMPT, 8, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=1234,
                     eos_token_id=[], return_dict_in_generate=True)
    seen = rec[0].seen
    assert len(out.tokens) == 8 and [t for _, _, t in seen] == out.tokens
    g = torch.Generator().manual_seed(1234)
    assert [reference_sample(lg, 0.8, 40, 0.9, g) for _, lg, _ in seen] == out.tokens
    again = m.generate(PROMPT, 8, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=1234,
                       eos_token_id=[])
    assert again[0, len(PROMPT):].tolist() == out.tokens  # reproducible run to run
    other = m.generate(PROMPT, 8, do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=1,
                       eos_token_id=[])
    assert other[0, len(PROMPT):].tolist() != out.tokens


def test_top_k_1_equals_greedy(models):
    m = models("tiny-llama", 1)
    greedy = m.generate(PROMPT, 10, eos_token_id=[])
    assert torch.equal(m.generate(PROMPT, 10, do_sample=True, top_k=1, seed=7, eos_token_id=[]), greedy)
    assert torch.equal(m.generate(PROMPT, 10, do_sample=True, top_k=1, temperature=0.3, seed=8,
                                  eos_token_id=[]), greedy)


def test_tp2_ranks_draw_the_same_token(models, monkeypatch):
    m = models("tiny-llama", 2)
    rec = []
    import amk.sampling as sm
    monkeypatch.setattr(sm, "Sampler", lambda *a, **kw: rec.append(Recording(*a, **kw)) or rec[-1])
    out = m.generate(PROMPT, 6, do_sample=True, temperature=1.5, seed=3, eos_token_id=[],
                     return_dict_in_generate=True)
    seen = rec[0].seen
    by_rank = {r: [t for q, _, t in seen if q == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1] == out.tokens
    for (r0, l0, _), (r1, l1, _) in zip(seen[::2], seen[1::2]):
        assert (r0, r1) == (0, 1) and torch.equal(l0, l1)  # the same gathered logits


def test_ranks_that_draw_differently_are_an_error(models):
    m = models("tiny-llama", 2)
    dec = m.decoder
    s = Sampler(SamplingParams(True, 3.0), 0, [0, 1])
    s.generators[1].manual_seed(99)  # rank 1 seeded differently: it draws other tokens
    with pytest.raises(AmkError, match="ranks disagree on the sampled token") as e:
        dec.generate(PROMPT, 12, sampler=s)
    assert e.value.exit_code == 1


@pytest.mark.parametrize("kw,msg", [
    (dict(do_sample=True, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(do_sample=True, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    (dict(do_sample=True, temperature=0.0), "temperature must be > 0 with do_sample"),
    (dict(do_sample=True, temperature=-1.0), "temperature must be > 0 with do_sample"),
    (dict(do_sample=True, top_k=0), "top_k must be an integer >= 1, got 0"),
    (dict(top_k=5), "top_k only applies to sampling; add do_sample"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    (dict(max_new_tokens=40), "exceed the schedule's max_seq 32"),
    (dict(input_ids=[[1, 2], [3, 4]]), "batch size 2"),
    (dict(input_ids=[5, 100000]), "token id 100000 is outside the vocabulary"),
])
def test_generate_refuses_bad_arguments(models, kw, msg):
    m = models("tiny-llama", 1)
    kw = {"input_ids": PROMPT, **kw}
    with pytest.raises(AmkError) as e:
        m.generate(**kw)
    assert msg in str(e.value) and "\n" not in str(e.value) and e.value.exit_code == 2


# -- prefill ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("tp", [1, 2])
def test_prefill_matches_token_by_token(models, name, tp):
    m = models(name, tp)
    s = m.compilation
    slow, fast = s.decoder("sim", seed=1), s.decoder("sim", seed=2)
    pf = Prefiller(s.resolved.model, s.program, fast.ex, "f32")
    assert slow.generate(PROMPT, 1) == fast.generate(PROMPT, 1, prefill=pf.fill)
    assert fast.steps == 1 and slow.steps == len(PROMPT)
    a, b = slow.logits(), fast.logits()
    assert (a - b).abs().max() <= 1e-5 * max(1.0, float(a.abs().max()))
    # the caches hold the same rows 0..T-1 (every rank's slice of the KV heads)
    for (i, r), _ in cache_slots(s.program).items():
        for c in ("kc", "vc"):
            x, y = (d.ex.read(f"{c}.l{i}.r{r}", r)[:, :len(PROMPT)] for d in (slow, fast))
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-5), (c, i, r)
    # the greedy continuation is identical, through the API
    one = m.generate(PROMPT, 10, eos_token_id=[], prefill=False)
    two = m.generate(PROMPT, 10, eos_token_id=[], prefill=True)
    assert torch.equal(one, two)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_prefill_in_bf16_is_as_close_to_fp32_as_token_by_token(name):
    """bf16: the prefill (HF's bf16 forward) and the schedule's own bf16 steps round
    differently, so the rule is pipeline.BF16_NOISE_FACTOR's: the logits after the prefill
    are about as close to the fp32 logits as token-by-token feeding's are."""
    from amk.pipeline import BF16_NOISE_FACTOR

    m = amk.compile(f"config:{name}", tp=2, config=CFG.replace(dtype="bf16"))
    s = m.compilation
    slow, fast = s.decoder("sim"), s.decoder("sim")
    slow.generate(PROMPT, 1)
    fast.generate(PROMPT, 1, prefill=Prefiller(s.resolved.model, s.program, fast.ex, "bf16").fill)
    with torch.no_grad():
        ref = s.resolved.model(torch.tensor([PROMPT])).logits[0, -1]
    e_slow = float((slow.logits() - ref).abs().max())
    e_fast = float((fast.logits() - ref).abs().max())
    assert 0 < e_fast <= BF16_NOISE_FACTOR * e_slow + 1e-3, (e_fast, e_slow)


def test_generate_output_fields(models):
    m = models("tiny-llama", 1)
    o = m.generate(PROMPT, 5, eos_token_id=[], return_dict_in_generate=True)
    assert o.sequences.dtype == torch.int64 and o.sequences.shape == (1, len(PROMPT) + 5)
    assert o.sequences[0, :len(PROMPT)].tolist() == PROMPT and o.prompt_tokens == PROMPT
    assert o.steps == 5 and o.prefill and 0 < o.prefill_s <= o.ttft_s <= o.seconds
    assert o.tokens_per_s > 0
    # a [1, T] tensor in, the same tokens out; a streamer sees the prompt then each token
    seen = []

    class Streamer:
        def put(self, v):
            seen.append(v.tolist())

        def end(self):
            seen.append("end")
    seq = m.generate(torch.tensor([PROMPT]), 5, eos_token_id=[], streamer=Streamer())
    assert torch.equal(seq, o.sequences)
    assert seen == [[PROMPT]] + [[t] for t in o.tokens] + ["end"]


def test_prefill_on_the_triton_backend_matches_token_by_token(tmp_path):
    """The triton executor (the CPU interpreter here, the megakernel on a GPU): the prefill
    writes its arena's caches, and the logits and tokens that follow equal step-by-step
    feeding's (tp 2, each rank its KV-head slice). Saved, the kernel source comes along."""
    m = amk.compile("config:tiny-qwen3", tp=2, backend="triton", config=CFG.replace(max_seq=8))
    s, prompt = m.compilation, PROMPT[:5]
    slow = m.decoder
    fast = s.decoder("triton")
    a = slow.generate(prompt, 1)
    la = slow.logits()
    b = fast.generate(prompt, 1, prefill=Prefiller(s.resolved.model, s.program, fast.ex, "f32").fill)
    assert a == b and fast.steps == 1 and slow.steps == len(prompt)
    assert (la - fast.logits()).abs().max() <= 1e-4 * max(1.0, float(la.abs().max()))
    d = m.save(tmp_path / "t")
    assert sorted(p.name for p in d.iterdir()) == ["amk.json", "kernel.py", "schedule.json"]
    assert "amk_megakernel" in (d / "kernel.py").read_text()


def test_warm_prepare_changes_no_tokens(models):
    cold = models("tiny-qwen2", 1).generate(PROMPT, 6, eos_token_id=[])
    m = amk.compile("config:tiny-qwen2", tp=1, backend="sim", config=CFG)
    m.prepare(prefill=True, warm=True)
    assert m.decoder.steps == 1  # the warm-up step
    for pf in (True, False):
        assert torch.equal(m.generate(PROMPT, 6, eos_token_id=[], prefill=pf), cold)


# -- compile, save, load ---------------------------------------------------------------------
def test_save_and_load_without_recompiling(models, tmp_path, monkeypatch):
    m = models("tiny-qwen3", 2)
    ref = m.generate("Hello", 6, eos_token_id=[])
    d = m.save(tmp_path / "m")
    assert sorted(p.name for p in d.iterdir()) == ["amk.json", "schedule.json"]

    import lowering.lower
    import validator
    from amk import pipeline

    def boom(*a, **kw):
        raise AssertionError("load lowered or validated")
    monkeypatch.setattr(lowering.lower, "lower", boom)
    monkeypatch.setattr(validator, "validate", boom)
    monkeypatch.setattr(pipeline, "validate_program", boom)
    m2 = amk.load(d)
    assert m2.tp == 2 and m2.backend == "sim" and m2.config == m.config
    assert torch.equal(m2.generate("Hello", 6, eos_token_id=[]), ref)
    assert torch.equal(m2.generate("Hello", 6, eos_token_id=[], prefill=False), ref)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and e.value.exit_code == 2
    return msg


def test_load_refuses_missing_and_corrupt_directories(models, tmp_path):
    with pytest.raises(AmkError) as e:
        amk.load(tmp_path / "nope")
    assert "not a directory" in _one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AmkError) as e:
        amk.load(tmp_path / "empty")
    assert "not a saved amk model (amk.json is missing)" in _one_line(e)

    d = models("tiny-llama", 1).save(tmp_path / "m")
    man = (d / "amk.json").read_text()
    (d / "amk.json").write_text(man[:40])
    with pytest.raises(AmkError) as e:
        amk.load(d)
    assert "amk.json:" in _one_line(e) and "invalid JSON" in str(e.value)

    (d / "amk.json").write_text(man)
    sched = (d / "schedule.json").read_text()
    (d / "schedule.json").write_text(sched.replace('"ranks": 1', '"ranks": 2', 1))
    with pytest.raises(AmkError) as e:
        amk.load(d)
    assert "does not match the sha256" in _one_line(e)

    (d / "schedule.json").unlink()
    with pytest.raises(AmkError) as e:
        amk.load(d)
    assert "cannot read the saved schedule" in _one_line(e)

    bad = json.loads(man)
    bad["tp"] = "two"
    (d / "amk.json").write_text(json.dumps(bad))
    with pytest.raises(AmkError) as e:
        amk.load(d)
    assert "field 'tp' is missing or not a int" in _one_line(e)


def test_compile_refuses_bad_arguments():
    for kw, msg in ((dict(backend="cuda"), "unknown backend 'cuda'"), (dict(tp=0), "--tp must be >= 1"),
                    (dict(config=3), "config must be None"),
                    (dict(config={"lowering": {"tile": "x"}}), "tile")):
        with pytest.raises(AmkError, match=msg):
            amk.compile("config:tiny-llama", **kw)


def test_import_amk_is_cheap():
    import subprocess
    import sys

    code = "import sys, amk; print(sorted(m for m in ('torch', 'transformers', 'amk.api') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
