"""Baselines that `amk bench` measures in the same run, on the same device, as the megakernel.

(a) ``hf_eager``: HF forward, one token per call, with its dynamic KV cache, plus argmax.
(b) ``hf_compiled_graph``: one decode step (HF forward with a ``StaticCache`` and
    ``cache_position``, argmax, and the bump of the position and token) compiled by
    ``torch.compile`` (inductor) and captured in one CUDA graph that is replayed per token.
    This is the strongest simple baseline a user can build without writing kernels.

Both are timed per decode step without Python ``generate`` overhead, and each returns the
greedy tokens it produced so that its correctness is checked against HF ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ground.errors import AmkError
from ground.timing import Timing, time_per_call

#: torch.compile modes baseline (b) can be compiled with ("default" = no mode argument).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_modes(text: str, flag: str) -> list[str | None]:
    """The torch.compile modes named by the comma list ``text`` (the value of the command-line
    option ``flag``), duplicates dropped, None for "default". Raises AmkError naming an
    unknown mode or an empty list."""
    modes = [m.strip() for m in (text or "default").split(",") if m.strip()]
    for m in modes:
        if m not in COMPILE_MODES:
            raise AmkError(f"{flag}: unknown mode {m!r}; expected one of {', '.join(COMPILE_MODES)}")
    if not modes:
        raise AmkError(f"{flag}: give at least one mode")
    return [None if m == "default" else m for m in dict.fromkeys(modes)]


def compiled_graph_name(mode: str | None) -> str:
    """The result name of baseline (b) compiled in ``mode`` (None: torch.compile's default)."""
    return "hf_compiled_graph" if mode is None else f"hf_compiled_graph[{mode}]"


def fresh_compile(run: int = 2):
    """The context of the ``run``-th measurement (1-based) of a compiled baseline. The first
    compiles as any user's would (caches on; a null context). A later one starts from nothing:
    dynamo's compiled code is reset and inductor's on-disk and in-memory caches (FX graph,
    autotuning) are off, so it re-runs its autotuner. max-autotune's choice is bimodal from one
    compile to the next (docs/experiments.md), so one compile is one sample of it."""
    import contextlib

    if run <= 1:
        return contextlib.nullcontext()
    import torch._dynamo
    import torch._inductor.config as inductor_config

    @contextlib.contextmanager
    def ctx():
        torch._dynamo.reset()
        with inductor_config.patch(force_disable_caches=True):
            yield
        torch._dynamo.reset()

    return ctx()


def speedup_line(ours: BaselineResult, summary: dict[str, Any]) -> str | None:
    """The printed line of ``speedup_summary`` (None when it has no speedup)."""
    if summary["speedup"] is None:
        return None
    return (f"amk {ours.timing.median_ms:.4f} ms against the fastest correct HF baseline run "
            f"{summary['fastest_baseline']} {summary['fastest_baseline_ms']:.4f} ms: {summary['speedup']:.3f}x")


def run_name(name: str, run: int) -> str:
    """The row name of the ``run``-th measurement (1-based) of baseline ``name``: the first
    keeps the plain name, later ones get `` #k``."""
    return name if run == 1 else f"{name} #{run}"


def fastest(results: list[BaselineResult]) -> BaselineResult | None:
    """The correct result with the lowest median latency among ``results`` (None: none is
    correct and timed): what a same-run comparison is made against."""
    timed = [r for r in results if r.correct and r.timing is not None]
    return min(timed, key=lambda r: r.timing.median_ms, default=None)


def speedup_summary(ours: BaselineResult, baselines: list[BaselineResult]) -> dict[str, Any]:
    """``{"fastest_baseline", "fastest_baseline_ms", "speedup"}`` of ``ours`` (median ms)
    against the fastest correct baseline; None values when there is none or ``ours`` has no
    timing. ``speedup`` > 1 means the megakernel is faster."""
    best = fastest(baselines)
    if best is None or ours.timing is None:
        return {"fastest_baseline": None, "fastest_baseline_ms": None, "speedup": None}
    return {"fastest_baseline": best.name, "fastest_baseline_ms": best.timing.median_ms,
            "speedup": best.timing.median_ms / ours.timing.median_ms}


@dataclass
class BaselineResult:
    """One baseline's outcome: tokens generated after the prompt, per-step timing, verdict."""

    name: str
    tokens: list[int]
    timing: Timing | None
    correct: bool | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "latency_ms_median": self.timing.median_ms if self.timing else None,
            "timing": self.timing.to_json() if self.timing else None,
            "correct": self.correct,
            "note": self.note,
            **self.extra,
        }


