"""`amk tune --proposer llm` over a MOCKED anthropic transport (never the network) and over an
unreachable endpoint: the prompt holds the shares of the step, the trials and the nearest
database entries; a knob change from the answer is evaluated; unusable candidates and a
malformed answer are counted, never a crash; failed requests stop the run with one line after
--llm-max-failures, or fall back to the local moves with --llm-fallback; the API key is in no
file of the run and in no output.

The runs use ``config:tiny-llama`` on the sim backend with a handful of trials."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ground.errors import AmkError
from search.proposers import ProposerUnavailable
from search.tuneproposer import TUNE_TOOL
from tests.test_search_cli import _closed_port
from tests.test_search_proposers import Transport

ROOT = Path(__file__).resolve().parent.parent
MODEL = "config:tiny-llama"
SECRET = "sk-ant-test-0123456789-TUNE-SECRET"


@pytest.fixture(autouse=True)
def no_shipped_entries(monkeypatch):
    """An empty database apart from what a test plants (no shipped entries)."""
    monkeypatch.setenv("AMK_TUNE_SHIPPED", "")
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)


class LiveTransport(Transport):
    """A Transport whose answers may be functions of nothing, called when the request comes
    (so an answer can name the incumbent of the moment)."""

    def __call__(self, request):
        if self.answers and callable(self.answers[0]):
            self.answers[0] = self.answers[0]()
        return super().__call__(request)


def answer(candidates, name=TUNE_TOOL):
    return [{"type": "text", "text": "the weight stream dominates"},
            {"type": "tool_use", "id": "toolu_1", "name": name, "input": {"candidates": candidates}}]


def _planted_entry(db: Path, ms: float = 7.25) -> None:
    from lowering.config import AmkConfig
    from models.graph import spec_from_config
    from models.recipes import build_config
    from search.tune import SIM_GPU
    from search.tunedb import Entry, GpuKey, ShapeKey, TuneDB, kernel_fingerprint

    cfg = AmkConfig().to_json()
    cfg["lowering"]["tile"] = 128
    e = Entry(shape=ShapeKey.from_spec(spec_from_config(build_config("tiny-llama")), "f32"),
              gpu=GpuKey(SIM_GPU, 132), tp=1, fingerprint=kernel_fingerprint(), config=cfg, ms=ms,
              baseline_ms=None, baseline=None, ratio=None, roofline_pct=None, correct=True,
              date="2026-01-01", command="planted", commit=None)
    assert TuneDB(db).put(e)[0]


def _tuner(tmp_path, transport, trials, **kw):
    from search.tune import TuneSettings, open_tune
    from tests.test_tune import RecordingEvaluator

    s = TuneSettings(model=MODEL, out=str(tmp_path / "t"), backend="sim", dtype="f32", trials=trials,
                     db=str(tmp_path / "db"), proposer="llm", **kw)
    return open_tune(s, evaluator=RecordingEvaluator(), llm_client=transport.client())


def _rows(tmp_path):
    return [json.loads(x) for x in (tmp_path / "t" / "trials.jsonl").read_text().splitlines()]


def _no_key_anywhere(d: Path, *texts: str) -> None:
    for t in texts:
        assert SECRET not in t
    for f in d.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_prompt_holds_shares_trials_and_nearest_and_a_knob_change_is_evaluated(tmp_path):
    _planted_entry(tmp_path / "db")
    box = {}

    def first():
        inc = box["t"].incumbent.config
        tile = box["t"].space.values_around("tile", inc["lowering"]["tile"])[0]
        box["tile"] = tile
        return answer([{"changes": {"tile": tile}, "why": "fewer tasks"},
                       {"changes": {"no_such_knob": 1}},
                       {"changes": {"workers": 3}},
                       {"changes": {"dtype": "bf16"}}])
    tr = LiveTransport([first])
    t = box["t"] = _tuner(tmp_path, tr, trials=3)
    summary = t.run()
    assert len(tr.requests) == 1
    body = json.loads(tr.requests[0].content)
    prompt = body["messages"][0]["content"]
    assert body["tools"][0]["name"] == TUNE_TOOL
    assert body["tools"][0]["input_schema"]["properties"]["candidates"]["items"]["properties"]["changes"] \
        == t.space.json_schema(required=False)
    for needle in ("Share of the step per op family (source: cost model (predicted))", "- gemv: ",
                   "trial 0 [warm]", "trial 1 [warm]", "Nearest entries of the tuning database",
                   "GPU sim (cost model) (132 SMs), tp 1, 7.25 ms", '"tile": 128', "## Incumbent",
                   "tile_gate_up"):
        assert needle in prompt, needle
    rows = _rows(tmp_path)
    llm = [r for r in rows if r.get("kind") == "llm"]
    assert len(llm) == 1 and llm[0]["trial"] == 2 and llm[0]["status"] in ("KEEP", "REVERT")
    assert llm[0]["config"]["lowering"]["tile"] == box["tile"] and llm[0]["changed"] == ["tile"]
    errors = [r["reason"] for r in rows if r.get("event") == "error"]
    assert len(errors) == 3 and summary["proposer_errors"] == 3 and summary["fallbacks"] == 0
    assert "candidate 2: unknown knob 'no_such_knob'" in errors[0]
    assert "candidate 3: workers=3 is not one of [1, 2, 4, 8, 16, 32]" in errors[1]
    assert "candidate 4: dtype is fixed at 'f32'" in errors[2]
    assert summary["trials"] == 3 and summary["rows"] == 3  # proposer rows are no trials
    log = [json.loads(x) for x in (tmp_path / "t" / "proposer.log").read_text().splitlines()]
    assert [e["event"] for e in log][:2] == ["request", "answer"] and log[0]["prompt"] == prompt
    assert "weight stream" in log[1]["text"]
    _no_key_anywhere(tmp_path / "t", prompt)


def test_malformed_answer_is_counted_and_the_round_falls_back(tmp_path, capsys):
    from rich.console import Console

    tr = LiveTransport([[{"type": "text", "text": "try a bigger tile"}],
                        answer("not a list")] + [answer([{"changes": {"tile": 16}}])] * 5)
    t = _tuner(tmp_path, tr, trials=4)
    t.console = Console(stderr=True, highlight=False)
    summary = t.run()
    assert summary["ok"] and summary["trials"] == 4
    assert summary["proposer_errors"] >= 1 and summary["fallbacks"] >= 1
    rows = _rows(tmp_path)
    errs = [r["reason"] for r in rows if r.get("event") == "error"]
    assert "expected one propose_configs call" in errs[0]
    fallback_trials = [r for r in rows if "(fallback)" in r.get("note", "")]
    assert fallback_trials and all(r["kind"] in ("neighbour", "mutation") for r in fallback_trials)
    err = capsys.readouterr().err
    assert err.count("fallback to the local moves") == summary["fallbacks"]
    assert "Traceback" not in err


def test_no_key_is_one_line(tmp_path, monkeypatch):
    from search.tune import TuneSettings, open_tune

    monkeypatch.delenv("ANTHROPIC_API_KEY")
    with pytest.raises(AmkError, match="needs ANTHROPIC_API_KEY.*--proposer local"):
        open_tune(TuneSettings(model=MODEL, out=str(tmp_path / "t"), backend="sim", dtype="f32", trials=2,
                               db=str(tmp_path / "db"), proposer="llm"))


def test_failed_requests_stop_the_run_in_process(tmp_path):
    tr = LiveTransport([500, 500, 500])
    t = _tuner(tmp_path, tr, trials=40, llm_max_failures=2)
    with pytest.raises(ProposerUnavailable, match="2 requests in a row failed"):
        t.run()
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    assert "requests in a row failed" in report["stop_reason"] and report["fallbacks"] == 1


# -- the command over an unreachable endpoint ---------------------------------------------------
def _tune(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AMK_TUNE_SHIPPED="", ANTHROPIC_API_KEY=SECRET,
               ANTHROPIC_BASE_URL=f"http://127.0.0.1:{_closed_port()}")
    env.pop("AMK_LLM_MODEL", None)
    return subprocess.run([sys.executable, "-m", "amk", "tune", MODEL, "--backend", "sim", "--proposer", "llm",
                           "--db", str(tmp_path / "db"), "--out", str(tmp_path / "t"), *extra],
                          env=env, capture_output=True, text=True, timeout=300)


def test_unreachable_llm_stops_after_n_failures_with_one_line(tmp_path):
    r = _tune(tmp_path, "--trials", "40", "--llm-max-failures", "2", "--quiet")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()
    assert "2 requests in a row failed" in err[-1] and "APIConnectionError" in err[-1], err[-1]
    assert f"amk tune --resume {tmp_path / 't'} --llm-fallback" in err[-1]
    assert sum("requests in a row failed" in x for x in err) == 1
    # round 1's failure fell back (said on the console); round 2's was the second in a row
    assert sum("fallback to the local moves" in x for x in err) == 1
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    assert report["fallbacks"] == 1 and report["best"] is not None
    _no_key_anywhere(tmp_path / "t", r.stdout, r.stderr)


def test_unreachable_llm_with_fallback_completes_and_counts(tmp_path):
    r = _tune(tmp_path, "--trials", "4", "--llm-fallback", "--llm-max-failures", "1", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["ok"] and summary["trials"] == 4 and summary["fallbacks"] >= 1
    lines = [x for x in r.stderr.splitlines() if "fallback to the local moves" in x]
    assert len(lines) == summary["fallbacks"] and all("Connection refused" in x for x in lines), r.stderr
    assert f"{summary['fallbacks']} rounds fell back to the local moves" in r.stderr
    _no_key_anywhere(tmp_path / "t", r.stdout, r.stderr)
