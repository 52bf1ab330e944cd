"""``amk profile MODEL|SCHEDULE``: one decode step as a per-task trace (Chrome / Perfetto).

    amk profile MODEL|SCHEDULE [--tp R] [--backend sim|triton] [--seq-len L] --trace OUT.json

The trace (lowering/trace.py) has one process per rank, one track per worker, one slice per
task (op, layer, stage, bytes, achieved GB/s), the counter waits as their own slices, a flow
arrow from each signal to the wait it released, and the step's roofline in ``otherData``.
``--backend sim`` (default): the cost model's timeline, ``otherData.clock`` = ``simulated``.
``--backend triton``: the megakernel's in-kernel timers (``clock`` = ``gpu``); MODEL only;
``--tp R`` runs one process per GPU over NVSHMEM (``--colocate``: the R ranks on one GPU).
Open the file in ui.perfetto.dev or chrome://tracing. Exit codes: 0 written, 1 the validator
rejected the model's schedule, 2 bad input (or no GPU for --backend triton).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ground.errors import AmkError

HELP = "trace one decode step per task (Chrome/Perfetto trace; simulated or GPU timers)"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help=HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("target", metavar="MODEL|SCHEDULE",
                   help="HF directory | file.gguf | smollm2-135m | config:NAME, or a schedule file "
                        "(.amk text IR or .json)")
    p.add_argument("--tp", type=int, default=None, metavar="R",
                   help="tensor-parallel ranks of MODEL (1); a schedule file has its own")
    p.add_argument("--backend", choices=("sim", "triton"), default="sim",
                   help="sim: the cost model's timeline (simulated clock, default); triton: the "
                        "megakernel's in-kernel timers on this GPU")
    p.add_argument("--seq-len", type=int, default=128, metavar="L",
                   help="tokens in the KV cache at the traced step (default 128); triton runs L "
                        "steps and traces the last")
    p.add_argument("--trace", metavar="OUT.json", default=None,
                   help="write the trace here (JSON, whole or not at all)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="config file: {\"lowering\": {...}, \"kernel\": {...}} (docs/lowering.md); the "
                        "knob flags below override it")
    p.add_argument("--colocate", action="store_true",
                   help="triton with --tp R > 1: run all R ranks' workers on one GPU in one process "
                        "instead of one process per GPU over NVSHMEM")
    p.add_argument("--json", action="store_true",
                   help="print the trace's summary as one JSON object on stdout")
    from amk.bench import BENCH_DEFAULTS
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags

    add_flags(p.add_argument_group("lowering knobs (docs/lowering.md)"), LoweringConfig,
              defaults=BENCH_DEFAULTS)
    add_flags(p.add_argument_group("kernel knobs of --backend triton (docs/triton.md)"), KernelConfig)
    from search.defaults import add_args

    add_args(p.add_argument_group("default config (docs/tuning.md)"), gpu=True)
    p.set_defaults(func=run)


def _is_schedule(target: str) -> bool:
    return target.endswith((".amk", ".json")) and not target.startswith("config:")


def run(args: argparse.Namespace) -> int:
    from amk import output
    from amk.profile import sim_trace, trace_summary
    from ground.files import atomic_write_bytes, atomic_write_text
    from lowering.trace import check_trace

    if args.seq_len < 1:
        raise AmkError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.trace:
        output.check_writable_dir(Path(args.trace).parent, "--trace")
    from rich.console import Console

    con = Console(stderr=True, highlight=False)  # progress; the result line: human_console
    if _is_schedule(args.target):
        if not os.path.isfile(args.target):
            raise AmkError(f"{args.target}: no such schedule file")
        if args.backend == "triton":
            raise AmkError("amk profile --backend triton traces a MODEL (it needs the model's weights); "
                           f"{args.target} is a schedule file: use --backend sim, or profile the model")
        from ir.io import load_program

        prog = load_program(args.target)
        if args.tp is not None and args.tp != prog.ranks:
            raise AmkError(f"--tp {args.tp}: {args.target} is a schedule of {prog.ranks} rank(s)")
        trace = sim_trace(prog, args.seq_len, meta={"source": args.target})
    else:
        ctx = None
        if args.backend == "triton" and (args.tp or 1) > 1:
            from amk import launch

            code, ctx = launch.tp_entry(args.tp, "triton", colocate=args.colocate)
            if code is not None:  # the launcher: the rank processes did the work
                return code
        trace = _model_trace(args, con, ctx)
        if ctx is not None and ctx.rank != 0:
            return 0  # rank 0 writes and speaks for every rank
    problems = check_trace(trace)
    if problems:  # a bug, not a user error: never write a file the viewers cannot open
        raise AmkError("the trace breaks the trace-event format: " + "; ".join(problems[:3]), exit_code=1)
    if args.trace:
        text = json.dumps(trace, separators=(",", ":")) + "\n"
        if str(args.trace).endswith(".gz"):  # Perfetto and chrome://tracing open gzip traces
            import gzip

            atomic_write_bytes(args.trace, gzip.compress(text.encode(), mtime=0))
        else:
            atomic_write_text(args.trace, text)
    s = {"ok": True, "target": args.target, "backend": args.backend, "trace": args.trace,
         **trace_summary(trace)}
    if output.json_mode(args):
        output.emit_json(s)
    else:
        output.human_console(args).print(f"{s['clock']} trace of {args.target}: {s['tasks']} task slices, {s['waits']} "
                  f"waits, {s['flows']} signal->wait flows over {s['ranks']} rank(s) x "
                  f"{s['workers']} worker(s); step {s['step_us']:.2f} us, roofline "
                  f"{s['roofline_us']:.2f} us" + (f"; written to {args.trace}" if args.trace else ""),
                  markup=False, soft_wrap=True)
    return 0


def _model_trace(args: argparse.Namespace, con, ctx=None) -> dict:
    """The trace of MODEL: the config ``amk bench`` would run (tuned entry, heuristic or
    --config with the flags), lowered, validated, then simulated or run with the timers
    (``ctx``: this rank's DistContext in a one-process-per-GPU run, else None)."""
    from amk import pipeline
    from amk.bench import cuda_target, run_config
    from amk.checks import check_counts, check_model_split
    from amk.profile import gpu_trace, sim_trace
    from search.defaults import gpu_for

    tp = args.tp if args.tp is not None else 1
    args.tp, args.model = tp, args.target  # the names amk.bench.run_config reads
    check_counts(tp, getattr(args, "workers", None))
    args.prompt_len, args.tokens = 0, args.seq_len  # the bench defaults' max_seq
    gpu = gpu_for(args, local=args.backend == "triton")
    full, source = run_config(args, gpu)
    check_model_split(args.target, tp, full.lowering)
    cfg = full.lowering
    if args.seq_len > cfg.max_seq:
        raise AmkError(f"--seq-len {args.seq_len} is above the config's max_seq {cfg.max_seq}")
    con.print(source, markup=False, highlight=False, soft_wrap=True)
    meta = {"model": args.target, "config_source": source}
    if args.backend == "triton":
        import torch

        if not torch.cuda.is_available():
            raise AmkError("amk profile --backend triton needs a CUDA GPU; none is visible here "
                           "(--backend sim gives the simulated trace)")
        dev = ctx.device if ctx is not None else torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        from models.sources import resolve_model

        resolved = resolve_model(args.target, dtype="fp32" if cfg.dtype == "f32" else "bf16",
                                 device=dev if ctx is not None else None)
        compilation = pipeline.Compilation.build(args.target, tp, cfg, cuda_target(props), resolved=resolved)
        _check_verdict(compilation)
        return gpu_trace(compilation, full.kernel, args.seq_len, meta=meta, ctx=ctx)
    from ir.program import Target

    compilation = pipeline.Compilation.build(args.target, tp, cfg, Target(backend="sim"), weights=False)
    _check_verdict(compilation)
    return sim_trace(compilation.program, args.seq_len, meta=meta)


def _check_verdict(compilation) -> None:
    if not compilation.verdict.ok:
        errs = compilation.verdict.errors
        raise AmkError(f"the schedule was rejected by the validator ({errs[0] if errs else '?'}); "
                       "nothing to trace", exit_code=1)
