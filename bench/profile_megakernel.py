"""Where does a megakernel step spend its time? In-kernel %globaltimer stamps per task.

Usage: python bench/profile_megakernel.py MODEL [--workers 132] [--tile 32] [--warps 8]
           [--gemv-block 32x512] [--steps 12] [--json FILE]
Runs ``--steps`` decode steps with the profiling kernel (one extra global store per stamp)
and reports, per op: task count, mean / p90 op time (op start -> signals released) and
mean wait time (queue head -> waits satisfied), plus the step's span and the sum of op
times on the busiest worker. The profiled kernel is slightly slower than the plain one;
use it to rank costs, not as the latency.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--workers", type=int, default=132)
    ap.add_argument("--tile", type=int, default=32)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--gemv-block", default="32x512")
    ap.add_argument("--policy", default="balanced")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fuse", action="store_true", help="lower with the fuse knob")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from amk import pipeline
    from amk.commands.bench import cuda_target
    from lowering.config import LoweringConfig
    from lowering.triton.runtime import Blocks
    from models.sources import resolve_model

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    resolved = resolve_model(args.model, dtype="bf16")
    cfg = LoweringConfig(tile=args.tile, workers=args.workers, policy=args.policy, dtype="bf16",
                         max_seq=256, fuse=args.fuse).validate()
    target = cuda_target(props)
    session = pipeline.Session.build(args.model, 1, cfg, target, resolved=resolved)
    bn, bk = (int(v) for v in args.gemv_block.split("x"))
    dec = session.decoder("triton", backend_options={
        "num_warps": args.warps, "blocks": Blocks(gemv_n=bn, gemv_k=bk), "profile": True})
    ex = dec.ex
    tok = 1
    for pos in range(args.steps):
        tok = dec.step(tok, pos)
    torch.cuda.synchronize()
    prof = ex._prof.view(-1, 3).cpu().numpy().astype(np.int64)
    tab = ex.table
    ops = tab.task_ops
    t0 = prof[:, 0].min()
    span_us = (prof[:, 2].max() - t0) / 1e3
    per_op = defaultdict(lambda: {"n": 0, "op_us": [], "wait_us": []})
    for row, op in enumerate(ops):
        d = per_op[op]
        d["n"] += 1
        d["op_us"].append((prof[row, 2] - prof[row, 1]) / 1e3)
        d["wait_us"].append((prof[row, 1] - prof[row, 0]) / 1e3)
    busy = []
    for w in range(tab.workers):
        lo, hi = int(tab.qstart[w]), int(tab.qstart[w + 1])
        busy.append(float(((prof[lo:hi, 2] - prof[lo:hi, 1]) / 1e3).sum()))
    print(f"{args.model}: {len(ops)} tasks on {tab.workers} workers; last step span "
          f"{span_us:.1f} us; busiest worker's op time {max(busy):.1f} us")
    print(f"{'op':<16}{'tasks':>7}{'op us mean':>12}{'op us p90':>11}{'op us sum':>11}"
          f"{'wait us mean':>14}")
    out = {"model": args.model, "device": props.name, "span_us": span_us,
           "busiest_worker_op_us": max(busy), "ops": {}}
    for op, d in sorted(per_op.items(), key=lambda kv: -sum(kv[1]["op_us"])):
        a, wt = np.array(d["op_us"]), np.array(d["wait_us"])
        print(f"{op:<16}{d['n']:>7}{a.mean():>12.2f}{np.percentile(a, 90):>11.2f}{a.sum():>11.1f}"
              f"{wt.mean():>14.2f}")
        out["ops"][op] = {"tasks": d["n"], "op_us_mean": float(a.mean()),
                          "op_us_p90": float(np.percentile(a, 90)), "op_us_sum": float(a.sum()),
                          "wait_us_mean": float(wt.mean())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
