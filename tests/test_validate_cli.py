"""`amk validate FILE [--json]`: exit codes 0 / 1 / 2, the text report and the JSON keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from amk.cli import main
from ir.examples import allreduce
from ir.io import save_program
from tests.test_validator import copy_chain, inversion, no_credit_allreduce

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def files(tmp_path):
    good = tmp_path / "good.amk"
    save_program(allreduce(2, 8, reuse="slots"), good)
    good_json = tmp_path / "good.json"
    save_program(allreduce(3, 8, reuse="credit"), good_json)
    bad = tmp_path / "bad.json"
    save_program(no_credit_allreduce(2), bad)
    dead = tmp_path / "dead.amk"
    save_program(inversion(cross_rank=False), dead)
    partial = tmp_path / "partial.amk"
    save_program(copy_chain(write=(0, 12)), partial)
    broken = tmp_path / "broken.amk"
    broken.write_text('amk 1\nprogram "x"\nranks 2 workers [\n')
    return {"good": good, "good_json": good_json, "bad": bad, "dead": dead,
            "partial": partial, "broken": broken, "missing": tmp_path / "none.amk"}


def test_accepted_exit_0(files, capsys):
    assert main(["validate", str(files["good"])]) == 0
    assert "accepted" in capsys.readouterr().out
    assert main(["validate", str(files["good_json"])]) == 0


def test_rejected_exit_1_prints_witness(files, capsys):
    assert main(["validate", str(files["dead"])]) == 1
    out = capsys.readouterr().out
    assert "DeadlockCycle" in out and "witness" in out and "counter c1" in out
    assert main(["validate", str(files["partial"])]) == 1
    out = capsys.readouterr().out
    assert "PartialCoverageRead" in out and "[12, 16]" in out


def test_unparsable_exit_2_with_position(files, capsys):
    assert main(["validate", str(files["broken"])]) == 2
    err = capsys.readouterr().err
    assert f"{files['broken']}:3:" in err
    assert main(["validate", str(files["missing"])]) == 2


def test_json_output(files, capsys):
    assert main(["validate", str(files["bad"]), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False
    assert {"ok", "errors", "stats"} <= set(d)
    e = d["errors"][0]
    assert {"class", "message", "tasks", "witness"} <= set(e)
    assert "ReceiveBufferReuseWithoutCredit" in {x["class"] for x in d["errors"]}
    assert d["stats"]["tasks"] == 6
    assert main(["validate", str(files["good"]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is True and d["errors"] == []
    assert main(["validate", str(files["broken"]), "--json"]) == 2
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and ":3:" in d["input_error"]


def test_console_entry_point(files):
    """The real process: exit codes survive `python -m amk`."""
    r = subprocess.run([sys.executable, "-m", "amk", "validate", str(files["dead"]), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["errors"][0]["class"] == "DeadlockCycle"


def _amk(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "amk", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("field", ["tasks", "buffers", "counters", "ranks"])
def test_json_missing_top_level_field_is_unreadable(tmp_path, field):
    """A JSON schedule without one of its required top-level fields is unreadable input:
    exit 2 and one line naming the field (not 'accepted, 0 tasks', not 200 findings)."""
    from ir.jsonio import program_to_json

    obj = program_to_json(allreduce(2, 8, reuse="credit"))
    del obj[field]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(obj))
    r = _amk("validate", str(path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"{path}: {field}: missing top-level field '{field}'" in lines[0]
    assert "accepted" not in r.stdout and "Traceback" not in r.stderr


def test_structural_errors_carry_the_task_position(tmp_path):
    """An unknown op (and any finding naming a task) points at the task's line:column in
    the text form, and at tasks[i] in JSON; the schedule is rejected (exit 1)."""
    text = ('amk 1\nprogram "u"\nranks 1 workers 1\nbuffer x io_input f32 [4] @r0\n'
            'buffer y io_output f32 [4] @r0\n\n'
            'task a @r0.w0 copy(x[0:4]) -> (y[0:4])\n'
            '  task b @r0.w0 frobnicate(x[0:4]) -> (y[0:4])\n'
            'task a @r0.w0 nop()\n')
    path = tmp_path / "u.amk"
    path.write_text(text)
    r = _amk("validate", str(path))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"{path}:8:3: UnknownOp: task b: op 'frobnicate' is not an IR op" in r.stdout
    assert f"{path}:9:1: DuplicateTask: task id a is used twice" in r.stdout
    r = _amk("validate", str(path), "--json")
    errs = {e["class"]: e for e in json.loads(r.stdout)["errors"]}
    assert errs["UnknownOp"]["location"] == f"{path}:8:3"

    from ir.io import load_program, save_program as save

    jpath = tmp_path / "u.json"
    save(load_program(path), jpath)
    r = _amk("validate", str(jpath))
    assert r.returncode == 1
    assert f"{jpath}: tasks[1]: UnknownOp: task b" in r.stdout


def test_validator_speed_bench_prints_stage_times(tmp_path):
    """bench/validator_speed.py on a schedule file: the table of stage times (parse,
    structure, deadlock, happens-before, races, validate, the CLI end to end) and JSON."""
    sched = tmp_path / "ar.amk"
    save_program(allreduce(3, 8, reuse="credit"), sched)
    out = tmp_path / "speed.json"
    r = subprocess.run([sys.executable, "bench/validator_speed.py", "--schedule", str(sched),
                        "--repeat", "2", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    for stage in ("parse", "structure", "deadlock", "happens_before", "races", "validate",
                  "cli"):
        assert any(line.startswith(stage) for line in r.stdout.splitlines()), stage
    d = json.loads(out.read_text())
    assert d["schedule"]["tasks"] == 12 and d["schedule"]["ok"] is True
    assert len(d["wall_s"]["cli"]["samples"]) == 2
    assert d["wall_s"]["parse"]["min"] <= d["wall_s"]["parse"]["median"]
    assert out.with_suffix(".txt").read_text().startswith("amk validate ar:")


def test_quiet_prints_nothing_and_loads_no_other_command(tmp_path):
    # `amk validate` builds only its own subparser and reads a lowered program's header
    # (config key "workers", a keyword the formatter quotes) without lark; on success with
    # --quiet it prints nothing, so rich never loads either
    prog = allreduce(2, 8, reuse="slots")
    prog.config = {"tile": 64, "workers": 1, "policy": "round_robin", "model": "x"}
    path = tmp_path / "p.amk"
    save_program(prog, path)
    assert '"workers"=1' in path.read_text()
    code = ("import sys; from amk.cli import main; rc = main(['validate', sys.argv[1], "
            "'--quiet']); heavy = ('lark', 'rich', 'torch', 'transformers', "
            "'importlib.metadata', 'models.features', 'lowering.config'); "
            "print(rc, [m for m in heavy if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "0 []\n" and r.stderr == ""
    r = subprocess.run([sys.executable, "-m", "amk", "validate", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "accepted" in r.stdout


def test_quiet_hides_stage_progress(files, capsys, monkeypatch):
    import amk.commands.validate as cmd

    monkeypatch.setattr(cmd, "LARGE", 1)  # progress for every program
    assert main(["validate", str(files["good"]), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert main(["validate", str(files["good"])]) == 0
    cap = capsys.readouterr()
    assert "validating" in cap.err and "races" in cap.err and "accepted" in cap.out
    assert main(["validate", str(files["dead"]), "--quiet"]) == 1  # errors still print
    assert "DeadlockCycle" in capsys.readouterr().out


def test_subcommand_parser_matches_the_full_one(capsys):
    from amk.cli import _module_of, build_parser

    assert _module_of("validate-corpus") == "validate_corpus"
    assert _module_of("validate_corpus") is None and _module_of("nope") is None
    for argv in (["validate", "x.amk", "--json"], ["validate-corpus", "--count", "3"]):
        full = build_parser().parse_args(argv)
        only = build_parser(_module_of(argv[0])).parse_args(argv)
        assert vars(full) == vars(only)
    with pytest.raises(SystemExit) as e:
        main(["validate"])  # the subcommand's own usage error, as before
    assert e.value.code == 2 and "usage: amk validate" in capsys.readouterr().err


def test_fresh_validate_process_uses_one_blas_thread(files):
    code = ("import os, sys; from amk.cli import main; rc = main(['validate', sys.argv[1], "
            "'--quiet']); print(rc, os.environ.get('OPENBLAS_NUM_THREADS'))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "OPENBLAS_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", code, str(files["good"])], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "0 1\n", r.stderr
    env["OPENBLAS_NUM_THREADS"] = "3"  # the user's setting stands
    r = subprocess.run([sys.executable, "-c", code, str(files["good"])], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.stdout == "0 3\n", r.stderr