def reference_tokens(model, prompt_ids: torch.Tensor, n_tokens: int) -> list[int]:
    """Greedy continuation by HF ``generate`` (the correctness reference).

    ``prompt_ids``: int64 [1, P] on the model's device. Returns ``n_tokens`` token ids.
    """
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, prompt_ids.shape[1]:].tolist()


def hf_eager(model, prompt_ids: torch.Tensor, n_tokens: int, warmup: int = 3) -> BaselineResult:
    """Baseline (a): eager HF forward per token with a DynamicCache.

    The prompt is prefilled in one forward (not timed); the first ``warmup`` decode steps
    are not timed, the remaining ``n_tokens - 1 - warmup`` are timed one by one.
    """
    from transformers import DynamicCache

    from amk.pipeline import hf_cache_kwargs

    if n_tokens < warmup + 2:
        raise ValueError(f"n_tokens={n_tokens} must be at least warmup + 2 = {warmup + 2}")
    dev = prompt_ids.device
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        kw = hf_cache_kwargs(model, cache)  # updated in place
        out = model(input_ids=prompt_ids, use_cache=True, **kw)
        toks = [out.logits[:, -1:].argmax(-1)]

        def step():
            o = model(input_ids=toks[-1], use_cache=True, **kw)
            toks.append(o.logits[:, -1:].argmax(-1))

        timing = time_per_call(step, iters=n_tokens - 1 - warmup, warmup=warmup, device=dev)
    return BaselineResult("hf_eager", [int(t) for t in toks][:n_tokens], timing)


class StaticDecode:
    """One greedy decode step of an HF model over a ``StaticCache``, as device-side state a
    CUDA graph can capture: ``body(step)`` runs ``step(tok, pos)`` (the model forward plus
    argmax, possibly compiled), records the token in ``hist`` (``hist[i]`` is the token
    after position i) and bumps ``pos`` / ``tok`` in place. ``prompt_ids``: int64 [1, P] on
    the model's device; the cache holds ``max_cache_len`` (default P + n_tokens + 8)
    positions. Shared by the single-GPU baseline (b) and the tensor-parallel baselines."""

    def __init__(self, model, prompt_ids: torch.Tensor, n_tokens: int, device,
                 max_cache_len: int | None = None):
        from transformers import StaticCache

        from amk.pipeline import hf_cache_kwargs

        self.model, self.prompt = model, prompt_ids
        self.p = prompt_ids.shape[1]
        self.max_len = max_cache_len or (self.p + n_tokens + 8)
        self.cache = StaticCache(config=model.config, max_cache_len=self.max_len)
        self.cache_kw = hf_cache_kwargs(model, self.cache)
        self.tok = prompt_ids[:, :1].clone()
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.nxt = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.hist = torch.zeros(self.max_len + 1, dtype=torch.long, device=device)

    def decode_step(self, tok_in, pos_in):
        """Forward one token at ``pos_in`` and return its greedy next token [1, 1]."""
        logits = self.model(input_ids=tok_in, cache_position=pos_in, use_cache=True,
                            **self.cache_kw).logits
        return logits[:, -1:].argmax(-1)

    def body(self, step) -> None:
        self.nxt.copy_(step(self.tok, self.pos))
        self.hist.index_copy_(0, self.pos, self.nxt.view(1))
        self.pos.add_(1)
        self.tok.copy_(self.nxt)

    def feed_prompt(self, run) -> None:
        """Reset the cache and position, then one ``run()`` per prompt token with that token
        forced in (position = step index)."""
        self.cache.reset()
        self.pos.zero_()
        for i in range(self.p):
            self.tok.copy_(self.prompt[:, i:i + 1])
            run()

    def tokens(self, n_tokens: int) -> list[int]:
        """The ``n_tokens`` greedy tokens after the prompt."""
        return self.hist[self.p - 1:self.p - 1 + n_tokens].tolist()[:n_tokens]


