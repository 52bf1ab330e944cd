"""``amk validate-corpus``: measure the static validator against the independent oracle on an
adversarial corpus of mutated schedules (validator/corpus.py, validator/oracle.py).

Writes ``DIR/report.json`` (keys: total, unsafe, safe, false_accepts, false_rejects,
unexplained_false_rejects, classes{name: {count, unsafe, false_accepts, false_rejects, ...}},
false_reject_reasons, oracle_problem_classes, seeds, setup, seconds), every false accept as
a JSON file under ``DIR/false_accepts/`` and a few false rejects per reason under
``DIR/false_rejects/``; prints a table. ``--markdown FILE`` also rewrites the generated
section of FILE (docs/validator-corpus.md); ``--render REPORT`` only re-renders an existing
report into ``--markdown`` without running anything. ``--json`` prints the report to stdout
as one JSON object (the table then goes to stderr; progress always does). Every file is
written whole or not at all, and the output directory is checked before the run starts.

Exit codes: 0 no false accept, 1 at least one false accept, 2 bad arguments or no validator.
"""

from __future__ import annotations

import argparse
import json
import os

from ground.errors import AmkError


HELP = "measure the validator against the oracle on a mutated corpus"
DESCRIPTION = """\
Generate COUNT schedules by mutating valid multi-rank schedules, label each with the independent
dynamic oracle, validate each with the static validator, and report false accepts (must be 0)
and false rejects (each attributed to a named reason)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `validate-corpus` subcommand to the root parser."""
    p = subparsers.add_parser("validate-corpus", help=HELP, description=DESCRIPTION)
    p.add_argument("--count", type=int, default=10_000, help="schedules to generate (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="corpus seed (default 0); results are "
                                                      "deterministic in it")
    p.add_argument("--out", default="bench/results/corpus", metavar="DIR",
                   help="output directory (default bench/results/corpus)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes (default: min(2, CPUs)); results do not depend on it")
    p.add_argument("--runs", type=int, default=24,
                   help="random interleavings the oracle tries per schedule (default 24)")
    p.add_argument("--no-lowered", action="store_true",
                   help="use only the hand-built seeds, not tiny lowered programs")
    p.add_argument("--stability", type=int, default=0, metavar="N",
                   help="re-check the first N schedules labelled safe with 16x the runs and "
                        "2 more epochs; record label flips in the report (default 0: off)")
    p.add_argument("--markdown", metavar="FILE",
                   help="also rewrite the generated report section of FILE "
                        "(e.g. docs/validator-corpus.md)")
    p.add_argument("--render", metavar="REPORT",
                   help="render an existing report.json into --markdown and exit")
    p.add_argument("--json", action="store_true",
                   help="print the report to stdout as one JSON object (the table goes to stderr)")
    p.set_defaults(func=run)


def _table(report: dict):
    from rich.table import Table

    t = Table(title=f"adversarial corpus: {report['total']} schedules, "
                    f"{len(report['classes'])} mutation classes")
    for col, just in (("class", "left"), ("intent", "left"), ("count", "right"),
                      ("unsafe", "right"), ("false accepts", "right"),
                      ("false rejects", "right"), ("false-reject reasons", "left")):
        t.add_column(col, justify=just)
    for name, d in report["classes"].items():
        fa = str(d["false_accepts"])
        t.add_row(name, d["intent"], str(d["count"]), str(d["unsafe"]),
                  f"[bold red]{fa}[/]" if d["false_accepts"] else fa, str(d["false_rejects"]),
                  ", ".join(f"{k} ({v})" for k, v in d["false_reject_reasons"].items()) or "-")
    t.add_section()
    t.add_row("total", "", str(report["total"]), str(report["unsafe"]),
              str(report["false_accepts"]), str(report["false_rejects"]),
              f"unexplained: {report['unexplained_false_rejects']}")
    return t


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from amk.output import check_writable_dir, emit_json, human_console
    from validator import corpus

    console = human_console(args)
    progress_console = Console(stderr=True, highlight=False)
    if args.render:
        if not args.markdown:
            raise AmkError("--render needs --markdown FILE (where to write the tables)")
        try:
            with open(args.render) as f:
                report = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise AmkError(f"{args.render}: cannot read the report: {exc}") from None
        if not isinstance(report, dict) or "classes" not in report or "setup" not in report:
            raise AmkError(f"{args.render}: not a report written by amk validate-corpus")
        corpus.update_markdown(args.markdown, report)
        console.print(f"wrote {args.markdown}")
        if args.json:
            emit_json({"ok": True, "markdown": args.markdown, "report": args.render})
        return 0
    for name in ("count", "jobs", "runs"):
        if getattr(args, name) < 1:
            raise AmkError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.stability < 0:
        raise AmkError(f"--stability must be >= 0, got {args.stability}")
    validate, status = corpus._load_validator()
    if validate is None:
        raise AmkError(f"the static validator is not available ({status})")
    # fail now rather than after the corpus has run
    check_writable_dir(args.out, "--out")
    if args.markdown:
        check_writable_dir(os.path.dirname(args.markdown), "--markdown")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=progress_console, transient=True) as prog:
        bar = prog.add_task("labelling and validating", total=args.count)
        report, records = corpus.run_corpus(
            count=args.count, seed=args.seed, jobs=args.jobs, runs=args.runs,
            include_lowered=not args.no_lowered, progress=lambda n: prog.advance(bar, n),
            stability_sample=args.stability)
    corpus.write_outputs(args.out, report, records)
    if args.markdown:
        corpus.update_markdown(args.markdown, report)
    if args.json:
        emit_json({**report, "ok": not report["false_accepts"],
                   "report_file": os.path.join(args.out, "report.json")})
    console.print(_table(report))
    console.print(f"report: {os.path.join(args.out, 'report.json')}")
    if report.get("validator_internal_errors"):
        console.print(f"[yellow]the validator failed internally on "
                      f"{report['validator_internal_errors']} schedules (counted as rejects)[/]")
    if report["unexplained_false_rejects"]:
        console.print(f"[yellow]{report['unexplained_false_rejects']} false rejects have no named "
                      f"reason: see {os.path.join(args.out, 'false_rejects')}[/]")
    if report["false_accepts"]:
        console.print(f"[bold red]{report['false_accepts']} false accepts[/] (validator accepted "
                      f"schedules the oracle saw fail): {os.path.join(args.out, 'false_accepts')}")
        return 1
    return 0
