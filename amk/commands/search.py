"""``amk search MODEL``: search the lowering's knobs for a faster schedule (autoresearch).

    amk search MODEL [--tp R] [--backend sim|triton] [--proposer optuna|llm|replay|edits]
                     [--edits] [--trials N | --minutes M] [--out DIR] [--resume DIR] ...

Every trial: propose a config -> lower -> validate -> correctness gate against HF eager ->
timing (sim: the cost model's PREDICTED latency; triton: interleaved A/B with CUDA events,
MEASURED) -> KEEP / REVERT / REJECTED / FAIL / TIMEOUT -> one row in DIR/results.tsv and
DIR/results.jsonl -> checkpoint. A killed search continues with ``--resume DIR``.
``--edits`` (``--proposer edits``): every candidate is a schedule edit list against the lowered
start config (search/edit_proposer.py); DIR/best/edits.json replays through ``amk edit
DIR/base/schedule.json DIR/best/edits.json``; ``--profile TRACE`` ranks its candidates by the
measured task durations of an ``amk profile --trace`` file. See docs/search.md.

``--config FILE`` (and the knob flags) sets trial 0's lowering knobs, the dtype and max_seq of
the whole search and the kernel knobs every triton candidate runs with. The best candidate is
saved as DIR/best/config.json (a config file, ``{"lowering": ..., "kernel": ...}``, what
``amk compile / generate / run / bench --config`` read) beside DIR/best/trial.json (its trial,
id and latency) and DIR/best/schedule.json; the summary prints the ``amk compile`` line that
uses it.

``amk search FILE.py:FUNC --world R --shape NAME=DIMS ... [--dtype bf16|f16|f32]`` searches a
communication pattern instead (docs/dist.md, "Tuning a pattern"): the function is captured
(models/capture.py, as ``amk dist`` does), and the knobs of its pattern's collective config
(lowering.config.CollectiveConfig: only those that act for the pattern) are searched from their
defaults or ``--config``'s ``"collective"`` part; each trial is lowered, validated, run on every
rank against the pattern's torch math and timed (search/patterns.py). DIR/best/config.json is
``{"collective": ...}``, what ``amk dist --config`` and ``amk.distribute(config=...)`` take.
Flags of a model's search (--tp, the lowering knobs, --positions, ...) are refused with a
function, --world / --shape with a model.

Exit codes: 0 when at least one candidate passed the correctness gate, 1 when none did
(the search ran and found nothing correct), 2 for bad input (including an unwritable
``--out``) and for an LLM proposer whose requests failed ``--llm-max-failures`` times in a
row without ``--llm-fallback``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from amk.commands import add_llm_args, add_run_args
from ground.errors import AmkError


def _positions(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one position")
    return vals


HELP = "search the lowering's knobs for a faster schedule"
DESCRIPTION = """\
Autoresearch over the lowering config: propose -> lower -> validate -> correctness gate against
HF eager -> timing (sim: predicted by the cost model; triton: measured A/B vs the incumbent) ->
keep or revert. Results go to DIR/results.tsv (one verdict per row) and DIR/results.jsonl."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("search", help=HELP, description=DESCRIPTION)
    add_run_args(p, trials="total trials including the start (default 30 unless --minutes)",
                 minutes="search time budget in minutes (summed over resumed runs)",
                 out="search directory, relative to the current directory (default "
                     "amk-search/MODEL-tpR-TIMESTAMP)",
                 resume="continue the search in DIR (its settings are reused; --trials, --minutes and "
                        "--timeout may be raised, --llm-fallback and --llm-max-failures changed)")
    p.add_argument("--world", default=None, metavar="R",
                   help="FILE.py:FUNC only: world size (ranks) the function is captured and searched for")
    p.add_argument("--shape", action="append", default=None, metavar="NAME=DIMS",
                   help="FILE.py:FUNC only: rank-local shape of a tensor parameter, e.g. x=64,128 (one per "
                        "parameter; docs/dist.md)")
    p.add_argument("--backend", choices=("sim", "triton"), default=None,
                   help="sim: CPU executor, latency predicted by the cost model (default); "
                        "triton: the GPU megakernel, latency measured")
    p.add_argument("--proposer", choices=("optuna", "llm", "replay", "edits"), default=None,
                   help="optuna: TPE + mutation ranked by the cost model (default, offline); "
                        "llm: anthropic SDK (needs ANTHROPIC_API_KEY); replay: --replay FILE; "
                        "edits: schedule edit lists against the start config's schedule (--edits)")
    p.add_argument("--edits", action="store_true", default=None,
                   help="search schedule edits (move, split, merge, refine_wait, ...; docs/ir.md) "
                        "against the lowered start config instead of knob values: the offline edit "
                        "proposer ranked by the cost model or a measured --profile (= --proposer "
                        "edits), or with "
                        "--proposer llm the LLM proposes the edits")
    p.add_argument("--profile", default=None, metavar="TRACE",
                   help="with --edits: rank the offline edit proposer's candidates by the measured task "
                        "durations of TRACE (a .json or .json.gz written by `amk profile MODEL "
                        "--backend triton --trace TRACE` for the same start config) instead of the "
                        "cost model alone")
    p.add_argument("--approve", action="store_true", default=None,
                   help="hold every proposal after trial 0 (knobs or edits) until it is approved or "
                        "rejected in `amk ui DIR` (files DIR/review/pending, approved, rejected; "
                        "docs/ui.md); a rejected one is recorded as REJECTED")
    p.add_argument("--replay", default=None, metavar="RESULTS",
                   help="results.jsonl (or search directory) for --proposer replay")
    add_llm_args(p, instead="mutations of the incumbent")
    p.add_argument("--seed", type=int, default=None, help="seed of proposers, prompts and "
                                                          "interleavings (0)")
    p.add_argument("--positions", type=_positions, default=None, metavar="P,P,...",
                   help="decode positions whose logits are checked against HF eager (0,3,7)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="context length the latency refers to (128)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="per-candidate evaluation timeout in seconds (600)")
    p.add_argument("--plateau", type=int, default=None, metavar="N",
                   help="trials without improvement before one random restart, then stop (10)")
    p.add_argument("--target-pct", type=float, default=None, metavar="P",
                   help="stop when the best is within P%% of the roofline (e.g. 80)")
    p.add_argument("--max-workers", type=int, default=None,
                   help="co-resident workers per rank of the target (132 = H100 SMs)")
    p.add_argument("--isolation", choices=("persistent", "fresh"), default=None,
                   help="one worker process for all candidates (default) or one per candidate")
    p.add_argument("--ab-rounds", type=int, default=None, help="triton: A/B rounds (7)")
    p.add_argument("--ab-steps", type=int, default=None, help="triton: steps per side per round (20)")
    p.add_argument("--audit-kernels", default=None, metavar="PREFIX[,PREFIX]",
                   help="triton: profile one timed step and FAIL candidates that launch any "
                        "kernel whose name does not start with one of these prefixes")
    p.add_argument("--quiet", action="store_true",
                   help="no live view or per-trial lines; print warnings and the summary only")
    p.add_argument("--json", action="store_true",
                   help="print the summary (as summary.json) as one JSON object on stdout; the live "
                        "view, trial lines and warnings go to stderr")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="config file (docs/lowering.md): its lowering knobs are trial 0 (dtype and max_seq "
                        "held for the whole search), its kernel knobs run every triton candidate and go "
                        "into best/config.json; the knob flags below override it")
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags

    add_flags(p.add_argument_group("lowering knobs: trial 0's (dtype, max_seq: the whole search's)"),
              LoweringConfig)
    add_flags(p.add_argument_group("kernel knobs of --backend triton, held for the whole search "
                                   "(docs/triton.md)"), KernelConfig)
    from search.defaults import add_args

    add_args(p.add_argument_group("default config of --backend triton (docs/tuning.md)"), gpu=True)
    p.set_defaults(func=run)


