"""`amk search` as a new user runs it: from any working directory (relative and default
``--out``), its best config fed unchanged to compile / generate / bench / run, an LLM
proposer whose endpoint is unreachable (console lines, summary count, a one-line stop,
``--llm-fallback``, the key written nowhere) and an unwritable ``--out`` (one line, exit 2).

The searches use ``config:tiny-llama`` on the sim with 3 to 4 trials (a few seconds each).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lowering.config import LoweringConfig
from search.records import read_json, read_tsv

ROOT = Path(__file__).resolve().parent.parent
MODEL = "config:tiny-llama"
SECRET = "sk-ant-test-0123456789-do-not-leak"


def _amk(*args: str, cwd: Path, env_extra: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "AMK_LLM_MODEL"):
        env.pop(k, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "amk", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _search(cwd: Path, *extra: str, trials: int = 3, **kw) -> subprocess.CompletedProcess:
    return _amk("search", MODEL, "--tp", "2", "--backend", "sim", "--trials", str(trials),
                *extra, cwd=cwd, **kw)


def _check_search_dir(d: Path) -> None:
    """A search that ran: every trial was evaluated by the worker (none died), trial 0 kept."""
    rows = read_tsv(d / "results.tsv")
    assert rows and rows[0]["status"] == "KEEP", rows
    for r in rows:
        assert "worker died" not in r["reason"] and "FileNotFoundError" not in r["reason"], r
    assert (d / "work" / "trial-0000" / "result.json").exists()
    st = read_json(d / "state.json")
    assert st["settings"]["out"] == str(d.resolve())  # stored absolute: resumable anywhere
    assert not [p for p in d.rglob("*") if p.name.endswith(".tmp")]  # atomic writes only


@pytest.fixture(scope="module")
def relative_search(tmp_path_factory) -> Path:
    """One search run from a scratch working directory with ``--out srch`` (relative)."""
    cwd = tmp_path_factory.mktemp("cwd")
    r = _search(cwd, "--out", "srch", "--quiet")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return cwd / "srch"


# -- relative and default --out --------------------------------------------------------------
def test_relative_out_from_another_working_directory(relative_search):
    assert relative_search.parent != ROOT
    _check_search_dir(relative_search)


def test_default_out_from_another_working_directory(tmp_path):
    r = _search(tmp_path, "--quiet")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    dirs = list((tmp_path / "amk-search").glob("config-tiny-llama-tp2-*"))
    assert len(dirs) == 1, list(tmp_path.rglob("*"))
    _check_search_dir(dirs[0])
    # a resume from yet another directory, with a relative --resume, continues it
    other = tmp_path / "elsewhere"
    other.mkdir()
    rel = os.path.relpath(dirs[0], other)
    r = _amk("search", "--resume", rel, "--trials", "4", "--quiet", cwd=other)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = read_tsv(dirs[0] / "results.tsv")
    assert [int(x["trial"]) for x in rows] == [0, 1, 2, 3]
    assert all("worker died" not in x["reason"] for x in rows)


def test_the_worker_gets_absolute_paths_whatever_it_is_handed(tmp_path, monkeypatch):
    """The worker runs in the repository root: the client resolves a relative work
    directory and log path against the caller's directory before handing them over."""
    from search.evaluator import Evaluator, new_workdir

    monkeypatch.chdir(tmp_path)
    ev = Evaluator("rel/worker.log", timeout_s=120)
    try:
        wd = new_workdir("rel/work", 0)
        assert wd.is_absolute() and wd == tmp_path / "rel" / "work" / "trial-0000"
        res = ev.evaluate({"model": MODEL, "ranks": 1, "backend": "sim", "config": {
            "tile": 100000}}, Path("rel/work/trial-0000"))  # relative on purpose
    finally:
        ev.close()
    # the worker read the request (and refused the config), it did not die on a path
    assert res["status"] in ("rejected", "fail"), res
    assert "FileNotFoundError" not in res.get("reason", "") and res.get("stage") != "setup"
    assert (tmp_path / "rel" / "work" / "trial-0000" / "result.json").exists()
    assert (tmp_path / "rel" / "worker.log").exists()


