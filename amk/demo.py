"""Greedy generation of a model through plain transformers (``python -m amk.demo``).

The ``make demo`` target runs this on the real SmolLM2-135M-Instruct checkpoint until amk's
own ``compile``/``generate`` commands exist; it is the eager HF reference those will match.

    python -m amk.demo [--model smollm2-135m] [--prompt "The capital of France is"] [--tokens 16]

Prints the prompt and the greedy continuation. Exit 2 with a one-line message on a bad MODEL.
"""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_PROMPT = "The capital of France is"


def greedy_generate(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy (argmax) continuation of ``prompt`` with HF ``generate``; returns only new text.

    No chat template: the prompt is tokenized as is (with the tokenizer's BOS rule).
    """
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    from ground.errors import AmkError
    from models.sources import resolve_model

    p = argparse.ArgumentParser(prog="python -m amk.demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"MODEL argument (default {DEFAULT_MODEL})")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--tokens", type=int, default=16, help="new tokens to generate (default 16)")
    args = p.parse_args(argv)
    try:
        t0 = time.perf_counter()
        resolved = resolve_model(args.model)
        tokenizer = resolved.tokenizer
        t1 = time.perf_counter()
        text = greedy_generate(resolved.model, tokenizer, args.prompt, args.tokens)
        t2 = time.perf_counter()
    except AmkError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(f"model:  {resolved.source.describe()}")
    print(f"load {t1 - t0:.1f} s, greedy generation of {args.tokens} tokens {t2 - t1:.1f} s "
          "(transformers eager, CPU)")
    print(f"prompt: {args.prompt!r}")
    print(f"output: {text!r}")
    print(f"{args.prompt}{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
