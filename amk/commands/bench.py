"""`amk bench MODEL`: per-token decode latency of the megakernel on one GPU, against the
roofline and against baselines measured in the same run on the same device.

Every latency is printed with its correctness verdict: greedy tokens against HF
``generate`` (a divergence is accepted only at a bf16 near-tie, see
amk.baselines.judge_tokens) and, for the megakernel, logits against HF eager at several
positions.

Output: the table goes to stdout (to stderr with ``--json``, which prints the result object
to stdout as one JSON line); ``--out FILE`` writes the same object to FILE (indented),
whole or not at all. FILE's directory is checked before anything is measured.
"""

from __future__ import annotations

import argparse
import json
import re
import platform
import sys
import time
from pathlib import Path

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
    p.add_argument("--kroll", type=int, default=0, metavar="G",
                   help="a GEMV row block prefetches its columns G groups of (--gemv-unroll x --gemv-block K) "
                        "ahead of its K loop into L2, row by row (0..8; 0, the default: off; needs "
                        "--gemv-unroll 4, 8 or 16)")
    p.add_argument("--relaxed-poll", type=int, default=0, choices=(0, 1), metavar="0|1",
                   help="1: waits poll with relaxed loads and one acquire fence when satisfied, instead of "
                        "an acquire load (an L1 invalidation) per poll (default 0)")
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
    p.add_argument("--attention-dot", action="store_true",
                   help="decode attention's products as fp32 tl.dot (allows a larger --attention-block)")
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


def _config(args, sms: int):
    from lowering.config import LoweringConfig

    base = {}
    if args.config:
        try:
            base = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise AmkError(f"{args.config}: cannot read the config: {e}") from None
    base.setdefault("workers", sms)
    base.setdefault("dtype", "bf16")
    if args.workers:
        base["workers"] = args.workers
    if args.tile:
        base["tile"] = args.tile
    if getattr(args, "attn_split", None):
        base["attn_split"] = args.attn_split
    base.setdefault("max_seq", max(256, args.prompt_len + args.tokens + 8))
    return LoweringConfig.from_json(base, source=args.config or "bench config")


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
    check_model_split(args.model, args.tp, _config(args, 1))  # tile / allreduce; config only
    import torch

    from rich.console import Console

    from amk import pipeline
    from amk.commands.output import check_writable_dir
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
    cfg = _config(args, props.multi_processor_count)
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


def write_result(args: argparse.Namespace, result: dict, final: bool = True) -> None:
    """``--out FILE``: write ``result`` to FILE (indented JSON, NaN as null), whole or not at
    all (AmkError naming FILE, exit 2). ``--json`` (``final`` only): print it to stdout."""
    from amk.commands.output import emit_json
    from ground.files import atomic_write_text, finite

    if args.out:
        atomic_write_text(args.out, json.dumps(finite(result), indent=1, default=str) + "\n")
    if final and args.json:
        emit_json(result)


#: Worker CTAs per SM a schedule may ask for on a CUDA target (the validator's static
#: limit); the runtime then checks the compiled kernel's real occupancy before launching.
MAX_WORKERS_PER_SM = 4


def cuda_target(props):
    """The Target of a schedule for the Triton backend on a CUDA device described by
    ``props`` (torch.cuda.get_device_properties): at most MAX_WORKERS_PER_SM workers per SM
    (two 4-warp workers per SM fit when the kernel needs <= 255 registers per thread)."""
    from ir.program import Target

    sms = props.multi_processor_count
    return Target(name=props.name, sms=sms, max_workers=MAX_WORKERS_PER_SM * sms, backend="triton")


def measure_megakernel(model_arg, resolved, cfg, target, prompt, ref, n_tokens: int,
                       backend_options: dict | None = None):
    """Lower, validate, build and time the megakernel for one config (R = 1).

    ``resolved``: the resolved HF model (its weights feed the kernel; the HF model itself is
    used on its current device for the logit check). ``prompt``: int64 [1, P] (CPU);
    ``ref``: the TokenReference. Returns (BaselineResult named ``amk_megakernel`` with
    timing, verdict and ``extra`` = logit_check, first_divergence, build_s), the Session and
    the executor. ``backend_options``: TritonExecutor options (``num_warps``, ``blocks``).
    Raises AmkError if the validator rejects the schedule.
    """
    from amk import pipeline
    from amk.baselines import BaselineResult, judge_tokens
    from lowering.triton.graph import DecodeGraph

    session = pipeline.Session.build(model_arg, 1, cfg, target, resolved=resolved)
    if not session.verdict.ok:
        raise AmkError("the schedule was rejected by the validator: "
                       + "; ".join(f.message for f in session.verdict.errors[:3]), exit_code=1)
    t0 = time.perf_counter()
    dec = session.decoder("triton", backend_options=backend_options)
    build_s = time.perf_counter() - t0
    report = session.check(dec)
    ex = dec.ex
    dec.step(int(prompt[0, 0]), 0)  # compiles; leaves the executor at a step boundary
    graph = DecodeGraph(ex, max_tokens=cfg.max_seq)
    toks, timing = graph.decode(prompt[0].tolist(), n_tokens)
    ok_tokens, first, note = judge_tokens(toks, ref)
    if not report.ok:
        note = f"logit check failed: {'; '.join(report.failures())}; {note}"
    res = BaselineResult("amk_megakernel", toks, timing, ok_tokens and report.ok, note,
                         {"first_divergence": first, "logit_check": report.to_json(),
                          "build_s": build_s, "tasks": len(session.program.tasks)})
    return res, session, ex


