"""``amk tune MODEL``: find the fastest whole config (lowering and kernel knobs) of a model on
this GPU at this --tp and store it in the tuning database, where every command finds it.

    amk tune MODEL [--tp R] [--minutes M] [--trials N] [--db DIR] [--out DIR] [--resume DIR]
                   [--backend triton|sim] [--baselines MODES|none] [--replace] [--json]
                   [--proposer local|llm] [--llm-fallback] [--llm-max-failures N]

The loop is search/tune.py (docs/tuning.md "amk tune"); this module parses the command line,
measures the baselines with ``amk bench``'s code (amk/baselines.py), shows the progress on
stderr and prints the summary. Exit codes: 0 a config passed the correctness gate, 1 none
did, 2 bad input (and an LLM proposer whose requests failed ``--llm-max-failures`` times in a
row without ``--llm-fallback``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from amk.commands import add_llm_args, add_run_args
from ground.errors import AmkError

HELP = "tune a model's whole config (lowering + kernel knobs) and store it in the tuning database"
DESCRIPTION = """\
Warm start from the cost-model heuristic and the nearest tuned entries, then rounds of one-knob
moves of the incumbent ranked by where the step spends its time (the in-kernel profile on the
GPU, the cost model on the sim) and a few random two-knob mutations; each candidate is screened
(no GPU time for a refused one), checked against the eager model and timed A/B against the
incumbent. The best goes to the tuning database (--db) and DIR/best/config.json. With --proposer llm
a language model proposes each round's candidates from the same profile, the trials and the
nearest database entries (any knob; needs ANTHROPIC_API_KEY)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help=HELP, description=DESCRIPTION)
    add_run_args(p, trials="evaluated candidates in all, the warm start included",
                 minutes="tuning time budget, summed over resumed runs (default 20 unless --trials)",
                 out="the run's directory (default amk-tune/MODEL-tpR-TIMESTAMP)",
                 resume="continue the run in DIR (its settings; --trials, --minutes, --timeout, --db and "
                        "--replace may change)")
    p.add_argument("--db", default=None, metavar="DIR",
                   help="the tuning database to read and write (default $AMK_TUNE_DB, else "
                        "~/.cache/amk/tuned)")
    p.add_argument("--backend", choices=("triton", "sim"), default=None,
                   help="triton: the GPU megakernel, latency measured (default); sim: the CPU executor, "
                        "latency PREDICTED by the cost model (lowering knobs only)")
    p.add_argument("--baselines", default=None, metavar="MODES|none",
                   help="baselines measured twice each at the start, with amk bench's code: a comma list of "
                        "eager and torch.compile modes (default eager,default); none skips them")
    p.add_argument("--replace", action="store_true", default=None,
                   help="store the result even if the database holds a faster entry of the same key")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="weights and activations (default bf16 on triton, f32 on sim)")
    p.add_argument("--max-seq", type=int, default=None, metavar="N", help="KV-cache length (256)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N", help="context length the latency refers to (128)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="per-candidate evaluation timeout in seconds (600)")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed of prompts, interleavings and mutations (0)")
    p.add_argument("--ring", action="store_true", default=None, help="search the weight ring's pages too")
    p.add_argument("--no-profile", action="store_true", default=None,
                   help="rank the knobs by the cost model, not the in-kernel profile")
    p.add_argument("--ab-rounds", type=int, default=None, metavar="N", help="triton: A/B rounds (7)")
    p.add_argument("--ab-steps", type=int, default=None, metavar="N", help="triton: steps per side per round (20)")
    p.add_argument("--proposer", choices=("local", "llm"), default=None,
                   help="local: profile-first one-knob moves and mutations (default, offline); llm: a "
                        "language model proposes each round's candidates (anthropic SDK, needs ANTHROPIC_API_KEY)")
    p.add_argument("--llm-candidates", type=int, default=None, metavar="K",
                   help="--proposer llm: candidates asked for per round (4)")
    add_llm_args(p, instead="the local moves")
    p.add_argument("--quiet", action="store_true", help="no progress bar or trial lines")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object on stdout (progress and lines go to stderr)")
    p.set_defaults(func=run)


def _gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise AmkError("--backend triton measures the megakernel and needs a CUDA GPU; none is visible here "
                       "(see `amk doctor`, or tune against the cost model with --backend sim)")
    p = torch.cuda.get_device_properties(0)
    return {"name": str(p.name), "sms": int(p.multi_processor_count),
            "smem": int(getattr(p, "shared_memory_per_block_optin", 0) or 0)}


