"""The compile pipeline and decoding (greedy or sampled) through a backend executor.

Stages: resolve the MODEL argument (models/sources.py) -> import the decode-step graph
(models/graph.py) -> lower to a ScheduleProgram (lowering/lower.py) -> validate
(validator/) -> build a backend executor (``sim``: lowering/sim.py; ``triton``:
lowering/triton/runtime.py) -> check logits against HF eager.

Import, lowering and validation need the model's shapes only: ``Compilation.build(...,
weights=False)`` builds the HF model on torch's ``meta`` device (no storage), so a schedule
for Llama-3.1-8B is lowered and validated in seconds and a directory holding config.json
alone compiles. ``Compilation.load_weights()`` loads them for the executor and the correctness
check; ``check_skip_reason`` says why that check cannot run here (no weights, or more memory
than is available: ``check_memory``).

Decoding runs ONE token per step (one epoch of the program per token). The prompt is either
fed token by token through the same decode program, or (``Decoder.generate(...,
prefill=...)``, amk/prefill.py) all but its last token fill the KV caches in one HF forward
and the last one runs the first decode step; then each generated token is fed back. The host
writes ``token.r{r}`` and ``pos.r{r}`` on every rank before a step and reads ``next.r{r}``
(the greedy token, identical on every rank) and ``logits.r{r}`` (each rank's vocabulary
rows) after it; sampling (amk/sampling.py) draws from the gathered logits on every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ground.errors import AmkError
from ir.program import ScheduleProgram, Target
from lowering.config import LoweringConfig
from models.graph import ModelGraph

BACKENDS = ("sim", "triton")
DEFAULT_POSITIONS = (0, 7, 31)
# Pass thresholds on max|amk - HF| / max(1, max|HF|) over the checked positions.
REL_TOL = {"f32": 1e-4, "bf16": 5e-2}
# bf16 with an fp32 reference (check_correctness(..., fp32_reference=True)): amk's distance
# to the fp32 logits may be at most this many times HF bf16's own distance to them. Two
# bf16 implementations round differently; one "within bf16 tolerance" is no further from
# the exact result than the reference implementation is (a fixed relative bound fails
# large random models whose logits are small: llama-3.1-8b, docs/experiments.md).
BF16_NOISE_FACTOR = 2.0


# -- stages ----------------------------------------------------------------------------------
def resolve(model_arg: str, seed: int = 0, weights: bool = True):
    """Resolve a MODEL argument to a ``models.sources.ResolvedModel`` with fp32 weights (the
    HF reference always runs in fp32; the lowering's ``dtype`` knob rounds weights itself).
    ``weights=False``: the model is built on the meta device (shapes only, nothing read)."""
    from models.sources import resolve_model

    return resolve_model(model_arg, dtype="fp32", seed=seed, weights=weights)


def has_weights(model: Any) -> bool:
    """Whether ``model``'s parameters hold data (False on the meta device)."""
    p = next(model.parameters(), None)
    return p is not None and not p.is_meta


def hf_cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands a KV cache object to ``model``'s forward: ``cache``
    where transformers has it (5.x: ``past_key_values`` is deprecated there and warns on
    every call), else ``past_key_values``."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        params = {}
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def import_graph(resolved: Any) -> ModelGraph:
    """The decode-step graph of a resolved model (AmkError for unsupported models)."""
    from models.graph import import_model

    return import_model(resolved.model, resolved.config, name=resolved.source.name)


def validate_program(program: ScheduleProgram):
    """Run the static validator; returns (verdict, seconds)."""
    from validator import validate

    t0 = time.perf_counter()
    verdict = validate(program)
    return verdict, time.perf_counter() - t0


def make_executor(program: ScheduleProgram, graph: ModelGraph, state: dict[str, torch.Tensor],
                  backend: str = "sim", *, seed: int = 0, policy: str = "random",
                  check: bool = True, backend_options: dict[str, Any] | None = None):
    """A backend executor for ``program`` with weights from ``state`` (an HF state dict).

    backend ``sim``: ``SimExecutor(program, init_fn, seed=, policy=, check=)``; ``triton``:
    ``TritonExecutor(program, init_fn, check=, **backend_options)`` (needs lowering/triton and
    a GPU; options: ``num_warps``, ``blocks`` = a ``lowering.triton.runtime.Blocks``). Raises
    AmkError for an unknown or unavailable backend.
    """
    from lowering.weights import make_init_fn

    init_fn = make_init_fn(state, graph.spec)
    if backend == "sim":
        from lowering.sim import SimExecutor, SimRefused

        try:
            return SimExecutor(program, init_fn, seed=seed, policy=policy, check=check)
        except SimRefused as e:
            raise AmkError(f"the sim backend refused the program: {e}", exit_code=1) from None
    if backend == "triton":
        try:
            from lowering.triton.runtime import TritonExecutor
        except ImportError as e:
            raise AmkError(f"backend triton is not available here: {e}") from None
        return TritonExecutor(program, init_fn, check=check, **(backend_options or {}))
    raise AmkError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


# -- decoding --------------------------------------------------------------------------------
class Decoder:
    """Decoding (greedy, or sampled with a ``Sampler``) through an executor running a
    lowered program.

    ``executor`` has ``step(epoch)``, ``read(buffer, rank)``, ``write(buffer, rank, tensor)``
    (SimExecutor / TritonExecutor). Epochs run in order from 0 and keep counting across
    sequences; a new sequence simply restarts at position 0 (attention reads only positions
    0..pos of the cache, so older cache rows are never read).
    """

    def __init__(self, program: ScheduleProgram, executor: Any, max_seq: int | None = None):
        self.program = program
        self.ex = executor
        self.R = program.ranks
        # A distributed executor (one rank per process, ``executor.dist`` set) holds only its
        # own ranks; every process runs this same decoder (SPMD) and host-side values of
        # other ranks arrive through ``dist.all_gather_object``.
        self.local = list(getattr(executor, "local_ranks", range(self.R)))
        self.dist = getattr(executor, "dist", None)
        self.epoch = 0
        self.max_seq = max_seq or int(program.config.get("max_seq", 0)) or None
        self.steps = 0
        self.seconds = 0.0

    def _write_inputs(self, rank: int, token: int, pos: int) -> None:
        self.ex.write(f"token.r{rank}", rank, torch.tensor([token], dtype=torch.int32))
        self.ex.write(f"pos.r{rank}", rank, torch.tensor([pos], dtype=torch.int32))

    def _check_pos(self, pos: int) -> None:
        if pos < 0 or (self.max_seq is not None and pos >= self.max_seq):
            raise AmkError(f"position {pos} is outside the KV cache of {self.max_seq} tokens; "
                           "raise the max_seq knob (--config FILE with {\"max_seq\": N})")

    def step(self, token: int, pos: int, sampler: Any = None) -> int:
        """Run one decode step for ``token`` at ``pos``; returns the next token: the greedy
        one of the schedule, or with ``sampler`` (amk.sampling.Sampler) the one every local
        rank draws from the gathered logits. Raises AmkError if the ranks disagree on it."""
        self._check_pos(pos)
        for r in self.local:
            self._write_inputs(r, token, pos)
        t0 = time.perf_counter()
        self.ex.step(self.epoch)
        self.seconds += time.perf_counter() - t0
        self.epoch += 1
        self.steps += 1
        return self.next_token() if sampler is None else self.sampled_token(sampler)

    def _gather(self, local: dict) -> dict:
        """Merge per-rank dicts from every process (identity without ``dist``)."""
        if self.dist is None:
            return local
        out: dict = {}
        for part in self.dist.all_gather_object(local):
            out.update(part)
        return out

    def next_token(self) -> int:
        mine = {r: int(self.ex.read(f"next.r{r}", r).reshape(-1)[0]) for r in self.local}
        got = self._gather(mine)
        toks = [got[r] for r in range(self.R)]
        if len(set(toks)) != 1:
            raise AmkError(f"ranks disagree on the next token: {toks}", exit_code=1)
        return toks[0]

    def sampled_token(self, sampler: Any) -> int:
        """The token each local rank draws with ``sampler`` (``pick(rank, logits)``) from the
        full logits of the last step, gathered from every rank; AmkError (exit 1) if the ranks
        disagree (in a multi-process run each process draws for its own rank)."""
        logits = self.logits()
        got = self._gather({r: sampler.pick(r, logits) for r in self.local})
        toks = [got[r] for r in range(self.R) if r in got]
        if len(set(toks)) != 1:
            raise AmkError(f"ranks disagree on the sampled token: {toks}", exit_code=1)
        return toks[0]

    def logits(self, rank_logits: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        """The full fp32 logits vector [vocab], gathered from every rank's slice in order."""
        have = dict(rank_logits or {})
        if len(have) < self.R:
            mine = {r: self.ex.read(f"logits.r{r}", r) for r in self.local if r not in have}
            have.update(self._gather(mine))
        parts = [have[r] for r in range(self.R)]
        return torch.cat([p.reshape(-1).float() for p in parts])

    def teacher_forced(self, tokens: Sequence[int], keep: Sequence[int],
                       progress: Callable[[int, int], None] | None = None) -> dict[int, torch.Tensor]:
        """Feed ``tokens`` at positions 0..n-1; return the logits at the positions in ``keep``.

        With an executor that has ``run_steps`` (the sim), the steps run as one launch
        sequence in which ranks may drift up to the schedule's limits across epochs (inputs
        are written per rank when that rank starts a step, outputs read when it finishes), so
        cross-step races in the schedule would show up here. ``progress(done, n)`` is called
        as positions complete on every local rank.
        """
        n = len(tokens)
        finished: dict[int, int] = {}

        def tick(pos: int) -> None:
            finished[pos] = finished.get(pos, 0) + 1
            if progress and finished[pos] == len(self.local):
                progress(sum(1 for c in finished.values() if c == len(self.local)), n)

        self._check_pos(n - 1)
        keep_set = set(keep)
        out: dict[int, dict[int, torch.Tensor]] = {p: {} for p in keep_set}
        base = self.epoch
        t0 = time.perf_counter()
        if hasattr(self.ex, "run_steps"):
            def on_start(epoch: int, rank: int) -> None:
                pos = epoch - base
                self._write_inputs(rank, int(tokens[pos]), pos)

            def on_end(epoch: int, rank: int) -> None:
                pos = epoch - base
                if pos in keep_set:
                    out[pos][rank] = self.ex.read(f"logits.r{rank}", rank)
                tick(pos)

            self.ex.run_steps(n, on_start=on_start, on_end=on_end)
            self.epoch += n
        else:
            for pos in range(n):
                for r in self.local:
                    self._write_inputs(r, int(tokens[pos]), pos)
                self.ex.step(self.epoch)
                self.epoch += 1
                if pos in keep_set:
                    out[pos] = {r: self.ex.read(f"logits.r{r}", r) for r in self.local}
                for _ in self.local:
                    tick(pos)
        if self.dist is not None:
            out = {p: self._gather({r: v.cpu() for r, v in d.items()}) for p, d in out.items()}
        self.seconds += time.perf_counter() - t0
        self.steps += n
        return {p: self.logits(out[p]) for p in sorted(keep_set)}

    def generate(self, prompt: Sequence[int], max_new_tokens: int,
                 eos: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
                 sampler: Any = None, prefill: Callable[[Sequence[int]], None] | None = None) -> list[int]:
        """Decode ``max_new_tokens`` new tokens after ``prompt``; stop early at a token in
        ``eos`` (which is kept, as HF does). Returns the new tokens.

        The prompt is fed token by token through the decode step, or with ``prefill`` (a
        callable writing the KV-cache rows of the tokens it gets at positions 0..n-1, e.g.
        ``amk.prefill.Prefiller.fill``) all prompt tokens but the last go through it in one
        pass and only the last runs a decode step. ``sampler``: draw each token (see
        ``sampled_token``) instead of the schedule's greedy one. ``on_token(tok)`` is called
        as each new token is known."""
        if not prompt:
            raise AmkError("the prompt is empty (no tokens to feed)")
        if max_new_tokens < 1:
            return []
        self._check_pos(len(prompt) + max_new_tokens - 2)
        nxt = None
        start = 0
        if prefill is not None and len(prompt) > 1:
            prefill([int(t) for t in prompt[:-1]])
            start = len(prompt) - 1
        for pos in range(start, len(prompt)):
            nxt = self.step(int(prompt[pos]), pos, sampler)
        new = [nxt]
        if on_token:
            on_token(nxt)
        pos = len(prompt)
        while len(new) < max_new_tokens and new[-1] not in eos:
            nxt = self.step(new[-1], pos, sampler)
            pos += 1
            new.append(nxt)
            if on_token:
                on_token(nxt)
        return new


# -- HF reference --------------------------------------------------------------------------
def hf_tokenwise_logits(model: Any, tokens: Sequence[int], keep: Sequence[int],
                        progress: Callable[[int, int], None] | None = None) -> dict[int, torch.Tensor]:
    """HF eager logits at positions ``keep``, feeding ``tokens`` one at a time through a
    ``DynamicCache`` (the same one-token-per-step order as amk). fp32 [vocab] tensors.
    ``progress(done, total)`` after each position (total: max(keep) + 1)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    out = {}
    keep_set = set(keep)
    total = max(keep_set) + 1
    kw = hf_cache_kwargs(model, cache)  # the cache object is updated in place
    with torch.no_grad():
        for pos, tok in enumerate(tokens):
            res = model(input_ids=torch.tensor([[int(tok)]], device=model.device),
                        use_cache=True, **kw)
            if pos in keep_set:
                out[pos] = res.logits[0, -1].float().cpu()
            if progress:
                progress(pos + 1, total)
            if pos >= max(keep_set):
                break
    return out


def hf_generate(model: Any, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` with greedy decoding (do_sample=False); returns the new tokens."""
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                             temperature=None, top_p=None, top_k=None)
    return [int(t) for t in out[0, ids.shape[1]:]]


def eos_ids(model: Any) -> list[int]:
    """EOS token ids of the model's generation config (what HF generate stops at)."""
    gc = getattr(model, "generation_config", None)
    e = getattr(gc, "eos_token_id", None) if gc is not None else None
    if e is None:
        e = getattr(model.config, "eos_token_id", None)
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, (list, tuple)) else [e])]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, or of the end of the shorter list when the lengths
    differ; None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- correctness -----------------------------------------------------------------------------
