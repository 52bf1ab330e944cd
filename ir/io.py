"""Load and save ScheduleProgram files in either form.

``*.json`` is the JSON form (ir/jsonio.py); any other suffix (``*.amk`` by convention)
is the text form (ir/text.py). A file with another suffix whose first non-blank
character is ``{`` is read as JSON.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ground.errors import AmkError
from ground.files import atomic_write_text
from ir import jsonio, text
from ir.program import ScheduleProgram

TEXT_SUFFIX = ".amk"
JSON_SUFFIX = ".json"


def detect_format(path: str | os.PathLike, content: str | None = None) -> str:
    """``"json"`` or ``"text"``: by suffix, else by content (leading ``{`` means JSON)."""
    suffix = Path(path).suffix.lower()
    if suffix == JSON_SUFFIX:
        return "json"
    if suffix == TEXT_SUFFIX or content is None:
        return "text"
    return "json" if content.lstrip().startswith("{") else "text"


def read_text_file(path: str | os.PathLike) -> str:
    """A UTF-8 file's contents; an unreadable or non-UTF-8 file is an AmkError."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AmkError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise AmkError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None


def load_program(path: str | os.PathLike) -> ScheduleProgram:
    """Read a program from a text (``.amk``) or JSON (``.json``) file.

    Raises IRParseError / IRJsonError (both AmkError) for malformed content, with the
    path in the message, and AmkError for an unreadable file. No semantic validation.
    """
    return load_program_located(path)[0]


def load_program_located(path: str | os.PathLike
                         ) -> tuple[ScheduleProgram, Callable[[int], str]]:
    """Like :func:`load_program`, and also ``where(i)``: the place of ``prog.tasks[i]`` in
    the file, ``"path:line:column"`` for the text form and ``"path: tasks[i]"`` for JSON
    (the field path of IRJsonError). Same errors as ``load_program``."""
    content = read_text_file(path)
    name = str(path)
    if detect_format(path, content) == "json":
        return jsonio.loads(content, name), lambda i: f"{name}: tasks[{i}]"
    positions: list[tuple[int, int]] = []
    prog = text.parse_program(content, name, positions)
    return prog, lambda i: f"{name}:{positions[i][0]}:{positions[i][1]}"


def dumps_program(prog: ScheduleProgram, fmt: str = "text") -> str:
    """The program as text (``fmt="text"``) or JSON (``fmt="json"``)."""
    if fmt == "json":
        return jsonio.dumps(prog)
    if fmt == "text":
        return text.format_program(prog)
    raise ValueError(f"unknown program format {fmt!r} (expected 'text' or 'json')")


def save_program(prog: ScheduleProgram, path: str | os.PathLike) -> Path:
    """Write ``prog`` to ``path`` (JSON if it ends in ``.json``, else text), atomically.

    The file is written to a temporary name in the same directory and renamed, so a
    reader never sees half a program. Returns the path. Raises AmkError if the directory
    is not writable, ValueError if the program holds a value the IR cannot represent.
    """
    path = Path(path)
    data = dumps_program(prog, "json" if detect_format(path) == "json" else "text")
    return atomic_write_text(path, data, durable=False)
