"""`amk search FILE.py:FUNC`: a communication pattern's collective knobs searched with the search
loop (search/patterns.py): the space holds only the knobs that act for the pattern, every trial is
lowered, validated and checked on every rank on the sim, a refused knob value is REJECTED with no
run, a wrong output FAILs, a killed search resumes with the next trial number, and
best/config.json is a config file amk dist and amk.distribute take as-is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ground.errors import AmkError
from search.loop import SearchSettings, open_search
from search.records import read_json
from tests.test_search_cheats import InProcessEvaluator

ROOT = Path(__file__).resolve().parent.parent
AG = "examples/distributed/allgather_matmul.py:allgather_matmul"
AG_ARGS = [AG, "--world", "2", "--shape", "x=32,64", "--shape", "w=64,48"]
SPEC = {"kind": "allgather_matmul", "world": 2, "dtype": "bf16", "m": 64, "n": 48, "k": 64}


def _amk(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "amk", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def settings(out, spec=SPEC, **kw) -> SearchSettings:
    """A pattern search's settings without a capture (the pattern given as JSON)."""
    fn = str(ROOT / AG)
    return SearchSettings(model=fn, out=str(out), tp=spec["world"], dtype=spec["dtype"],
                          pattern={"function": fn, "world": spec["world"],
                                   "shapes": {"x": [32, 64], "w": [64, 48]}, "spec": dict(spec)}, **kw)


def _records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x.strip()]


class WrongSim:
    """A sim executor whose outputs are off by 1 (a planted wrong result)."""

    def __init__(self, program):
        from lowering.sim import SimExecutor

        self.ex = SimExecutor(program, check=False)

    def write(self, *a):
        self.ex.write(*a)

    def step(self, e):
        self.ex.step(e)

    def read(self, name, rank):
        return self.ex.read(name, rank) + 1


def wrong_sim(program, init_fn, seed=0, policy="random"):
    return WrongSim(program)


# ----------------------------------------------------------------------------- the space
def test_space_holds_only_the_knobs_that_act_for_the_pattern():
    from lowering.config import CollectiveConfig
    from lowering.knobs import knob_named
    from search.patterns import pattern_space

    kinds = {"allgather_matmul": set(), "matmul_reduce_scatter": {"reduce_rows", "direct"},
             "matmul_allreduce": {"reduce_rows", "allreduce", "direct"}, "ulysses_combine": {"whole_k"}}
    for kind, extra in kinds.items():
        sp = pattern_space(kind)
        assert set(sp.names) == {"tile_m", "tile_n", "workers", "chunks"} | extra, kind
        assert set(sp.fixed) | set(sp.names) == {f for f in CollectiveConfig.__dataclass_fields__}
        for k in sp.knobs:  # every value is one the knob allows, the default among them
            assert k.default == knob_named(CollectiveConfig, k.name).default
            assert all(knob_named(CollectiveConfig, k.name).problem(v) is None for v in k.values)
    # a --config value outside the ladder is added, so trial 0 is a point of the space
    assert 48 in pattern_space("allgather_matmul", {"tile_n": 48}).knob("tile_n").values


def test_config_file_drops_a_knob_that_does_nothing_at_the_others():
    from lowering.config import CollectiveConfig
    from search.patterns import config_for_file, pattern_space

    sp = pattern_space("matmul_allreduce")
    cfg = config_for_file("matmul_allreduce", sp.lowering_config({"direct": True, "allreduce": "oneshot"}))
    assert cfg["direct"] is False  # --direct 1 does nothing with --allreduce oneshot
    CollectiveConfig.from_json(cfg, "x", "matmul_allreduce")  # what amk dist --config checks
    cfg = config_for_file("matmul_allreduce", sp.lowering_config({"direct": True, "allreduce": "twoshot"}))
    assert cfg["direct"] is True


def test_cost_model_prices_the_gemm_flops():
    from lowering.collectives import lower_pattern
    from lowering.config import CollectiveConfig
    from lowering.costmodel import DEFAULT_GEMM_FLOPS, estimate, gemm_flops_of
    from search.patterns import pattern_from_json

    def est(k):
        p = pattern_from_json({**SPEC, "k": k, "m": 256, "n": 256})
        prog, _ = lower_pattern(p, CollectiveConfig(tile_m=64, tile_n=64, workers=4))
        flops = sum(gemm_flops_of(t) for t in prog.tasks)
        assert flops == p.world * p.flops()
        return prog, estimate(prog)

    prog, e = est(64)
    g = next(t for t in prog.tasks if t.op == "gemm")
    assert gemm_flops_of(g) == 2 * 64 * 64 * 64  # a 64 x 64 tile over K = 64
    assert all(gemm_flops_of(t) == 0 for t in prog.tasks if t.op != "gemm")
    # 4 workers per rank: each runs its share of the rank's 16 tiles at one SM's share of the peak
    per_worker = DEFAULT_GEMM_FLOPS / prog.target.sms
    want = max(sum(gemm_flops_of(t) for t in prog.tasks if t.rank == 0 and t.worker == w)
               for w in range(prog.workers)) / per_worker
    assert e.per_rank[0]["gemm_compute_us"] == pytest.approx(want * 1e6)
    _, e_big = est(4096)
    assert e_big.per_rank[0]["gemm_compute_us"] == pytest.approx(64 * e.per_rank[0]["gemm_compute_us"])
    assert e_big.predicted_latency_s > e.predicted_latency_s
    assert e.assumptions["gemm_flops_per_s"] == DEFAULT_GEMM_FLOPS