@dataclass
class PositionCheck:
    pos: int
    max_abs_err: float
    max_abs_ref: float
    rel_err: float
    argmax_ref: int
    argmax_amk: int
    argmax_agree: bool
    ref_margin: float   # top-1 minus top-2 of the HF logits
    # bf16 runs with an fp32 reference: max |amk - HF fp32| and HF's own max |bf16 - fp32|
    err_vs_fp32: float | None = None
    hf_noise: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class CorrectnessReport:
    """Logit agreement of the schedule with HF eager at a few positions."""

    positions: list[PositionCheck]
    dtype: str
    rel_tol: float
    tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def max_abs_err(self) -> float:
        return max((p.max_abs_err for p in self.positions), default=0.0)

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Why the check fails (empty when it passes). An argmax disagreement fails unless
        HF's own top-2 margin is within twice the observed error (a numerical near-tie)."""
        out = []
        for p in self.positions:
            if p.hf_noise is not None and math.isfinite(p.max_abs_err):
                # bf16: as close to the fp32 truth as HF's own bf16 run, within BF16_NOISE_FACTOR
                bound = BF16_NOISE_FACTOR * p.hf_noise + 1e-3
                if not (p.err_vs_fp32 <= bound):
                    out.append(f"position {p.pos}: max |amk - HF fp32| {p.err_vs_fp32:.3g} > "
                               f"{BF16_NOISE_FACTOR:g} x HF's own bf16 error {p.hf_noise:.3g}")
                elif not p.argmax_agree and p.ref_margin > 2 * p.max_abs_err:
                    out.append(f"position {p.pos}: argmax {p.argmax_amk} != HF {p.argmax_ref} "
                               f"(HF margin {p.ref_margin:.3g})")
                continue
            if not math.isfinite(p.max_abs_err) or p.rel_err > self.rel_tol:
                out.append(f"position {p.pos}: relative logit error {p.rel_err:.3g} > "
                           f"{self.rel_tol:g} (max abs error {p.max_abs_err:.3g})")
            elif not p.argmax_agree and p.ref_margin > 2 * p.max_abs_err:
                out.append(f"position {p.pos}: argmax {p.argmax_amk} != HF {p.argmax_ref} "
                           f"(HF margin {p.ref_margin:.3g})")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "dtype": self.dtype, "rel_tol": self.rel_tol,
                "max_abs_err": self.max_abs_err, "failures": self.failures(),
                "positions": [p.to_json() for p in self.positions],
                "tokens": self.tokens, "seconds": self.seconds}


