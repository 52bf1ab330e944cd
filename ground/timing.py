"""Timing and roofline utilities shared by `amk bench`, the search and bench/ scripts.

Method (the device README's METHOD.md): time device work with CUDA events after a warm-up,
repeat many times and report the median and spread; measure the memory ceiling once per run
with a large device-to-device copy, counting bytes read plus bytes written.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    """Per-call latencies in milliseconds: median, p10, p90, min, and the sample count."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    min_ms: float
    n: int

    @staticmethod
    def of(samples_ms: list[float]) -> "Timing":
        if not samples_ms:
            raise ValueError("no timing samples")
        s = sorted(samples_ms)

        def q(p: float) -> float:
            return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

        return Timing(statistics.median(s), q(0.1), q(0.9), s[0], len(s))

    def to_json(self) -> dict:
        return asdict(self)


def time_per_call(fn: Callable[[], object], iters: int, warmup: int = 5,
                  device: torch.device | str | None = None) -> Timing:
    """Latency of ``fn()`` per call, one sample per call.

    On CUDA each call is bracketed by CUDA events (device time including launch gaps);
    on CPU by ``time.perf_counter``. ``warmup`` calls run first and are not timed.
    """
    dev = torch.device(device) if device is not None else None
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(dev)
        samples = [a.elapsed_time(b) for a, b in zip(starts, ends)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return Timing.of(samples)


def measure_hbm_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30,
                          iters: int = 20) -> float:
    """Measured device-memory bandwidth in bytes/s: a device-to-device copy of ``nbytes``,
    counting bytes read plus bytes written (2 * nbytes per copy), median over ``iters``.

    Raises RuntimeError if ``device`` is not a CUDA device.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise RuntimeError("HBM bandwidth can only be measured on a CUDA device")
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).uniform_()
    dst = torch.empty_like(src)
    t = time_per_call(lambda: dst.copy_(src), iters=iters, warmup=3, device=dev)
    return 2 * nbytes / (t.median_ms * 1e-3)


def _element_size(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    """Bytes per element of ``t``, or of ``dtype`` when given (a size override)."""
    return torch.empty(0, dtype=dtype).element_size() if dtype else t.element_size()


def weight_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the model's unique parameters (tied weights counted once).

    ``dtype`` overrides the element size (e.g. bf16 bytes for a model held in fp32).
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * _element_size(p, dtype)
    return total


def decode_weight_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Weight bytes one batch-1 decode step must read: the roofline's traffic.

    Every weight is read once per token, except an UNTIED input embedding table, of which
    only one row is read. Tied embeddings are read in full once, as the lm_head.
    """
    total = weight_bytes(model, dtype)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and out is not None and emb.weight.data_ptr() != out.weight.data_ptr():
        total -= (emb.weight.shape[0] - 1) * emb.weight.shape[1] * _element_size(emb.weight, dtype)
    return total


def roofline_ms(nbytes: int, bandwidth_bytes_per_s: float) -> float:
    """The memory-roofline floor in milliseconds: bytes / bandwidth."""
    return nbytes / bandwidth_bytes_per_s * 1e3
