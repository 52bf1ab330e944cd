"""One triton trial of a pattern's search on R GPUs, one process per rank:

    torchrun --nproc-per-node R -m search.pattern_ranks REQUEST.json RESULT.json

(search/patterns.py ``rank_command`` starts it; REQUEST is a pattern trial request, its
``evaluate``'s docstring). Every rank lowers the candidate (``config``) and the incumbent
(``incumbent``; none, or the same config: the candidate is timed against itself, A/A) for the
request's ``target``, initialises NVSHMEM with a heap for both, builds each one's executor
(lowering.triton.pattern_rank.PatternRank: its arena symmetric, its launch replayed from a
CUDA graph), runs one epoch of each on its own seeded operands (search.patterns.seeded_inputs,
the same on every rank, so each rank also computes its reference) and checks the candidate's
output against ``Pattern.reference`` on every rank. Then interleaved A/B rounds
(search.evaluator.ab_interleaved: incumbent A, candidate B, A again) of graph replays, every
rank in lockstep; a batch's per-call time is the slowest rank's (each rank times with CUDA
events, the times are gathered); after the rounds the candidate's replayed output is checked
again on every rank. Rank 0 writes RESULT (``status`` ok | fail, ``stage``, ``reason``,
``correctness``, ``timing``). NO_MULTICAST_ENV is set (no multicast / NVLS).

Without GPUs the module runs on the CPU when the request's ``hooks`` name a ``rank_runner``
(a factory ``(program, binding, ctx, kernel) -> runner`` with PatternRank's methods, e.g.
``search.pattern_ranks:SimRank``) and a ``timer`` (``() -> timer``): the ranks form a gloo
group and NVSHMEM is left alone (tests/test_search_patterns.py).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import torch

from ground.errors import AmkError


class SimRank:
    """A rank runner for CPU runs of this module: every rank gathers all ranks' operands
    over the group and runs the whole program on the sim (lowering.sim), keeping its own
    output. ``replay`` runs one more epoch; ``capture`` / ``check`` / ``close`` do nothing."""

    def __init__(self, program: Any, binding: Any, ctx: Any, kernel: Any = None):
        from lowering.sim import SimExecutor

        self.program, self.binding, self.ctx = program, binding, ctx
        self.ex = SimExecutor(program, check=False)
        self.epoch, self.everyone, self.out = 0, None, None

    def run(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        self.everyone = self.ctx.all_gather_object({k: v.cpu() for k, v in inputs.items()})
        self.replay()
        return self.out

    def replay(self) -> None:
        from search.patterns import run_sim

        outs, _ = run_sim(self.program, self.binding, self.everyone, executor=self.ex, epoch=self.epoch)
        self.epoch += 1
        self.out = outs[self.ctx.rank]

    def capture(self) -> None:
        pass

    def check(self) -> None:
        pass

    def output(self) -> torch.Tensor:
        return self.out

    def close(self) -> None:
        pass


def _context(cpu: bool) -> Any:
    """This process's lowering.triton.dist.DistContext: the GPU ``LOCAL_RANK`` and a
    gloo + NCCL group (init_distributed), or with ``cpu`` a gloo group on the CPU."""
    from lowering.triton.dist import NO_MULTICAST_ENV, DistContext, env_world, init_distributed

    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    if not cpu:
        return init_distributed()
    import torch.distributed as dist

    got = env_world()
    if got is None:
        raise AmkError("start it with torchrun --nproc-per-node R (RANK / WORLD_SIZE are not set)")
    rank, world, local = got
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return DistContext(rank=rank, world=world, local_rank=local, device=torch.device("cpu"))


def _slowest_rank(ctx: Any, timer: Callable) -> Callable:
    """``timer`` with every rank starting together and each call's time the slowest rank's."""
    def timed(fn: Callable[[], Any], steps: int) -> list[float]:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        ctx.barrier()
        mine = [float(x) for x in timer(fn, steps)]
        return [max(col) for col in zip(*ctx.all_gather_object(mine))]
    return timed


def run_ranks(req: dict[str, Any], ctx: Any, make: Callable[..., Any], timer: Callable) -> dict[str, Any]:
    """The trial on this rank (module docstring); every rank returns the same result dict."""
    from lowering.config import KernelConfig
    from search.evaluator import measured_ab
    from search.patterns import compare, correctness_fields, lower_candidate, pattern_from_json, seeded_inputs
    from search.trial import make_target

    res: dict[str, Any] = {"status": "fail", "stage": "lower", "reason": ""}
    errors: list[str] = []

    def agreed(stage: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on every rank; when it raised on any, every rank learns which (no rank is
        left waiting in a collective) and the trial stops at ``stage``."""
        res["stage"] = stage
        try:
            out, err = fn(), None
        except Exception as e:  # the candidate's failure (a kernel error, a watchdog)
            out, err = None, f"{type(e).__name__}: {e}".splitlines()[0]
        errs = [f"rank {r}: {e}" for r, e in enumerate(ctx.all_gather_object(err)) if e]
        if errs:
            errors.extend(errs)
            raise _Stop()
        return out

    pattern = pattern_from_json(req["pattern"])
    target = make_target(req.get("target", {}))
    kernel = KernelConfig.from_json(dict(req.get("kernel") or {}), "the search's kernel knobs")
    inputs = seeded_inputs(pattern, int(req.get("seed", 0)))
    ref = pattern.reference(inputs)[ctx.rank]
    runners: list[Any] = []
    try:
        prog, bind = agreed("lower", lambda: lower_candidate(pattern, req["config"], target))
        inc = None
        if req.get("incumbent") and req["incumbent"] != req["config"]:
            inc = agreed("lower", lambda: lower_candidate(pattern, req["incumbent"], target))
        if getattr(make, "needs_nvshmem", False):
            from lowering.triton.dist import init_nvshmem
            from lowering.triton.pattern_rank import PatternRank

            agreed("nvshmem", lambda: init_nvshmem(ctx, PatternRank.heap_bytes([prog] + ([inc[0]] if inc else []))))
        b = agreed("build", lambda: make(prog, bind, ctx, kernel))
        runners.append(b)
        out = agreed("correctness", lambda: b.run(inputs[ctx.rank]))
        check = _gathered(ctx, compare([out], [ref], pattern.dtype))
        res["correctness"] = correctness_fields(check)
        if not check["ok"]:
            res.update(reason=f"correctness: {res['correctness']['why']}")
            return res
        a = b
        if inc is not None:
            a = agreed("build", lambda: make(inc[0], inc[1], ctx, kernel))
            runners.append(a)
            agreed("incumbent", lambda: a.run(inputs[ctx.rank]))
        agreed("capture", lambda: [r.capture() for r in runners])
        timing = agreed("timing", lambda: measured_ab(a.replay, b.replay, _slowest_rank(ctx, timer),
                                                      req.get("timing") or {}, inc is not None))
        agreed("timing", lambda: [r.check() for r in runners])
        again = _gathered(ctx, compare([b.output()], [ref], pattern.dtype))
        if not again["ok"]:  # the replayed output, after the timed rounds
            res["correctness"] = correctness_fields(again)
            res.update(stage="correctness", reason=f"correctness after the timed replays: {res['correctness']['why']}")
            return res
        res.update(status="ok", stage="done", timing=timing,
                   program={"workers": prog.workers, "tasks": len(prog.tasks)})
        return res
    except _Stop:
        res["reason"] = f"{res['stage']}: " + "; ".join(errors)
        return res
    finally:
        for r in reversed(runners):  # collective: the same order on every rank
            try:
                r.close()
            except Exception:
                pass


