"""The search loop: verdict on every row, stopping rules, checkpoints, and the CLI killed
with SIGKILL then resumed without losing a finished trial."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ground.errors import AmkError
from ir.io import load_program
from search.loop import LoopState, SearchSettings, open_search, replay_state
from search.records import STATUSES, Record, read_json, read_tsv
from tests.test_search_cheats import InProcessEvaluator

ROOT = Path(__file__).resolve().parent.parent
MODEL = "config:tiny-llama"


def _rec(trial, status, lat=None, restart=False, pct=None):
    r = Record(trial, None, "x", f"k-{trial}", {}, status, latency_ms=lat,
               timing_source="predicted" if lat is not None else None, pct_roofline=pct)
    if restart:
        r.extra["restart"] = True
    return r


def test_plateau_restarts_once_then_stops():
    s = SearchSettings(model="m", out="o", plateau=3)
    st = LoopState()
    for r in [_rec(0, "KEEP", 2.0), _rec(1, "REVERT", 3.0), _rec(2, "FAIL"),
              _rec(3, "REVERT", 2.5)]:
        st.apply(r, s)
    assert st.restart_pending and st.restarts == 1 and st.stop_reason is None
    st.apply(_rec(4, "FAIL", restart=True), s)      # a restart point that failed
    assert st.restart_pending
    st.apply(_rec(5, "KEEP", 2.4, restart=True), s)  # the restart point becomes incumbent
    assert not st.restart_pending and st.incumbent.trial == 5 and st.best.trial == 0
    for t in (6, 7, 8):
        st.apply(_rec(t, "REVERT", 2.6), s)
    assert st.stop_reason and "plateau" in st.stop_reason
    # the same records replayed give the same state (resume)
    recs = [_rec(0, "KEEP", 2.0), _rec(1, "REVERT", 3.0)]
    a = replay_state(recs, s)
    assert a.incumbent.trial == 0 and a.plateau == 1


def test_target_pct_stops():
    s = SearchSettings(model="m", out="o", target_pct=50)
    st = LoopState()
    st.apply(_rec(0, "KEEP", 2.0, pct=40.0), s)
    assert st.stop_reason is None
    st.apply(_rec(1, "KEEP", 1.0, pct=80.0), s)
    assert "roofline" in st.stop_reason


@pytest.mark.parametrize("bad,msg", [
    (dict(tp=0), "--tp"), (dict(backend="cuda"), "--backend"),
    (dict(proposer="replay"), "--replay"), (dict(trials=None, minutes=None), "budget"),
    (dict(positions=[0, 300]), "--max-seq"), (dict(seq_len=0), "--seq-len"),
    (dict(target_pct=120), "--target-pct"),
])
def test_settings_are_checked(bad, msg):
    with pytest.raises(AmkError, match=msg):
        SearchSettings(model="m", out="o", **bad).check()


def test_search_in_process_records_everything(tmp_path):
    out = tmp_path / "s"
    s = SearchSettings(model=MODEL, out=str(out), tp=2, trials=6, seed=3)
    ev = InProcessEvaluator()
    search = open_search(s, evaluator=ev)
    result = search.run()
    recs = result.records
    assert [r.trial for r in recs] == list(range(6))
    assert recs[0].proposer == "baseline" and recs[0].config == search.space.default()
    rows = read_tsv(out / "results.tsv")
    assert len(rows) == 6 and all(r["status"] in STATUSES for r in rows)
    for r in recs:
        if r.latency_ms is not None:  # no latency without its verdict and its source
            assert r.status in ("KEEP", "REVERT") and r.timing_source == "predicted"
            assert r.correctness["passed"] and r.pct_roofline > 0
    # fresh inputs: every trial got its own prompt and interleaving seed
    assert len({q["prompt_seed"] for q in ev.requests}) == 6
    assert len({q["sim_seed"] for q in ev.requests}) == 6
    assert len({r.candidate_id for r in recs}) == 6  # never the same candidate twice
    st = read_json(out / "state.json")
    assert st["finished"] and st["trials_done"] == 6 and "budget" in st["stop_reason"]
    summary = read_json(out / "summary.json")
    assert summary["timing_source"] == "predicted" and summary["trials"] == 6
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
    if result.state.incumbent is not None:
        from lowering.config import KernelConfig, LoweringConfig
        from lowering.knobs import without_inert

        whole = read_json(out / "incumbent" / "config.json")
        cfg = whole["lowering"]
        inc = read_json(out / "incumbent" / "trial.json")
        assert inc["trial"] == result.state.incumbent.trial and inc["lowering_config"] == cfg
        # the candidate's knobs, those that do nothing at its others set back (the same program)
        cand = LoweringConfig(**search.space.lowering_config(result.state.incumbent.config))
        assert cfg == without_inert(cand, 2).to_json() and whole["kernel"] == KernelConfig().to_json()
        prog = load_program(out / "incumbent" / "schedule.json")
        assert prog.ranks == 2 and prog.workers == cfg["workers"]
        assert inc["same_schedule_as_evaluated"] is True
        assert load_program(out / "incumbent" / "schedule.amk").tasks


def test_replay_proposer_reproduces_a_search(tmp_path):
    first = tmp_path / "a"
    s = SearchSettings(model=MODEL, out=str(first), tp=2, trials=4, seed=5)
    a = open_search(s, evaluator=InProcessEvaluator()).run()
    r = SearchSettings(model=MODEL, out=str(tmp_path / "b"), tp=2, trials=10,
                       proposer="replay", replay=str(first))
    b = open_search(r, evaluator=InProcessEvaluator()).run()
    # trial 0 is the default in both; then the replayed configs in order, then it stops
    assert [x.candidate_id for x in b.records] == [x.candidate_id for x in a.records]
    assert [x.proposer for x in b.records[1:]] == ["replay"] * 3
    assert "nothing left" in b.stop_reason


def test_minutes_budget_and_dir_rules(tmp_path):
    out = tmp_path / "s"
    s = SearchSettings(model=MODEL, out=str(out), tp=2, trials=None, minutes=1e-9)
    r = open_search(s, evaluator=InProcessEvaluator()).run()
    assert r.records == [] and "minutes" in r.stop_reason  # spent before the first trial
    s.minutes = 10
    s.trials = 1
    import shutil

    shutil.rmtree(out)
    r = open_search(s, evaluator=InProcessEvaluator()).run()
    assert len(r.records) == 1 and "1 trials" in r.stop_reason
    with pytest.raises(AmkError, match="already holds a search"):
        open_search(s, evaluator=InProcessEvaluator())
    with pytest.raises(AmkError, match="tp was 2"):
        open_search(resume=str(out), overrides={"tp": 3}, evaluator=InProcessEvaluator())
    with pytest.raises(AmkError, match="no state.json"):
        open_search(resume=str(tmp_path / "nothing"))
    more = open_search(resume=str(out), overrides={"trials": 3, "minutes": 10},
                       evaluator=InProcessEvaluator())
    r = more.run()
    assert [x.trial for x in r.records] == [0, 1, 2]


# -- the CLI, killed and resumed -----------------------------------------------------------
def _amk(*args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ANTHROPIC_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "amk", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=kw.get("timeout", 300))


def _lines(p: Path) -> int:
    try:
        return p.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_cli_sigkill_then_resume_loses_nothing(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ANTHROPIC_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "amk", "search", MODEL, "--tp", "2", "--backend", "sim",
         "--trials", "14", "--out", str(out), "--quiet"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    jsonl = out / "results.jsonl"
    deadline = time.time() + 240
    while _lines(jsonl) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the search ended before it could be killed: " + \
        proc.stderr.read().decode()[-2000:]
    os.kill(proc.pid, signal.SIGKILL)  # the search process only: its worker is orphaned
    proc.wait()
    before = jsonl.read_bytes()
    before = before[: before.rfind(b"\n") + 1]  # a kill mid-append leaves a torn line
    done = [json.loads(x) for x in before.decode().splitlines() if x.strip()]
    assert len(done) >= 2
    # the orphaned worker notices the closed pipe and exits on its own
    pid = done[-1]["extra"].get("worker_pid")
    if pid:
        end = time.time() + 60
        while time.time() < end and os.path.exists(f"/proc/{pid}") and \
                "State:\tZ" not in open(f"/proc/{pid}/status").read():
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}") or \
            "State:\tZ" in open(f"/proc/{pid}/status").read()
    r = _amk("search", "--resume", str(out), "--quiet")
    assert r.returncode in (0, 1), r.stderr
    after = jsonl.read_bytes()
    assert after.startswith(before)
    recs = [json.loads(x) for x in after.decode().splitlines()]
    assert [x["trial"] for x in recs] == list(range(14))
    for old, new in zip(done, recs):
        assert old == new  # finished trials are kept as they were
    rows = read_tsv(out / "results.tsv")
    assert [int(x["trial"]) for x in rows] == list(range(14))
    assert all(x["status"] in STATUSES for x in rows)
    st = read_json(out / "state.json")
    assert st["finished"] and st["trials_done"] == 14
    assert (out / "latency.png").exists() and (out / "summary.json").exists()


def test_cli_errors_are_one_line(tmp_path):
    r = _amk("search")
    assert r.returncode == 2 and "MODEL" in r.stderr and "Traceback" not in r.stderr
    r = _amk("search", MODEL, "--proposer", "llm", "--trials", "2", "--out", str(tmp_path / "l"))
    assert r.returncode == 2 and "ANTHROPIC_API_KEY" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "l").exists()
    import torch

    if not torch.cuda.is_available():
        r = _amk("search", MODEL, "--backend", "triton", "--out", str(tmp_path / "t"))
        assert r.returncode == 2 and "CUDA" in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "t").exists()
    r = _amk("search", "--resume", "/nonexistent/dir")
    assert r.returncode == 2 and "no state.json" in r.stderr
    r = _amk("search", "no-such-model", "--trials", "1", "--out", str(tmp_path / "n"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
