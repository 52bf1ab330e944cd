"""``amk generate MODEL --prompt TEXT --max-new-tokens N``: greedy decoding through the schedule.

The prompt is tokenized with the model's tokenizer and fed one token per decode step (no
separate prefill yet), then each generated token is fed back, until N new tokens or an EOS
token (as HF generate stops). ``--verify`` runs HF ``generate`` (greedy, same prompt ids,
same max_new_tokens) and reports the first diverging position, or none.

``--json`` prints one object on stdout (progress goes to stderr): ok, text, tokens,
prompt_tokens, steps, seconds, and with --verify reference_tokens, reference_text, match
(bool) and first_divergence (int or null); when the validator rejects the schedule,
``{"ok": false, "error": ...}``.

Exit codes: 0 success (and match, with --verify); 1 the schedule was rejected, or --verify
found a divergence; 2 bad input.
"""

from __future__ import annotations

import argparse
import time

from amk.commands.compile import add_common_args, backend_options, resolve_args_config, target_for
from ground.errors import AmkError


HELP = "greedy decoding through the compiled schedule"
DESCRIPTION = """\
Compile MODEL (as amk compile does, without writing files), then decode greedily through the
schedule on the backend. --verify compares the tokens with HF generate."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help=HELP, description=DESCRIPTION)
    add_common_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens to generate (default 32)")
    p.add_argument("--verify", action="store_true",
                   help="also run HF generate and report the first diverging position")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object to stdout (progress goes to stderr)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from amk.checks import check_model_split
    from lowering.config import sets
    from models.sources import require_weights

    if args.max_new_tokens < 1:
        raise AmkError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    full, config_source = resolve_args_config(args)  # before any heavy import
    cfg = full.lowering
    split = check_model_split(args.model, args.tp, cfg)  # the config only, no weights
    require_weights(split.source, "amk generate")

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
        tok = resolved.tokenizer
    prompt_ids = [int(t) for t in tok(args.prompt)["input_ids"]]
    if not prompt_ids:
        raise AmkError("the prompt tokenizes to no tokens")
    need = len(prompt_ids) + args.max_new_tokens
    if need > cfg.max_seq:
        if sets(args, "max_seq"):
            raise AmkError(f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens "
                           f"{args.max_new_tokens} exceed max_seq {cfg.max_seq} (--max-seq"
                           f"{' or ' + args.config if args.config else ''})")
        cfg = cfg.replace(max_seq=need)
    with err.status(f"lowering for {args.tp} ranks and validating"):
        session = pipeline.Session.build(args.model, args.tp, cfg, target_for(args.backend),
                                          resolved=resolved)
    if not session.verdict.ok:
        f = session.verdict.errors[0]
        msg = f"the validator rejected the schedule: {f.cls}: {f.message}"
        if args.json and lead:
            emit_json({"ok": False, "model": session.graph.name, "error": msg})
        err.print(f"[bold red]error:[/] {escape(msg)}")
        return 1
    opts = backend_options(args.backend, full)
    if ctx is not None:
        opts = {**(opts or {}), "dist": ctx}
    dec = session.decoder(args.backend, seed=args.seed, policy=args.sim_policy, backend_options=opts)
    eos = pipeline.eos_ids(resolved.model)
    t0 = time.perf_counter()
    with err.status(f"decoding on {args.backend} ({len(prompt_ids)} prompt tokens, one step each)"):
        new = dec.generate(prompt_ids, args.max_new_tokens, eos)
    seconds = time.perf_counter() - t0
    text = tok.decode(new, skip_special_tokens=True)
    out = {"model": session.graph.name, "ranks": args.tp, "workers": session.program.workers,
           "backend": args.backend, "config_source": config_source, "prompt": args.prompt, "prompt_tokens": prompt_ids,
           "text": text, "tokens": new, "steps": dec.steps, "seconds": round(seconds, 3)}
    rc = 0
    if args.verify and lead:
        with err.status("HF generate (greedy) for --verify"):
            ref = pipeline.hf_generate(resolved.model, prompt_ids, args.max_new_tokens)
        div = pipeline.first_divergence(new, ref)
        out.update({"reference_tokens": ref,
                    "reference_text": tok.decode(ref, skip_special_tokens=True),
                    "match": div is None, "first_divergence": div})
        rc = 0 if div is None else 1
    if not lead:
        return 0
    out["ok"] = rc == 0
    if args.json:
        emit_json(out)
    else:
        con = Console(highlight=False)
        con.print(f"[bold]{escape(args.prompt)}[/]{escape(text)}")
        con.print(f"[dim]{len(new)} tokens, {dec.steps} decode steps in {seconds:.1f} s on "
                  f"{args.backend}, tp={args.tp}[/]")
        if args.verify:
            if out["match"]:
                con.print(f"[green]verify: identical to HF greedy ({len(ref)} tokens)[/]")
            else:
                con.print(f"[red]verify: first divergence at new token {div}: amk "
                          f"{new[div] if div < len(new) else None} vs HF "
                          f"{ref[div] if div < len(ref) else None}[/]")
    return rc