# ----------------------------------------------------------------------------- trials
def test_refused_knob_value_is_rejected_without_a_run(tmp_path):
    # 1024 workers per rank: more than the sim target's 132 can hold; the lowering refuses
    ev = InProcessEvaluator()
    s = open_search(settings(tmp_path / "s", trials=2, start={"workers": 1024}), evaluator=ev)
    res = s.run()
    r0 = res.records[0]
    assert r0.status == "REJECTED" and "lowering refused" in r0.reason and "workers" in r0.reason
    assert r0.correctness is None and r0.latency_ms is None
    assert r0.extra["stage"] == "lower" and "gate_s" not in r0.extra["times"]
    assert res.records[1].status == "KEEP"  # the first correct candidate is the start


def test_wrong_output_fails_the_check(tmp_path):
    ev = InProcessEvaluator()
    s = open_search(settings(tmp_path / "s", trials=2, hooks={"executor": "tests.test_search_patterns:wrong_sim"}),
                    evaluator=ev)
    res = s.run()
    assert [r.status for r in res.records] == ["FAIL", "FAIL"]
    r0 = res.records[0]
    assert r0.extra["stage"] == "correctness" and "differ from the reference" in r0.reason
    assert r0.correctness["passed"] is False and r0.correctness["ranks"] == [pytest.approx(1.0, abs=0.3)] * 2
    assert res.state.best is None and not (tmp_path / "s" / "best").exists()


def test_search_in_process_validates_every_trial_and_resumes(tmp_path):
    ev = InProcessEvaluator()
    out = tmp_path / "s"
    res = open_search(settings(out, trials=3), evaluator=ev).run()
    assert [r.trial for r in res.records] == [0, 1, 2]
    assert all(q["pattern"]["kind"] == "allgather_matmul" for q in ev.requests)
    for r in res.records:
        assert r.extra["verdict"]["ok"] is True and r.correctness["passed"] is True
        assert r.timing_source == "predicted" and r.latency_ms > 0
    before = _records(out)
    res = open_search(resume=str(out), overrides={"trials": 5}, evaluator=InProcessEvaluator()).run()
    after = _records(out)
    assert [r["trial"] for r in after] == [0, 1, 2, 3, 4] and after[:3] == before
    st = read_json(out / "state.json")
    assert st["trials_done"] == 5 and st["settings"]["pattern"]["spec"] == SPEC


def test_settings_refuse_an_edit_search_of_a_pattern(tmp_path):
    with pytest.raises(AmkError, match="collective knobs"):
        open_search(settings(tmp_path / "s", proposer="edits", edits=True))