# flags of a model's search (dest -> flag), refused with FILE.py:FUNC
_MODEL_ONLY = {"tp": "--tp", "positions": "--positions", "seq_len": "--seq-len", "max_workers": "--max-workers",
               "edits": "--edits", "profile": "--profile", "db": "--db", "gpu": "--gpu",
               "audit_kernels": "--audit-kernels"}


def _given_flag(args: argparse.Namespace, dests: dict[str, str]) -> str | None:
    for dest, flag in dests.items():
        if getattr(args, dest, None) not in (None, False):
            return flag
    return None


def _pattern_settings(args: argparse.Namespace) -> Any:
    """The settings of a pattern's search (``amk search FILE.py:FUNC --world R --shape ...``):
    capture the function (amk.commands.capture_function), its pattern as the target, the
    start from ``--config``'s collective part. AmkError (exit 2) for a flag of a model's
    search, a missing --world / --shape or a function amk dist does not lower."""
    from amk.commands import capture_function, parse_target
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import given
    from search.loop import SearchSettings
    from search.patterns import pattern_to_json

    flag = _given_flag(args, _MODEL_ONLY) or ("--no-tuned" if args.no_tuned else None)
    low = {k for k in given(args, LoweringConfig) if k != "dtype"}
    if flag is None and low:
        flag = "--" + sorted(low)[0].replace("_", "-")
    if flag is None and args.proposer == "edits":
        flag = "--proposer edits"
    if flag:
        raise AmkError(f"{flag} is a flag of a model's search; {args.model} is a function (FILE.py:FUNC): "
                       "its search takes --world, --shape, --dtype, --backend, --config and the budget")
    if args.world is None:
        raise AmkError(f"{args.model}: give the world size with --world R")
    dtype = getattr(args, "dtype", None) or "bf16"
    if dtype not in ("bf16", "f16", "f32"):
        raise AmkError(f"--dtype {dtype}: a pattern's dtype is bf16, f16 or f32")
    path, func = parse_target(args.model)
    cap = capture_function(path, func, args.world, args.shape or [], dtype)
    pattern = cap.pattern
    backend = args.backend or "sim"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{path.stem}-{func}").strip("-")
    out = args.out or f"amk-search/{name}-world{pattern.world}-{time.strftime('%Y%m%d-%H%M%S')}"
    s = SearchSettings(model=f"{path.resolve()}:{func}", out=out, tp=pattern.world, backend=backend,
                       dtype=dtype, pattern={"function": f"{path.resolve()}:{func}", "world": pattern.world,
                                             "shapes": _param_shapes(cap), "spec": pattern_to_json(pattern)})
    _shared_flags(s, args)
    if args.replay and not args.proposer:
        s.proposer = "replay"
    flags_ker = given(args, KernelConfig)
    if args.config:
        from amk.distributed import load_config
        from ground.files import read_json
        from lowering.config import collective_part

        obj = read_json(args.config, "config file")
        # amk dist's reading of the file (a knob inert for the pattern is refused); the start is
        # the knobs the file gives, not their defaults
        kernel = load_config(obj, pattern.kind, source=args.config)[1]
        s.start = dict(collective_part(obj, args.config)) or None
        if kernel is not None:
            flags_ker = {**kernel.to_json(), **flags_ker}
        s.config_source = f"config: {args.config}'s collective part over the knobs' defaults"
    if flags_ker:
        if backend != "triton":
            raise AmkError(f"--{next(iter(flags_ker)).replace('_', '-')} is a knob of the triton backend's kernel; "
                           f"--backend {backend} has none (add --backend triton)")
        s.kernel = KernelConfig.from_json(dict(flags_ker), "amk search").to_json()
    s.check()
    return s


