"""The ``gemm`` op on the Triton backend (lowering/triton/ops/gemm.py) and the op shapes the
collective patterns need there: the standalone kernel against lowering/reference.py (M < 16,
M == 1 and N == 1 tiles, strided operands, f32 / bf16 / f16, a residual), ``reduce`` over
3-D partials, ``rmsnorm`` over strided rows and ``copy`` into a column block; the megakernel
(every rank co-located in one process) against the sim on the programs of
tests/test_gemm.py; the table's views, flags and refusals; and the offline sm_90 compile of
a bf16 gemm program (tl.dot inside the VM) with this machine's Triton and with the GPU
machines' (AMK_DEVICE_TRITON).

Runs on the CPU under ``TRITON_INTERPRET=1`` (set by ``lowering.triton`` without a GPU);
the ``gpu``-marked parametrisations run compiled on a CUDA device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from ir.builder import ProgramBuilder, parse_region
from lowering.reference import apply_op
from lowering.sim import SimExecutor
from lowering.triton import TritonExecutor
from lowering.triton import standalone as O
from lowering.triton import table as T
from lowering.triton.blocks import Blocks
from lowering.triton.errors import TritonError
from lowering.triton.lang import interpreting
from tests.test_gemm import gemm_tiles_program, reduce_scatter_program, seeded_init, ulysses_program

ROOT = Path(__file__).resolve().parents[1]
INTERP = interpreting()
DEV = "cpu" if INTERP else "cuda"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERP, reason="interpreter mode not active")),
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(INTERP or not torch.cuda.is_available(),
                                                   reason="needs compiled Triton on a CUDA GPU")]),
]
needs_device = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                  reason="needs the interpreter or a CUDA GPU")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def ref(op, ins, outs_like, params=None):
    """reference.apply_op on CPU copies; returns the outputs."""
    ins = [t.detach().cpu().clone() for t in ins]
    outs = [torch.empty(o.shape, dtype=o.dtype) for o in outs_like]
    apply_op(op, params or {}, ins, outs)
    return outs


def close(got, want, dtype):
    """fp32: summation order only; bf16 / f16: one rounding of the same fp32 value, so at
    most one unit in the last place apart."""
    tol = {F32: (2e-5, 2e-5), F16: (2e-3, 2e-3), BF16: (1.6e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(got.detach().cpu().float(), want.float(), rtol=tol[0], atol=tol[1])


# ---------------------------------------------------------------- the standalone kernel
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dt", [F32, BF16, F16])
def test_gemm_tiles_against_the_reference(device, dt):
    """16 x 16 x 16 blocks over tiles that need several blocks and masked edges: M = 5 < 16,
    M = 1, N = 1, K not a multiple of 16; a column block of a weight, a transposed
    (column-strided) b, an output column block, a residual."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 70, generator=g).to(dt).to(device)
    w = torch.randn(70, 90, generator=g).to(dt).to(device)
    wt = torch.randn(50, 70, generator=g).to(dt).to(device)  # b = wt.T: column stride 70
    r = torch.randn(37, 90, generator=g).to(dt).to(device)
    cases = [
        (x[0:5, 0:70], w[:, 10:43], None),           # M < 16, a column block of w
        (x[3:4, 0:70], w[:, 0:90], r[3:4]),          # M == 1, with a residual
        (x[0:37, 0:70], w[:, 7:8], r[:, 7:8]),       # N == 1
        (x[0:20, 5:38], wt.T[5:38, 0:50], None),     # strided a and b (b's columns stride 70)
    ]
    for a, b, res in cases:
        big = torch.full((a.shape[0], b.shape[1] + 6), float("nan"), dtype=dt, device=device)
        y = big[:, 3:3 + b.shape[1]]  # a column block: row stride != N
        O.run_gemm(a, b, y, res, block_m=16, block_n=16, block_k=16)
        (want,) = ref("gemm", [a, b] + ([res] if res is not None else []), [y])
        close(y, want, dt)
        assert big[:, :3].isnan().all() and big[:, 3 + b.shape[1]:].isnan().all()  # nothing outside y


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_mixed_dtypes_multiply_in_fp32(device):
    """a bf16 and b f32 (and an f32 output): both converted to fp32, the exact product."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 24, generator=g).to(BF16).to(device)
    b = torch.randn(24, 8, generator=g).to(device)
    y = torch.empty(4, 8, device=device)
    O.run_gemm(a, b, y, block_m=16, block_n=16, block_k=16)
    (want,) = ref("gemm", [a, b], [y])
    close(y, want, F32)


def test_run_gemm_refuses_operands_that_do_not_fit():
    with pytest.raises(ValueError, match=r"run_gemm: a \(4, 8\) @ b \(7, 3\) -> y \(4, 3\) do not fit"):
        O.run_gemm(torch.zeros(4, 8), torch.zeros(7, 3), torch.zeros(4, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_reduce_of_3d_partials_rmsnorm_rows_and_column_block_copy(device):
    """reduce over partials [k, rows, C] (a column block: each partial two strided axes)
    with a residual; rmsnorm per row of a strided [rows, C] region; copy into a column
    block G[rows, c0:c1]."""
    g = torch.Generator().manual_seed(2)
    P = torch.randn(3, 4, 20, generator=g).to(device)
    part = P[:, 1:4, 4:12]  # [k=3, rows=3, C=8], row stride 20
    res = torch.randn(3, 8, generator=g).to(device)
    y = torch.empty(3, 8, device=device)
    O.run_reduce(part, y, residual=res, block=16)
    (want,) = ref("reduce", [part, res], [y])
    assert torch.equal(y.cpu(), want)  # index-order fp32 sum, as the reference
    X = torch.randn(3, 20, generator=g).to(device)
    wn = torch.randn(8, generator=g).to(device)
    z = torch.full((3, 20), float("nan"), device=device)
    O.run_rmsnorm(X[:, 6:14], wn, z[:, 2:10], dim=8, eps=1e-5, block=8)
    (want,) = ref("rmsnorm", [X[:, 6:14], wn], [z[:, 2:10]], {"dim": 8, "eps": 1e-5})
    close(z[:, 2:10], want, F32)
    assert z[:, :2].isnan().all() and z[:, 10:].isnan().all()
    G = torch.full((3, 24), float("nan"), device=device)
    O.run_copy(X[:, 0:8], G[:, 8:16], block=16)
    assert torch.equal(G[:, 8:16].cpu(), X[:, 0:8].cpu()) and G[:, :8].isnan().all() and G[:, 16:].isnan().all()


# ---------------------------------------------------------------- the megakernel against the sim
def _agree(prog, steps: int = 2):
    """Run ``prog`` on the Triton backend (co-located ranks) and the sim for ``steps`` steps
    with the same seeded inputs; every io_output agrees (up to fp32 summation order and one
    rounding)."""
    init, _ = seeded_init(prog)
    ex = TritonExecutor(prog, init, check=False, device=DEV)
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    outs = [(b.name, r) for b in prog.buffers if b.kind == "io_output"
            for r in (range(prog.ranks) if b.placement == "symmetric" else [b.rank])]
    for e in range(steps):
        ex.step(e)
        sim.step(e)
        for name, r in outs:
            got = ex.read(name, r)
            close(got, sim.read(name, r), got.dtype)
    return ex


@needs_device
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_megakernel_gemm_tiles_match_the_sim(dtype):
    """The M == 1, N == 1 (+ residual) and plain tiles of tests/test_gemm.py in the
    megakernel: the table splits each operand by the op's K / N, so the [5, 1] and [12, 1]
    tiles keep their one column."""
    ex = _agree(gemm_tiles_program(dtype))
    assert sorted(v.flag("residual") for v in ex.table.variants) == [False, True]
    # K = 12 columns of a are 16-byte rows in f32 only; b's N = 2 and 1 never are
    assert all(v.flag("acontig") and v.flag("bcontig") and v.flag("aaligned") == (dtype == "f32")
               and not v.flag("baligned") for v in ex.table.variants)
    i = ex.table.task_ids.index("g.n1")
    row = ex.table.rows[i]
    b = row[T.F_OPND + 1 * T.OPND_W:T.F_OPND + 2 * T.OPND_W]  # w[0:12, 2:3]: [K=12, N=1], row stride 3
    assert list(b[2:5]) == [1, 12, 1] and b[6] == 3
    assert (ex._launch_kw["GEMM_M"], ex._launch_kw["GEMM_N"], ex._launch_kw["GEMM_K"]) == (16, 16, 16)


@needs_device
@pytest.mark.parametrize("ranks,dtype", [(2, "f32"), (3, "bf16")])
def test_megakernel_ulysses_layout_matches_the_sim(ranks, dtype):
    """put / copy into column blocks of G on co-located ranks, gemm over G, rmsnorm over
    strided rows."""
    ex = _agree(ulysses_program(ranks=ranks, dtype=dtype))
    assert {"put", "copy", "gemm", "rmsnorm"} <= {v.op for v in ex.table.variants}


@needs_device
@pytest.mark.parametrize("ranks,dtype,pad", [(2, "f32", 0), (3, "bf16", 0), (2, "f32", 4)])
def test_megakernel_reduce_of_3d_partials_matches_the_sim(ranks, dtype, pad):
    """One reduce over P[0:k, 0:rows, 0:n] (+ residual): contiguous partial rows take the
    16-byte ``vec`` path; with ``pad`` columns in P each partial is a strided [rows, n] box
    (the generic path, two strided axes per partial)."""
    ex = _agree(_padded_rs(ranks, dtype, pad))
    (red,) = [v for v in ex.table.variants if v.op == "reduce"]
    assert red.flag("vec") == (pad == 0) and red.flag("residual")
    i = ex.table.task_ids.index("sum.r0")
    p = ex.table.rows[i][T.F_OPND:T.F_OPND + T.OPND_W]  # partials: [k, rows, n] -> n0 = k
    assert p[2] == ranks and p[3] * p[4] == 2 * 8


def _padded_rs(ranks: int, dtype: str, pad: int):
    """reduce_scatter_program with ``pad`` more columns in the staging buffer P."""
    prog = reduce_scatter_program(ranks=ranks, m=2 * ranks, dtype=dtype)
    if pad:
        prog.buffers = [dataclasses.replace(b, shape=(*b.shape[:-1], b.shape[-1] + pad)) if b.name == "P" else b
                        for b in prog.buffers]
    return prog


def _gemm_program(m: int, k: int, n: int, tiles: int, dtype: str = "bf16", workers: int = 2):
    """y[m, tiles * n] = x[m, k] @ w[k, tiles * n] in ``tiles`` column tiles of n."""
    b = ProgramBuilder(f"gemm-{m}x{k}x{n}-{dtype}", ranks=1, workers=workers)
    b.buffer("x", "io_input", dtype, (m, k))
    b.buffer("w", "weight", dtype, (k, tiles * n))
    b.buffer("y", "io_output", dtype, (m, tiles * n))
    for j in range(tiles):
        cols = f"{j * n}:{(j + 1) * n}"
        b.task(f"g{j}", 0, j % workers, "gemm", ins=[f"x[0:{m}, 0:{k}]", f"w[0:{k}, {cols}]"], outs=[f"y[0:{m}, {cols}]"])
    return b.build()


@needs_device
def test_megakernel_gemm_blocks_follow_the_tiles():
    """GEMM_M / GEMM_N / GEMM_K: the smallest power of two >= 16 covering the largest tile, at
    most the Blocks' sizes; the tile is walked in blocks when it is larger (here 40 x 48 x
    80 tiles in 32 x 32 x 32 blocks, bf16, 16-byte aligned operands)."""
    prog = _gemm_program(40, 80, 48, 2)
    init, _ = seeded_init(prog)
    ex = TritonExecutor(prog, init, check=False, device=DEV, blocks=Blocks(gemm_m=32, gemm_n=32, gemm_k=32))
    assert (ex._launch_kw["GEMM_M"], ex._launch_kw["GEMM_N"], ex._launch_kw["GEMM_K"]) == (32, 32, 32)
    (v,) = ex.table.variants
    assert v.flag("aaligned") and v.flag("baligned")
    ex.step(0)
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    sim.step(0)
    close(ex.read("y", 0), sim.read("y", 0), BF16)
    assert Blocks().gemm_blocks({"gemm_m": 4, "gemm_n": 100, "gemm_k": 256}) == (16, 64, 64)
    assert Blocks(gemm_k=128).gemm_blocks({"gemm_m": 33, "gemm_n": 1, "gemm_k": 100}) == (64, 16, 128)


def test_blocks_refuse_a_gemm_block_that_is_not_a_power_of_two():
    for bad in (24, 8, 0):
        with pytest.raises(TritonError) as e:
            Blocks(gemm_n=bad)
        assert str(e.value) == f"Blocks.gemm_n must be a power of two >= 16 (tl.dot's smallest block), got {bad}"
        assert e.value.exit_code == 2


def test_table_refuses_a_gemm_writing_its_own_input():
    """The kernel reads a and b while it writes y: an overlap is a TableError naming the task."""
    prog = gemm_tiles_program()
    t = prog.tasks[1]
    prog.tasks[1] = dataclasses.replace(t, outs=(parse_region("x[1:5, 0:2]", 0),))
    with pytest.raises(T.TableError, match=r"task g.rest: output x\[.*overlaps input x.*disjoint inputs and outputs"):
        TritonExecutor(prog, None, check=False, device=DEV)


def test_table_refuses_a_mismatched_gemm_in_one_line():
    prog = gemm_tiles_program()
    prog.tasks[0] = dataclasses.replace(prog.tasks[0], outs=(parse_region("y[0:1, 0:3]", 0),))
    with pytest.raises(T.TableError) as e:
        TritonExecutor(prog, None, check=False, device=DEV)
    assert str(e.value) == ("task g.m1: gemm: a [12] @ b [12, 2] -> y [3]: no M, K, N give a [M, K] "
                            "(12 elements), b [K, N] (24), y [M, N] (3)")


def test_describe_region_splits_a_matrix_by_the_columns_the_op_reads():
    """A [K, 1] column of a weight keeps its column (split 1); without the split the region
    squeezes to one row; a region with no trailing axes of the split's size is refused."""
    from ir.program import Buffer
    from lowering.triton.layout import TableError, describe_region

    w = Buffer("w", "weight", "f32", (12, 3), "local", 0, None)
    col = parse_region("w[0:12, 2:3]", 0)
    assert describe_region(col, w, "matrix", 1, "t", 1).n == (1, 12, 1)
    assert describe_region(col, w, "matrix", 1, "t").n == (1, 1, 12)
    P = Buffer("P", "activation", "f32", (3, 4, 20), "local", 0, None)
    box = parse_region("P[0:3, 1:4, 4:12]", 0)
    d = describe_region(box, P, "partials", 1, "t", 24)
    assert (d.n, d.s) == ((3, 3, 8), (80, 20, 1))
    with pytest.raises(TableError, match="t: region of P with shape .3, 3, 8. has no trailing axes holding 16"):
        describe_region(box, P, "partials", 1, "t", 16)


