"""``amk generate`` over the Python API: streaming and --no-stream, --chat, --json's fields,
--prefill 1|0, sampling flags and their refusals (one line, exit code 2)."""

from __future__ import annotations

import json

import pytest

from amk.cli import main
from tests.test_cli_inputs import amk, one_line_error

MODEL = "config:tiny-llama"
BASE = ["--max-new-tokens", "5", "--workers", "2", "--max-seq", "32"]


@pytest.mark.parametrize("argv,line", [
    (["--do-sample", "--top-p", "0"], "error: --top-p must be in (0, 1], got 0.0"),
    (["--do-sample", "--top-p", "1.01"], "error: --top-p must be in (0, 1], got 1.01"),
    (["--do-sample", "--temperature", "0"],
     "error: --temperature must be > 0 with --do-sample, got 0.0 (greedy decoding is the default without it)"),
    (["--do-sample", "--top-k", "0"], "error: --top-k must be an integer >= 1, got 0"),
    (["--top-p", "0.9"], "error: --top-p only applies to sampling; add --do-sample"),
    (["--do-sample", "--verify"],
     "error: --verify compares with HF greedy decoding; it cannot be used with --do-sample"),
    (["--do-sample", "--temperature", "nan"], "error: --temperature must be a finite number, got nan"),
])
def test_bad_sampling_arguments_are_one_line(argv, line):
    assert one_line_error(amk("generate", MODEL, "--prompt", "hi", *argv)) == line


def test_chat_without_a_template_is_refused():
    line = one_line_error(amk("generate", MODEL, "--prompt", "hi", "--chat", *BASE))
    assert line == ("error: --chat: config:tiny-llama's tokenizer has no chat template (use a model "
                    "that ships one, e.g. smollm2-135m, or drop --chat)")


def test_stream_and_no_stream_print_the_same_text():
    streamed = amk("generate", MODEL, "--prompt", "Hello", *BASE)
    plain = amk("generate", MODEL, "--prompt", "Hello", *BASE, "--no-stream")
    assert streamed.returncode == plain.returncode == 0, streamed.stderr + plain.stderr
    assert streamed.stdout == plain.stdout and streamed.stdout.startswith("Hello")
    for r in (streamed, plain):  # stdout is the text alone; the summary is on stderr
        assert "first token after" not in r.stdout and "first token after" in r.stderr


def test_streaming_puts_each_token_as_it_comes(monkeypatch, capsys):
    from amk.commands import generate

    puts = []
    real = generate._Printer

    def recording(tok):
        s = real(tok)
        put = s.put
        s.put = lambda v: (puts.append(v.tolist()), put(v))[1]
        return s
    monkeypatch.setattr(generate, "_Printer", recording)
    assert main(["generate", MODEL, "--prompt", "Hello", *BASE]) == 0
    out = capsys.readouterr().out
    assert len(puts) == 1 + 5 and all(len(p) == 1 for p in puts[1:])  # prompt, then one per token
    puts.clear()
    assert main(["generate", MODEL, "--prompt", "Hello", *BASE, "--no-stream"]) == 0
    assert puts == [] and capsys.readouterr().out == out


def test_json_fields_and_prefill_off(capsys):
    assert main(["generate", MODEL, "--prompt", "Hello", *BASE, "--json", "--verify"]) == 0
    on = json.loads(capsys.readouterr().out)
    for key in ("tokens", "text", "ttft_ms", "tokens_per_s", "prefill", "prompt_tokens", "steps",
                "seconds", "sampling", "match"):
        assert key in on, key
    assert on["ok"] and on["match"] and on["prefill"] is True and len(on["tokens"]) == 5
    assert on["steps"] == 5 and on["ttft_ms"] > 0 and on["tokens_per_s"] > 0
    assert main(["generate", MODEL, "--prompt", "Hello", *BASE, "--json", "--prefill", "0"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["prefill"] is False and off["tokens"] == on["tokens"]
    assert off["steps"] == len(off["prompt_tokens"]) + 5 - 1


def test_sampling_is_reproducible_and_seeded(capsys):
    runs = []
    for seed in ("3", "3", "4"):
        assert main(["generate", MODEL, "--prompt", "Hello", *BASE, "--json", "--do-sample",
                     "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--sample-seed", seed,
                     "--tp", "2"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["tokens"] == runs[1]["tokens"] != runs[2]["tokens"]
    assert runs[0]["sampling"] == {"do_sample": True, "temperature": 1.5, "top_k": 50, "top_p": 0.95,
                                   "seed": 3}


@pytest.mark.parametrize("margin,ok", [(1e-4, True), (50.0, False)])
def test_bf16_verify_applies_the_near_tie_rule(capsys, monkeypatch, margin, ok):
    """A bf16 schedule whose tokens depart from HF's fp32 greedy ones passes --verify (exit 0,
    the rule's note in ``verdict``) only when HF's fp32 top-2 margin at that token is within
    4 x its own bf16 noise there; an f32 schedule is never judged so (exit 1)."""
    import amk.baselines as B
    from amk import pipeline

    hf = pipeline.hf_generate
    monkeypatch.setattr(pipeline, "hf_generate",  # HF "picks" another token at new token 2
                        lambda model, prompt, n: [t + 1 if i == 2 else t for i, t in enumerate(hf(model, prompt, n))])
    seen = []

    def margins(model, ids, tokens):
        seen.append(next(p.dtype for p in model.parameters()))
        return B.TokenReference(list(tokens), [margin] * len(tokens), [0.01] * len(tokens))
    monkeypatch.setattr(B, "bf16_margins", margins)
    rc = main(["generate", MODEL, "--prompt", "Hello", *BASE, "--dtype", "bf16", "--json", "--verify"])
    out = json.loads(capsys.readouterr().out)
    assert (rc == 0) == ok and out["ok"] == ok and out["match"] is False and out["first_divergence"] == 2
    assert ("a bf16 near-tie" in out["verdict"]) == ok and "diverges at token 2" in out["verdict"]
    assert seen == [__import__("torch").float32]  # judged against the fp32 model
    assert main(["generate", MODEL, "--prompt", "Hello", *BASE, "--dtype", "f32", "--json", "--verify"]) == 1
    assert "verdict" not in json.loads(capsys.readouterr().out) and len(seen) == 1


def test_bf16_margins_of_a_model_that_refuses_float():
    """bf16_margins gives per-token fp32 top-2 margins and bf16-vs-fp32 noise, and casts with
    ``.to(dtype)``, which GGUF-loaded models allow (their ``.float()`` raises)."""
    import torch

    from amk.baselines import bf16_margins
    from models.recipes import build_model

    model = build_model("tiny-llama").float().eval()
    model.float = lambda: (_ for _ in ()).throw(ValueError(".float() is not supported"))
    ids = torch.tensor([[1, 5, 9]])
    toks = [3, 4, 7, 2]
    ref = bf16_margins(model, ids, toks)
    with torch.no_grad():
        hi = model(input_ids=torch.tensor([[1, 5, 9, *toks]])).logits[0, 2:6]
    top2 = hi.topk(2, dim=-1).values
    assert ref.tokens == toks and len(ref.noise) == 4
    torch.testing.assert_close(torch.tensor(ref.margin), top2[:, 0] - top2[:, 1])
    assert all(z > 0 for z in ref.noise)
