"""What the examples' ``__main__`` shares: run a user function over a real process group
(torchrun) next to its ``amk.distribute`` version and print the largest difference.

Each process (rank r of R, from torchrun's RANK / WORLD_SIZE) draws its own seeded inputs of
the example's shapes, calls the original function (its collectives run over the process
group: gloo for CPU tensors, NCCL for CUDA tensors) and the fused callable on the same
inputs, and reports max |fused - original|. Rank 0 prints one line per rank and the verdict;
every process exits 0 when all ranks agree within amk.distributed.TOL, 1 otherwise, 2 for bad
arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as `torchrun examples/distributed/X.py` from a source checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

_SHAPE = re.compile(r"^([A-Za-z_]\w*)=(\d+(?:[,x]\d+)*)$")


def _parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    m = _SHAPE.match(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DIMS, e.g. x=64,128")
    return m.group(1), tuple(int(d) for d in re.split(r"[,x]", m.group(2)))


def main(fn: Callable, shapes: Callable[[int], dict[str, tuple[int, ...]]], argv: list[str] | None = None) -> NoReturn:
    """Run ``fn`` and ``amk.distribute(fn, ...)`` in this process of a torchrun job and end the
    process with the exit code (module docstring; ``os._exit`` after the process group is
    destroyed, so it does not return). ``shapes(R)``: the default rank-local shapes at world
    size R."""
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=f"{fn.__name__}: the original function over torch.distributed "
                                            "against amk's fused schedule (run under torchrun)")
    p.add_argument("--backend", choices=("sim", "triton"), default="triton" if gpu else "sim",
                   help="amk backend of the fused version (default: triton with GPUs, else sim)")
    p.add_argument("--dtype", choices=("bf16", "f16", "f32"), default="bf16")
    p.add_argument("--shape", type=_parse_shape, action="append", default=[], metavar="NAME=DIMS",
                   help="a rank-local parameter shape (default: the example's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", default=None, metavar="FILE", help="collective knobs (docs/dist.md)")
    args = p.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        p.error(f"run it under torchrun, e.g. torchrun --nproc-per-node 2 {sys.argv[0]}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo")
    try:
        code = _compare(fn, {**shapes(world), **dict(args.shape)}, args, rank, world, device)
    finally:
        # every rank leaves its last collective before any tears the group down: a gloo pair
        # destroyed under a peer still in flight aborts that peer's process at exit
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    # Leave without the interpreter's teardown: with the result printed and the group gone,
    # a C++ thread still joinable when static objects are destroyed ("terminate called
    # without an active exception", seen now and then in CPU runs of these examples) would
    # turn exit 0 into SIGABRT.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _compare(fn, shapes, args, rank, world, device) -> int:
    import amk
    from amk.distributed import TOL
    from ground.errors import AmkError
    from models.collectives import DTYPES

    dt = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    inputs = {}
    for name, shape in shapes.items():
        v = torch.randn(shape, generator=g)
        inputs[name] = (1 + 0.1 * v if len(shape) == 1 else 0.5 * v).to(dt).to(device)
    try:
        fused = amk.distribute(fn, world=world, shapes=shapes, dtype=args.dtype, backend=args.backend,
                               config=args.config)
    except AmkError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    want = fn(**inputs)
    got = fused(**inputs)
    ref = want.float()
    err = float((got.float() - ref).abs().max())
    tol = TOL[args.dtype] * max(1.0, float(ref.abs().max()))
    rows = [None] * world
    dist.all_gather_object(rows, (rank, tuple(got.shape), err, tol, bool(err <= tol)))
    ok = all(r[4] for r in rows)
    if rank == 0:
        print(f"{fn.__name__}: {fused.captured.describe()}, backend {args.backend}")
        for r, shape, e, t, good in rows:
            print(f"  rank {r}: output {list(shape)}, max abs err vs the original {e:.3g} (tolerance {t:.3g})"
                  f"{'' if good else '  MISMATCH'}")
        print(f"verdict: {'fused matches the original' if ok else 'fused DIFFERS from the original'}")
    return 0 if ok else 1