#: Blocks fields set by one flag each, with a value (0/1 for the booleans but --attention-dot);
#: gemv_n / gemv_k come from --gemv-block NxK. Blocks checks its own fields, and its errors are
#: reworded with these flag names (one home for the rules); bench/sweep_best.py turns a sweep
#: row back into these flags.
BLOCKS_FLAGS = {"gemv_stages": "--gemv-stages", "gemv_unroll": "--gemv-unroll", "prefetch": "--prefetch",
                "attention_t": "--attention-block", "maxnreg": "--maxnreg", "x_chunk": "--x-chunk",
                "w_preload": "--w-preload", "prefetch_cap": "--prefetch-cap", "prefetch_rows": "--prefetch-rows",
                "roll": "--roll", "kroll": "--kroll", "row_prefetch": "--row-prefetch", "x_stage": "--x-stage",
                "x_reuse": "--x-reuse", "relaxed_poll": "--relaxed-poll", "lean_release": "--lean-release",
                "gemv_tma": "--gemv-tma", "ring": "--ring", "ring_rows": "--ring-rows", "ring_cols": "--ring-cols"}
_FLAG_OF = {**BLOCKS_FLAGS, "gemv_k": "--gemv-block K", "gemv_n": "--gemv-block N"}


def _flag_names(message: str) -> str:
    """A Blocks error message with its field names replaced by the bench flags that set them."""
    return re.sub(r"\b(" + "|".join(_FLAG_OF) + r")\b", lambda m: _FLAG_OF[m.group(1)], message)


def backend_options(args) -> dict:
    """TritonExecutor options from --num-warps, --gemv-block NxK, --gemv-stages,
    --prefetch, --gemv-unroll, --attention-block, --attention-dot, --row-prefetch,
    --x-stage, --x-reuse, --x-chunk, --w-preload, --prefetch-cap, --prefetch-rows, --roll,
    --kroll, --relaxed-poll, --lean-release, --gemv-tma and --maxnreg. Raises AmkError naming the flag (the ranges are
    lowering.triton.runtime.Blocks' own checks)."""
    from lowering.triton.runtime import Blocks, TritonError

    try:
        n, k = (int(v) for v in args.gemv_block.lower().split("x"))
    except ValueError:
        raise AmkError(f"--gemv-block {args.gemv_block!r}: expected NxK, e.g. 32x512") from None
    att = getattr(args, "attention_block", 32)
    for v, what in ((n, "N"), (k, "K"), (args.num_warps, "--num-warps"), (att, "--attention-block")):
        if v < 1 or v & (v - 1):
            raise AmkError(f"{what} must be a power of two, got {v}")
    try:
        blocks = Blocks(gemv_n=n, gemv_k=k, gemv_stages=getattr(args, "gemv_stages", 1),
                        prefetch=getattr(args, "prefetch", 0), attention_t=att,
                        gemv_unroll=getattr(args, "gemv_unroll", 1),
                        attention_dot=bool(getattr(args, "attention_dot", False)),
                        row_prefetch=bool(getattr(args, "row_prefetch", 1)), maxnreg=getattr(args, "maxnreg", 0),
                        x_stage=bool(getattr(args, "x_stage", 1)), x_reuse=bool(getattr(args, "x_reuse", 1)),
                        x_chunk=getattr(args, "x_chunk", 8192), w_preload=getattr(args, "w_preload", 0),
                        prefetch_cap=getattr(args, "prefetch_cap", 0),
                        prefetch_rows=getattr(args, "prefetch_rows", 0), roll=getattr(args, "roll", 0),
                        kroll=getattr(args, "kroll", 0), relaxed_poll=bool(getattr(args, "relaxed_poll", 0)),
                        lean_release=bool(getattr(args, "lean_release", 1)),
                        gemv_tma=bool(getattr(args, "gemv_tma", 0)), ring=getattr(args, "ring", 0),
                        ring_rows=getattr(args, "ring_rows", 4), ring_cols=getattr(args, "ring_cols", 2048))
    except TritonError as e:
        raise AmkError(_flag_names(str(e))) from None
    return {"num_warps": args.num_warps, "blocks": blocks}


def _resolve_bf16(model_arg: str):
    from models.sources import resolve_model

    return resolve_model(model_arg, dtype="bf16")
