"""results.tsv / results.jsonl / state files: no latency without its verdict, durable
appends, a torn last line survives a kill, the TSV is rebuilt from the JSONL; the plot."""

from __future__ import annotations

import json

import pytest

from ground.errors import AmkError
from search.plot import plot_latency
from ground.files import atomic_write_json
from search.records import TSV_COLUMNS, Record, ResultsStore, read_json, read_tsv


def rec(trial: int, status: str = "KEEP", lat: float | None = 1.0, **kw) -> Record:
    return Record(trial=trial, parent=trial - 1 if trial else None, proposer="optuna",
                  candidate_id=f"k-{trial:012d}", config={"tile": 64}, status=status,
                  latency_ms=lat, timing_source="predicted" if lat is not None else None,
                  roofline_ms=0.5, pct_roofline=50.0 / (lat or 1), **kw)


def test_a_latency_needs_its_source_and_a_valid_status():
    with pytest.raises(ValueError, match="timing_source"):
        Record(0, None, "x", "k", {}, "KEEP", latency_ms=1.0)
    with pytest.raises(ValueError, match="status"):
        Record(0, None, "x", "k", {}, "MAYBE")


def test_row_has_every_column_and_no_tabs():
    r = rec(3, reason="a\tb\nc", description="tile=64\tworkers=4",
            correctness={"max_abs_err": 1e-6, "argmax_agree": 1.0, "positions": [0, 7]})
    row = r.row()
    assert len(row) == len(TSV_COLUMNS)
    d = dict(zip(TSV_COLUMNS, row))
    assert d["status"] == "KEEP" and d["reason"] == "a b c" and d["positions"] == "0,7"
    assert d["timing_source"] == "predicted" and d["latency_ms"] == "1"
    assert all("\t" not in c and "\n" not in c for c in row)
    f = rec(4, status="FAIL", lat=None, reason="correctness: wrong")
    d = dict(zip(TSV_COLUMNS, f.row()))
    assert d["latency_ms"] == "-" and d["timing_source"] == "-" and d["status"] == "FAIL"


def test_append_and_load_round_trip(tmp_path):
    st = ResultsStore(tmp_path)
    rs = [rec(0), rec(1, "REVERT", 1.2), rec(2, "REJECTED", None, reason="validator: X")]
    rs[0].extra = {"nan": float("nan")}
    for r in rs:
        st.append(r)
    got = ResultsStore(tmp_path).load()
    assert [r.trial for r in got] == [0, 1, 2]
    assert got[0].extra == {"nan": None}  # strict JSON
    rows = read_tsv(tmp_path / "results.tsv")
    assert [r["status"] for r in rows] == ["KEEP", "REVERT", "REJECTED"]
    assert list(rows[0]) == list(TSV_COLUMNS)


def test_torn_last_line_is_cut_and_tsv_rebuilt(tmp_path):
    st = ResultsStore(tmp_path)
    st.append(rec(0))
    st.append(rec(1))
    good = (tmp_path / "results.jsonl").read_bytes()
    # A kill in the middle of the third append leaves half a line, and the TSV lags.
    with open(tmp_path / "results.jsonl", "ab") as f:
        f.write(json.dumps(rec(2).to_json()).encode()[:40])
    (tmp_path / "results.tsv").write_text(ResultsStore.header() + "\n")
    got = ResultsStore(tmp_path).load()
    assert [r.trial for r in got] == [0, 1]
    assert (tmp_path / "results.jsonl").read_bytes() == good
    assert [r["trial"] for r in read_tsv(tmp_path / "results.tsv")] == ["0", "1"]
    # A complete JSON object without its newline is also an unfinished append.
    with open(tmp_path / "results.jsonl", "ab") as f:
        f.write(json.dumps(rec(2).to_json()).encode())
    assert len(ResultsStore(tmp_path).load()) == 2


def test_corrupt_middle_line_is_an_error(tmp_path):
    st = ResultsStore(tmp_path)
    st.append(rec(0))
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write("{not json\n")
    st.append(rec(1))
    with pytest.raises(AmkError, match=r"results.jsonl:2"):
        ResultsStore(tmp_path).load()


def test_atomic_json(tmp_path):
    p = tmp_path / "d" / "state.json"
    atomic_write_json(p, {"a": 1, "b": float("inf")})
    atomic_write_json(p, {"a": 2})
    assert read_json(p) == {"a": 2}
    assert [x.name for x in p.parent.iterdir()] == ["state.json"]  # no temp files left


def test_plot_writes_a_png(tmp_path):
    rs = [rec(0, lat=2.0), rec(1, "REVERT", 2.5), rec(2, "FAIL", None, reason="x"),
          rec(3, "KEEP", 1.5), rec(4, "TIMEOUT", None)]
    out = plot_latency(rs, tmp_path / "latency.png", "t")
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError):
        plot_latency([], tmp_path / "x.png")