# flag attribute -> SearchSettings field, for the flags a model's and a function's search share
_SHARED = {"proposer": "proposer", "minutes": "minutes", "seed": "seed", "timeout": "timeout_s",
           "plateau": "plateau", "target_pct": "target_pct", "replay": "replay", "llm_model": "llm_model",
           "isolation": "isolation", "llm_fallback": "llm_fallback", "llm_max_failures": "llm_max_failures",
           "approve": "approve"}


def _shared_flags(s: Any, args: argparse.Namespace, **more: str) -> None:
    """Set on settings ``s`` every given flag of ``_SHARED`` and ``more`` (attribute -> field),
    the trial budget (``--trials``; ``--minutes`` alone lifts it) and the A/B rounds and steps."""
    for a, f in {**_SHARED, **more}.items():
        v = getattr(args, a)
        if v is not None:
            setattr(s, f, v)
    if args.trials is not None:
        s.trials = args.trials
    elif args.minutes is not None:
        s.trials = None
    if args.ab_rounds is not None:
        s.timing["rounds"] = args.ab_rounds
    if args.ab_steps is not None:
        s.timing["steps"] = args.ab_steps


def _param_shapes(cap: Any) -> dict[str, list[int]]:
    """The ``--shape`` of each tensor parameter, as the function takes it (for the ``amk dist``
    line that uses the best config)."""
    return {op.param: list(cap.operand_shapes()[k]) for k, op in cap.operands.items()}


