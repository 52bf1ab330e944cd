"""RoPE parameters read from an HF config, and the inverse frequencies amk feeds its ``rope`` op.

Supported rope types: ``default`` (the original RoPE of Su et al., as in HF Llama) and
``llama3`` (the frequency-dependent scaling of Llama 3.1/3.2). Both have an attention scaling
of 1.0, so ``cos``/``sin`` are used unscaled, which is what the ``rope`` IR op implements.

The arithmetic below is the same sequence of torch fp32 operations as transformers'
``LlamaRotaryEmbedding.compute_default_rope_parameters`` and
``modeling_rope_utils._compute_llama3_parameters`` (transformers 5.x), so the result is
bit-identical to what HF computes; tests/test_import.py checks that equality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ground.errors import AmkError
from models.features import rope_parameters

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """RoPE settings of a model.

    ``theta``: base wavelength. For ``llama3``: ``factor``, ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position`` (tokens) as in the HF config's
    ``rope_parameters`` (5.x) / ``rope_scaling`` (4.x).
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def rope_spec_from_config(config: Any) -> RopeSpec:
    """Build a RopeSpec from an HF config.

    Reads ``rope_parameters`` (transformers 5.x) or ``rope_theta`` + ``rope_scaling`` (4.x)
    through ``models.features.rope_parameters``. Raises AmkError naming the config field for
    rope types other than default/llama3, for partial rotary embeddings, and for a llama3
    scaling with missing parameters.
    """
    d = rope_parameters(config)
    field_name = "rope_parameters" if isinstance(getattr(config, "rope_parameters", None), dict) \
        else "rope_scaling"
    rtype = d.get("rope_type") or "default"
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise AmkError(f"unsupported feature: rope type {rtype!r} (config field "
                       f"{field_name}.rope_type); amk supports {', '.join(SUPPORTED_ROPE_TYPES)}")
    prf = d.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if prf is not None and float(prf) != 1.0:
        raise AmkError(f"unsupported feature: partial rotary embedding (config field "
                       f"partial_rotary_factor = {prf}); amk rotates the whole head")
    theta = float(d["rope_theta"])
    if rtype == "default":
        return RopeSpec("default", theta)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings") if d.get(k) is None]
    if missing:
        raise AmkError(f"llama3 rope scaling without {', '.join(missing)} "
                       f"(config field {field_name})")
    return RopeSpec("llama3", theta, float(d["factor"]), float(d["low_freq_factor"]),
                    float(d["high_freq_factor"]), int(d["original_max_position_embeddings"]))


def inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies, fp32 tensor of shape ``[head_dim // 2]`` (radians per token).

    ``default``: ``1 / theta ** (arange(0, head_dim, 2) / head_dim)``.
    ``llama3``: the default frequencies with wavelengths above
    ``original_max_position / low_freq_factor`` divided by ``factor``, those below
    ``original_max_position / high_freq_factor`` kept, and a linear blend in between
    (Meta's Llama 3.1 reference, as transcribed by transformers).
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int, got {head_dim}")
    base = rope.theta
    dim = head_dim
    if rope.type == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if rope.type != "llama3":
        raise ValueError(f"unsupported rope type {rope.type!r}")
    freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    factor = rope.factor
    low, high = rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_freq_wavelen, freq / factor, freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
