"""Prefill: the prompt's KV-cache rows in one forward pass, written into amk's cache layout.

A lowered program keeps one key and one value cache per layer and rank,
``kc.l{i}.r{r}`` / ``vc.l{i}.r{r}`` (kind ``kv_cache``, shape ``[G_r, max_seq, head_dim]`` in
the program's dtype), holding rank r's KV heads ``[g0, g1)`` (those of its query heads; the
rank's ``w.l{i}.k`` weight slice names them), keys after RoPE (and after ``k_norm`` where the
model has one), exactly as HF's ``DynamicCache`` stores them. The decode step's
``kv_append`` writes row ``pos``; attention reads rows ``0..pos``.

``Prefiller.fill(tokens)`` runs the HF decoder body (no LM head) over ``tokens`` at
positions ``0..n-1`` in one causal forward (SDPA attention) into a ``DynamicCache`` and copies
each layer's keys and values, per local rank, into rows ``0..n-1`` of that rank's caches
through the executor's ``write``. The forward runs on the executor's device in the program's
dtype: on the CPU in fp32 it is the resolved model itself; otherwise a copy of the model
converted once (the first ``fill``) and kept, which costs a second copy of the weights in
that dtype on the device.

``pipeline.Decoder.generate(..., prefill=...)`` fills the cache for all prompt tokens but the
last and feeds the last one through the decode step, so the first new token (and its logits)
comes from the schedule like every later one.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from ground.errors import AmkError

_KC = re.compile(r"^kc\.l(\d+)\.r(\d+)$")


def cache_slots(program: Any) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(layer, rank): (g0, n_kv)}`` for every key cache ``kc.l{i}.r{r}`` of ``program``:
    the first global KV head the rank's cache holds (from its ``w.l{i}.k`` weight slice) and
    how many. Raises AmkError when the program's caches or K weights are not laid out as the
    lowering lays them out (a hand-edited program)."""
    bufs = {b.name: b for b in program.buffers}
    out = {}
    for b in program.buffers:
        m = _KC.match(b.name)
        if not m or b.kind != "kv_cache":
            continue
        i, r = int(m.group(1)), int(m.group(2))
        n_kv, _, d = b.shape
        w = bufs.get(f"w.l{i}.k.r{r}")
        v = bufs.get(f"vc.l{i}.r{r}")
        if w is None or w.source is None or not w.source.ranges or v is None or v.shape != b.shape:
            raise AmkError(f"prefill: program {program.name!r} has cache {b.name} without the "
                           f"matching vc.l{i}.r{r} and w.l{i}.k.r{r} slice; use --prefill 0")
        lo, hi = w.source.ranges[0]
        if lo % d or (hi - lo) != n_kv * d:
            raise AmkError(f"prefill: {w.name} rows {lo}:{hi} are not {n_kv} whole heads of {d}")
        out[(i, r)] = (lo // d, n_kv)
    if not out:
        raise AmkError(f"prefill: program {program.name!r} has no KV caches (kc.l*.r*)")
    return out


class Prefiller:
    """Fill the KV caches of ``executor`` (running ``program``) for a prompt with one HF
    forward of ``model`` (see the module docstring). ``dtype``: the program's float dtype
    (``f32``, ``bf16``, ``f16``); ``device``: where the executor's memory lives (default: its
    ``device`` attribute, else the CPU)."""

    def __init__(self, model: Any, program: Any, executor: Any, dtype: str,
                 device: Any = None):
        from lowering.reference import torch_dtype

        self.src = model
        self.program = program
        self.ex = executor
        self.dtype = torch_dtype(dtype)
        self.device = torch.device(device if device is not None else getattr(executor, "device", "cpu"))
        self.slots = cache_slots(program)
        local = set(getattr(executor, "local_ranks", range(program.ranks)))
        self.slots = {k: v for k, v in self.slots.items() if k[1] in local}
        self.layers = 1 + max(i for i, _ in cache_slots(program))
        self.max_seq = next(b.shape[1] for b in program.buffers if _KC.match(b.name))
        self._model = None
        self.seconds = 0.0  # wall time of the last fill (forward + cache writes)

    def _prepared(self):
        """The model that runs the forward: the source model when it already has the dtype
        and device, else a converted copy (made once)."""
        if self._model is None:
            p = next(self.src.parameters())
            if p.dtype == self.dtype and p.device == self.device:
                self._model = self.src
            else:
                import copy

                self._model = copy.deepcopy(self.src).to(device=self.device, dtype=self.dtype)
                try:  # SDPA on the copy (the shared model is left as resolved: SDPA by default)
                    self._model.set_attn_implementation("sdpa")
                except Exception:  # noqa: BLE001 - a model without SDPA keeps its own attention
                    pass
        return self._model

    def kv(self, tokens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (keys, values) of ``tokens`` at positions 0..n-1: [kv_heads, n,
        head_dim] tensors in the program's dtype on the device (the HF forward's cache)."""
        from transformers import DynamicCache

        from amk.pipeline import hf_cache_kwargs

        m = self._prepared()
        body = m.get_decoder() if hasattr(m, "get_decoder") else m.model
        cache = DynamicCache()
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        with torch.no_grad():
            body(input_ids=ids, use_cache=True, **hf_cache_kwargs(body, cache))
        layers = cache.layers
        if len(layers) != self.layers:
            raise AmkError(f"prefill: the HF model has {len(layers)} cache layers, the program "
                           f"{self.layers}")
        return [(lay.keys[0], lay.values[0]) for lay in layers]

    def fill(self, tokens: Sequence[int]) -> None:
        """Write the cache rows of ``tokens`` at positions 0..n-1 on every local rank
        (each cache is written whole: rows >= n become 0, and attention never reads past the
        current position before the decode step's kv_append has written it).
        Raises AmkError when n exceeds the caches' max_seq."""
        import time

        n = len(tokens)
        if n == 0:
            return
        if n > self.max_seq:
            raise AmkError(f"prefill of {n} tokens exceeds the KV cache of {self.max_seq} tokens")
        t0 = time.perf_counter()
        kv = self.kv(tokens)
        for (i, r), (g0, nkv) in sorted(self.slots.items()):
            k, v = kv[i]
            for name, src in ((f"kc.l{i}.r{r}", k), (f"vc.l{i}.r{r}", v)):
                full = torch.zeros((nkv, self.max_seq, src.shape[-1]), dtype=src.dtype,
                                   device=src.device)
                full[:, :n] = src[g0:g0 + nkv]
                self.ex.write(name, r, full)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds = time.perf_counter() - t0
