"""``amk generate MODEL --prompt TEXT --max-new-tokens N``: decoding through the schedule.

A thin layer over the Python API (amk/api.py): ``amk.api.compile`` lowers and validates, then
``CompiledModel.generate`` decodes. The prompt is tokenized with the model's tokenizer
(``--chat``: as the user turn of its chat template); with ``--prefill 1`` (the default) all
prompt tokens but the last fill the KV caches in one HF forward (amk/prefill.py) and the last
runs the first decode step, with ``--prefill 0`` every prompt token runs a decode step. Then
each new token is fed back until N new tokens or an EOS token (as HF generate stops). Greedy
by default; ``--do-sample`` with ``--temperature``, ``--top-k``, ``--top-p`` and
``--sample-seed`` draws instead (amk/sampling.py). ``--verify`` (greedy only) runs HF
``generate`` (greedy, same prompt ids, same max_new_tokens, the model in fp32) and reports the
first diverging position, or none. A bf16 schedule (``--dtype bf16``) that diverges is judged
by amk bench's near-tie rule (amk/baselines.py ``judge_tokens``): accepted when HF's fp32
top-2 margin at that token is at most 4 x the bf16-vs-fp32 logit noise of HF's own model
there, where two correct bf16 implementations may round either way.

Output: the text goes to stdout as the tokens come (``--no-stream``: at the end), the summary
and progress to stderr. ``--json`` prints one object on stdout instead: ok, text, tokens,
prompt_tokens, steps, seconds, ttft_ms (time to first token, prefill included),
tokens_per_s (decode rate after the first token), prefill, sampling, and with --verify
reference_tokens, reference_text, match (bool), first_divergence (int or null) and, for a bf16
divergence, verdict (the near-tie rule's note).

Exit codes: 0 success (and, with --verify, a match or a bf16 near-tie); 1 the schedule was
rejected, or --verify found another divergence; 2 bad input.
"""

from __future__ import annotations

import argparse
import sys

from amk.commands.compile import add_common_args, resolve_args_config
from ground.errors import AmkError


HELP = "decode through the compiled schedule (greedy or sampled)"
DESCRIPTION = """\
Compile MODEL (as amk compile does, without writing files), then decode through the schedule
on the backend: the prompt through a prefill (--prefill 1, default) or one decode step per
token (--prefill 0), then greedy decoding or, with --do-sample, sampling. --verify compares
greedy tokens with HF generate."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help=HELP, description=DESCRIPTION)
    add_common_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens to generate (default 32)")
    p.add_argument("--prefill", type=int, choices=(0, 1), default=1,
                   help="1: fill the KV caches for the prompt in one forward pass (default); "
                        "0: feed the prompt one decode step per token")
    p.add_argument("--chat", action="store_true",
                   help="apply the tokenizer's chat template (the prompt as the user turn)")
    s = p.add_argument_group("sampling (default: greedy)")
    s.add_argument("--do-sample", action="store_true",
                   help="sample instead of greedy decoding")
    s.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="> 0; divides the logits (default 1)")
    s.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="keep the K most probable tokens (>= 1)")
    s.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="keep the smallest set of tokens whose probability reaches P, in (0, 1]")
    s.add_argument("--sample-seed", type=int, default=0, metavar="S",
                   help="seed of the sampling generator (default 0); --seed is the sim's interleaving")
    p.add_argument("--verify", action="store_true",
                   help="also run HF generate (greedy) and report the first diverging position")
    p.add_argument("--no-stream", action="store_true",
                   help="print the text when decoding ends instead of token by token")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object to stdout (progress goes to stderr)")
    p.set_defaults(func=run)


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the command line; AmkError (exit 2) names a bad flag, and
    --verify with --do-sample (HF greedy is the only reference)."""
    from amk.sampling import SamplingParams

    t = args.temperature
    params = SamplingParams(args.do_sample, 1.0 if t is None else t, args.top_k, args.top_p)
    params.check(flag="--")
    if args.verify and args.do_sample:
        raise AmkError("--verify compares with HF greedy decoding; it cannot be used with --do-sample")
    return params


