"""amk.distribute: the callable keeps the function's name, docstring and signature, and inside a
process group computes what the function computes (on the sim: in this process at R = 1,
under torchrun at R = 2 for each example); its errors are one line."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import amk
from ground.errors import AmkError

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples" / "distributed"


def project(x, w, g, eps=1e-6):
    """Row-parallel projection, all-reduce, RMSNorm."""
    y = x @ w
    dist.all_reduce(y)
    h = y.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return g * h.to(y.dtype)


def gather(x, w):
    g = torch.empty(dist.get_world_size() * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(g, x)
    return torch.nn.functional.linear(g, w)


SHAPES = {"x": (8, 16), "w": (16, 12), "g": (12,)}


class one_rank_group:
    """A real gloo process group of one process (FileStore), destroyed after."""

    def __init__(self, tmp_path):
        self.path = tmp_path / "store"

    def __enter__(self):
        dist.init_process_group("gloo", store=dist.FileStore(str(self.path), 1), rank=0, world_size=1)

    def __exit__(self, *exc):
        dist.destroy_process_group()


def test_the_callable_looks_like_the_function():
    fused = amk.distribute(project, world=2, shapes=SHAPES, config={"workers": 2})
    assert fused.__name__ == "project" and fused.__doc__ == project.__doc__
    assert inspect.signature(fused) == inspect.signature(project)
    assert fused.captured.pattern.kind == "matmul_allreduce" and fused.captured.pattern.norm
    assert fused.program.ranks == 2 and fused.program.workers == 2 and fused.backend == "sim"
    assert "distribute" in dir(amk)
    with pytest.raises(AmkError, match=r"^project: call it in every process of an initialised process group of 2 "
                                       r"ranks \(torchrun --nproc-per-node 2; dist.init_process_group\)$"):
        fused(torch.randn(8, 16), torch.randn(16, 12), torch.randn(12))


def test_it_computes_what_the_function_computes(tmp_path):
    """At R = 1 in this process: the fused sim run against the function over gloo."""
    torch.manual_seed(0)
    x, w, g = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(16, 12, dtype=torch.bfloat16), \
        1 + 0.1 * torch.randn(12, dtype=torch.bfloat16)
    with one_rank_group(tmp_path):
        fused = amk.distribute(project, world=1, shapes=SHAPES, config={"workers": 2})
        want = project(x, w, g)
        for _ in range(3):  # the executor is reused: epochs 0, 1, 2
            got = fused(x, w, g=g)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert float((got.float() - want.float()).abs().max()) <= 3e-2 * max(1.0, float(want.abs().max()))
        assert fused._epoch == 3
        f32 = amk.distribute(gather, world=1, shapes={"x": (8, 16), "w": (12, 16)}, dtype="f32",
                             config={"workers": 2})
        x32, w32 = torch.randn(8, 16), torch.randn(12, 16)
        torch.testing.assert_close(f32(x32, w32), gather(x32, w32), rtol=1e-5, atol=1e-5)
        with pytest.raises(AmkError, match=r"^project: eps=0.001 differs from 1e-06, the value it was captured "):
            fused(x, w, g, eps=1e-3)
        with pytest.raises(AmkError, match=r"^project: argument w has shape \(12, 16\), captured with \(16, 12\)$"):
            fused(x, w.t(), g)
        two = amk.distribute(gather, world=2, shapes={"x": (8, 16), "w": (12, 16)}, config={"workers": 2})
        with pytest.raises(AmkError, match=r"^gather was distributed for world size 2; this process group has 1 "
                                           r"ranks$"):
            two(x, w.t())


def test_the_nvshmem_context_leaves_the_callers_group(tmp_path, monkeypatch):
    """The triton path's DistContext releases NVSHMEM only: the process group is the caller's
    (a DistContext that owns its group destroys it on close)."""
    from amk.distributed import _caller_group_context
    from lowering.triton.dist import NO_MULTICAST_ENV

    for k, v in NO_MULTICAST_ENV.items():  # what the context sets; restored after the test
        monkeypatch.setenv(k, v)

    with one_rank_group(tmp_path):
        ctx = _caller_group_context(0, 1, 0)
        assert ctx.rank == 0 and ctx.world == 1 and str(ctx.device) == "cuda:0"
        ctx.close()
        ctx.close()
        assert dist.is_initialized() and ctx._closed


def test_config_forms(tmp_path):
    from lowering.config import CollectiveConfig

    from amk.distributed import load_config

    assert load_config(None)[0] == CollectiveConfig()
    assert load_config({"chunks": 2})[0].chunks == 2
    path = tmp_path / "c.json"
    path.write_text('{"collective": {"tile_m": 32}, "kernel": {"num_warps": 8}}')
    cfg, kernel = load_config(str(path), "allgather_matmul")
    assert cfg.tile_m == 32 and kernel.num_warps == 8
    with pytest.raises(AmkError, match="config must be None, a CollectiveConfig, a dict or a file path, got int"):
        load_config(3)
    with pytest.raises(AmkError, match="does nothing for allgather_matmul"):
        amk.distribute(gather, world=2, shapes={"x": (8, 16), "w": (12, 16)}, config={"allreduce": "twoshot"})
    with pytest.raises(AmkError, match=r"^unknown backend 'cuda'; choose one of sim, triton$"):
        amk.distribute(gather, world=2, shapes={"x": (8, 16), "w": (12, 16)}, backend="cuda")


def torchrun(script: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           str(script), "--backend", "sim", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.parametrize("name", [
    "matmul_reduce_scatter",
    pytest.param("allgather_matmul", marks=pytest.mark.slow),
    pytest.param("matmul_allreduce_rmsnorm", marks=pytest.mark.slow),
    pytest.param("ulysses_combine", marks=pytest.mark.slow),
])
def test_each_example_under_torchrun(name):
    """The example's __main__ at R = 2 over gloo: the original function against amk.distribute."""
    r = torchrun(EX / f"{name}.py", 2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "verdict: fused matches the original" in r.stdout
    assert r.stdout.count("max abs err vs the original") == 2
