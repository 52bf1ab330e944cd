"""One knob surface at the command line: every command that takes knobs has one flag per knob,
spelled as the field, with the field's one description; a combination that does nothing is
refused in one line (exit code 2); the docs' knob tables are the declarations'."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowering.config import KernelConfig, LoweringConfig
from lowering.knobs import knobs_of

ROOT = Path(__file__).resolve().parents[1]


def _subparser(name: str):
    from amk.cli import build_parser

    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and name in a.choices)
    return sub.choices[name]


@pytest.mark.parametrize("command,classes", [
    ("compile", (LoweringConfig, KernelConfig)), ("generate", (LoweringConfig, KernelConfig)),
    ("bench", (LoweringConfig, KernelConfig)), ("search", (LoweringConfig, KernelConfig)),
    ("run", (KernelConfig,)),
])
def test_every_command_has_one_flag_per_knob_with_its_description(command, classes):
    actions = {a.option_strings[0]: a for a in _subparser(command)._actions if a.option_strings}
    assert "--config" in actions
    for cls in classes:
        for k in knobs_of(cls):
            a = actions[k.flag]
            assert a.dest == k.name and a.help.replace("%%", "%").startswith(k.help.rstrip(".")), (command, k.name)


def test_the_docs_tables_are_the_declarations():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "knob_docs.py")], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    text = (ROOT / "docs" / "lowering.md").read_text()
    for k in knobs_of(LoweringConfig):
        assert f"| `{k.name}` | `{k.flag}` |" in text and k.help in text, k.name


def test_the_docs_check_fails_on_a_stale_table(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("knob_docs", ROOT / "scripts" / "knob_docs.py")
    kd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kd)
    (tmp_path / "docs").mkdir()
    for _, doc in kd.TABLES:
        text = (ROOT / doc).read_text()
        (tmp_path / doc).write_text(text.replace("| `tile` | `--tile` |", "| `tile` | `--tiles` |"))
    monkeypatch.setattr(kd, "ROOT", tmp_path)
    assert kd.stale() == ["docs/lowering.md (LoweringConfig)"]
    kd.write()
    assert kd.stale() == []


def _amk(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "amk", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


@pytest.mark.parametrize("argv,message", [
    (["compile", "config:tiny-llama", "--late-append", "1", "--no-check", "--no-tuned"],
     "amk compile: --late-append 1 does nothing without --fuse 1: set --fuse 1 or --late-append 0"),
    (["compile", "config:tiny-llama", "--fuse", "1", "--fuse-reduce", "1", "--no-check"],
     "--fuse-reduce 1 does nothing at one rank (--tp 1)"),
    (["compile", "config:tiny-qwen3", "--fuse", "1", "--late-append", "1", "--no-check"],
     "--late-append 1 does nothing for config:tiny-qwen3: its attention has a q/k norm"),
    (["compile", "config:tiny-llama", "--gemv-block", "16x128", "--no-check"],
     "--gemv-block is a knob of the triton backend's kernel; --backend sim has none"),
    (["compile", "config:tiny-llama", "--backend", "triton", "--x-stage", "0", "--no-check"],
     "--x-reuse 1 does nothing without --x-stage 1"),
    (["generate", "config:tiny-llama", "--prompt", "hi", "--tp", "2", "--allreduce", "twoshot", "--fuse", "1",
      "--fuse-reduce", "1"], "--fuse-reduce 1 does nothing without --allreduce oneshot or fused"),
    (["run", "examples/nonexistent.amk", "--ring-rows", "8"],
     "--ring-rows is a knob of the triton backend's kernel; --backend sim has none"),
    (["bench", "config:tiny-llama", "--gemv-stages", "9"], "amk bench: --gemv-stages: must be an integer in 1..8"),
])
def test_the_cli_refuses_in_one_line(argv, message):
    r = _amk(*argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "Traceback" not in r.stderr, r.stderr
