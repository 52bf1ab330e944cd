"""Where does the megakernel's GEMV lose bandwidth? A synthetic program of independent GEMV
tiles (no waits, no signals) run by the real megakernel with profiling stamps.

Each of ``--workers`` workers runs its share of ``rows / tile`` norm_gemv (or gemv) tiles of a
bf16 W[rows, K]. ``--giant`` also compiles in the dispatch variants of a fused bf16 Llama
(attention, RoPE, argmax, ...) that the real model's kernel carries, so the GEMV code is the
same while the kernel's size and register allocation are the real kernel's. Prints the mean
per-task time split by the PROF stamps and the achieved bandwidth (tile bytes / stream time
per SM, and all weight bytes / step span).

    python bench/gemv_probe.py [--op norm_gemv] [--giant] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch


def build(op: str, rows: int, k: int, tile: int, workers: int, sms: int):
    from ir.builder import ProgramBuilder
    from ir.program import Target

    b = ProgramBuilder(f"probe-{op}", ranks=1, workers=workers,
                       target=Target(name="probe", sms=sms, max_workers=4 * sms, backend="triton"))
    b.buffer("x", "io_input", "bf16", (k,))
    b.buffer("a", "weight", "bf16", (k,))
    b.buffer("W", "weight", "bf16", (rows, k))
    b.buffer("y", "io_output", "bf16", (rows,))
    for t in range(rows // tile):
        r0, r1 = t * tile, (t + 1) * tile
        if op == "norm_gemv":
            b.task(f"t{t}", 0, t % workers, "norm_gemv", ins=[f"x[0:{k}]", f"a[0:{k}]", f"W[{r0}:{r1}, 0:{k}]"],
                   outs=[f"y[{r0}:{r1}]"], params={"eps": 1e-5})
        else:
            b.task(f"t{t}", 0, t % workers, "gemv", ins=[f"x[0:{k}]", f"W[{r0}:{r1}, 0:{k}]"], outs=[f"y[{r0}:{r1}]"])
    return b.build()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", default="norm_gemv", choices=["norm_gemv", "gemv"])
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--workers", type=int, default=132)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--gemv-block", default="16x1024")
    ap.add_argument("--unroll", type=int, default=1, help="GEMV K-loop unroll (Blocks.gemv_unroll)")
    ap.add_argument("--x-stage", type=int, default=1, choices=(0, 1), help="Blocks.x_stage")
    ap.add_argument("--no-profile", action="store_true",
                    help="time the kernel without the PROF stamps (CUDA events over 20 steps)")
    ap.add_argument("--giant", action="store_true", help="also compile a fused Llama's variants in")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    from ground.timing import time_per_call
    from lowering.triton import vm as MK
    from lowering.triton import table as T
    from lowering.triton.runtime import Blocks, TritonExecutor

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if a.giant:  # prepend the real kernel's dispatch variants to every table built below
        from tests.test_triton_megakernel import lowered
        prog0, init0, _ = lowered("tiny-llama", workers=2, dtype="bf16", fuse=True)
        extra = list(TritonExecutor(prog0, init0, check=False).table.variants)
        orig = T.build_table

        def build_table(*args, **kw):
            args = list(args)
            given = args[5] if len(args) > 5 else kw.get("variants")
            merged = list(extra) + [v for v in (given or []) if v not in extra]
            if len(args) > 5:
                args[5] = merged
            else:
                kw["variants"] = merged
            return orig(*args, **kw)
        T.build_table = build_table
    prog = build(a.op, a.rows, a.k, a.tile, a.workers, sms)
    g = torch.Generator().manual_seed(0)
    data = {"W": torch.randn(a.rows, a.k, generator=g).to(torch.bfloat16),
            "a": torch.randn(a.k, generator=g).to(torch.bfloat16)}
    bn, bk = (int(v) for v in a.gemv_block.split("x"))
    ex = TritonExecutor(prog, lambda buf, r: data.get(buf.name), check=True, num_warps=a.warps,
                        blocks=Blocks(gemv_n=bn, gemv_k=bk, gemv_unroll=a.unroll, x_stage=bool(a.x_stage)),
                        profile=not a.no_profile)
    x = torch.randn(a.k, generator=g).to(torch.bfloat16)
    for e in range(4):
        ex.write("x", 0, x)
        ex.step(e)
    torch.cuda.synchronize()
    y = ex.read("y").float().cpu()
    xf = x.float()
    if a.op == "norm_gemv":  # f(x) rounded to bf16, as the kernel's prologue
        xf = (data["a"].float() * (xf * torch.rsqrt(xf.square().mean() + 1e-5))).bfloat16().float()
    ref = data["W"].float() @ xf
    ok = bool(torch.allclose(y, ref, rtol=2e-2, atol=2e-1))
    res = dict(regs=ex.occupancy.get("n_regs"), variants=len(ex.table.variants), correct=ok, op=a.op,
               giant=a.giant, warps=a.warps, gemv_block=a.gemv_block, unroll=a.unroll, x_stage=a.x_stage,
               profile=not a.no_profile,
               device=torch.cuda.get_device_name(dev), command=" ".join(sys.argv))
    head = (f"{a.op} giant={a.giant} block={a.gemv_block} unroll={a.unroll} x_stage={a.x_stage} warps={a.warps} "
            f"regs={res['regs']} correct={ok}")
    if a.no_profile:  # kernel time per step: CUDA events around single launches (launch gaps included)
        steps = iter(range(4, 1 << 30))
        span = time_per_call(lambda: ex.step(next(steps)), iters=20, warmup=0, device=dev).median_ms * 1e3
        res.update(span_us=span, kernel_tbps=a.rows * a.k * 2 / span / 1e6)
        print(f"{head}: step {span:.1f} us = {res['kernel_tbps']:.2f} TB/s "
              f"({res['kernel_tbps'] * 1e3 / sms:.1f} GB/s per SM); correct={ok}")
    else:
        p = ex._prof.view(-1, MK.PROF_W).cpu().numpy().astype(np.float64)
        parts = {"waits": p[:, 1] - p[:, 0], "decode": p[:, 3] - p[:, 1], "prologue": p[:, 4] - p[:, 3],
                 "stream+store": p[:, 5] - p[:, 4], "barrier+signals": p[:, 2] - p[:, 6],
                 "op total": p[:, 2] - p[:, 1]}
        span = (p[:, 2].max() - p[:, 0].min()) / 1e3
        res.update({k: float(v.mean() / 1e3) for k, v in parts.items()})
        res.update(span_us=span, kernel_tbps=a.rows * a.k * 2 / span / 1e6,
                   stream_gbps_per_sm=a.tile * a.k * 2 / res["stream+store"] / 1e3)
        print(f"{head} variants={res['variants']}: " + ", ".join(f"{k} {res[k]:.2f} us" for k in parts)
              + f"; stream {res['stream_gbps_per_sm']:.1f} GB/s/SM; step {span:.1f} us = "
              f"{res['kernel_tbps']:.2f} TB/s; correct={ok}")
    if a.json:
        from ground.files import atomic_write_text  # whole file or none

        atomic_write_text(a.json, json.dumps(res, indent=1))
    return 0

if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/gemv_probe.py")  # an AmkError: one line, its exit code