class _Printer:
    """A transformers ``TextStreamer`` that writes to stdout and flushes each piece (the text
    appears as the tokens come; word pieces are held until they decode to whole characters)."""

    def __new__(cls, tokenizer):
        from transformers import TextStreamer

        class Streamer(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                sys.stdout.write(text + ("\n" if stream_end else ""))
                sys.stdout.flush()

        return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def run(args: argparse.Namespace) -> int:
    from amk.checks import check_model_split
    from lowering.config import AmkConfig, sets
    from models.sources import require_weights

    if args.max_new_tokens < 1:
        raise AmkError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    params = sampling_params(args)
    full, config_source = resolve_args_config(args)  # before any heavy import
    cfg = full.lowering
    split = check_model_split(args.model, args.tp, cfg)  # the config only, no weights
    require_weights(split.source, "amk generate")
    from amk import api
    from models.sources import load_config, load_tokenizer

    # the prompt's ids (and a --chat without a template) before anything is printed
    tok = load_tokenizer(split.source, load_config(split.source))
    prompt_ids = api.encode(tok, args.prompt, chat=args.chat, model=args.model)

    from rich.console import Console
    from rich.markup import escape

    from amk import launch, pipeline
    from amk.output import emit_json

    code, ctx = launch.tp_entry(args.tp, args.backend, args.colocate)
    if code is not None:
        return code
    lead = ctx is None or ctx.rank == 0  # the rank that verifies and reports
    err = Console(stderr=True, highlight=False)
    if lead:
        err.print(escape(config_source), soft_wrap=True)
        for note in split.notes:
            err.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    with err.status(f"resolving {args.model}"):
        resolved = pipeline.resolve(args.model)
    need = len(prompt_ids) + args.max_new_tokens
    if need > cfg.max_seq:
        if sets(args, "max_seq"):
            raise AmkError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens "
                           f"{args.max_new_tokens} exceed max_seq {cfg.max_seq} (--max-seq"
                           f"{' or ' + args.config if args.config else ''})")
        cfg = cfg.replace(max_seq=need)
    with err.status(f"lowering for {args.tp} ranks and validating"):
        try:
            m = api.compile(args.model, args.tp, args.backend, AmkConfig(cfg, full.kernel),
                            seed=args.seed, sim_policy=args.sim_policy, dist=ctx,
                            resolved=resolved, config_source=config_source)
        except AmkError as e:
            if e.exit_code == 1 and args.json and lead:  # the validator's verdict
                emit_json({"ok": False, "model": args.model, "error": str(e)})
            raise
    with err.status(f"building the {args.backend} executor and warming it up"):
        m.prepare(prefill=bool(args.prefill), warm=True)  # ttft_ms without the kernel compile
    stream = lead and not args.json and not args.no_stream
    con = Console(highlight=False)
    if stream:
        con.print(f"[bold]{escape(args.prompt)}[/]", end="")
    how = "prefill" if args.prefill else "one step per prompt token"
    with err.status(f"decoding on {args.backend} ({len(prompt_ids)} prompt tokens, {how})"):
        res = m.generate(prompt_ids, args.max_new_tokens, do_sample=params.do_sample,
                         temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                         seed=args.sample_seed, streamer=_Printer(tok) if stream else None,
                         prefill=bool(args.prefill), return_dict_in_generate=True)
    new = res.tokens
    text = tok.decode(new, skip_special_tokens=True)
    out = {"model": m.compilation.graph.name, "ranks": args.tp, "workers": m.program.workers,
           "backend": args.backend, "config_source": config_source, "prompt": args.prompt,
           "chat": args.chat, "prompt_tokens": prompt_ids, "text": text, "tokens": new,
           "steps": res.steps, "seconds": round(res.seconds, 3),
           "ttft_ms": round(res.ttft_s * 1e3, 3),
           "tokens_per_s": round(res.tokens_per_s, 3) if res.tokens_per_s else None,
           "prefill": res.prefill, "prefill_ms": round(res.prefill_s * 1e3, 3),
           "sampling": res.sampling}
    rc = 0
    if args.verify and lead:
        with err.status("HF generate (greedy) for --verify"):
            ref = pipeline.hf_generate(resolved.model, prompt_ids, args.max_new_tokens)
        div = pipeline.first_divergence(new, ref)
        out.update({"reference_tokens": ref,
                    "reference_text": tok.decode(ref, skip_special_tokens=True),
                    "match": div is None, "first_divergence": div})
        rc = 0 if div is None else 1
        if div is not None and cfg.dtype == "bf16" and div < min(len(new), len(ref)):
            import torch

            from amk.baselines import bf16_margins, judge_tokens

            with err.status("HF fp32 and bf16 logits at the divergence (near-tie rule)"):
                ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=resolved.model.device)
                near, _, note = judge_tokens(new, bf16_margins(resolved.model, ids, ref))
            out["verdict"] = note
            rc = 0 if near else 1
    if not lead:
        return 0
    out["ok"] = rc == 0
    if args.json:
        emit_json(out)
        return rc
    if not stream:
        con.print(f"[bold]{escape(args.prompt)}[/]{escape(text)}")
    rate = f", {res.tokens_per_s:.1f} tokens/s after it" if res.tokens_per_s else ""
    err.print(f"[dim]{len(new)} tokens, {res.steps} decode steps in {res.seconds:.2f} s on "
              f"{args.backend}, tp={args.tp}; first token after {res.ttft_s * 1e3:.1f} ms "
              f"({'prefill' if res.prefill else 'no prefill'}){rate}[/]", soft_wrap=True)
    if args.verify:
        if out["match"]:
            err.print(f"[green]verify: identical to HF greedy ({len(ref)} tokens)[/]")
        else:
            colour = "yellow" if rc == 0 else "red"
            err.print(f"[{colour}]verify: first divergence at new token {div}: amk "
                      f"{new[div] if div < len(new) else None} vs HF "
                      f"{ref[div] if div < len(ref) else None}"
                      + (f"; {escape(out['verdict'])}" if "verdict" in out else "") + "[/]")
    return rc
