"""The evaluation subprocess of `amk search`: one candidate config -> a result dict.

Run as ``python -m search.worker --serve`` (the protocol of ``search.evaluator.WorkerClient``:
absolute request/result file paths over a pipe, since the worker's working directory is the
repository root and not the search's; the model is loaded once per process) or
``python -m search.worker REQUEST.json RESULT.json`` (one candidate). ``evaluate(request)``
is also callable in-process (tests).

Request (JSON): ``model`` (MODEL argument), ``ranks``, ``backend`` (sim | triton),
``config`` (full lowering config of the candidate), ``edits`` (optional: an edit list,
ir/edits.py, applied to the lowered config's schedule before validation; one that does not
apply is REJECTED at stage ``edit``), ``incumbent`` (full lowering config of
the incumbent or null; triton A/B only), ``incumbent_edits`` (the incumbent's edit list), ``target`` (Target fields), ``positions`` (decode
positions whose logits are compared), ``prompt_seed`` (fresh random prompt tokens),
``sim_seed`` / ``sim_policy`` (interleaving of the sim), ``seq_len`` (the context length the
latency refers to), ``tolerance`` ({"rel_err", "min_argmax_agree"}), ``timing`` (A/B
parameters), ``kernel`` (the candidate's kernel knobs, a KernelConfig's JSON; absent or {}:
the defaults), ``incumbent_kernel`` (the incumbent's kernel knobs; absent: the candidate's,
as when one set of kernel knobs served a whole search), ``profile`` (triton: after the
timing, one step of the candidate with the in-kernel profile, per-op time in the result),
``profile_only`` (triton: lower, validate and profile; no gate, no timing),
``hooks`` (tests only: dotted names of an executor (a factory of executors), an
executor_factory (``(backend, kernel) -> factory``, called once for the candidate's and once
for the incumbent's kernel knobs), a timer, or a predictor; never set by the CLI).

A request with ``pattern`` (a communication pattern of ``amk search FILE.py:FUNC``) is one
trial of search/patterns.py instead (its ``evaluate`` says what it holds).

Result: ``status`` ok | rejected | fail, ``stage`` where it stopped, ``reason``, ``verdict``,
``program`` (stats, op counts, cost-model estimate), ``correctness``, ``timing``
(``source`` predicted | measured, ``median_ms``, ``spread_ms``, ``incumbent_ms``, A/B
statistics), ``floor_ms``, ``times`` (seconds per stage), ``restart_worker``, ``profile``
(with ``profile``: ``{"source": "in-kernel profile", "op_us": {op: summed op time}}``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

from ground.errors import AmkError
from search.trial import make_target, program_summary, resolve_hook, time_sim, validate_stage  # noqa: F401

_CACHE: dict[tuple, Any] = {}


class ModelContext:
    """A loaded model (fp32, the correctness reference), its graph and weight init_fn."""

    def __init__(self, model_arg: str):
        from lowering.weights import make_init_fn
        from models.graph import import_model
        from models.sources import resolve_model

        res = resolve_model(model_arg, "fp32")
        self.model = res.model
        self.config = res.config
        self.graph = import_model(res.model, res.config, name=res.source.name)
        self.spec = self.graph.spec
        self.init_fn = make_init_fn(res.model.state_dict(), self.spec)

    @staticmethod
    def get(model_arg: str) -> "ModelContext":
        key = ("model", model_arg)
        if key not in _CACHE:
            _CACHE[key] = ModelContext(model_arg)
        return _CACHE[key]

    def reference_logits(self, tokens: list[int]) -> Any:
        """HF eager logits (fp32) for the prompt ``tokens``, one row per position:
        [len(tokens), vocab]. A causal forward over the whole prompt gives at every
        position exactly what token-by-token decoding with a KV cache gives."""
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([tokens], dtype=torch.long))
        return out.logits[0].float()


def lower_config(graph: Any, ranks: int, config: dict[str, Any], target: Any) -> Any:
    """Lower ``graph`` with a lowering-config dict. Raises AmkError for a config the lowering
    refuses (bad value, too many workers for the target, ...)."""
    from lowering.config import LoweringConfig
    from lowering.lower import lower

    # a candidate may set a knob another one leaves without effect: the same program
    cfg = LoweringConfig.from_json(dict(config), source="candidate config", combinations=False)
    return lower(graph, ranks, config=cfg, target=target)


# -- correctness gate -----------------------------------------------------------------
def _poison_outputs(ex: Any, program: Any, rank: int | None) -> None:
    """Fill the io_output buffers of ``rank`` (all ranks if None) with NaN (float) or the
    int sentinel, so an output the step does not write shows up as wrong."""
    import torch

    from lowering.reference import INT_POISON

    for b in program.buffers:
        if b.kind != "io_output":
            continue
        ranks = [b.rank] if b.placement == "local" else list(range(program.ranks))
        for r in ranks:
            if rank is not None and r != rank:
                continue
            if b.dtype == "i32":
                val = torch.full(b.shape, INT_POISON, dtype=torch.int32)
            else:
                val = torch.full(b.shape, float("nan"), dtype=torch.float32)
            ex.write(b.name, r, val)


def correctness_gate(program: Any, ctx: ModelContext, req: dict[str, Any],
                     executor_factory: Callable[..., Any]) -> dict[str, Any]:
    """Run ``program`` for positions 0..max(positions) on fresh random prompt tokens and
    compare its logits with HF eager at ``positions``.

    Returns ``{"passed", "max_abs_err", "rel_err", "argmax_agree", "positions", "finite",
    "tokens_agree_across_ranks", "why"}``. Outputs are poisoned before every step; the
    logits are the concatenation of ``logits.r{r}`` over ranks (each rank's vocabulary
    rows, in order) and must have the vocabulary's length.
    """
    import torch

    from lowering.reference import INT_POISON

    positions = sorted(set(int(p) for p in req["positions"]))
    n = positions[-1] + 1
    vocab = int(ctx.spec.vocab)
    gen = torch.Generator().manual_seed(int(req["prompt_seed"]))
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    ref = ctx.reference_logits(tokens)
    R = program.ranks
    ex = executor_factory(program, ctx.init_fn, seed=int(req.get("sim_seed", 0)),
                          policy=req.get("sim_policy", "random"))
    names = program.buffer_map()
    for r in range(R):
        for nm in (f"token.r{r}", f"pos.r{r}", f"logits.r{r}", f"next.r{r}"):
            if nm not in names:
                raise AmkError(f"program has no buffer {nm}: cannot run the correctness gate")
    got: dict[int, dict[int, Any]] = {}
    nxt: dict[int, dict[int, int]] = {}

    def on_start(e: int, r: int) -> None:
        ex.write(f"token.r{r}", r, torch.tensor([tokens[e]], dtype=torch.int32))
        ex.write(f"pos.r{r}", r, torch.tensor([e], dtype=torch.int32))
        _poison_outputs(ex, program, r)

    def on_end(e: int, r: int) -> None:
        if e in positions:
            got.setdefault(e, {})[r] = ex.read(f"logits.r{r}", r).float().reshape(-1)
            nxt.setdefault(e, {})[r] = int(ex.read(f"next.r{r}", r).reshape(-1)[0])

    first = getattr(ex, "next_epoch", 0)
    if first != 0:
        raise AmkError("the executor must start at epoch 0")
    if hasattr(ex, "run_steps") and req.get("overlap_epochs", True):
        ex.run_steps(n, on_start=on_start, on_end=on_end)
    else:
        for e in range(n):
            for r in range(R):
                on_start(e, r)
            ex.step(e)
            for r in range(R):
                on_end(e, r)
    max_err, scale, agree, finite, ranks_agree = 0.0, 1.0, 0, True, True
    why = []
    for p in positions:
        logits = torch.cat([got[p][r] for r in range(R)])
        if logits.numel() != vocab:
            raise AmkError(f"gathered logits have {logits.numel()} entries, vocabulary {vocab}")
        if not torch.isfinite(logits).all():
            finite = False
            why.append(f"non-finite logits at position {p} (an output left unwritten?)")
            continue
        r_ = ref[p]
        scale = max(scale, float(r_.abs().max()))
        max_err = max(max_err, float((logits - r_).abs().max()))
        toks = {nxt[p][r] for r in range(R)}
        if len(toks) != 1 or INT_POISON in toks:
            ranks_agree = False
            why.append(f"next token at position {p} differs across ranks or is unwritten: "
                       f"{sorted(toks)}")
        agree += int(nxt[p][0] == int(r_.argmax()))
    tol = req.get("tolerance", {})
    rel = max_err / scale
    agree_frac = agree / len(positions)
    rel_tol = float(tol.get("rel_err", 2e-3))
    min_agree = float(tol.get("min_argmax_agree", 1.0))
    if finite and rel > rel_tol:
        why.append(f"logit error {max_err:.3g} ({rel:.2e} of max |logit| {scale:.3g}) exceeds "
                   f"{rel_tol:g}")
    if finite and agree_frac < min_agree:
        why.append(f"next token matches HF argmax at {agree}/{len(positions)} positions")
    return {"passed": not why, "max_abs_err": max_err if finite else None,
            "rel_err": rel if finite else None, "argmax_agree": agree_frac,
            "positions": positions, "finite": finite, "tokens_agree_across_ranks": ranks_agree,
            "why": "; ".join(why)}


def default_executor_factory(backend: str, kernel: dict[str, Any] | None = None) -> Callable[..., Any]:
    """The executor of ``backend`` for a candidate's program: the sim, or the Triton megakernel
    with the kernel knobs ``kernel`` (a KernelConfig's JSON; None or {}: its defaults)."""
    if backend == "sim":
        from lowering.sim import SimExecutor

        def make(program, init_fn, seed=0, policy="random"):
            # The program was validated just before; check=False skips a second validation.
            return SimExecutor(program, init_fn, seed=seed, policy=policy, check=False)
        return make
    if backend == "triton":
        from lowering.config import KernelConfig
        from lowering.triton.blocks import kernel_options
        from lowering.triton.runtime import TritonExecutor  # noqa: the GPU backend

        opts = kernel_options(KernelConfig.from_json(dict(kernel or {}), "the search's kernel knobs"))

        def make(program, init_fn, seed=0, policy="random"):
            return TritonExecutor(program, init_fn, check=False, **opts)
        return make
    raise AmkError(f"unknown backend {backend!r}")


# -- timing ---------------------------------------------------------------------------
def _hbm(req: dict[str, Any]) -> tuple[float, int]:
    """(bandwidth in bytes/s, cache bytes) for the floor on the triton backend: measured
    once per worker with a device copy; the cache is the GPU's L2. A request may give
    ``hbm_bw`` (and ``cache_bytes``) instead, e.g. a bandwidth measured earlier."""
    if req.get("hbm_bw"):
        return float(req["hbm_bw"]), int(req.get("cache_bytes", 0))
    key = ("hbm",)
    if key not in _CACHE:
        import torch

        from ground.timing import measure_hbm_bandwidth

        bw = measure_hbm_bandwidth("cuda", nbytes=int(req.get("bw_bytes", 1 << 30)))
        l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0))
        _CACHE[key] = (bw, l2)
    return _CACHE[key]


