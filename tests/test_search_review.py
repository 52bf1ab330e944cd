"""``amk search --approve``: proposals wait in DIR/review/pending until a decision file appears
(search/review.py); approved ones are evaluated, rejected ones recorded as REJECTED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ground.errors import AmkError

ROOT = Path(__file__).resolve().parents[1]


def _wait_pending(out: Path, pid: str, proc: subprocess.Popen, timeout: float = 60.0) -> dict:
    from search.review import pending

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        items = [p for p in pending(out) if p["id"] == pid]
        if items:
            return items[0]
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{pid} never became pending")


def test_approve_and_reject_through_the_files(tmp_path):
    from search.review import decide, decided, pending

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "amk", "search", "config:tiny-llama", "--backend", "sim",
                             "--trials", "3", "--edits", "--approve", "--out", str(out), "--quiet"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = _wait_pending(out, "trial-0001", proc)
        assert first["proposer"] == "edits" and first["edits"] and first["candidate_id"].startswith("k-")
        time.sleep(0.5)
        assert proc.poll() is None, "the search went on without a decision"
        assert not (out / "work" / "trial-0001").exists()
        decide(out, "trial-0001", True, "looks fine")
        _wait_pending(out, "trial-0002", proc)
        decide(out, "trial-0002", False, "not this one")
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    assert recs[1]["extra"].get("stage") != "review"  # evaluated
    assert recs[2]["status"] == "REJECTED" and recs[2]["reason"] == "rejected in review: not this one"
    assert recs[2]["extra"]["stage"] == "review"
    assert pending(out) == []
    assert [d["decision"] for d in decided(out)] == ["approved", "rejected"]


def test_decide_refuses_bad_ids_and_repeats(tmp_path):
    from search.review import ReviewGate, decide

    with pytest.raises(AmkError, match="not a proposal id"):
        decide(tmp_path, "../../etc/passwd", True)
    with pytest.raises(AmkError, match="no pending proposal trial-0001"):
        decide(tmp_path, "trial-0001", True)
    (tmp_path / "review" / "pending").mkdir(parents=True)
    (tmp_path / "review" / "pending" / "trial-0001.json").write_text(json.dumps({"candidate_id": "k-1"}))
    decide(tmp_path, "trial-0001", False)
    with pytest.raises(AmkError, match="already rejected"):
        decide(tmp_path, "trial-0001", True)
    # a decision for another candidate (left by a killed run) is set aside, not taken
    gate = ReviewGate(tmp_path, poll_s=0.01)
    (tmp_path / "review" / "approved").mkdir(parents=True)
    (tmp_path / "review" / "approved" / "trial-0005.json").write_text(json.dumps({"candidate_id": "k-old"}))
    (tmp_path / "review" / "rejected" / "trial-0005.json").write_text(json.dumps({"candidate_id": "k-new",
                                                                                  "comment": "no"}))
    assert gate.ask(5, {"candidate_id": "k-new"}) == (False, "no")
    assert not (tmp_path / "review" / "approved" / "trial-0005.json").exists()
