"""``amk compile MODEL``: import, lower, validate, check against HF, write the schedule.

Stages (each shown with rich progress): check the arguments against the model's config
(``amk.checks``: ``--tp``/``--workers`` ranges, then whether the heads, MLP columns and
vocabulary split over ``--tp`` ranks), resolve the MODEL argument and import the
decode-step graph from its shapes alone (no weights), lower it for ``--tp`` ranks x
``--workers`` workers, validate it, write ``DIR/schedule.amk`` (text IR),
``DIR/schedule.json`` and ``DIR/report.json``, then load the weights, run the schedule on
the backend and compare its logits with HF eager at positions 0, 7 and 31 (a progress bar
counts the positions). With ``--backend triton`` the kernel source is also written to
``DIR/kernel.py``.

The correctness check is skipped, with one line saying why and ``correctness.skipped`` in
report.json, under ``--no-check``, when the model has no weights (a directory with
config.json only), and when its estimated memory (``amk.pipeline.check_memory``: fp32 HF
model + the executor's buffers) exceeds the available memory. The schedule is still written
and the exit code is 0.

report.json: model, source, family, ranks, workers, config (the lowering knobs), kernel (the
kernel knobs, with --backend triton), counts
(tasks, buffers, counters, tasks per rank), validation (ok, seconds, errors), correctness
(per position: max abs error, relative error, argmax agreement; or ``skipped``: why), notes
(ranks without query heads), quantization (``--weights int8|fp8``: the GEMV weights' dtype
and scales, whether the LM head is quantized (``--quantize-lm-head``), the embedding never;
weight bytes; the correctness reference is then the HF model with the same weights
dequantized), cost (PREDICTED latency from the roofline cost model), timings per stage, and
ok.

Exit codes: 0 success; 1 the schedule was rejected by the validator or failed the
correctness check (the reason is printed and recorded in report.json); 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from ground.errors import AmkError


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Arguments shared by compile and generate: MODEL, --tp, the backend and its sim options,
    --config FILE and one flag per knob (lowering.knobs.add_flags)."""
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags

    p.add_argument("model", metavar="MODEL",
                   help="HF directory | file.gguf | smollm2-135m | config:NAME")
    p.add_argument("--tp", type=int, default=1, metavar="R",
                   help="tensor-parallel ranks (GPUs); default 1")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="config file: {\"lowering\": {...}, \"kernel\": {...}} (docs/lowering.md); the knob "
                        "flags below override it")
    p.add_argument("--backend", choices=("sim", "triton"), default="sim",
                   help="executor: sim (CPU reference, default) or triton (GPU)")
    p.add_argument("--seed", type=int, default=0,
                   help="interleaving seed of the sim backend (default 0)")
    p.add_argument("--sim-policy", choices=("random", "in_order", "adversarial"), default="random",
                   help="interleaving policy of the sim backend (default random)")
    p.add_argument("--colocate", action="store_true",
                   help="triton with --tp R > 1: run all R ranks' workers on one GPU in one process "
                        "(testing) instead of one process per GPU over NVSHMEM")
    add_flags(p.add_argument_group("lowering knobs (docs/lowering.md)"), LoweringConfig)
    add_flags(p.add_argument_group("kernel knobs of --backend triton (docs/triton.md)"), KernelConfig)
    from search.defaults import add_args

    add_args(p.add_argument_group("default config (docs/tuning.md)"), gpu=True)


def config_from_args(args: argparse.Namespace):
    """The AmkConfig of compile / generate (``resolve_args_config`` without its line)."""
    return resolve_args_config(args)[0]


