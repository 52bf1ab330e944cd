"""The four communication patterns lowered to schedules (lowering/collectives.py): every
program passes the validator; on the sim backend at R = 2, 3, 4 (f32 and bf16, several knob
settings) each rank's output equals the pattern's torch reference (models/collectives.py) and
the original torch.distributed function run over gloo in R CPU processes; a dropped wait is
rejected by the validator."""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ground.errors import AmkError
from ir.program import Target
from lowering.collectives import lower_pattern
from lowering.config import CollectiveConfig
from lowering.sim import SimExecutor
from models.collectives import (
    DTYPES, AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter, UlyssesCombine,
)
from validator import validate

WORLDS = (2, 3, 4)
EPS = 1e-6


# ----------------------------------------------------------------------------- the originals
# The user's functions as written with torch.distributed (what amk dist captures).
def allgather_matmul(x, w, group=None):
    world = dist.get_world_size(group)
    g = torch.empty(world * x.shape[0], x.shape[1], dtype=x.dtype)
    dist.all_gather_into_tensor(g, x, group=group)
    return g @ w


def matmul_reduce_scatter(x, w, group=None):
    y = x @ w
    out = torch.empty(y.shape[0] // dist.get_world_size(group), y.shape[1], dtype=y.dtype)
    dist.reduce_scatter_tensor(out, y, group=group)
    return out


def matmul_allreduce(x, w, g=None, eps=EPS, group=None):
    y = x @ w
    dist.all_reduce(y, group=group)
    if g is None:
        return y
    h = y.float()  # HF LlamaRMSNorm
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return g * h.to(y.dtype)


def ulysses_combine(o, w, group=None):
    world = dist.get_world_size(group)
    s, c = o.shape
    out = torch.empty_like(o)
    dist.all_to_all_single(out, o, group=group)
    return out.reshape(world, s // world, c).permute(1, 0, 2).reshape(s // world, world * c) @ w


def _original(p, ins: dict, group):
    if isinstance(p, AllGatherMatmul):
        return allgather_matmul(ins["x"], ins["w"], group)
    if isinstance(p, MatmulReduceScatter):
        return matmul_reduce_scatter(ins["x"], ins["w"], group)
    if isinstance(p, MatmulAllReduce):
        return matmul_allreduce(ins["x"], ins["w"], ins.get("g"), p.eps, group)
    return ulysses_combine(ins["o"], ins["w"], group)


# ----------------------------------------------------------------------------- the cases
def _patterns(world: int, dtype: str) -> list:
    return [AllGatherMatmul(world, dtype, m=24, n=32, k=48),
            MatmulReduceScatter(world, dtype, m=24, n=48, k=16),
            MatmulAllReduce(world, dtype, m=10, n=32, k=16),
            MatmulAllReduce(world, dtype, m=10, n=32, k=16, norm=True, eps=EPS),
            UlyssesCombine(world, dtype, s=24, c=16, n=32)]


CASES = [(p, e) for world in WORLDS for dtype in ("f32", "bf16") for p in _patterns(world, dtype)
         for e in range(2)]


def _inputs(p, epoch: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's operands for one epoch of ``p`` (seeded by the case)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{p!r} {epoch}".encode()))
    dt = DTYPES[p.dtype]
    out = []
    for _ in range(p.world):
        ins = {k: torch.randn(s, generator=gen).to(dt) for k, s in p.operands().items()}
        if "g" in ins:
            ins["g"] = (1 + 0.5 * torch.randn(ins["g"].shape, generator=gen)).to(dt)
        out.append(ins)
    return out


def _gloo_worker(rank: int, world: int, port: int, path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")  # the deprecation notes of the *_tensor collectives
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        groups = {r: dist.new_group(list(range(r))) for r in WORLDS}  # every rank, in one order
        cases = torch.load(path, weights_only=False)  # this test's own file: patterns and tensors
        out = {}
        for key, (p, ins) in cases.items():
            if rank < p.world:
                out[key] = _original(p, ins[rank], groups[p.world])
        torch.save(out, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory) -> dict:
    """The original functions' outputs over gloo: ``{(case index): [output of each rank]}``,
    every case run in one process group of max(WORLDS) CPU processes (subgroups for R < 4)."""
    path = str(tmp_path_factory.mktemp("gloo") / "cases.pt")
    torch.save({i: (p, _inputs(p, e)) for i, (p, e) in enumerate(CASES)}, path)
    world = max(WORLDS)
    mp.spawn(_gloo_worker, args=(world, _free_port(), path), nprocs=world)
    per_rank = [torch.load(f"{path}.{r}") for r in range(world)]
    return {i: [per_rank[r][i] for r in range(p.world)] for i, (p, _) in enumerate(CASES)}


CONFIGS = {
    "t4x16-c2-w2": CollectiveConfig(tile_m=4, tile_n=16, workers=2, chunks=2),
    "t8x32-c1-w3": CollectiveConfig(tile_m=8, tile_n=32, workers=3, chunks=1),
    "t3x16-c4-w1": CollectiveConfig(tile_m=3, tile_n=16, workers=1, chunks=4, reduce_rows=2),
}


def _variants(p) -> list[CollectiveConfig]:
    """The configs a pattern runs under: each of CONFIGS, with its own knobs both ways
    (all-reduce one-shot and two-shot, direct stores every other config, whole_k)."""
    out = []
    for n, cfg in enumerate(CONFIGS.values()):
        if isinstance(p, MatmulAllReduce):
            out += [dataclasses.replace(cfg, allreduce="oneshot"),
                    dataclasses.replace(cfg, allreduce="twoshot", direct=n % 2 == 1)]
        elif isinstance(p, MatmulReduceScatter):
            out.append(dataclasses.replace(cfg, direct=n % 2 == 1))
        elif isinstance(p, UlyssesCombine):
            out += [dataclasses.replace(cfg, reduce_rows=0), dataclasses.replace(cfg, reduce_rows=0, whole_k=True)]
        else:
            out.append(dataclasses.replace(cfg, reduce_rows=0))
    for cfg in out:
        cfg.validate("test", p.kind)
    return out


def _tolerance(ref: torch.Tensor, dtype: str) -> float:
    scale = max(1.0, ref.float().abs().max().item())
    return (1e-5 if dtype == "f32" else 2e-2) * scale


def _run_sim(p, cfg, epochs: list[list[dict]], policy: str = "random", seed: int = 0) -> list[list[torch.Tensor]]:
    """Each epoch's outputs of every rank (ranks drifting across epochs, inputs written as
    each rank starts its epoch)."""
    prog, bind = lower_pattern(p, cfg)
    ex = SimExecutor(prog, seed=seed, policy=policy, check=False)
    outs = [[None] * p.world for _ in epochs]
    ex.run_steps(len(epochs), on_start=lambda e, r: bind.write_inputs(ex, r, epochs[e][r]),
                 on_end=lambda e, r: outs[e].__setitem__(r, bind.read_output(ex, r, e)))
    return outs


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("world", WORLDS)
def test_every_program_passes_the_validator(world):
    for dtype in ("f32", "bf16"):
        for p in _patterns(world, dtype):
            for cfg in _variants(p):
                prog, _ = lower_pattern(p, cfg)
                v = validate(prog)
                assert v.ok, (p, cfg, [f"{f.cls}: {f.message}" for f in v.errors[:3]])
                assert prog.ranks == world and prog.workers == cfg.workers


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_sim_equals_the_reference_and_the_original_over_gloo(world, dtype, gloo):
    for i, (p, e0) in enumerate(CASES):
        if p.world != world or p.dtype != dtype or e0:
            continue
        # epochs 0 and 1 are cases i and i + 1 (the same pattern, other inputs)
        epochs = [_inputs(p, 0), _inputs(p, 1)]
        refs = [p.reference(ins) for ins in epochs]
        for n, cfg in enumerate(_variants(p)):
            policy = ("random", "adversarial")[n % 2]
            outs = _run_sim(p, cfg, epochs, policy=policy, seed=n)
            for e in range(2):
                for r in range(world):
                    got, ref, orig = outs[e][r], refs[e][r], gloo[i + e][r]
                    assert got.dtype == DTYPES[dtype] and got.shape == ref.shape == orig.shape
                    tol = _tolerance(ref, dtype)
                    err_ref = (got.float() - ref.float()).abs().max().item()
                    err_orig = (got.float() - orig.float()).abs().max().item()
                    assert err_ref <= tol and err_orig <= tol, (p, cfg, e, r, err_ref, err_orig, tol)


def test_the_gloo_outputs_are_the_references(gloo):
    # the comparison above is only as good as the originals: they must be the patterns' math
    for i, (p, e) in enumerate(CASES):
        refs = p.reference(_inputs(p, e))
        for r in range(p.world):
            assert (gloo[i][r].float() - refs[r].float()).abs().max().item() <= _tolerance(refs[r], p.dtype)


_AR3 = MatmulAllReduce(3, "f32", m=12, n=16, k=16, norm=True)


@pytest.mark.parametrize("p,allreduce", [(AllGatherMatmul(3, "f32", m=12, n=16, k=16), "oneshot"),
                                         (MatmulReduceScatter(3, "f32", m=12, n=16, k=16), "oneshot"),
                                         (_AR3, "oneshot"), (_AR3, "twoshot"),
                                         (UlyssesCombine(3, "f32", s=12, c=8, n=16), "oneshot")],
                         ids=["allgather_matmul", "matmul_reduce_scatter", "allreduce_oneshot", "allreduce_twoshot",
                              "ulysses_combine"])
def test_a_dropped_wait_is_rejected(p, allreduce):
    cfg = CollectiveConfig(tile_m=4, tile_n=8, workers=2, chunks=2, allreduce=allreduce)
    prog, _ = lower_pattern(p, cfg)
    assert validate(prog).ok
    # every task that waits for a peer's data: without its wait the program must be refused
    # (the two-shot's closing nop is left out: no task reads the rows it waits for, the
    # caller does after the kernel)
    waiting = [i for i, t in enumerate(prog.tasks) if t.op != "nop" and any(".own." not in w.counter for w in t.waits)]
    assert waiting
    for i in waiting[:: max(1, len(waiting) // 3)]:
        bad = prog.copy()
        bad.tasks[i].waits = ()
        v = validate(bad)
        assert not v.ok, bad.tasks[i].id
        assert {f.cls for f in v.errors} & {"RemoteReadBeforeDelivery", "UncoveredRead", "PartialCoverageRead",
                                            "ReadWriteRace"}, [f.cls for f in v.errors]


def test_without_the_wait_the_sim_reads_stale_data():
    # what the validator's verdict protects against: the adversarial interleaving delivers the
    # peer's rows late, so a GEMM that does not wait for them computes on NaN (unwritten) rows
    p = AllGatherMatmul(2, "f32", m=8, n=8, k=8)
    prog, bind = lower_pattern(p, CollectiveConfig(tile_m=4, tile_n=8, workers=1, chunks=1))
    for t in prog.tasks:
        t.waits = ()
    ex = SimExecutor(prog, seed=1, policy="adversarial", check=False)
    ins = _inputs(p, 0)
    for r in range(2):
        bind.write_inputs(ex, r, ins[r])
    ex.step(0)
    assert any(torch.isnan(bind.read_output(ex, r, 0)).any() for r in range(2))


def test_knobs_change_the_program():
    p = MatmulAllReduce(2, "f32", m=16, n=32, k=16)
    base = CollectiveConfig(tile_m=8, tile_n=16, workers=2, chunks=2)
    progs = {name: lower_pattern(p, dataclasses.replace(base, **kw))[0] for name, kw in {
        "base": {}, "tile_m": {"tile_m": 4}, "tile_n": {"tile_n": 8}, "workers": {"workers": 3},
        "chunks": {"chunks": 1}, "reduce_rows": {"reduce_rows": 2}, "allreduce": {"allreduce": "twoshot"}}.items()}
    two = dataclasses.replace(base, allreduce="twoshot")
    progs["direct"] = lower_pattern(p, dataclasses.replace(two, direct=True))[0]
    assert not [t for t in progs["direct"].tasks if t.op == "put" and ".ag." not in t.id]
    assert [t for t in lower_pattern(p, two)[0].tasks if t.op == "put" and ".ag." not in t.id]
    sig = {k: [(t.id, t.worker, t.op, t.ins, t.outs, t.waits) for t in v.tasks] for k, v in progs.items()}
    for name in progs:
        if name != "base":
            assert sig[name] != sig["base"], name
    u = UlyssesCombine(2, "f32", s=8, c=8, n=16)
    a = lower_pattern(u, base)[0]
    b = lower_pattern(u, dataclasses.replace(base, whole_k=True))[0]
    assert {t.op for t in a.tasks} != {t.op for t in b.tasks} or len(a.tasks) != len(b.tasks)


def test_own_rows_start_before_any_peer_data():
    # all-gather + matmul: the GEMMs of the own block wait for nothing and come first on every
    # worker; the reduce-scatter computes the peers' rows first (rank r+1's, r+2's, ...) and
    # its own last
    p = AllGatherMatmul(4, "f32", m=32, n=16, k=8)
    prog, _ = lower_pattern(p, CollectiveConfig(tile_m=4, tile_n=16, workers=2, chunks=1))
    for (r, w), q in prog.queues().items():
        gemms = [t for t in q if t.op == "gemm"]
        own = [f"from{r}." in t.id for t in gemms]
        assert own[0] and own == sorted(own, reverse=True), (r, w)
        assert all(not t.waits for t, o in zip(gemms, own) if o) and all(t.waits for t, o in zip(gemms, own) if not o)
    rs, _ = lower_pattern(MatmulReduceScatter(3, "f32", m=6, n=8, k=8),
                          CollectiveConfig(tile_m=2, tile_n=8, workers=1, chunks=1))
    order = [t.id for t in rs.tasks if t.rank == 0 and t.op == "gemm"]
    assert [i.split(".m")[1].split(".")[0] for i in order] == ["2", "4", "0"]


def test_binding_names_each_operand_and_the_output():
    p = MatmulAllReduce(2, "bf16", m=8, n=16, k=8, norm=True)
    prog, bind = lower_pattern(p, CollectiveConfig(tile_m=4, tile_n=16, workers=1, allreduce="twoshot"))
    bufs = prog.buffer_map()
    for r in range(2):
        assert set(bind.inputs[r]) == {"x", "w", "g"}
        for name, reg in bind.inputs[r].items():
            assert bufs[reg.buffer].kind == "io_input" and bufs[reg.buffer].shape == p.operands()[name]
        assert bufs[bind.outputs[r].buffer].kind == "io_output"
    ex = SimExecutor(prog, check=False)
    with pytest.raises(AmkError, match="operand 'x' has shape \\(8, 4\\), expected \\(8, 8\\)"):
        bind.write_inputs(ex, 0, {"x": torch.zeros(8, 4), "w": torch.zeros(8, 16), "g": torch.zeros(16)})
    with pytest.raises(AmkError, match="rank 1 has no operand 'g'"):
        bind.write_inputs(ex, 1, {"x": torch.zeros(8, 8), "w": torch.zeros(8, 16)})


@pytest.mark.parametrize("p,cfg,message", [
    (AllGatherMatmul(3, "f32", m=10, n=8, k=8), None, "M=10 is not divisible by the world size 3"),
    (UlyssesCombine(2, "f32", s=8, c=0, n=8), None, "C=0 must be >= 1"),
    (MatmulAllReduce(2, "f32", m=8, n=8, k=8), CollectiveConfig(tile_m=-4),
     "collective config: field 'tile_m' (--tile-m): must be 0 (by size) or an integer >= 1, got -4"),
    (MatmulAllReduce(2, "f32", m=8, n=8, k=8), CollectiveConfig(allreduce="ring"),
     "field 'allreduce' (--allreduce): expected one of oneshot, twoshot, got 'ring'"),
    (MatmulAllReduce(2, "f32", m=8, n=8, k=8), CollectiveConfig(workers=200),
     "200 workers per rank exceed the target's 132 co-resident workers"),
])
def test_bad_patterns_and_knobs_are_one_line_errors(p, cfg, message):
    with pytest.raises(AmkError) as ei:
        lower_pattern(p, cfg, Target())
    assert message in str(ei.value) and "\n" not in str(ei.value) and ei.value.exit_code == 2


def test_one_rank_is_a_tiled_matmul():
    for p in _patterns(1, "f32"):
        prog, _ = lower_pattern(p, CollectiveConfig(tile_m=4, tile_n=16, workers=2))
        assert validate(prog).ok and prog.slots == 1
        assert not [t for t in prog.tasks if t.op == "put"]
        ins = _inputs(p, 0)
        out = _run_sim(p, CollectiveConfig(tile_m=4, tile_n=16, workers=2), [ins])
        assert (out[0][0] - p.reference(ins)[0]).abs().max() <= 1e-4


def test_many_signals_per_epoch_lower_max_epochs_instead_of_overflowing_a_counter():
    """4,096 tiles signalling one counter per epoch: the program allows fewer calls rather
    than a counter that leaves its 32-bit range (which the validator refuses)."""
    from models.collectives import MatmulAllReduce
    from lowering.collectives import lower_pattern
    from lowering.config import CollectiveConfig

    prog, _ = lower_pattern(MatmulAllReduce(world=2, dtype="bf16", m=8192, n=8192, k=16), CollectiveConfig())
    most = max(prog.signals_per_epoch().values())
    assert most >= 4096
    assert most * (prog.max_epochs + 1) <= 2 ** 31 - 1 < most * (prog.max_epochs + 2)
    small, _ = lower_pattern(MatmulAllReduce(world=2, dtype="bf16", m=64, n=64, k=16), CollectiveConfig())
    assert small.max_epochs == 1 << 20


@pytest.mark.parametrize("p,workers,side", [
    (AllGatherMatmul(2, "bf16", m=256, n=256, k=256), 132, 32),     # 16 tiles of 64 x 64
    (AllGatherMatmul(2, "bf16", m=512, n=512, k=512), 132, 32),     # 64 < 66
    (AllGatherMatmul(2, "bf16", m=1024, n=1024, k=1024), 132, 64),  # 256
    (UlyssesCombine(2, "bf16", s=1024, c=512, n=1024), 132, 64),    # [512, 1024]: 128
    (UlyssesCombine(2, "bf16", s=512, c=256, n=512), 132, 32),      # [256, 512]: 32
    (MatmulReduceScatter(2, "bf16", m=256, n=256, k=256), 16, 64),  # 16 tiles, 16 workers
])
def test_tiles_by_size(p, workers, side):
    """tile_m / tile_n 0 (the default) pick 32 x 32 only where 64 x 64 leaves a rank with fewer
    GEMM tiles than half its workers; the program records the sides it was lowered with."""
    from lowering.collectives import size_tile

    assert size_tile(p, workers) == side
    prog, _ = lower_pattern(p, CollectiveConfig(workers=workers, chunks=1))
    assert (prog.config["tile_m"], prog.config["tile_n"]) == (side, side)
    gemms = [t for t in prog.tasks if t.op == "gemm" and t.rank == 0]
    rows, cols = (p.s // p.world, p.n) if isinstance(p, UlyssesCombine) else (p.m, p.n)
    per_piece = p.world if isinstance(p, UlyssesCombine) else 1  # one GEMM per source piece
    assert len(gemms) == -(-rows // side) * -(-cols // side) * per_piece


def test_given_tiles_are_kept():
    p = AllGatherMatmul(2, "bf16", m=256, n=256, k=256)
    prog, _ = lower_pattern(p, CollectiveConfig(tile_m=64, tile_n=128, chunks=1))
    assert (prog.config["tile_m"], prog.config["tile_n"]) == (64, 128)
