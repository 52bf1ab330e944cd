"""How many all-reduce consumer tiles queue behind their own reduce task? (CPU only, no weights.)

Usage: python bench/reduce_queue_order.py [MODEL] --tp R --config KNOBS.json [--workers 132] [--layer 5]

Lowers MODEL (a recipe name, default llama-3.1-8b: only its config is built, no weights) at
``--tp R`` with the knobs of ``--config`` and counts, on rank 0 and in one layer, the
``reduce_norm_gemv`` tiles (``fuse_reduce``) that stand in a worker's queue after a reduce
task of the all-reduce they consume: each must wait for that reduce before it starts, which
``late_reduce`` avoids. Prints one line per ``late_reduce`` value.
"""

from __future__ import annotations

import argparse

from ir.program import Target
from lowering.config import LoweringConfig
from lowering.lower import lower
from models.graph import build_graph, spec_from_config
from models.recipes import build_config


def behind_reduce(prog, layer: int | None = None, rank: int | None = None) -> int:
    """reduce_norm_gemv tiles (of ``layer`` / on ``rank``; None: every one) queued after a
    reduce task of the all-reduce whose receive rows they read (``rx.<site>``)."""
    n = 0
    for (r, _), queue in prog.queues().items():
        if rank is not None and r != rank:
            continue
        seen: set[str] = set()  # sites whose reduce already stands ahead in this queue
        for t in queue:
            if t.op == "reduce":
                seen.add(t.id.split(".red.")[0])
            elif (t.op == "reduce_norm_gemv" and (layer is None or t.id.startswith(f"l{layer}."))
                  and t.ins[0].buffer.removeprefix("rx.") in seen):
                n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="llama-3.1-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--config", required=True, help="lowering knobs (JSON), e.g. bench/configs/llama-3.1-8b-tp2-fr.json")
    ap.add_argument("--workers", type=int, default=132)
    ap.add_argument("--attn-split", type=int, default=4)
    ap.add_argument("--layer", type=int, default=5)
    args = ap.parse_args(argv)
    graph = build_graph(spec_from_config(build_config(args.model), "bf16"), args.model)
    base = LoweringConfig.from_file(args.config).replace(workers=args.workers, dtype="bf16",
                                                          attn_split=args.attn_split)
    target = Target(name="h200", sms=132, max_workers=args.workers, backend="triton")
    for late in (False, True):
        prog = lower(graph, args.tp, config=base.replace(late_reduce=late), target=target)
        print(f"late_reduce={int(late)}: {behind_reduce(prog, args.layer, 0)} reduce_norm_gemv tiles of layer "
              f"{args.layer} on rank 0 queue behind their reduce ({len(prog.tasks)} tasks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