def _settings_from_args(args: argparse.Namespace) -> Any:
    from amk.commands import is_function_arg
    from search.loop import SearchSettings

    if not args.model:
        raise AmkError("amk search needs MODEL (or --resume DIR)")
    if is_function_arg(args.model):
        return _pattern_settings(args)
    if args.world is not None or args.shape:
        raise AmkError(f"--{'world' if args.world is not None else 'shape'} is a flag of a function's search "
                       f"(amk search FILE.py:FUNC --world R --shape ...); {args.model} is a model (use --tp R)")
    tp = args.tp if args.tp is not None else 1  # --tp 0 is an error, not the default
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.model).strip("-")
    out = args.out or f"amk-search/{name}-tp{tp}-{time.strftime('%Y%m%d-%H%M%S')}"
    s = SearchSettings(model=args.model, out=out, tp=tp)
    _shared_flags(s, args, backend="backend", positions="positions", seq_len="seq_len",
                  max_workers="max_workers", profile="profile")
    if args.audit_kernels:
        s.timing["audit_prefixes"] = [x for x in args.audit_kernels.split(",") if x]
    if args.edits:
        if args.proposer not in (None, "edits", "llm"):
            raise AmkError(f"--edits proposes schedule edits offline (--proposer edits) or with "
                           f"--proposer llm, not with --proposer {args.proposer}")
        s.edits = True
        s.proposer = args.proposer or "edits"
    if s.proposer == "edits":
        s.edits = True  # --proposer edits is --edits (a resume may name either)
    if args.replay and not args.proposer:
        s.proposer = "replay"
    _config_settings(args, s)
    s.check()
    from amk.checks import check_counts, check_model_split
    check_counts(s.tp, s.max_workers, workers_flag="--max-workers")
    check_model_split(s.model, s.tp)  # before the search starts: the config only
    return s


def _config_settings(args: argparse.Namespace, s: Any) -> None:
    """--config FILE and the knob flags into the settings: dtype and max_seq (fixed for the
    search), the other lowering knobs they set (trial 0, ``start``) and the kernel knobs
    (``kernel``; kernel knobs with --backend sim are refused: that backend has no kernel)."""
    from lowering.config import KernelConfig, LoweringConfig, config_from_args, file_fields
    from lowering.knobs import given

    flags_low, flags_ker = given(args, LoweringConfig), given(args, KernelConfig)
    _refuse_quantized(flags_low)
    if s.backend == "triton" and not (args.config or args.no_tuned):
        _tuned_settings(args, s, flags_low, flags_ker)
        return
    if not (args.config or flags_low or flags_ker):
        return
    cfg = config_from_args(args, "amk search", ranks=s.tp)
    _refuse_quantized(cfg.lowering.to_json())
    low, ker = file_fields(args)
    if (ker or flags_ker) and s.backend != "triton":
        flag = "--" + next(iter(flags_ker or ker)).replace("_", "-")
        raise AmkError(f"{flag} is a knob of the triton backend's kernel; --backend {s.backend} has none "
                       "(add --backend triton)")
    explicit = set(low) | set(flags_low)
    if "dtype" in explicit:
        s.dtype = cfg.lowering.dtype
    if "max_seq" in explicit:
        s.max_seq = cfg.lowering.max_seq
    s.start = {k: getattr(cfg.lowering, k) for k in sorted(explicit - {"dtype", "max_seq"})} or None
    s.kernel = cfg.kernel.to_json() if (ker or flags_ker) else {}


