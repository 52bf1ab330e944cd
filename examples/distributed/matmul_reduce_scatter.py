"""Matmul + reduce-scatter: the output side of a tensor-parallel MLP with sequence
parallelism. Each rank multiplies all M rows of its K shard of the activations by its row
shard of the weight (kept in nn.Linear's [N, K] layout, hence F.linear); the partial products
are summed over the ranks and rank r keeps rows r*M/R .. (r+1)*M/R - 1.

    amk dist examples/distributed/matmul_reduce_scatter.py:matmul_reduce_scatter --world 2 \\
        --shape x=64,32 --shape w=48,32
    torchrun --nproc-per-node 2 examples/distributed/matmul_reduce_scatter.py [--backend sim|triton]
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def matmul_reduce_scatter(x, w):
    """x [M, K], w [N, K] (nn.Linear's layout) -> the sum over ranks of x @ w.T, rows
    r*M/R .. (r+1)*M/R - 1 on rank r: [M/R, N]."""
    world = dist.get_world_size()
    partial = F.linear(x, w)
    out = torch.empty(partial.shape[0] // world, partial.shape[1], dtype=partial.dtype, device=partial.device)
    dist.reduce_scatter_tensor(out, partial)
    return out


def shapes(world: int) -> dict[str, tuple[int, ...]]:
    """Rank-local shapes of the __main__ run: M = 32 * world rows."""
    return {"x": (32 * world, 32), "w": (48, 32)}


if __name__ == "__main__":
    from _harness import main

    raise SystemExit(main(matmul_reduce_scatter, shapes))
