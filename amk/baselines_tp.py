"""Tensor-parallel HF baselines that `amk bench MODEL --tp R` measures in every rank process.

SPMD: all R rank processes call the same functions in the same order; each returns its own
rank's result, and ``gather_tp`` (collective) combines them into the row rank 0 reports.

(a) ``hf_tp_eager``: transformers' built-in tensor parallelism (the model's ``tp_plan``,
    loaded with ``from_pretrained`` and ``DistributedConfig(tp_size=R, tp_plan="auto")``;
    on transformers without ``transformers.distributed``, the older ``tp_plan="auto"``
    argument), one forward per token with its DynamicCache plus argmax, timed per decode
    step with CUDA events: exactly ``amk.baselines.hf_eager`` run on every rank.
(b) ``hf_tp_compiled_graph``: the same TP model, one decode step (StaticCache,
    cache_position, argmax, position/token bump on the device) compiled by
    ``torch.compile`` and captured in one CUDA graph per rank, replayed per token (baseline
    (b) of ``amk.baselines``, per rank). If the compiled attempt fails on any rank, every
    rank falls back to capturing the uncompiled step and the result says so
    (``extra["compiled"] = False`` and ``extra["compile_error"]``), never silently.

Weights reach every rank from a safetensors directory (``prepare_tp_checkpoint``): a local
HF directory is used in place; any other source (``config:`` recipe, GGUF, alias) is
written once by rank 0 in the benchmark dtype while the others wait, so no rank but 0
ever holds the whole model in host memory, and ``from_pretrained`` reads only each rank's
shards. (transformers 5.x can also shard an in-memory model, ``DistributedMixin.
maybe_distribute_model``, but only on a model built on the meta device before its weights
are loaded, and its signature differs between 5.17 and 5.23; the checkpoint route is the
public, version-stable one.)

Communication: transformers builds its device mesh with ``init_device_mesh`` over the
*default* process group, so the TP collectives use whatever backend that group has for
the device. On GPUs it must be NCCL: ``load_tp_model`` refuses a default group whose CUDA
backend is not NCCL (the gloo-only bootstrap group would carry every all-reduce through
host memory and time gloo, not NCCL). ``lowering.triton.dist.init_distributed`` must
therefore create the default group as ``"cpu:gloo,cuda:nccl"``: CPU tensors (object
collectives, barriers, NVSHMEM bootstrap) keep using gloo and CUDA tensors use NCCL, whose
communicator is created lazily on the first CUDA collective. On the CPU (tests) the mesh
is a CPU mesh over gloo.

Correctness: every result carries the greedy tokens it produced; ``gather_tp`` keeps only
the prefix all ranks agree on (replicated logits must give the same argmax everywhere),
so ``amk.baselines.judge`` fails a run whose ranks disagree ("only k of n tokens").
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from amk.baselines import BaselineResult, fresh_compile, hf_eager, run_name
from ground.errors import AmkError
from ground.timing import Timing, time_per_call

#: Written last into a checkpoint directory prepared by rank 0; a directory whose marker
#: matches the request is reused instead of written again.
MARKER = "amk_tp_checkpoint.json"


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    # dynamo appends advice on logging to every error; it is not part of the reason
    text = text.split(" Set TORCHDYNAMO_VERBOSE=1")[0]
    text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _by_rank(errs: list[str | None]) -> str:
    """"ranks 0,1: msg; rank 2: other" for the non-None entries of a per-rank list."""
    groups: dict[str, list[int]] = {}
    for r, e in enumerate(errs):
        if e is not None:
            groups.setdefault(e, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {e}"
                     for e, rs in groups.items())


# ---------------------------------------------------------------------------------- checks


def check_tp_shapes(config: Any, world: int) -> None:
    """Raise AmkError unless HF's TP plan can split ``config``'s attention over ``world``
    ranks: it shards q/k/v column-wise by output features, so the query heads and the KV
    heads must both be divisible by ``world`` (an uneven split would cut a head in two).
    """
    if world < 1:
        raise AmkError(f"tensor-parallel degree must be at least 1, got {world}")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    bad = [f"{what} {n}" for what, n in (("query heads", heads), ("KV heads", kv)) if n % world]
    if bad:
        raise AmkError("HF tensor parallelism splits attention by whole heads: "
                       f"{' and '.join(bad)} not divisible by --tp {world}")


def cuda_backend(backend_config: str) -> str | None:
    """The backend name a process group uses for CUDA tensors, from the string of
    ``torch.distributed.get_backend_config()`` ("cpu:gloo,cuda:nccl" -> "nccl", a single
    name such as "nccl" -> that name), or None when CUDA has no backend."""
    backend_config = backend_config.strip().lower()
    if ":" not in backend_config:
        return backend_config or None
    for part in backend_config.split(","):
        dev, _, name = part.partition(":")
        if dev.strip() == "cuda":
            return name.strip() or None
    return None


def check_default_group(device: torch.device) -> None:
    """Raise AmkError unless torch.distributed is initialised and, for a CUDA ``device``,
    its default group sends CUDA tensors through NCCL (see the module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise AmkError("the TP baselines need torch.distributed initialised (init_distributed)",
                       exit_code=1)
    if device.type != "cuda":
        return
    cfg = dist.get_backend_config()
    if cuda_backend(cfg) != "nccl":
        raise AmkError(f"the default process group has backend {cfg!r}: HF tensor parallelism "
                       "would run its collectives without NCCL; initialise it with "
                       "'cpu:gloo,cuda:nccl' (lowering/triton/dist.py init_distributed)",
                       exit_code=1)


# ---------------------------------------------------------------------------------- weights


def _source_stamp(model_arg: str, dtype: str, seed: int) -> dict[str, Any]:
    """What a prepared checkpoint was made from; equal stamps mean equal weights."""
    from models.sources import parse_model_arg

    src = parse_model_arg(model_arg)
    stamp: dict[str, Any] = {"model": model_arg, "kind": src.kind, "dtype": dtype, "seed": seed}
    if src.gguf_file:
        st = (src.path / src.gguf_file).stat()
        stamp.update(file=str(src.path / src.gguf_file), size=st.st_size, mtime_ns=st.st_mtime_ns)
    if src.kind != "recipe":
        stamp.pop("seed")
    return stamp


def prepare_tp_checkpoint(model_arg: str, ctx, save_dir: str | os.PathLike, *, model=None,
                          dtype: str = "bf16", seed: int | None = None) -> Path:
    """A safetensors directory every rank can load with ``from_pretrained``. Collective.

    ``model_arg``: the MODEL argument (models.sources). A local HF directory is returned as
    is (nothing written). Otherwise rank 0 writes the model to ``save_dir`` in ``dtype``
    ("bf16", "fp32", ...) with ``save_pretrained`` (safetensors), unless ``save_dir``
    already holds a checkpoint of the same source, dtype and seed; the other ranks wait.
    ``model``: rank 0's already-resolved model of that source in ``dtype`` (e.g. the one
    bench holds for its reference), saved instead of resolving it again; ignored on other
    ranks. Without it, rank 0 resolves the model uncached; for a recipe that draws fp32
    weights and casts them (models.recipes), so the weights equal ``resolve_model(arg,
    dtype)``'s but rank 0 transiently holds the fp32 model (32 GB for llama-3.1-8b).
    Raises AmkError on every rank when rank 0 cannot write the checkpoint.
    """
    from models import recipes
    from models.sources import parse_model_arg

    src = parse_model_arg(model_arg)
    if src.kind == "hf-dir":
        return src.path
    seed = recipes.DEFAULT_SEED if seed is None else seed
    out = Path(save_dir)
    status: tuple[str, str] = ("ok", str(out))
    if ctx.rank == 0:
        try:
            stamp = _source_stamp(model_arg, dtype, seed)
            marker = out / MARKER
            fresh = marker.is_file() and json.loads(marker.read_text()) == stamp
            if not fresh:
                _write_checkpoint(model_arg, out, model, dtype, seed)
                from ground.files import atomic_write_text  # whole stamp or none

                atomic_write_text(marker, json.dumps(stamp, indent=1))
        except AmkError as e:
            status = ("error", str(e))
        except Exception as e:  # disk full, permissions: report on every rank, do not hang
            status = ("error", f"cannot write the TP checkpoint to {out}: {_one_line(e)}")
    status = ctx.broadcast_object(status, src=0)
    if status[0] != "ok":
        raise AmkError(f"rank 0: {status[1]}", exit_code=1)
    return Path(status[1])


def _write_checkpoint(model_arg: str, out: Path, model, dtype: str, seed: int) -> None:
    from models.sources import parse_dtype, resolve_model

    if model is None:
        model = resolve_model(model_arg, dtype=dtype, seed=seed, cache=False).model
    elif next(model.parameters()).dtype != parse_dtype(dtype):
        raise AmkError(f"prepare_tp_checkpoint: the given model is "
                       f"{next(model.parameters()).dtype}, expected {parse_dtype(dtype)}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)


def load_tp_model(checkpoint: str | os.PathLike, ctx, *, dtype: str = "bf16"):
    """This rank's shard of the model in ``checkpoint``, tensor-parallel over ``ctx.world``
    ranks with the model's own HF TP plan, on ``ctx.device``, in eval mode. Collective.

    Parameters that the plan shards are DTensors (``.to_local()`` is this rank's slice);
    logits come out replicated on every rank (``lm_head``: column-wise with gathered output).
    Raises AmkError when the shapes cannot be split (``check_tp_shapes``), the default
    process group has no NCCL for CUDA (``check_default_group``), loading fails, or the
    loaded model is not actually sharded or not on ``ctx.device``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.sources import parse_dtype

    check_default_group(ctx.device)
    path = str(checkpoint)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise AmkError(f"cannot read the config of {path}: {_one_line(e)}") from None
    check_tp_shapes(config, ctx.world)
    kwargs: dict[str, Any] = {"dtype": parse_dtype(dtype), "local_files_only": True}
    try:
        from transformers.distributed import DistributedConfig
        kwargs["distributed_config"] = DistributedConfig(tp_size=ctx.world, tp_plan="auto")
    except ImportError:  # transformers 4.x: the standalone argument
        kwargs["tp_plan"] = "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as e:
        raise AmkError(f"rank {ctx.rank}: HF tensor-parallel load of {path} failed: "
                       f"{_one_line(e)}", exit_code=1) from None
    sharded = tp_sharded_parameters(model)
    if ctx.world > 1 and not sharded:
        raise AmkError(f"transformers did not shard {type(model).__name__} (no parameter is a "
                       "sharded DTensor): it has no usable tensor-parallel plan", exit_code=1)
    dev = next(model.parameters()).device
    if dev.type != ctx.device.type or (dev.index or 0) != (ctx.device.index or 0):
        raise AmkError(f"rank {ctx.rank}: the TP model landed on {dev}, expected {ctx.device}",
                       exit_code=1)
    return model.eval()


def tp_sharded_parameters(model) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Parameter name -> (global shape, this rank's local shape) for every parameter that is
    a DTensor with a Shard placement (i.e. split across ranks, not replicated)."""
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            out[name] = (tuple(p.shape), tuple(p.to_local().shape))
    return out


# ---------------------------------------------------------------------------------- baselines


def hf_tp_eager(model, ctx, prompt_ids: torch.Tensor, n_tokens: int,
                warmup: int = 3) -> BaselineResult:
    """Baseline (a) per rank: ``amk.baselines.hf_eager`` on this rank's TP model.

    ``model``: from ``load_tp_model``; ``prompt_ids``: int64 [1, P], the same on every rank
    (moved to ``ctx.device``). Collective: every forward all-reduces across ranks. Returns
    this rank's BaselineResult "hf_tp_eager": the ``n_tokens`` greedy tokens after the
    prompt and the CUDA-event timing of ``n_tokens - 1 - warmup`` decode steps (host
    ``perf_counter`` on the CPU); combine ranks with ``gather_tp``.
    """
    prompt_ids = prompt_ids.to(ctx.device)
    _sync(ctx)
    res = hf_eager(model, prompt_ids, n_tokens, warmup=warmup)
    res.name = "hf_tp_eager"
    res.extra.update(rank=ctx.rank, world=ctx.world)
    return res


def hf_tp_compiled_graph(model, ctx, prompt_ids: torch.Tensor, n_tokens: int,
                         max_cache_len: int | None = None, *, compile: bool = True,
                         cuda_graph: bool | None = None,
                         compile_backend: str | Callable = "inductor", mode: str | None = None) -> BaselineResult:
    """Baseline (b) per rank: a decode step over a StaticCache, compiled, in one CUDA graph.

    The step (TP forward of one token at ``cache_position``, argmax, token/position bump on
    the device) is compiled with ``torch.compile(backend=compile_backend)``, warmed up on a
    side stream, captured in a CUDA graph, and replayed once per token (prompt fed token by
    token through the same graph, as in ``amk.baselines.hf_compiled_graph``). Collective:
    the captured graph holds this rank's NCCL collectives, so all ranks replay in lockstep.

    If the compiled attempt raises on any rank (compile or capture; the ranks agree through
    ``ctx.all_gather_object``), every rank resets dynamo and captures the uncompiled step
    instead; the result then has ``extra["compiled"] = False`` and
    ``extra["compile_error"]`` = "ranks 0,1: phase: error". ``compile=False`` skips the
    attempt (reason "not requested"). ``cuda_graph``: default True on CUDA; False runs the
    step per token without a graph (result named "hf_tp_compiled", for CPU tests); True on
    a CPU device raises AmkError. ``mode``: torch.compile's mode (None: its default, as
    ``amk.baselines.hf_compiled_graph``); the result's name then ends in ``[mode]``.
    Returns this rank's BaselineResult; combine with ``gather_tp``. Raises whatever the
    uncompiled fallback raises.
    """
    dev = ctx.device
    if cuda_graph is None:
        cuda_graph = dev.type == "cuda"
    if cuda_graph and dev.type != "cuda":
        raise AmkError("the CUDA-graph TP baseline needs CUDA devices")
    prompt_ids = prompt_ids.to(dev)
    reason = "not requested"
    if compile:
        try:
            res = _graph_decode(model, ctx, prompt_ids, n_tokens, max_cache_len,
                                compile_backend, cuda_graph, mode)
            res.extra.update(compiled=True, compile_error=None)
            return res
        except _PhaseError as e:
            reason = str(e)
        import torch._dynamo
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    res = _graph_decode(model, ctx, prompt_ids, n_tokens, max_cache_len, None, cuda_graph, mode)
    res.extra.update(compiled=False, compile_error=reason)
    if compile:
        res.note = (f"uncompiled: torch.compile failed ({reason[:200]}); the plain step was "
                    + ("captured instead" if cuda_graph else "used instead"))
    return res


def tp_compiled_name(mode: str | None, cuda_graph: bool = True) -> str:
    """The result name of the TP baseline (b) compiled in ``mode`` (None: torch.compile's
    default), as ``amk.baselines.compiled_graph_name`` names the single-GPU one;
    ``cuda_graph`` False: the per-token compiled step of the CPU tests."""
    base = "hf_tp_compiled_graph" if cuda_graph else "hf_tp_compiled"
    return base if mode is None else f"{base}[{mode}]"


class _PhaseError(Exception):
    """A failure of the compiled attempt, with the phase it happened in."""


def _graph_decode(model, ctx, prompt_ids, n_tokens, max_cache_len, compile_backend,
                  cuda_graph: bool, mode: str | None = None) -> BaselineResult:
    """One static-cache decode run (see hf_tp_compiled_graph). ``compile_backend`` None:
    uncompiled, errors raise as they are. ``mode``: torch.compile's mode, and the name's
    ``[mode]`` suffix. When compiling, an error in the warm-up
    (compile) or capture phase is held until the agreement point after capture, where the
    ranks exchange their errors over the host group; if any rank failed, every rank raises
    _PhaseError (the caller falls back) before replaying anything. This keeps the ranks in
    step when a failure is symmetric (same code, inputs and versions on every rank); a
    failure on one rank only, in the middle of the warm-up's collectives, leaves its peers
    waiting in NCCL until NCCL's own timeout."""
    from amk.baselines import StaticDecode, capture_graph, warm_up_on_side_stream

    dev = ctx.device
    if n_tokens < 2:
        raise ValueError(f"n_tokens={n_tokens} must be at least 2")
    st = StaticDecode(model, prompt_ids, n_tokens, dev, max_cache_len)
    step = (torch.compile(st.decode_step, backend=compile_backend, **({"mode": mode} if mode else {}))
            if compile_backend else st.decode_step)

    def body():
        st.body(step)

    errors: list[str] = []

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        if compile_backend is None:
            return fn()
        if errors:  # an earlier phase failed: skip, go to the agreement point
            return None
        try:
            return fn()
        except Exception as e:
            errors.append(f"{name}: {_one_line(e)}")
            return None

    with torch.no_grad():
        if cuda_graph:
            # warm-up: compile, lazy StaticCache init, NCCL communicator
            phase("compile (warm-up)", lambda: warm_up_on_side_stream(body))
            graph = phase("CUDA-graph capture", lambda: capture_graph(body))
            run = graph.replay if graph is not None else None
        else:
            phase("compile (warm-up)", lambda: [body() for _ in range(3)])
            run = body
        if compile_backend is not None:
            # Agreement point, before any replay: all ranks go on compiled or none does.
            errs = ctx.all_gather_object(errors[0] if errors else None)
            if any(e is not None for e in errs):
                raise _PhaseError(_by_rank(errs))
        st.feed_prompt(run)
        # Decode: each step consumes the previous output token (copied inside the step).
        _sync(ctx)
        timing = time_per_call(run, iters=n_tokens - 1, warmup=0, device=dev)
        tokens = st.tokens(n_tokens)
    return BaselineResult(tp_compiled_name(mode, cuda_graph), tokens, timing,
                          extra={"rank": ctx.rank, "world": ctx.world, "cuda_graph": cuda_graph})


def _sync(ctx) -> None:
    """Finish this rank's device work, then a host barrier: the ranks enter a timed loop
    together, so the first samples do not include a peer's lag."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    ctx.barrier()


# ---------------------------------------------------------------------------------- combine


def gather_tp(ctx, result: BaselineResult) -> BaselineResult:
    """Combine every rank's result of one baseline (collective; same result on every rank).

    Latency: the per-rank medians' maximum (a TP step is as slow as its slowest rank):
    ``timing`` is the slowest rank's Timing, ``extra["per_rank_median_ms"]`` lists all.
    Tokens: the longest prefix on which all ranks agree (``extra["ranks_agree"]``), so a
    disagreement fails ``amk.baselines.judge`` with "only k of n tokens". ``note`` and
    ``extra`` are rank 0's, plus per-rank fields; a rank without timing gives no timing.
    """
    rows = ctx.all_gather_object((result.name, result.tokens, result.timing, result.note,
                                  result.extra))
    names = {r[0] for r in rows}
    if len(names) != 1:
        raise AmkError(f"gather_tp: ranks returned different baselines {sorted(names)}",
                       exit_code=1)
    token_lists = [list(r[1]) for r in rows]
    k = 0
    while all(k < len(t) for t in token_lists) and len({t[k] for t in token_lists}) == 1:
        k += 1
    agree = all(t == token_lists[0] for t in token_lists)
    timings: list[Timing | None] = [r[2] for r in rows]
    timing, slowest = None, None
    if all(t is not None for t in timings):
        slowest = max(range(len(timings)), key=lambda r: timings[r].median_ms)
        timing = timings[slowest]
    extra = dict(rows[0][4])
    extra.pop("rank", None)
    extra.update(ranks_agree=agree,
                 per_rank_median_ms=[t.median_ms if t else None for t in timings],
                 slowest_rank=slowest)
    if "compiled" in extra:
        extra["compiled_per_rank"] = [r[4].get("compiled") for r in rows]
    note = rows[0][3]
    if not agree:
        note = (note + "; " if note else "") + f"ranks disagree after token {k}"
    return BaselineResult(rows[0][0], token_lists[0][:k], timing, None, note, extra)


def run_tp_baselines(model_arg: str, ctx, prompt_ids: torch.Tensor, n_tokens: int,
                     save_dir: str | os.PathLike, *, model=None,
                     dtype: str = "bf16", modes: Sequence[str | None] = (None,),
                     runs: int = 1) -> list[BaselineResult]:
    """The TP baselines for ``amk bench MODEL --tp R``, in every rank. Collective.

    Prepares the checkpoint (``prepare_tp_checkpoint``; ``model``: rank 0's resolved model
    in ``dtype``, optional), loads this rank's shard, broadcasts rank 0's ``prompt_ids``
    (int64 [1, P]) so that every rank decodes the same prompt, and runs ``hf_tp_eager`` and
    ``hf_tp_compiled_graph`` once per torch.compile mode in ``modes`` (None: the default
    mode; CUDA graph on CUDA devices, plain compiled steps on the CPU), each combined with
    ``gather_tp``. ``runs``: each baseline is measured that many times (rows named by
    ``amk.baselines.run_name``), each compiled mode's later runs afresh (``amk.baselines.fresh_compile``).
    A baseline that raises on every rank becomes a row
    with ``timing=None``, ``correct=False`` and the error as note, like bench's single-GPU
    rows. Setup failures (checkpoint, load) raise AmkError. Returns the two results,
    identical on every rank; judge them with ``amk.baselines.judge``.
    """
    ckpt = prepare_tp_checkpoint(model_arg, ctx, save_dir, model=model, dtype=dtype)
    tp_model = load_tp_model(ckpt, ctx, dtype=dtype)
    prompt_ids = ctx.broadcast_object(prompt_ids.detach().cpu(), src=0)
    out = []
    todo = [(run_name("hf_tp_eager", k), contextlib.nullcontext,
             lambda: hf_tp_eager(tp_model, ctx, prompt_ids, n_tokens)) for k in range(1, runs + 1)]
    todo += [(run_name(tp_compiled_name(m), k), lambda k=k: fresh_compile(k),
              lambda m=m: hf_tp_compiled_graph(tp_model, ctx, prompt_ids, n_tokens, mode=m))
             for m in modes for k in range(1, runs + 1)]
    for name, context, fn in todo:
        try:
            with context():
                res, err = fn(), None
        except Exception as e:  # same code on every rank: a failure is normally everywhere
            res, err = None, _one_line(e)
        errs = ctx.all_gather_object(err)
        if any(e is not None for e in errs):
            out.append(BaselineResult(name, [], None, False, f"failed: {_by_rank(errs)}"))
            continue
        res = gather_tp(ctx, res)
        res.name = name
        out.append(res)
    return out
