"""The lowered communication patterns on the Triton backend with every rank in one process
(``TritonExecutor`` without a dist context: remote puts and signals through the arena slice
distance, as tests/test_triton_multirank.py): under the interpreter one worker runs a
topological order of all ranks' tasks; on a GPU (``gpu`` marker) the R x W queues run as
persistent CTAs. Each rank's output must equal the pattern's reference and the sim's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from ir.program import Target
from lowering.collectives import lower_pattern
from lowering.config import CollectiveConfig
from lowering.sim import SimExecutor
from lowering.triton import TritonExecutor
from lowering.triton.lang import interpreting
from models.collectives import AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter, UlyssesCombine

INTERP = interpreting()
DEV = "cpu" if INTERP else "cuda"
needs_device = pytest.mark.skipif(not INTERP and not torch.cuda.is_available(),
                                  reason="needs the interpreter or a CUDA GPU")

CFG = CollectiveConfig(tile_m=4, tile_n=16, workers=2, chunks=2)
CASES = {
    "allgather_matmul": (AllGatherMatmul(2, "bf16", m=8, n=32, k=16), CFG),
    "matmul_reduce_scatter": (MatmulReduceScatter(2, "f32", m=8, n=32, k=16), CFG),
    "matmul_reduce_scatter-direct": (MatmulReduceScatter(3, "bf16", m=12, n=16, k=16),
                                     dataclasses.replace(CFG, direct=True)),
    "matmul_allreduce-oneshot-norm": (MatmulAllReduce(2, "bf16", m=6, n=32, k=16, norm=True), CFG),
    "matmul_allreduce-twoshot": (MatmulAllReduce(3, "f32", m=10, n=16, k=16),
                                 dataclasses.replace(CFG, allreduce="twoshot")),
    "ulysses_combine": (UlyssesCombine(2, "bf16", s=8, c=16, n=32), CFG),
    "ulysses_combine-whole_k": (UlyssesCombine(2, "f32", s=8, c=8, n=16), dataclasses.replace(CFG, whole_k=True)),
}


def _inputs(p, seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}[p.dtype]
    return [{k: torch.randn(s, generator=gen).to(dt) for k, s in p.operands().items()} for _ in range(p.world)]


def _run(ex, bind, p, epochs: list[list[dict]]) -> list[list[torch.Tensor]]:
    outs = []
    for e, ins in enumerate(epochs):
        for r in range(p.world):
            bind.write_inputs(ex, r, ins[r])
        ex.step(e)
        outs.append([bind.read_output(ex, r, e) for r in range(p.world)])
    return outs


@needs_device
@pytest.mark.parametrize("case", list(CASES))
def test_pattern_on_colocated_triton_ranks_equals_the_reference_and_the_sim(case):
    p, cfg = CASES[case]
    prog, bind = lower_pattern(p, cfg, Target(backend="triton"))
    epochs = [_inputs(p, 0), _inputs(p, 1)]  # two epochs: both slots of the staging buffers
    got = _run(TritonExecutor(prog, None, check=True, device=DEV), bind, p, epochs)
    sim = _run(SimExecutor(prog, None, check=False), bind, p, epochs)
    for e, ins in enumerate(epochs):
        ref = p.reference(ins)
        for r in range(p.world):
            scale = max(1.0, ref[r].float().abs().max().item())
            tol = (1e-4 if p.dtype == "f32" else 2e-2) * scale
            assert got[e][r].dtype == ref[r].dtype and got[e][r].shape == ref[r].shape
            assert (got[e][r].float() - ref[r].float()).abs().max().item() <= tol, (case, e, r)
            assert (got[e][r].float() - sim[e][r].float()).abs().max().item() <= tol, (case, e, r)


def test_graphs_refuse_an_executor_they_cannot_capture():
    """StepGraph and DecodeGraph (its subclass) need a CUDA executor that has compiled."""
    import types

    from lowering.triton.graph import DecodeGraph, StepGraph

    ex = types.SimpleNamespace(device=torch.device("cpu"), compiled=None)
    with pytest.raises(RuntimeError, match=r"^StepGraph needs the compiled \(CUDA\) Triton backend$"):
        StepGraph(ex)
    with pytest.raises(RuntimeError, match=r"^DecodeGraph needs the compiled \(CUDA\) Triton backend$"):
        DecodeGraph(ex, 8)
    ex.device = torch.device("cuda", 0)
    for make in (lambda: StepGraph(ex), lambda: DecodeGraph(ex, 8)):
        with pytest.raises(RuntimeError, match=r"^run one executor.step\(\) before capturing"):
            make()
