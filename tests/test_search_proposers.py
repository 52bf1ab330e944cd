"""Proposers: optuna TPE + mutation ranked by the cost model (journal survives a reopen),
replay of a results file, and the LLM proposer over a MOCKED anthropic transport (never the
network): the tool's input schema is the config schema, answers are data checked against
it, malformed answers are skipped, and the API key never reaches a file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ground.errors import AmkError
from search.proposers import (
    TOOL_NAME, LLMProposer, OptunaProposer, ProposalContext, ProposalSkipped,
    RandomProposer, ReplayProposer, mutations, redact,
)
from search.records import Record, ResultsStore
from search.space import Knob, SearchSpace

SECRET = "sk-ant-test-0123456789-SECRET-KEY"


def space() -> SearchSpace:
    return SearchSpace([Knob("tile", (16, 32, 64, 128, 256), 64, True, "rows per tile"),
                        Knob("workers", (1, 2, 4, 8, 16), 4, True, "CTAs per rank"),
                        Knob("policy", ("round_robin", "balanced"), "round_robin")],
                       {"dtype": "f32", "max_seq": 64})


def fake_predict(c) -> float:
    """A deterministic 'cost model': best at tile 128, workers 8, balanced."""
    import math

    return (abs(math.log2(c["tile"] / 128)) + abs(math.log2(c["workers"] / 8))
            + (0.5 if c["policy"] == "round_robin" else 0.0) + 1.0)


def record(sp, trial, config, status="KEEP", lat=None, reason=""):
    lat = fake_predict(config) if lat is None and status in ("KEEP", "REVERT") else lat
    return Record(trial=trial, parent=None, proposer="x", candidate_id=sp.candidate_id(config),
                  config=sp.canonical(config), status=status, reason=reason, latency_ms=lat,
                  timing_source="predicted" if lat is not None else None)


def ctx_for(sp, records, trial=None, incumbent=None, predict=fake_predict):
    keeps = [r for r in records if r.status == "KEEP"]
    return ProposalContext(trial=len(records) if trial is None else trial, space=sp,
                           records=records, incumbent=incumbent or (keeps[-1] if keeps else None),
                           seen={r.candidate_id for r in records}, predict=predict,
                           summary=lambda c: {"tasks": 123, "ops": {"gemv": 100}})


# -- optuna + mutation ---------------------------------------------------------------------
def test_optuna_proposes_unseen_candidates_ranked_by_the_cost_model(tmp_path):
    sp = space()
    p = OptunaProposer(sp, tmp_path / "study.journal", seed=1)
    records = [record(sp, 0, sp.default())]
    for t in range(1, 12):
        ctx = ctx_for(sp, records)
        prop = p.propose(ctx)
        assert prop is not None and sp.candidate_id(prop.config) not in ctx.seen
        assert prop.proposer in ("optuna", "mutation") and prop.predicted_ms is not None
        # the proposal is the best-ranked of its pool: nothing in the pool predicted lower
        assert "ranked 1/" in prop.note
        inc = ctx.incumbent
        status = "KEEP" if fake_predict(prop.config) < inc.latency_ms else "REVERT"
        r = record(sp, t, prop.config, status)
        records.append(r)
        p.observe(prop, r)
    p.close()
    best = min(r.latency_ms for r in records)
    assert best < fake_predict(sp.default())
    from optuna.trial import TrialState

    trials = p.study.get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    done = {t.user_attrs.get("amk_trial") for t in trials}
    assert set(range(1, 12)) <= done


def test_optuna_study_survives_a_kill(tmp_path):
    sp = space()
    j = tmp_path / "study.journal"
    p = OptunaProposer(sp, j, seed=0, n_tpe=1, n_mutations=0)
    records = [record(sp, 0, sp.default())]
    p.sync(records)
    prop = p.propose(ctx_for(sp, records))  # asked, never told: the "kill" happens here
    assert prop.meta.get("optuna_trial") is not None
    from optuna.trial import TrialState

    q = OptunaProposer(sp, j, seed=0)  # reopen: the RUNNING trial is closed as FAIL
    states = [t.state for t in q.study.get_trials()]
    assert TrialState.RUNNING not in states and TrialState.FAIL in states
    # records are the truth: a finished trial the study missed is added once
    r1 = record(sp, 1, prop.config, "REVERT")
    assert q.sync(records + [r1]) == 1 and q.sync(records + [r1]) == 0


def test_mutations_and_random_cover_the_space():
    sp = space()
    inc = record(sp, 0, sp.default())
    ctx = ctx_for(sp, [inc])
    ms = mutations(ctx, 5)
    assert len(ms) == 5 and len({sp.candidate_id(m.config) for m in ms}) == 5
    assert all(m.parent == 0 and m.proposer == "mutation" for m in ms)
    recs = [record(sp, i, c, "REVERT") for i, c in enumerate(sp.all())]
    assert RandomProposer().propose(ctx_for(sp, recs)) is None  # space exhausted


# -- replay --------------------------------------------------------------------------------
def test_replay_reproduces_configs_in_order(tmp_path):
    sp = space()
    st = ResultsStore(tmp_path)
    cfgs = [sp.default(), {**sp.default(), "tile": 128}, {**sp.default(), "tile": 999},
            {**sp.default(), "workers": 8}]
    for i, c in enumerate(cfgs):
        st.append(Record(i, None, "x", f"k-{i}", c, "REVERT", latency_ms=1.0,
                         timing_source="predicted"))
    rp = ReplayProposer(tmp_path)
    seen = [record(sp, 0, sp.default())]
    a = rp.propose(ctx_for(sp, seen))
    assert a.config["tile"] == 128 and a.proposer == "replay"  # trial 0's config was seen
    with pytest.raises(ProposalSkipped, match="tile"):
        rp.propose(ctx_for(sp, seen))
    assert rp.propose(ctx_for(sp, seen)).config["workers"] == 8
    assert rp.propose(ctx_for(sp, seen)) is None
    with pytest.raises(AmkError, match="does not exist"):
        ReplayProposer(tmp_path / "nope")


# -- LLM over a mocked transport -----------------------------------------------------------
class Transport:
    """An httpx2 MockTransport for the anthropic SDK: records requests, replays answers."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.requests = []

    def __call__(self, request):
        import httpx2

        self.requests.append(request)
        content = self.answers.pop(0)
        if isinstance(content, int):
            return httpx2.Response(content, json={"type": "error", "error": {
                "type": "api_error", "message": "boom"}})
        return httpx2.Response(200, json={
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": content, "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1}})

    def client(self):
        import anthropic
        import httpx2

        return anthropic.Anthropic(api_key=SECRET, max_retries=0,
                                   http_client=httpx2.Client(transport=httpx2.MockTransport(self)))


