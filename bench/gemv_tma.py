"""Can TMA copies into shared memory lift one persistent program per SM to the HBM roofline?

A micro-benchmark for the megakernel's GEMV: the megakernel runs one 8-warp
program per SM at ~240 registers per thread, so its weight stream can keep only what the
registers hold in flight (16 x 128 bf16 blocks unrolled 8 times: 32 KB per SM), and it streams
at 1.7-2.6 TB/s of the H200's ~4.2 (docs/experiments.md). A tensor-memory-accelerator (TMA)
copy lands in shared memory and holds no registers, so Triton's software pipeliner
(``tl.range(..., num_stages=S)`` over ``tl.make_tensor_descriptor`` loads) can keep
(S - 1) boxes in flight per SM whatever the register count.

Each program walks row tiles of ``--tile`` rows of a bf16 W[N, K] (far above L2) and computes
y = W @ x (fp32 accumulation), one program per SM. Variants (``--variants``):

* ``ldg:BNxBK:U``  register loads as in the megakernel's unrolled loop (``loop_unroll_factor`` U;
  BN must divide ``--tile``)
* ``tma:BNxBK:S``  a device-side tensor descriptor per tile, row blocks of BN, K loop pipelined
  S deep (S - 1 boxes of BN x BK in flight)
* ``tmaf:BNxBK:S`` the same with one flat loop over (row block, K block), so the pipeline
  does not drain between row blocks of a tile

Prints a table (TB/s, GB/s per SM, fraction of a device-to-device copy measured in the same
run, max error against torch) and writes JSON.

    python bench/gemv_tma.py [--k 4096] [--tile 64] [--rounds 8] [--warps 8]
                             [--variants ldg:16x128:8,tma:64x128:4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from ground.timing import measure_hbm_bandwidth, time_per_call
from lowering.triton.runtime import tma_scratch


@triton.jit
def _ldg(W, X, Y, ntiles, K, TILE_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, U: tl.constexpr):
    pid = tl.program_id(0)
    K = tl.multiple_of(K, 16)
    for tile in range(pid, ntiles, tl.num_programs(0)):
        for n0 in range(0, TILE_N, BN):
            rows = tile * TILE_N + n0 + tl.arange(0, BN)
            acc = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in tl.range(0, K, BK, loop_unroll_factor=U):
                cols = k0 + tl.arange(0, BK)
                w = tl.load(W + rows.to(tl.int64)[:, None] * K + cols[None, :])
                x = tl.load(X + cols).to(tl.float32)
                acc += w.to(tl.float32) * x[None, :]
            tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty))


@triton.jit
def _tma(W, X, Y, ntiles, K, TILE_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    for tile in range(pid, ntiles, tl.num_programs(0)):
        desc = tl.make_tensor_descriptor(W + tile.to(tl.int64) * TILE_N * K, shape=[TILE_N, K], strides=[K, 1],
                                         block_shape=[BN, BK])
        for n0 in range(0, TILE_N, BN):
            acc = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in tl.range(0, K, BK, num_stages=S):
                w = desc.load([n0, k0])
                x = tl.load(X + k0 + tl.arange(0, BK)).to(tl.float32)
                acc += w.to(tl.float32) * x[None, :]
            r = n0 + tl.arange(0, BN)  # a box taller than the tile's rest: rows past it are zeros
            tl.store(Y + tile * TILE_N + r, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=r < TILE_N)


@triton.jit
def _tmaf(W, X, Y, ntiles, K, TILE_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    pid = tl.program_id(0)
    nk = K // BK
    for tile in range(pid, ntiles, tl.num_programs(0)):
        desc = tl.make_tensor_descriptor(W + tile.to(tl.int64) * TILE_N * K, shape=[TILE_N, K], strides=[K, 1],
                                         block_shape=[BN, BK])
        acc = tl.zeros([BN, BK], dtype=tl.float32)
        for i in tl.range(0, tl.cdiv(TILE_N, BN) * nk, num_stages=S):
            n0 = (i // nk) * BN
            k0 = (i % nk) * BK
            w = desc.load([n0, k0])
            x = tl.load(X + k0 + tl.arange(0, BK)).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
            if i % nk == nk - 1:
                r = n0 + tl.arange(0, BN)
                tl.store(Y + tile * TILE_N + r, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=r < TILE_N)
                acc = tl.zeros([BN, BK], dtype=tl.float32)


KERNELS = {"ldg": _ldg, "tma": _tma, "tmaf": _tmaf}


def _time(fn, reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` CUDA-event-timed calls after 3 warm-ups."""
    return time_per_call(fn, reps, warmup=3, device="cuda").median_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--tile", type=int, default=64, help="rows per tile")
    ap.add_argument("--rounds", type=int, default=8, help="tiles per program")
    ap.add_argument("--warps", default="8")
    ap.add_argument("--per-sm", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", default="ldg:16x128:8,tma:16x256:4,tma:64x128:4,tma:64x128:6,tmaf:16x256:8")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemv_tma: needs a CUDA GPU", file=sys.stderr)
        return 2
    triton.set_allocator(tma_scratch)  # device-side tensor descriptors live in global scratch
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * a.per_sm
    ntiles = grid * a.rounds
    n = ntiles * a.tile
    w = torch.randn(n, a.k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(a.k, device="cuda", dtype=torch.bfloat16)
    want = (w.float() @ x.float())
    copy_tbs = measure_hbm_bandwidth("cuda", 1 << 29, a.reps) / 1e12
    gemv_ms = _time(lambda: torch.mv(w, x), a.reps)
    wbytes = w.numel() * 2
    rows = [dict(variant="torch.mv (cuBLAS)", warps=None, ms=gemv_ms, tbs=wbytes / gemv_ms / 1e9, err=0.0)]
    for spec in a.variants.split(","):
        kind, blk, depth = spec.split(":")
        bn, bk = (int(v) for v in blk.split("x"))
        for nw in (int(v) for v in a.warps.split(",")):
            y = torch.empty(n, device="cuda", dtype=torch.float32)
            fn = KERNELS[kind]
            try:
                run = lambda: fn[(grid,)](w, x, y, ntiles, a.k, a.tile, bn, bk, int(depth), num_warps=nw)
                ms = _time(run, a.reps)
                err = (y - want).abs().max().item()
                k = fn.warmup(w, x, y, ntiles, a.k, a.tile, bn, bk, int(depth), num_warps=nw, grid=(grid,))
                meta = dict(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
                            shared=int(k.metadata.shared))
                rows.append(dict(variant=spec, warps=nw, ms=ms, tbs=wbytes / ms / 1e9, err=err, **meta))
            except Exception as e:  # report and go on: one failing variant must not lose the rest
                rows.append(dict(variant=spec, warps=nw, error=f"{type(e).__name__}: {str(e)[:300]}"))
    print(f"device {torch.cuda.get_device_name(0)}, {sms} SMs, grid {grid}, W {n} x {a.k} bf16 "
          f"({wbytes / 2**20:.0f} MiB), copy {copy_tbs:.2f} TB/s")
    print(f"{'variant':<22}{'warps':>6}{'ms':>9}{'TB/s':>7}{'GB/s/SM':>9}{'of copy':>9}{'max err':>10}"
          f"{'regs':>6}{'smem':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<22}{r['warps']:>6}  ERROR {r['error']}")
            continue
        print(f"{r['variant']:<22}{str(r['warps'] or '-'):>6}{r['ms']:>9.3f}{r['tbs']:>7.2f}"
              f"{r['tbs'] * 1e3 / sms:>9.1f}{r['tbs'] / copy_tbs:>9.1%}{r['err']:>10.2e}"
              f"{str(r.get('regs', '-')):>6}{str(r.get('shared', '-')):>8}")
    if a.json:
        from ground.files import atomic_write_text  # whole file or none

        atomic_write_text(a.json, json.dumps(dict(device=torch.cuda.get_device_name(0), sms=sms, grid=grid, n=n,
                                                  k=a.k, tile=a.tile, copy_tbs=copy_tbs,
                                                  command=" ".join(sys.argv), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/gemv_tma.py")  # an AmkError: one line, its exit code
