"""`amk tune`: the whole space (every generated candidate validates, a planted invalid one is
refused before evaluation), the worker's incumbent with its own kernel knobs, the loop on the
sim backend end to end (database entry, best/config.json, resume after kill -9, no silent
overwrite, the minutes budget)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowering.config import AmkConfig, KernelConfig, LoweringConfig
from lowering.knobs import inert, knob
from models.graph import spec_from_config
from models.recipes import build_config
from search import worker
from search.space import SpaceError
from search.tunespace import KERNEL_VALUES, TuneSpace, candidate_id, kernel_knobs

ROOT = Path(__file__).resolve().parent.parent
MODEL = "config:tiny-llama"


@pytest.fixture(autouse=True)
def no_shipped_entries(monkeypatch):
    """Every run here starts from an empty database: the package's shipped entries
    (search/tuned/) would add warm starts the tests do not expect."""
    monkeypatch.setenv("AMK_TUNE_SHIPPED", "")


def _spec(name: str):
    return spec_from_config(build_config(name))


def _amk(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amk", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


# -- the space ------------------------------------------------------------------------------
def test_every_kernel_knob_has_values_its_declaration_allows():
    knobs = kernel_knobs(ring=True)
    assert [k.name for k in knobs] == [f.name for f in dataclasses.fields(KernelConfig)]
    from lowering.knobs import knob_named

    for k in knobs:
        assert len(k.values) >= 1
        for v in k.values:
            assert knob_named(KernelConfig, k.name).problem(v) is None, (k.name, v)
    assert len({k.name: k for k in knobs}["ring"].values) > 1   # --ring searches the pages
    assert {k.name: k for k in kernel_knobs()}["ring"].values == (0,)  # off by default
    assert set(KERNEL_VALUES) <= {f.name for f in dataclasses.fields(KernelConfig)}


def test_kernel_knob_without_a_value_rule_is_an_error():
    @dataclasses.dataclass(frozen=True)
    class Wider(KernelConfig):
        spin: int = knob(3, "Spins per poll.", lo=1)

    with pytest.raises(SpaceError, match="spin"):
        kernel_knobs(config_cls=Wider)


@pytest.mark.parametrize("model,ranks", [("tiny-llama", 1), ("tiny-llama", 2), ("llama-3.2-1b", 1),
                                         ("llama-3.2-1b", 2)])
def test_generated_candidates_validate(model, ranks):
    """Every one-knob neighbour and every settled random mutation of the default and of the
    heuristic config leaves no knob without effect; the screen passes it or names a rule or
    a resource, never a knob that does nothing."""
    from search.heuristic import heuristic_config
    from search.tunedb import GpuKey, ShapeKey

    spec = _spec(model)
    sp = TuneSpace(spec, ranks, 4 * 132, dtype="bf16", sms=132, colocated=ranks)
    heur, dropped = sp.adapt(heuristic_config(ShapeKey.from_spec(spec, "bf16"), GpuKey("NVIDIA H100", 132), ranks))
    assert dropped == []
    rng = random.Random(1)
    n = 0
    for start in (sp.default(), heur):
        assert sp.screen(start) is None
        cands = [c for name in sp.names for c in sp.neighbours(start, name)]
        cands += [sp.settle(sp.mutate(start, rng, 2)) for _ in range(100)]
        for c in cands:
            n += 1
            assert not list(inert(LoweringConfig(**c["lowering"]), ranks))
            assert not list(inert(KernelConfig(**c["kernel"]), ranks))
            why = sp.screen(c)
            if why is None:
                AmkConfig.from_json(c, "candidate", ranks=ranks, combinations=True)
            else:
                # a rule between knobs (--gemv-tma 1 needs --gemv-stages 2..8, --w-preload below K) or a
                # resource: refused before any backend time, but never a knob that does nothing
                assert "does nothing" not in why and ("needs" in why or "at least" in why
                                                      or why.startswith("resources:")), why
    assert n > 100


def test_screen_refuses_planted_combinations_with_their_reason():
    sp = TuneSpace(_spec("tiny-llama"), 1, 132, dtype="f32", sms=132)
    d = sp.default()
    inert_one = sp.with_value(sp.with_value(d, "x_stage", False), "x_reuse", True)
    assert "--x-reuse 1 does nothing without --x-stage 1" in sp.screen(inert_one)
    assert sp.settle(inert_one, keep="x_reuse") is None
    big = sp.with_value(sp.with_value(d, "gemv_stages", 8), "gemv_block", "64x256")
    assert "shared memory" in sp.screen(big)   # 7 x 64 x 256 x 4 B > 227 KiB
    regs = TuneSpace(_spec("tiny-llama"), 1, 4 * 132, sms=132)
    many = regs.with_value(regs.with_value(d, "workers", 528), "num_warps", 16)
    assert "register file" not in (regs.screen(many) or "")  # 4 CTAs x 512 threads fit
    unroll = sp.with_value(sp.with_value(d, "gemv_unroll", 4), "gemv_block", "16x512")
    assert "32 x num_warps" in sp.screen(unroll)
    assert sp.screen(sp.with_value(d, "dtype", "bf16")).startswith("dtype is 'bf16'")


def test_adapt_keeps_the_kernel_and_the_knobs_that_validate():
    sp = TuneSpace(_spec("tiny-llama"), 1, 132, dtype="f32")
    other = {"lowering": {"tile": 32, "allreduce": "fused", "fuse": True, "fuse_reduce": True,
                          "tile_reduce": 256, "dtype": "bf16", "gone": 1},
             "kernel": {"gemv_block": "16x128", "gemv_stages": 4, "gemv_tma": True}}
    cand, dropped = sp.adapt(other)   # an entry of --tp 2, bf16
    assert sp.screen(cand) is None
    assert cand["lowering"]["tile"] == 32 and cand["lowering"]["fuse"] is True
    assert cand["lowering"]["allreduce"] == "oneshot" and cand["lowering"]["dtype"] == "f32"
    assert cand["kernel"]["gemv_block"] == "16x128" and cand["kernel"]["gemv_tma"] is True
    assert any(d.startswith("allreduce") for d in dropped) and any(d.startswith("gone") for d in dropped)


def test_knobs_are_ranked_by_the_share_of_their_family():
    from search.tune import rank_knobs

    sp = TuneSpace(_spec("tiny-llama"), 2, 132, dtype="bf16", sms=132)
    gemv_first = rank_knobs(sp, {"gemv": 0.8, "attention": 0.1, "comm": 0.05, "schedule": 0.05})
    assert sp.knob(gemv_first[0][0]).family == "gemv"
    attn_first = rank_knobs(sp, {"gemv": 0.1, "attention": 0.7, "comm": 0.1, "schedule": 0.1})
    assert [n for n, _ in attn_first[:4]] == ["attn_split", "attn_kv_split", "late_append", "attention_block"]
    comm_first = rank_knobs(sp, {"gemv": 0.1, "attention": 0.1, "comm": 0.7, "schedule": 0.1})
    assert {n for n, _ in comm_first[:3]} <= {"allreduce", "tile_reduce", "fuse_reduce", "lean_release",
                                               "coalesce_signals"}


def test_cost_model_shares_follow_the_program():
    from lowering.lower import lower
    from models.graph import build_graph
    from search.tune import cost_shares, profile_shares

    spec = _spec("llama-3.2-1b")
    shares = cost_shares(lower(build_graph(spec, name="x"), 2, config=LoweringConfig(dtype="bf16", workers=64)), 128)
    assert abs(sum(shares.values()) - 1) < 1e-9
    assert shares["gemv"] > 0.5 and shares["comm"] > 0
    p = profile_shares({"norm_gemv": 6.0, "rope_attention": 2.0, "put": 1.0, "embed": 1.0})
    assert p == {"gemv": 0.6, "attention": 0.2, "comm": 0.1, "schedule": 0.1}


# -- the worker: the incumbent runs with its own kernel knobs ---------------------------------
BUILT: list[tuple[dict, object]] = []


def recording_factory(backend, kernel):
    """An executor_factory hook: the sim executor, recording which kernel knobs built it."""
    from lowering.sim import SimExecutor

    def make(program, init_fn, seed=0, policy="random"):
        BUILT.append((dict(kernel or {}), program))
        return SimExecutor(program, init_fn, seed=seed, policy=policy, check=False)
    return make


def _triton_request(**kw):
    from tests.test_search_cheats import request

    hooks = {"executor_factory": "tests.test_tune:recording_factory",
             "timer": "tests.test_search_cheats:plausible_timer"}
    return request(backend="triton", hooks=hooks, hbm_bw=3.0e12, **kw)


def test_incumbent_runs_with_its_own_kernel_knobs():
    cand_k, inc_k = {"gemv_block": "16x128"}, {"gemv_block": "32x256", "num_warps": 4}
    req = _triton_request(kernel=cand_k, incumbent_kernel=inc_k)
    req["incumbent"] = dict(req["config"])   # the same lowering: only the kernels differ
    BUILT.clear()
    res = worker.evaluate(req)
    assert res["status"] == "ok", res["reason"]
    kernels = [k for k, _ in BUILT]
    # the gate and the candidate's timing run the candidate's knobs, the incumbent its own
    assert kernels.count(cand_k) == 2 and kernels.count(inc_k) == 1, kernels
    assert res["timing"]["incumbent_ms"] is not None and res["timing"]["ab"]["rounds"] == 2


def test_request_without_incumbent_kernel_keeps_the_old_meaning():
    req = _triton_request(kernel={"gemv_block": "16x128"})
    req["incumbent"] = dict(req["config"], tile=32)
    BUILT.clear()
    res = worker.evaluate(req)
    assert res["status"] == "ok", res["reason"]
    assert [k for k, _ in BUILT] == [{"gemv_block": "16x128"}] * 3
    assert BUILT[1][1] is not BUILT[2][1]    # the incumbent's own program (tile 32)
    BUILT.clear()
    req = _triton_request(kernel={"gemv_block": "16x128"}, incumbent_kernel={"gemv_block": "16x128"})
    req["incumbent"] = dict(req["config"])
    worker.evaluate(req)
    assert len(BUILT) == 2 and "incumbent_ms" in worker.evaluate(req)["timing"]  # A/A on itself


# -- the loop ------------------------------------------------------------------------------
class RecordingEvaluator:
    def __init__(self):
        self.requests = []

    def evaluate(self, request, workdir, timeout_s=None):
        self.requests.append(request)
        return worker.evaluate(request)

    def close(self):
        pass


def test_planted_candidate_is_rejected_without_evaluation(tmp_path):
    from search.tune import TuneSettings, open_tune

    ev = RecordingEvaluator()
    t = open_tune(TuneSettings(model=MODEL, out=str(tmp_path / "t"), backend="sim", dtype="f32", trials=3,
                               db=str(tmp_path / "db")), evaluator=ev)
    d = t.space.default()
    bad = t.space.with_value(d, "late_append", True)
    bad["lowering"]["fuse"] = False
    row = t.try_candidate(bad, "planted", "late_append without fuse")
    assert row["status"] == "REJECTED" and row["trial"] is None
    assert "--late-append 1 does nothing without --fuse 1" in row["reason"]
    assert ev.requests == [] and t.trials == 0
    lines = (tmp_path / "t" / "trials.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["reason"] == row["reason"]
    summary = t.summary()
    assert summary["rejected_by_reason"] == {"a knob does nothing": 1}


def _db_entry(tmp_path, ms: float) -> Path:
    from search.tune import SIM_GPU
    from search.tunedb import Entry, GpuKey, ShapeKey, TuneDB, kernel_fingerprint

    e = Entry(shape=ShapeKey.from_spec(_spec("tiny-llama"), "f32"), gpu=GpuKey(SIM_GPU, 132), tp=1,
              fingerprint=kernel_fingerprint(), config=AmkConfig().to_json(), ms=ms, baseline_ms=None,
              baseline=None, ratio=None, roofline_pct=None, correct=True, date="2026-01-01",
              command="planted", commit=None)
    ok, _ = TuneDB(tmp_path / "db").put(e)
    assert ok
    return tmp_path / "db" / e.file_name()


def test_amk_tune_sim_writes_the_entry_and_a_usable_config(tmp_path):
    out, db = tmp_path / "run", tmp_path / "db"
    r = _amk("tune", MODEL, "--backend", "sim", "--trials", "6", "--out", str(out), "--db", str(db), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["ok"] and summary["trials"] == 6 and summary["timing_source"] == "predicted"
    assert "PREDICTION" in summary["timing_note"] and "PREDICTED" in r.stderr
    entries = list(db.glob("*.json"))
    assert len(entries) == 1 and summary["db"]["written"] is True
    entry = json.loads(entries[0].read_text())
    assert entry["ms"] == summary["best"]["ms"] and entry["config"] == summary["best"]["config"]
    assert "prediction" in (out / "report.md").read_text().lower()
    assert summary["use"].startswith("amk compile")
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    ids = [x["id"] for x in rows if x.get("trial") is not None]
    assert len(ids) == len(set(ids)) == 6
    c = _amk("compile", MODEL, "--backend", "sim", "--no-check", "--config", str(out / "best" / "config.json"),
             "--out", str(tmp_path / "c"))
    assert c.returncode == 0, c.stderr


def test_resume_after_kill_continues_without_repeating(tmp_path):
    out, db = tmp_path / "run", tmp_path / "db"
    proc = subprocess.Popen([sys.executable, "-m", "amk", "tune", MODEL, "--backend", "sim", "--trials", "40",
                             "--out", str(out), "--db", str(db), "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    log = out / "trials.jsonl"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if log.exists() and '"trial": 0' in log.read_text():
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [json.loads(x) for x in log.read_text().splitlines() if x.endswith("}")]
    n = sum(1 for x in done if x.get("trial") is not None)
    assert n >= 1
    with open(log, "a") as f:          # a kill in the middle of an append
        f.write('{"id": "t-0123456789ab", "status": "KE')
    r = _amk("tune", "--resume", str(out), "--trials", str(n + 3), "--json")
    assert r.returncode == 0, r.stderr
    assert "half-written last line" in r.stderr
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    trials = [x for x in rows if x.get("trial") is not None]
    assert [x["trial"] for x in trials] == list(range(n + 3))
    assert len({x["id"] for x in trials}) == n + 3
    assert json.loads(r.stdout)["trials"] == n + 3


def test_a_faster_entry_is_not_silently_replaced(tmp_path):
    path = _db_entry(tmp_path, 1e-9)
    out = tmp_path / "run"
    r = _amk("tune", MODEL, "--backend", "sim", "--trials", "2", "--out", str(out), "--db", str(tmp_path / "db"))
    assert r.returncode == 0, r.stderr
    assert "kept the existing entry" in r.stdout and "--replace" in r.stdout
    assert json.loads(path.read_text())["ms"] == 1e-9
    assert (out / "best" / "config.json").exists()
    r = _amk("tune", "--resume", str(out), "--replace", "--trials", "3")
    assert r.returncode == 0, r.stderr
    assert json.loads(path.read_text())["ms"] > 1e-9 and "(--replace)" in r.stdout


def test_minutes_budget_is_respected(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    r = _amk("tune", MODEL, "--backend", "sim", "--minutes", "0.02", "--out", str(out), "--db", str(tmp_path / "db"),
             "--json")
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["stop_reason"] == "budget: 0.02 minutes" and s["trials"] >= 1
    # the trial under way when the budget ran out finishes; nothing starts after it
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert all(x["elapsed_s"] - x.get("eval_s", 0) < 0.02 * 60 + 1 for x in rows if x.get("trial") is not None)
    assert wall < 60


def test_bad_input_is_one_line(tmp_path):
    r = _amk("tune", MODEL, "--backend", "sim", "--trials", "0", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "--trials must be >= 1" in r.stderr and "Traceback" not in r.stderr
    r = _amk("tune", MODEL, "--backend", "sim", "--baselines", "eager", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "the sim backend has no baselines" in r.stderr
    (tmp_path / "file").write_text("x")
    r = _amk("tune", MODEL, "--backend", "sim", "--trials", "2", "--out", str(tmp_path / "y"), "--db",
             str(tmp_path / "file"))
    assert r.returncode == 2 and "must be a directory" in r.stderr and not (tmp_path / "y" / "trials.jsonl").exists()
    r = _amk("tune", "--resume", str(tmp_path / "nothing"))
    assert r.returncode == 2 and "not an amk tune directory" in r.stderr
    r = _amk("tune", MODEL, "--trials", "2", "--out", str(tmp_path / "x"), "--json")  # triton, no GPU here
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and json.loads(r.stdout)["ok"] is False


def test_triton_path_keeps_each_incumbent_kernel_and_the_baselines(tmp_path):
    """The triton loop on the CPU (the sim executor and a fixed timer through the worker's
    hooks): kernel knobs are walked, every request carries the incumbent's own kernel knobs,
    equal timings are never kept, the baselines give the ratio stored in the entry."""
    from search.tune import TuneSettings, open_tune

    ev = RecordingEvaluator()
    s = TuneSettings(model=MODEL, out=str(tmp_path / "t"), backend="triton", dtype="f32", trials=8,
                     db=str(tmp_path / "db"), baselines=["eager"], gpu={"name": "Test GPU", "sms": 132},
                     max_workers=528, hbm_bw=3.0e12, timing={"rounds": 2, "steps": 2, "warmup": 0, "min_gain": 0.01},
                     hooks={"executor": "tests.test_search_cheats:sim_executor",
                            "timer": "tests.test_search_cheats:plausible_timer"})
    t = open_tune(s, evaluator=ev)
    assert "gemv_block" in t.space.names
    t.measure_baselines(lambda st: [{"name": "hf_eager", "ms": 500.0, "runs": [500.0, 510.0], "correct": True}])
    summary = t.run()
    assert summary["trials"] == 8 and summary["timing_source"] == "measured"
    first = ev.requests[0]
    assert first["incumbent"] is None and first["incumbent_kernel"] is None
    inc = summary["best"]["config"]
    for req in ev.requests[1:]:
        assert req["incumbent"] == inc["lowering"] and req["incumbent_kernel"] == inc["kernel"]
    assert any(req["kernel"] != inc["kernel"] for req in ev.requests[1:])   # kernel moves were tried
    assert summary["by_status"].get("KEEP") == 1                           # 1000 ms vs 1000 ms: never faster
    assert summary["ratio_vs_fastest_baseline"] == pytest.approx(0.5)
    entry = json.loads(next((tmp_path / "db").glob("*.json")).read_text())
    assert entry["gpu"] == {"name": "Test GPU", "sms": 132} and entry["baseline"] == "hf_eager"
    assert entry["ratio"] == pytest.approx(0.5) and entry["ms"] == pytest.approx(1000.0)
    assert json.loads((tmp_path / "t" / "baselines.json").read_text())["baselines"][0]["ms"] == 500.0
    assert "AMK_TUNE_DB=" in summary["use"] and "amk bench config:tiny-llama --tp 1" in summary["use"]


class ProfilingEvaluator(RecordingEvaluator):
    """Answers the incumbent's profile request with an attention-heavy in-kernel profile."""

    def evaluate(self, request, workdir, timeout_s=None):
        if request.get("profile_only"):
            self.requests.append(request)
            return {"status": "ok", "profile": {"source": "in-kernel profile",
                                                "op_us": {"rope_attention": 80.0, "norm_gemv": 15.0, "embed": 5.0}}}
        return super().evaluate(request, workdir, timeout_s)


