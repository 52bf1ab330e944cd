"""How fast can one persistent Triton program per SM stream GEMV weight tiles?

A micro-benchmark for the megakernel's GEMV: each program walks tiles of
``--tile`` rows of a bf16 W[N, K] (N * K * 2 bytes well above L2) and computes y = W @ x
with fp32 accumulation, no synchronisation between tiles. Sweeps block shape, warps, grid
(programs per SM) and K blocks loaded per iteration, and prints the achieved HBM bandwidth
per config next to a device-to-device copy and torch's own GEMV (cuBLAS) in the same run.
Then the megakernel's own GEMV device function (``ops/gemv.py gemv_ex``) in the same persistent
loop: plain, with the RMSNorm prologue, and with the megakernel's per-task acquire poll,
bar.sync and release ("sync").

    python bench/gemv_stream.py [--k 2048] [--rows 131072] [--blocks 16x1024,16x512]
                                [--warps 8] [--per-sm 1,2] [--unroll 1,2] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from lowering.triton.ops import gemv as K


@triton.jit
def _stream(W, X, Y, ntiles, K, TILE_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            UNROLL: tl.constexpr, TILED: tl.constexpr = False):
    """Persistent GEMV over row tiles; UNROLL K blocks loaded before any is consumed.
    TILED: W is stored block-contiguous (``tiled``), so each [BN, BK] block is one contiguous
    run of memory instead of BN runs of BK elements one row stride apart."""
    pid = tl.program_id(0)
    for tile in range(pid, ntiles, tl.num_programs(0)):
        for n0 in range(0, TILE_N, BN):
            rows = tile * TILE_N + n0 + tl.arange(0, BN)
            acc = tl.zeros([BN, BK], dtype=tl.float32)
            for k0 in range(0, K, BK * UNROLL):
                cols = k0 + tl.arange(0, BK)
                if TILED:  # block (k0 // BK) of the tile: TILE_N rows of BK elements, contiguous
                    base = W + tile * TILE_N * K + k0 * TILE_N + (n0 + tl.arange(0, BN))[:, None] * BK
                    w0 = tl.load(base + tl.arange(0, BK)[None, :])
                    if UNROLL > 1:
                        w1 = tl.load(base + TILE_N * BK + tl.arange(0, BK)[None, :])
                else:
                    w0 = tl.load(W + rows[:, None] * K + cols[None, :])
                    if UNROLL > 1:
                        w1 = tl.load(W + rows[:, None] * K + (cols + BK)[None, :])
                x0 = tl.load(X + cols).to(tl.float32)
                acc += w0.to(tl.float32) * x0[None, :]
                if UNROLL > 1:
                    x1 = tl.load(X + cols + BK).to(tl.float32)
                    acc += w1.to(tl.float32) * x1[None, :]
            tl.store(Y + rows, tl.sum(acc, axis=1).to(Y.dtype.element_ty))


@triton.jit
def _stream_ex(W, X, A, Y, FLAG, ntiles, K_, TILE_N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               PRO: tl.constexpr, SYNC: tl.constexpr):
    """The megakernel's own GEMV device function (ops/gemv.py gemv_ex: x loaded with its runtime
    stride, masks, PRO prologue) over the same tiles; SYNC adds the megakernel's per-task
    synchronisation: an acquire poll of an already-satisfied counter, bar.sync, and a
    release atomic after the tile's stores."""
    pid = tl.program_id(0)
    for tile in range(pid, ntiles, tl.num_programs(0)):
        if SYNC:
            v = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [FLAG],
                                          dtype=tl.int32, is_pure=False, pack=1)
            if tl.max(tl.full([256], 0, dtype=tl.int32) + v, axis=0) < 0:
                tl.store(Y, 0.0)
        K.gemv_ex((X, 1, K_, 0, 0, 1), (A, 1, K_, 0, 0, 1), 1e-5,
                  (W + tile * TILE_N * K_, K_, 1), (Y, 1, TILE_N, 0, 0, 1),
                  (Y + tile * TILE_N, 1, TILE_N, 0, 0, 1), TILE_N, K_,
                  PRO, False, True, True, 8, BN, BK)
        if SYNC:
            tl.debug_barrier()
            tl.atomic_add(FLAG + 1, 1, sem="release", scope="gpu")


