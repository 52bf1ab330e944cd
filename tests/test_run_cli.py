"""`amk run FILE`: seeded inputs, digests, validation gate, --unsafe deadlocks on both
backends (sim deadlock report, triton watchdog), triton vs sim agreement, exit codes, and the
committed example schedules in examples/schedules/."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU, before triton loads)
from amk.cli import main
from amk.commands.run import InputPlan, compare
from ir.builder import ProgramBuilder
from ir.io import load_program, save_program
from ir.program import Target
from ir.text import format_program

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples" / "schedules"
SAFE, ALLREDUCE, DEADLOCK = EX / "norm_gemv_w2.amk", EX / "allreduce_r2.amk", EX / "deadlock.amk"


def _make_module():
    spec = importlib.util.spec_from_file_location("amk_examples_make", EX / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["run", *map(str, argv)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def attention_file(tmp_path: Path, S: int = 4) -> Path:
    """embed(tok) -> kv_append at pos -> attention over 0..pos -> o: int32 token and
    position inputs, a KV cache of S positions (the megakernel tests' program, as a file)."""
    from tests.test_triton_megakernel import attention_program

    return save_program(attention_program(S), tmp_path / "attn.amk")


# ------------------------------------------------------------------ example files
def test_examples_are_current_and_parse():
    make = _make_module()
    for name in make.EXAMPLES:
        path = EX / name
        assert path.read_text(encoding="utf-8") == make.render(name), \
            f"{path} differs from examples/schedules/make.py; rerun it"
        prog = load_program(path)
        assert format_program(prog) == format_program(make.EXAMPLES[name][0]())


def test_example_verdicts(capsys):
    assert main(["validate", str(SAFE)]) == 0
    assert main(["validate", str(ALLREDUCE)]) == 0
    capsys.readouterr()
    assert main(["validate", str(DEADLOCK), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert [e["class"] for e in d["errors"]] == ["DeadlockCycle"]
    assert set(d["errors"][0]["tasks"]) == {"ping", "pong"}


# ------------------------------------------------------------------ safe runs, sim
def test_safe_schedule_on_sim(capsys):
    code, out, err = run_cli(capsys, SAFE, "--steps", 2)
    assert code == 0, err
    assert "ran" in out and "2 step(s)" in out and "validated in" in out
    assert "y@r0 [32] f32 finite" in out and "crc32" in out
    assert "inputs (seed 0)" in out and "W" in out

    code, out, _ = run_cli(capsys, SAFE, "--steps", 2, "--json")
    assert code == 0
    d = json.loads(out)
    assert d["ok"] is True and d["backend"] == "sim" and d["steps"] == 2 and d["validated"] is True
    assert d["tasks"] == 8 and d["inputs"]["random"] == ["x", "g", "W"]
    (o,) = d["outputs"]
    assert o["buffer"] == "y" and o["shape"] == [32] and o["finite"] and o["nonfinite"] == 0
    assert o["min"] <= o["max"] and len(o["crc32"]) == 8

    # Deterministic in the seed; another seed gives other inputs.
    # A validated schedule gives the same result under any interleaving policy.
    code, out2, _ = run_cli(capsys, SAFE, "--steps", 2, "--json", "--sim-policy", "adversarial")
    assert code == 0 and json.loads(out2)["policy"] == "adversarial"
    assert json.loads(out2)["outputs"][0]["crc32"] == o["crc32"]
    code, out3, _ = run_cli(capsys, SAFE, "--steps", 2, "--json", "--seed", 1)
    assert json.loads(out3)["outputs"][0]["crc32"] != o["crc32"]


def test_allreduce_outputs_follow_the_input_rule(capsys):
    """y = x.r0 + x.r1 of the LAST step on both ranks: io_inputs are rewritten every step."""
    code, out, err = run_cli(capsys, ALLREDUCE, "--steps", 3, "--json", "--seed", 5)
    assert code == 0, err
    d = json.loads(out)
    prog = load_program(ALLREDUCE)
    plan = InputPlan(prog, seed=5, steps=3)
    bufs = prog.buffer_map()
    want = plan.value(bufs["x.r0"], 2) + plan.value(bufs["x.r1"], 2)
    assert not torch.allclose(want, plan.value(bufs["x.r0"], 1) + plan.value(bufs["x.r1"], 1))
    got = {o["buffer"]: o for o in d["outputs"]}
    for name in ("y.r0", "y.r1"):
        assert got[name]["sum"] == pytest.approx(float(want.double().sum()), abs=1e-5)
        assert got[name]["max"] == pytest.approx(float(want.max()), abs=1e-6)


def test_positions_and_tokens(capsys, tmp_path):
    f = attention_file(tmp_path, S=4)
    code, out, err = run_cli(capsys, f, "--steps", 4, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["inputs"]["positions"] == ["pos"] and d["inputs"]["tokens"] == ["tok"]
    assert d["outputs"][0]["finite"]
    plan = InputPlan(load_program(f), seed=0, steps=4)
    bufs = plan.program.buffer_map()
    assert [int(plan.value(bufs["pos"], e)[0]) for e in range(4)] == [0, 1, 2, 3]
    toks = [int(plan.value(bufs["tok"], e)[0]) for e in range(20)]
    assert all(0 <= t < 10 for t in toks) and len(set(toks)) > 1
    # Positions run past the cache: a usage error before anything runs.
    code, _, err = run_cli(capsys, f, "--steps", 5)
    assert code == 2 and "KV cache kc holds 4 positions" in err


# ------------------------------------------------------------------ the validation gate
def test_deadlock_refused_without_unsafe(capsys):
    for backend in ("sim", "triton"):
        code, out, err = run_cli(capsys, DEADLOCK, "--backend", backend)
        assert code == 1
        assert "rejected by the validator (DeadlockCycle)" in err and "--unsafe" in err
        assert "DeadlockCycle" in out and "witness" in out
    code, out, _ = run_cli(capsys, DEADLOCK, "--json")
    d = json.loads(out)
    assert code == 1 and d["ok"] is False and d["kind"] == "rejected"
    assert d["errors"][0]["class"] == "DeadlockCycle"


def test_deadlock_unsafe_sim_reports_blocked_queues(capsys):
    t0 = time.perf_counter()
    code, out, err = run_cli(capsys, DEADLOCK, "--unsafe")
    assert time.perf_counter() - t0 < 60
    assert code == 1
    assert "WARNING: --unsafe" in err and "WITHOUT validation" in err
    assert "deadlock: 2 queues blocked" in err
    assert "task ping waits c.pong >= 1 (value 0)" in err and "task pong waits c.ping >= 1" in err
    code, out, _ = run_cli(capsys, DEADLOCK, "--unsafe", "--json")
    d = json.loads(out)
    assert code == 1 and d["kind"] == "deadlock"
    assert {b["task"] for b in d["blocked"]} == {"ping", "pong"}


def test_deadlock_unsafe_triton_watchdog_subprocess():
    """The real process, under the interpreter here (its watchdog counts polls): exit 1
    with a one-line error naming the stuck task, no traceback, bounded wall time."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "amk", "run", str(DEADLOCK), "--unsafe",
                        "--backend", "triton", "--timeout", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert wall < 60, f"took {wall:.1f} s"
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "watchdog" in r.stderr and "stuck at task ping" in r.stderr
    assert "c.pong (value 0, needs 1)" in r.stderr and "ping @r0.w0" in r.stderr


def test_deadlock_unsafe_triton_json(capsys):
    code, out, err = run_cli(capsys, DEADLOCK, "--unsafe", "--backend", "triton", "--json")
    assert code == 1 and "WARNING" in err
    d = json.loads(out)
    assert d["kind"] == "watchdog" and d["unsafe"] is True
    s = {x["task"]: x for x in d["stuck"]}
    assert "ping" in s and s["ping"]["counter"] == "c.pong" and s["ping"]["location"] == "@r0.w0"


# ------------------------------------------------------------------ triton vs sim
def test_triton_matches_sim(capsys, tmp_path):
    code, out, err = run_cli(capsys, SAFE, "--backend", "triton")
    assert code == 0, err
    assert "matches sim: yes" in out and "y@r0 [32] f32 finite" in out
    for f in (SAFE, attention_file(tmp_path)):
        code, out, err = run_cli(capsys, f, "--backend", "triton", "--steps", 3, "--json")
        assert code == 0, err
        d = json.loads(out)
        assert d["ok"] and d["sim"]["matches"] and d["sim"]["mismatches"] == []
        assert d["sim"]["compared"] >= 3 and d["sim"]["max_abs_err"] < 1e-5


def test_unsafe_race_mismatch_is_exit_1(capsys, tmp_path):
    """A read-before-write race (reader on w0, writer on w1, no signal): under the
    interpreter the kernel runs the reader first (linearized in worker order) and reads
    poison; the sim's random interleaving sometimes runs the writer first. Every run's exit
    code follows its verdict, and some seed shows `matches sim: no`."""
    from lowering.triton.lang import interpreting

    if not interpreting():
        pytest.skip("the kernel's interleaving is only fixed under the interpreter")
    b = ProgramBuilder("race", ranks=1, workers=2)
    b.buffer("x", "io_input", "f32", (4,))
    b.buffer("h", "scratch", "f32", (4,))
    b.buffer("y", "io_output", "f32", (4,))
    b.task("write", 0, 1, "copy", ins=["x[0:4]"], outs=["h[0:4]"])
    b.task("read", 0, 0, "copy", ins=["h[0:4]"], outs=["y[0:4]"])
    f = save_program(b.build(), tmp_path / "race.amk")
    assert run_cli(capsys, f, "--backend", "triton")[0] == 1  # rejected: a race
    verdicts = []
    for seed in range(6):
        code, out, _ = run_cli(capsys, f, "--unsafe", "--backend", "triton", "--steps", 1, "--seed", seed)
        assert code == (0 if "matches sim: yes" in out else 1)
        verdicts.append(code)
        if code:
            assert "matches sim: no" in out and "y@r0 step 0: NaN / inf in different places" in out
    assert 1 in verdicts


def test_compare_rule():
    x = torch.linspace(-3, 3, 16)
    assert compare(x, x.clone(), "f32") == (True, 0.0, "")
    ok, err, _ = compare(x + 2e-4, x, "f32")  # bound 1e-4 * max(1, 3)
    assert ok and err == pytest.approx(2e-4, rel=1e-3)
    ok, _, why = compare(x + 1e-3, x, "f32")
    assert not ok and "max abs err" in why
    assert compare((x + 1e-2).bfloat16(), x.bfloat16(), "bf16")[0]
    y = x.clone()
    y[3] = float("nan")
    assert compare(y, y.clone(), "f32")[0]  # unwritten (NaN) in both: same
    ok, err, why = compare(y, x, "f32")
    assert not ok and err == float("inf") and "NaN" in why
    i = torch.arange(4, dtype=torch.int32)
    assert compare(i, i.clone(), "i32")[0] and not compare(i + 1, i, "i32")[0]


# ------------------------------------------------------------------ bad input
def test_bad_input_exit_2(capsys, tmp_path):
    missing = tmp_path / "none.amk"
    code, _, err = run_cli(capsys, missing)
    assert code == 2 and "none.amk" in err
    broken = tmp_path / "broken.amk"
    broken.write_text('amk 1\nprogram "x"\nranks 1 workers [\n')
    code, _, err = run_cli(capsys, broken)
    assert code == 2 and f"{broken}:3:" in err
    code, out, _ = run_cli(capsys, broken, "--json")
    d = json.loads(out)
    assert code == 2 and d["kind"] == "input_error" and ":3:" in d["error"]
    assert run_cli(capsys, SAFE, "--steps", 0)[0] == 2
    assert run_cli(capsys, SAFE, "--timeout", 0, "--backend", "triton")[0] == 2


def test_backend_limit_is_a_usage_error(capsys, tmp_path):
    """More workers than the target allows: rejected by the validator; with --unsafe the
    sim runs it, the triton backend refuses it (exit 2, names the limit)."""
    b = ProgramBuilder("wide", ranks=1, workers=2, target=Target(name="small", sms=1, max_workers=1))
    b.buffer("x", "io_input", "f32", (4,))
    b.buffer("y", "io_output", "f32", (4,))
    b.task("c0", 0, 0, "copy", ins=["x[0:2]"], outs=["y[0:2]"])
    b.task("c1", 0, 1, "copy", ins=["x[2:4]"], outs=["y[2:4]"])
    f = save_program(b.build(), tmp_path / "wide.amk")
    assert run_cli(capsys, f)[0] == 1
    assert run_cli(capsys, f, "--unsafe")[0] == 0
    code, _, err = run_cli(capsys, f, "--unsafe", "--backend", "triton")
    assert code == 2 and "allows 1" in err


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_gpu_deadlock_unsafe_triton_ends_within_10s(capsys):
    from lowering.triton.lang import interpreting

    if interpreting():
        pytest.skip("TRITON_INTERPRET=1: this test is for compiled Triton on a GPU")
    t0 = time.perf_counter()
    code, out, err = run_cli(capsys, DEADLOCK, "--unsafe", "--backend", "triton", "--timeout", "1",
                             "--json")
    wall = time.perf_counter() - t0
    assert code == 1 and wall < 10, (code, wall, err)
    d = json.loads(out)
    assert d["kind"] == "watchdog"
    assert {s["task"] for s in d["stuck"]} == {"ping", "pong"}
    assert "Traceback" not in err and "stuck at task" in err