def test_the_in_kernel_profile_ranks_the_knobs(tmp_path):
    from search.tune import TuneSettings, open_tune

    ev = ProfilingEvaluator()
    s = TuneSettings(model=MODEL, out=str(tmp_path / "t"), backend="triton", dtype="f32", trials=4,
                     db=str(tmp_path / "db"), gpu={"name": "Test GPU", "sms": 132}, max_workers=528,
                     hbm_bw=3.0e12, timing={"rounds": 2, "steps": 2, "warmup": 0, "min_gain": 0.01},
                     hooks={"executor": "tests.test_search_cheats:sim_executor",
                            "timer": "tests.test_search_cheats:plausible_timer"})
    summary = open_tune(s, evaluator=ev).run()
    assert [r.get("profile_only") for r in ev.requests].count(True) == 1   # once for the incumbent
    assert summary["shares"]["source"] == "in-kernel profile (measured)"
    assert summary["shares"]["families"]["attention"] == pytest.approx(0.8)
    rows = [json.loads(x) for x in (tmp_path / "t" / "trials.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows][:2] == ["warm", "profile"]
    moved = [r["note"].split(":")[0] for r in rows if r.get("kind") == "neighbour"]
    assert moved and set(moved) <= {"attn_split", "attn_kv_split", "late_append", "attention_block"}, moved


@pytest.mark.parametrize("correct", [True, False])
def test_the_entry_records_amk_bench_of_the_best(tmp_path, correct):
    """At the end the best config is measured the way `amk bench` measures (``confirm``); the
    entry records that ms and its ratio to the fastest baseline; an incorrect confirmation is
    not stored and the summary says so (the report and best/config.json are still written)."""
    from search.tune import TuneSettings, open_tune

    seen = []

    def confirm(config):
        seen.append(config)
        return {"ms": 400.0, "roofline_pct": 61.0, "correct": correct, "verdict": "v",
                "command": "amk bench ...", "file": "bench.json"}

    s = TuneSettings(model=MODEL, out=str(tmp_path / "t"), backend="triton", dtype="f32", trials=2,
                     db=str(tmp_path / "db"), baselines=["eager"], gpu={"name": "Test GPU", "sms": 132},
                     max_workers=528, hbm_bw=3.0e12, timing={"rounds": 2, "steps": 2, "warmup": 0, "min_gain": 0.01},
                     hooks={"executor": "tests.test_search_cheats:sim_executor",
                            "timer": "tests.test_search_cheats:plausible_timer"})
    t = open_tune(s, evaluator=RecordingEvaluator())
    t.measure_baselines(lambda st: [{"name": "hf_eager", "ms": 500.0, "runs": [500.0], "correct": True}])
    if correct:
        summary = t.run(confirm=confirm)
        assert seen == [summary["best"]["config"]] and summary["confirmed"]["ms"] == 400.0
        assert summary["ratio_vs_fastest_baseline"] == pytest.approx(1.25)
        entry = json.loads(next((tmp_path / "db").glob("*.json")).read_text())
        assert entry["ms"] == pytest.approx(400.0) and entry["ratio"] == pytest.approx(1.25)
        assert entry["roofline_pct"] == pytest.approx(61.0)
    else:
        summary = t.run(confirm=confirm)
        assert summary["db"] == {"dir": str(tmp_path / "db"), "written": False,
                                 "message": "not stored: the measurement was not correct"}
        assert not list((tmp_path / "db").glob("*.json"))
        assert (tmp_path / "t" / "best" / "config.json").exists()
        assert json.loads((tmp_path / "t" / "report.json").read_text())["confirmed"]["correct"] is False


def test_a_model_with_a_qk_norm_never_gets_late_append():
    """late_append does nothing where attention has a q/k norm (Qwen3): the space does not walk
    it, the screen refuses it, and an entry of another model that holds it (the tuned Llama
    entry did) is adapted with it set back, so `amk bench --config` of the result runs."""
    sp = TuneSpace(_spec("tiny-qwen3"), 1, 132, dtype="f32")
    assert "late_append" not in sp.names
    d = sp.with_value(sp.with_value(sp.default(), "fuse", True), "late_append", True)
    assert sp.screen(d) == ("late_append does nothing for this model: its attention has a q/k norm, "
                            "which the fused attention does not take")
    cand, dropped = sp.adapt({"lowering": {"fuse": True, "late_append": True}, "kernel": {}})
    assert cand["lowering"]["late_append"] is False and cand["lowering"]["fuse"] is True
    assert sp.screen(cand) is None and any(x.startswith("late_append") for x in dropped)
    llama = TuneSpace(_spec("tiny-llama"), 1, 132, dtype="f32")
    assert "late_append" in llama.names and llama.screen(d) is None


def test_the_report_names_the_step_timer():
    """The summary's timing note says what the A/B replayed: CUDA graphs of one megakernel
    step (the worker on a GPU), executor steps, or a mix across a resumed run."""
    from search.tune import _step_timer

    assert _step_timer([{"timing_step": "cuda-graph"}, {}]) == "CUDA-graph replays of one megakernel step"
    assert _step_timer([{"timing_step": "executor"}]) == "one executor step"
    assert _step_timer([]) == "one executor step"
    assert "each trial's timing_step" in _step_timer([{"timing_step": "cuda-graph"}, {"timing_step": "executor"}])
