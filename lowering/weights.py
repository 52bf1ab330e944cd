"""Materialise a buffer's initial contents for a rank: weights from the HF state dict (sliced
as ``Buffer.source`` says), derived ``amk.*`` tensors, zeroed KV caches.

Used by the sim backend (as its ``init_fn``) and by the Triton backend when it packs weights.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ground.errors import AmkError
from ir.program import Buffer, ScheduleProgram
from models.graph import ROPE_INV_FREQ_KEY, ModelSpec
from lowering.quant import TORCH_QDTYPE, parse_qweight_key, parse_scale_key, quantize_as
from models.rope import inv_freq

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
                "i32": torch.int32, "i8": torch.int8, "f8e4m3": torch.float8_e4m3fn}


def derived_tensor(key: str, spec: ModelSpec) -> torch.Tensor:
    """A tensor amk derives from the model config, by ``amk.*`` key.

    ``amk.rope_inv_freq``: RoPE inverse frequencies, fp32 [head_dim / 2] (models/rope.py).
    Raises AmkError for an unknown key.
    """
    if key == ROPE_INV_FREQ_KEY:
        return inv_freq(spec.rope, spec.head_dim)
    raise AmkError(f"unknown derived weight key {key!r}")


class WeightStore:
    """Resolves weight sources against a state dict (key -> tensor) and a ModelSpec.

    Derived tensors are computed once and cached. The state dict is not copied: slices are
    views, cast only when the buffer's dtype differs from the tensor's.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], spec: ModelSpec):
        self.state = state
        self.spec = spec
        self._derived: dict[str, torch.Tensor] = {}
        self._quant: dict[tuple[str, str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def quantized(self, key: str, qdtype: str, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, scale)`` of the whole weight ``key`` quantized to ``qdtype`` per row
        (``group`` 0) or per ``group`` K elements (int8 only; lowering/quant.py), computed
        once."""
        if (key, qdtype, group) not in self._quant:
            self._quant[(key, qdtype, group)] = quantize_as(self.source_tensor(key), qdtype, group)
        return self._quant[(key, qdtype, group)]

    def source_tensor(self, key: str) -> torch.Tensor:
        sk = parse_scale_key(key)
        if sk is not None:
            return self.quantized(sk[1], sk[0], sk[2])[1]
        qk = parse_qweight_key(key)
        if qk is not None:
            return self.quantized(qk[1], qk[0], qk[2])[0]
        if key.startswith("amk."):
            if key not in self._derived:
                self._derived[key] = derived_tensor(key, self.spec)
            return self._derived[key]
        try:
            return self.state[key]
        except KeyError:
            raise AmkError(f"weight {key!r} is not in the model's state dict") from None

    def buffer_tensor(self, buf: Buffer) -> torch.Tensor | None:
        """Initial contents of ``buf`` (same on every rank that holds it), or None when the
        buffer starts unwritten (activations, io buffers).

        weight: ``source.key`` sliced by ``source.ranges`` (one (start, stop) per axis;
        empty = whole tensor), cast to the buffer dtype; its shape must equal the buffer's
        (AmkError otherwise). A quantized weight (dtype ``i8`` / ``f8e4m3``): the whole tensor
        quantized per row, then sliced; its scales are the source ``amk.scale.<dtype>:<key>``
        (per group: the sources ``amk.qweight.i8/<group>:<key>`` and
        ``amk.scale.i8/<group>:<key>``, lowering/quant.py).
        kv_cache: zeros.
        """
        dtype = TORCH_DTYPES[buf.dtype]
        if buf.kind == "kv_cache":
            return torch.zeros(buf.shape, dtype=dtype)
        if buf.kind != "weight":
            return None
        if buf.source is None:
            raise AmkError(f"weight buffer {buf.name} has no source")
        if buf.dtype in TORCH_QDTYPE and parse_qweight_key(buf.source.key) is None:
            t = self.quantized(buf.source.key, buf.dtype)[0]
        else:
            t = self.source_tensor(buf.source.key)
        if buf.source.ranges:
            if len(buf.source.ranges) != t.dim():
                raise AmkError(f"weight buffer {buf.name}: source {buf.source.key} has {t.dim()} "
                               f"axes, the slice names {len(buf.source.ranges)}")
            for ax, (a, b) in enumerate(buf.source.ranges):
                if not (0 <= a <= b <= t.shape[ax]):
                    raise AmkError(f"weight buffer {buf.name}: slice {a}:{b} of axis {ax} is "
                                   f"outside {buf.source.key} {list(t.shape)}")
            t = t[tuple(slice(a, b) for a, b in buf.source.ranges)]
        if tuple(t.shape) != tuple(buf.shape):
            raise AmkError(f"weight buffer {buf.name}: source {buf.source.key} slice has shape "
                           f"{list(t.shape)}, buffer {list(buf.shape)}")
        return t.detach().to(dtype)


def make_init_fn(state: Mapping[str, torch.Tensor], spec: ModelSpec
                 ) -> Callable[[Buffer, int], torch.Tensor | None]:
    """An ``init_fn(buffer, rank)`` for SimExecutor / TritonExecutor."""
    store = WeightStore(state, spec)

    def init_fn(buf: Buffer, rank: int) -> torch.Tensor | None:
        return store.buffer_tensor(buf)

    return init_fn


def weight_bytes(program: ScheduleProgram) -> dict[int, int]:
    """Bytes of weight buffers each rank holds (symmetric weights count on every rank)."""
    out = {r: 0 for r in range(program.ranks)}
    for b in program.buffers:
        if b.kind != "weight":
            continue
        ranks = range(program.ranks) if b.placement == "symmetric" else [b.rank]
        for r in ranks:
            out[r] += b.nbytes
    return out


def state_dict_of(model: Any) -> dict[str, torch.Tensor]:
    """The model's state dict (tensors are shared with the model, not copied)."""
    return model.state_dict()