def check_tokens(vocab: int, n: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence of length n (seeded, independent of global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=g)]


def compare(ref: dict[int, torch.Tensor], got: dict[int, torch.Tensor], dtype: str,
            tokens: Sequence[int] = (), seconds: float = 0.0,
            ref32: dict[int, torch.Tensor] | None = None) -> CorrectnessReport:
    """Per-position logit comparison of ``got`` with ``ref`` (HF in the run's dtype);
    ``ref32``: fp32 HF logits, for the bf16 rule (see BF16_NOISE_FACTOR)."""
    checks = []
    for pos in sorted(ref):
        r, g = ref[pos].float(), got[pos].float()
        if r.shape != g.shape:
            raise AmkError(f"logits at position {pos} have {g.numel()} entries, HF {r.numel()}",
                           exit_code=1)
        err = float((r - g).abs().max())
        if torch.isnan(g).any():
            err = float("nan")
        mx = float(r.abs().max())
        top2 = torch.topk(r, 2).values
        pc = PositionCheck(pos, err, mx, err / max(1.0, mx), int(r.argmax()),
                           int(g.argmax()), int(r.argmax()) == int(g.argmax()),
                           float(top2[0] - top2[1]))
        if ref32 is not None and pos in ref32:
            t = ref32[pos].float()
            pc.err_vs_fp32 = float((t - g).abs().max()) if not torch.isnan(g).any() else float("nan")
            pc.hf_noise = float((t - r).abs().max())
        checks.append(pc)
    return CorrectnessReport(checks, dtype, REL_TOL.get(dtype, 5e-2), list(tokens), seconds)


