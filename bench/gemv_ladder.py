"""Bisect the gap between a plain persistent GEMV and the megakernel's GEMV tasks.

The megakernel streams a 64 KB weight tile at ~13-16 GB/s per SM, a plain persistent Triton
kernel running the same device function (ops/gemv.py gemv_ex) at ~24 GB/s per SM
(docs/experiments.md). Each rung below adds one property of the megakernel to the plain
kernel, over the same W[rows, K] bf16 tiles of ``--tile`` rows, tile t on program t mod P:

  plain     ops/gemv.py gemv_ex with kernel-argument pointers and sizes
  table     W / x / y offsets, N and K loaded per tile from an int64 table, all operands in
            one bf16 arena (the megakernel's operand decoding)
  dispatch  ``table`` inside a data-dependent opcode switch whose other branch (never taken)
            is a register-hungry [4, 64, 64] attention-like block, so the compiler allocates
            registers for the whole kernel as it does for the megakernel
  stamps    ``dispatch`` plus two %globaltimer stores per tile (the megakernel's PROFILE)

and three rungs that take one property of ``table`` back, to find which one costs:

  table_n   ``table`` with N (rows per tile) a compile-time constant again
  table_nk  ``table_n`` with K a kernel argument again (only the offsets from the table)
  table_pf  ``table`` with the next tile's row loaded one tile ahead (decode latency hidden)
  regs      ``table_pf`` with the never-taken branch of ``dispatch`` made 4x larger ([16, 64,
            64] products), so the kernel is compiled at the megakernel's register count

and then the megakernel itself on the same tiles (bench/gemv_probe.py, same flags). Prints
TB/s and GB/s per SM for each rung and writes JSON.

    python bench/gemv_ladder.py [--blocks 16x512:2,16x128:8] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from gemv_stream import time_back_to_back
from lowering.triton.ops import gemv as K

RUNGS = ("plain", "table", "dispatch", "stamps", "table_n", "table_nk", "table_pf", "regs")


@triton.jit
def _row(TAB, t):
    """Tile t's table row: (opcode, W / x / y element offsets, N, K)."""
    row = TAB + t.to(tl.int64) * 8
    return (tl.load(row + 0).to(tl.int32), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4).to(tl.int32), tl.load(row + 5).to(tl.int32))


