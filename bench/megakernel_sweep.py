"""Time the megakernel for several lowering configs of one model in one GPU call.

Usage: python bench/megakernel_sweep.py MODEL [--workers 32,66,132] [--tile 64,128]
           [--policy balanced] [--warps 4,8] [--gemv-block 16x256,32x512] [--gemv-stages 1,3]
           [--fuse 0,1] [--wave 0,1] [--prefetch 0,1] [--late-append 0,1] ... [--tokens 64] [--json FILE]
Every knob flag takes a comma list; the sweep runs their product (``--help`` lists them).
``--tp R``: tensor parallel over R GPUs, one process per GPU over NVSHMEM (spawned, as
``amk bench --tp R``); each row's latency is the slowest rank's median and its roofline the
per-rank one (amk/bench_tp.py); rank 0 prints and writes the JSON.
Prints the knobs that stay fixed once, then per row the ones that vary, tasks, median
ms/token, % of roofline, and the correctness verdict (greedy tokens vs HF generate with the
bf16 near-tie rule, plus the logit check).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch


def ints(s: str) -> list[int]:
    """A comma-list flag's integers."""
    return [int(x) for x in s.split(",")]


def flags(s: str) -> list[bool]:
    """A comma-list flag of 0/1 values."""
    return [bool(x) for x in ints(s)]


def strs(s: str) -> list[str]:
    return s.split(",")


#: Sweep flags (argparse dest) that set a LoweringConfig field of the same name.
LOWERING_AXES = {"workers": ints, "tile": ints, "policy": strs, "fuse": flags, "wave": flags,
                 "attn_split": ints, "tile_qkv": ints, "tile_gate_up": ints, "tile_lm_head": ints,
                 "late_append": flags, "tile_reduce": ints, "allreduce": strs, "fuse_reduce": flags}
#: Sweep flags (argparse dest) that set a Blocks field: dest -> (field, parser). A row of the
#: JSON records each under the field's name (bench/sweep_best.py maps them to amk bench flags).
BLOCKS_AXES = {"gemv_stages": ("gemv_stages", ints), "prefetch": ("prefetch", ints),
               "att_t": ("attention_t", ints), "unroll": ("gemv_unroll", ints),
               "row_prefetch": ("row_prefetch", flags),
               "maxnreg": ("maxnreg", ints), "x_stage": ("x_stage", flags),
               "lean_release": ("lean_release", flags),
               "x_reuse": ("x_reuse", flags),
               "x_chunk": ("x_chunk", ints), "w_preload": ("w_preload", ints),
               "prefetch_cap": ("prefetch_cap", ints), "prefetch_rows": ("prefetch_rows", ints),
               "roll": ("roll", ints), "gemv_tma": ("gemv_tma", flags),
               "ring": ("ring", ints), "ring_rows": ("ring_rows", ints), "ring_cols": ("ring_cols", ints)}