def check_correctness(model: Any, decoder: Decoder, vocab: int, dtype: str = "f32",
                      positions: Sequence[int] = DEFAULT_POSITIONS, tokens: Sequence[int] | None = None,
                      seed: int = 0,
                      progress: Callable[[str, int, int], None] | None = None) -> CorrectnessReport:
    """Teacher-force a token sequence through the schedule and through HF eager (DynamicCache,
    one token per step) and compare the logits at ``positions``. Tokens default to a fixed
    pseudo-random sequence of length max(positions)+1. When ``model`` holds bf16/fp16
    weights, an fp32 copy of it also runs (one forward over the sequence) and the bf16 rule
    applies (BF16_NOISE_FACTOR): the schedule must be about as close to the fp32 logits as
    HF's own low-precision run is. With a distributed decoder every rank calls this (SPMD);
    rank 0 alone runs HF and broadcasts its logits. ``progress(part, done, total)`` reports
    positions done: part "schedule" (the executor), then "hf" (the HF reference)."""
    n = max(positions) + 1
    toks = list(tokens) if tokens is not None else check_tokens(vocab, n, seed)
    if len(toks) < n:
        raise AmkError(f"correctness check needs {n} tokens, got {len(toks)}")
    toks = toks[:n]
    t0 = time.perf_counter()
    got = decoder.teacher_forced(
        toks, positions, progress=(lambda d, t: progress("schedule", d, t)) if progress else None)
    # In a distributed run (SPMD) the HF reference is computed once, by rank 0, and sent.
    dist = getattr(decoder, "dist", None)
    ref = ref32 = None
    if dist is None or dist.rank == 0:
        ref = hf_tokenwise_logits(
            model, toks, positions, progress=(lambda d, t: progress("hf", d, t)) if progress else None)
        if next(model.parameters()).dtype != torch.float32:
            ref32 = fp32_logits(model, toks, positions)
    if dist is not None:
        ref, ref32 = dist.broadcast_object((ref, ref32), src=0)
    return compare(ref, got, dtype, toks, time.perf_counter() - t0, ref32=ref32)


