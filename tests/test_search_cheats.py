"""Planted cheats: an evaluator that returns stale (or no) outputs, and timings below the
roofline floor, must be caught and logged (FAIL with the reason), never kept.

This module also holds the test-only hooks the evaluation worker imports by dotted name
(``tests.test_search_cheats:...``) and a small in-process evaluator for fast loop tests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from search import worker
from search.loop import SearchSettings, open_search
from search.records import read_tsv

MODEL = "config:tiny-llama"
TARGET = {"name": "generic", "sms": 132, "max_workers": 132, "backend": "sim"}


# -- hooks (imported by the worker by dotted name) -------------------------------------
class StaleExecutor:
    """Runs the real sim for step 0 only; afterwards it writes step 0's outputs back
    instead of computing (a cheat that returns stale outputs quickly)."""

    def __init__(self, program, init_fn, seed=0, policy="random"):
        from lowering.sim import SimExecutor

        self.inner = SimExecutor(program, init_fn, seed=seed, policy=policy, check=False)
        self.program = program
        self.saved: dict[tuple[str, int], Any] = {}
        self.next_epoch = 0

    def write(self, name, rank, value):
        self.inner.write(name, rank, value)

    def read(self, name, rank):
        return self.inner.read(name, rank)

    def step(self, epoch):
        outs = [(b.name, b.rank) for b in self.program.buffers if b.kind == "io_output"]
        if epoch == 0:
            self.inner.step(0)
            self.saved = {k: self.inner.read(*k) for k in outs}
        else:
            for (name, rank), v in self.saved.items():
                self.inner.write(name, rank, v)
        self.next_epoch = epoch + 1


def stale_executor(program, init_fn, seed=0, policy="random"):
    return StaleExecutor(program, init_fn, seed, policy)


class LazyExecutor(StaleExecutor):
    """Never computes anything: outputs stay as the gate left them (poisoned)."""

    def step(self, epoch):
        self.next_epoch = epoch + 1


def lazy_executor(program, init_fn, seed=0, policy="random"):
    return LazyExecutor(program, init_fn, seed, policy)


def hanging_executor(program, init_fn, seed=0, policy="random"):
    time.sleep(3600)


def crashing_executor(program, init_fn, seed=0, policy="random"):
    os._exit(3)


def sim_executor(program, init_fn, seed=0, policy="random"):
    """The real sim, for running the triton code path on the CPU."""
    from lowering.sim import SimExecutor

    return SimExecutor(program, init_fn, seed=seed, policy=policy, check=False)


def impossible_predict(program, seq_len):
    """A 'cost model' claiming a picosecond step: below any roofline floor."""
    return 1e-9


def fast_timer():
    """A timer that claims every step took 1 ns."""
    def timer(fn, steps):
        for _ in range(steps):
            fn()
        return [1e-6] * steps
    return timer


def plausible_timer():
    """A timer returning 1 s per step (far above the floor of a tiny model)."""
    def timer(fn, steps):
        for _ in range(steps):
            fn()
        return [1000.0] * steps
    return timer


class InProcessEvaluator:
    """Evaluates requests in this process (tests only: no subprocess, no timeout)."""

    def __init__(self):
        self.requests: list[dict[str, Any]] = []

    def evaluate(self, request, workdir, timeout_s=None):
        self.requests.append(request)
        t = time.perf_counter()
        res = worker.evaluate(request)
        res["wall_s"] = time.perf_counter() - t
        return res

    def close(self):
        pass


def request(config=None, backend="sim", hooks=None, **kw):
    from models.graph import spec_from_config
    from models.recipes import build_config
    from search.space import space_for

    sp = space_for(spec_from_config(build_config("tiny-llama")), 2, 132)
    req = dict(model=MODEL, ranks=2, backend=backend,
               config=sp.lowering_config(config or sp.default()), incumbent=None,
               target=dict(TARGET, backend=backend), positions=[0, 3, 7], prompt_seed=5,
               sim_seed=1, sim_policy="random", seq_len=64, hooks=hooks or {},
               tolerance={"rel_err": 2e-3, "min_argmax_agree": 1.0},
               timing={"rounds": 2, "steps": 2, "warmup": 0, "min_gain": 0.01})
    req.update(kw)
    return req


# -- tests -------------------------------------------------------------------------------
def test_honest_candidate_passes():
    res = worker.evaluate(request())
    assert res["status"] == "ok", res["reason"]
    assert res["correctness"]["passed"] and res["correctness"]["argmax_agree"] == 1.0
    assert res["timing"]["source"] == "predicted"
    assert res["timing"]["median_ms"] >= res["floor_ms"] > 0


def test_stale_outputs_are_caught():
    res = worker.evaluate(request(hooks={"executor": "tests.test_search_cheats:stale_executor"}))
    assert res["status"] == "fail" and res["stage"] == "correctness"
    assert "correctness" in res["reason"]
    assert res["correctness"]["passed"] is False
    assert "timing" not in res  # never timed


def test_unwritten_outputs_are_caught_by_poisoning():
    res = worker.evaluate(request(hooks={"executor": "tests.test_search_cheats:lazy_executor"}))
    assert res["status"] == "fail"
    assert "non-finite" in res["reason"] or "unwritten" in res["reason"]


def test_predicted_timing_below_floor_is_rejected():
    res = worker.evaluate(request(hooks={"predict": "tests.test_search_cheats:impossible_predict"}))
    assert res["status"] == "fail" and "below the roofline floor" in res["reason"]


def test_measured_timing_below_floor_is_rejected_on_triton_path():
    """The triton code path (A/B timing + floor) with the sim executor and a fake timer."""
    hooks = {"executor": "tests.test_search_cheats:sim_executor",
             "timer": "tests.test_search_cheats:fast_timer"}
    res = worker.evaluate(request(backend="triton", hooks=hooks, hbm_bw=3.0e12))
    assert res["status"] == "fail", res
    assert "below the roofline floor" in res["reason"]
    hooks["timer"] = "tests.test_search_cheats:plausible_timer"
    res = worker.evaluate(request(backend="triton", hooks=hooks, hbm_bw=3.0e12))
    assert res["status"] == "ok", res["reason"]
    assert res["timing"]["source"] == "measured" and res["timing"]["ab"]["rounds"] == 2
    assert res["timing"]["step"] == "executor"  # no CUDA graph for a sim executor


def test_step_graph_only_for_a_compiled_cuda_executor():
    """worker.step_graph captures nothing (and runs no step) for an executor that is not the
    compiled Triton one on a CUDA device: it returns None and the A/B runs ``step``."""
    from types import SimpleNamespace

    import torch

    ran = []
    for ex in (SimpleNamespace(device=torch.device("cpu"), compiled=None), SimpleNamespace()):
        assert worker.step_graph(ex, lambda: ran.append(1)) is None
    assert not ran


@pytest.mark.gpu
def test_triton_timing_replays_a_cuda_graph():
    """On a GPU the A/B of a real megakernel (tiny-llama, 2 co-located ranks) replays each
    side from a CUDA graph, checks the replays' error records and stays above the floor."""
    res = worker.evaluate(request(backend="triton"))
    assert res["status"] == "ok", res.get("reason")
    assert res["timing"]["step"] == "cuda-graph" and res["timing"]["median_ms"] > 0


@pytest.mark.parametrize("hook,what", [
    ({"executor": "tests.test_search_cheats:stale_executor"}, "correctness"),
    ({"predict": "tests.test_search_cheats:impossible_predict"}, "below the roofline floor"),
])
def test_cheats_are_logged_not_kept_by_the_loop(tmp_path: Path, hook, what):
    s = SearchSettings(model=MODEL, out=str(tmp_path / "s"), tp=2, trials=3, hooks=hook)
    search = open_search(s, evaluator=InProcessEvaluator())
    result = search.run()
    assert len(result.records) == 3
    assert all(r.status == "FAIL" and what in r.reason for r in result.records)
    assert all(r.latency_ms is None for r in result.records)
    assert result.state.best is None and result.state.incumbent is None
    rows = read_tsv(tmp_path / "s" / "results.tsv")
    assert [r["status"] for r in rows] == ["FAIL"] * 3
    assert all(r["latency_ms"] == "-" for r in rows)
    assert not (tmp_path / "s" / "incumbent").exists()
