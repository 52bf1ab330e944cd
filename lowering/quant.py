"""Weight-only quantization of the GEMV weights at compile time: int8 and FP8 (E4M3),
symmetric, one f32 scale per output row; and ``q8_0``, int8 with one scale per block of 32
K elements of a row (GGUF's Q8_0).

The math is torchao's weight-only recipes, restated so that amk needs no torchao at
compile time (tests/test_quant.py checks the two agree bit for bit when torchao is
installed):

* ``int8`` (``Int8WeightOnlyConfig``, ``Int8Tensor.from_hp(w, PerRow())``): per row,
  ``scale = max(|w|) / 127.5`` computed in w's dtype, clamped below at fp32's eps, then f32;
  ``q = clamp(round_half_even(w * (1 / scale)), -128, 127)`` as int8;
* ``fp8`` (``Float8WeightOnlyConfig``, ``Float8Tensor.from_hp(w, PerRow())``): per row,
  ``scale = max(|w|) / 448`` in w's dtype, then f32; ``q = clamp(float32(w) / scale, -448,
  448)`` rounded to float8_e4m3fn. A row of zeros (torchao: 0 / 0) gets scale 1 here.

``q8_0`` is ggml's Q8_0 (``quantize_row_q8_0_ref`` in ggml-quants.c; gguf-py's
``quants.Q8_0``, which tests/test_quant.py checks bit for bit): per block of ``Q8_0_GROUP``
= 32 elements, ``d = max(|w|) / 127`` in f32, ``q = round_half_away(w * (1 / d))`` (0 where
d = 0) as int8, and the scale stored as ``f32(f16(d))``, GGUF's half-precision block scale.
Re-quantizing a Q8_0 tensor's dequantized values gives back its blocks exactly (the largest
element of a block is ``127 d``), so a Q8_0 GGUF checkpoint loaded in f32 runs on its own
weights and scales, as llama.cpp does.

A per-row quantized weight buffer keeps its HF state-dict key as ``source`` (the quantized
tensor is computed from the whole tensor, then sliced, so a row-parallel split along K keeps
the whole rows' scales); its scales are the derived tensor ``amk.scale.<ir dtype>:<key>``, f32
``[N]``, sliced with the weight's rows. A group-quantized weight's source is the derived
``amk.qweight.<ir dtype>/<group>:<key>`` and its scales ``amk.scale.<ir dtype>/<group>:<key>``,
``[N, K / group]`` (f16 values, stored as f32 by the lowering), sliced with the weight's rows
and (a split along K, on group boundaries) its columns. ``dequantize`` gives
``scale * float(q)``, the weights of the torch reference model of a quantized schedule.
"""

from __future__ import annotations

import torch

from ground.errors import AmkError

#: weight format (LoweringConfig.weight_format) -> the IR dtype of its quantized weights
IR_DTYPE = {"int8": "i8", "fp8": "f8e4m3", "q8_0": "i8"}
#: weight format -> K elements per scale (0: one scale per output row)
Q8_0_GROUP = 32  # ggml's QK8_0
GROUP = {"int8": 0, "fp8": 0, "q8_0": Q8_0_GROUP}
TORCH_QDTYPE = {"i8": torch.int8, "f8e4m3": torch.float8_e4m3fn}
SCALE_PREFIX = "amk.scale."
QWEIGHT_PREFIX = "amk.qweight."
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def is_quantized(fmt: str | None) -> bool:
    """Whether the ``weights`` knob value ``fmt`` quantizes (``int8`` / ``fp8``; ``none`` /
    ``bf16`` do not)."""
    return fmt in IR_DTYPE


def scale_key(qdtype: str, key: str, group: int = 0) -> str:
    """The derived source key of the scales of weight ``key`` quantized to IR dtype
    ``qdtype`` (``i8`` / ``f8e4m3``) per row (``group`` 0:
    ``amk.scale.i8:model.layers.0.mlp.up_proj.weight``) or per ``group`` K elements
    (``amk.scale.i8/32:...``)."""
    return f"{SCALE_PREFIX}{qdtype}{f'/{group}' if group else ''}:{key}"


