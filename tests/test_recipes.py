"""The built-in config:NAME recipes keep the published shapes of their models."""

from __future__ import annotations

import pytest

from models.recipes import RECIPES


@pytest.mark.parametrize("name,hidden,inter,layers,heads,head_dim,tied,factor", [
    ("llama-3.2-1b", 2048, 8192, 16, 32, 64, True, 32.0),
    ("llama-3.2-3b", 3072, 8192, 28, 24, 128, True, 32.0),
    ("llama-3.1-8b", 4096, 14336, 32, 32, 128, False, 8.0),
])
def test_llama3_recipes(name, hidden, inter, layers, heads, head_dim, tied, factor):
    c = RECIPES[name].make_config()
    assert type(c).__name__ == "LlamaConfig"
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.head_dim) == \
        (hidden, inter, layers, head_dim)
    assert (c.vocab_size, c.num_attention_heads, c.num_key_value_heads) == (128256, heads, 8)
    assert (c.max_position_embeddings, c.rms_norm_eps) == (131072, 1e-5)
    assert (c.bos_token_id, c.eos_token_id, c.tie_word_embeddings) == (128000, 128001, tied)
    rope = c.to_dict().get("rope_parameters") or {**(c.rope_scaling or {}),
                                                  "rope_theta": c.rope_theta}
    assert rope["rope_theta"] == 500000.0 and rope["factor"] == factor
    assert rope["original_max_position_embeddings"] == 8192


@pytest.mark.parametrize("name,cls", [("tiny-qwen2", "Qwen2Config"), ("tiny-qwen3", "Qwen3Config"),
                                      ("tiny-llama", "LlamaConfig")])
def test_recipe_config_classes(name, cls):
    assert type(RECIPES[name].make_config()).__name__ == cls


def test_qwen3_1_7b_recipe():
    c = RECIPES["qwen3-1.7b"].make_config()
    assert type(c).__name__ == "Qwen3Config"
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (2048, 6144, 28)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 8, 128)
    assert (c.vocab_size, c.tie_word_embeddings, c.rms_norm_eps) == (151936, True, 1e-6)