def time_triton(program: Any, inc_program: Any | None, ctx: ModelContext, req: dict[str, Any],
                executor_factory: Callable[..., Any], timer: Any,
                inc_factory: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Interleaved A/B timing of the candidate against the incumbent (or A/A on itself when
    there is no incumbent yet) at position ``seq_len - 1``. The candidate runs with
    ``executor_factory``, the incumbent with ``inc_factory`` (its own kernel knobs; default
    the candidate's factory); ``inc_program`` may be the candidate's own program when only
    the kernel knobs differ. On a CUDA device each side's step is replayed from a CUDA graph
    (``step_graph``); the result's ``step`` says which ran (``cuda-graph`` or ``executor``)."""
    import torch

    from search.evaluator import measured_ab

    tp = req.get("timing", {})
    pos = max(0, int(req.get("seq_len", 128)) - 1)
    graphs = []

    def prepared(prog, factory=executor_factory):
        ex = factory(prog, ctx.init_fn, seed=0, policy="in_order")
        state = {"e": 0}
        for r in range(prog.ranks):
            ex.write(f"token.r{r}", r, torch.tensor([1], dtype=torch.int32))
            ex.write(f"pos.r{r}", r, torch.tensor([pos], dtype=torch.int32))

        def step():
            ex.step(state["e"])
            state["e"] += 1
        g = step_graph(ex, step)
        if g is not None:
            graphs.append(g)
            return ex, g.replay
        return ex, step

    _, run_b = prepared(program)
    if inc_program is not None:
        _, run_a = prepared(inc_program, inc_factory or executor_factory)
    else:
        run_a = run_b
    prefixes = tp.get("audit_prefixes")
    if prefixes:  # only our kernels may run inside the timed region
        from search.evaluator import foreign_kernels, profile_kernel_names

        foreign = foreign_kernels(profile_kernel_names(run_b), list(prefixes))
        if foreign:
            raise AmkError(f"kernels other than {list(prefixes)} run inside the timed step: "
                           f"{foreign[:5]}")
    res = measured_ab(run_a, run_b, timer, tp, inc_program is not None)
    for g in graphs:  # a replay that timed out or failed a task raises here, naming it
        g.check()
    res["step"] = "cuda-graph" if graphs else "executor"
    return res


def step_graph(ex: Any, step: Callable[[], None]) -> Any | None:
    """``ex``'s epoch captured in a CUDA graph (lowering/triton/graph.py ``StepGraph``) after
    one ``step()`` (which compiles the kernel), or None where there is no CUDA graph to take:
    an executor that is not the compiled Triton one on a CUDA device (the interpreter, the
    sim, a test's hook). A replay is one launch with no host round trip, as ``amk bench``
    times the step; the executor's ``step`` reads the error records after every launch,
    whose host round trip made the per-step timing noisier than the gap between close
    configs (docs/experiments.md, the Llama-3.2-1B re-tune)."""
    dev = getattr(ex, "device", None)
    if getattr(dev, "type", None) != "cuda" or not hasattr(ex, "compiled"):
        return None
    from lowering.triton.graph import StepGraph

    step()
    return StepGraph(ex)


def profile_ops(program: Any, ctx: ModelContext, req: dict[str, Any], kernel: dict[str, Any],
                steps: int = 3) -> dict[str, Any]:
    """Where one decode step of ``program`` spends its time, from the megakernel's in-kernel
    profile (``TritonExecutor(profile=True)``: %globaltimer stamps per task, lowering/triton/vm.py
    PROF_W): per op, the summed op time (waits done -> signals released) of the last of
    ``steps`` steps, in microseconds. The profiled kernel is a little slower than the plain
    one; the shares rank the op families, they are not the latency. CUDA only."""
    import torch

    from lowering.config import KernelConfig
    from lowering.triton import vm as VM
    from lowering.triton.blocks import kernel_options
    from lowering.triton.runtime import TritonExecutor

    opts = kernel_options(KernelConfig.from_json(dict(kernel or {}), "the candidate's kernel knobs"))
    ex = TritonExecutor(program, ctx.init_fn, check=False, profile=True, **opts)
    pos = max(0, int(req.get("seq_len", 128)) - 1)
    for e in range(steps):
        for r in range(program.ranks):
            ex.write(f"token.r{r}", r, torch.tensor([1], dtype=torch.int32))
            ex.write(f"pos.r{r}", r, torch.tensor([pos], dtype=torch.int32))
        ex.step(e)
    torch.cuda.synchronize()
    prof = ex._prof.view(-1, VM.PROF_W).cpu().tolist()
    op_us: dict[str, float] = {}
    for row, op in enumerate(ex.table.task_ops):
        op_us[op] = op_us.get(op, 0.0) + max(0, prof[row][2] - prof[row][1]) / 1e3
    return {"source": "in-kernel profile", "op_us": op_us}


# -- one request ----------------------------------------------------------------------
def evaluate(req: dict[str, Any]) -> dict[str, Any]:
    """Evaluate one candidate request (see the module docstring). Never raises for a
    candidate's own failure: the result says what happened and where."""
    if req.get("pattern"):  # a communication pattern (amk search FILE.py:FUNC)
        from search.patterns import evaluate as evaluate_pattern

        return evaluate_pattern(req)
    from search.evaluator import below_floor, roofline_floor_ms

    times: dict[str, float] = {}
    res: dict[str, Any] = {"status": "fail", "stage": "setup", "reason": "", "times": times,
                           "restart_worker": False}
    hooks = req.get("hooks") or {}
    backend = req["backend"]
    try:
        t = time.perf_counter()
        ctx = ModelContext.get(req["model"])
        times["model_s"] = time.perf_counter() - t
        target = make_target(req.get("target", {}))
        # 1. lower
        res["stage"] = "lower"
        t = time.perf_counter()
        try:
            program = lower_config(ctx.graph, int(req["ranks"]), req["config"], target)
        except AmkError as err:
            res.update(status="rejected", reason=f"lowering refused the config: {err}")
            return res
        times["lower_s"] = time.perf_counter() - t
        if req.get("edits"):  # an edit list against the lowered base schedule (ir/edits.py)
            res["stage"] = "edit"
            from ir.edits import parse_edits
            from lowering.placement import apply_edits

            try:
                program = apply_edits(program, parse_edits(req["edits"], "the candidate's edits"))
            except AmkError as err:
                res.update(status="rejected", reason=f"edits do not apply: {err}"[:400])
                return res
        seq_len = int(req.get("seq_len", 128))
        res["program"] = program_summary(program, seq_len)
        # 2. validate: a rejected program never reaches a backend
        res["stage"] = "validate"
        if not validate_stage(program, backend, res, times):
            return res
        if req.get("profile_only"):  # the incumbent's profile: no gate, no timing
            res["stage"] = "profile"
            res["profile"] = profile_ops(program, ctx, req, req.get("kernel") or {})
            res.update(status="ok", stage="done")
            return res
        # floor: sim uses the cost model's bandwidth, no cache; triton a measured one
        if backend == "sim":
            from lowering.costmodel import DEFAULT_HBM_BW

            floor = roofline_floor_ms(program, float(req.get("hbm_bw", DEFAULT_HBM_BW)))
        else:
            bw, l2 = _hbm(req)
            floor = roofline_floor_ms(program, bw, cache_bytes=l2)
        res["floor_ms"] = floor
        # 3. correctness gate
        res["stage"] = "correctness"
        maker = resolve_hook(hooks.get("executor_factory")) or default_executor_factory
        kernel = req.get("kernel") or {}
        inc_kernel = req["incumbent_kernel"] if req.get("incumbent_kernel") is not None else kernel
        factory = resolve_hook(hooks.get("executor")) or maker(backend, kernel)
        t = time.perf_counter()
        gate = correctness_gate(program, ctx, req, factory)
        times["gate_s"] = time.perf_counter() - t
        res["correctness"] = gate
        if not gate["passed"]:
            res.update(status="fail", reason=f"correctness: {gate['why']}"[:400])
            return res
        # 4. timing
        res["stage"] = "timing"
        t = time.perf_counter()
        if backend == "sim":
            timing = time_sim(program, req, resolve_hook(hooks.get("predict")))
        else:
            timer_hook = resolve_hook(hooks.get("timer"))
            if timer_hook is not None:
                timer = timer_hook()
            else:
                from search.evaluator import cuda_event_timer

                timer = cuda_event_timer()
            inc, inc_factory = None, None
            same_edits = (req.get("incumbent_edits") or []) == (req.get("edits") or [])
            if req.get("incumbent") and (req["incumbent"] != req["config"] or inc_kernel != kernel
                                         or not same_edits):
                inc = program if req["incumbent"] == req["config"] and same_edits else \
                    lower_config(ctx.graph, int(req["ranks"]), req["incumbent"], target)
                if inc is not program and req.get("incumbent_edits"):
                    from ir.edits import parse_edits
                    from lowering.placement import apply_edits

                    inc = apply_edits(inc, parse_edits(req["incumbent_edits"], "the incumbent's edits"))
                # the incumbent runs with its own kernel knobs, not the candidate's
                inc_factory = resolve_hook(hooks.get("executor")) or maker(backend, inc_kernel)
            timing = time_triton(program, inc, ctx, req, factory, timer, inc_factory)
        times["timing_s"] = time.perf_counter() - t
        res["timing"] = timing
        if not math.isfinite(timing["median_ms"]) or timing["median_ms"] <= 0 or \
                below_floor(timing["median_ms"], floor):
            res.update(status="fail", reason=(
                f"timing {timing['median_ms']:.4g} ms ({timing['source']}) is below the "
                f"roofline floor {floor:.4g} ms: a measurement error, not a speedup"))
            return res
        if req.get("profile") and backend == "triton" and not hooks.get("executor"):
            res["stage"] = "profile"
            res["profile"] = profile_ops(program, ctx, req, kernel)
        res.update(status="ok", stage="done")
        return res
    except AmkError as err:
        res.update(status="fail", reason=f"{res['stage']}: {err}"[:400])
        return res
    except Exception as err:  # a crash of the candidate's evaluation, not of the search
        tb = traceback.format_exc(limit=6)
        print(tb, file=sys.stderr)
        res.update(status="fail", reason=f"{res['stage']} crashed: {type(err).__name__}: "
                   f"{err}"[:400])
        if backend == "triton" and "CUDA" in f"{type(err).__name__}{err}":
            res["restart_worker"] = True  # the CUDA context may be unusable now
        return res


def _write_json_atomic(path: str, obj: Any) -> None:
    from ground.files import atomic_write_json

    atomic_write_json(path, obj)


def serve() -> int:
    """The persistent worker loop (see search.evaluator.WorkerClient for the protocol)."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints go to the log
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        with open(msg["request"], encoding="utf-8") as f:
            req = json.load(f)
        t0 = time.perf_counter()
        res = evaluate(req)
        res["worker_s"] = time.perf_counter() - t0
        res["worker_pid"] = os.getpid()
        _write_json_atomic(msg["result"], res)
        proto.write(json.dumps({"done": msg["result"]}) + "\n")
        proto.flush()
        if res.get("restart_worker"):
            return 0
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return serve()
    if len(argv) == 2:
        with open(argv[0], encoding="utf-8") as f:
            req = json.load(f)
        _write_json_atomic(argv[1], evaluate(req))
        return 0
    print("usage: python -m search.worker --serve | REQUEST.json RESULT.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
