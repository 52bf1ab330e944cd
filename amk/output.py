"""How amk commands write their results: one convention for every subcommand.

* ``--json`` is a flag (it takes no value): the command prints exactly one JSON object, on
  one line, to stdout, and nothing else goes to stdout. Tables, progress and warnings go to
  stderr. ``amk.cli.main`` enforces it: while a ``--json`` command runs, ``sys.stdout`` is
  redirected to stderr (so a stray ``print`` in a library cannot corrupt the JSON) and
  ``emit_json`` writes to the real stdout. A command that fails with ``AmkError`` before it
  printed its object prints ``{"ok": false, "error": ..., "exit_code": ...}`` instead.
* Without ``--json``, human output (tables, verdicts) goes to stdout and progress to stderr.
* Result files are written by an explicit flag (``--out``) and always through
  ``ground.files`` (temporary file + rename: whole or not at all; a failed write is one
  line naming the path, exit code 2).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from ground.errors import AmkError
from ground.files import finite

# The real stdout while a --json command runs (sys.stdout is stderr then), and whether the
# command's JSON object has been printed.
_stream = None
_emitted = False


def json_mode(args: Any) -> bool:
    """Whether ``args`` (an argparse Namespace) asks for JSON output (``--json`` given)."""
    return getattr(args, "json", None) is True


@contextlib.contextmanager
def json_stdout() -> Iterator[None]:
    """Run the body with ``sys.stdout`` redirected to stderr; ``emit_json`` still reaches the
    original stdout. Used by ``amk.cli.main`` around a ``--json`` command."""
    global _stream, _emitted
    saved = (_stream, _emitted)
    _stream, _emitted = sys.stdout, False
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _stream, _emitted = saved


def emit_json(obj: Any, default: Callable[[Any], Any] = str) -> None:
    """Print ``obj`` as one line of strict JSON on the command's stdout.

    NaN and infinities become ``null`` (``ground.files.finite``); objects json cannot encode
    go through ``default`` (``str`` unless given).
    """
    global _emitted
    stream = _stream if _stream is not None else sys.stdout
    stream.write(json.dumps(finite(obj), default=default) + "\n")
    stream.flush()
    _emitted = True


def emitted() -> bool:
    """Whether ``emit_json`` ran since the current ``json_stdout`` block began."""
    return _emitted


def human_console(args: Any = None, **kw: Any):
    """A rich Console for the command's human output: stdout, or stderr under ``--json``."""
    from rich.console import Console

    kw.setdefault("highlight", False)
    return Console(stderr=json_mode(args), **kw)


def check_writable_dir(directory: str | os.PathLike, what: str) -> Path:
    """Create ``directory`` (and its parents) and check that a file can be created in it, so
    a long run fails at once, not at its end. Returns the directory as a Path.

    Raises:
        AmkError: ``"{what}: cannot write to {directory}: {reason}"`` (exit code 2).
    """
    d = Path(directory) if str(directory) else Path(".")
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d, prefix=".amk-write-check."):
            pass
    except OSError as e:
        raise AmkError(f"{what}: cannot write to {d}: {e.strerror or e}") from None
    return d