# ----------------------------------------------------------------------------- the command
def test_cli_search_then_amk_dist_and_distribute_take_the_best_config(tmp_path):
    out = tmp_path / "s"
    r = _amk("search", *AG_ARGS, "--trials", "4", "--out", out, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    obj = json.loads(r.stdout)
    assert obj["pattern"] == "allgather_matmul" and obj["world"] == 2 and obj["trials"] == 4
    recs = _records(out)
    assert [x["trial"] for x in recs] == [0, 1, 2, 3]
    assert all(x["extra"]["verdict"]["ok"] for x in recs if x["status"] != "REJECTED")
    cfg = json.loads((out / "best" / "config.json").read_text())
    assert set(cfg) == {"collective"}
    assert obj["use_best"].startswith("amk dist ") and "--config" in obj["use_best"]
    # amk dist --config takes it as-is (and the run matches the reference)
    from amk.cli import main

    assert main(["dist", *AG_ARGS, "--config", str(out / "best" / "config.json")]) == 0
    # amk.distribute(config=...) too, with the same knobs
    import amk
    from amk.commands import load_function

    fn = load_function(ROOT / "examples/distributed/allgather_matmul.py", "allgather_matmul")
    fused = amk.distribute(fn, world=2, shapes={"x": (32, 64), "w": (64, 48)}, config=str(out / "best" / "config.json"))
    from ir.io import load_program
    from search.space import program_fingerprint

    # the very schedule the search saved as the best
    assert program_fingerprint(fused.program) == program_fingerprint(load_program(out / "best" / "schedule.json"))
    trial = json.loads((out / "best" / "trial.json").read_text())
    assert trial["pattern"] == "allgather_matmul" and trial["collective_config"] == cfg["collective"]


def test_cli_kill_then_resume_continues_the_trial_numbers(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "amk", "search", *AG_ARGS, "--trials", "30", "--out", str(out),
                             "--quiet"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    jsonl = out / "results.jsonl"
    deadline = time.time() + 120
    while (not jsonl.exists() or jsonl.read_bytes().count(b"\n") < 2) and proc.poll() is None \
            and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the search and its worker
    proc.wait()
    data = jsonl.read_bytes()
    done = [json.loads(x) for x in data[: data.rfind(b"\n") + 1].decode().splitlines() if x.strip()]
    assert len(done) >= 2
    r = _amk("search", "--resume", out, "--trials", str(len(done) + 2), "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = _records(out)
    assert [x["trial"] for x in recs] == list(range(len(done) + 2))
    assert recs[: len(done)] == done


@pytest.mark.parametrize("args,needle", [
    ([AG, "--world", "2"], "--shape NAME=DIMS"),
    ([AG, "--shape", "x=32,64", "--shape", "w=64,48"], "--world R"),
    ([*AG_ARGS, "--tp", "2"], "--tp is a flag of a model's search"),
    ([*AG_ARGS, "--tile", "32"], "--tile is a flag of a model's search"),
    ([*AG_ARGS, "--dtype", "int8"], "bf16, f16 or f32"),
    (["config:tiny-llama", "--world", "2"], "--world is a flag of a function's search"),
    (["config:tiny-llama", "--shape", "x=2,2"], "--shape is a flag of a function's search"),
    ([*AG_ARGS, "--backend", "sim", "--num-warps", "8"], "has none"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, needle):
    r = _amk("search", *args, "--trials", "1", "--out", tmp_path / "x")
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and needle in err[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- triton, on the CPU
# `torchrun -m search.pattern_ranks` with the sim standing in for the megakernel on each rank
# (hooks: rank_runner, timer); on GPUs the same module builds PatternRank executors over NVSHMEM.
def fake_timer():
    """A timer hook: runs the step ``steps`` times, 1 ms each."""
    def timer(fn, steps):
        for _ in range(steps):
            fn()
        return [1.0] * steps
    return timer


class WrongSimRank:
    """A rank runner whose output is off by 1 on rank 1 only."""

    def __new__(cls, program, binding, ctx, kernel=None):
        from search.pattern_ranks import SimRank

        class Wrong(SimRank):
            def output(self):
                return self.out + (1 if self.ctx.rank == 1 else 0)

            def run(self, inputs):
                super().run(inputs)
                return self.output()
        return Wrong(program, binding, ctx, kernel)


def _triton_request(hooks, incumbent=None):
    from search.patterns import pattern_space

    sp = pattern_space("allgather_matmul")
    return {"pattern": dict(SPEC), "ranks": 2, "backend": "triton",
            "config": sp.lowering_config({"tile_m": 32}), "incumbent": sp.lowering_config(incumbent) if incumbent
            else None, "target": {"name": "generic", "sms": 132, "max_workers": 132, "backend": "triton"},
            "seed": 3, "timing": {"rounds": 2, "steps": 2, "warmup": 1, "min_gain": 0.01},
            "hooks": hooks, "kernel": {}, "timeout_s": 240}


def test_triton_trial_on_two_rank_processes_times_candidate_against_incumbent():
    from search.worker import evaluate

    res = evaluate(_triton_request({"rank_runner": "search.pattern_ranks:SimRank",
                                    "timer": "tests.test_search_patterns:fake_timer"}, incumbent={"tile_m": 128}))
    assert res["status"] == "ok", res["reason"]
    t = res["timing"]
    assert t["source"] == "measured" and t["median_ms"] == 1.0 and t["incumbent_ms"] == 1.0
    assert t["ab"]["rounds"] == 2 and t["ab"]["faster"] is False  # equal times: not faster
    assert res["correctness"]["passed"] and len(res["correctness"]["ranks"]) == 2
    assert res["verdict"]["ok"] and res["floor_ms"] > 0


def test_triton_trial_fails_when_one_rank_differs():
    from search.worker import evaluate

    res = evaluate(_triton_request({"rank_runner": "tests.test_search_patterns:WrongSimRank",
                                    "timer": "tests.test_search_patterns:fake_timer"}))
    assert res["status"] == "fail" and res["stage"] == "correctness", res
    assert "rank(s) [1] differ" in res["reason"] and "timing" not in res
