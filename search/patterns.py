"""A communication pattern as a search target: its knob space, seeded inputs, the check of
every rank's output against the pattern's torch math, and one trial (``evaluate``).

``amk search FILE.py:FUNC --world R --shape ...`` (docs/dist.md, "Tuning a pattern") captures
the function (models/capture.py), recognises one of the patterns of models/collectives.py and
searches the knobs of ``lowering.config.CollectiveConfig`` that act for it, with the loop of
search/loop.py. One trial of a candidate config (``evaluate``, called by search/worker.py for a
request with a ``pattern``):

1. lower (lowering.collectives.lower_pattern); a value the lowering refuses: REJECTED;
2. validate (validator.validate, the backend's op set); rejected: REJECTED, nothing runs;
3. backend ``sim``: run every rank on the sim with seeded inputs (``seeded_inputs``) and
   compare each rank's output with ``Pattern.reference`` (``compare``; a difference: FAIL),
   then the cost model's PREDICTED time of the program (lowering/costmodel.py, which prices
   the gemm tiles' flops); backend ``triton``: ``torchrun --nproc-per-node R -m
   search.pattern_ranks REQUEST RESULT`` (search/pattern_ranks.py) runs the candidate and the
   incumbent as the megakernel on R GPUs, checks the candidate's output on every rank and
   times both in interleaved A/B rounds (MEASURED).

The helpers here (``seeded_inputs``, ``compare``, ``TOL``, ``run_sim``) are also what
``amk dist`` and ``amk.distribute`` run (amk/distributed.py imports them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

import torch

from ground.errors import AmkError
# the floor's peak flop rate and bandwidth: the cost model's (an H100 SXM's, its docstring)
from lowering.costmodel import DEFAULT_GEMM_FLOPS, DEFAULT_HBM_BW

#: A rank's output matches the reference when max|out - ref| <= TOL[dtype] * max(1, max|ref|):
#: the fused schedule rounds partial tiles and partial sums to the dtype where the reference
#: keeps fp32 (amk run's margins, amk/commands/run.py TOL).
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 3e-2}
#: Standard deviation of the seeded inputs of ``seeded_inputs`` (mean 0).
INPUT_STD = 0.5
#: The integer values the search tries for an integer collective knob (besides its default
#: and 0 where the knob gives 0 a meaning, e.g. "one per SM"), filtered by the knob's own
#: rule (``lowering.knobs.Knob.problem``). A knob not named here gets POW2_VALUES.
INT_VALUES = {"tile_m": (16, 32, 64, 128), "tile_n": (16, 32, 64, 128), "chunks": (1, 2, 4, 8),
              "workers": (16, 32, 64), "reduce_rows": (16, 32, 64, 128)}
POW2_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


# ----------------------------------------------------------------------------- patterns
def pattern_to_json(pattern: Any) -> dict[str, Any]:
    """``{"kind": ..., "world": ..., "dtype": ..., <dims>}``: a models.collectives pattern as
    JSON (what a search stores and a trial request carries instead of the user's function)."""
    return {"kind": pattern.kind, **dataclasses.asdict(pattern)}


def pattern_from_json(d: dict[str, Any]) -> Any:
    """The pattern of ``pattern_to_json``; AmkError for an unknown kind or field."""
    from models import collectives as C

    kinds = {cls.kind: cls for cls in vars(C).values()
             if isinstance(cls, type) and issubclass(cls, C.Pattern) and cls is not C.Pattern}
    d = dict(d)
    kind = d.pop("kind", None)
    cls = kinds.get(kind)
    if cls is None:
        raise AmkError(f"unknown pattern kind {kind!r}; known: {', '.join(sorted(kinds))}")
    try:
        return cls(**d).check()
    except TypeError as e:
        raise AmkError(f"pattern {kind}: {e}") from None


# ----------------------------------------------------------------------------- the space
def acting_knobs(kind: str) -> list[str]:
    """The CollectiveConfig knobs that act for the pattern kind ``kind``: a knob set away from
    its default is kept when ``CollectiveConfig.inert_for`` does not name it, alone or beside
    one other knob set away from its default (``direct`` acts for the all-reduce beside
    ``allreduce`` twoshot: a config file may hold it, so the search tries it)."""
    from lowering.config import CollectiveConfig
    from lowering.knobs import knobs_of

    base = CollectiveConfig()
    others = [(k.name, _another_value(k)) for k in knobs_of(base)]
    out = []
    for name, value in others:
        if value is None:
            continue
        for extra in [None, *others]:
            change = {name: value}
            if extra is not None and extra[0] != name and extra[1] is not None:
                change[extra[0]] = extra[1]
            if name not in {n for n, _ in dataclasses.replace(base, **change).inert_for(kind)}:
                out.append(name)
                break
    return out


def _another_value(k: Any) -> Any:
    if k.kind is bool:
        return not k.default
    vals = [v for v in knob_values(k) if v != k.default]
    return vals[0] if vals else None


def knob_values(k: Any) -> tuple[Any, ...]:
    """The values the search tries for collective knob ``k`` (a lowering.knobs.Knob): both
    booleans, every choice, or for an integer its default, 0 when the knob gives 0 a meaning
    (``zero``) and ``INT_VALUES`` (else ``POW2_VALUES``) within the knob's rule."""
    if k.kind is bool:
        return (False, True)
    if k.choices:
        return tuple(k.choices)
    if k.kind is int:
        vals = {k.default} | ({0} if k.zero else set())
        vals |= {v for v in INT_VALUES.get(k.name, POW2_VALUES) if k.problem(v) is None}
        return tuple(sorted(vals))
    return (k.default,)


def pattern_space(kind: str, start: dict[str, Any] | None = None) -> Any:
    """The search space (search.space.SearchSpace) of the pattern kind ``kind``: the acting
    knobs (``acting_knobs``) with ``knob_values``, ordinal for integers; the other knobs held
    at their defaults (``fixed``). A value of ``start`` (a config file's collective knobs)
    outside a knob's values is added to them, so trial 0 is a point of the space."""
    from lowering.config import CollectiveConfig
    from lowering.knobs import knobs_of
    from search.space import Knob, SearchSpace

    acting = set(acting_knobs(kind))
    knobs, fixed = [], {}
    for k in knobs_of(CollectiveConfig):
        if k.name not in acting:
            fixed[k.name] = k.default
            continue
        vals = list(knob_values(k))
        v = (start or {}).get(k.name)
        if v is not None and v not in vals:
            vals = sorted(vals + [v]) if k.kind is int else vals + [v]
        knobs.append(Knob(k.name, tuple(vals), k.default, k.kind is int, k.help))
    return SearchSpace(knobs, fixed)


def config_for_file(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """A candidate's collective knobs as a config file holds them: every knob that does
    nothing for ``kind`` at the others (``CollectiveConfig.inert_for``) set back to its
    default, so ``amk dist --config`` (which refuses such knobs) takes the file."""
    from lowering.config import CollectiveConfig
    from lowering.knobs import knob_named

    cfg = CollectiveConfig.from_json(dict(config), "candidate config", combinations=False)
    for _ in range(8):
        inert = cfg.inert_for(kind)
        if not inert:
            return cfg.to_json()
        cfg = dataclasses.replace(cfg, **{n: knob_named(cfg, n).default for n, _ in inert})
    raise AssertionError("config_for_file did not settle")


# ----------------------------------------------------------------------------- inputs, check
def seeded_inputs(pattern: Any, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Every rank's operands of ``pattern``: N(0, INPUT_STD^2) values drawn in fp32 from
    ``seed``, the rank and the operand name, rounded to the pattern's dtype; an RMSNorm
    weight ``g`` is 1 + N(0, 0.1^2) (a norm weight near 1, as trained ones are)."""
    from models.collectives import DTYPES

    dt = DTYPES[pattern.dtype]
    out = []
    for r in range(pattern.world):
        ins = {}
        for k, (name, shape) in enumerate(sorted(pattern.operands().items())):
            g = torch.Generator().manual_seed(seed * 1_000_003 + r * 101 + k)
            v = torch.randn(shape, generator=g, dtype=torch.float32)
            v = 1.0 + 0.1 * v if name == "g" else INPUT_STD * v
            ins[name] = v.to(dt)
        out.append(ins)
    return out


def compare(got: list[torch.Tensor], ref: list[torch.Tensor], dtype: str) -> dict[str, Any]:
    """``{"ok", "max_abs_err", "tolerance", "ranks": [max abs err per rank]}``: every rank's
    output against the reference within ``TOL[dtype] * max(1, max|ref|)`` (NaN fails)."""
    errs, ok, tol_max = [], True, 0.0
    for g, r in zip(got, ref):
        g32, r32 = g.float(), r.float()
        scale = max(1.0, float(r32.abs().max())) if r32.numel() else 1.0
        tol = TOL[dtype] * scale
        tol_max = max(tol_max, tol)
        err = float((g32 - r32).abs().max()) if g32.numel() and g32.shape == r32.shape else float("inf")
        if g32.shape != r32.shape or not torch.isfinite(g32).all() or not err <= tol:
            ok = False
        errs.append(err)
    return {"ok": ok, "max_abs_err": max(errs) if errs else 0.0, "tolerance": tol_max, "ranks": errs}


def run_sim(program: Any, binding: Any, inputs: list[dict[str, torch.Tensor]], *, seed: int = 0,
            policy: str = "random", executor: Any = None, epoch: int = 0) -> tuple[list[torch.Tensor], Any]:
    """Run one epoch of a lowered pattern (``program`` and its lowering.collectives Binding)
    on the sim with every rank's operands (``inputs[r][name]``); returns (every rank's output,
    the executor). ``executor``: a SimExecutor of this program to reuse (its next epoch is
    ``epoch``), or any executor with ``write`` / ``step`` / ``read``. Raises AmkError (exit
    code 1) when the sim deadlocks or an op fails."""
    from lowering.sim import SimError, SimExecutor

    try:
        ex = executor or SimExecutor(program, seed=seed, policy=policy, check=False)
        for r, ins in enumerate(inputs):
            binding.write_inputs(ex, r, ins)
        ex.step(epoch)
        return [binding.read_output(ex, r, epoch) for r in range(len(inputs))], ex
    except SimError as e:
        raise AmkError(f"the sim failed: {e}".splitlines()[0], exit_code=1) from None


def floor_ms(pattern: Any, hbm_bw: float = DEFAULT_HBM_BW, flops: float = DEFAULT_GEMM_FLOPS) -> float:
    """The time no correct run of ``pattern`` can beat on one rank, in milliseconds: its share
    of the GEMM at the GPU's peak, or its own operands read and its output written once at
    the HBM bandwidth, whichever is longer (a lower bound: communication is left out)."""
    from ir.program import DTYPE_BYTES

    nbytes = DTYPE_BYTES.get(pattern.dtype, 2) * (sum(math.prod(s) for s in pattern.operands().values())
                                                   + math.prod(pattern.output_shape()))
    return max(pattern.flops() / flops, nbytes / hbm_bw) * 1e3


# ----------------------------------------------------------------------------- one trial
def lower_candidate(pattern: Any, config: dict[str, Any], target: Any) -> tuple[Any, Any]:
    """(program, binding) of ``pattern`` lowered with the collective knobs ``config`` (a dict)
    for ``target``. AmkError for a value the lowering refuses."""
    from lowering.collectives import lower_pattern
    from lowering.config import CollectiveConfig

    cfg = CollectiveConfig.from_json(dict(config), "candidate config", combinations=False)
    return lower_pattern(pattern, cfg, target)


def evaluate(req: dict[str, Any]) -> dict[str, Any]:
    """One trial of a pattern candidate (module docstring). ``req``: ``pattern``
    (``pattern_to_json``), ``backend``, ``config`` / ``incumbent`` (collective knobs),
    ``target`` (Target fields), ``seed`` (of the inputs and the sim's interleaving),
    ``sim_policy``, ``timing`` (A/B parameters), ``kernel`` (kernel knobs), ``timeout_s``,
    ``hooks`` (tests: ``executor``, a factory ``(program, init_fn, seed, policy)`` of the sim
    gate's executor; ``predict``; for triton ``rank_runner`` and ``timer``, passed on to the
    rank processes). Never raises for the candidate's own failure: the result says what
    happened (``status`` ok | rejected | fail, ``stage``, ``reason``, ``correctness``,
    ``timing``, ``floor_ms``, ``program``, ``verdict``, ``times``)."""
    times: dict[str, float] = {}
    res: dict[str, Any] = {"status": "fail", "stage": "setup", "reason": "", "times": times,
                           "restart_worker": False}
    from search.trial import make_target, program_summary, resolve_hook, time_sim, validate_stage

    hooks = req.get("hooks") or {}
    backend = req["backend"]
    try:
        pattern = pattern_from_json(req["pattern"])
        target = make_target(req.get("target", {}))
        res["stage"] = "lower"
        t = time.perf_counter()
        try:
            program, binding = lower_candidate(pattern, req["config"], target)
        except AmkError as err:
            res.update(status="rejected", reason=f"lowering refused the config: {err}"[:400])
            return res
        times["lower_s"] = time.perf_counter() - t
        res["program"] = program_summary(program, 1)
        res["stage"] = "validate"
        if not validate_stage(program, backend, res, times):
            return res
        res["floor_ms"] = floor_ms(pattern)
        if backend == "triton":
            return _evaluate_triton(req, res, times)
        res["stage"] = "correctness"
        seed = int(req.get("seed", 0))
        t = time.perf_counter()
        inputs = seeded_inputs(pattern, seed)
        factory = resolve_hook(hooks.get("executor"))
        ex = factory(program, None, seed=seed, policy=req.get("sim_policy", "random")) if factory else None
        got, _ = run_sim(program, binding, inputs, seed=seed, policy=req.get("sim_policy", "random"),
                         executor=ex)
        check = compare(got, pattern.reference(inputs), pattern.dtype)
        times["gate_s"] = time.perf_counter() - t
        res["correctness"] = correctness_fields(check)
        if not check["ok"]:
            res.update(status="fail", reason=f"correctness: {res['correctness']['why']}"[:400])
            return res
        res["stage"] = "timing"
        timing = time_sim(program, {"seq_len": 1}, resolve_hook(hooks.get("predict")))
        res["timing"] = timing
        return _finish(res)
    except AmkError as err:
        res.update(status="fail", reason=f"{res['stage']}: {err}"[:400])
        return res
    except Exception as err:  # a crash of the candidate's evaluation, not of the search
        import traceback

        print(traceback.format_exc(limit=6), file=sys.stderr)
        res.update(status="fail", reason=f"{res['stage']} crashed: {type(err).__name__}: {err}"[:400])
        return res


def correctness_fields(check: dict[str, Any]) -> dict[str, Any]:
    """A compare() result in the record's correctness fields (``passed``, ``why``)."""
    bad = [r for r, e in enumerate(check["ranks"]) if not e <= check["tolerance"]]
    why = "" if check["ok"] else (f"rank(s) {bad} differ from the reference: max abs err "
                                  f"{check['max_abs_err']:.3g} > tolerance {check['tolerance']:.3g}")
    return {"passed": bool(check["ok"]), "max_abs_err": check["max_abs_err"],
            "tolerance": check["tolerance"], "ranks": list(check["ranks"]),
            "finite": all(math.isfinite(e) for e in check["ranks"]), "why": why}


def _finish(res: dict[str, Any]) -> dict[str, Any]:
    from search.evaluator import below_floor

    timing = res["timing"]
    floor = res.get("floor_ms") or 0.0
    if not math.isfinite(timing["median_ms"]) or timing["median_ms"] <= 0 or below_floor(timing["median_ms"], floor):
        res.update(status="fail", reason=(
            f"timing {timing['median_ms']:.4g} ms ({timing['source']}) is below the floor "
            f"{floor:.4g} ms: a measurement error, not a speedup"))
        return res
    res.update(status="ok", stage="done")
    return res


def rank_command(world: int, request: str, result: str) -> list[str]:
    """The command that runs a triton trial on ``world`` GPUs: torch's launcher (torchrun)
    starting search/pattern_ranks.py once per rank."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
            "-m", "search.pattern_ranks", request, result]


def _evaluate_triton(req: dict[str, Any], res: dict[str, Any], times: dict[str, float]) -> dict[str, Any]:
    """The triton part of ``evaluate``: run ``rank_command`` with the request in a temporary
    directory and take rank 0's result (correctness on every rank, the A/B timing)."""
    import json
    import subprocess
    import tempfile
    from pathlib import Path

    from ground.files import atomic_write_json
    from lowering.triton.dist import NO_MULTICAST_ENV

    res["stage"] = "correctness"
    world = int(req["pattern"]["world"])
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env.update(NO_MULTICAST_ENV)  # no multicast / NVLS on the shared machines (docs/gpu-testing.md)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amk-pattern-") as d:
        rq, rs = str(Path(d) / "request.json"), str(Path(d) / "result.json")
        atomic_write_json(rq, req)
        # start_new_session: a timeout kills the launcher and every rank with one killpg
        p = subprocess.Popen(rank_command(world, rq, rs), cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = p.communicate(timeout=float(req.get("timeout_s", 600)))
        except subprocess.TimeoutExpired:
            import signal

            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            res.update(status="fail", reason=f"the {world} rank processes did not finish in "
                                             f"{req.get('timeout_s', 600)} s")
            return res
        if log:
            sys.stderr.write(log[-20000:])
        if not Path(rs).exists():
            tail = " | ".join(log.strip().splitlines()[-3:])
            res.update(status="fail", reason=f"the rank processes wrote no result (exit {p.returncode}): {tail}"[:400])
            return res
        ranks = json.loads(Path(rs).read_text())
    times["ranks_s"] = time.perf_counter() - t
    res["program"] = {**res.get("program", {}), **(ranks.get("program") or {})}
    if ranks.get("correctness") is not None:
        res["correctness"] = ranks["correctness"]
    if ranks.get("status") != "ok":
        res.update(status=ranks.get("status", "fail"), stage=ranks.get("stage", "ranks"),
                   reason=ranks.get("reason", "the rank processes failed")[:400])
        return res
    res["stage"] = "timing"
    res["timing"] = ranks["timing"]
    return _finish(res)


__all__ = ["INPUT_STD", "TOL", "acting_knobs", "compare", "config_for_file", "evaluate", "floor_ms",
           "knob_values", "lower_candidate", "pattern_from_json", "pattern_space", "pattern_to_json",
           "rank_command", "run_sim", "seeded_inputs"]
