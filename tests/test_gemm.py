"""The ``gemm`` op (y = a @ b (+ r), fp32 accumulation) and the op shapes the collective
patterns need: its shape check on squeezed shapes (M == 1 and N == 1 tiles, a transposed or
mismatched operand named in one line), its reference math, the validator and ``amk
validate`` on programs that use it, and on the sim: gemm tiles over row and column blocks,
``reduce`` of partials ``[k, rows, N]`` into ``y[rows, N]`` with a residual, ``rmsnorm`` over
each row of a strided ``[rows, N]`` region, and ``put`` / ``copy`` into a column block
``G[rows, c0:c1]`` of a row-major buffer (the Ulysses layout).

The program builders here are shared with tests/test_triton_gemm.py, which runs the same
programs on the Triton backend against the sim.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ir.builder import ProgramBuilder, parse_region
from ir.io import save_program
from ir.ops import OPS, gemm_dims, squeeze
from ir.program import ScheduleProgram
from lowering.reference import ReferenceOpError, apply_op, torch_dtype
from lowering.sim import SimExecutor, SimTaskError
from validator import validate

ROOT = Path(__file__).resolve().parents[1]


def check(a, b, y, r=None, dtypes=("f32", "f32", "f32")):
    """gemm's OpSpec check on unsqueezed region shapes (squeezed here, as the validator does)."""
    ins = [squeeze(a), squeeze(b)] + ([squeeze(r)] if r is not None else [])
    ind = list(dtypes[:2]) + ([dtypes[0]] if r is not None else [])
    return OPS["gemm"].check(ins, ind, [squeeze(y)], [dtypes[2]], {})


# ---------------------------------------------------------------- the shape check
@pytest.mark.parametrize("a,b,y", [
    ((4, 32), (32, 16), (4, 16)),     # a full tile
    ((1, 32), (32, 16), (1, 16)),     # M == 1: a and y squeeze to vectors
    ((4, 32), (32, 1), (4, 1)),       # N == 1: b and y squeeze to vectors
    ((1, 32), (32, 1), (1, 1)),       # a dot product: y squeezes to ()
    ((4, 1), (1, 16), (4, 16)),       # K == 1: an outer product
    ((1, 1, 4, 32), (32, 16), (4, 16)),  # a region of a 4-D buffer with unit leading axes
])
def test_gemm_check_accepts_every_tile_shape(a, b, y):
    assert check(a, b, y) == []
    assert check(a, b, y, r=y) == []


@pytest.mark.parametrize("a,b,y,r,needle", [
    ((4, 32), (16, 16), (4, 16), None,
     "gemm: a [4, 32] @ b [16, 16] -> y [4, 16]: a has K=32 columns, b has K=16 rows"),
    ((4, 32), (16, 32), (4, 16), None,
     "gemm: a [4, 32] @ b [16, 32] -> y [4, 16]: a has K=32 columns, b has K=16 rows"),
    ((32, 4), (32, 16), (4, 16), None, "gemm: a [32, 4] @ b [32, 16] -> y [4, 16]: a has K=4 columns"),
    ((4, 32), (32, 16), (16, 4), None,
     "gemm: y is [16, 4], expected [4, 16] (M=4, K=32, N=16 from a [4, 32] @ b [32, 16] -> y [16, 4]; "
     "axes of extent 1 dropped)"),
    ((4, 32), (32, 16), (4, 16), (16, 4), "gemm: r is [16, 4], expected [4, 16]"),
    ((4, 32), (32, 16), (4, 8), None, "gemm: y is [4, 8], expected [4, 16]"),
    ((1, 32), (32, 16), (1, 15), None, "gemm: a [32] @ b [32, 16] -> y [15]: no M, K, N give"),
    ((1, 32), (16, 32), (1, 16), None, "gemm: b is [16, 32], expected [32, 16] (M=1, K=32, N=16"),
    ((1, 16), (32, 16), (1, 32), None, "gemm: b is [32, 16], expected [16, 32] (M=1, K=16, N=32"),
])
def test_gemm_check_names_the_mismatch_in_one_line(a, b, y, r, needle):
    errs = check(a, b, y, r=r)
    assert len(errs) == 1 and "\n" not in errs[0], errs
    assert errs[0].startswith(needle), errs


def test_gemm_dims_from_element_counts():
    assert gemm_dims(4 * 32, 32 * 16, 4 * 16) == (4, 32, 16)
    assert gemm_dims(32, 32, 1) == (1, 32, 1)
    assert gemm_dims(4, 16, 64) == (4, 1, 16)
    assert gemm_dims(4 * 32, 32 * 16, 63) is None and gemm_dims(0, 4, 4) is None


