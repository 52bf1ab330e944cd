"""The model graph of one decode step (token -> logits) for the supported decoder families.

``import_model(model, config)`` turns a transformers causal LM (Llama / SmolLM2 / Llama-3.x,
Qwen2/2.5, Qwen3, Mistral) into a ``ModelGraph``: a ``ModelSpec`` (the shapes and settings
the lowering needs) and a flat list of ``GraphOp`` in execution order, each naming its input
and output values and the state-dict keys of its weights. The graph is the contract between
models/ and lowering/: the lowering never looks at the HF module tree, only at this graph and
at the state dict through ``WeightRef`` keys.

One decoder layer (HF ``LlamaDecoderLayer`` and its Qwen2/Qwen3/Mistral copies)::

    xn = rmsnorm(x, input_layernorm)
    q, k, v = linear(xn, q_proj[, bias]), linear(xn, k_proj[, bias]), linear(xn, v_proj[, bias])
    q, k = rmsnorm_per_head(q, q_norm), rmsnorm_per_head(k, k_norm)        # qwen3 only
    q, k = rope(q, pos), rope(k, pos)
    kv_append(k, v) -> kc, vc ; a = attention(q, kc, vc)                   # GQA, scale 1/sqrt(D)
    h = x + linear(a, o_proj)
    hn = rmsnorm(h, post_attention_layernorm)
    x' = h + linear(swiglu(linear(hn, gate_proj), linear(hn, up_proj)), down_proj)

then ``xf = rmsnorm(x_L, model.norm)``, ``logits = lm_head(xf)`` (weight ``lm_head.weight``,
or ``model.embed_tokens.weight`` when the embeddings are tied).

Refusals: every feature ``models.features.check_support`` lists, plus any parameter of the
model that this graph does not consume (an unmodelled bias, an extra norm, ...) and any weight
whose shape differs from what the config implies. A model we would compute wrongly is never
accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ground.errors import AmkError
from models.rope import RopeSpec, rope_spec_from_config

GRAPH_OPS = ("embed", "rmsnorm", "linear", "rope", "kv_append", "attention", "swiglu", "add",
             "lm_head")

# Derived (non-state-dict) tensors live under this key prefix (see lowering/weights.py).
ROPE_INV_FREQ_KEY = "amk.rope_inv_freq"


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and settings of a decoder model (units: elements, tokens).

    ``heads``/``kv_heads``: query / key-value heads; ``head_dim``: per-head width (may differ
    from hidden/heads, e.g. Qwen3); ``intermediate``: SwiGLU width; ``eps``: RMSNorm epsilon;
    ``tie``: lm_head shares the embedding matrix; ``qkv_bias``: q/k/v projections have
    biases (Qwen2); ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3); ``dtype``:
    the dtype of the loaded weights ("f32" / "bf16" / "f16"); ``max_position``: the config's
    ``max_position_embeddings``.
    """

    family: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope: RopeSpec
    tie: bool
    qkv_bias: bool
    qk_norm: bool
    dtype: str = "f32"
    max_position: int = 0

    @property
    def group(self) -> int:
        """Query heads per KV head (the GQA group size)."""
        return self.heads // self.kv_heads

    @property
    def attn_scale(self) -> float:
        """Softmax scale ``head_dim ** -0.5`` (as every supported HF family uses)."""
        return float(self.head_dim) ** -0.5

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "rope"}
        d["rope"] = self.rope.to_json()
        return d


@dataclass(frozen=True)
class WeightRef:
    """A weight of the graph: a state-dict key (or ``amk.*`` derived key) and its shape."""

    key: str
    shape: tuple[int, ...]


@dataclass
class GraphOp:
    """One op of the decode-step graph.

    ``op``: one of GRAPH_OPS. ``ins``/``outs``: value names (see ModelGraph.values).
    ``weights``: role -> WeightRef (roles: ``table``, ``w``, ``bias``, ``inv_freq``).
    ``params``: op settings; linear ops carry ``role`` (q, k, v, o, gate, up, down) and ``tp``
    (how the lowering splits it over ranks: ``heads_q``, ``heads_kv``, ``cols`` = column
    parallel; ``rows`` = row parallel, output is a partial sum). ``layer``: decoder layer
    index, or None for embed / final norm / lm_head.
    """

    op: str
    name: str
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    weights: dict[str, WeightRef] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None


@dataclass
class ModelGraph:
    """A decode step as ops over named values.

    ``values``: value name -> shape. Inputs: ``token`` [1] and ``pos`` [1] (int32); state:
    ``kc.l{i}``/``vc.l{i}`` [kv_heads, max_seq, head_dim] (the KV cache; max_seq is chosen by
    the lowering, so it is recorded as 0 here); output: ``logits`` [vocab].
    """

    spec: ModelSpec
    ops: list[GraphOp]
    values: dict[str, tuple[int, ...]]
    name: str = "model"

    def weight_refs(self) -> dict[str, WeightRef]:
        """Every weight key the graph reads -> its ref (derived ``amk.*`` keys included)."""
        out: dict[str, WeightRef] = {}
        for op in self.ops:
            for ref in op.weights.values():
                out[ref.key] = ref
        return out

    def layer_ops(self, layer: int) -> list[GraphOp]:
        return [op for op in self.ops if op.layer == layer]