def time_back_to_back(fn, reps: int = 20) -> float:
    """Mean ms per call of ``reps`` calls enqueued back to back between two CUDA events
    (after one untimed call); also used by bench/gemv_ladder.py."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps  # ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=131072)
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--blocks", default="16x1024,16x512", help="comma list of BNxBK weight blocks")
    ap.add_argument("--warps", default="8", help="comma list of warps per program")
    ap.add_argument("--per-sm", default="1,2", help="comma list of programs per SM")
    ap.add_argument("--unroll", default="1,2", help="comma list of K blocks loaded before use (1 or 2)")
    ap.add_argument("--layout", default="row", help="comma list of W layouts: row (row-major) and/or "
                    "tiled (each tile's [BN, BK] blocks contiguous)")
    ap.add_argument("--no-ex", action="store_true", help="skip the gemv_ex rows")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    blocks = [tuple(int(v) for v in b.split("x")) for b in a.blocks.split(",")]
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    W = torch.randn(a.rows, a.k, device=dev, dtype=torch.bfloat16)
    x = torch.randn(a.k, device=dev, dtype=torch.bfloat16)
    y = torch.empty(a.rows, device=dev, dtype=torch.bfloat16)
    ref = (W.float() @ x.float())
    nbytes = W.numel() * 2
    buf = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
    copy_ms = time_back_to_back(lambda: buf.copy_(W.view(-1)))
    hbm = 2 * nbytes / copy_ms / 1e9  # TB/s, bytes read + written
    mv_ms = time_back_to_back(lambda: torch.mv(W, x))
    rows = [dict(name="copy", ms=copy_ms, tbps=hbm), dict(name="torch.mv", ms=mv_ms, tbps=nbytes / mv_ms / 1e9)]
    print(f"{torch.cuda.get_device_name(dev)}: W {a.rows}x{a.k} bf16 ({nbytes / 1e6:.0f} MB); copy {hbm:.2f} TB/s; "
          f"torch.mv {rows[1]['tbps']:.2f} TB/s")
    ntiles = a.rows // a.tile
    for (bn, bk), warps, per_sm, unroll, layout in itertools.product(
            blocks, ints(a.warps), ints(a.per_sm), ints(a.unroll), a.layout.split(",")):
        if a.k % (bk * unroll) or a.tile % bn:
            continue
        grid = (sms * per_sm,)
        tiled = layout == "tiled"
        Wl = (W.view(ntiles, a.tile, a.k // bk, bk).permute(0, 2, 1, 3).contiguous() if tiled else W)
        try:
            f = lambda: _stream[grid](Wl, x, y, ntiles, a.k, a.tile, bn, bk, unroll, tiled,  # noqa: E731
                                      num_warps=warps)
            f()
            torch.cuda.synchronize()
            ok = bool(torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-1))
            ms = time_back_to_back(f)
        except Exception as e:  # a config that does not compile or launch: report, go on
            print(f"  {bn}x{bk} warps={warps} per_sm={per_sm} unroll={unroll}: {type(e).__name__}")
            continue
        del Wl
        r = dict(name="stream", bn=bn, bk=bk, warps=warps, per_sm=per_sm, unroll=unroll, layout=layout,
                 ms=ms, tbps=nbytes / ms / 1e9, correct=ok)
        rows.append(r)
        print(f"  {bn:>2}x{bk:<4} warps={warps:<2} per_sm={per_sm} unroll={unroll} {layout:<5} "
              f"{r['tbps']:.2f} TB/s ({100 * r['tbps'] / hbm:.0f}% of copy) correct={ok}")
    # the megakernel's GEMV function, plain / with the RMSNorm prologue / plus per-task sync
    aw = torch.randn(a.k, device=dev, dtype=torch.bfloat16)
    flag = torch.ones(4, device=dev, dtype=torch.int32)
    for (bn, bk), warps, pro, sync in itertools.product(blocks if not a.no_ex else [], ints(a.warps),
                                                        [0, 1], [0, 1]):
        f = lambda: _stream_ex[(sms,)](W, x, aw, y, flag, ntiles, a.k, a.tile, bn, bk, pro, sync,  # noqa: E731
                                       num_warps=warps)
        try:
            f()
            torch.cuda.synchronize()
            want = ref if pro == 0 else None
            ok = bool(torch.allclose(y.float(), want, rtol=2e-2, atol=2e-1)) if want is not None else None
            ms = time_back_to_back(f)
        except Exception as e:
            print(f"  gemv_ex {bn}x{bk} pro={pro} sync={sync}: {type(e).__name__}: {e}")
            continue
        r = dict(name="gemv_ex", bn=bn, bk=bk, warps=warps, per_sm=1, pro=pro, sync=sync, ms=ms,
                 tbps=nbytes / ms / 1e9, correct=ok)
        rows.append(r)
        print(f"  gemv_ex {bn:>2}x{bk:<4} warps={warps} pro={pro} sync={sync} {r['tbps']:.2f} TB/s "
              f"({100 * r['tbps'] / hbm:.0f}% of copy) correct={ok}")
    if a.json:
        from ground.files import atomic_write_text  # whole file or none

        atomic_write_text(a.json, json.dumps(dict(device=torch.cuda.get_device_name(dev), k=a.k, rows=a.rows,
                                                  tile=a.tile, command=" ".join(sys.argv), results=rows),
                                             indent=1))
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/gemv_stream.py")  # an AmkError: one line, its exit code
