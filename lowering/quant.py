"""Weight-only quantization of the GEMV weights at compile time: int8 and FP8 (E4M3),
symmetric, one f32 scale per output row.

The math is torchao's weight-only recipes, restated so that amk needs no torchao at
compile time (tests/test_quant.py checks the two agree bit for bit when torchao is
installed):

* ``int8`` (``Int8WeightOnlyConfig``, ``Int8Tensor.from_hp(w, PerRow())``): per row,
  ``scale = max(|w|) / 127.5`` computed in w's dtype, clamped below at fp32's eps, then f32;
  ``q = clamp(round_half_even(w * (1 / scale)), -128, 127)`` as int8;
* ``fp8`` (``Float8WeightOnlyConfig``, ``Float8Tensor.from_hp(w, PerRow())``): per row,
  ``scale = max(|w|) / 448`` in w's dtype, then f32; ``q = clamp(float32(w) / scale, -448,
  448)`` rounded to float8_e4m3fn. A row of zeros (torchao: 0 / 0) gets scale 1 here.

A quantized weight buffer keeps its HF state-dict key as ``source`` (the quantized tensor
is computed from the whole tensor, then sliced, so a row-parallel split along K keeps the
whole rows' scales); its scales are the derived tensor ``amk.scale.<ir dtype>:<key>``, f32
``[N]``, sliced with the weight's rows. ``dequantize`` gives ``scale * float(q)``, the weights
of the torch reference model of a quantized schedule.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ground.errors import AmkError

#: weight format (the ``weights`` knob) -> the IR dtype of its quantized weights
IR_DTYPE = {"int8": "i8", "fp8": "f8e4m3"}
TORCH_QDTYPE = {"i8": torch.int8, "f8e4m3": torch.float8_e4m3fn}
SCALE_PREFIX = "amk.scale."
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_quantized(fmt: str | None) -> bool:
    """Whether the ``weights`` knob value ``fmt`` quantizes (``int8`` / ``fp8``; ``none`` /
    ``bf16`` do not)."""
    return fmt in IR_DTYPE


def scale_key(qdtype: str, key: str) -> str:
    """The derived source key of the per-row scales of weight ``key`` quantized to IR dtype
    ``qdtype`` (``i8`` / ``f8e4m3``): ``amk.scale.i8:model.layers.0.mlp.up_proj.weight``."""
    return f"{SCALE_PREFIX}{qdtype}:{key}"


def parse_scale_key(key: str) -> tuple[str, str] | None:
    """``(qdtype, weight key)`` of a scale key, None for any other key."""
    if not key.startswith(SCALE_PREFIX) or ":" not in key:
        return None
    qdtype, wkey = key[len(SCALE_PREFIX):].split(":", 1)
    return (qdtype, wkey) if qdtype in TORCH_QDTYPE else None


def quantize_rows(w: torch.Tensor, qdtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float weight ``w`` [N, K] (f32 / bf16 / f16) per output row.

    Returns ``(q, scale)``: q [N, K] int8 (``qdtype == "i8"``) or float8_e4m3fn
    (``"f8e4m3"``), scale [N] f32, with ``w ~= scale[:, None] * float(q)`` (module doc for the
    exact math). Raises AmkError for another qdtype or a weight that is not 2-D float.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise AmkError(f"cannot quantize a {w.dtype} weight of shape {list(w.shape)} per row "
                       "(expected a 2-D float tensor)")
    w = w.detach()
    amax = w.abs().amax(dim=1, keepdim=True)
    if qdtype == "i8":
        scale = (amax / 127.5).clamp(min=torch.finfo(torch.float32).eps).to(torch.float32)
        q = torch.clamp(torch.round(w * (1.0 / scale)), -128, 127).to(torch.int8)
    elif qdtype == "f8e4m3":
        scale = (amax / FP8_MAX).to(torch.float32)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (w.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        raise AmkError(f"unknown quantized dtype {qdtype!r}; expected one of {sorted(TORCH_QDTYPE)}")
    return q, scale.reshape(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale[:, None] * float(q)`` (computed in f32) as ``dtype``: [N, K]."""
    return (q.to(torch.float32) * scale.to(torch.float32).reshape(-1, 1)).to(dtype)


def quantized_keys(state_keys, tied_lm_head: bool, quantize_lm_head: bool) -> list[str]:
    """The state-dict keys a quantized lowering quantizes: every linear weight of the decoder
    layers (``*_proj.weight``: q/k/v/o, gate/up/down) and, with ``quantize_lm_head``, the LM
    head (``lm_head.weight``, or for a tied head the embedding table's rows it reads; the
    embedding itself stays unquantized). Keys are returned in the state dict's order."""
    out = [k for k in state_keys if k.endswith("_proj.weight") and ".layers." in k]
    if quantize_lm_head:
        if tied_lm_head:
            out.append("lm_head.weight")
        else:
            out += [k for k in state_keys if k == "lm_head.weight"]
    return out


def dequantized_state(state: Mapping[str, torch.Tensor], keys, qdtype: str) -> dict[str, torch.Tensor]:
    """``{key: dequantize(quantize_rows(state[key]))}`` in the tensor's own dtype, for each of
    ``keys``: the weights of the torch model that a quantized schedule computes."""
    out = {}
    for k in keys:
        w = state[k]
        q, s = quantize_rows(w, qdtype)
        out[k] = dequantize(q, s, w.dtype)
    return out