def _refuse_quantized(low: dict) -> None:
    """The search lowers unquantized weights only: --weights int8 / fp8 and
    --quantize-lm-head are refused in one line (AmkError, exit 2)."""
    if low.get("weights") in ("int8", "fp8") or low.get("quantize_lm_head"):
        raise AmkError("amk search: --weights int8 / fp8 and --quantize-lm-head are not searched; "
                       "search with unquantized weights, then compile with --weights")


def _tuned_settings(args: argparse.Namespace, s: Any, flags_low: dict, flags_ker: dict) -> None:
    """--backend triton without --config / --no-tuned: the tuned entry or the cost-model
    heuristic for the model on the local GPU (search/defaults.py), flags over it. Its kernel
    knobs run every candidate; trial 0 is the point of the search space nearest its lowering
    knobs (search.defaults.snap_to_space: the space holds powers of two, the heuristic may
    not). The source line goes to ``s.config_source`` (printed by ``run``)."""
    from amk.checks import model_spec
    from search.defaults import command_config, gpu_for, snap_to_space
    from search.space import space_for

    spec = model_spec(s.model)[1]
    cfg, line = command_config(args, "amk search", spec, s.tp, gpu_for(args), defaults={"dtype": s.dtype})
    explicit = set(flags_low)
    if "dtype" in explicit:
        s.dtype = cfg.lowering.dtype
    if "max_seq" in explicit:
        s.max_seq = cfg.lowering.max_seq
    space = space_for(spec, s.tp, s.max_workers, fixed={"dtype": s.dtype, "max_seq": s.max_seq})
    start = snap_to_space(cfg.lowering.to_json(), space)
    start.update({k: v for k, v in flags_low.items() if k not in ("dtype", "max_seq")})
    s.start = start
    s.kernel = cfg.kernel.to_json()
    s.config_source = line


