"""Matmul + all-reduce + RMSNorm: a row-parallel projection (attention output or MLP down
projection) whose partial sums are all-reduced, followed by the next layer's RMSNorm written
as HF Llama writes it (in fp32, then back to the activation dtype, times the weight).

    amk dist examples/distributed/matmul_allreduce_rmsnorm.py:matmul_allreduce_rmsnorm --world 2 \\
        --shape x=16,64 --shape w=64,48 --shape g=48
    torchrun --nproc-per-node 2 examples/distributed/matmul_allreduce_rmsnorm.py [--backend sim|triton]
"""

import torch
import torch.distributed as dist


def matmul_allreduce_rmsnorm(x, w, g, eps=1e-6):
    """x [M, K] (this rank's K shard), w [K, N], g [N] -> RMSNorm(sum over ranks of x @ w) * g:
    [M, N] on every rank."""
    y = x @ w
    dist.all_reduce(y)
    dtype = y.dtype
    h = y.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return g * h.to(dtype)


def shapes(world: int) -> dict[str, tuple[int, ...]]:
    """Rank-local shapes of the __main__ run."""
    return {"x": (16, 64), "w": (64, 48), "g": (48,)}


if __name__ == "__main__":
    from _harness import main

    raise SystemExit(main(matmul_allreduce_rmsnorm, shapes))