def _settings(args: argparse.Namespace) -> Any:
    from search.tune import TuneSettings

    if not args.model:
        raise AmkError("amk tune needs MODEL (or --resume DIR)")
    tp = args.tp if args.tp is not None else 1
    backend = args.backend or "triton"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.model).strip("-")
    out = args.out or f"amk-tune/{name}-tp{tp}-{time.strftime('%Y%m%d-%H%M%S')}"
    s = TuneSettings(model=args.model, out=out, tp=tp, backend=backend, trials=args.trials,
                     minutes=args.minutes, db=args.db, dtype=args.dtype or ("bf16" if backend == "triton" else "f32"))
    for a, f in (("max_seq", "max_seq"), ("seq_len", "seq_len"), ("timeout", "timeout_s"), ("seed", "seed")):
        if getattr(args, a) is not None:
            setattr(s, f, getattr(args, a))
    s.replace = bool(args.replace)
    for a in ("proposer", "llm_model", "llm_candidates", "llm_max_failures"):
        if getattr(args, a) is not None:
            setattr(s, a, getattr(args, a))
    s.llm_fallback = bool(args.llm_fallback)
    s.ring = bool(args.ring)
    s.profile = not args.no_profile
    if args.ab_rounds is not None:
        s.timing["rounds"] = args.ab_rounds
    if args.ab_steps is not None:
        s.timing["steps"] = args.ab_steps
    text = args.baselines if args.baselines is not None else ("eager,default" if backend == "triton" else "none")
    s.baselines = [] if text.strip().lower() == "none" else _modes(text)
    if s.baselines and backend == "sim":
        raise AmkError("--baselines: the sim backend has no baselines (its latency is the cost model's); "
                       "use --baselines none")
    s.check()
    from amk.checks import check_counts, check_model_split

    check_counts(s.tp, None)
    check_model_split(s.model, s.tp)
    if backend == "triton":
        from amk.bench import MAX_WORKERS_PER_SM

        s.gpu = _gpu()
        s.max_workers = MAX_WORKERS_PER_SM * s.gpu["sms"]
    return s


def _modes(text: str) -> list[str]:
    from amk.baselines import compile_modes

    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise AmkError("--baselines: expected a comma list of eager and torch.compile modes, or none")
    rest = [n for n in names if n != "eager"]
    if rest:
        compile_modes(",".join(rest), "--baselines")  # refuses an unknown mode, naming the flag
    return names


def measure_baselines(s: Any, tokens: int = 64, prompt_len: int = 8, console: Any = None) -> list[dict[str, Any]]:
    """The baselines of ``amk bench`` (amk/baselines.py: HF eager, torch.compile + CUDA graph per
    mode), each measured twice on the bf16 model; a row per mode: ``name``, ``runs`` (the two
    medians, ms/token), ``ms`` (the faster), ``correct`` (both runs' greedy tokens judged
    against the HF reference), ``note``. At --tp > 1 none are measured here (they need one
    process per GPU: ``amk bench --tp R``)."""
    if s.tp > 1:
        if console is not None:
            console.print("baselines: none at --tp > 1 here (amk bench --tp R measures them over R processes)")
        return []
    import torch

    from amk.baselines import BaselineResult, compile_modes, hf_compiled_graph, hf_eager, judge, make_reference
    from models.sources import resolve_model

    resolved = resolve_model(s.model, dtype="fp32" if s.dtype == "f32" else "bf16")
    dev = torch.device("cuda")
    model = resolved.model.to(dev)
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g).to(dev)
    ref = make_reference(model, prompt, tokens)
    rows = []
    for mode in s.baselines:
        runs: list[BaselineResult] = []
        for _ in range(2):
            if console is not None:
                console.print(f"baseline {mode}: run {len(runs) + 1} of 2")
            try:
                if mode == "eager":
                    r = hf_eager(model, prompt, tokens)
                else:
                    r = hf_compiled_graph(model, prompt, tokens, mode=compile_modes(mode, "--baselines")[0])
                runs.append(judge(r, ref))
            except Exception as err:  # keep the row with the reason rather than lose the run
                runs.append(BaselineResult(mode, [], None, False, f"failed: {type(err).__name__}: {err}"))
        meds = [r.timing.median_ms for r in runs if r.timing is not None]
        rows.append({"name": runs[0].name, "mode": mode, "runs": meds, "ms": min(meds) if meds else None,
                     "correct": all(r.correct for r in runs), "note": "; ".join(r.note for r in runs if r.note)})
    del model
    torch.cuda.empty_cache()
    return rows