class LiveView:
    """A rich progress bar with the best-so-far, plus one printed line per trial."""

    def __init__(self, search: Any, quiet: bool = False, stderr: bool = False):
        from rich.console import Console

        self.search = search
        self.quiet = quiet
        self.console = Console(highlight=False, stderr=stderr)
        self.progress = None
        self.task = None

    def __enter__(self) -> "LiveView":
        if self.quiet:
            return self
        from rich.progress import (
            BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
        )

        s = self.search.s
        self.progress = Progress(TextColumn("[bold]search[/]"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("{task.description}"), console=self.console)
        self.progress.start()
        self.task = self.progress.add_task(self._best(), total=s.trials,
                                           completed=len(self.search.records))
        return self

    def _best(self) -> str:
        b = self.search.state.best
        if b is None or b.latency_ms is None:
            return "best: -"
        return (f"best: trial {b.trial} {b.latency_ms:.4g} ms ({b.timing_source}), "
                f"{b.pct_roofline or 0:.1f}% of roofline")

    def on_trial(self, rec: Any, search: Any) -> None:
        if self.quiet:
            return
        from rich.markup import escape

        color = {"KEEP": "green", "REVERT": "white", "REJECTED": "yellow", "FAIL": "red",
                 "TIMEOUT": "magenta"}[rec.status]
        lat = f"{rec.latency_ms:.4g} ms {rec.timing_source}" if rec.latency_ms is not None \
            else "no latency"
        self.console.print(f"trial {rec.trial:3d} [{color}]{rec.status:8s}[/] {lat:24s} "
                           f"{escape(rec.proposer):9s} {escape(rec.description[:70])}"
                           + (f"  [dim]{escape(rec.reason[:90])}[/]" if rec.reason else ""))
        self.progress.update(self.task, completed=len(search.records), description=self._best())

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()


def print_summary(result: Any, console: Any) -> None:
    """The end-of-search table: trials per status, the start, the best, the stop reason."""
    from rich.markup import escape
    from rich.table import Table

    from search.loop import summarize

    s = summarize(result.records, result.state, result.settings, result.stop_reason)
    src = s["timing_source"]
    t = Table(title=f"amk search summary ({src} latency)", title_justify="left",
              show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value", overflow="fold")
    t.add_row("trials", ", ".join(f"{k} {v}" for k, v in sorted(s["by_status"].items())))
    for key in ("start", "best"):
        b = s[key]
        if b:
            t.add_row(key, escape(
                f"trial {b['trial']} {b['latency_ms']:.4g} ms ({b['timing_source']}), "
                f"roofline {b['roofline_ms']:.4g} ms, {b['pct_roofline']:.1f}% of roofline; "
                f"{b['config']}"))
        else:
            t.add_row(key, "none passed the correctness gate")
    if s["speedup_vs_start"]:
        t.add_row("speedup vs start", f"{s['speedup_vs_start']:.3f}x ({src})")
    if s.get("edits"):
        e = s["edits"]
        t.add_row("edits", f"{e['proposed']} proposed, {e['rejected']} rejected by the validator, "
                           f"{e['failed_gate']} failed the correctness gate, {e['kept']} kept, "
                           f"{e['reverted']} reverted")
        for cls, v in sorted(e["rejected_by_class"].items()):
            w = json.dumps(v.get("witness"), separators=(",", ":"), default=str)
            t.add_row(f"  {escape(cls)}", escape(f"{v['count']}x, first trial {v['trial']}: "
                                                 f"{json.dumps(v['edit'])}; witness {w[:300]}"))
        if s.get("replay_best"):
            t.add_row("replay the best", escape(s["replay_best"]))
    if s["fallbacks"]:
        t.add_row("fallbacks", f"{s['fallbacks']} trials used a mutation because the "
                               f"{escape(s['proposer'])} proposer gave no usable candidate")
    t.add_row("stopped", escape(s["stop_reason"] or "-"))
    t.add_row("results", escape(f"{result.out}/results.tsv, results.jsonl"))
    if s["use_best"]:
        t.add_row("use the best", escape(s["use_best"]))
    if result.plot:
        t.add_row("plot", escape(str(result.plot)))
    console.print(t)


def run(args: argparse.Namespace) -> int:
    from search.loop import open_search

    if args.resume:
        from lowering.config import KernelConfig, LoweringConfig
        from lowering.knobs import given

        if args.config or given(args, LoweringConfig) or given(args, KernelConfig) or args.world or args.shape:
            raise AmkError("--resume DIR reuses the search's settings: --config and the knob flags "
                           "cannot change them")
        if args.model:
            overrides: dict[str, Any] = {"model": args.model}
        else:
            overrides = {}
        overrides.update({"trials": args.trials, "minutes": args.minutes,
                          "timeout_s": args.timeout, "tp": args.tp, "backend": args.backend,
                          "proposer": args.proposer or ("edits" if args.edits else None),
                          "edits": args.edits,
                          "llm_fallback": args.llm_fallback,
                          "llm_max_failures": args.llm_max_failures, "approve": args.approve,
                          "profile": str(Path(args.profile).expanduser().resolve())
                          if args.profile else None})
        search = open_search(resume=args.resume, overrides=overrides)
    else:
        search = open_search(_settings_from_args(args))
    from amk.output import emit_json, json_mode

    view = LiveView(search, quiet=args.quiet, stderr=json_mode(args))
    search.console = view.console  # warnings (proposer fallbacks, ...) even with --quiet
    if search.s.config_source and not search.records:
        view.console.print(search.s.config_source, markup=False, highlight=False, soft_wrap=True)
    what = (f"{search.pattern.kind} of {search.s.model} --world {search.s.tp}" if search.s.pattern
            else f"{search.s.model} --tp {search.s.tp}")
    view.console.print(f"amk search {what} --backend "
                       f"{search.s.backend}: {search.space.size()} candidates over knobs "
                       f"{', '.join(search.space.names)}; "
                       f"{'predicted (cost model)' if search.s.backend == 'sim' else 'measured'}"
                       f" latency; out {search.out}"
                       + (f"; resuming after {len(search.records)} trials"
                          if search.records else ""))
    with view:
        result = search.run(on_trial=view.on_trial)
    print_summary(result, view.console)
    if json_mode(args):
        from search.loop import summarize

        emit_json({"ok": result.state.best is not None, "out": str(result.out),
                   "config_source": result.settings.config_source
                   or "config: --config / the knob flags over the lowering's defaults",
                   **summarize(result.records, result.state, result.settings, result.stop_reason)})
    return 0 if result.state.best is not None else 1