def test_settings_paths_are_made_absolute_once(tmp_path, monkeypatch):
    from search.loop import SearchSettings, absolute_model_arg

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-model").mkdir()
    s = SearchSettings(model="my-model", out="srch", replay="old/results.jsonl").absolute()
    assert s.model == str(tmp_path / "my-model") and s.out == str(tmp_path / "srch")
    assert s.replay == str(tmp_path / "old" / "results.jsonl")
    # recipes, aliases and names that are not paths here are left for the model loader
    for arg in (MODEL, "smollm2-135m", "no-such-model"):
        assert absolute_model_arg(arg) == arg


# -- the best config is usable as-is -----------------------------------------------------------
def test_best_config_is_accepted_by_compile_generate_bench_and_run(relative_search, tmp_path):
    from amk.bench import bench_config
    from amk.commands.compile import config_from_args
    from ir.io import load_program
    from lowering.config import AmkConfig, KernelConfig
    from search.space import program_fingerprint

    best = relative_search / "best"
    cfg_file = best / "config.json"
    raw = json.loads(cfg_file.read_text())
    # a config file and nothing else: every lowering knob, and the kernel part the search ran
    # with (it set none: the defaults)
    assert set(raw) == {"lowering", "kernel"}
    assert set(raw["lowering"]) == set(LoweringConfig.__dataclass_fields__)
    assert raw["kernel"] == KernelConfig().to_json()
    meta = read_json(best / "trial.json")  # where it came from sits beside it
    assert meta["candidate_id"].startswith("k-") and meta["lowering_config"] == raw["lowering"]
    assert meta["latency_ms"] > 0 and meta["timing_source"] == "predicted"
    summary = read_json(relative_search / "summary.json")
    assert summary["best_config_file"] == str(cfg_file.resolve())
    assert summary["use_best"] == meta["compile"]

    # compile (the CLI, from another directory, with the file unchanged)
    r = _amk("compile", MODEL, "--tp", "2", "--config", str(cfg_file), "--out", "build",
             cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    built = load_program(tmp_path / "build" / "schedule.json")
    assert program_fingerprint(built) == program_fingerprint(load_program(best / "schedule.json"))
    # compile for the triton backend takes the kernel part too (no check: no GPU needed)
    r = _amk("compile", MODEL, "--tp", "2", "--config", str(cfg_file), "--backend", "triton", "--no-check",
             "--out", "build-t", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert read_json(tmp_path / "build-t" / "report.json")["kernel"] == raw["kernel"]
    # generate reads --config through compile's loader; bench through its own
    want = AmkConfig.from_json(raw)
    ns = argparse.Namespace(config=str(cfg_file), tp=2, backend="sim", command="generate")
    assert config_from_args(ns) == want
    ns = argparse.Namespace(config=str(cfg_file), tp=2, prompt_len=8, tokens=128)
    assert bench_config(ns, 132) == want
    # run takes the saved schedule, and the config's kernel part
    r = _amk("run", str(best / "schedule.json"), "--steps", "2", "--config", str(cfg_file), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_search_starts_from_a_config_file(tmp_path):
    """--config FILE: trial 0 is the file's lowering knobs (the rest at their defaults), its
    max_seq is the whole search's; kernel knobs are refused on the sim backend, and a start
    outside the search space is refused before any trial."""
    f = tmp_path / "start.json"
    f.write_text(json.dumps({"lowering": {"tile": 32, "fuse": True, "policy": "stage", "max_seq": 128}}))
    out = tmp_path / "s"
    r = _search(tmp_path, "--config", str(f), "--out", str(out), "--quiet", trials=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert (rec["config"]["tile"], rec["config"]["fuse"], rec["config"]["policy"]) == (32, True, "stage")
    assert read_json(out / "state.json")["settings"]["max_seq"] == 128
    assert json.loads((out / "best" / "config.json").read_text())["lowering"]["max_seq"] == 128
    f.write_text(json.dumps({"kernel": {"gemv_block": "16x128"}}))
    r = _search(tmp_path, "--config", str(f), "--out", str(tmp_path / "s2"), "--quiet", trials=1)
    assert r.returncode == 2 and "--gemv-block is a knob of the triton backend's kernel" in r.stderr, r.stderr
    r = _search(tmp_path, "--workers", "3", "--out", str(tmp_path / "s3"), "--quiet", trials=1)
    assert r.returncode == 2 and "start config: not a point of the search space" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "s3").exists()


def test_hand_written_config_with_an_unknown_field_is_still_refused(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"tile": 32, "candidate_id": "k-123"}))
    from ground.errors import AmkError

    with pytest.raises(AmkError, match="unknown field 'candidate_id'"):
        LoweringConfig.from_file(f)


# -- the LLM proposer with an unreachable endpoint ---------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed when the block ends: connections are refused


def _llm_env() -> dict[str, str]:
    return {"ANTHROPIC_API_KEY": SECRET,
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{_closed_port()}"}


def _no_key_anywhere(r: subprocess.CompletedProcess, d: Path) -> None:
    assert SECRET not in r.stdout and SECRET not in r.stderr
    for f in d.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def test_llm_unreachable_stops_after_n_failures_with_one_line(tmp_path):
    from search.loop import LLM_MAX_FAILURES, SearchSettings

    assert SearchSettings(model="m", out="o").llm_max_failures == LLM_MAX_FAILURES == 3
    out = tmp_path / "s"
    r = _search(tmp_path, "--proposer", "llm", "--llm-max-failures", "2", "--out", str(out),
                "--quiet", trials=6, env_extra=_llm_env())
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "2 requests in a row failed" in err[0] and "APIConnectionError" in err[0]
    assert "--llm-fallback" in err[0]
    # trial 1 fell back (said on the console); trial 2's failure was the second in a row
    fb = [x for x in r.stdout.splitlines() if "fallback to a mutation" in x]
    assert len(fb) == 1 and "LLM request failed: APIConnectionError" in fb[0], r.stdout
    summary = read_json(out / "summary.json")
    assert summary["fallbacks"] == 1 and summary["trials"] == 2
    assert "requests in a row failed" in summary["stop_reason"]
    assert read_json(out / "state.json")["finished"] is False  # resumable
    recs = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [x["proposer"] for x in recs] == ["baseline", "mutation"]
    assert "APIConnectionError" in recs[1]["extra"]["fallback"]
    _no_key_anywhere(r, out)


def test_llm_fallback_completes_and_counts(tmp_path):
    out = tmp_path / "s"
    r = _search(tmp_path, "--proposer", "llm", "--llm-fallback", "--llm-max-failures", "1",
                "--out", str(out), trials=4, env_extra=_llm_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if "fallback to a mutation" in x]
    assert len(lines) == 3, r.stdout  # one console line per fallback (trials 1..3)
    assert all("Connection refused" in x for x in lines)
    summary = read_json(out / "summary.json")
    assert summary["fallbacks"] == 3 and summary["trials"] == 4
    assert "3 trials used a mutation" in r.stdout
    _no_key_anywhere(r, out)


# -- an unwritable --out ---------------------------------------------------------------------
def _one_line_exit_2(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in err[0], err[0]


def test_out_under_a_regular_file_is_one_line(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    r = _search(tmp_path, "--out", "file.txt/sub", "--quiet")
    _one_line_exit_2(r, "cannot write the search directory", str(f / "sub"))
    r = _search(tmp_path, "--out", "file.txt", "--quiet")  # --out is a file itself
    _one_line_exit_2(r, "cannot write the search directory", str(f))
    assert f.read_text() == "x"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a 0o500 directory regardless of its mode")
def test_read_only_out_is_one_line(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        r = _search(tmp_path, "--out", "ro", "--quiet")
        _one_line_exit_2(r, "cannot write the search directory", str(d))
        r = _search(tmp_path, "--out", "ro/sub", "--quiet")
        _one_line_exit_2(r, "cannot write the search directory", str(d / "sub"))
    finally:
        d.chmod(0o700)
