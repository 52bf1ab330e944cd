"""The weight ring (lowering/triton/ring.py): GEMV weights streamed through shared-memory
pages ahead of the tasks that use them.

CPU: the page order, the stream list the table derives from a program, the ring's knob checks,
the interpreter's run of ring GEMVs against the sim backend, and an offline sm_90 compile
with the GPU machines' Triton (AMK_DEVICE_TRITON). GPU: the compiled ring against the sim.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lowering.sim import SimExecutor
from lowering.triton import TritonExecutor, TritonError
from lowering.triton import ring as RG
from lowering.triton import table as T
from lowering.triton.ops.gemv import ROLES as GEMV
from lowering.triton.runtime import Blocks
from tests.test_triton_megakernel import ROOT, TOKENS, cpu_only, decodes_alike, gpu, lowered


def test_page_order_covers_the_tile_once():
    """Pages run over row blocks, then column blocks, and cover W[n, k] exactly once."""
    for n, k, pr, pc in ((16, 2048, 4, 2048), (13, 8192, 4, 2048), (5, 576, 4, 2048), (7, 100, 2, 32)):
        pages = RG.page_order(n, k, pr, pc)
        seen = torch.zeros(n, k, dtype=torch.int32)
        for r0, c0, rows, cols in pages:
            assert 0 < rows <= pr and 0 < cols <= pc
            seen[r0:r0 + rows, c0:c0 + cols] += 1
        assert bool((seen == 1).all())
        assert [p[:2] for p in pages] == sorted(p[:2] for p in pages)  # rows outer, columns inner


def test_ring_knobs_are_checked():
    """Blocks refuses ring sizes and page shapes the kernel cannot use, with the field named."""
    for bad, name in ((dict(ring=-1), "ring"), (dict(ring=33), "ring"), (dict(ring_rows=3), "ring_rows"),
                      (dict(ring_cols=4), "ring_cols"), (dict(ring_cols=3000), "ring_cols")):
        with pytest.raises(TritonError, match=name):
            Blocks(**bad)
    b = Blocks(ring=12, ring_rows=4, ring_cols=2048)
    assert b.ring_page == 16384 and RG.ring_smem(12, b.ring_page) == 12 * 16384 + 96


def _table(ring: bool, dtype: str = "bf16"):
    prog, init, _ = lowered("tiny-llama", workers=3, dtype=dtype, fuse=True)
    q = prog.queues()
    tab = T.build_table(prog, 0, [q.get((0, w), []) for w in range(prog.workers)], reuse_x=True, ring=ring)
    return prog, tab


def test_stream_list_lists_every_ring_gemv_in_queue_order():
    """With ring on, every bf16 GEMV of the fused tiny Llama (weights only read) is a ``ring``
    variant, and the stream list has one entry per such row, per worker in queue order, with
    the W tile's byte offset, shape and row stride from the row's operand fields."""
    prog, tab = _table(True)
    ring_ops = {i for i, v in enumerate(tab.variants) if v.flag("ring")}
    assert ring_ops and {tab.variants[i].op for i in ring_ops} >= {"norm_gemv", "gemv_res", "swiglu_gemv"}
    streams, sstart = T.stream_list(tab)
    assert len(sstart) == tab.workers + 1 and sstart[0] == 0
    k = 0
    for w in range(tab.workers):
        for i in range(int(tab.qstart[w]), int(tab.qstart[w + 1])):
            if int(tab.rows[i, T.F_OP]) not in ring_ops:
                continue
            wi = GEMV[tab.task_ops[i]].w
            f = tab.rows[i, T.F_OPND + wi * T.OPND_W:T.F_OPND + (wi + 1) * T.OPND_W]
            off, rs, nk, _ = (int(x) for x in streams[k])
            n, kk = nk >> 32, nk & 0xFFFFFFFF
            assert (off, n, kk) == (int(f[0]) * 2, int(f[3]), int(f[4]))
            assert off % 16 == 0 and rs % 16 == 0 and kk % 8 == 0
            k += 1
        assert sstart[w + 1] == k
    # without the ring (or with f32 weights) nothing streams
    assert not any(v.flag("ring") for v in _table(False)[1].variants)
    assert not any(v.flag("ring") for v in _table(True, "f32")[1].variants)


def test_staged_x_reuse_keeps_ring_and_register_stagers_apart():
    """A ring GEMV stages f(x) as fp32 and the register GEMVs in x's dtype: a task reuses only
    the scratch of a task of its own kind (same op and inputs otherwise)."""
    prog, _ = _table(True)
    q = prog.queues()[(0, 0)]
    staged = {op for op, g in GEMV.items() if g.staged}
    stagers = [t for t in q if t.op in staged]
    assert stagers
    gemvs = [t for t in q if t.op in GEMV]
    ids = frozenset(t.id for t in gemvs)
    mixed = frozenset(t.id for t in gemvs[1::2])  # every other GEMV on the ring
    plain, all_ring, half = (T.staged_x_reuse(q, 1, r) for r in (frozenset(), ids, mixed))
    assert any(plain) and any(all_ring)
    for i, t in enumerate(q):
        if half[i]:  # reused: the last staging task before it is of the same kind
            prev = next(u for u in reversed(q[:i]) if u.op in staged or u.id in mixed)
            assert (prev.id in mixed) == (t.id in mixed)


@cpu_only
@pytest.mark.parametrize("rows,cols", [(4, 32), (2, 2048)])
def test_ring_gemvs_match_sim_under_the_interpreter(rows, cols):
    """The ring GEMV's page loop (pages of rows x cols over the fused bf16 tiny Llama's tiles:
    K > cols gives several column pages per row block, K <= cols one), its fp32 staging of
    every prologue (plain x included) and its epilogue reproduce the sim backend."""
    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True)
    ex = TritonExecutor(prog, init, check=False, blocks=Blocks(ring=3, ring_rows=rows, ring_cols=cols))
    assert ex.ring_pages == 3 and int(ex._sstart[-1]) > 0
    sim = SimExecutor(prog, init, check=False, policy="random", seed=2)
    decodes_alike(ex, sim, TOKENS[:2], rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not os.environ.get("AMK_DEVICE_TRITON"),
                    reason="AMK_DEVICE_TRITON (a folder holding the GPU machines' Triton, .ci/run installs 3.6) unset")
def test_device_triton_compiles_the_ring(tmp_path):
    """With the GPU machines' Triton (3.6), the ring compiles for sm_90: bulk copies into shared
    memory completing on mbarriers, parity waits, 16-byte shared loads of the pages, the
    staged x as 16-byte loads, and no spills (fused bf16 tiny Llama, 8 warps, 8 pages)."""
    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True)
    ex = TritonExecutor(prog, init, check=False, num_warps=8, blocks=Blocks(ring=8))
    src = ex.emit_source(tmp_path / "kernel.py")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([os.environ["AMK_DEVICE_TRITON"], str(ROOT)]))
    code = ("import sys, json; from lowering.triton.offline import compile_offline, launch_meta; "
            "src = open(sys.argv[1]).read(); cx, warps, _ = launch_meta(src); "
            "print(json.dumps(compile_offline(src, cx, 90, warps)))")
    res = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["ring_copies"] and rep["ring_waits"] and rep["ring_page_loads"], rep
    if rep["regs"] is not None:
        assert rep["regs"] <= 255 and rep["local_bytes"] == 0, rep


@gpu
@pytest.mark.parametrize("rows,cols", [(4, 32), (4, 2048)])
def test_gpu_ring_matches_sim(rows, cols):
    """The compiled ring (4 workers, 6 pages of rows x cols, bf16 fused tiny Llama with
    ragged tiles) matches the sim backend for 12 steps, and the launch holds the ring's shared
    memory past the kernel's own."""
    prog, init, _ = lowered("tiny-llama", workers=4, dtype="bf16", max_seq=64, tile=32, fuse=True)
    ex = TritonExecutor(prog, init, check=False, num_warps=8, blocks=Blocks(ring=6, ring_rows=rows, ring_cols=cols))
    sim = SimExecutor(prog, init, check=False, policy="random", seed=2)
    tokens = TOKENS + [11, 3, 40, 7, 1, 100, 23]
    decodes_alike(ex, sim, tokens, rtol=2e-2, atol=2e-2)
    assert ex.occupancy["shared"] >= RG.ring_smem(6, rows * cols * 2)
    assert "cp.async.bulk.shared" in ex.compiled.asm["ptx"]