def confirm_with_bench(s: Any, out: Path, tokens: int = 128, console: Any = None) -> Any:
    """A function ``config -> dict | None`` that measures a config the way `amk bench` does
    (a subprocess ``amk bench MODEL --config FILE --no-baselines --tokens 128``: CUDA-graph
    decode, token and logit checks, the roofline from the bandwidth measured in that run), so
    the database entry records the speed a user will see; None at --tp > 1 (bench runs one
    process per GPU there) or when the run fails (the reason is printed)."""
    import subprocess

    from ground.files import atomic_write_json

    def confirm(config: dict[str, Any]) -> dict[str, Any] | None:
        if s.tp > 1:
            return None
        cfg = {"lowering": {k: v for k, v in config.get("lowering", {}).items() if k != "max_seq"},
               "kernel": dict(config.get("kernel", {}))}
        cfg_file, res_file = out / "best" / "bench-config.json", out / "best" / "bench.json"
        atomic_write_json(cfg_file, cfg)
        cmd = [sys.executable, "-m", "amk", "bench", s.model, "--config", str(cfg_file), "--no-baselines",
               "--tokens", str(tokens), "--out", str(res_file)]
        if console is not None:
            console.print(f"confirming the best config with amk bench ({tokens} tokens, CUDA graph)")
        p = subprocess.run(cmd, capture_output=True, text=True)
        try:
            res = json.loads(res_file.read_text())
        except (OSError, ValueError):
            if console is not None:
                console.print(f"amk bench of the best config failed (exit {p.returncode}): "
                              f"{(p.stderr.strip().splitlines() or ['no output'])[-1]}", soft_wrap=True)
            return None
        return {"ms": res["latency_ms_median"], "roofline_pct": res.get("roofline_pct"),
                "correct": bool(res.get("correct")), "verdict": res.get("verdict"),
                "command": "amk bench " + " ".join(cmd[4:]), "file": str(res_file)}
    return confirm


