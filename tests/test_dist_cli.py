"""`amk dist FILE.py:FUNC`: each example captured, lowered, validated and run on the sim at
R = 2 against the pattern's reference; --emit writes a schedule amk validate accepts; bad
input is one line and exit 2; a rejected schedule and a wrong result are exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amk.cli import main

ROOT = Path(__file__).resolve().parents[1]
EX = "examples/distributed"

#: (function, shapes at R = 2, pattern kind)
CASES = {
    "allgather_matmul": (["x=32,64", "w=64,48"], "allgather_matmul"),
    "matmul_reduce_scatter": (["x=64,32", "w=48,32"], "matmul_reduce_scatter"),
    "matmul_allreduce_rmsnorm": (["x=16,64", "w=64,48", "g=48"], "matmul_allreduce"),
    "ulysses_combine": (["o=32,16", "w=32,48"], "ulysses_combine"),
}


def amk(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "amk", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def shape_args(shapes: list[str]) -> list[str]:
    return [a for s in shapes for a in ("--shape", s)]


def dist_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["dist", *map(str, argv)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_the_command_end_to_end(tmp_path):
    """In a fresh process: capture, lower, validate, run at R = 2, --json and --emit."""
    shapes, kind = CASES["matmul_reduce_scatter"]
    out = tmp_path / "rs.json"
    r = amk("dist", f"{EX}/matmul_reduce_scatter.py:matmul_reduce_scatter", "--world", "2", *shape_args(shapes),
            "--workers", "4", "--emit", out, "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout
    obj = json.loads(lines[0])
    assert obj["ok"] is True and obj["pattern"] == kind and obj["world"] == 2 and obj["workers"] == 4
    assert obj["dims"] == {"M": 64, "N": 48, "K": 32} and obj["output_shape"] == [32, 48]
    assert obj["operands"]["w"] == {"param": "w", "transposed": True, "shape": [48, 32]}
    assert [s["op"] for s in obj["steps"]] == ["matmul", "reduce_scatter_tensor"]
    assert obj["steps"][1]["where"] == f"{EX}/matmul_reduce_scatter.py:22"
    assert obj["validation"] == {"ok": True} and obj["run"]["ok"] is True
    assert len(obj["run"]["ranks"]) == 2 and obj["run"]["max_abs_err"] <= obj["run"]["tolerance"]
    assert obj["emit"] == str(out)
    from ir.io import load_program
    from validator import validate

    prog = load_program(out)
    assert prog.ranks == 2 and prog.workers == 4 and validate(prog).ok


@pytest.mark.parametrize("name", ["allgather_matmul", "matmul_allreduce_rmsnorm", "ulysses_combine"])
def test_each_example_at_r2(name, capsys):
    shapes, kind = CASES[name]
    code, out, err = dist_cli(capsys, f"{EX}/{name}.py:{name}", "--world", "2", *shape_args(shapes),
                              "--workers", "4")
    assert code == 0, err[-3000:]
    head = out.splitlines()[0]
    assert head.startswith(f"{name} ({EX}/{name}.py:") and f": {kind} (" in head
    assert "accepted " in out and "2 rank(s) x 4 worker(s)" in out
    assert "sim: every rank's output matches the reference (models.collectives)" in out


def test_knobs_reach_the_lowering(capsys):
    shapes, _ = CASES["matmul_allreduce_rmsnorm"]
    target = f"{EX}/matmul_allreduce_rmsnorm.py:matmul_allreduce_rmsnorm"
    code, out, _ = dist_cli(capsys, target, "--world", "2", *shape_args(shapes), "--workers", "2",
                            "--allreduce", "twoshot", "--tile-m", "8", "--json")
    obj = json.loads(out)
    assert code == 0 and obj["config"]["allreduce"] == "twoshot" and obj["config"]["tile_m"] == 8
    assert obj["rmsnorm_eps"] == 1e-6
    code, _, err = dist_cli(capsys, f"{EX}/allgather_matmul.py:allgather_matmul", "--world", "2",
                            *shape_args(CASES["allgather_matmul"][0]), "--allreduce", "twoshot")
    assert code == 2
    assert "--allreduce twoshot does nothing for allgather_matmul" in one_error_line(err)


def test_a_refused_function_names_its_line(tmp_path):
    src = tmp_path / "bad.py"
    src.write_text("import torch\nimport torch.distributed as dist\n\n\ndef f(x, w):\n    y = x @ w\n"
                   "    dist.all_reduce(y)\n    return torch.sort(y).values\n")
    r = amk("dist", f"{src}:f", "--world", "2", "--shape", "x=4,8", "--shape", "w=8,6")
    assert r.returncode == 2
    assert one_error_line(r.stderr).startswith(f"error: {src}:8: torch.sort is not an op amk dist lowers (known: ")
    assert r.stdout == ""


@pytest.mark.parametrize("argv, message", [
    (["examples/distributed/allgather_matmul.py"], "examples/distributed/allgather_matmul.py: expected FILE.py:FUNC, "
                                                   "e.g. examples/distributed/allgather_matmul.py:allgather_matmul"),
    (["nowhere.py:f"], "nowhere.py: no such file"),
    (["README.md:f"], "README.md:f: README.md is not a .py file"),
    ([f"{EX}/allgather_matmul.py:nope"], f"{EX}/allgather_matmul.py: no function 'nope' (its functions: "
                                         "allgather_matmul, shapes)"),
    ([f"{EX}/allgather_matmul.py:allgather_matmul", "--shape", "x=32;64"],
     "--shape x=32;64: expected NAME=DIMS with positive integers, e.g. x=64,128"),
    ([f"{EX}/allgather_matmul.py:allgather_matmul", "--shape", "x=32,64", "--shape", "x=1"],
     "--shape x=1: x is given twice"),
    ([f"{EX}/allgather_matmul.py:allgather_matmul", "--shape", "x=32,64"],
     "allgather_matmul: parameter w has no shape (give w=DIMS) and no default"),
    ([f"{EX}/allgather_matmul.py:allgather_matmul", "--shape", "x=32,64", "--shape", "w=64,48", "--shape", "v=1"],
     "shape for v: allgather_matmul has no parameter v (its parameters: x, w)"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    world = [] if "--world" in argv else ["--world", "2"]
    code, out, err = dist_cli(capsys, *argv, *world)
    assert code == 2
    assert one_error_line(err) == f"error: {message}"


def test_bad_world_and_config(tmp_path, capsys):
    target = f"{EX}/allgather_matmul.py:allgather_matmul"
    code, _, err = dist_cli(capsys, target, "--world", "two", *shape_args(CASES["allgather_matmul"][0]))
    assert code == 2 and one_error_line(err) == "error: --world two: expected an integer >= 1"
    cfg = tmp_path / "c.json"
    cfg.write_text('{"collective": {"tile_q": 3}}')
    code, out, err = dist_cli(capsys, target, "--world", "2", *shape_args(CASES["allgather_matmul"][0]),
                              "--config", cfg, "--json")
    assert code == 2 and "unknown field 'tile_q'" in one_error_line(err)
    obj = json.loads(out)
    assert obj["ok"] is False and obj["exit_code"] == 2 and "tile_q" in obj["error"]


def test_an_unwritable_emit_fails_before_the_capture(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = dist_cli(capsys, f"{EX}/allgather_matmul.py:allgather_matmul", "--world", "2",
                            *shape_args(CASES["allgather_matmul"][0]), "--emit", blocker / "s.json")
    assert code == 2
    assert one_error_line(err).startswith(f"error: --emit: cannot write to {blocker}: ")
    assert blocker.read_text() == "x"


def test_a_rejected_schedule_exits_1_with_the_findings(monkeypatch, capsys):
    """The lowering loses a put's signal: the validator finds the wait that never completes."""
    import lowering.collectives as C

    real = C.lower_pattern

    def lossy(*a, **kw):
        prog, binding = real(*a, **kw)
        t = next(t for t in prog.tasks if t.signals)
        t.signals = ()
        return prog, binding

    monkeypatch.setattr(C, "lower_pattern", lossy)
    code, out, err = dist_cli(capsys, f"{EX}/allgather_matmul.py:allgather_matmul", "--world", "2",
                              *shape_args(CASES["allgather_matmul"][0]), "--workers", "2", "--json")
    assert code == 1, err[-2000:]
    obj = json.loads(out)
    assert obj["ok"] is False and obj["validation"]["ok"] is False and obj["validation"]["errors"]
    assert "run" not in obj
    code, out, _ = dist_cli(capsys, f"{EX}/allgather_matmul.py:allgather_matmul", "--world", "2",
                            *shape_args(CASES["allgather_matmul"][0]), "--workers", "2")
    assert code == 1 and "rejected " in out


def test_a_wrong_result_exits_1(monkeypatch, capsys):
    import amk.distributed as D

    real = D.run_sim

    def off_by_one(*a, **kw):
        outs, ex = real(*a, **kw)
        return [o + 1 for o in outs], ex

    monkeypatch.setattr(D, "run_sim", off_by_one)
    code, out, _ = dist_cli(capsys, f"{EX}/allgather_matmul.py:allgather_matmul", "--world", "2",
                            *shape_args(CASES["allgather_matmul"][0]), "--workers", "2")
    assert code == 1
    assert "sim: every rank's output DIFFERS from the reference" in out