def decode_bytes(model, fmt: str | None, quantize_lm_head: bool = False) -> int:
    """Weight bytes one batch-1 decode step of HF ``model`` reads
    (ground.timing.decode_weight_bytes) when the decoder layers' linear weights (and, with
    ``quantize_lm_head``, the LM head) are stored at 1 byte per element plus one f32 scale
    per row, as a schedule lowered with ``weights=fmt`` stores them; ``fmt`` None / ``none``
    / ``bf16``: unquantized. The roofline of a quantized run."""
    from ground.timing import decode_weight_bytes

    total = decode_weight_bytes(model)
    if not is_quantized(fmt):
        return total
    mods = [m for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".layers." in f".{n}" and n.endswith("_proj")]
    if quantize_lm_head:
        mods.append(model.get_output_embeddings())
    for m in mods:
        w = m.weight
        total -= w.numel() * (w.element_size() - 1) - w.shape[0] * 4
    return total


def quantized_copy(model, fmt: str, quantize_lm_head: bool = False):
    """A copy of the HF causal LM ``model`` whose decoder-layer linear weights (and, with
    ``quantize_lm_head``, its LM head) hold ``dequantize(quantize_rows(w))`` in their own
    dtype: the torch model that a schedule lowered with ``weights=fmt`` computes (the
    reference of its correctness check). A tied LM head is untied in the copy, so the
    embedding table stays unquantized. ``model`` itself is not changed. Raises AmkError for
    an unknown format."""
    import copy

    if not is_quantized(fmt):
        raise AmkError(f"unknown weight format {fmt!r}; expected int8 or fp8")
    qdtype = IR_DTYPE[fmt]
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and name.endswith("_proj"):
                q, s = quantize_rows(mod.weight, qdtype)
                mod.weight.copy_(dequantize(q, s, mod.weight.dtype))
        if quantize_lm_head:
            head = m.get_output_embeddings()
            q, s = quantize_rows(head.weight, qdtype)
            head.weight = torch.nn.Parameter(dequantize(q, s, head.weight.dtype), requires_grad=False)
            if getattr(m.config, "tie_word_embeddings", False):
                m.config.tie_word_embeddings = False
    return m


def summary(weights: str, quantize_lm_head: bool, program) -> dict:
    """What a lowered program quantizes, for reports: ``weights`` (the knob), ``gemv_weights``
    (their IR dtype, or ``unquantized``), ``lm_head`` and ``embedding`` (``quantized`` /
    ``unquantized``), ``scale`` (the granularity), and ``weight_bytes``: bytes of every weight
    buffer over all ranks, quantized weights and their scales counted as they are stored."""
    q = is_quantized(weights)
    qb = sum(b.nbytes for b in program.buffers if b.kind == "weight" and b.dtype in TORCH_QDTYPE)
    sb = sum(b.nbytes for b in program.buffers
             if b.kind == "weight" and b.source is not None and parse_scale_key(b.source.key))
    total = sum(b.nbytes for b in program.buffers if b.kind == "weight")
    return {"weights": weights if q else "none",
            "gemv_weights": IR_DTYPE[weights] if q else "unquantized",
            "lm_head": "quantized" if q and quantize_lm_head else "unquantized",
            "embedding": "unquantized",
            "scale": "f32 per output row" if q else None,
            "weight_bytes": {"total": total, "quantized": qb, "scales": sb}}


# -- distance of a quantized model to the unquantized one -----------------------------------

#: the fixed text of the perplexity comparison (original prose, ~270 words)
EVAL_TEXT = "examples/text/eval.txt"
#: the prompt of the greedy-agreement comparison
EVAL_PROMPT = "The harbour town woke slowly on the first cold morning of the autumn."


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens of HF ``model`` after ``prompt`` (HF generate with its KV
    cache; EOS may not end the run early: ``min_new_tokens = n``), as token ids."""
    dev = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=dev)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, num_beams=1, temperature=None,
                             top_p=None, top_k=None)
    return [int(t) for t in out[0, ids.shape[1]:]]


def forced_argmax(model, tokens: list[int]) -> list[int]:
    """The argmax next token of ``model`` at every position of ``tokens`` (one forward)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([tokens], device=dev)).logits[0]
    return [int(t) for t in lg.argmax(-1)]


def perplexity(model, tokens: list[int]) -> float:
    """``exp(mean negative log-likelihood)`` of ``tokens[1:]`` given their prefixes under HF
    ``model`` (one forward, fp32 log-softmax)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([tokens], device=dev)).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(lg, torch.tensor(tokens[1:], device=dev))
    return float(torch.exp(nll))


def distance(base, quant, prompt: list[int], text: list[int], n: int = 64) -> dict:
    """How far the quantized HF model ``quant`` is from ``base``: ``greedy_match`` (the
    fraction of the ``n`` greedy tokens of ``base`` after ``prompt`` that ``quant``, teacher-
    forced on them, predicts too), ``greedy_prefix`` (tokens of ``quant``'s own greedy run
    equal to ``base``'s before the first difference, of ``n``), ``ppl_base`` / ``ppl_quant``
    (perplexity on the token ids ``text``) and ``ppl_ratio`` (quant / base)."""
    ref = greedy_tokens(base, prompt, n)
    pred = forced_argmax(quant, list(prompt) + ref)[len(prompt) - 1:-1]
    match = sum(int(a == b) for a, b in zip(pred, ref)) / n
    own = greedy_tokens(quant, prompt, n)
    prefix = next((i for i, (a, b) in enumerate(zip(own, ref)) if a != b), n)
    pb, pq = perplexity(base, text), perplexity(quant, text)
    return {"tokens": n, "greedy_match": match, "greedy_prefix": prefix, "ppl_base": pb,
            "ppl_quant": pq, "ppl_ratio": pq / pb, "reference_tokens": ref}
