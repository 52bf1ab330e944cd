"""Ulysses combine: the output side of Ulysses sequence parallelism (DeepSpeed-Ulysses).
After attention each rank holds the whole sequence for its H/R heads (o [S, C], C = H/R * D);
an all-to-all sends sequence block j to rank j, which lays the R pieces side by side (all
heads of its S/R positions) and applies the output projection.

    amk dist examples/distributed/ulysses_combine.py:ulysses_combine --world 2 \\
        --shape o=32,16 --shape w=32,48
    torchrun --nproc-per-node 2 examples/distributed/ulysses_combine.py [--backend sim|triton]
"""

import torch
import torch.distributed as dist


def ulysses_combine(o, w):
    """o [S, C] (every position, this rank's heads), w [R*C, N] -> positions
    r*S/R .. (r+1)*S/R - 1 with all heads, times w: [S/R, N]."""
    world = dist.get_world_size()
    seq, cols = o.shape
    pieces = torch.empty_like(o)
    dist.all_to_all_single(pieces, o)
    heads = pieces.reshape(world, seq // world, cols).permute(1, 0, 2).reshape(seq // world, world * cols)
    return heads @ w


def shapes(world: int) -> dict[str, tuple[int, ...]]:
    """Rank-local shapes of the __main__ run: S = 16 * world positions, 16 columns per rank."""
    return {"o": (16 * world, 16), "w": (16 * world, 48)}


if __name__ == "__main__":
    from _harness import main

    raise SystemExit(main(ulysses_combine, shapes))