class Progress:
    """The progress bar on stderr (elapsed / budget, trials, the incumbent's ms and its ratio
    to the fastest baseline) and one line per trial."""

    def __init__(self, tuner: Any, quiet: bool, console: Any):
        self.t = tuner
        self.quiet = quiet
        self.console = console
        self.bar = None

    def describe(self) -> str:
        t = self.t
        inc = t.incumbent
        src = t.s.timing_source
        text = f"trials {t.trials}" + (f"/{t.s.trials}" if t.s.trials else "")
        text += f" | incumbent {inc.ms:.4g} ms ({src})" if inc else " | incumbent -"
        r = t.ratio()
        if r:
            text += f" | {r:.3f}x the fastest baseline"
        return text

    def budget(self) -> str:
        t = self.t
        used = t.elapsed()
        total = f"{t.s.minutes:g} min" if t.s.minutes else "-"
        return f"{used / 60:.1f} min / {total}"

    def __enter__(self) -> "Progress":
        if self.quiet:
            return self
        from rich.progress import BarColumn, Progress as Bar, TextColumn

        self.bar = Bar(TextColumn("[bold]tune[/]"), BarColumn(), TextColumn("{task.fields[budget]}"),
                       TextColumn("{task.description}"), console=self.console)
        self.bar.start()
        self.task = self.bar.add_task(self.describe(), total=self._total(), completed=self._done(),
                                      budget=self.budget())
        return self

    def _total(self) -> float:
        t = self.t
        return float(t.s.trials) if t.s.trials else float(t.s.minutes or 1) * 60

    def _done(self) -> float:
        t = self.t
        return float(t.trials) if t.s.trials else min(t.elapsed(), self._total())

    def on_row(self, row: dict[str, Any], tuner: Any) -> None:
        if self.quiet:
            return
        from rich.markup import escape

        color = {"KEEP": "green", "REVERT": "white", "REJECTED": "yellow", "FAIL": "red",
                 "TIMEOUT": "magenta"}.get(row["status"], "white")
        lat = f"{row['ms']:.4g} ms {row['timing_source']}" if row.get("ms") is not None else "-"
        trial = f"trial {row['trial']:3d}" if row.get("trial") is not None else "screen   "
        self.console.print(f"{trial} [{color}]{row['status']:8s}[/] {lat:24s} {escape(row['kind']):9s} "
                           f"{escape(row.get('note', '')[:80])}"
                           + (f"  [dim]{escape(row['reason'][:100])}[/]" if row.get("reason") else ""),
                           soft_wrap=True)
        self.bar.update(self.task, completed=self._done(), description=self.describe(), budget=self.budget())

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_summary(summary: dict[str, Any], console: Any) -> None:
    from rich.markup import escape

    src = summary["timing_source"]
    console.print(f"amk tune {escape(summary['model'])} --tp {summary['tp']} ({summary['backend']}): "
                  f"{summary['trials']} trials, {', '.join(f'{k} {v}' for k, v in sorted(summary['by_status'].items()))}; "
                  f"stopped: {escape(summary['stop_reason'] or '-')}", soft_wrap=True)
    if src == "predicted":
        console.print("latency: PREDICTED by the cost model (the sim backend), not a measurement")
    if summary.get("proposer") == "llm":
        console.print(f"llm proposer: {summary['proposer_errors']} proposer errors; {summary['fallbacks']} rounds "
                      f"fell back to the local moves (prompts and answers: {escape(summary['out'])}/proposer.log)",
                      soft_wrap=True)
    st, b = summary["start"], summary["best"]
    if b is None:
        console.print("no candidate passed the correctness gate")
        return
    console.print(f"start: trial {st['trial']} {st['ms']:.4g} ms/token ({src}); best: trial {b['trial']} "
                  f"{b['ms']:.4g} ms/token ({src}), {summary['speedup_vs_start']:.3f}x the start")
    c = summary.get("confirmed")
    if c:
        console.print(f"amk bench of the best: {c['ms']:.4g} ms/token, {c.get('roofline_pct') or 0:.1f}% of "
                      f"roofline, correct: {c['correct']} ({escape(c['file'])}); the database entry records it",
                      soft_wrap=True)
    if summary.get("ratio_vs_fastest_baseline"):
        fb = summary["fastest_baseline"]
        console.print(f"fastest baseline: {escape(fb['name'])} {fb['ms']:.4g} ms/token; the best is "
                      f"{summary['ratio_vs_fastest_baseline']:.3f}x its speed")
    console.print(f"tuning database: {escape(summary['db']['message'])}", soft_wrap=True)
    console.print(f"best config: {escape(summary['best_config_file'])}; report: "
                  f"{escape(summary['out'])}/report.md", soft_wrap=True)
    console.print(f"use it: {escape(summary['use'])}", soft_wrap=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from amk.output import emit_json, human_console, json_mode
    from search.tune import open_tune

    err = Console(stderr=True, highlight=False)  # progress, trial lines, warnings
    if args.resume:
        overrides = {"trials": args.trials, "minutes": args.minutes, "timeout_s": args.timeout,
                     "replace": args.replace, "db": args.db, "tp": args.tp, "backend": args.backend,
                     "llm_fallback": args.llm_fallback, "llm_max_failures": args.llm_max_failures}
        tuner = open_tune(resume=args.resume, overrides=overrides, console=err)
    else:
        tuner = open_tune(_settings(args), console=err)
    view = Progress(tuner, quiet=args.quiet, console=err)
    s = tuner.s
    view.console.print(f"amk tune {s.model} --tp {s.tp} --backend {s.backend}: "
                       f"{len(tuner.space.knobs)} knobs ({', '.join(tuner.space.names)}); "
                       + ("latency PREDICTED by the cost model (the sim backend: lowering knobs only)"
                          if s.backend == "sim" else f"latency measured on {s.gpu['name']}")
                       + f"; out {tuner.out}" + (f"; resuming after {tuner.trials} trials" if tuner.rows else ""),
                       soft_wrap=True)
    tuner.measure_baselines(lambda st: measure_baselines(st, console=view.console))
    with view:
        summary = tuner.run(on_row=view.on_row,
                            confirm=confirm_with_bench(s, tuner.out, console=view.console)
                            if s.backend == "triton" else None)
    print_summary(summary, human_console(args, soft_wrap=True))
    if json_mode(args):
        emit_json(summary)
    return 0 if summary["ok"] else 1
