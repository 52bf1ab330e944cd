"""The import contracts of pyproject.toml ([tool.importlinter], docs/layout.md) hold, and
an upward import, a cycle or a module placed in no layer breaks them.

Each check runs import-linter's ``lint-imports`` in a subprocess. A planted import goes
into a copy of the packages (and pyproject.toml) under tmp_path, never into the tree:
``lint-imports`` puts its working directory first on sys.path, so run from the copy it
reads the copy.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
ROOT_PACKAGES = CONFIG["root_packages"]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports --no-cache`` (the console command's entry point) run in ``cwd``."""
    env = {**os.environ, "COLUMNS": "200"}  # rich wraps long report lines at 80 columns
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--no-cache", "--no-logo"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the root packages and pyproject.toml (no caches, no tests or data)."""
    for pkg in ROOT_PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_contracts_hold():
    r = lint_imports(ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"Contracts: {len(CONFIG['contracts'])} kept, 0 broken." in out, out


def test_the_copy_holds_too(tree):
    """The planted cases below start from a copy that passes, so only the plant breaks them."""
    r = lint_imports(tree)
    assert r.returncode == 0, r.stdout + r.stderr


# (file in the copy, line appended to it, text the report must contain)
PLANTED = {
    "ir imports search": (
        "ir/program.py", "from search import loop", ["ir.program -> search.loop"]),
    "search imports amk": (
        "search/space.py", "from amk import pipeline", ["search.space -> amk.pipeline"]),
    "validator imports a backend": (
        "validator/verdict.py", "import lowering.triton.runtime",
        ["validator is not allowed to import lowering.triton", "validator.verdict -> lowering.triton.runtime"]),
    "lowering imports a backend": (
        "lowering/partition.py", "from lowering import sim", ["lowering.partition -> lowering.sim"]),
    "models imports lowering": (
        "models/graph.py", "from lowering.config import LoweringConfig", ["models.graph -> lowering.config"]),
    "ground imports ir": (
        "ground/timing.py", "import ir.program", ["ground.timing -> ir.program"]),
    "the library imports a command": (
        "amk/pipeline.py", "from amk.commands.bench import run",
        ["amk.pipeline is not allowed to import amk.commands", "amk.pipeline -> amk.commands.bench"]),
    "a backend imports the other": (
        "lowering/sim.py", "from lowering.triton import table", ["lowering.sim -> lowering.triton.table"]),
    "a cycle in ground": (
        "ground/errors.py", "import ground.files", ["No cycles are allowed in ground"]),
    "a lowering module in no layer": (
        "lowering/planted.py", "", ["not listed as layers", "- lowering.planted"]),
}


@pytest.mark.parametrize("case", PLANTED)
def test_planted_import_breaks_the_contracts(tree, case):
    path, line, expected = PLANTED[case]
    f = tree / path
    f.write_text((f.read_text() if f.exists() else "") + f"\n{line}\n")
    r = lint_imports(tree)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "BROKEN" in out, out
    for text in expected:
        assert text in out, out