def qweight_key(qdtype: str, key: str, group: int = 0) -> str:
    """The source key of weight ``key``'s quantized values: the key itself per row (the
    buffer's dtype says the rest), ``amk.qweight.<qdtype>/<group>:<key>`` per group."""
    return f"{QWEIGHT_PREFIX}{qdtype}/{group}:{key}" if group else key


def _parse(key: str, prefix: str) -> tuple[str, str, int] | None:
    if not key.startswith(prefix) or ":" not in key:
        return None
    kind, wkey = key[len(prefix):].split(":", 1)
    qdtype, _, group = kind.partition("/")
    if qdtype not in TORCH_QDTYPE or (group and not group.isdigit()):
        return None
    return qdtype, wkey, int(group or 0)


def parse_scale_key(key: str) -> tuple[str, str, int] | None:
    """``(qdtype, weight key, group)`` of a scale key (scale_key), None for any other key."""
    return _parse(key, SCALE_PREFIX)


def parse_qweight_key(key: str) -> tuple[str, str, int] | None:
    """``(qdtype, weight key, group)`` of a group-quantized weight's key (qweight_key), None
    for any other key."""
    return _parse(key, QWEIGHT_PREFIX)


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


def quantize_groups(w: torch.Tensor, group: int = Q8_0_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float weight ``w`` [N, K] to int8 with one scale per ``group`` K
    elements of a row, ggml's Q8_0 math (module doc) for any group size.

    Returns ``(q, scale)``: q [N, K] int8, scale [N, K / group] f32 (each an f16 value), with
    ``w ~= scale.repeat_interleave(group, 1) * float(q)``. Raises AmkError for a weight that
    is not 2-D float or whose K is not a multiple of ``group``.
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise AmkError(f"cannot quantize a {w.dtype} weight of shape {list(w.shape)} per group "
                       "(expected a 2-D float tensor)")
    n, k = w.shape
    if group < 1 or k % group:
        raise AmkError(f"cannot quantize a weight of K = {k} in groups of {group} (K must be a multiple)")
    blocks = w.detach().to(torch.float32).reshape(n, k // group, group)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = blocks * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf: half away from zero
    return q.to(torch.int8).reshape(n, k), d.to(torch.float16).to(torch.float32).reshape(n, k // group)


def quantize_as(w: torch.Tensor, qdtype: str, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of weight ``w`` [N, K] quantized to IR dtype ``qdtype`` per row
    (``group`` 0: quantize_rows, scale [N]) or per ``group`` K elements (int8 only:
    quantize_groups, scale [N, K / group]). Raises AmkError for per-group scales of
    another dtype (and as those functions do)."""
    if not group:
        return quantize_rows(w, qdtype)
    if qdtype != "i8":
        raise AmkError(f"per-group scales are int8 only, not {qdtype}")
    return quantize_groups(w, group)


def quantize(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of weight ``w`` [N, K] in weight format ``fmt`` (``int8`` / ``fp8``:
    scale [N]; ``q8_0``: scale [N, K / 32]; quantize_as). Raises AmkError for another
    format."""
    if fmt not in IR_DTYPE:
        raise AmkError(f"unknown weight format {fmt!r}; expected one of {', '.join(IR_DTYPE)}")
    return quantize_as(w, IR_DTYPE[fmt], GROUP[fmt])


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scale * float(q)`` (computed in f32) as ``dtype``: [N, K]. ``scale`` [N] applies per
    row, [N, K / G] per group of G K elements."""
    s = scale.to(torch.float32)
    if s.dim() == 2 and s.shape[1] > 1:
        s = s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    else:
        s = s.reshape(-1, 1)
    return (q.to(torch.float32) * s).to(dtype)


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


def decode_bytes(model, fmt: str | None, quantize_lm_head: bool = False) -> int:
    """Weight bytes one batch-1 decode step of HF ``model`` reads
    (ground.timing.decode_weight_bytes) when the decoder layers' linear weights (and, with
    ``quantize_lm_head``, the LM head) are stored at 1 byte per element plus one f32 scale
    per row (``q8_0``: one scale per 32 elements, an f16 value stored as f32), as a schedule lowered with
    ``weights=fmt`` stores them; ``fmt`` None / ``none`` / ``bf16``: unquantized. The
    roofline of a quantized run."""
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
        scale_bytes = 4 * (w.numel() // GROUP[fmt] if GROUP[fmt] else w.shape[0])
        total -= w.numel() * (w.element_size() - 1) - scale_bytes
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
        raise AmkError(f"unknown weight format {fmt!r}; expected one of {', '.join(IR_DTYPE)}")
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}" and name.endswith("_proj"):
                q, s = quantize(mod.weight, fmt)
                mod.weight.copy_(dequantize(q, s, mod.weight.dtype))
        if quantize_lm_head:
            head = m.get_output_embeddings()
            q, s = quantize(head.weight, fmt)
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
            "scale": (f"f32 (an f16 value) per {GROUP[weights]} elements of a row" if q and GROUP[weights]
                      else "f32 per output row" if q else None),
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


def logits_perplexity(logits: torch.Tensor, tokens: list[int]) -> float:
    """``exp(mean negative log-likelihood)`` of ``tokens[1:]`` from ``logits`` [len(tokens) - 1,
    vocab], row i the logits after ``tokens[: i + 1]`` (fp32 log-softmax). ValueError for a
    row count that does not match."""
    if logits.shape[0] != len(tokens) - 1:
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(tokens) - 1} predicted tokens")
    nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(tokens[1:], device=logits.device))
    return float(torch.exp(nll))


def perplexity(model, tokens: list[int]) -> float:
    """``exp(mean negative log-likelihood)`` of ``tokens[1:]`` given their prefixes under HF
    ``model`` (one forward; logits_perplexity)."""
    dev = next(model.parameters()).device
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([tokens], device=dev)).logits[0, :-1]
    return logits_perplexity(lg, tokens)


def agreement(pred: list[int], ref: list[int]) -> tuple[float, int]:
    """(fraction of positions where ``pred`` equals ``ref``, length of their common prefix),
    over ``len(ref)`` positions."""
    match = sum(int(a == b) for a, b in zip(pred, ref)) / len(ref)
    prefix = next((i for i, (a, b) in enumerate(zip(pred, ref)) if a != b), min(len(pred), len(ref)))
    return match, prefix


def distance(base, quant, prompt: list[int], text: list[int], n: int = 64) -> dict:
    """How far the quantized HF model ``quant`` is from ``base``: ``greedy_match`` (the
    fraction of the ``n`` greedy tokens of ``base`` after ``prompt`` that ``quant``, teacher-
    forced on them, predicts too), ``greedy_prefix`` (tokens of ``quant``'s own greedy run
    equal to ``base``'s before the first difference, of ``n``), ``ppl_base`` / ``ppl_quant``
    (perplexity on the token ids ``text``) and ``ppl_ratio`` (quant / base)."""
    ref = greedy_tokens(base, prompt, n)
    match, _ = agreement(forced_argmax(quant, list(prompt) + ref)[len(prompt) - 1:-1], ref)
    _, prefix = agreement(greedy_tokens(quant, prompt, n), ref)
    pb, pq = perplexity(base, text), perplexity(quant, text)
    return {"tokens": n, "greedy_match": match, "greedy_prefix": prefix, "ppl_base": pb,
            "ppl_quant": pq, "ppl_ratio": pq / pb, "reference_tokens": ref}