class _Stop(Exception):
    """A stage failed on some rank (``run_ranks``'s ``agreed``)."""


def _gathered(ctx: Any, mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's one-rank compare() result merged into one over all ranks."""
    every = ctx.all_gather_object(mine)
    return {"ok": all(c["ok"] for c in every), "max_abs_err": max(c["max_abs_err"] for c in every),
            "tolerance": max(c["tolerance"] for c in every), "ranks": [c["ranks"][0] for c in every]}


def main(argv: list[str] | None = None) -> int:
    """Entry point of every rank (module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: torchrun --nproc-per-node R -m search.pattern_ranks REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        req = json.load(f)
    from search.trial import resolve_hook

    hooks = req.get("hooks") or {}
    make = resolve_hook(hooks.get("rank_runner"))
    timer_hook = resolve_hook(hooks.get("timer"))
    ctx = _context(cpu=make is not None and not torch.cuda.is_available())
    try:
        if make is None:
            from lowering.triton.pattern_rank import PatternRank

            def make(program, binding, ctx, kernel):
                return PatternRank(program, binding, ctx, kernel=kernel)
            make.needs_nvshmem = True
        if timer_hook is not None:
            timer = timer_hook()
        else:
            from search.evaluator import cuda_event_timer

            timer = cuda_event_timer(ctx.device)
        res = run_ranks(req, ctx, make, timer)
        if ctx.rank == 0:
            from ground.files import atomic_write_json

            atomic_write_json(argv[1], res)
        ctx.barrier()
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