def tool_use(inp, name=TOOL_NAME):
    return {"type": "tool_use", "id": "toolu_1", "name": name, "input": inp}


def test_llm_request_carries_schema_and_context_and_answer_is_data(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    sp = space()
    tr = Transport([[{"type": "text", "text": "bigger tiles stream better"},
                     tool_use({"tile": 128, "workers": 8, "policy": "balanced"})]])
    llm = LLMProposer(sp, tr.client(), model="claude-test", docs="IR DOCS: put, signal, wait")
    recs = [record(sp, 0, sp.default()),
            record(sp, 1, {**sp.default(), "tile": 16}, "REJECTED",
                   reason="validator: UnorderedWrites"),
            record(sp, 2, {**sp.default(), "workers": 16}, "FAIL",
                   reason="correctness: logit error 3.1")]
    prop = llm.propose(ctx_for(sp, recs))
    assert prop.config == {"tile": 128, "workers": 8, "policy": "balanced"}
    assert prop.proposer == "llm" and prop.parent == 0 and "bigger tiles" in prop.note
    body = json.loads(tr.requests[0].content)
    assert body["model"] == "claude-test"
    assert body["tools"] == [{"name": TOOL_NAME, "description": llm.tool()["description"],
                              "input_schema": sp.json_schema()}]
    prompt = body["messages"][0]["content"]
    for needle in ("IR DOCS: put, signal, wait", "schedule summary", "REJECTED",
                   "validator: UnorderedWrites", "correctness: logit error 3.1",
                   "Why recent candidates failed", "status", "tile: one of [16, 32, 64, 128, 256]"):
        assert needle in prompt, needle
    assert SECRET not in prompt


@pytest.mark.parametrize("content,msg", [
    ([{"type": "text", "text": "I think tile 128"}], "expected one propose_config call"),
    ([tool_use({"tile": 100, "workers": 8, "policy": "balanced"})], "not one of"),
    ([tool_use({"tile": 128, "workers": 8})], "missing knobs"),
    ([tool_use({"tile": 128, "workers": 8, "policy": "balanced", "code": "import os"})],
     "unknown knob"),
    ([tool_use({"tile": 128, "workers": 8, "policy": "balanced"}, name="run_python")],
     "expected one propose_config call"),
    ([tool_use({"tile": 64, "workers": 4, "policy": "round_robin"})], "already evaluated"),
    (500, "LLM request failed"),
])
def test_malformed_llm_answers_are_skipped(monkeypatch, content, msg):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    sp = space()
    llm = LLMProposer(sp, Transport([content]).client(), docs="d")
    with pytest.raises(ProposalSkipped, match=msg) as ei:
        llm.propose(ctx_for(sp, [record(sp, 0, sp.default())]))
    assert SECRET not in ei.value.reason and SECRET not in ei.value.raw


def test_llm_needs_a_key(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(AmkError, match="ANTHROPIC_API_KEY"):
        LLMProposer(space())


def test_redact(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    assert redact(f"auth {SECRET} failed") == "auth [redacted] failed"


def test_llm_search_never_writes_the_key(monkeypatch, tmp_path):
    """A whole (short) search with the LLM proposer, including a malformed answer and a
    failing request that echoes the key: the key appears in no file of the search."""
    from search.loop import SearchSettings, open_search
    from tests.test_search_cheats import InProcessEvaluator

    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    s = SearchSettings(model="config:tiny-llama", out=str(tmp_path / "s"), tp=2, trials=3,
                       proposer="llm")
    from models.graph import spec_from_config
    from models.recipes import build_config
    from search.space import space_for

    real = space_for(spec_from_config(build_config("tiny-llama")), 2, 132)
    good = [dict(real.default(), tile=t) for t in (32, 128)]

    class Leaky(Transport):
        def __call__(self, request):
            if len(self.requests) == 1:  # an error message quoting the key
                import httpx2

                self.requests.append(request)
                return httpx2.Response(400, json={"type": "error", "error": {
                    "type": "invalid_request_error", "message": f"bad key {SECRET}"}})
            return super().__call__(request)

    tr = Leaky([[{"type": "text", "text": "no tool"}],
                [tool_use(good[0])], [tool_use(good[1])]])
    search = open_search(s, evaluator=InProcessEvaluator(), llm_client=tr.client())
    result = search.run()
    # trial 1: a malformed answer, then a failed request -> a mutation in its place
    assert [r.proposer for r in result.records] == ["baseline", "mutation", "llm"]
    assert "LLM request failed" in result.records[1].extra["fallback"]
    assert "[redacted]" in result.records[1].extra["fallback"]
    assert json.loads((tmp_path / "s" / "summary.json").read_text())["fallbacks"] == 1
    log = (tmp_path / "s" / "proposer.log").read_text()
    assert log.count('"skipped"') == 2 and log.count('"fallback"') == 1
    assert "[redacted]" in log
    for f in Path(tmp_path / "s").rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_missing_optuna_is_one_line(tmp_path):
    """A machine without optuna (a bare GPU image) gets one line naming the package, exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "optuna.py").write_text("raise ImportError('No module named optuna')\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{shadow}{os.pathsep}{root}")
    r = subprocess.run([sys.executable, "-m", "amk", "search", "config:tiny-llama", "--trials", "1",
                        "--out", str(tmp_path / "s")], cwd=root, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert lines and "--proposer optuna needs the optuna package" in lines[0]
    assert "Traceback" not in r.stderr
