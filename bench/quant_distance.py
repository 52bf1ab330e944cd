"""How far a quantized megakernel is from the unquantized model, measured with the megakernel
itself: on the GPU with ``--backend triton``, with the sim on the CPU.

For the unquantized config and each format of ``--weights`` (int8, fp8, q8_0), the same model is
compiled and run:

* greedy agreement: the unquantized HF model's ``--tokens`` greedy tokens after a fixed prompt
  (lowering.quant.EVAL_PROMPT) are fed to the megakernel one by one (teacher-forced); the
  fraction of positions where its argmax is the reference's next token, and the common prefix of
  its own greedy run with the reference;
* perplexity on a fixed text (lowering.quant.EVAL_TEXT; ``--text-tokens`` caps its length) from
  the megakernel's logits at every position, and its ratio to the unquantized megakernel's.

HF's own perplexity (the model in ``--dtype``) is printed beside. A model without a tokenizer
(``config:NAME``) takes seeded token ids for the prompt and the text. Prints a table, writes
``--out`` (JSON) atomically after every row (``partial: true`` until the end). Exit code 0, 1 when
a row misses ``--max-ppl-ratio`` or ``--min-match``, 2 for bad input.

    python bench/quant_distance.py smollm2-135m --weights int8,fp8 --backend triton --out d.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "bench"):  # run as `python bench/quant_distance.py`, or imported by a path
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from ground.errors import AmkError, run_main  # noqa: E402
from quant import parse_formats  # noqa: E402  (bench/quant.py: the same --weights list)

NAME = "bench/quant_distance.py"


def parser() -> argparse.ArgumentParser:
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags

    ap = argparse.ArgumentParser(prog=NAME, description=__doc__.splitlines()[0])
    ap.add_argument("model", metavar="MODEL", help="an alias, a checkpoint or config:NAME (as amk compile)")
    ap.add_argument("--weights", dest="formats", default="int8,fp8", metavar="int8,fp8",
                    help="comma list of the quantized formats (int8, fp8, q8_0; default int8,fp8)")
    ap.add_argument("--backend", choices=("sim", "triton"), default="triton", help="default triton (a GPU)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared (default 64)")
    ap.add_argument("--text-tokens", type=int, default=0,
                    help="at most this many tokens of the text (0: all of it)")
    ap.add_argument("--min-match", type=float, default=0.0, help="fail a row below this greedy agreement")
    ap.add_argument("--max-ppl-ratio", type=float, default=0.0,
                    help="fail a row whose perplexity ratio to the unquantized megakernel's exceeds this (0: off)")
    ap.add_argument("--out", metavar="FILE", default=None, help="write the result (JSON) to FILE, atomically")
    add_flags(ap.add_argument_group("lowering knobs (docs/lowering.md)"), LoweringConfig,
              skip=("weights", "weight_group"))
    add_flags(ap.add_argument_group("kernel knobs (docs/triton.md)"), KernelConfig)
    return ap


def inputs(resolved, n_text: int) -> tuple[list[int], list[int], str]:
    """(prompt ids, text ids, where they came from): the tokenizer's encoding of EVAL_PROMPT and
    EVAL_TEXT, else seeded ids (16 and 256 of them); the text cut to ``n_text`` ids (0: all)."""
    from amk.pipeline import check_tokens
    from lowering import quant

    tok = getattr(resolved, "tokenizer", None)
    if tok is not None:
        prompt = list(tok(quant.EVAL_PROMPT)["input_ids"])
        text = list(tok((ROOT / quant.EVAL_TEXT).read_text())["input_ids"])
        source = f"{quant.EVAL_TEXT} and EVAL_PROMPT, tokenized"
    else:
        vocab = resolved.model.config.vocab_size
        prompt, text, source = check_tokens(vocab, 16, 1), check_tokens(vocab, 256, 2), "seeded token ids"
    return prompt, text[:n_text] if n_text else text, source


def measure_format(compilation, backend: str, prompt: list[int], ref: list[int], text: list[int],
                   options: dict | None = None) -> dict:
    """One config's numbers from its decoder: ``greedy_match`` / ``forced_prefix`` (teacher-
    forced argmax against ``ref`` after ``prompt``), ``greedy_prefix`` (its own greedy run's
    common prefix with ``ref``), ``ppl`` (on ``text``) and the seconds it took."""
    import torch

    from lowering import quant

    t0 = time.perf_counter()
    dec = compilation.decoder(backend, policy="in_order", backend_options=options)
    seq = list(prompt) + list(ref)
    at = list(range(len(prompt) - 1, len(seq) - 1))
    got = dec.teacher_forced(seq, at)
    match, forced_prefix = quant.agreement([int(got[p].argmax()) for p in at], ref)
    _, prefix = quant.agreement(dec.generate(prompt, len(ref)), ref)
    lg = dec.teacher_forced(text, list(range(len(text) - 1)))
    ppl = quant.logits_perplexity(torch.stack([lg[p] for p in range(len(text) - 1)]), text)
    return {"greedy_match": match, "forced_prefix": forced_prefix, "greedy_prefix": prefix, "ppl": ppl,
            "seconds": round(time.perf_counter() - t0, 1)}


def measure(args: argparse.Namespace, formats: list[str], progress, checkpoint=lambda r: None) -> dict:
    """Every row (the unquantized config first); see the module doc."""
    import copy

    import torch

    from amk import pipeline
    from amk.bench import cuda_target
    from lowering import quant
    from lowering.config import KernelConfig, LoweringConfig, weight_knobs
    from lowering.knobs import given
    from lowering.triton.blocks import kernel_options

    gpu = args.backend == "triton"
    if gpu and not torch.cuda.is_available():
        raise AmkError("--backend triton needs a CUDA GPU; none is visible here (or pass --backend sim)")
    progress(f"resolving {args.model}")
    resolved = pipeline.resolve(args.model)
    prompt, text, source = inputs(resolved, args.text_tokens)
    low = given(args, LoweringConfig)
    low.setdefault("dtype", "bf16" if gpu else "f32")
    low.setdefault("fuse", True)
    low.setdefault("max_seq", max(256, len(text), len(prompt) + args.tokens))
    if gpu:
        props = torch.cuda.get_device_properties(0)
        low.setdefault("workers", props.multi_processor_count)
        target = cuda_target(props)
    else:
        target = None
    kernel = KernelConfig(**given(args, KernelConfig)).validate(NAME)
    options = kernel_options(kernel) if gpu else None
    dev = torch.device("cuda" if gpu else "cpu")
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}[low["dtype"]]
    hf = copy.deepcopy(resolved.model).to(dev, dt).eval()  # the compilations read the fp32 weights
    progress(f"HF {low['dtype']}: {args.tokens} greedy tokens, perplexity on {len(text)} tokens")
    ref = quant.greedy_tokens(hf, prompt, args.tokens)
    hf_ppl = quant.perplexity(hf, text)
    del hf
    meta = {"model": args.model, "backend": args.backend, "device": torch.cuda.get_device_name(0) if gpu else "cpu",
            "inputs": source, "prompt_tokens": len(prompt), "text_tokens": len(text), "tokens": args.tokens,
            "hf_ppl": hf_ppl, "reference_tokens": ref, "command": " ".join(sys.argv), "kernel": kernel.to_json()}
    rows: list[dict] = []
    for fmt in ["none", *formats]:
        cfg = LoweringConfig(**{**low, **weight_knobs(fmt)}).validate(NAME, ranks=1)
        progress(f"{fmt}: lower, validate; the prompt and {args.tokens} tokens twice, {len(text)} text tokens "
                 f"({args.backend})")
        comp = pipeline.Compilation.build(args.model, 1, cfg, target, resolved=resolved)
        if not comp.verdict.ok:
            raise AmkError(f"{fmt}: the validator rejected the schedule", exit_code=1)
        r = {"weights": fmt, "config": cfg.to_json(), **measure_format(comp, args.backend, prompt, ref, text, options)}
        base = rows[0]["ppl"] if rows else r["ppl"]
        r["ppl_ratio"] = r["ppl"] / base
        r["ppl_ratio_hf"] = r["ppl"] / hf_ppl
        r["ok"] = (r["greedy_match"] >= args.min_match
                   and (not args.max_ppl_ratio or fmt == "none" or r["ppl_ratio"] <= args.max_ppl_ratio))
        rows.append(r)
        checkpoint({**meta, "rows": rows, "partial": True})
        del comp
    return {**meta, "rows": rows, "ok": all(r["ok"] for r in rows)}


def table(result: dict):
    """The printed table (rich)."""
    from rich.table import Table

    t = Table(title=f"{result['model']}, {result['backend']} on {result['device']}: distance to the "
                    f"unquantized model ({result['tokens']} greedy tokens, perplexity on {result['text_tokens']} "
                    f"tokens; HF {result['hf_ppl']:.3f})")
    for c in ("weights", "greedy agreement", "forced prefix", "own greedy prefix", "perplexity",
              "vs unquantized megakernel", "vs HF", "ok"):
        t.add_column(c)
    for r in result["rows"]:
        n = result["tokens"]
        t.add_row(r["weights"], f"{round(r['greedy_match'] * n)}/{n}", str(r["forced_prefix"]), str(r["greedy_prefix"]),
                  f"{r['ppl']:.3f}", f"{100 * (r['ppl_ratio'] - 1):+.2f}%", f"{100 * (r['ppl_ratio_hf'] - 1):+.2f}%",
                  "yes" if r["ok"] else "NO")
    return t


def main(argv: list[str] | None = None, measure_fn=None) -> int:
    """Parse, measure (``measure_fn``, default ``measure``), print, write ``--out``. Returns 0
    when every row is ok, 1 otherwise; AmkError (exit 2) for bad input."""
    args = parser().parse_args(argv)
    formats = parse_formats(args.formats)
    if args.tokens < 1 or args.text_tokens < 0 or args.text_tokens == 1:
        raise AmkError("--tokens must be >= 1 and --text-tokens 0 or >= 2")
    from rich.console import Console

    from amk.bench import write_result
    from amk.output import check_writable_dir

    if args.out:
        check_writable_dir(Path(args.out).parent, "--out")
    con = Console(stderr=True)

    def checkpoint(partial: dict) -> None:
        write_result(args, partial, final=False)

    result = (measure_fn or measure)(args, formats, lambda s: con.print(s, markup=False, highlight=False), checkpoint)
    Console(width=200).print(table(result))
    checkpoint(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    run_main(main, NAME)
