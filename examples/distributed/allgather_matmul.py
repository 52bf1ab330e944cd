"""All-gather + matmul: the input side of a tensor-parallel MLP whose activations are sharded
by rows (sequence parallelism). Each rank holds x, its M/R rows of the activations, and w,
its column shard of the weight; every rank needs all rows times its shard.

    amk dist examples/distributed/allgather_matmul.py:allgather_matmul --world 2 \\
        --shape x=32,64 --shape w=64,48
    torchrun --nproc-per-node 2 examples/distributed/allgather_matmul.py [--backend sim|triton]
"""

import torch
import torch.distributed as dist


def allgather_matmul(x, w):
    """x [M/R, K] (this rank's rows), w [K, N] -> all ranks' rows stacked in rank order,
    times w: [M, N]."""
    world = dist.get_world_size()
    gathered = torch.empty(world * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x)
    return gathered @ w


def shapes(world: int) -> dict[str, tuple[int, ...]]:
    """Rank-local shapes of the __main__ run: M = 32 * world."""
    return {"x": (32, 64), "w": (64, 48)}


if __name__ == "__main__":
    from _harness import main

    raise SystemExit(main(allgather_matmul, shapes))
