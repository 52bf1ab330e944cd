"""`amk bench MODEL`: per-token decode latency of the megakernel on one GPU, against the
roofline and against baselines measured in the same run on the same device.

Every latency is printed with its correctness verdict: greedy tokens against HF
``generate`` (a divergence is accepted only at a bf16 near-tie, see
amk.baselines.judge_tokens) and, for the megakernel, logits against HF eager at several
positions. With ``--weights int8|fp8`` the megakernel is judged against the HF model with
the same quantized weights dequantized (lowering.quant.quantized_copy), its roofline counts
the quantized bytes (lowering.quant.decode_bytes), and the HF baselines stay bf16 (the
torchao baselines are bench/quant.py's).

Output: the table goes to stdout (to stderr with ``--json``, which prints the result object
to stdout as one JSON line); ``--out FILE`` writes the same object to FILE (indented),
whole or not at all. FILE's directory is checked before anything is measured.

The measurement itself (config and Triton options from the flags, the megakernel's timing)
is amk/bench.py; ``--tp R`` runs amk/bench_tp.py in every rank process.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from amk.bench import cuda_target, measure_megakernel, run_config, write_result
from ground.errors import AmkError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time the megakernel's decode step against the roofline "
                       "and HF baselines (needs a GPU)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: R > 1 runs one process per GPU over NVSHMEM")
    p.add_argument("--tokens", type=int, default=128, help="decode steps timed (default 128)")
    p.add_argument("--prompt-len", type=int, default=8, help="random prompt tokens (default 8)")
    p.add_argument("--config", metavar="FILE",
                   help="config file: {\"lowering\": {...}, \"kernel\": {...}} (docs/lowering.md); the knob "
                        "flags below override it")
    from amk.bench import BENCH_DEFAULTS
    from lowering.config import KernelConfig, LoweringConfig
    from lowering.knobs import add_flags

    add_flags(p.add_argument_group("lowering knobs (docs/lowering.md)"), LoweringConfig, defaults=BENCH_DEFAULTS)
    add_flags(p.add_argument_group("kernel knobs (docs/triton.md)"), KernelConfig)
    from search.defaults import add_args

    add_args(p.add_argument_group("default config (docs/tuning.md)"))
    p.add_argument("--no-baselines", action="store_true", help="skip the HF baselines")
    p.add_argument("--baseline-compile-mode", default="default,max-autotune-no-cudagraphs", metavar="MODES",
                   help="comma list of torch.compile modes, one baseline (b) row each (default: "
                        "default,max-autotune-no-cudagraphs; the second compiles for ~2 minutes and "
                        "measured 23%% faster on the SmolLM2 shape); with --tp R, one HF tensor-parallel "
                        "compiled-graph row each")
    p.add_argument("--baseline-runs", type=int, default=2, metavar="N",
                   help="measure each baseline N times, each later run compiled afresh with torch.compile's "
                        "caches off (its max-autotune choice differs from one compile to the next), "
                        "and compare against the fastest correct run (default 2)")
    p.add_argument("--tp-checkpoint-dir", metavar="DIR", default=None,
                   help="--tp R: where rank 0 writes a random-weight model as safetensors for the HF "
                        "tensor-parallel baselines (default: a folder in the temp dir)")
    p.add_argument("--json", action="store_true",
                   help="print the result object to stdout as one JSON line (the table goes to stderr)")
    p.add_argument("--out", metavar="FILE", default=None,
                   help="write the result object to FILE (JSON, indented); with --tp R it is "
                        "rewritten after each stage, so a run cut short keeps its rows")
    p.set_defaults(func=run)


def results_table(title: str, results: list, rows: list[dict]):
    """The printed table of `amk bench`: one line per method (megakernel, baselines) with
    its median, p10-p90, roofline share, tokens/s and verdict. ``results`` are the measured
    objects (``name``, ``timing``, ``correct``, ``note``), ``rows`` their JSON rows. Names and
    notes are shown verbatim: a (b) row's name carries its compile mode in brackets, which
    rich would otherwise read as markup and drop."""
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=title)
    width = max(len(r.name) for r in results)
    for c in ("method", "ms/token (median)", "p10-p90", "% roofline", "tokens/s", "correct", "note"):
        tab.add_column(c, min_width=width if c == "method" else None, overflow="fold" if c == "note" else "ellipsis")
    for r, d in zip(results, rows):
        t = r.timing
        tab.add_row(escape(r.name), f"{t.median_ms:.4f}" if t else "-",
                    f"{t.p10_ms:.3f}-{t.p90_ms:.3f}" if t else "-",
                    f"{d['roofline_pct']:.1f}" if d["roofline_pct"] else "-",
                    f"{d['tokens_per_s']:.0f}" if d["tokens_per_s"] else "-",
                    str(r.correct), escape(r.note))
    return tab


def run(args: argparse.Namespace) -> int:
    from amk.checks import check_counts, check_model_split

    from search.tunedb import GpuKey

    check_counts(args.tp, getattr(args, "workers", None))  # before the model is read
    if args.baseline_runs < 1:
        raise AmkError(f"--baseline-runs must be at least 1, got {args.baseline_runs}")
    full, config_source = run_config(args, GpuKey.local())
    check_model_split(args.model, args.tp, full.lowering)  # tile / allreduce; config only
    import torch

    from rich.console import Console

    from amk import pipeline
    from amk.output import check_writable_dir
    from amk.baselines import (BaselineResult, compile_modes, compiled_graph_name, fresh_compile, hf_compiled_graph,
                               hf_eager, judge, make_reference, run_name, speedup_line, speedup_summary)
    from ground.timing import measure_hbm_bandwidth, roofline_ms
    from lowering.quant import decode_bytes, is_quantized, quantized_copy
    from lowering.triton.blocks import kernel_options
    con = Console(stderr=True)
    con.print(config_source, markup=False, highlight=False, soft_wrap=True)
    if args.out:  # a run takes minutes: refuse an unwritable --out before it starts
        check_writable_dir(Path(args.out).parent, "--out")
    if not torch.cuda.is_available():
        raise AmkError("amk bench needs a CUDA GPU; none is visible here (see `amk doctor`)")
    if args.tp > 1:
        from amk import launch
        from amk.bench_tp import run_tp
        code, ctx = launch.tp_entry(args.tp, "triton")
        return code if code is not None else run_tp(args, ctx)
    if args.tokens < 4:
        raise AmkError("--tokens must be at least 4")
    modes = compile_modes(getattr(args, "baseline_compile_mode", "default"), "--baseline-compile-mode")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    cfg = full.lowering
    target = cuda_target(props)

    with con.status("measuring HBM bandwidth"):
        bw = measure_hbm_bandwidth(dev)
    with con.status(f"resolving {args.model} (bf16)"):
        resolved = pipeline.resolve(args.model) if cfg.dtype == "f32" else _resolve_bf16(args.model)
    model = resolved.model
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    with con.status("HF greedy reference"):
        model = model.to(dev)
        ref = ours_ref = make_reference(model, prompt.to(dev), args.tokens)
        if is_quantized(cfg.weights):  # amk's tokens against the model it computes: the same
            qref = quantized_copy(model, cfg.weight_format, cfg.quantize_lm_head)  # quantized weights
            ours_ref = make_reference(qref, prompt.to(dev), args.tokens)
            del qref
    with con.status("megakernel: lower, validate, build, check logits, decode in a CUDA graph"):
        ours, compilation, ex = measure_megakernel(args.model, resolved, cfg, target, prompt, ours_ref,
                                                   args.tokens, kernel_options(full.kernel))
    timing = ours.timing
    nbytes = decode_bytes(model, cfg.weight_format, cfg.quantize_lm_head)  # quantized: 1 byte + scales
    floor = roofline_ms(nbytes, bw)

    baselines: list[BaselineResult] = []
    if not args.no_baselines:
        for k in range(1, args.baseline_runs + 1):
            with con.status(f"baseline (a): HF eager, run {k}"):
                r = judge(hf_eager(model, prompt.to(dev), args.tokens), ref)
                r.name = run_name(r.name, k)
                baselines.append(r)
        for mode in modes:
            for k in range(1, args.baseline_runs + 1):
                name = run_name(compiled_graph_name(mode), k)
                with con.status(f"baseline (b): torch.compile ({mode or 'default'}) + CUDA graph, "
                                f"static cache, run {k}"), fresh_compile(k):
                    try:
                        r = judge(hf_compiled_graph(model, prompt.to(dev), args.tokens, mode=mode), ref)
                        r.name = name
                    except Exception as err:  # keep the row, with the reason, rather than lose the run
                        r = BaselineResult(name, [], None, False, f"failed: {type(err).__name__}: {err}")
                baselines.append(r)

    def row(r: BaselineResult) -> dict:
        d = r.to_json()
        med = d["latency_ms_median"]
        d["roofline_pct"] = 100 * floor / med if med else None
        d["tokens_per_s"] = 1e3 / med if med else None
        return d

    result = {
        "device": props.name, "model": args.model, "tp": 1, "backend": "triton",
        "command": "amk " + " ".join(sys.argv[1:]) if sys.argv else "amk bench",
        "python": platform.python_version(), "torch": torch.__version__,
        "config": cfg.to_json(), "kernel": full.kernel.to_json(), "config_source": config_source,
        "tasks": len(compilation.program.tasks), "workers": ex.workers,
        "num_warps": ex.num_warps, "blocks": ex.blocks.__dict__,
        "occupancy": ex.occupancy, "build_s": ours.extra["build_s"],
        "weight_bytes": nbytes, "hbm_bytes_per_s": bw, "roofline_ms": floor,
        "latency_ms_median": timing.median_ms, "timing": timing.to_json(),
        "roofline_pct": 100 * floor / timing.median_ms, "tokens_per_s": 1e3 / timing.median_ms,
        "correct": ours.correct, "verdict": ours.note, "logit_check": ours.extra["logit_check"],
        "first_divergence": ours.extra["first_divergence"], "reference": ours_ref.to_json(),
        "tokens": ours.tokens,
        "baselines": [row(b) for b in baselines],
        "baseline_runs": 0 if args.no_baselines else args.baseline_runs,
        **speedup_summary(ours, baselines),
    }
    title = (f"{args.model} on {props.name}: weights {nbytes / 1e6:.1f} MB, HBM {bw / 1e12:.2f} TB/s, "
             f"roofline {floor:.3f} ms/token")
    tab = results_table(title, [ours] + baselines, [row(r) for r in [ours] + baselines])
    out_con = Console(width=200, stderr=bool(args.json))
    out_con.print(tab)
    line = speedup_line(ours, result)
    if line:
        out_con.print(line, markup=False, highlight=False)
    write_result(args, result)
    return 0 if ours.correct else 1


def _resolve_bf16(model_arg: str):
    from models.sources import resolve_model

    return resolve_model(model_arg, dtype="bf16")
