"""Schedule edits as amk uses them: apply, validate, report (``amk edit`` and ``amk mcp``).

``edit_program(prog, edits)`` applies an edit list (ir/edits.py; ``replace`` through
lowering/placement.py) and validates the result with the project's validator; nothing here
constructs a backend executor: an edited schedule runs only after it was accepted, and only
where a caller asks for a run. ``verdict_report`` turns the verdict into plain data with each
error's class, message, tasks, buffers and witness (the cycle of a deadlock, the racing pair
and its regions, ...).
"""

from __future__ import annotations

import json
from typing import Any

from ground.errors import AmkError
from ir.program import ScheduleProgram

#: the longest witness (JSON characters) the text verdict prints; --json carries all of it
WITNESS_CHARS = 2000


def read_edits(path: str) -> list:
    """The checked edit list of a JSON file (ir.edits.load_edits). Raises AmkError (exit 2)
    for an unreadable file, invalid JSON or an edit that breaks the schema."""
    from ir.edits import load_edits
    from ir.io import read_text_file

    return load_edits(read_text_file(path), path)


def edit_program(prog: ScheduleProgram, edits: list) -> tuple[ScheduleProgram, Any]:
    """Apply ``edits`` (``ir.edits.Edit`` objects, or the raw JSON list) to a copy of
    ``prog`` and validate it. Returns (edited program, ``validator.Verdict``). Raises
    EditError (exit 2) for an edit that cannot apply; a schedule the validator rejects is
    a verdict, not an exception."""
    from ir.edits import Edit, parse_edits
    from lowering.placement import apply_edits
    from validator import validate

    if not all(isinstance(e, Edit) for e in edits):
        edits = parse_edits(edits)
    new = apply_edits(prog, edits)
    return new, validate(new)


def _plain(x: Any) -> Any:
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def verdict_report(verdict: Any) -> dict[str, Any]:
    """``{"ok", "errors": [{"class", "message", "tasks", "buffers", "witness"}], "classes"}``
    as JSON-ready data (numpy scalars become numbers)."""
    errs = [_plain(f.to_json()) for f in verdict.errors]
    return {"ok": verdict.ok, "classes": sorted({e["class"] for e in errs}), "errors": errs}


def format_verdict(report: dict[str, Any], name: str) -> list[str]:
    """Text lines of a verdict report: ``accepted NAME`` or ``rejected NAME: n error(s)``
    and, per error, ``Class: message``, the tasks and the witness (truncated)."""
    if report["ok"]:
        return [f"accepted {name}"]
    lines = [f"rejected {name}: {len(report['errors'])} error(s): {', '.join(report['classes'])}"]
    for e in report["errors"]:
        lines.append(f"{e['class']}: {e['message']}")
        if e.get("tasks"):
            lines.append(f"  tasks: {', '.join(map(str, e['tasks']))}")
        if e.get("witness"):
            w = json.dumps(e["witness"], separators=(",", ":"))
            if len(w) > WITNESS_CHARS:
                w = w[:WITNESS_CHARS] + " ... (truncated; --json carries all of it)"
            lines.append(f"  witness: {w}")
    return lines


def write_program(prog: ScheduleProgram, path: str) -> None:
    """Write ``prog`` atomically (text, or JSON for ``*.json``); AmkError naming the path."""
    from ir.io import save_program

    try:
        save_program(prog, path)
    except ValueError as e:
        raise AmkError(f"{path}: cannot write the edited program: {e}") from None
