"""One rank of tests/test_spmd_decoder.py (started R times with torchrun variables, gloo, CPU).

Runs ``amk.pipeline.Decoder`` as a distributed (SPMD) run does: the executor holds only this
process's rank (``local_ranks``, ``dist``), so next tokens and logits of the other ranks
arrive by ``all_gather_object`` and the HF reference of ``check_correctness`` is computed by
rank 0 alone and broadcast. The executor stands in for one GPU's TritonExecutor: a sim of the
whole program in every process, of which only this rank is visible; every rank writes the
same token and position (as the real ranks do), so the hidden ranks of the sim see them too.

Usage: python tests/spmd_decoder_driver.py MODEL OUT_JSON. Rank 0 writes OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

from amk import pipeline  # noqa: E402
from lowering.config import LoweringConfig  # noqa: E402
from lowering.triton.dist import DistContext, env_world  # noqa: E402


class OneRankView:
    """A sim executor of all ranks that shows only ``rank`` (see module doc)."""

    def __init__(self, ex, rank: int, ranks: int, ctx):
        self.ex, self.local_ranks, self.ranks, self.dist = ex, [rank], ranks, ctx

    def write(self, buffer: str, rank: int, value) -> None:
        assert rank in self.local_ranks, (buffer, rank)
        for q in range(self.ranks):
            self.ex.write(buffer.replace(f".r{rank}", f".r{q}"), q, value)

    def read(self, buffer: str, rank: int):
        assert rank in self.local_ranks, (buffer, rank)
        return self.ex.read(buffer, rank)

    def step(self, epoch: int):
        return self.ex.step(epoch)


def main() -> None:
    model_arg, out = sys.argv[1], sys.argv[2]
    rank, world, _ = env_world()
    torch.set_num_threads(1)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    ctx = DistContext(rank=rank, world=world, local_rank=rank, device=torch.device("cpu"))
    compilation = pipeline.Compilation.build(model_arg, world, LoweringConfig(max_seq=40, workers=2))
    dec = compilation.decoder("sim", policy="in_order")
    dec = pipeline.Decoder(compilation.program, OneRankView(dec.ex, rank, world, ctx), compilation.config.max_seq)
    report = compilation.check(dec)
    tokens = dec.generate([5, 17, 33], 6)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"ok": report.ok, "max_abs_err": report.max_abs_err, "tokens": tokens}, f)
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The result is written and the process group closed. Leave without C++ static
    # destructors: a torch background thread still joinable there can abort the rank
    # ("terminate called without an active exception", exit -6) after the work succeeded
    # (seen in a clean-clone CI run; tests/tp_baselines_driver.py has the same exit). An
    # exception in main() still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
