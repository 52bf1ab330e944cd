"""Which HF decoder configs amk can compile, and why the others are refused.

``check_support(config)`` inspects a transformers config (a ``PretrainedConfig`` or a plain
``config.json`` dict) and returns a ``SupportReport`` that lists every unsupported feature with
the config field that carries it. Nothing is loaded and no weights are touched, so it is cheap
enough to run before any download or allocation.

Supported: ``model_type`` llama (Llama 2/3.x, SmolLM/SmolLM2), qwen2, qwen3, mistral; i.e. the
pre-norm decoder ``x + Attn(RMSNorm(x))``, ``x + SwiGLU(RMSNorm(x))`` with GQA, RoPE (default or
llama3 frequency scaling), optional qkv bias (qwen2 only), per-head q/k RMSNorm (qwen3 only),
tied or untied LM head.

Both config generations are read: transformers 5.x keeps RoPE in ``rope_parameters`` (a dict
with ``rope_type``, ``rope_theta``, ...), 4.x in ``rope_theta`` + ``rope_scaling``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type -> family name reported by `amk info`.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "mistral",
}

# RoPE variants the lowering implements (transformers' ROPE_INIT_FUNCTIONS names).
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Fields whose presence with a positive value means a mixture-of-experts MLP.
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Fields that mean multi-head latent attention (DeepSeek-V2/V3 style).
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank")
# Fields that turn on per-head q/k normalisation in other families.
_QK_NORM_FIELDS = ("use_qk_norm", "qk_layernorm", "qk_norm")


@dataclass
class Unsupported:
    """One feature amk cannot compile.

    feature: short name (e.g. "mixture of experts"); field: the config field that carries it
    (e.g. "num_local_experts"); value: that field's value; why: one sentence for the user.
    """

    feature: str
    field: str
    value: Any
    why: str

    def __str__(self) -> str:
        return f"{self.feature} ({self.field}={self.value!r}): {self.why}"


@dataclass
class SupportReport:
    """Result of ``check_support``.

    family: amk's family name for a supported model_type, else None; model_type: the config's
    ``model_type`` ("" when missing); unsupported: every refused feature (empty when ok).
    """

    family: str | None
    model_type: str
    unsupported: list[Unsupported] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the config has no unsupported feature."""
        return not self.unsupported

    def summary(self) -> str:
        """One line: "supported" or the unsupported features joined by "; "."""
        if self.ok:
            return "supported"
        return "; ".join(str(u) for u in self.unsupported)


def _get(config: Any, name: str, default: Any = None) -> Any:
    """Read a field from a config object or a config.json dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE parameters as one dict, for transformers 4.x and 5.x configs.

    Returns a dict with at least ``rope_type`` (str) and ``rope_theta`` (float), plus the
    scaling keys of that type (for llama3: ``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``). Missing theta defaults to
    10000.0 (the default of every supported family's config class).
    """
    params: dict[str, Any] = {}
    v5 = _get(config, "rope_parameters")
    if isinstance(v5, dict) and v5:
        params.update(v5)
    else:
        scaling = _get(config, "rope_scaling")
        if isinstance(scaling, dict):
            params.update(scaling)
        theta = _get(config, "rope_theta")
        if theta is not None:
            params["rope_theta"] = theta
    # 4.x spelled the type "type" in older checkpoints.
    rope_type = params.get("rope_type", params.get("type")) or "default"
    params["rope_type"] = rope_type
    params.pop("type", None)
    params["rope_theta"] = float(params.get("rope_theta", 10000.0))
    return params


def head_dim(config: Any) -> int:
    """Per-head dimension: the explicit ``head_dim`` field, else hidden_size // heads."""
    hd = _get(config, "head_dim")
    if hd:
        return int(hd)
    return int(_get(config, "hidden_size")) // int(_get(config, "num_attention_heads"))


def _truthy_positive(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (int, float)):
        return value > 0
    return bool(value)