def fp32_logits(model: Any, tokens: Sequence[int], keep: Sequence[int]) -> dict[int, torch.Tensor]:
    """Logits of an fp32 copy of ``model`` (same device) at positions ``keep``, from one
    causal forward over ``tokens``: the exact-arithmetic reference of a bf16 run."""
    import copy
    m32 = copy.deepcopy(model).float()
    try:
        with torch.no_grad():
            lg = m32(input_ids=torch.tensor([list(tokens)], device=next(m32.parameters()).device)).logits[0]
        return {p: lg[p].float().cpu() for p in keep}
    finally:
        del m32
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- memory --------------------------------------------------------------------------------
# Peak host memory while loading, in units of the fp32 model (measured: SmolLM2-135M's GGUF,
# first dequantized to fp32 arrays then copied into the model, 0.76 GB of peak for 0.54 GB
# of weights; the llama-3.2-1b recipe, drawn in place with temporaries, 5.56 GiB for 4.6).
LOAD_FACTOR = {"gguf": 1.5, "alias": 1.5}
LOAD_FACTOR_DEFAULT = 1.25
# Kept free on top of the estimate: the HF forward's temporaries, the executor's
# bookkeeping, the allocator's slack.
MEMORY_HEADROOM = 512 << 20


def available_memory() -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, lowered to the
    cgroup's ``memory.max - memory.current`` when a cgroup v2 limit is set; None when
    neither can be read (not Linux)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = int(limit) - int(f.read().strip())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def parameter_count(model: Any) -> int:
    """Unique parameters of ``model`` (tied weights once); works on the meta device."""
    return sum(p.numel() for p in model.parameters())


