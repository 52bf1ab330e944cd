"""Megakernel launches replayed from CUDA graphs: ``StepGraph`` (one epoch of any program, one
replay per call) and ``DecodeGraph`` (autoregressive decoding, one replay per token).

DecodeGraph's graph holds the megakernel launch followed by the step's bookkeeping, all on the
device: ``epoch += 1``, ``pos += 1``, ``token <- next`` and ``history[pos] <- next``. A replay
is therefore one whole decode step with no host round trip; the host reads the history once
at the end. The bookkeeping is four tiny element-wise kernels (about 2 us each inside a
graph); they are part of every step a user would run, so they stay in the timed region.
"""

from __future__ import annotations

import torch

from ground.timing import Timing, time_per_call


class StepGraph:
    """One epoch of any program (a launch and ``epoch += 1``) captured in a CUDA graph, for
    programs whose inputs the caller writes into io buffers in place (the communication
    patterns of lowering/collectives.py): a replay is one call with no host round trip.

    The kernel's error records are read by ``check()``, not per replay (a read would
    synchronise); a wait that times out still ends the kernel (the watchdog), and ``check``
    then raises as ``TritonExecutor.step`` does. ``executor``: a compiled-mode
    ``TritonExecutor`` at a step boundary that has run one ``step()`` (which compiles);
    capturing runs no step. Raises RuntimeError without CUDA or before that first step.
    """

    def __init__(self, executor):
        self._require(executor)
        self.ex = executor
        self.ex._epoch.fill_(executor.next_epoch)
        torch.cuda.synchronize(executor.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()

    @classmethod
    def _require(cls, executor) -> None:
        """RuntimeError unless ``executor`` runs compiled on CUDA and has compiled its kernel
        (by a normal step first: compilation cannot happen inside a capture)."""
        if executor.device.type != "cuda":
            raise RuntimeError(f"{cls.__name__} needs the compiled (CUDA) Triton backend")
        if executor.compiled is None:
            raise RuntimeError("run one executor.step() before capturing (it compiles the kernel)")

    def _body(self) -> None:
        """What the graph holds: the launch and ``epoch += 1``."""
        ex = self.ex
        ex.arm_scratch()
        ex._kernel[(ex.workers,)](*ex._args(), **ex._launch_kw)
        ex._epoch.add_(1)

    def replay(self) -> None:
        """One epoch; advances the executor's epoch bookkeeping too."""
        self.graph.replay()
        self.ex._next_epoch += 1

    def check(self) -> None:
        """Synchronise and raise TritonWatchdogError / TritonTaskError / TritonError when the
        last replay's workers reported a failure or did not finish their queues."""
        torch.cuda.synchronize(self.ex.device)
        self.ex._report(self.ex.next_epoch - 1, self.ex._err.to("cpu"))


class DecodeGraph(StepGraph):
    """Capture ``executor``'s decode step in a CUDA graph; see the module docstring.

    ``executor``: a compiled-mode ``TritonExecutor`` whose program has io buffers
    ``token.r{r}``, ``pos.r{r}`` and ``next.r{r}`` (int32 [1]) for each of its local ranks
    (all ranks when co-located; this process's rank in a distributed run, where every rank
    process captures and replays its own graph); ``max_tokens``: history length.
    The executor must be at a step boundary and have run one ``step()``; capturing runs no
    step. Raises RuntimeError without CUDA.
    """

    def __init__(self, executor, max_tokens: int):
        self._require(executor)
        ranks = list(getattr(executor, "local_ranks", [0]))
        self.tokens = [executor._view(f"token.r{r}", r) for r in ranks]
        self.positions = [executor._view(f"pos.r{r}", r) for r in ranks]
        self.nexts = [executor._view(f"next.r{r}", r) for r in ranks]
        self.token, self.pos, self.next = self.tokens[0], self.positions[0], self.nexts[0]
        self.hist = torch.zeros(max_tokens + 1, dtype=torch.int32, device=executor.device)
        self.max_tokens = max_tokens
        super().__init__(executor)

    def _body(self) -> None:
        """The launch and ``epoch += 1``, then the step's bookkeeping (module docstring)."""
        super()._body()
        idx = self.pos.long()
        self.hist.index_copy_(0, idx.clamp_(0, self.max_tokens), self.next)
        for tok, pos, nxt in zip(self.tokens, self.positions, self.nexts):
            pos.add_(1)
            tok.copy_(nxt)

    def feed(self, token: int, pos: int) -> None:
        """Set the next step's input token and position (prompt feeding)."""
        for t, p in zip(self.tokens, self.positions):
            t.fill_(token)
            p.fill_(pos)

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
        self.check()
        toks = self.hist[p - 1:p - 1 + n_tokens].tolist()
        return [int(t) for t in toks], timing
