"""models/graph.py and models/rope.py: HF model import, RoPE frequencies, refusals."""

from __future__ import annotations

import pytest
import torch

from ground.errors import AmkError
from models.graph import ROPE_INV_FREQ_KEY, build_graph, import_model, spec_from_config
from models.recipes import build_config, build_model
from models.rope import RopeSpec, inv_freq, rope_spec_from_config


def _hf_inv_freq(config) -> torch.Tensor:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rtype = config.rope_parameters["rope_type"]
    if rtype == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[rtype](config)[0]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "llama-3.2-1b",
                                  "llama-3.1-8b", "qwen2.5-0.5b", "smollm2-135m"])
def test_inv_freq_bit_identical_to_transformers(name):
    config = build_config(name)
    spec = spec_from_config(config)
    ours = inv_freq(spec.rope, spec.head_dim)
    ref = _hf_inv_freq(config)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(ours, ref), (ours - ref).abs().max()


def test_llama3_scaling_changes_low_frequencies_only():
    spec = spec_from_config(build_config("llama-3.2-1b"))
    assert spec.rope.type == "llama3" and spec.rope.factor == 32.0
    scaled = inv_freq(spec.rope, 64)
    plain = inv_freq(RopeSpec("default", spec.rope.theta), 64)
    assert torch.equal(scaled[:8], plain[:8])           # high frequencies untouched
    assert torch.allclose(scaled[-4:], plain[-4:] / 32)  # low frequencies divided by factor


def test_inv_freq_matches_the_model_buffer():
    model = build_model("tiny-llama")
    g = import_model(model)
    assert torch.equal(inv_freq(g.spec.rope, g.spec.head_dim), model.model.rotary_emb.inv_freq)


def test_rope_from_transformers_4x_style_config():
    class Old:  # 4.x: rope_theta + rope_scaling with the old "type" key
        rope_theta = 500000.0
        rope_scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    r = rope_spec_from_config(Old())
    assert r == RopeSpec("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize("name,family,bias,qk", [("tiny-llama", "llama", False, False),
                                                 ("tiny-qwen2", "qwen2", True, False),
                                                 ("tiny-qwen3", "qwen3", False, True)])
def test_import_tiny_models(name, family, bias, qk):
    model = build_model(name)
    g = import_model(model, name=name)
    s = g.spec
    c = model.config
    assert (s.family, s.qkv_bias, s.qk_norm) == (family, bias, qk)
    assert (s.layers, s.hidden, s.heads, s.kv_heads, s.vocab, s.intermediate) == (
        c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
        c.vocab_size, c.intermediate_size)
    assert s.tie == c.tie_word_embeddings
    state = model.state_dict()
    for key, ref in g.weight_refs().items():
        if key == ROPE_INV_FREQ_KEY:
            assert ref.shape == (s.head_dim // 2,)
        else:
            assert tuple(state[key].shape) == ref.shape
    # every parameter of the model is consumed by the graph
    used = set(g.weight_refs())
    assert {k for k, _ in model.named_parameters()} <= used
    kinds = [op.op for op in g.ops]
    assert kinds[0] == "embed" and kinds[-2:] == ["rmsnorm", "lm_head"]
    per_layer = kinds[1:-2]
    assert len(per_layer) == s.layers * (18 if qk else 16)
    head = g.ops[-1].weights["w"].key
    assert head == ("model.embed_tokens.weight" if s.tie else "lm_head.weight")


def test_qwen3_head_dim_differs_from_hidden_over_heads():
    s = spec_from_config(build_config("tiny-qwen3"))
    assert s.head_dim * s.heads != s.hidden
    g = build_graph(s)
    q = next(op for op in g.ops if op.name == "l0.q")
    assert q.weights["w"].shape == (s.heads * s.head_dim, s.hidden)
    qn = next(op for op in g.ops if op.name == "l0.q_norm")
    assert qn.params["dim"] == s.head_dim


def test_mistral_without_sliding_window_is_accepted():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=None, max_position_embeddings=128)
    g = import_model(MistralForCausalLM(cfg))
    assert g.spec.family == "mistral" and not g.spec.qkv_bias


def _cfg(name: str, **changes):
    c = build_config(name)
    for k, v in changes.items():
        setattr(c, k, v)
    return c


def _refusal(config) -> str:
    with pytest.raises(AmkError) as ei:
        import_model(None, config)
    return str(ei.value)


@pytest.mark.parametrize("changes,field,words", [
    (dict(num_local_experts=8), "num_local_experts", "mixture of experts"),
    (dict(kv_lora_rank=512), "kv_lora_rank", "latent attention"),
    (dict(hidden_act="gelu"), "hidden_act", "activation"),
    (dict(attention_bias=True), "attention_bias", "attention bias"),
    (dict(mlp_bias=True), "mlp_bias", "MLP bias"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
     "rope_type", "RoPE"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.5}), "partial_rotary_factor", "partial"),
    (dict(qk_norm=True), "qk_norm", "q/k norm"),
])
def test_refusals_name_feature_and_field(changes, field, words):
    msg = _refusal(_cfg("tiny-llama", **changes))
    assert field in msg and words.lower() in msg.lower(), msg


def test_refuse_sliding_window():
    from transformers import MistralConfig, Qwen2Config

    msg = _refusal(MistralConfig(num_hidden_layers=1, sliding_window=64,
                                 max_position_embeddings=4096))
    assert "sliding" in msg and "sliding_window" in msg
    q = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                    max_window_layers=2)
    msg = _refusal(q)
    assert "sliding" in msg and ("layer_types" in msg or "use_sliding_window" in msg)


def test_refuse_unknown_model_type():
    from transformers import GPT2Config

    msg = _refusal(GPT2Config(n_layer=1))
    assert "model_type" in msg and "gpt2" in msg


def test_refuse_unmodelled_parameter():
    model = build_model("tiny-llama")
    o = model.model.layers[1].self_attn.o_proj
    o.bias = torch.nn.Parameter(torch.zeros(o.out_features))
    with pytest.raises(AmkError, match=r"layers\.1\.self_attn\.o_proj\.bias"):
        import_model(model)


def test_refuse_shape_mismatch():
    model = build_model("tiny-qwen2")
    cfg = _cfg("tiny-qwen2", intermediate_size=200)
    with pytest.raises(AmkError, match=r"gate_proj\.weight has shape \[224, 96\]"):
        import_model(model, cfg)


def test_refuse_tied_config_with_distinct_lm_head():
    from transformers import LlamaForCausalLM

    cfg = _cfg("tiny-llama", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    cfg2 = _cfg("tiny-llama", tie_word_embeddings=True)
    with pytest.raises(AmkError, match="tie_word_embeddings"):
        import_model(model, cfg2)