def check_memory(compilation: "Compilation") -> tuple[int, str]:
    """Bytes of host memory the correctness check needs beyond what the process holds
    now, and how they add up (one line). The check holds the fp32 HF model (parameters x 4
    bytes, x LOAD_FACTOR / LOAD_FACTOR_DEFAULT at the loading peak) and the executor's buffers: KV
    caches, activations and io buffers, plus the weight slices the executor must convert
    (an f32 schedule's weights are views of the HF tensors; a bf16 one's are copies),
    plus MEMORY_HEADROOM."""
    hf = parameter_count(compilation.resolved.model) * 4
    factor = LOAD_FACTOR.get(compilation.resolved.source.kind, LOAD_FACTOR_DEFAULT)
    prog = 0
    for b in compilation.program.buffers:
        if b.kind == "weight" and b.dtype == "f32":
            continue
        prog += b.nbytes * (compilation.program.ranks if b.rank is None else 1)
    need = int(hf * factor) + prog + MEMORY_HEADROOM
    gib = 1 << 30
    detail = (f"fp32 HF model {hf / gib:.1f} GiB x{factor:g} while loading"
              + f" + executor buffers {prog / gib:.1f} GiB + {MEMORY_HEADROOM / gib:.1f} GiB headroom")
    return need, detail


def check_skip_reason(compilation: "Compilation", no_check: bool = False,
                      available: int | None = None) -> str | None:
    """Why the correctness check cannot run here, or None when it can: ``--no-check``, a
    source without weights, or an estimated need (``check_memory``) above the available
    memory (``available``: bytes, default ``available_memory()``)."""
    if no_check:
        return "--no-check"
    src = compilation.resolved.source
    if not src.weights:
        return f"{src.path} has no weights (config.json only)"
    avail = available_memory() if available is None else available
    if avail is None or has_weights(compilation.resolved.model):
        return None
    need, detail = check_memory(compilation)
    if need > avail:
        gib = 1 << 30
        return (f"it needs about {need / gib:.1f} GiB ({detail}), {avail / gib:.1f} GiB "
                "of memory is available")
    return None