def resolve_args_config(args: argparse.Namespace):
    """(AmkConfig, config source line) of compile / generate: --config FILE, or without it
    the tuned entry / cost-model heuristic for the model, --tp and the GPU (--gpu, else the
    local one; search/defaults.py) unless --no-tuned, with the knob flags over it; checked at
    --tp ranks, after ``amk.checks.check_counts`` of --tp / --workers (AmkError on bad input;
    kernel flags with --backend sim are refused: that backend has no kernel). The kernel part
    of a tuned or heuristic config is kept for --backend triton only (the sim has no kernel)."""
    from amk.checks import check_counts, model_spec
    from lowering.config import KernelConfig, config_from_args as from_args
    from lowering.knobs import given
    from search.defaults import command_config, gpu_for

    workers = getattr(args, "workers", None)
    max_workers = target_for(args.backend).max_workers
    check_counts(args.tp, workers, max_workers)
    kernel_flags = given(args, KernelConfig)
    if kernel_flags and args.backend != "triton":
        flag = "--" + next(iter(kernel_flags)).replace("_", "-")
        raise AmkError(f"{flag} is a knob of the triton backend's kernel; --backend {args.backend} has none "
                       "(add --backend triton)")
    command = f"amk {getattr(args, 'command', None) or 'compile'}"
    # the file and the flags on their own first: their mistakes before the model is read
    from_args(args, command, ranks=args.tp, combinations=False)
    tuned = not (args.config or getattr(args, "no_tuned", False))
    spec = model_spec(args.model)[1] if tuned else None
    cfg, line = command_config(args, command, spec, args.tp, gpu_for(args) if tuned else None,
                               max_workers=max_workers)
    if tuned and args.backend != "triton":
        cfg = type(cfg)(cfg.lowering, KernelConfig())
    from_file = args.config and workers is None
    check_counts(workers=cfg.lowering.workers, max_workers=max_workers,
                 workers_flag=f"{args.config}: workers" if from_file else "--workers")
    return cfg, line


def backend_options(backend: str, cfg) -> dict | None:
    """The executor options of ``backend`` for AmkConfig ``cfg``: the triton backend's warps
    and Blocks from the kernel knobs (lowering.triton.blocks.kernel_options); None for sim."""
    if backend != "triton":
        return None
    from lowering.triton.blocks import kernel_options

    return kernel_options(cfg.kernel)


def target_for(backend: str):
    """The Target a schedule for ``backend`` is built and validated for (the validator checks
    that every op is implemented by that backend)."""
    from ir.program import Target

    return Target(backend=backend)


