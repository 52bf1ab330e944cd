"""``amk dist FILE.py:FUNC --world R --shape NAME=DIMS ...``: capture a function written with
torch ops and torch.distributed collectives, lower its pattern to one validated schedule of R
ranks and check it against the pattern's torch math (docs/dist.md).

Steps: import FILE and take FUNC; capture it with dynamo under a fake process group of R ranks
and recognise its pattern (models/capture.py; anything else is refused with the op and its
file:line); lower it with the collective knobs (``--config FILE``'s ``"collective"`` part and
the flags; lowering/collectives.py); validate the program (validator.validate: deadlock and
race freedom, the backend's op set); run one epoch with seeded inputs for every rank on the
sim (``--backend triton``: the Triton megakernel with every rank in this process, on one GPU
or under the Triton CPU interpreter) and compare every rank's output with
``models.collectives`` ``Pattern.reference``. ``--emit FILE`` writes the schedule (``.json``
or the ``.amk`` text form), whole or not at all.

Exit codes: 0 accepted and matching; 1 rejected by the validator (its findings are printed),
the run failed or a rank's output differs; 2 unusable input (FILE, FUNC, a shape, a knob, a
function amk dist does not lower: one line). ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from amk.commands import load_function, parse_shapes, parse_target, parse_world
from ground.errors import AmkError

HELP = "capture a torch.distributed function, lower it to a validated fused schedule, check it"
DESCRIPTION = """\
Capture FUNC of FILE (torch ops and torch.distributed collectives) with torch.compile under a
fake process group of R ranks, recognise its pattern (all-gather + matmul, matmul +
reduce-scatter, matmul + all-reduce (+ RMSNorm), Ulysses all-to-all + projection), lower it
to one schedule, validate it and run it with seeded inputs against the pattern's torch math.
Exit 0 accepted and matching, 1 rejected / failed / differs, 2 unusable input."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `dist` subcommand to the root parser."""
    p = subparsers.add_parser("dist", help=HELP, description=DESCRIPTION)
    p.add_argument("target", metavar="FILE.py:FUNC", help="the Python file and the function in it")
    p.add_argument("--world", required=True, metavar="R", help="world size (ranks), an integer >= 1")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=DIMS",
                   help="rank-local shape of a tensor parameter, e.g. x=64,128 (one per parameter)")
    p.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16",
                   help="element type of the tensors (default bf16)")
    p.add_argument("--backend", choices=("sim", "triton"), default="sim",
                   help="sim: the CPU reference executor (default); triton: the megakernel with every rank "
                        "in this process (one GPU, or the Triton CPU interpreter without one)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="config file: its \"collective\" part holds the knobs below, its \"kernel\" part "
                        "the triton kernel's (docs/dist.md)")
    p.add_argument("--emit", metavar="FILE", default=None,
                   help="write the schedule to FILE (.json, else the .amk text form)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the inputs and of the sim's interleaving (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    from lowering.config import CollectiveConfig
    from lowering.knobs import add_flags

    add_flags(p.add_argument_group("collective knobs (docs/dist.md)"), CollectiveConfig)
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    from amk.output import check_writable_dir, emit_json, human_console

    out = human_console(args, soft_wrap=True)
    path, func = parse_target(args.target)
    world = parse_world(args.world)
    shapes = parse_shapes(args.shape)
    if args.emit:  # fail before the capture, not after it
        if Path(args.emit).is_dir():
            raise AmkError(f"--emit {args.emit}: is a directory; give a file name (.json or .amk)")
        check_writable_dir(Path(args.emit).parent, "--emit")
    from lowering.config import collective_from_args

    if args.config:  # a bad file is reported before the function is imported
        collective_from_args(args, "amk dist")
    if args.backend == "triton":
        # must precede any `import triton`: it picks the CPU interpreter when no GPU is present
        try:
            import lowering.triton  # noqa: F401
        except ImportError as e:
            raise AmkError(f"the triton backend cannot be loaded here ({e})") from None
    fn = load_function(path, func)

    from amk import distributed as D
    from models.capture import capture
    from rich.markup import escape

    cap = capture(fn, world, shapes, args.dtype)
    pattern = cap.pattern
    cfg = collective_from_args(args, "amk dist", pattern.kind)
    kernel = D.load_config(args.config, pattern.kind)[1] if args.config else None
    report: dict[str, Any] = {
        "ok": False, "function": f"{args.target}", "where": cap.where, "pattern": pattern.kind,
        "dims": pattern.dims(), "world": world, "dtype": args.dtype, "backend": args.backend,
        "steps": [{"op": k, "where": w} for k, w in cap.steps],
        "operands": {k: {"param": op.param, "transposed": op.transposed, "shape": list(cap.operand_shapes()[k])}
                     for k, op in cap.operands.items()},
        "output_shape": list(pattern.output_shape()), "config": cfg.to_json(),
    }
    if getattr(pattern, "norm", False):
        report["rmsnorm_eps"] = pattern.eps
    out.print(f"[bold]{escape(cap.name)}[/] ({escape(cap.where)}): {escape(cap.describe())}")
    for k, w in cap.steps:
        out.print(f"  {escape(k)} at {escape(w)}")
    for k, op in cap.operands.items():
        shape = list(cap.operand_shapes()[k])
        note = " (as [N, K], used transposed)" if op.transposed else ""
        out.print(f"  {k} = parameter {escape(op.param)} {shape}{note}")
    out.print(f"  output {list(pattern.output_shape())} per rank")

    low = D.lower(pattern, cfg, args.backend)
    prog, verdict = low.program, low.verdict
    report.update(program=prog.name, tasks=len(prog.tasks), ranks=prog.ranks, workers=prog.workers,
                  counters=len(prog.counters), lower_s=round(low.lower_s, 4), validate_s=round(low.validate_s, 4))
    if args.emit:
        from ir.io import save_program

        report["emit"] = str(save_program(prog, args.emit))
    if not verdict.ok:
        report["validation"] = {"ok": False, "errors": [f.to_json() for f in verdict.errors[:20]]}
        out.print(f"[bold red]rejected[/] {escape(prog.name)}: {len(verdict.errors)} error(s)")
        for f in verdict.errors[:20]:
            out.print(f"  [bold]{escape(f.cls)}[/]: {escape(f.message)}")
        if args.json:
            emit_json(report)
        return 1
    report["validation"] = {"ok": True}
    out.print(f"[bold green]accepted[/] {escape(prog.name)}: {len(prog.tasks)} tasks, {prog.ranks} rank(s) x "
              f"{prog.workers} worker(s), {len(prog.counters)} counters (lowered in {low.lower_s:.3f} s, "
              f"validated in {low.validate_s:.3f} s)")
    if args.emit:
        out.print(f"  schedule written to {escape(report['emit'])}")

    inputs = D.seeded_inputs(pattern, args.seed)
    ref = pattern.reference(inputs)
    try:
        if args.backend == "sim":
            got, _ = D.run_sim(low, inputs, seed=args.seed)
        else:
            got = D.run_colocated_triton(low, inputs, kernel)
    except AmkError as e:
        report["run"] = {"ok": False, "error": str(e)}
        if args.json:
            emit_json(report)
        raise
    verdict_run = D.compare(got, ref, args.dtype)
    report["run"] = verdict_run
    report["ok"] = bool(verdict_run["ok"])
    word = "[bold green]matches[/]" if verdict_run["ok"] else "[bold red]DIFFERS from[/]"
    out.print(f"{args.backend}: every rank's output {word} the reference (models.collectives): max abs err "
              f"{verdict_run['max_abs_err']:.3g}, tolerance {verdict_run['tolerance']:.3g}")
    if args.json:
        emit_json(report)
    return 0 if verdict_run["ok"] else 1


__all__ = ["DESCRIPTION", "HELP", "load_function", "parse_shapes", "parse_target", "parse_world", "register", "run"]