# -- the whole pipeline --------------------------------------------------------------------
@dataclass
class Compilation:
    """A compiled model: resolved HF model, graph, program and (once started) an executor.

    Build with ``Compilation.build(model_arg, ranks, config)``; ``verdict`` is the validation
    result (``validate_s`` its time). ``decoder(backend, seed, policy)`` starts an executor.
    Built with ``weights=False`` the HF model lives on the meta device (shapes only) until
    ``load_weights()``.
    """

    resolved: Any
    graph: ModelGraph
    program: ScheduleProgram
    config: LoweringConfig
    verdict: Any = None
    validate_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def build(cls, model_arg: str, ranks: int, config: LoweringConfig | None = None,
              target: Target | None = None, validate: bool = True,
              progress: Callable[[str], None] | None = None,
              resolved: Any = None, weights: bool = True) -> "Compilation":
        """Resolve (unless ``resolved`` is given), import, lower and (optionally) validate.
        ``weights=False``: resolve shapes only (meta device); lowering and validation need
        nothing more. Raises AmkError for bad input or an unsupported model."""
        from lowering.lower import lower

        cfg = config or LoweringConfig()
        timings: dict[str, float] = {}

        def stage(name: str, fn, *a):
            if progress:
                progress(name)
            t0 = time.perf_counter()
            res = fn(*a)
            timings[name] = time.perf_counter() - t0
            return res

        if resolved is None:
            resolved = stage("resolve", resolve, model_arg, 0, weights)
        graph = stage("import", import_graph, resolved)
        program = stage("lower", lambda: lower(graph, ranks, config=cfg, target=target))
        s = cls(resolved, graph, program, cfg, timings=timings)
        if validate:
            s.verdict, s.validate_s = stage("validate", validate_program, program)
        return s

    @property
    def has_weights(self) -> bool:
        """Whether the HF model holds its weights (False after ``build(weights=False)``)."""
        return has_weights(self.resolved.model)

    def load_weights(self) -> None:
        """Load the model's fp32 weights if the compilation was built without them, and check
        them against the graph (missing, mis-shaped or unmodelled parameters). Raises
        AmkError when the source has no weights or the checkpoint cannot be loaded."""
        if self.has_weights:
            return
        t0 = time.perf_counter()
        self.resolved = resolve(self.resolved.source.arg, weights=True)
        import_graph(self.resolved)
        self.timings["load weights"] = time.perf_counter() - t0

    def decoder(self, backend: str = "sim", seed: int = 0, policy: str = "random",
                backend_options: dict[str, Any] | None = None) -> Decoder:
        if self.verdict is not None and not self.verdict.ok:
            raise AmkError("the schedule was rejected by the validator; it will not be run",
                           exit_code=1)
        self.load_weights()
        ex = make_executor(self.program, self.graph, self.resolved.model.state_dict(), backend,
                           seed=seed, policy=policy, check=self.verdict is None,
                           backend_options=backend_options)
        return Decoder(self.program, ex, self.config.max_seq)

    def check(self, decoder: Decoder, positions: Sequence[int] = DEFAULT_POSITIONS,
              seed: int = 0,
              progress: Callable[[str, int, int], None] | None = None) -> CorrectnessReport:
        """Logits of ``decoder`` against HF eager at ``positions`` (check_correctness;
        ``progress(part, done, total)`` as positions complete)."""
        if max(positions) >= self.config.max_seq:
            raise AmkError(f"correctness positions up to {max(positions)} need max_seq > "
                           f"{max(positions)}, the config has {self.config.max_seq}")
        return check_correctness(self.reference_model(), decoder, self.graph.spec.vocab,
                                 self.config.dtype, positions, seed=seed, progress=progress)

    def reference_model(self) -> Any:
        """The HF model the schedule must match: the resolved model, or for a quantized
        config (``weights`` int8 / fp8) a copy with the same quantized weights, dequantized
        (lowering.quant.quantized_copy; built once)."""
        from lowering.quant import is_quantized, quantized_copy

        if not is_quantized(self.config.weights):
            return self.resolved.model
        self.load_weights()
        key = (id(self.resolved.model), self.config.weight_format, self.config.quantize_lm_head)
        if getattr(self, "_ref", (None, None))[0] != key:
            self._ref = (key, quantized_copy(self.resolved.model, self.config.weight_format,
                                             self.config.quantize_lm_head))
        return self._ref[1]
