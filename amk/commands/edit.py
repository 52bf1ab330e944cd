"""``amk edit SCHEDULE [EDITS.json] [--out NEW] [--force] [--json]``: apply typed schedule
edits, validate, write; ``--summary`` and ``--layer/--worker/--stage/--rank`` print views.

SCHEDULE is the text (``.amk``) or JSON form (what ``amk validate`` reads); EDITS.json a
list of edit objects (docs/ir.md, "Schedule edits"). The edited program is validated by the
project's validator and written to NEW (atomically) only when it is accepted, or with
``--force`` anyway (the verdict then says it is rejected). Nothing is run.

Exit codes: 0 accepted (and written when --out is given; a view printed), 1 rejected (the
error classes and their witnesses are printed), 2 bad input (an unreadable schedule, an edit
list that breaks the schema or names a missing task: one line naming the edit's index and
field). ``--json``: one object with ``ok``, ``classes``, ``errors``, ``written``, ``edits``.
"""

from __future__ import annotations

import argparse

from ground.errors import AmkError

HELP = "apply typed schedule edits, validate, write (or show a summary / a slice)"
DESCRIPTION = """\
Apply an edit list (JSON: move, swap, split, merge, replace, refine_wait, add_wait,
drop_wait, add_signal, drop_signal, add_counter; docs/ir.md) to a schedule, validate the
result and write it to --out only when the validator accepts it (--force: write it anyway).
--summary prints per-stage task counts, the predicted critical path and idle time per
worker; --layer/--worker/--stage/--rank print that slice in the text IR. Exit 0 accepted,
1 rejected (with witnesses), 2 bad input."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `edit` subcommand to the root parser."""
    p = subparsers.add_parser("edit", help=HELP, description=DESCRIPTION)
    p.add_argument("schedule", metavar="SCHEDULE", help="schedule program (.amk text or .json)")
    p.add_argument("edits", metavar="EDITS.json", nargs="?", default=None,
                   help="the edit list (a JSON list of edit objects)")
    p.add_argument("--out", metavar="NEW", default=None,
                   help="write the edited program here (.json: JSON form, else text)")
    p.add_argument("--force", action="store_true",
                   help="write NEW even when the validator rejects the edited program")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--summary", action="store_true",
                   help="print the (edited) program's summary: stages, critical path, idle time")
    p.add_argument("--layer", type=int, default=None, help="print the tasks of this layer (a slice)")
    p.add_argument("--worker", type=int, default=None, help="slice: this worker")
    p.add_argument("--stage", default=None, help="slice: this stage (e.g. l0.q)")
    p.add_argument("--rank", type=int, default=None, help="slice: this rank")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from amk.editing import edit_program, format_verdict, read_edits, verdict_report, write_program
    from amk.output import emit_json, human_console
    from ir.io import load_program

    view = args.summary or any(v is not None for v in (args.layer, args.worker, args.stage, args.rank))
    if args.edits is None and not view:
        raise AmkError("amk edit: give EDITS.json, or --summary / a slice (--layer, --worker, "
                       "--stage, --rank)")
    if args.edits is None and (args.out or args.force):
        raise AmkError("amk edit: --out and --force need EDITS.json")
    if args.force and not args.out:
        raise AmkError("amk edit: --force needs --out NEW")
    prog = load_program(args.schedule)
    edits = read_edits(args.edits) if args.edits is not None else None
    out = human_console(args, soft_wrap=True)
    result: dict = {"schedule": args.schedule}
    code = 0
    if edits is not None:
        new, verdict = edit_program(prog, edits)
        report = verdict_report(verdict)
        result.update(report)
        result["edits"] = len(edits)
        written = None
        if args.out and (verdict.ok or args.force):
            write_program(new, args.out)
            written = args.out
        result["written"] = written
        label = args.out or f"{args.schedule} + {args.edits}"
        for line in format_verdict(report, label):
            out.print(line, markup=False, highlight=False)
        if written and not verdict.ok:
            out.print(f"wrote {written} (--force): REJECTED by the validator; it will not run",
                      markup=False)
        elif args.out and not written:
            out.print(f"{args.out} not written: the edited program is rejected (--force writes it)",
                      markup=False)
        elif written:
            out.print(f"wrote {written}", markup=False)
        code = 0 if verdict.ok else 1
        prog = new
    if view:
        from lowering.views import format_summary, slice_program, summary

        if args.summary:
            s = summary(prog)
            result["summary"] = s
            out.print(format_summary(s), markup=False)
        if any(v is not None for v in (args.layer, args.worker, args.stage, args.rank)):
            text = slice_program(prog, layer=args.layer, worker=args.worker, stage=args.stage,
                                 rank=args.rank)
            result["slice"] = text
            out.print(text, markup=False, end="")
    if args.json:
        result.setdefault("ok", True)
        result["exit_code"] = code
        emit_json(result)
    return code
