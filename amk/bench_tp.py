"""`amk bench MODEL --tp R`: the tensor-parallel megakernel over R GPUs, one process per rank.

Every rank process runs ``run_tp`` (SPMD; ``amk.launch`` spawned them or torchrun did):

1. each rank measures its own GPU's HBM bandwidth; the roofline is *per rank*: the largest
   per-rank weight traffic of the schedule (``search.evaluator.weight_bytes_per_rank``,
   every weight region a rank's tasks read, once) over that rank's bandwidth;
2. the model is drawn on every rank's GPU with the same seed (recipes) or loaded from the
   same checkpoint; a checksum over the weights, gathered from all ranks, must agree;
3. rank 0 computes the greedy HF reference (bf16 tokens plus fp32 margins, as the
   single-GPU bench) and broadcasts it;
4. the megakernel: lower for R ranks, validate, build the NVSHMEM executor, check logits
   against HF eager at positions 0, 7 and 31 (teacher-forced, SPMD), then decode with one
   CUDA-graph replay per token on every rank; per-token latency = max over ranks of the
   rank's median replay time (the ranks are coupled through their counters, so a rank's
   step includes waiting for its peers); the greedy tokens must agree on every rank and
   with the reference (``judge_tokens``);
5. baselines in the same run: HF tensor parallel (``tp_plan="auto"`` over NCCL) eager and
   as a compiled decode step in a CUDA graph, once per ``--baseline-compile-mode`` mode
   (``amk.baselines_tp``, when available), and
   the single-GPU megakernel on rank 0.

Rank 0 prints the table (to stderr under ``--json``), writes ``--out FILE`` (after the
megakernel, again after each baseline stage) and with ``--json`` prints the final result
object to stdout; the JSON holds every rank's timing.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ground.errors import AmkError


def _checksum(model) -> float:
    """A cheap fingerprint of the weights (float64 sum of a strided sample per tensor)."""
    total = 0.0
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.detach().reshape(-1)
            total += float(flat[:: max(1, flat.numel() // 4096)].double().sum()) * (i + 1)
    return total


def run_tp(args, ctx) -> int:
    """The body of ``amk bench --tp R`` in one rank process (see module doc). Returns the
    exit code (0: the megakernel is correct)."""
    from rich.console import Console

    from amk.baselines import BaselineResult, make_reference, speedup_summary
    from amk.bench import cuda_target, measure_megakernel, run_config, write_result
    from lowering.triton.blocks import kernel_options
    from ground.timing import measure_hbm_bandwidth
    from models.sources import resolve_model
    from search.evaluator import weight_bytes_per_rank

    R, rank, dev = ctx.world, ctx.rank, ctx.device
    con = Console(stderr=True, quiet=rank != 0)
    if args.tokens < 4:
        raise AmkError("--tokens must be at least 4")
    props = torch.cuda.get_device_properties(dev)
    from search.tunedb import GpuKey

    full, config_source = run_config(args, GpuKey(str(props.name), int(props.multi_processor_count)))
    con.print(config_source, markup=False, highlight=False, soft_wrap=True)
    cfg = full.lowering
    target = cuda_target(props)
    opts = kernel_options(full.kernel)
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    with con.status("measuring HBM bandwidth"):
        bw = measure_hbm_bandwidth(dev)
    bws = ctx.all_gather_object(bw)
    with con.status(f"drawing/loading {args.model} on every rank's GPU"):
        resolved = resolve_model(args.model, dtype="fp32" if cfg.dtype == "f32" else "bf16", device=dev)
    model = resolved.model
    sums = ctx.all_gather_object(_checksum(model))
    if len(set(sums)) != 1:
        raise AmkError(f"the ranks hold different weights (checksums {sums}); recipes drawn on "
                       "different kinds of GPU differ")
    timings["model_s"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    ref = None
    if rank == 0:
        with con.status("HF greedy reference (rank 0)"):
            ref = make_reference(model, prompt.to(dev), args.tokens)
    ref = ctx.broadcast_object(ref, 0)

    # -- the tensor-parallel megakernel -----------------------------------------------------
    with con.status(f"megakernel: lower for {R} ranks, validate, build, check logits, decode in a CUDA graph"):
        ours, compilation, ex = measure_megakernel_tp(args.model, resolved, cfg, target, prompt, ref,
                                                      args.tokens, opts, ctx)
    timings["build_s"] = ours.extra["build_s"]
    report, per_rank, agree, first = (ours.extra["report"], ours.extra["per_rank"], ours.extra["ranks_agree"],
                                      ours.extra["first_divergence"])
    toks = ours.tokens
    ours.extra = {}  # the JSON holds these fields at its top level
    per_rank_bytes = weight_bytes_per_rank(compilation.program)
    floor = max(b / min(bws) for b in per_rank_bytes) * 1e3

    def result(baselines: list, done: bool) -> dict[str, Any]:
        return {
            "device": f"{R} x {props.name}", "model": args.model, "tp": R, "backend": "triton",
            "transport": "NVSHMEM symmetric heap, peer stores + system-scope release/acquire",
            "command": "amk " + " ".join(sys.argv[1:]) if sys.argv else "amk bench",
            "python": platform.python_version(), "torch": torch.__version__,
            "config": cfg.to_json(), "kernel": full.kernel.to_json(), "config_source": config_source,
            "tasks": len(compilation.program.tasks), "workers_per_rank": compilation.program.workers,
            "num_warps": ex.num_warps, "blocks": ex.blocks.__dict__, "occupancy": ex.occupancy,
            "hbm_bytes_per_s_per_rank": bws, "weight_bytes_per_rank": per_rank_bytes,
            "roofline_ms": floor, "roofline_note": "per rank: max over ranks of the rank's weight "
                                                  "bytes / the slowest rank's measured bandwidth",
            "latency_ms_median": ours.timing.median_ms, "timing": ours.timing.to_json(),
            "roofline_pct": 100 * floor / ours.timing.median_ms,
            "tokens_per_s": 1e3 / ours.timing.median_ms,
            "correct": ours.correct, "verdict": ours.note, "logit_check": report.to_json(),
            "first_divergence": first, "ranks_agree": agree, "per_rank": per_rank,
            "reference": ref.to_json(), "tokens": toks, "timings_s": timings,
            "baselines": [_row(b, floor) for b in baselines],
            "baseline_runs": 0 if args.no_baselines else args.baseline_runs,
            **speedup_summary(ours, hf_rows(baselines)),
            "complete": done,
        }

    def write(obj: dict, final: bool = False) -> None:
        if rank == 0:
            write_result(args, obj, final=final)

    # the megakernel's row first, so a run cut short by a baseline still leaves its result
    write(result([], done=args.no_baselines))
    con.print(f"{ours.name}: {ours.timing.median_ms:.4f} ms/token (max over ranks of the median), "
              f"correct={ours.correct}: {ours.note}")

    # -- baselines --------------------------------------------------------------------------
    baselines: list[BaselineResult] = []
    if not args.no_baselines:
        baselines += _tp_baselines(args, ctx, model, prompt, ref, con)
        write(result(baselines, done=False))
        ctx.barrier()
        single = None
        if rank == 0:
            with con.status("single-GPU megakernel (rank 0)"):
                try:
                    single, _, _ = measure_megakernel(args.model, resolved, cfg, target, prompt, ref,
                                                      args.tokens, opts)
                    single.name = "amk_megakernel_tp1"
                    single.extra = {"first_divergence": single.extra.get("first_divergence")}
                except Exception as err:  # keep the row with the reason
                    single = BaselineResult("amk_megakernel_tp1", [], None, False,
                                            f"failed: {type(err).__name__}: {err}")
        single = ctx.broadcast_object(single, 0)
        baselines.append(single)
    ctx.barrier()
    if rank != 0:
        return 0 if ours.correct else 1

    _print_table(args, props, R, floor, bws, ours, baselines)
    write(result(baselines, done=True), final=True)
    return 0 if ours.correct else 1


def measure_megakernel_tp(model_arg, resolved, cfg, target, prompt, ref, n_tokens: int, opts: dict, ctx):
    """Lower for ``ctx.world`` ranks, validate, build this rank's NVSHMEM executor, check logits
    against HF eager at positions 0, 7 and 31 (SPMD), then decode ``n_tokens`` with one
    CUDA-graph replay per token. Called by every rank (collective).

    ``prompt``: int64 [1, P] (CPU); ``ref``: the TokenReference (on every rank). Returns
    (BaselineResult ``amk_megakernel_tp{R}`` whose timing is the slowest rank's and whose
    ``extra`` holds ``report`` (LogitReport), ``per_rank`` (every rank's tokens, timing, wall
    time, device), ``ranks_agree``, ``first_divergence``, ``build_s``, ``tasks``), the Compilation
    and this rank's executor. Raises AmkError if the validator rejects the schedule."""
    from amk import pipeline
    from amk.baselines import BaselineResult, judge_tokens
    from ground.timing import Timing
    from lowering.triton.graph import DecodeGraph

    R, rank, dev = ctx.world, ctx.rank, ctx.device
    t0 = time.perf_counter()
    compilation = pipeline.Compilation.build(model_arg, R, cfg, target, resolved=resolved)
    if not compilation.verdict.ok:
        raise AmkError("the schedule was rejected by the validator: "
                       + "; ".join(f.message for f in compilation.verdict.errors[:3]), exit_code=1)
    dec = compilation.decoder("triton", backend_options={**opts, "dist": ctx})
    build_s = time.perf_counter() - t0
    report = compilation.check(dec)
    ex = dec.ex
    dec.step(int(prompt[0, 0]), 0)  # leaves every rank at the same step boundary
    graph = DecodeGraph(ex, max_tokens=cfg.max_seq)
    ctx.barrier()
    t0 = time.perf_counter()
    toks, timing = graph.decode(prompt[0].tolist(), n_tokens)
    wall = time.perf_counter() - t0
    per_rank = ctx.all_gather_object({"rank": rank, "tokens": toks, "timing": timing.to_json(),
                                      "wall_s": wall, "device": torch.cuda.get_device_name(dev)})
    agree = all(p["tokens"] == per_rank[0]["tokens"] for p in per_rank)
    ok_tokens, first, note = judge_tokens(toks, ref)
    if not agree:
        ok_tokens, note = False, "ranks produced different tokens: " + "; ".join(
            str(p["tokens"][:8]) for p in per_rank)
    if not report.ok:
        note = f"logit check failed: {'; '.join(report.failures())}; {note}"
    slowest = max(per_rank, key=lambda p: p["timing"]["median_ms"])
    ours = BaselineResult(f"amk_megakernel_tp{R}", toks, Timing(**slowest["timing"]),
                          ok_tokens and report.ok, note,
                          {"report": report, "per_rank": per_rank, "ranks_agree": agree,
                           "first_divergence": first, "build_s": build_s,
                           "tasks": len(compilation.program.tasks)})
    return ours, compilation, ex