@triton.jit
def _ladder(A, TAB, PROF, ntiles, Kc, RUNG: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            UNROLL: tl.constexpr, TILE_N: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    # table_pf: the first row loaded before the loop, each next one during the current tile
    p_op, p_wo, p_xo, p_yo, p_n, p_k = _row(TAB, pid)
    for t in range(pid, ntiles, P):
        if RUNG == 0:
            wo = t.to(tl.int64) * TILE_N * Kc
            xo = ntiles.to(tl.int64) * TILE_N * Kc
            yo = ntiles.to(tl.int64) * TILE_N * Kc + Kc + t * TILE_N
            n = TILE_N
            k = Kc
            op = 0
        elif RUNG == 6 or RUNG == 7:
            op, wo, xo, yo, n, k = p_op, p_wo, p_xo, p_yo, p_n, p_k
            p_op, p_wo, p_xo, p_yo, p_n, p_k = _row(TAB, tl.minimum(t + P, ntiles - 1))
            # tl.multiple_of does not stick to loop-carried values: shifts state the alignment
            k = (k >> 4) << 4
            wo = (wo >> 3) << 3
            xo = (xo >> 3) << 3
        else:
            # loaded inline, not through _row: with _row here the table rungs measured ~20%
            # slower (H200, one run; table 2.61 -> 2.08 TB/s), a change of the measured kernel
            row = TAB + t.to(tl.int64) * 8
            op = tl.load(row + 0).to(tl.int32)
            wo = tl.load(row + 1)
            xo = tl.load(row + 2)
            yo = tl.load(row + 3)
            n = tl.load(row + 4).to(tl.int32)
            k = tl.load(row + 5).to(tl.int32)
            if RUNG >= 4:
                n = TILE_N
            if RUNG == 5:
                k = Kc
            # K % 16: gemv_ex's own W_ALIGN = 8 hint on K did not give 16-byte W loads here
            # (sm_90 SASS: scalar loads), the megakernel's table-driven K does get them
            k = tl.multiple_of(k, 16)
            wo = tl.multiple_of(wo, 8)
            xo = tl.multiple_of(xo, 8)
        if RUNG == 3:
            tl.store(PROF + t * 2, K.global_timer())
        if op == 0:
            K.gemv_ex((A + xo, 1, k, 0, 0, 1), (A + xo, 1, k, 0, 0, 1), 0.0,
                      (A + wo, k, 1), (A + yo, 1, n, 0, 0, 1),
                      (A + yo, 1, n, 0, 0, 1), n, k,
                      K.PRO_PLAIN, False, True, True, 8, BN, BK, 1, None, False, 8, UNROLL)
        elif RUNG == 2 or RUNG == 3 or RUNG == 7:
            # never taken (op is 0 everywhere): register pressure like the attention variant
            QB: tl.constexpr = 16 if RUNG == 7 else 4
            qh = tl.arange(0, QB)
            tt = tl.arange(0, 64)
            dd = tl.arange(0, 64)
            q = tl.load(A + xo + qh[:, None] * 64 + dd[None, :]).to(tl.float32)
            kt = tl.load(A + wo + tt[:, None] * 64 + dd[None, :]).to(tl.float32)
            vt = tl.load(A + wo + 4096 + tt[:, None] * 64 + dd[None, :]).to(tl.float32)
            sc = tl.sum(q[:, None, :] * kt[None, :, :], axis=2)
            pr = tl.exp(sc - tl.max(sc, axis=1)[:, None])
            o = tl.sum(pr[:, :, None] * vt[None, :, :], axis=1) / tl.sum(pr, axis=1)[:, None]
            tl.store(A + yo + qh[:, None] * 64 + dd[None, :], o.to(tl.bfloat16))
        if RUNG == 3:
            tl.store(PROF + t * 2 + 1, K.global_timer())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=65536)
    ap.add_argument("--tile", type=int, default=16)
    ap.add_argument("--blocks", default="16x512:2,16x128:8", help="comma list of BNxBK:UNROLL")
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ntiles = a.rows // a.tile
    # arena: W [rows, K] | x [K] | y [rows] (bf16)
    wn = a.rows * a.k
    arena = torch.zeros(wn + a.k + a.rows, device=dev, dtype=torch.bfloat16)
    arena[:wn].normal_()
    arena[wn:wn + a.k].normal_()
    W, x = arena[:wn].view(a.rows, a.k), arena[wn:wn + a.k]
    ref = W.float() @ x.float()
    tab = torch.zeros(ntiles, 8, dtype=torch.int64)
    t = torch.arange(ntiles)
    tab[:, 1] = t * a.tile * a.k
    tab[:, 2] = wn
    tab[:, 3] = wn + a.k + t * a.tile
    tab[:, 4] = a.tile
    tab[:, 5] = a.k
    tab = tab.to(dev)
    prof = torch.zeros(ntiles * 2, dtype=torch.int64, device=dev)
    nbytes = wn * 2
    buf = torch.empty_like(arena[:wn])
    copy_ms = time_back_to_back(lambda: buf.copy_(arena[:wn]))
    hbm = 2 * nbytes / copy_ms / 1e9
    print(f"{torch.cuda.get_device_name(dev)}: W {a.rows}x{a.k} bf16 ({nbytes / 1e6:.0f} MB), "
          f"{a.tile}-row tiles; copy {hbm:.2f} TB/s")
    rows = [dict(name="copy", tbps=hbm)]
    for blk, (ri, rung) in itertools.product(a.blocks.split(","), enumerate(RUNGS)):
        shape, un = blk.split(":")
        bn, bk = (int(v) for v in shape.split("x"))
        arena[wn + a.k:].zero_()
        f = lambda: _ladder[(sms,)](arena, tab, prof, ntiles, a.k, ri, bn, bk, int(un), a.tile,  # noqa: E731
                                    num_warps=a.warps)
        try:
            f()
            torch.cuda.synchronize()
            ok = bool(torch.allclose(arena[wn + a.k:].float(), ref, rtol=2e-2, atol=2e-1))
            ms = time_back_to_back(f)
        except Exception as e:  # a rung that does not compile or launch: report, go on
            print(f"  {blk:<10} {rung:<9} {type(e).__name__}: {e}")
            continue
        r = dict(name=rung, block=blk, ms=ms, tbps=nbytes / ms / 1e9,
                 gbps_per_sm=nbytes / ms / 1e6 / sms, correct=ok)
        rows.append(r)
        print(f"  {blk:<10} {rung:<9} {r['tbps']:.2f} TB/s ({r['gbps_per_sm']:.1f} GB/s per SM) correct={ok}",
              flush=True)
    if a.json:
        from ground.files import atomic_write_text  # whole file or none

        atomic_write_text(a.json, json.dumps(dict(device=torch.cuda.get_device_name(dev), k=a.k, rows=a.rows,
                                                  tile=a.tile, warps=a.warps, command=" ".join(sys.argv),
                                                  results=rows), indent=1))
    return 0


if __name__ == "__main__":
    from ground.errors import run_main

    run_main(main, "bench/gemv_ladder.py")  # an AmkError: one line, its exit code