def warm_up_on_side_stream(body, iters: int = 3) -> None:
    """Run ``body()`` ``iters`` times on a side stream and join it back: compiles, lazy
    initialisations (StaticCache, NCCL communicators) and allocator warm-up happen before a
    CUDA-graph capture, as torch.cuda.graphs requires ("Partial-network capture")."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(iters):
            body()
    torch.cuda.current_stream().wait_stream(s)


def capture_graph(body) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of one ``body()`` call (run warm_up_on_side_stream first)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def inductor_counter_delta(before: dict, after: dict) -> dict[str, int]:
    """What each of torch inductor's counters (``torch._dynamo.utils.counters["inductor"]``,
    name -> count) grew by from ``before`` to ``after``, the counters that did not grow left
    out, sorted by name. E.g. ``coordesc_tuning_bench`` (configs benchmarked by
    coordinate-descent tuning: 0 when every kernel's tuning result came from the cache),
    ``fxgraph_cache_hit`` / ``fxgraph_cache_miss``, ``async_compile_cache_miss``."""
    grown = {str(k): int(v) - int(before.get(k, 0)) for k, v in after.items()}
    return {k: n for k, n in sorted(grown.items()) if n > 0}


def hf_compiled_graph(model, prompt_ids: torch.Tensor, n_tokens: int,
                      max_cache_len: int | None = None, mode: str | None = None) -> BaselineResult:
    """Baseline (b): a decode step over a StaticCache, compiled, in one CUDA graph.

    The prompt is fed token by token through the same graph (position = step index).
    ``mode``: torch.compile's mode (None: its default); the result is named by
    ``compiled_graph_name(mode)``.
    Requires CUDA. Returns the ``n_tokens`` greedy tokens after the prompt and the per-replay
    timing of the decode steps (each replay is one whole decode step); ``extra`` holds
    ``compile_s`` (wall seconds of the warm-up before capture, torch.compile's work included),
    ``dynamo_graphs`` (graphs Dynamo compiled meanwhile: more than one is a recompile or a
    graph break) and ``inductor_counters`` (inductor_counter_delta over the warm-up: FX graph
    cache hits and misses, kernels benchmarked by coordinate-descent tuning, ...), what a slow
    compile is diagnosed from.
    """
    import time

    from torch._dynamo.utils import counters

    dev = prompt_ids.device
    if dev.type != "cuda":
        raise RuntimeError("the compiled CUDA-graph baseline needs a CUDA device")
    st = StaticDecode(model, prompt_ids, n_tokens, dev, max_cache_len)
    compiled = torch.compile(st.decode_step, **({"mode": mode} if mode else {}))

    def body():
        st.body(compiled)

    with torch.no_grad():
        graphs0, ind0, t0 = counters["stats"]["unique_graphs"], dict(counters["inductor"]), time.perf_counter()
        warm_up_on_side_stream(body)  # compiles
        torch.cuda.synchronize(dev)
        warm = {"compile_s": round(time.perf_counter() - t0, 3),
                "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs0,
                "inductor_counters": inductor_counter_delta(ind0, counters["inductor"])}
        graph = capture_graph(body)
        st.feed_prompt(graph.replay)
        # Decode: each replay consumes the previous output token (copied inside the graph).
        timing = time_per_call(graph.replay, iters=n_tokens - 1, warmup=0, device=dev)
    return BaselineResult(compiled_graph_name(mode), st.tokens(n_tokens), timing, extra=warm)


@dataclass
class TokenReference:
    """The greedy reference a decode result is judged against.

    ``tokens``: HF ``generate`` greedy tokens of the model as benchmarked (e.g. bf16).
    ``margin[k]``: top-1 minus top-2 logit of an fp32 copy of the same weights at generated
    step k (teacher-forced along ``tokens``). ``noise[k]``: max |bf16 logits - fp32 logits|
    of HF itself at step k: the rounding noise of the reference.
    """

    tokens: list[int]
    margin: list[float]
    noise: list[float]

    def to_json(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "margin": self.margin, "noise": self.noise}


NEAR_TIE_FACTOR = 4.0  # a divergence is a near-tie when margin <= 4 x the reference's own noise


def make_reference(model, prompt_ids: torch.Tensor, n_tokens: int) -> TokenReference:
    """HF greedy tokens plus the per-step fp32 margin and bf16-vs-fp32 noise (see
    TokenReference) of a bf16 ``model``. ``prompt_ids``: int64 [1, P] on the model's device."""
    return _with_margins(reference_tokens(model, prompt_ids, n_tokens), prompt_ids, model, torch.float32)


def bf16_margins(model, prompt_ids: torch.Tensor, tokens: list[int]) -> TokenReference:
    """A TokenReference for greedy ``tokens`` (int ids, after the prompt) of an fp32 HF
    ``model``: per step the fp32 top-2 margin and the largest |logit| difference between a
    bf16 copy of the model and the fp32 one (what judge_tokens' near-tie rule needs).
    ``prompt_ids``: int64 [1, P] on the model's device."""
    return _with_margins(list(tokens), prompt_ids, model, torch.bfloat16)


def _with_margins(tokens: list[int], prompt_ids: torch.Tensor, model, other: torch.dtype) -> TokenReference:
    """``tokens`` with the fp32 top-2 margin and the bf16-vs-fp32 logit noise at each step, from
    one forward over prompt + tokens of ``model`` and one of a copy of it cast to ``other``
    (the model's other precision of bf16 / fp32). Casts with ``.to(dtype)``, which
    transformers allows for GGUF-loaded models (their ``.float()`` raises)."""
    import copy

    seq = torch.cat([prompt_ids, torch.tensor([tokens], device=prompt_ids.device)], dim=1)
    p, n = prompt_ids.shape[1], len(tokens)
    with torch.no_grad():
        mine = model(input_ids=seq).logits[0, p - 1:p - 1 + n].float()
        copied = copy.deepcopy(model).to(other)
        theirs = copied(input_ids=seq).logits[0, p - 1:p - 1 + n].float()
        del copied
    hi, lo = (theirs, mine) if other == torch.float32 else (mine, theirs)
    top2 = hi.topk(2, dim=-1).values
    return TokenReference(tokens, (top2[:, 0] - top2[:, 1]).tolist(), (lo - hi).abs().amax(dim=-1).tolist())


def judge_tokens(tokens: list[int], ref: TokenReference) -> tuple[bool, int | None, str]:
    """Verdict for a greedy token sequence against ``ref``.

    Identical tokens are correct. A first divergence at step k is accepted only as a
    near-tie: the fp32 reference's margin at k is at most NEAR_TIE_FACTOR times HF's own
    bf16-vs-fp32 logit noise there (two correct bf16 implementations may round such a step
    either way). Returns (correct, first divergence or None, note).
    """
    n = min(len(tokens), len(ref.tokens))
    k = next((i for i in range(n) if tokens[i] != ref.tokens[i]), None)
    if k is None:
        if len(tokens) < len(ref.tokens):
            return False, len(tokens), f"only {len(tokens)} of {len(ref.tokens)} tokens"
        return True, None, "identical to HF generate"
    m, z = ref.margin[k], ref.noise[k]
    if m <= NEAR_TIE_FACTOR * z:
        return True, k, (f"diverges at token {k}, a bf16 near-tie (fp32 margin {m:.4f} <= "
                         f"{NEAR_TIE_FACTOR:g} x HF bf16 noise {z:.4f})")
    return False, k, f"diverges at token {k} (fp32 margin {m:.4f} > {NEAR_TIE_FACTOR:g} x noise {z:.4f})"


def judge(result: BaselineResult, ref: TokenReference | list[int]) -> BaselineResult:
    """Set ``result.correct`` and its note against a TokenReference (or plain tokens, which
    must then match exactly)."""
    if not isinstance(ref, TokenReference):
        ref = TokenReference(list(ref), [float("inf")] * len(ref), [0.0] * len(ref))
    result.correct, first, result.note = judge_tokens(result.tokens, ref)
    result.extra["first_divergence"] = first
    return result
