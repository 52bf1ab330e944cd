"""Token selection after a decode step: greedy, or sampling with temperature, top-k and top-p.

Greedy decoding takes the schedule's own ``next`` token (the in-kernel argmax, identical on
every rank). Sampling reads the full logits vector (every rank's vocabulary slice, gathered
in order) and draws on the host, in the order transformers' logits warpers use:

1. temperature: ``logits / temperature``;
2. top-k: logits below the k-th largest are set to ``-inf`` (ties with the k-th are kept);
3. top-p (nucleus): ``probs = softmax(logits)``; sorted in descending order, keep the
   smallest prefix whose cumulative probability is ``>= top_p`` (always at least the most
   probable token); the rest are set to ``-inf``;
4. ``torch.multinomial(softmax(logits), 1, generator=g)``.

All arithmetic is fp32 on the CPU, so a run is reproducible across backends and machines:
``Sampler`` holds one ``torch.Generator`` per rank, each seeded once per ``generate`` call with
the same seed, and every rank draws from the same gathered logits, so every rank picks the same
token (``pipeline.Decoder`` checks it, as it checks the greedy token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from ground.errors import AmkError


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen. ``do_sample=False``: greedy (the other fields must keep their
    defaults or be None). ``temperature`` > 0; ``top_k`` >= 1 or None (no limit); ``top_p``
    in (0, 1] or None (1: no limit)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def check(self, flag: str = "") -> "SamplingParams":
        """Return self, or raise AmkError (exit 2) naming the bad value. ``flag``: spell the
        fields as command-line flags (``--top-p``) instead of keyword arguments."""
        def name(field: str) -> str:
            return "--" + field.replace("_", "-") if flag else field

        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise AmkError(f"{name('temperature')} must be a finite number, got {t!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise AmkError(f"{name('top_k')} must be an integer >= 1, got {self.top_k!r}")
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                              or not (0.0 < p <= 1.0)):
            raise AmkError(f"{name('top_p')} must be in (0, 1], got {p!r}")
        if self.do_sample:
            if t <= 0:
                raise AmkError(f"{name('temperature')} must be > 0 with {name('do_sample')}, got {t!r} "
                               "(greedy decoding is the default without it)")
        else:
            given = [f for f, v, d in (("temperature", t, 1.0), ("top_k", self.top_k, None),
                                       ("top_p", p, None)) if v is not None and v != d]
            if given:
                raise AmkError(f"{name(given[0])} only applies to sampling; add {name('do_sample')}")
        return self


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits after temperature, top-k and top-p (masked entries ``-inf``): fp32 [vocab].

    ``logits``: [vocab], any float dtype and device (the result is on the same device)."""
    import torch  # here, not at import: the CLI checks sampling flags before loading torch

    x = logits.reshape(-1).float() / float(params.temperature)
    if params.top_k is not None and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sp, idx = torch.sort(probs, descending=True)
        before = torch.cumsum(sp, dim=-1) - sp  # mass of the more probable tokens
        drop_sorted = before >= params.top_p    # the prefix already reached top_p without it
        drop = torch.zeros_like(drop_sorted).scatter(0, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token drawn from ``logits`` ([vocab]) under ``params`` with ``generator`` (a CPU
    ``torch.Generator``; one ``torch.multinomial`` draw). Returns the token id."""
    import torch

    probs = torch.softmax(warp(logits.cpu(), params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)[0])


class Sampler:
    """Per-rank samplers over the same gathered logits: rank ``r`` draws with its own
    generator, all seeded with ``seed`` (so, with the same logits, every rank draws the same
    token, as ranks in separate processes do)."""

    def __init__(self, params: SamplingParams, seed: int, ranks: Iterable[int]):
        import torch

        self.params = params.check()
        self.seed = int(seed)
        self.generators = {int(r): torch.Generator(device="cpu").manual_seed(self.seed) for r in ranks}

    def pick(self, rank: int, logits: torch.Tensor) -> int:
        """The token rank ``rank`` draws from ``logits`` ([vocab] fp32)."""
        return sample(logits, self.params, self.generators[rank])