def check_support(config: Any) -> SupportReport:
    """List every feature of ``config`` that amk cannot compile, naming its config field.

    config: a transformers ``PretrainedConfig`` or a ``config.json`` dict.
    Returns a SupportReport; never raises on odd values (they become Unsupported entries).
    Refused: unknown model types, mixture of experts, sliding-window attention in use,
    multi-head latent attention, activations other than silu, RoPE types other than
    default/llama3, partial rotary, attention bias on llama/mistral/qwen3 (only qwen2's qkv
    bias is modelled), MLP bias, q/k norm outside qwen3, hidden size not divisible by the
    head count without an explicit head_dim, odd head_dim, query heads not a multiple of KV
    heads, and pre-quantized checkpoints (GPTQ/AWQ/...; GGUF is dequantized on load and fine).
    """
    model_type = str(_get(config, "model_type", "") or "")
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    out: list[Unsupported] = []

    def refuse(feature: str, field_name: str, value: Any, why: str) -> None:
        out.append(Unsupported(feature, field_name, value, why))

    if family is None:
        known = ", ".join(sorted(SUPPORTED_MODEL_TYPES))
        refuse("model type", "model_type", model_type or None,
               f"amk supports the decoder families {known}")

    for name in _MOE_FIELDS:
        value = _get(config, name)
        if _truthy_positive(value):
            refuse("mixture of experts", name, value,
                   "amk lowers dense SwiGLU MLPs only, not routed experts")

    for name in _MLA_FIELDS:
        value = _get(config, name)
        if value is not None:
            refuse("multi-head latent attention", name, value,
                   "amk lowers GQA attention with full-rank K/V projections only")

    _check_sliding_window(config, model_type, refuse)

    act = _get(config, "hidden_act", "silu")
    if act != "silu":
        refuse("activation", "hidden_act", act, "amk's MLP op is SwiGLU with silu")

    rope = rope_parameters(config)
    if rope["rope_type"] not in SUPPORTED_ROPE_TYPES:
        field_name = "rope_parameters" if isinstance(_get(config, "rope_parameters"), dict) \
            else "rope_scaling"
        refuse("RoPE scaling", f"{field_name}.rope_type", rope["rope_type"],
               f"amk implements RoPE types {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = _get(config, "partial_rotary_factor")
    if partial is None:
        partial = rope.get("partial_rotary_factor")
    if partial is not None and float(partial) < 1.0:
        refuse("partial rotary embedding", "partial_rotary_factor", partial,
               "amk rotates the whole head dimension")

    attn_bias = _get(config, "attention_bias")
    if attn_bias and model_type in ("llama", "mistral", "qwen3"):
        refuse("attention bias", "attention_bias", attn_bias,
               "amk models q/k/v bias only for qwen2 (and never an o_proj bias)")
    mlp_bias = _get(config, "mlp_bias")
    if mlp_bias:
        refuse("MLP bias", "mlp_bias", mlp_bias, "amk's gate/up/down GEMVs have no bias")

    if model_type != "qwen3":
        for name in _QK_NORM_FIELDS:
            value = _get(config, name)
            if value:
                refuse("q/k norm", name, value, "amk applies per-head q/k RMSNorm only for qwen3")

    _check_heads(config, refuse)

    quant = _get(config, "quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else \
            getattr(quant, "quant_method", None)
        method = getattr(method, "value", method)
        # transformers' GGUF loader records quant_method "gguf" but dequantizes on load.
        if str(method).lower() != "gguf":
            refuse("pre-quantized weights", "quantization_config.quant_method", method,
                   "amk compiles fp32/bf16 weights; use an unquantized or GGUF checkpoint")

    return SupportReport(family=family, model_type=model_type, unsupported=out)


def _check_sliding_window(config: Any, model_type: str, refuse) -> None:
    """Refuse sliding-window attention only when some layer actually uses it."""
    layer_types = _get(config, "layer_types")
    if isinstance(layer_types, (list, tuple)) and layer_types:
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        if sliding:
            refuse("sliding-window attention", "layer_types",
                   f"{layer_types[sliding[0]]} on {len(sliding)} of {len(layer_types)} layers",
                   "amk attends over the full KV cache in every layer")
            return
    window = _get(config, "sliding_window")
    if window is None:
        return
    if model_type == "mistral":
        max_pos = _get(config, "max_position_embeddings")
        if max_pos is None or window < max_pos:
            refuse("sliding-window attention", "sliding_window", window,
                   f"window smaller than max_position_embeddings={max_pos}; amk attends over "
                   "the full KV cache")
    elif model_type in ("qwen2", "qwen3"):
        # Without layer_types (4.x dicts): qwen2/3 slide on layers >= max_window_layers.
        if _get(config, "use_sliding_window") and layer_types is None:
            n_layers = int(_get(config, "num_hidden_layers", 0) or 0)
            max_window_layers = _get(config, "max_window_layers", 0) or 0
            if max_window_layers < n_layers:
                refuse("sliding-window attention", "use_sliding_window", True,
                       f"sliding_window={window} on layers >= {max_window_layers}; amk attends "
                       "over the full KV cache")
    elif model_type == "llama":
        pass  # HF llama ignores the field.


def _check_heads(config: Any, refuse) -> None:
    hidden = _get(config, "hidden_size")
    n_heads = _get(config, "num_attention_heads")
    n_kv = _get(config, "num_key_value_heads") or n_heads
    if not isinstance(hidden, int) or not isinstance(n_heads, int) or n_heads <= 0 \
            or not isinstance(n_kv, int) or n_kv <= 0:
        refuse("attention shape", "num_attention_heads", n_heads,
               "hidden_size, num_attention_heads and num_key_value_heads must be positive integers")
        return
    hd = _get(config, "head_dim")
    explicit = bool(hd) and not (hidden % n_heads != 0 and hd == hidden // n_heads)
    if not explicit and hidden % n_heads != 0:
        refuse("attention shape", "num_attention_heads", n_heads,
               f"hidden_size={hidden} is not divisible by the head count and head_dim is not set")
    hd_value = int(hd) if hd else hidden // n_heads
    if hd_value % 2 != 0:
        refuse("odd head dimension", "head_dim", hd_value, "RoPE rotates pairs of dimensions")
    if n_heads % n_kv != 0:
        refuse("attention shape", "num_key_value_heads", n_kv,
               f"num_attention_heads={n_heads} is not a multiple of it (GQA groups must be equal)")


def tp_degrees(n_heads: int, n_kv_heads: int, max_r: int = 8) -> list[int]:
    """Tensor-parallel degrees 1..max_r that split query and KV heads evenly.

    A degree r is listed when r divides both n_heads and n_kv_heads, so every rank owns the
    same number of whole query heads and whole KV heads (and its query heads' KV heads).
    amk also lowers uneven splits (a rank may own 5 heads and another 4), at the cost of load
    imbalance; these are the balanced ones. Raises ValueError for non-positive counts.
    """
    if n_heads <= 0 or n_kv_heads <= 0 or max_r <= 0:
        raise ValueError(f"head counts and max_r must be positive: {n_heads}, {n_kv_heads}, {max_r}")
    return [r for r in range(1, max_r + 1) if n_heads % r == 0 and n_kv_heads % r == 0]
