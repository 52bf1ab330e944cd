"""Autoregressive decoding with one CUDA-graph replay per token (R = 1).

The graph holds the megakernel launch followed by the step's bookkeeping, all on the device:
``epoch += 1``, ``pos += 1``, ``token <- next`` and ``history[pos] <- next``. A replay is
therefore one whole decode step with no host round trip; the host reads the history once
at the end. The bookkeeping is four tiny element-wise kernels (about 2 us each inside a
graph); they are part of every step a user would run, so they stay in the timed region.
"""

from __future__ import annotations

import torch

from amk.timing import Timing, time_per_call


class DecodeGraph:
    """Capture ``executor``'s decode step in a CUDA graph; see the module docstring.

    ``executor``: a compiled-mode ``TritonExecutor`` (R = 1) whose program has io buffers
    ``token.r0``, ``pos.r0`` and ``next.r0`` (int32 [1]); ``max_tokens``: history length.
    The executor must be at a step boundary; capturing runs no step. Raises RuntimeError
    without CUDA.
    """

    def __init__(self, executor, max_tokens: int):
        if executor.device.type != "cuda":
            raise RuntimeError("DecodeGraph needs the compiled (CUDA) Triton backend")
        self.ex = executor
        self.token = executor._view("token.r0", 0)
        self.pos = executor._view("pos.r0", 0)
        self.next = executor._view("next.r0", 0)
        self.hist = torch.zeros(max_tokens + 1, dtype=torch.int32, device=executor.device)
        self.max_tokens = max_tokens
        # The kernel must be compiled (and its co-residency checked) by a normal step first:
        # compilation cannot happen inside a capture.
        if executor.compiled is None:
            raise RuntimeError("run one executor.step() before capturing (it compiles the kernel)")
        self.ex._epoch.fill_(executor.next_epoch)
        torch.cuda.synchronize(executor.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()

    def _body(self) -> None:
        ex = self.ex
        ex._kernel[(ex.workers,)](*ex._args(), **ex._launch_kw)
        ex._epoch.add_(1)
        idx = self.pos.long()
        self.hist.index_copy_(0, idx.clamp_(0, self.max_tokens), self.next)
        self.pos.add_(1)
        self.token.copy_(self.next)

    def feed(self, token: int, pos: int) -> None:
        """Set the next step's input token and position (prompt feeding)."""
        self.token.fill_(token)
        self.pos.fill_(pos)

    def replay(self) -> None:
        """One decode step. Advances the executor's epoch bookkeeping too."""
        self.graph.replay()
        self.ex._next_epoch += 1

    def decode(self, prompt: list[int], n_tokens: int) -> tuple[list[int], Timing]:
        """Feed ``prompt`` from position 0 (one replay per token), then time ``n_tokens - 1``
        further replays (one per generated token; the first generated token comes from the
        last prompt step). Returns the ``n_tokens`` greedy tokens and the per-step timing.
        Raises RuntimeError if the kernel reported an error (watchdog, bad position)."""
        p = len(prompt)
        if p + n_tokens > self.max_tokens:
            raise ValueError(f"prompt {p} + {n_tokens} tokens exceed the history of {self.max_tokens}")
        for i, t in enumerate(prompt):
            self.feed(t, i)
            self.replay()
        timing = time_per_call(self.replay, iters=n_tokens - 1, warmup=0, device=self.ex.device)
        torch.cuda.synchronize(self.ex.device)
        rec = self.ex._err.to("cpu")
        self.ex._report(self.ex.next_epoch - 1, rec)
        toks = self.hist[p - 1:p - 1 + n_tokens].tolist()
        return [int(t) for t in toks], timing