def _tp_baselines(args, ctx, model, prompt, ref, con) -> list:
    """HF tensor-parallel baselines (``amk.baselines_tp``), judged against ``ref``; a row
    with the reason when they cannot run."""
    from amk.baselines import BaselineResult, compile_modes, judge
    modes = compile_modes(getattr(args, "baseline_compile_mode", "default"), "--baseline-compile-mode")
    try:
        from amk import baselines_tp
    except ImportError as err:
        return [BaselineResult("hf_tp_eager", [], None, False, f"not available: {err}")]
    import tempfile
    save_dir = args.tp_checkpoint_dir or str(Path(tempfile.gettempdir()) / "amk-tp-checkpoint")
    with con.status("HF tensor parallel baselines (tp_plan=auto over NCCL)"):
        try:
            rows = baselines_tp.run_tp_baselines(args.model, ctx, prompt, args.tokens, save_dir,
                                                 model=model, modes=modes, runs=args.baseline_runs)
        except AmkError as err:
            return [BaselineResult("hf_tp_eager", [], None, False, f"failed: {err}")]
    # the HF TP model is no longer needed: give its memory back before the next measurement
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    return [judge(r, ref) for r in rows]


def hf_rows(baselines: list) -> list:
    """The HF baseline rows (what the speedup is against; not amk's own tp 1 row)."""
    return [b for b in baselines if b.name.startswith("hf_")]


