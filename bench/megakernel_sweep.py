"""Time the megakernel for several configs of one model in one GPU call.

Usage: python bench/megakernel_sweep.py MODEL [--config FILE] [--workers 66,132] [--tile 16,32]
           [--policy balanced,stage] [--num-warps 4,8] [--gemv-block 16x128,32x512] [--gemv-stages 1,3]
           [--fuse 0,1] [--prefetch 0,1] [--late-append 0,1] ... [--tokens 64] [--json FILE]
Every knob has the flag it has in ``amk bench`` (lowering.knobs: one spelling), here taking a
comma list; the sweep runs their product over ``--config FILE`` (a config file, as ``amk bench
--config`` reads it) and the defaults ``amk bench`` uses (one worker per SM, bf16). A point in
which a knob does nothing (``--x-reuse 1`` with ``--x-stage 0``, ...) is skipped with the reason.
``--tp R``: tensor parallel over R GPUs, one process per GPU over NVSHMEM (spawned, as
``amk bench --tp R``); each row's latency is the slowest rank's median and its roofline the
per-rank one (amk/bench_tp.py); rank 0 prints and writes the JSON.
Prints the knobs that stay fixed once, then per row the ones that vary, tasks, median
ms/token, % of roofline, and the correctness verdict (greedy tokens vs HF generate with the
bf16 near-tie rule, plus the logit check). Each row of the JSON holds its whole config as a
config file holds it (``"config": {"lowering": ..., "kernel": ...}``; bench/sweep_best.py
writes the best row's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from lowering.config import KernelConfig, LoweringConfig
from lowering.knobs import add_flags, given, show


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--config", metavar="FILE", default=None,
                    help="config file every point starts from (docs/lowering.md)")
    ap.add_argument("--tp", type=int, default=1,
                    help="ranks: one process per GPU over NVSHMEM (R GPUs needed), as amk bench --tp R")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--json", default=None, metavar="FILE", help="write the rows to FILE")
    add_flags(ap.add_argument_group("lowering knobs, comma lists"), LoweringConfig, lists=True)
    add_flags(ap.add_argument_group("kernel knobs, comma lists"), KernelConfig, lists=True)
    return ap


def sweep_points(args: argparse.Namespace) -> list[dict]:
    """Every combination of the knob flags' comma lists, in product order, each as
    {knob name: value} (the knobs the flags set; the rest come from --config and the
    defaults)."""
    axes = {**given(args, LoweringConfig), **given(args, KernelConfig)}
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]


def point_args(args: argparse.Namespace, pt: dict) -> argparse.Namespace:
    """``args`` with the sweep's lists replaced by the point's values: what amk.bench.bench_config
    reads (as for ``amk bench`` with those flags)."""
    return argparse.Namespace(**{**vars(args), **pt})


def varying_knobs(points: list[dict]) -> set[str]:
    """The knobs that take more than one value over the sweep."""
    return {k for k in points[0] if len({repr(p[k]) for p in points}) > 1}


def tag_of(pt: dict, keys: set[str], invert: bool = False) -> str:
    """The knobs of a point in ``keys`` (``invert``: those not in it) as name=value."""
    return " ".join(f"{k}={show(v)}" for k, v in pt.items() if (k in keys) != invert) or "-"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from lowering.config import AmkConfig

    if args.config:  # a file every point reads: refused once, before any GPU work
        AmkConfig.from_file(args.config, combinations=False)
    points = sweep_points(args)
    ctx = None
    if args.tp > 1:
        from amk import launch
        code, ctx = launch.script_entry(__file__, argv, args.tp)
        if code is not None:
            return code

    from amk.baselines import make_reference
    from amk.bench_tp import measure_megakernel_tp
    from amk.bench import bench_config, cuda_target, measure_megakernel
    from ground.errors import AmkError
    from ground.timing import decode_weight_bytes, measure_hbm_bandwidth, roofline_ms
    from lowering.triton.blocks import kernel_options
    from models.sources import resolve_model
    from search.evaluator import weight_bytes_per_rank

    dev = ctx.device if ctx else torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    bw = measure_hbm_bandwidth(dev)
    if ctx:
        bw = min(ctx.all_gather_object(bw))  # the per-rank roofline uses the slowest rank's
    resolved = resolve_model(args.model, dtype="bf16", device=dev if ctx else None)
    model = resolved.model.to(dev)
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=g)
    ref = make_reference(model, prompt.to(dev), args.tokens) if not ctx or ctx.rank == 0 else None
    if ctx:
        ref = ctx.broadcast_object(ref, 0)
    floor = roofline_ms(decode_weight_bytes(model), bw)
    target = cuda_target(props)
    rows = []

    def dump() -> None:  # after every row: a sweep cut off by a time limit keeps what it measured
        if args.json and (not ctx or ctx.rank == 0):
            from ground.files import atomic_write_text  # whole file or none

            atomic_write_text(args.json, json.dumps(
                {"device": props.name if not ctx else f"{ctx.world} x {props.name}",
                 "model": args.model, "tp": args.tp, "hbm_bytes_per_s": bw,
                 "roofline_ms": floor, "command": " ".join(sys.argv), "rows": rows}, indent=1))

    print(f"{args.model} on {props.name}{f' x {args.tp}' if ctx else ''}: HBM {bw / 1e12:.2f} TB/s, "
          f"roofline {floor:.4f} ms{' (one GPU; rows give the per-rank one)' if ctx else ''}")
    varying = varying_knobs(points)
    print("fixed: " + tag_of(points[0], varying, invert=True))
    for pt in points:
        tag = tag_of(pt, varying)
        try:
            full = bench_config(point_args(args, pt), props.multi_processor_count)
        except AmkError as err:  # a combination refused or doing nothing (gemv_tma without stages, ...)
            print(f"  {tag}: skipped, {err}", flush=True)
            continue
        if full.lowering.dtype != "bf16":  # the model was drawn once, in bf16
            print(f"  {tag}: skipped, the sweep runs bf16 schedules (dtype {full.lowering.dtype})", flush=True)
            continue
        opts, cfg = kernel_options(full.kernel), full.lowering
        knobs = {"config": full.to_json()}
        try:
            if ctx:
                res, compilation, ex = measure_megakernel_tp(args.model, resolved, cfg, target, prompt, ref,
                                                             args.tokens, opts, ctx)
            else:
                res, compilation, ex = measure_megakernel(args.model, resolved, cfg, target, prompt, ref,
                                                          args.tokens, opts)
        except Exception as err:  # (under --tp a failure on one rank only would desync the ranks)
            print(f"  {tag}: FAILED {type(err).__name__}: {err}", flush=True)
            rows.append({**knobs, "error": f"{type(err).__name__}: {err}"})
            dump()
            continue
        med = res.timing.median_ms
        check = res.extra["report"].to_json() if ctx else res.extra["logit_check"]
        row_floor = floor
        if ctx:
            row_floor = max(weight_bytes_per_rank(compilation.program)) / bw * 1e3
        row = {**knobs, "tasks": res.extra["tasks"], "latency_ms_median": med,
               "timing": res.timing.to_json(), "roofline_ms": row_floor, "roofline_pct": 100 * row_floor / med,
               "correct": res.correct, "note": res.note, "build_s": res.extra["build_s"],
               "occupancy": ex.occupancy, "max_abs_err": check.get("max_abs_err")}
        rows.append(row)
        dump()
        print(f"  {tag} tasks={row['tasks']:<6} {med:8.4f} ms "
              f"({row['roofline_pct']:5.1f}% roofline) correct={res.correct} {res.note}",
              flush=True)
        if ctx:  # the next schedule's arena needs the symmetric heap's room
            ctx.free_symmetric(ex.arena)
        del ex, compilation
        torch.cuda.empty_cache()
    dump()
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/megakernel_sweep.py")  # an AmkError: one line, its exit code
