"""Every command's --help shows its description, and the root --help its one-line help."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["compile", "generate", "search", "info", "run", "validate", "validate-corpus", "edit", "dist", "mcp"]


def _amk(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="2000")
    return subprocess.run([sys.executable, "-m", "amk", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", COMMANDS)
def test_command_help_shows_its_description(name):
    mod = importlib.import_module(f"amk.commands.{name.replace('-', '_')}")
    r = _amk(name, "--help")
    assert r.returncode == 0, r.stderr
    assert " ".join(mod.DESCRIPTION.split()) in " ".join(r.stdout.split())
    assert r.stdout.startswith(f"usage: amk {name} ")


def test_root_help_lists_each_command_with_its_help():
    r = _amk("--help")
    assert r.returncode == 0, r.stderr
    for name in COMMANDS:
        mod = importlib.import_module(f"amk.commands.{name.replace('-', '_')}")
        assert mod.HELP in r.stdout, name