def _row(r, floor: float) -> dict:
    d = r.to_json()
    med = d["latency_ms_median"]
    d["roofline_pct"] = 100 * floor / med if med else None
    d["tokens_per_s"] = 1e3 / med if med else None
    return d


def _print_table(args, props, R, floor, bws, ours, baselines) -> None:
    from rich.console import Console

    from rich.table import Table

    from amk.baselines import speedup_line, speedup_summary

    tab = Table(title=f"{args.model}, tp={R} on {R} x {props.name}: per-rank roofline {floor:.3f} ms/token "
                      f"(HBM {min(bws) / 1e12:.2f} TB/s)")
    for c in ("method", "ms/token (median)", "p10-p90", "% roofline", "tokens/s", "correct", "note"):
        tab.add_column(c)
    for r in [ours] + baselines:
        d = _row(r, floor)
        t = r.timing
        tab.add_row(r.name, f"{t.median_ms:.4f}" if t else "-",
                    f"{t.p10_ms:.3f}-{t.p90_ms:.3f}" if t else "-",
                    f"{d['roofline_pct']:.1f}" if d["roofline_pct"] else "-",
                    f"{d['tokens_per_s']:.0f}" if d["tokens_per_s"] else "-", str(r.correct), r.note)
    out = Console(width=200, stderr=bool(getattr(args, "json", False)))
    out.print(tab)
    line = speedup_line(ours, speedup_summary(ours, hf_rows(baselines)))
    if line:
        out.print(line, markup=False, highlight=False)