def test_reduce_check_accepts_3d_partials_and_refuses_a_wrong_row():
    spec = OPS["reduce"]
    ok = [((2, 3, 8), (3, 8)), ((2, 3, 8), (24,)), ((2, 16), (16,)), ((3, 8), (3, 8))]
    for part, y in ok:
        assert spec.check([part], ["f32"], [y], ["f32"], {}) == [], (part, y)
        assert spec.check([part, y], ["f32"] * 2, [y], ["f32"], {}) == [], (part, y)
    assert spec.check([(2, 3, 8)], ["f32"], [(3, 7)], ["f32"], {}) == [
        "reduce: partials (2, 3, 8) are not [k, ...] with 21 elements (the output's) after the first axis"]
    assert spec.check([(2, 16)], ["f32"], [(8,)], ["f32"], {}) == ["reduce: partials have width 16, output 8"]
    assert spec.check([(2, 3, 8), (3, 4)], ["f32"] * 2, [(3, 8)], ["f32"], {}) == [
        "reduce: residual has 12 elements, output 24"]


# ---------------------------------------------------------------- reference math
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gemm_reference_is_one_fp32_matmul_rounded_once(dtype):
    g = torch.Generator().manual_seed(0)
    dt = torch_dtype(dtype)
    a = torch.randn(6, 40, generator=g).to(dt)
    b = torch.randn(40, 12, generator=g).to(dt)
    r = torch.randn(6, 12, generator=g).to(dt)
    want = (a.float() @ b.float() + r.float()).to(dt)
    y = torch.full((6, 12), float("nan"), dtype=dt)
    apply_op("gemm", {}, [a, b, r], [y])
    assert torch.equal(y, want)
    # strided operands: a column block of a weight, a column block of the output
    big_b = torch.randn(40, 30, generator=g).to(dt)
    big_y = torch.zeros(6, 30, dtype=dt)
    apply_op("gemm", {}, [a, big_b[:, 8:20]], [big_y[:, 8:20]])
    assert torch.equal(big_y[:, 8:20], (a.float() @ big_b[:, 8:20].float()).to(dt))
    assert not big_y[:, :8].any() and not big_y[:, 20:].any()
    # M == 1 and N == 1 tiles as [1, K] / [K, 1] regions
    y1 = torch.zeros(1, 1, dtype=dt)
    apply_op("gemm", {}, [a[2:3], b[:, 5:6]], [y1])
    assert torch.equal(y1, (a[2:3].float() @ b[:, 5:6].float()).to(dt))
    with pytest.raises(ReferenceOpError, match="gemm: a"):
        apply_op("gemm", {}, [a, b], [torch.zeros(6, 11)])


# ---------------------------------------------------------------- programs
def gemm_tiles_program(dtype: str = "f32") -> ScheduleProgram:
    """One rank, one worker: y[5, 3] = x[5, 12] @ w[12, 3] (+ r in the last column) as three
    tiles: an M == 1 tile (row 0, columns 0:2), the other rows of those columns, and an N == 1
    tile (column 2, all rows, with the residual); the w columns are column blocks of a
    weight, the tiles' outputs column blocks of y."""
    b = ProgramBuilder(f"gemm-tiles-{dtype}", ranks=1, workers=1)
    b.buffer("x", "io_input", dtype, (5, 12))
    b.buffer("w", "weight", dtype, (12, 3))
    b.buffer("r", "io_input", dtype, (5, 3))
    b.buffer("y", "io_output", dtype, (5, 3))
    b.task("g.m1", 0, 0, "gemm", ins=["x[0:1, 0:12]", "w[0:12, 0:2]"], outs=["y[0:1, 0:2]"])
    b.task("g.rest", 0, 0, "gemm", ins=["x[1:5, 0:12]", "w[0:12, 0:2]"], outs=["y[1:5, 0:2]"])
    b.task("g.n1", 0, 0, "gemm", ins=["x[0:5, 0:12]", "w[0:12, 2:3]", "r[0:5, 2:3]"], outs=["y[0:5, 2:3]"])
    return b.build()


def gemm_tiles_want(vals) -> torch.Tensor:
    """The expected y of gemm_tiles_program (fp32 math), before its rounding to y's dtype."""
    x, w, r = (vals[(n, 0)] for n in ("x", "w", "r"))
    y = x.float() @ w.float()
    y[:, 2] += r[:, 2].float()
    return y