#: the flags after MODEL, in --help order: (flag, default, help); an int default makes an
#: int flag, every other knob takes a comma list (the sweep runs their product)
FLAGS = (
    ("--workers", "32,66,132", None),
    ("--tile", "64,128", None),
    ("--policy", "balanced,round_robin", None),
    ("--warps", "4,8", None),
    ("--gemv-block", "16x256,32x512", None),
    ("--gemv-stages", "1", "comma list of GEMV pipeline depths (Blocks.gemv_stages), e.g. 1,2,3"),
    ("--fuse", "0", "comma list of 0/1 for the fuse knob"),
    ("--wave", "0", "comma list of 0/1 for the wave knob"),
    ("--prefetch", "0", "comma list of L2 prefetch look-aheads (Blocks.prefetch)"),
    ("--att-t", "32", "comma list of attention blocks (Blocks.attention_t)"),
    ("--unroll", "1", "comma list of GEMV unroll factors (Blocks.gemv_unroll)"),
    ("--attn-split", "1", "comma list of the attn_split lowering knob"),
    ("--row-prefetch", "1", "comma list of 0/1 (Blocks.row_prefetch)"),
    ("--x-stage", "1", "comma list of 0/1 (Blocks.x_stage)"),
    ("--x-reuse", "1", "comma list of 0/1 (Blocks.x_reuse)"),
    ("--x-chunk", "8192", "comma list of powers of two (Blocks.x_chunk)"),
    ("--w-preload", "0", "comma list of Blocks.w_preload (0 = off)"),
    ("--prefetch-cap", "0", "comma list of Blocks.prefetch_cap (bytes; 0 = whole tile)"),
    ("--prefetch-rows", "0", "comma list of Blocks.prefetch_rows (0 = no limit)"),
    ("--roll", "0", "comma list of Blocks.roll (row blocks; 0 = off)"),
    ("--tile-gate-up", "0", "comma list of the tile_gate_up lowering knob (0 = tile)"),
    ("--tile-qkv", "0", "comma list of the tile_qkv lowering knob (0 = tile)"),
    ("--tile-lm-head", "0", "comma list of the tile_lm_head lowering knob (0 = tile)"),
    ("--tp", 1, "ranks: one process per GPU over NVSHMEM (R GPUs needed), as amk bench --tp R"),
    ("--tile-reduce", "0", "comma list of the tile_reduce lowering knob (0 = tile)"),
    ("--allreduce", "oneshot", "comma list of the allreduce lowering knob"),
    ("--fuse-reduce", "0", "comma list of 0/1 for the fuse_reduce knob"),
    ("--lean-release", "1", "comma list of 0/1 (Blocks.lean_release)"),
    ("--gemv-tma", "0", "comma list of 0/1 (Blocks.gemv_tma; needs --gemv-stages >= 2)"),
    ("--maxnreg", "0", "comma list of register caps (Blocks.maxnreg; 0 = automatic)"),
    ("--ring", "0", "comma list of weight-ring pages per worker (Blocks.ring; 0 = off)"),
    ("--ring-rows", "4", "comma list of weight-ring page rows (Blocks.ring_rows)"),
    ("--ring-cols", "2048", "comma list of weight-ring page columns (Blocks.ring_cols)"),
    ("--sync-opt", "1", "comma list of 0/1: Blocks.elide_waits and Blocks.coalesce_signals together"),
    ("--late-append", "0", "comma list of 0/1 for the late_append knob"),
    ("--tokens", 64, None),
    ("--prompt-len", 8, None),
    ("--json", None, None),
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    for flag, default, help_ in FLAGS:
        ap.add_argument(flag, default=default, help=help_,
                        **({"type": int} if isinstance(default, int) else {}))
    return ap


def sweep_points(args: argparse.Namespace) -> list[dict]:
    """Every combination of the comma lists, in product order, as {"config": {LoweringConfig
    fields}, "blocks": {Blocks fields}, "num_warps", "gemv_block", "sync_opt"}. Raises
    ValueError for a list that does not parse."""
    axes = {("config", d): parse(getattr(args, d)) for d, parse in LOWERING_AXES.items()}
    axes.update({("blocks", f): parse(getattr(args, d)) for d, (f, parse) in BLOCKS_AXES.items()})
    axes[("run", "num_warps")] = ints(args.warps)
    axes[("run", "gemv_block")] = strs(args.gemv_block)
    axes[("run", "sync_opt")] = flags(args.sync_opt)
    points = []
    for combo in itertools.product(*axes.values()):
        pt: dict = {"config": {}, "blocks": {}}
        for (kind, name), v in zip(axes, combo):
            (pt[kind] if kind != "run" else pt)[name] = v
        points.append(pt)
    return points


def flat_point(pt: dict) -> dict:
    """A sweep point's knobs in one dict (lowering, Blocks, then run knobs)."""
    return {**pt["config"], **pt["blocks"], **{k: v for k, v in pt.items() if k not in ("config", "blocks")}}


def varying_knobs(points: list[dict]) -> set[str]:
    """The knobs that take more than one value over the sweep."""
    flat = [flat_point(p) for p in points]
    return {k for k in flat[0] if len({repr(f[k]) for f in flat}) > 1}


def tag_of(pt: dict, keys: set[str], invert: bool = False) -> str:
    """The knobs of a point in ``keys`` (``invert``: those not in it) as name=value."""
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in flat_point(pt).items()
                    if (k in keys) != invert) or "-"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    points = sweep_points(args)
    ctx = None
    if args.tp > 1:
        from amk import launch
        code, ctx = launch.script_entry(__file__, argv, args.tp)
        if code is not None:
            return code

    from amk.baselines import make_reference
    from amk.bench_tp import measure_megakernel_tp
    from amk.bench import cuda_target, measure_megakernel
    from ground.timing import decode_weight_bytes, measure_hbm_bandwidth, roofline_ms
    from lowering.config import LoweringConfig
    from lowering.triton.runtime import Blocks, TritonError
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
        bn, bk = (int(v) for v in pt["gemv_block"].split("x"))
        so = pt["sync_opt"]
        tag = tag_of(pt, varying)
        try:
            blocks = Blocks(gemv_n=bn, gemv_k=bk, elide_waits=so, coalesce_signals=so, **pt["blocks"])
        except TritonError as err:  # a combination the kernel refuses (e.g. gemv_tma without stages)
            print(f"  {tag}: skipped, {err}", flush=True)
            continue
        opts = {"num_warps": pt["num_warps"], "blocks": blocks}
        cfg = LoweringConfig(dtype="bf16", max_seq=max(256, args.prompt_len + args.tokens + 8),
                             **pt["config"]).validate()
        knobs = {"config": cfg.to_json(), "num_warps": pt["num_warps"], "gemv_block": pt["gemv_block"],
                 "sync_opt": so, **pt["blocks"]}
        try:
            if ctx:
                res, session, ex = measure_megakernel_tp(args.model, resolved, cfg, target, prompt, ref,
                                                         args.tokens, opts, ctx)
            else:
                res, session, ex = measure_megakernel(args.model, resolved, cfg, target, prompt, ref,
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
            row_floor = max(weight_bytes_per_rank(session.program)) / bw * 1e3
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
        del ex, session
        torch.cuda.empty_cache()
    dump()
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/megakernel_sweep.py")  # an AmkError: one line, its exit code
