"""`amk search --edits`: edit lists against the lowered start config, the offline edit proposer,
validator rejections that never reach a backend, resume, and best/edits.json through `amk edit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from search.edit_proposer import EditProposer, edit_key
from search.loop import SearchSettings, open_search
from search.proposers import Proposal
from search.records import Record, read_json
from tests.test_search_cheats import InProcessEvaluator

ROOT = Path(__file__).resolve().parent.parent
MODEL = "config:tiny-llama"

# -- test hooks (the worker imports them by dotted name) ------------------------------------
FACTORY_CALLS: list[tuple[str, int]] = []


def counting_factory(backend, kernel=None):
    """The default executor factory, counting its calls (one per evaluated candidate that
    reaches the correctness gate)."""
    from search.worker import default_executor_factory

    FACTORY_CALLS.append((backend, len(FACTORY_CALLS)))
    return default_executor_factory(backend, kernel)


def _unsafe_drop_wait(prog) -> dict:
    """A drop_wait a naive agent would make (its program is rejected by the validator)."""
    from amk.editing import edit_program

    for t in prog.tasks:
        for w in t.waits:
            if w.offset == 0 and w.threshold > 0:
                e = {"op": "drop_wait", "task": t.id, "counter": w.counter}
                if not edit_program(prog, [e])[1].ok:
                    return e
    raise AssertionError("no unsafe drop_wait found")


class PlantedProposer:
    """Trial 1: an unsafe edit (a dropped wait); then nothing."""

    name = "edits"

    def __init__(self, base):
        self.base = base
        self.planted = None

    def propose(self, ctx):
        if ctx.trial != 1:
            return None
        self.planted = _unsafe_drop_wait(self.base())
        return Proposal(dict(ctx.incumbent.config), "edits", ctx.incumbent.trial, "planted",
                        meta={"edits": [self.planted]})

    def observe(self, proposal, record):
        pass

    def close(self):
        pass


def _amk(*args, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("ANTHROPIC_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "amk", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_edit_search_offline_and_best_replays_through_amk_edit(tmp_path):
    out = tmp_path / "s"
    r = _amk("search", MODEL, "--tp", "2", "--backend", "sim", "--trials", "5", "--edits",
             "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["proposer"] == "edits"
    log = summary["edits"]
    assert log["proposed"] == 4 and log["kept"] + log["reverted"] >= 1
    assert log["proposed"] == (log["kept"] + log["reverted"] + log["rejected"] + log["failed_gate"]
                               + log["failed_other"] + log["timeout"])
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert recs[0]["extra"]["edits"] == []
    assert all(x["proposer"] == "edits" and x["extra"]["edits"] for x in recs[1:])
    assert len({x["config"]["tile"] for x in recs}) == 1  # one base config, edits only
    best = read_json(out / "best" / "trial.json")
    edits = read_json(out / "best" / "edits.json")
    assert isinstance(edits, list) and best["edits"] == len(edits)
    assert "amk edit" in summary["replay_best"] and "edits" in r.stderr
    # the base schedule plus best/edits.json through `amk edit` is the best schedule
    new = tmp_path / "new.json"
    e = _amk("edit", str(out / "base" / "schedule.json"), str(out / "best" / "edits.json"),
             "--out", str(new))
    assert e.returncode == 0 and "accepted" in e.stdout, e.stdout + e.stderr
    from ir.io import load_program
    from search.space import program_fingerprint

    assert program_fingerprint(load_program(new)) == \
        program_fingerprint(load_program(out / "best" / "schedule.json"))
    assert best["same_schedule_as_evaluated"] is True


def test_planted_unsafe_edit_is_rejected_and_never_reaches_a_backend(tmp_path):
    FACTORY_CALLS.clear()
    s = SearchSettings(model=MODEL, out=str(tmp_path / "s"), tp=2, trials=3, proposer="edits",
                       hooks={"executor_factory": "tests.test_search_edits:counting_factory"})
    search = open_search(s, evaluator=InProcessEvaluator())
    planted = PlantedProposer(search.base_program)
    search.proposer = planted
    calls = []
    result = search.run(on_trial=lambda rec, _: calls.append(len(FACTORY_CALLS)))
    recs = result.records
    assert [r.status for r in recs] == ["KEEP", "REJECTED"]
    assert calls == [1, 1]  # trial 0 reached the backend, the unsafe edit never did
    rej = recs[1]
    assert rej.extra["stage"] == "validate" and rej.extra["edits"] == [planted.planted]
    assert rej.reason.startswith("validator: ") and rej.latency_ms is None
    classes = rej.extra["verdict"]["classes"]
    assert classes and set(rej.extra["verdict"]["witnesses"]) == set(classes)
    log = read_json(tmp_path / "s" / "summary.json")["edits"]
    assert log["proposed"] == 1 and log["rejected"] == 1 and log["kept"] == 0
    for c in classes:
        assert log["rejected_by_class"][c]["edit"] == planted.planted
        assert log["rejected_by_class"][c]["witness"]["tasks"]
    # the offline proposer reads the rejection back and never proposes that edit again
    ep = EditProposer(search.base_program, s.seq_len)
    ctx = search._context(2)
    first = ep.propose(ctx)
    assert first is not None
    fake = Record(2, 0, "edits", "x", dict(recs[0].config), "REJECTED", reason="validator: X",
                  extra={"edits": first.meta["edits"], "stage": "validate",
                         "verdict": {"classes": ["X"], "witnesses": {}}})
    ctx.records = recs + [fake]
    again = ep.propose(ctx)
    assert again is not None and edit_key(again.meta["edits"][-1]) != \
        edit_key(first.meta["edits"][-1])


def test_resume_keeps_the_edit_lists(tmp_path):
    out = tmp_path / "s"
    s = SearchSettings(model=MODEL, out=str(out), tp=2, trials=3, proposer="edits")
    open_search(s, evaluator=InProcessEvaluator()).run()
    before = (out / "results.jsonl").read_text()
    with open(out / "results.jsonl", "a") as f:  # a kill in the middle of an append
        f.write('{"trial": 3, "torn')
    b = open_search(resume=str(out), overrides={"trials": 5},
                    evaluator=InProcessEvaluator()).run()
    after = (out / "results.jsonl").read_text()
    assert after.startswith(before)
    recs = b.records
    assert [r.trial for r in recs] == list(range(len(recs))) and len(recs) >= 4
    assert all(isinstance(r.extra.get("edits"), list) for r in recs)
    for r in recs[1:]:  # each list extends its parent's list by one edit
        parent = recs[r.parent]
        assert r.extra["edits"][:-1] == parent.extra["edits"]
    assert len({r.candidate_id for r in recs}) == len(recs)


def test_edits_flag_conflicts_with_another_proposer(tmp_path):
    r = _amk("search", MODEL, "--edits", "--proposer", "optuna", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == \
        "error: --edits proposes schedule edits offline (--proposer edits) or with --proposer " \
        "llm, not with --proposer optuna"


def test_llm_proposes_edits_with_summary_and_witnesses(tmp_path, monkeypatch):
    from search.edit_proposer import EDIT_TOOL
    from tests.test_search_proposers import SECRET, Transport, tool_use

    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    s = SearchSettings(model=MODEL, out=str(tmp_path / "s"), tp=2, trials=4, proposer="llm",
                       edits=True)
    probe = open_search(SearchSettings(model=MODEL, out=str(tmp_path / "p"), tp=2, trials=1,
                                       proposer="edits"), evaluator=InProcessEvaluator())
    unsafe = _unsafe_drop_wait(probe.base_program())
    good = {"op": "replace", "stage": "lm.k0", "policy": "balanced"}
    tr = Transport([
        [tool_use({"edits": [{"op": "bogus"}]}, name=EDIT_TOOL)],      # trial 1: malformed
        [tool_use({"edits": [good], "why": "balance lm.k0"}, name=EDIT_TOOL)],
        [tool_use({"edits": [unsafe]}, name=EDIT_TOOL)],               # trial 2: rejected
        [tool_use({"edits": [unsafe]}, name=EDIT_TOOL)],               # trial 3: a repeat
        [tool_use({"edits": [{"op": "replace", "stage": "lm.argmax.k0",
                              "policy": "round_robin"}]}, name=EDIT_TOOL)]])
    search = open_search(s, evaluator=InProcessEvaluator(), llm_client=tr.client())
    recs = search.run().records
    assert [r.proposer for r in recs] == ["baseline", "llm", "llm", "llm"]
    assert recs[1].extra["edits"] == [good] and recs[1].status in ("KEEP", "REVERT")
    assert recs[2].status == "REJECTED" and recs[2].extra["stage"] == "validate"
    inc = recs[1].extra["edits"] if recs[1].status == "KEEP" else []
    assert recs[2].extra["edits"] == inc + [unsafe]
    assert recs[3].extra["edits"][-1]["stage"] == "lm.argmax.k0"
    log = (tmp_path / "s" / "proposer.log").read_text()
    assert "unknown op" in log and "the validator rejected in trial 2" in log
    # the prompt of trial 3 carries the schedule summary and the rejected edit's witness
    body = json.loads(tr.requests[3].content)
    text = body["messages"][0]["content"]
    assert "critical path:" in text and "idle per worker" in text
    cls = recs[2].extra["verdict"]["classes"][0]
    assert cls in text and '"witness"' in text and unsafe["task"] in text
    assert body["tools"][0]["name"] == EDIT_TOOL


def test_edit_search_starts_from_a_config_off_the_knob_grid(tmp_path):
    """An edit search never moves a knob, so its start (a tuned entry's config: 3 workers, a
    gate/up tile of 24) need not be a grid point of the knob search; a knob search from the
    same file is still refused with the knob named."""
    cfg = tmp_path / "tuned.json"
    cfg.write_text(json.dumps({"lowering": {"workers": 3, "tile_gate_up": 24, "fuse": True}}))
    out = tmp_path / "s"
    r = _amk("search", MODEL, "--backend", "sim", "--trials", "2", "--edits", "--config", str(cfg),
             "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert recs[0]["config"]["workers"] == 3 and recs[0]["config"]["tile_gate_up"] == 24
    k = _amk("search", MODEL, "--backend", "sim", "--trials", "2", "--config", str(cfg),
             "--out", str(tmp_path / "k"))
    assert k.returncode == 2 and "not a point of the search space" in k.stderr and "'workers'" in k.stderr


def test_pool_is_interleaved_by_kind_and_the_scoring_budget_is_honoured():
    """A proposal over a large schedule has a scoring budget: with none left it proposes the
    first candidate that beats the incumbent, having looked at every kind in turn."""
    from search.edit_proposer import interleave_kinds

    pool = [{"op": "move", "n": 1}, {"op": "move", "n": 2}, {"op": "split", "n": 3},
            {"op": "replace", "n": 4}, {"op": "split", "n": 5}]
    assert [e["n"] for e in interleave_kinds(pool)] == [1, 3, 4, 2, 5]

    class Counting(EditProposer):
        scored = 0

        def score(self, prog, tl=None):
            Counting.scored += 1
            return super().score(prog, tl)

    from lowering.lower import lower
    from models.graph import build_graph, spec_from_config
    from models.recipes import build_config
    from ir.program import Target

    spec = spec_from_config(build_config("tiny-llama"))
    prog = lower(build_graph(spec), ranks=1, target=Target(name="t", sms=8, max_workers=8, backend="sim"))
    everything = Counting(lambda: prog, 128, budget_s=1e9)
    rec = Record(trial=0, parent=None, proposer="baseline", candidate_id="k", config={}, status="KEEP",
                 extra={"edits": []})
    from search.proposers import ProposalContext
    ctx = ProposalContext(trial=1, incumbent=rec, records=[rec], space=None, seen=set(), predict=None)
    assert everything.propose(ctx) is not None
    full = Counting.scored
    Counting.scored = 0
    hurried = Counting(lambda: prog, 128, budget_s=0.0)
    p = hurried.propose(ctx)
    assert p is not None and Counting.scored < full and "scored candidates" in p.note


# -- a measured profile ranks the offline edit proposer (--profile TRACE) -----------------------
def _tiny_base():
    from ir.program import Target
    from lowering.lower import lower
    from models.graph import build_graph, spec_from_config
    from models.recipes import build_config

    spec = spec_from_config(build_config("tiny-llama"))
    return lower(build_graph(spec), ranks=1, target=Target(name="t", sms=8, max_workers=8, backend="sim"))


def test_a_slow_worker_in_the_measured_profile_reranks_the_edits():
    """Durations that make one worker's tasks 10x slower than the cost model says change the
    pool and the chosen edit, which then touches a task of that worker; without durations
    the proposer ranks by the cost model as before."""
    from ir.edits import stage_of
    from lowering.views import model_durations, timeline
    from search.proposers import ProposalContext

    prog = _tiny_base()
    rec = Record(trial=0, parent=None, proposer="baseline", candidate_id="k", config={}, status="KEEP",
                 extra={"edits": []})
    ctx = ProposalContext(trial=1, incumbent=rec, records=[rec], space=None, seen=set(), predict=None)
    by_model = EditProposer(lambda: prog, 128)
    p0 = by_model.propose(ctx)
    assert p0 is not None and "ranked by the cost model" in p0.note
    e0 = p0.meta["edits"][-1]
    worker = {t.id: t.worker for t in prog.tasks}
    model = model_durations(prog, 128)
    assert timeline(prog, 128, durations=model).end == timeline(prog, 128).end

    def touches(e, w):
        if e["op"] in ("move", "split", "refine_wait"):
            return worker[e["task"]] == w
        if e["op"] == "merge":
            return w in (worker[e["a"]], worker[e["b"]])
        return any(t.worker == w for t in prog.tasks if stage_of(t.id) == e["stage"])

    tried = 0
    for w in range(prog.workers):
        if touches(e0, w):
            continue
        tried += 1
        slow = {t.id: model[t.id] * (10 if t.worker == w else 1) for t in prog.tasks}
        ep = EditProposer(lambda: prog, 128, durations=slow)
        assert ep.timeline(prog).makespan > 2 * timeline(prog, 128).makespan
        assert ep.candidates(prog) != by_model.candidates(prog)
        p = ep.propose(ctx)
        assert p is not None and f"ranked by the measured profile ({len(prog.tasks)} tasks)" in p.note
        e = p.meta["edits"][-1]
        assert edit_key(e) != edit_key(e0) and touches(e, w), (w, e)
    assert tried >= 2


def test_new_tasks_of_an_edit_take_the_model_scaled_by_their_stage():
    """A split tile has no measured duration: its halves take the cost model's time scaled
    by the measured / predicted ratio of its stage; untouched tasks keep theirs."""
    from ir.edits import GEMV_FAMILY, stage_of
    from lowering.views import model_durations

    prog = _tiny_base()
    model = model_durations(prog, 128)
    tile = next(t for t in prog.tasks if t.op in GEMV_FAMILY)
    measured = {t.id: model[t.id] * (3 if stage_of(t.id) == stage_of(tile.id) else 1) for t in prog.tasks}
    ep = EditProposer(lambda: prog, 128, durations=measured)
    split = ep._apply(prog, [{"op": "split", "task": tile.id}])
    d = ep.durations_for(split)
    new_model = model_durations(split, 128)
    halves = [t.id for t in split.tasks if t.id not in measured]
    assert len(halves) == 2
    for h in halves:
        assert abs(d[h] - 3 * new_model[h]) < 1e-15
    other = next(t.id for t in prog.tasks if stage_of(t.id) != stage_of(tile.id))
    assert d[other] == measured[other]


def test_profile_flag_refusals(tmp_path):
    """--profile without --edits, an unreadable trace, one without task slices and one whose
    task ids are not the base schedule's: one line each, exit 2, no search directory."""
    r = _amk("search", MODEL, "--backend", "sim", "--profile", str(tmp_path / "t.json"),
             "--out", str(tmp_path / "a"))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: --profile TRACE ranks the offline edit proposer's candidates by measured task "
        "durations: it needs --edits"]
    r = _amk("search", MODEL, "--backend", "sim", "--edits", "--profile", str(tmp_path / "none.json.gz"),
             "--out", str(tmp_path / "b"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "none.json.gz" in lines[0], r.stderr
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}}]
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": meta}))
    r = _amk("search", MODEL, "--backend", "sim", "--edits", "--profile", str(empty),
             "--out", str(tmp_path / "c"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "holds no task slices" in lines[0], r.stderr
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"traceEvents": meta + [
        {"name": "l0.q.t0.r0", "cat": "gemv", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 2.0,
         "args": {"op": "gemv"}}]}))
    r = _amk("search", MODEL, "--backend", "sim", "--edits", "--profile", str(other),
             "--out", str(tmp_path / "d"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "only 1 of the base schedule's 72 task ids are in the trace (1 task slices)" in lines[0]
    assert not any((tmp_path / x).exists() for x in "abcd")


def test_edit_search_ranked_by_a_profile_of_amk_profile(tmp_path):
    """`amk profile --trace X.json.gz` of the start config, then `amk search --edits --profile
    X.json.gz`: every task id of the base schedule is in the trace, the proposals say they
    were ranked by the measured profile, and a resume keeps the profile."""
    from ir.io import load_program
    from lowering.trace import read_trace, task_durations

    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"lowering": {"workers": 4, "dtype": "f32"}}))
    trace = tmp_path / "t.json.gz"
    r = _amk("profile", MODEL, "--config", str(cfg), "--trace", str(trace))
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "s"
    r = _amk("search", MODEL, "--backend", "sim", "--edits", "--config", str(cfg), "--profile", str(trace),
             "--trials", "3", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    base = load_program(out / "base" / "schedule.json")
    d = task_durations(read_trace(str(trace)))
    assert set(d) == {t.id for t in base.tasks} and all(v > 0 for v in d.values())
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 3 and all(x["proposer"] == "edits" for x in recs[1:])
    assert all(f"ranked by the measured profile ({len(base.tasks)} tasks)" in x["description"]
               for x in recs[1:])
    assert read_json(out / "state.json")["settings"]["profile"] == str(trace.resolve())
    r = _amk("search", "--resume", str(out), "--profile", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "profile" in r.stderr.strip().splitlines()[-1], r.stderr