def seeded_init(prog: ScheduleProgram, seed: int = 0):
    """Seeded normal contents for every input and weight buffer of ``prog`` (in its dtype);
    returns (init_fn, {(buffer, rank): tensor})."""
    g = torch.Generator().manual_seed(seed)
    vals = {}
    for buf in prog.buffers:
        if buf.kind not in ("io_input", "weight"):
            continue
        ranks = range(prog.ranks) if buf.placement == "symmetric" else [buf.rank]
        for rank in ranks:
            vals[(buf.name, rank)] = torch.randn(buf.shape, generator=g).to(torch_dtype(buf.dtype))

    def init_fn(buf, rank):
        return vals.get((buf.name, rank))

    return init_fn, vals


def ulysses_program(ranks: int = 2, rows: int = 2, c: int = 8, n: int = 16, dtype: str = "f32",
                    eps: float = 1e-5) -> ScheduleProgram:
    """The Ulysses combine on ``ranks`` ranks: rank r puts rows j*rows.. of its o[ranks*rows, c]
    into rank j's G[rows, ranks*c] at columns r*c.. (its own block by ``copy``), each with a
    signal to rank j; rank j's gemm tiles multiply G by w[ranks*c, n] in two column blocks of
    n/2 (y[rows, n]), and an rmsnorm over each row of each column block (dim n/2, a strided
    [rows, n/2] region) writes z. Credits: a writer waits for the readers' previous step."""
    K, half = ranks * c, n // 2
    b = ProgramBuilder(f"ulysses-{ranks}r-{dtype}", ranks=ranks, workers=1)
    b.buffer("G", "activation", dtype, (rows, K), placement="symmetric")
    for r in range(ranks):
        b.buffer(f"o.r{r}", "io_input", dtype, (ranks * rows, c), rank=r)
        b.buffer(f"w.r{r}", "weight", dtype, (K, n), rank=r)
        b.buffer(f"nw.r{r}", "weight", dtype, (half,), rank=r)
        b.buffer(f"y.r{r}", "activation", dtype, (rows, n), rank=r)
        b.buffer(f"z.r{r}", "io_output", dtype, (rows, n), rank=r)
        b.counter(f"c.g.r{r}", rank=r)
        b.counter(f"c.cr.r{r}", rank=r)
    for r in range(ranks):
        for j in range(ranks):
            src = f"o.r{r}[{j * rows}:{(j + 1) * rows}, 0:{c}]"
            dst = f"G@{j}[0:{rows}, {r * c}:{(r + 1) * c}]"
            b.task(f"send.r{r}.to{j}", r, 0, "copy" if j == r else "put", ins=[src], outs=[dst],
                   waits=[f"c.cr.r{r}>={ranks}@prev"], signals=[f"c.g.r{j}+=1"])
        for h in range(2):
            cols = f"{h * half}:{(h + 1) * half}"
            b.task(f"gemm.r{r}.n{h}", r, 0, "gemm", ins=[f"G[0:{rows}, 0:{K}]", f"w.r{r}[0:{K}, {cols}]"],
                   outs=[f"y.r{r}[0:{rows}, {cols}]"], waits=[f"c.g.r{r}>={ranks}"])
        b.task(f"credit.r{r}", r, 0, "nop", signals=[f"c.cr.r{p}+=1" for p in range(ranks)])
        for h in range(2):
            cols = f"{h * half}:{(h + 1) * half}"
            b.task(f"norm.r{r}.n{h}", r, 0, "rmsnorm", ins=[f"y.r{r}[0:{rows}, {cols}]", f"nw.r{r}[0:{half}]"],
                   outs=[f"z.r{r}[0:{rows}, {cols}]"], params={"dim": half, "eps": eps})
    return b.build()