# ---------------------------------------------------------------- offline sm_90 compile
@pytest.mark.skipif(not INTERP, reason="the offline compile runs where the tests use the interpreter")
@pytest.mark.parametrize("triton_path", ["local", "device"])
def test_gemm_compiles_to_tensor_cores_for_sm90(tmp_path, triton_path):
    """A bf16 gemm program (64 x 64 tiles, K = 256, two workers) compiled offline for sm_90:
    tl.dot inside the VM's dispatch lowers to tensor-core instructions (Hopper wgmma or
    mma.sync), the aligned operands stream through cp.async, and nothing spills.
    ``device``: with the GPU machines' Triton (AMK_DEVICE_TRITON, 3.6)."""
    if triton_path == "device" and not os.environ.get("AMK_DEVICE_TRITON"):
        pytest.skip("AMK_DEVICE_TRITON (the GPU machines' Triton, .ci/run installs 3.6) unset")
    ex = TritonExecutor(_gemm_program(64, 256, 64, 2), None, check=False, device=DEV)
    assert (ex._launch_kw["GEMM_M"], ex._launch_kw["GEMM_N"], ex._launch_kw["GEMM_K"]) == (64, 64, 64)
    (v,) = ex.table.variants
    assert v.flag("aaligned") and v.flag("baligned")
    src = ex.emit_source(tmp_path / "kernel.py")
    path = [os.environ["AMK_DEVICE_TRITON"]] if triton_path == "device" else []
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([*path, str(ROOT)]))
    code = ("import sys, json, triton; from lowering.triton.offline import main; "
            "print(json.dumps({'triton': triton.__version__})); sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", code, str(src), "--arch", "90"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.strip().splitlines()
    version, rep = json.loads(lines[0])["triton"], json.loads(lines[-1])
    assert rep["wgmma"] + rep["mma_sync"] > 0 and rep["async_copy"], (version, rep)
    if rep["regs"] is not None:
        assert rep["regs"] <= 255 and rep["local_bytes"] == 0, (version, rep)
