"""One rank of a lowered communication pattern (lowering/collectives.py) as the Triton
megakernel over NVSHMEM, replayed from a CUDA graph: what ``bench/dist.py`` times and what a
pattern's ``amk search --backend triton`` runs on every rank (search/pattern_ranks.py).

``PatternRank(program, binding, ctx)`` builds this rank's executor (its arena a symmetric
allocation of ``ctx``, a lowering.triton.dist.DistContext whose NVSHMEM is initialised;
collective: every rank builds its own, in the same order); ``run(inputs)`` writes this rank's
operands and runs one epoch through the executor (the first compiles; the kernel's error
records are read) and returns the output; ``capture()`` captures the launch in a
lowering.triton.graph.StepGraph; ``replay()`` is one epoch from the graph (no host round trip,
the error records unread); ``check()`` synchronises and reads them; ``output()`` is the last
epoch's output; ``close()`` gives the arena back (collective).
"""

from __future__ import annotations

from typing import Any

import torch


class PatternRank:
    """This rank of a lowered pattern on its GPU (module docstring). ``kernel``: the kernel
    knobs (a lowering.config.KernelConfig or None for their defaults); ``timeout_s``: the
    kernel's watchdog per wait (TritonExecutor's default when None)."""

    def __init__(self, program: Any, binding: Any, ctx: Any, *, kernel: Any = None,
                 timeout_s: float | None = None):
        from lowering.triton.blocks import kernel_options
        from lowering.triton.runtime import TritonExecutor

        opts = kernel_options(kernel) if kernel is not None else {}
        if timeout_s is not None:
            opts["timeout_s"] = timeout_s
        self.ex = TritonExecutor(program, None, check=False, dist=ctx, **opts)
        self.program, self.binding, self.ctx, self.rank = program, binding, ctx, ctx.rank
        self.graph: Any = None

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Write this rank's operands (``inputs[name]``, the pattern's shapes) and run one epoch
        through the executor; this rank's output (CPU). Raises TritonError when it fails."""
        self.binding.write_inputs(self.ex, self.rank, inputs)
        self.ex.step(self.ex.next_epoch)
        return self.output()

    def capture(self) -> None:
        """Capture the launch in a CUDA graph (after ``run``, which compiled the kernel)."""
        from lowering.triton.graph import StepGraph

        self.graph = StepGraph(self.ex)

    def replay(self) -> None:
        """One epoch replayed from the graph, on the inputs last written."""
        self.graph.replay()

    def check(self) -> None:
        """Synchronise and raise when the last replay's workers failed or did not finish."""
        self.graph.check()

    def output(self) -> torch.Tensor:
        """This rank's output of the last epoch (CPU)."""
        return self.binding.read_output(self.ex, self.rank, self.ex.next_epoch - 1)

    def close(self) -> None:
        """Give the arena back to the symmetric heap (collective; nothing may use the executor
        or its graph after)."""
        self.graph = None
        self.ctx.free_symmetric(self.ex.arena)

    @staticmethod
    def heap_bytes(programs: list[Any]) -> int:
        """The NVSHMEM heap that holds the largest arena of ``programs`` on any rank."""
        from lowering.triton import table as T

        return max((T.build_layout(p, r).nbytes for p in programs for r in range(p.ranks)), default=0)