def ulysses_want(vals, ranks: int, rows: int, c: int, n: int, eps: float = 1e-5) -> dict[int, torch.Tensor]:
    """Expected z per rank of ulysses_program (fp32 math, the sim's roundings: y stored in its
    dtype before the norm)."""
    out = {}
    for j in range(ranks):
        g = torch.cat([vals[(f"o.r{r}", r)][j * rows:(j + 1) * rows] for r in range(ranks)], dim=1)
        w = vals[(f"w.r{j}", j)]
        y = (g.float() @ w.float()).to(w.dtype).float()
        nw = vals[(f"nw.r{j}", j)].float()
        zs = []
        for h in range(2):
            blk = y[:, h * n // 2:(h + 1) * n // 2]
            zs.append(nw * (blk * torch.rsqrt(blk.pow(2).mean(-1, keepdim=True) + eps)))
        out[j] = torch.cat(zs, dim=1)
    return out


def reduce_scatter_program(ranks: int = 2, m: int = 4, k: int = 8, n: int = 8, dtype: str = "f32",
                           eps: float = 1e-5) -> ScheduleProgram:
    """Matmul + reduce-scatter (+ residual, RMSNorm) on ``ranks`` ranks: rank r computes
    its partial x[m, k] @ w[k, n] in one gemm tile per destination row block (m/ranks rows
    each), puts the block for rank j into P@j[r] (P[ranks, m/ranks, n], a 3-D staging buffer)
    with a signal; rank j reduces P[0:ranks, rows, 0:n] plus a residual into y[rows, n] (one
    reduce over the 3-D partials) and normalises each row (rmsnorm, dim n) into z."""
    rows = m // ranks
    b = ProgramBuilder(f"rs-{ranks}r-{dtype}", ranks=ranks, workers=1)
    b.buffer("P", "activation", dtype, (ranks, rows, n), placement="symmetric")
    for r in range(ranks):
        b.buffer(f"x.r{r}", "io_input", dtype, (m, k), rank=r)
        b.buffer(f"w.r{r}", "weight", dtype, (k, n), rank=r)
        b.buffer(f"res.r{r}", "io_input", dtype, (rows, n), rank=r)
        b.buffer(f"nw.r{r}", "weight", dtype, (n,), rank=r)
        b.buffer(f"part.r{r}", "activation", dtype, (m, n), rank=r)
        b.buffer(f"y.r{r}", "activation", dtype, (rows, n), rank=r)
        b.buffer(f"z.r{r}", "io_output", dtype, (rows, n), rank=r)
        b.counter(f"c.p.r{r}", rank=r)
        b.counter(f"c.cr.r{r}", rank=r)
    for r in range(ranks):
        for j in range(ranks):
            blk = f"{j * rows}:{(j + 1) * rows}"
            b.task(f"gemm.r{r}.m{j}", r, 0, "gemm", ins=[f"x.r{r}[{blk}, 0:{k}]", f"w.r{r}[0:{k}, 0:{n}]"],
                   outs=[f"part.r{r}[{blk}, 0:{n}]"])
            b.task(f"send.r{r}.to{j}", r, 0, "copy" if j == r else "put", ins=[f"part.r{r}[{blk}, 0:{n}]"],
                   outs=[f"P@{j}[{r}:{r + 1}, 0:{rows}, 0:{n}]"], waits=[f"c.cr.r{r}>={ranks}@prev"],
                   signals=[f"c.p.r{j}+=1"])
        b.task(f"sum.r{r}", r, 0, "reduce", ins=[f"P[0:{ranks}, 0:{rows}, 0:{n}]", f"res.r{r}[0:{rows}, 0:{n}]"],
               outs=[f"y.r{r}[0:{rows}, 0:{n}]"], waits=[f"c.p.r{r}>={ranks}"],
               signals=[f"c.cr.r{p}+=1" for p in range(ranks)])
        b.task(f"norm.r{r}", r, 0, "rmsnorm", ins=[f"y.r{r}[0:{rows}, 0:{n}]", f"nw.r{r}[0:{n}]"],
               outs=[f"z.r{r}[0:{rows}, 0:{n}]"], params={"dim": n, "eps": eps})
    return b.build()


def reduce_scatter_want(vals, ranks: int, m: int, eps: float = 1e-5) -> dict[int, torch.Tensor]:
    """Expected z per rank of reduce_scatter_program (the sim's roundings: each partial and y
    stored in their dtype)."""
    rows = m // ranks
    out = {}
    for j in range(ranks):
        dt = vals[(f"x.r{j}", j)].dtype
        parts = [(vals[(f"x.r{r}", r)][j * rows:(j + 1) * rows].float() @ vals[(f"w.r{r}", r)].float()).to(dt)
                 for r in range(ranks)]
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        y = (acc + vals[(f"res.r{j}", j)].float()).to(dt).float()
        nw = vals[(f"nw.r{j}", j)].float()
        out[j] = nw * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> bool:
    if dtype == "f32":
        return torch.allclose(got.float(), want.float(), rtol=1e-5, atol=1e-5)
    return torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- validator and sim
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gemm_tiles_on_the_sim(dtype):
    prog = gemm_tiles_program(dtype)
    v = validate(prog)
    assert v.ok, [f.message for f in v.errors]
    init, vals = seeded_init(prog)
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    sim.step(0)
    want = gemm_tiles_want(vals).to(torch_dtype(dtype))
    assert _close(sim.read("y", 0), want, dtype)


@pytest.mark.parametrize("ranks,dtype", [(2, "f32"), (3, "bf16")])
def test_ulysses_layout_puts_into_column_blocks_on_the_sim(ranks, dtype):
    """put / copy into a column block G[rows, c0:c1] of a row-major buffer, gemm over the
    gathered rows, rmsnorm over each row of a strided [rows, n/2] region; two steps (the
    credits let the second step reuse G)."""
    prog = ulysses_program(ranks=ranks, dtype=dtype)
    v = validate(prog)
    assert v.ok, [f.message for f in v.errors]
    init, vals = seeded_init(prog)
    sim = SimExecutor(prog, init, check=False, policy="random", seed=3)
    want = ulysses_want(vals, ranks, 2, 8, 16)
    for e in range(2):
        sim.step(e)
        for j in range(ranks):
            assert _close(sim.read(f"z.r{j}", j), want[j], dtype), (e, j)


@pytest.mark.parametrize("ranks,dtype", [(2, "f32"), (3, "f32"), (2, "bf16")])
def test_reduce_of_3d_partials_with_residual_on_the_sim(ranks, dtype):
    """gemm tiles per destination row block, put into a 3-D staging buffer P[k, rows, n],
    one reduce of P[0:k, 0:rows, 0:n] + residual into y[rows, n], rmsnorm over each row."""
    m = 2 * ranks
    prog = reduce_scatter_program(ranks=ranks, m=m, dtype=dtype)
    v = validate(prog)
    assert v.ok, [f.message for f in v.errors]
    init, vals = seeded_init(prog)
    sim = SimExecutor(prog, init, check=False, policy="random", seed=1)
    want = reduce_scatter_want(vals, ranks, m)
    for e in range(2):
        sim.step(e)
        for j in range(ranks):
            assert _close(sim.read(f"z.r{j}", j), want[j], dtype), (e, j)


def test_validator_reports_a_bad_gemm_tile():
    """A gemm whose b is a transposed block: ShapeMismatch naming the task and the operand."""
    prog = gemm_tiles_program()
    prog.buffers[1] = dataclasses.replace(prog.buffers[1], shape=(12, 12))
    t = prog.tasks[1]
    prog.tasks[1] = dataclasses.replace(t, ins=(t.ins[0], parse_region("w[0:2, 0:12]", 0)))
    v = validate(prog)
    msgs = [f.message for f in v.errors if f.cls == "ShapeMismatch"]
    assert msgs == ["task g.rest: gemm: a [4, 12] @ b [2, 12] -> y [4, 2]: a has K=12 columns, b has K=2 rows"], \
        [f.message for f in v.errors]


def test_sim_refuses_a_gemm_whose_counts_do_not_fit():
    """Unvalidated (check=False), a gemm the reference cannot read is a SimTaskError naming
    the task, not wrong output."""
    b = ProgramBuilder("bad-gemm", ranks=1, workers=1)
    b.buffer("x", "io_input", "f32", (4, 8))
    b.buffer("w", "weight", "f32", (8, 8))
    b.buffer("y", "io_output", "f32", (4, 7))
    b.task("g", 0, 0, "gemm", ins=["x[0:4, 0:8]", "w[0:8, 0:8]"], outs=["y[0:4, 0:7]"])
    prog = b.build()
    init, _ = seeded_init(prog)
    sim = SimExecutor(prog, init, check=False)
    with pytest.raises(SimTaskError, match="task g .op gemm.*gemm: a .32 elements. @ b .64. does not fit y .28."):
        sim.step(0)


def test_amk_validate_names_a_bad_gemm(tmp_path):
    """``amk validate`` on a program with a mismatched gemm: exit code 1 and the one-line
    ShapeMismatch; the good program: exit code 0."""
    good = tmp_path / "good.amk"
    save_program(gemm_tiles_program(), good)
    prog = gemm_tiles_program()
    prog.tasks[0] = dataclasses.replace(prog.tasks[0], outs=(parse_region("y[0:1, 0:3]", 0),))
    bad = tmp_path / "bad.amk"
    save_program(prog, bad)
    for path, rc in ((good, 0), (bad, 1)):
        res = subprocess.run([sys.executable, "-m", "amk", "validate", str(path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == rc, res.stdout + res.stderr
    assert "task g.m1: gemm: a [12] @ b [12, 2] -> y [3]: no M, K, N give" in res.stdout, res.stdout
