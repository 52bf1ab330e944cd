"""`amk bench MODEL`: per-token decode latency of the megakernel on one GPU, against the
roofline and against baselines measured in the same run on the same device.

Every latency is printed with its correctness verdict: greedy tokens against HF
``generate`` (a divergence is accepted only at a bf16 near-tie, see
amk.baselines.judge_tokens) and, for the megakernel, logits against HF eager at several
positions.

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

from amk.bench import backend_options, bench_config, cuda_target, measure_megakernel, write_result
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
    p.add_argument("--config", metavar="FILE", help="lowering config JSON (knobs)")
    p.add_argument("--workers", type=int, help="workers per rank (default: one per SM)")
    p.add_argument("--tile", type=int, help="GEMV tile rows")
    p.add_argument("--attn-split", type=int, metavar="S",
                   help="attention tasks per KV head (lowering knob attn_split; default 1)")
    p.add_argument("--num-warps", type=int, default=8, help="warps per worker CTA (default 8)")
    p.add_argument("--gemv-block", default="32x512", metavar="NxK",
                   help="GEMV block: rows x columns streamed per iteration (default 32x512)")
    p.add_argument("--gemv-stages", type=int, default=1, metavar="S",
                   help="GEMV weight pipeline depth: 1 = one block in flight (default); S >= 2 = "
                        "S-1 blocks in flight via cp.async into S-1 shared-memory buffers")
    p.add_argument("--prefetch", type=int, default=0, metavar="D",
                   help="L2 prefetch look-ahead in tasks: task i starts prefetching task i+D's GEMV "
                        "weight tile (0 = off, default)")
    p.add_argument("--gemv-unroll", type=int, default=1, choices=(1, 2, 4, 8, 16), metavar="U",
                   help="GEMV K loop unrolled U times, U weight blocks in flight (1, 2, 4, 8 or 16; "
                        "above 2 needs a K block below 32 x warps, e.g. 16x128 at 8 warps; default 1)")
    p.add_argument("--attention-block", type=int, default=32, metavar="T",
                   help="decode attention: cache positions per block of its online softmax "
                        "(power of two, default 32); a context of <= T positions takes one block")
    p.add_argument("--row-prefetch", type=int, default=1, choices=(0, 1), metavar="0|1",
                   help="1 (default): prefetch the next task's table row into L1 during each task")
    p.add_argument("--x-stage", type=int, default=1, choices=(0, 1), metavar="0|1",
                   help="1 (default): norm_gemv / swiglu_gemv compute their prologue (RMSNorm, SiLU x up) "
                        "once per task into a per-worker scratch instead of inside the weight loop")
    p.add_argument("--x-reuse", type=int, default=1, choices=(0, 1), metavar="0|1",
                   help="1 (default, with --x-stage 1): a GEMV task whose prologue the worker's previous "
                        "task already staged (same x, same norm weight, nothing waited on or written "
                        "since) skips it")
    p.add_argument("--x-chunk", type=int, default=8192, metavar="E",
                   help="elements of x the GEMV prologue loads at once (power of two, default 8192); "
                        "an x that fits is loaded once")
    p.add_argument("--w-preload", type=int, default=0, metavar="E",
                   help="columns of its weight tile a GEMV task loads before its waits (0 = off, the "
                        "default; else a power of two of at least the --gemv-block K)")
    p.add_argument("--prefetch-cap", type=int, default=0, metavar="BYTES",
                   help="the --prefetch L2 prefetch covers at most a tile's first BYTES (a multiple of "
                        "16; 0, the default: the whole tile)")
    p.add_argument("--prefetch-rows", type=int, default=0, metavar="N",
                   help="the --prefetch L2 prefetch covers at most a tile's first N weight rows (0, the "
                        "default: no limit); unlike --prefetch-cap it keeps a wide tile's whole first rows")
    p.add_argument("--roll", type=int, default=0, metavar="B",
                   help="a GEMV tile of several row blocks prefetches the row block B blocks ahead into "
                        "L2 while it streams (0..8; 0, the default: off)")
    p.add_argument("--lean-release", type=int, default=1, choices=(0, 1), metavar="0|1",
                   help="1 (default): a task that signals a peer fences once (thread 0, after the barrier) "
                        "and signals each peer with a relaxed red; 0: a fence in every thread and one "
                        "release per peer")
    p.add_argument("--gemv-tma", type=int, default=0, choices=(0, 1), metavar="0|1",
                   help="1: GEMVs with a contiguous 16-byte aligned W stream it with TMA copies into the "
                        "--gemv-stages - 1 shared-memory buffers (no registers held by the copies in "
                        "flight; needs --gemv-stages 2..8, --w-preload 0, --gemv-block N and K <= 256; "
                        "default 0)")
    p.add_argument("--ring", type=int, default=0, metavar="S",
                   help="weight ring: each worker streams its GEMVs' bf16 weights through S shared-memory "
                        "pages copied ahead of the tasks, across their waits (0 = off, default)")
    p.add_argument("--ring-rows", type=int, default=4, metavar="R", help="rows of a weight-ring page (default 4)")
    p.add_argument("--ring-cols", type=int, default=2048, metavar="C",
                   help="columns of a weight-ring page (default 2048; a page is R x C bf16)")
    p.add_argument("--maxnreg", type=int, default=0, metavar="R",
                   help="register cap per thread (24..255); 0 (default) = automatic: capped only when "
                        "--workers exceeds the SM count, so that two (or more) workers share an SM")
    p.add_argument("--no-baselines", action="store_true", help="skip the HF baselines")
    p.add_argument("--baseline-compile-mode", default="default,max-autotune-no-cudagraphs", metavar="MODES",
                   help="comma list of torch.compile modes, one baseline (b) row each (default: "
                        "default,max-autotune-no-cudagraphs; the second compiles for ~2 minutes and "
                        "measured 23%% faster on the SmolLM2 shape); with --tp R, one HF tensor-parallel "
                        "compiled-graph row each")
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

    check_counts(args.tp, args.workers)  # before torch is imported
    check_model_split(args.model, args.tp, bench_config(args, 1))  # tile / allreduce; config only
    import torch

    from rich.console import Console

    from amk import pipeline
    from amk.output import check_writable_dir
    from amk.baselines import (BaselineResult, compile_modes, compiled_graph_name, hf_compiled_graph, hf_eager,
                               judge, make_reference)
    from ground.timing import decode_weight_bytes, measure_hbm_bandwidth, roofline_ms
    con = Console(stderr=True)
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
    cfg = bench_config(args, props.multi_processor_count)
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
        ref = make_reference(model, prompt.to(dev), args.tokens)
    with con.status("megakernel: lower, validate, build, check logits, decode in a CUDA graph"):
        ours, session, ex = measure_megakernel(args.model, resolved, cfg, target, prompt, ref,
                                               args.tokens, backend_options(args))
    timing = ours.timing
    nbytes = decode_weight_bytes(model)
    floor = roofline_ms(nbytes, bw)

    baselines: list[BaselineResult] = []
    if not args.no_baselines:
        with con.status("baseline (a): HF eager"):
            baselines.append(judge(hf_eager(model, prompt.to(dev), args.tokens), ref))
        for mode in modes:
            with con.status(f"baseline (b): torch.compile ({mode or 'default'}) + CUDA graph, static cache"):
                try:
                    baselines.append(judge(hf_compiled_graph(model, prompt.to(dev), args.tokens,
                                                             mode=mode), ref))
                except Exception as err:  # keep the row, with the reason, rather than lose the run
                    baselines.append(BaselineResult(compiled_graph_name(mode), [], None, False,
                                                    f"failed: {type(err).__name__}: {err}"))

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
        "config": cfg.to_json() if hasattr(cfg, "to_json") else cfg.__dict__,
        "tasks": len(session.program.tasks), "workers": ex.workers,
        "num_warps": ex.num_warps, "blocks": ex.blocks.__dict__,
        "occupancy": ex.occupancy, "build_s": ours.extra["build_s"],
        "weight_bytes": nbytes, "hbm_bytes_per_s": bw, "roofline_ms": floor,
        "latency_ms_median": timing.median_ms, "timing": timing.to_json(),
        "roofline_pct": 100 * floor / timing.median_ms, "tokens_per_s": 1e3 / timing.median_ms,
        "correct": ours.correct, "verdict": ours.note, "logit_check": ours.extra["logit_check"],
        "first_divergence": ours.extra["first_divergence"], "reference": ref.to_json(),
        "tokens": ours.tokens,
        "baselines": [row(b) for b in baselines],
    }
    title = (f"{args.model} on {props.name}: weights {nbytes / 1e6:.1f} MB, HBM {bw / 1e12:.2f} TB/s, "
             f"roofline {floor:.3f} ms/token")
    tab = results_table(title, [ours] + baselines, [row(r) for r in [ours] + baselines])
    Console(width=200, stderr=bool(args.json)).print(tab)
    write_result(args, result)
    return 0 if ours.correct else 1


def _resolve_bf16(model_arg: str):
    from models.sources import resolve_model

    return resolve_model(model_arg, dtype="bf16")