HELP = "lower a model to a validated schedule and check it against HF"
DESCRIPTION = """\
Import MODEL, lower it to a tensor-parallel schedule, validate it, write DIR/schedule.amk,
DIR/schedule.json and DIR/report.json, and check its logits against HF eager at positions 0, 7
and 31 on the backend."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compile", help=HELP, description=DESCRIPTION)
    add_common_args(p)
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default build/<model>-tp<R>)")
    p.add_argument("--json", action="store_true",
                   help="print the report (as in report.json) to stdout as one JSON object; the "
                        "summary table goes to stderr")
    p.add_argument("--no-check", action="store_true",
                   help="lower, validate and write the schedule without the correctness check "
                        "against HF (no weights are loaded)")
    p.set_defaults(func=run)


def quant_distance(compilation: Any) -> dict[str, Any]:
    """The quantized reference model's distance to the unquantized one (lowering.quant.distance):
    greedy agreement over 64 tokens after a fixed prompt and perplexity on
    examples/text/eval.txt, tokenized by the model's tokenizer; a model without one (the
    ``config:`` shapes) uses seeded token ids instead (``text`` says which)."""
    from amk import pipeline
    from lowering import quant

    vocab = compilation.graph.spec.vocab
    try:
        tok = compilation.resolved.tokenizer
        prompt = tok(quant.EVAL_PROMPT)["input_ids"]
        text = tok((Path(__file__).resolve().parents[2] / quant.EVAL_TEXT).read_text())["input_ids"]
        what = quant.EVAL_TEXT
    except (AmkError, OSError):
        prompt, text = pipeline.check_tokens(vocab, 16, 1), pipeline.check_tokens(vocab, 256, 2)
        what = "256 seeded token ids (the model has no tokenizer)"
    d = quant.distance(compilation.resolved.model, compilation.reference_model(), prompt, text, 64)
    d.pop("reference_tokens")
    return {**d, "text": what, "base": "the checkpoint's weights, unquantized (fp32)"}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "model"


def _write(path: Path, text: str) -> None:
    """Write a result file whole or not at all (AmkError naming the path, exit 2)."""
    from ground.files import atomic_write_text

    atomic_write_text(path, text, durable=False)


def run(args: argparse.Namespace) -> int:
    from amk.checks import check_model_split

    full, config_source = resolve_args_config(args)  # --tp 0 is refused before any heavy import
    cfg = full.lowering
    split = check_model_split(args.model, args.tp, cfg)  # the config only, no weights

    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from amk import pipeline
    from amk.output import emit_json, human_console
    from ground.files import finite
    from ir.jsonio import dumps
    from lowering.quant import summary as quant_summary
    from ir.text import format_program
    from lowering.costmodel import estimate

    class StepBar(BarColumn):
        """A bar for tasks counting steps (positions); nothing for one-shot stages."""
        def render(self, task):
            return super().render(task) if task.fields.get("steps") else Text("")

    class StepCount(MofNCompleteColumn):
        def render(self, task):
            return super().render(task) if task.fields.get("steps") else Text("")

    console = Console(stderr=True, highlight=False)
    console.print(escape(config_source), soft_wrap=True)
    for note in split.notes:
        console.print(f"[yellow]note:[/] {escape(note)}", soft_wrap=True)
    report: dict[str, Any] = {"model": args.model, "ranks": args.tp, "backend": args.backend,
                              "config_source": config_source}
    timings: dict[str, float] = {}
    out_dir = None

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), StepBar(bar_width=16),
                  StepCount(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        def stage(desc: str, fn, *a):
            tid = progress.add_task(desc, total=1)
            t0 = time.perf_counter()
            try:
                res = fn(*a)
            except BaseException:
                progress.update(tid, description=f"[red]✗[/] {desc}")
                raise
            dt = time.perf_counter() - t0
            timings[desc] = round(dt, 3)
            progress.update(tid, completed=1, description=f"[green]✓[/] {desc}")
            return res

        compilation = stage(f"import + lower {args.model} (shapes)", lambda: pipeline.Compilation.build(
            args.model, args.tp, cfg, target_for(args.backend), validate=False, weights=False))
        g, spec = compilation.graph, compilation.graph.spec
        out_dir = Path(args.out) if args.out else Path("build") / f"{_safe(g.name)}-tp{args.tp}"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AmkError(f"{out_dir}: cannot create the output directory: {e.strerror or e}") from None
        prog = compilation.program
        verdict, vs = stage(f"validate {len(prog.tasks)} tasks", pipeline.validate_program, prog)
        compilation.verdict, compilation.validate_s = verdict, vs
        stage("write schedule.amk / schedule.json", lambda: (
            _write(out_dir / "schedule.amk", format_program(prog)),
            _write(out_dir / "schedule.json", dumps(prog))))
        report.update({
            "model": g.name, "source": compilation.resolved.source.describe(),
            "family": spec.family, "spec": spec.to_json(), "ranks": prog.ranks,
            "workers": prog.workers, "config": cfg.to_json(), "program": prog.name,
            **({"kernel": full.kernel.to_json()} if args.backend == "triton" else {}),
            "notes": split.notes,
            "counts": {"tasks": len(prog.tasks), "buffers": len(prog.buffers),
                       "counters": len(prog.counters),
                       "tasks_per_rank": [sum(1 for t in prog.tasks if t.rank == r)
                                          for r in range(prog.ranks)]},
            "validation": {"ok": verdict.ok, "seconds": round(vs, 4),
                           "errors": [f.to_json() for f in verdict.errors[:20]],
                           "error_count": len(verdict.errors)},
            "quantization": quant_summary(cfg.weight_format, cfg.quantize_lm_head, prog),
            "cost": {"seq_len_1": estimate(prog, 1).to_json(),
                     f"seq_len_{cfg.max_seq}": estimate(prog, cfg.max_seq).to_json()},
        })
        failure = skipped = None
        if not verdict.ok:
            failure = f"validation rejected the schedule: {verdict.errors[0].cls}: " \
                      f"{verdict.errors[0].message}"
            report["correctness"] = {"ok": False, "skipped": "the schedule was rejected"}
        else:
            skipped = pipeline.check_skip_reason(compilation, args.no_check)
        if skipped:
            report["correctness"] = {"ok": None, "skipped": skipped}
        elif verdict.ok:
            if not compilation.has_weights:
                stage("load weights", compilation.load_weights)
            parts = {"schedule": f"  schedule on {args.backend}: positions",
                     "hf": "  HF eager: positions"}
            bars: dict[str, Any] = {}

            def on_step(part: str, done: int, total: int) -> None:
                if part not in bars:
                    bars[part] = progress.add_task(parts[part], total=total, steps=True)
                progress.update(bars[part], completed=done)

            def correctness():
                dec = compilation.decoder(args.backend, seed=args.seed, policy=args.sim_policy,
                                          backend_options=backend_options(args.backend, full))
                return compilation.check(dec, progress=on_step), dec
            corr, dec = stage(f"correctness vs HF eager ({args.backend}, positions 0/7/31)",
                              correctness)
            report["correctness"] = corr.to_json()
            if hasattr(dec.ex, "emit_source"):  # triton: the kernel source next to the schedule
                report["kernel_source"] = str(dec.ex.emit_source(out_dir / "kernel.py"))
            report["correctness"]["backend_steps_per_s"] = \
                round(dec.steps / dec.seconds, 3) if dec.seconds else None
            if not corr.ok:
                failure = "correctness check failed: " + "; ".join(corr.failures())
            if cfg.weights not in ("none", "bf16"):
                report["quantization"]["distance"] = stage(
                    "distance to the unquantized model (64 greedy tokens, perplexity)",
                    lambda: quant_distance(compilation))
    report["timings_s"] = {**{k: round(v, 3) for k, v in compilation.timings.items()}, **timings}
    report["ok"] = failure is None
    if failure:
        report["failure"] = failure
    _write(out_dir / "report.json", json.dumps(finite(report), indent=1, default=str) + "\n")

    out = human_console(args)  # stderr under --json: stdout carries the JSON alone
    t = Table(title=f"amk compile {g.name} --tp {prog.ranks}", show_header=False)
    t.add_row("schedule", f"{len(prog.tasks)} tasks, {len(prog.buffers)} buffers, "
              f"{len(prog.counters)} counters, {prog.ranks} ranks x {prog.workers} workers")
    t.add_row("validation", ("accepted" if verdict.ok else "[red]rejected[/]") + f" in {vs:.2f} s")
    qs = report["quantization"]
    if qs["weights"] != "none":
        t.add_row("weights", f"{qs['weights']} ({qs['gemv_weights']}, {qs['scale']}); LM head "
                  f"{qs['lm_head']}, embedding {qs['embedding']}; reference: the HF model with "
                  "these weights dequantized")
        if "distance" in qs:
            d = qs["distance"]
            t.add_row("vs unquantized", f"greedy agreement {d['greedy_match']:.0%} of {d['tokens']} tokens "
                      f"(identical prefix {d['greedy_prefix']}); perplexity {d['ppl_quant']:.3f} vs "
                      f"{d['ppl_base']:.3f} ({(d['ppl_ratio'] - 1) * 100:+.2f}%)")
    corr_j = report.get("correctness", {})
    if skipped:
        t.add_row("correctness", f"[yellow]skipped[/]: {escape(skipped)}")
    if "positions" in corr_j:
        for p in corr_j["positions"]:
            t.add_row(f"logits pos {p['pos']}",
                      f"max abs err {p['max_abs_err']:.3g} (rel {p['rel_err']:.2g}), argmax "
                      f"{'agrees' if p['argmax_agree'] else 'DIFFERS'}")
    c1 = report["cost"]["seq_len_1"]
    t.add_row("predicted latency", f"{c1['predicted_latency_us']:.1f} us/token (roofline "
              f"{c1['roofline_us']:.1f} us; cost model, not measured)")
    t.add_row("files", f"{out_dir}/schedule.amk, schedule.json, report.json")
    out.print(t)
    if args.json:
        emit_json(report)
    if skipped:
        console.print(f"[yellow]correctness check skipped:[/] {escape(skipped)}", soft_wrap=True)
    if failure:
        console.print(f"[bold red]error:[/] {failure}")
        return 1
    return 0