_DTYPE_NAMES = {"torch.float32": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}


def spec_from_config(config: Any, dtype: str = "f32") -> ModelSpec:
    """Build a ModelSpec from an HF config after ``check_support`` accepted it.

    Raises AmkError naming every unsupported feature and its config field.
    """
    from models.features import check_support

    report = check_support(config)
    if not report.ok:
        raise AmkError("unsupported model: " + report.summary())
    rope = rope_spec_from_config(config)
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    hd = int(getattr(config, "head_dim", None) or hidden // heads)
    mt = report.model_type
    qkv_bias = mt == "qwen2"  # Qwen2Attention always builds q/k/v with bias=True
    return ModelSpec(
        family=report.family or mt, model_type=mt, layers=int(config.num_hidden_layers),
        hidden=hidden, heads=heads, kv_heads=kv, head_dim=hd,
        intermediate=int(config.intermediate_size), vocab=int(config.vocab_size),
        eps=float(config.rms_norm_eps), rope=rope,
        tie=bool(getattr(config, "tie_word_embeddings", False)), qkv_bias=qkv_bias,
        qk_norm=mt == "qwen3", dtype=dtype,
        max_position=int(getattr(config, "max_position_embeddings", 0) or 0),
    )


def build_graph(spec: ModelSpec, name: str = "model") -> ModelGraph:
    """The decode-step graph of ``spec`` (no weights are touched)."""
    H, D, I, V = spec.hidden, spec.head_dim, spec.intermediate, spec.vocab
    nq, nkv = spec.heads * D, spec.kv_heads * D
    ops: list[GraphOp] = []
    values: dict[str, tuple[int, ...]] = {"token": (1,), "pos": (1,)}

    def val(name: str, shape: tuple[int, ...]) -> str:
        values[name] = shape
        return name

    def linear(layer: int, role: str, tp: str, x: str, out: str, key: str, n: int, k: int,
               bias: bool) -> None:
        w = {"w": WeightRef(f"{key}.weight", (n, k))}
        if bias:
            w["bias"] = WeightRef(f"{key}.bias", (n,))
        ops.append(GraphOp("linear", f"l{layer}.{role}", (x,), (val(out, (n,)),), w,
                           {"role": role, "tp": tp}, layer))

    inv = WeightRef(ROPE_INV_FREQ_KEY, (D // 2,))
    ops.append(GraphOp("embed", "embed", ("token",), (val("x.l0", (H,)),),
                       {"table": WeightRef("model.embed_tokens.weight", (V, H))}))
    for i in range(spec.layers):
        p = f"model.layers.{i}"
        x = f"x.l{i}"
        ops.append(GraphOp("rmsnorm", f"l{i}.ln1", (x,), (val(f"xn.l{i}", (H,)),),
                           {"w": WeightRef(f"{p}.input_layernorm.weight", (H,))},
                           {"dim": H, "eps": spec.eps}, i))
        linear(i, "q", "heads_q", f"xn.l{i}", f"q.l{i}", f"{p}.self_attn.q_proj", nq, H,
               spec.qkv_bias)
        linear(i, "k", "heads_kv", f"xn.l{i}", f"k.l{i}", f"{p}.self_attn.k_proj", nkv, H,
               spec.qkv_bias)
        linear(i, "v", "heads_kv", f"xn.l{i}", f"v.l{i}", f"{p}.self_attn.v_proj", nkv, H,
               spec.qkv_bias)
        q, k = f"q.l{i}", f"k.l{i}"
        if spec.qk_norm:
            ops.append(GraphOp("rmsnorm", f"l{i}.q_norm", (q,), (val(f"qn.l{i}", (nq,)),),
                               {"w": WeightRef(f"{p}.self_attn.q_norm.weight", (D,))},
                               {"dim": D, "eps": spec.eps}, i))
            ops.append(GraphOp("rmsnorm", f"l{i}.k_norm", (k,), (val(f"kn.l{i}", (nkv,)),),
                               {"w": WeightRef(f"{p}.self_attn.k_norm.weight", (D,))},
                               {"dim": D, "eps": spec.eps}, i))
            q, k = f"qn.l{i}", f"kn.l{i}"
        ops.append(GraphOp("rope", f"l{i}.rope_q", (q, "pos"), (val(f"qr.l{i}", (nq,)),),
                           {"inv_freq": inv}, {"head_dim": D}, i))
        ops.append(GraphOp("rope", f"l{i}.rope_k", (k, "pos"), (val(f"kr.l{i}", (nkv,)),),
                           {"inv_freq": inv}, {"head_dim": D}, i))
        kc, vc = val(f"kc.l{i}", (spec.kv_heads, 0, D)), val(f"vc.l{i}", (spec.kv_heads, 0, D))
        ops.append(GraphOp("kv_append", f"l{i}.kv_append", (f"kr.l{i}", f"v.l{i}", "pos"),
                           (kc, vc), {}, {"head_dim": D}, i))
        ops.append(GraphOp("attention", f"l{i}.attn", (f"qr.l{i}", kc, vc, "pos"),
                           (val(f"a.l{i}", (nq,)),), {},
                           {"head_dim": D, "scale": spec.attn_scale, "heads": spec.heads,
                            "kv_heads": spec.kv_heads}, i))
        linear(i, "o", "rows", f"a.l{i}", f"o.l{i}", f"{p}.self_attn.o_proj", H, nq, False)
        ops.append(GraphOp("add", f"l{i}.res1", (x, f"o.l{i}"), (val(f"h.l{i}", (H,)),),
                           layer=i))
        ops.append(GraphOp("rmsnorm", f"l{i}.ln2", (f"h.l{i}",), (val(f"hn.l{i}", (H,)),),
                           {"w": WeightRef(f"{p}.post_attention_layernorm.weight", (H,))},
                           {"dim": H, "eps": spec.eps}, i))
        linear(i, "gate", "cols", f"hn.l{i}", f"g.l{i}", f"{p}.mlp.gate_proj", I, H, False)
        linear(i, "up", "cols", f"hn.l{i}", f"u.l{i}", f"{p}.mlp.up_proj", I, H, False)
        ops.append(GraphOp("swiglu", f"l{i}.swiglu", (f"g.l{i}", f"u.l{i}"),
                           (val(f"m.l{i}", (I,)),), layer=i))
        linear(i, "down", "rows", f"m.l{i}", f"d.l{i}", f"{p}.mlp.down_proj", H, I, False)
        ops.append(GraphOp("add", f"l{i}.res2", (f"h.l{i}", f"d.l{i}"),
                           (val(f"x.l{i + 1}", (H,)),), layer=i))
    L = spec.layers
    ops.append(GraphOp("rmsnorm", "final_norm", (f"x.l{L}",), (val("xf", (H,)),),
                       {"w": WeightRef("model.norm.weight", (H,))}, {"dim": H, "eps": spec.eps}))
    head_key = "model.embed_tokens.weight" if spec.tie else "lm_head.weight"
    ops.append(GraphOp("lm_head", "lm_head", ("xf",), (val("logits", (V,)),),
                       {"w": WeightRef(head_key, (V, H))}))
    return ModelGraph(spec=spec, ops=ops, values=values, name=name)


# Buffers HF registers that are not weights (RoPE caches are recomputed by amk).
_NON_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


def _tensor_dtype(model: Any) -> str:
    try:
        p = next(model.parameters())
    except (StopIteration, AttributeError):
        return "f32"
    return _DTYPE_NAMES.get(str(p.dtype), str(p.dtype))


def import_model(model: Any, config: Any = None, name: str = "model") -> ModelGraph:
    """Build the decode-step ModelGraph of an HF causal LM.

    model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``) whose state dict
    uses the standard keys (``model.layers.{i}.self_attn.q_proj.weight``, ...); config: its
    config (default ``model.config``). Raises AmkError (exit code 2) when the config has an
    unsupported feature (listing each with its config field), when the model holds a
    parameter the graph does not model, when a weight the graph needs is missing, when a
    weight's shape differs from the config, or when a tied config's lm_head differs from the
    embedding.
    """
    config = config if config is not None else getattr(model, "config", None)
    if config is None:
        raise AmkError("import_model: the model has no config")
    spec = spec_from_config(config, dtype=_tensor_dtype(model))
    graph = build_graph(spec, name=name)
    state = model.state_dict()
    refs = graph.weight_refs()
    missing = [k for k in refs if not k.startswith("amk.") and k not in state]
    if missing:
        raise AmkError(f"model {name}: weight {missing[0]} is missing from the state dict"
                       + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for key, ref in refs.items():
        if key.startswith("amk."):
            continue
        shape = tuple(state[key].shape)
        if shape != ref.shape:
            raise AmkError(f"model {name}: weight {key} has shape {list(shape)}, the config "
                           f"implies {list(ref.shape)}")
    used = set(refs)
    unmodelled = [k for k, _ in model.named_parameters() if k not in used]
    unmodelled += [k for k in state if k not in used and k != "lm_head.weight"
                   and not k.endswith(_NON_WEIGHT_SUFFIXES) and k not in unmodelled]
    if "lm_head.weight" in state and "lm_head.weight" not in used:
        # Tied: lm_head must be the embedding (same storage or same values).
        lm, emb = state["lm_head.weight"], state["model.embed_tokens.weight"]
        same = lm.data_ptr() == emb.data_ptr() or (lm.shape == emb.shape and bool((lm == emb).all()))
        if not same:
            raise AmkError(f"model {name}: config says tie_word_embeddings=True but lm_head.weight "
                           "differs from model.embed_tokens.weight")
    if unmodelled:
        raise AmkError(f"unsupported feature: parameter {unmodelled[0]} is not modelled by amk's "
                       f"{spec.family} graph (an unexpected bias or norm); refusing to compile "
                       "a model it would compute wrongly")
    return graph
