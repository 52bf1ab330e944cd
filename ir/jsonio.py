"""The JSON form of a ScheduleProgram: ``program_to_json`` / ``program_from_json``.

Layout (docs/ir.md, "JSON form"); every field is written, in this order::

    {"version": 1, "name": str, "target": {"name", "sms", "max_workers", "backend"},
     "ranks": int, "workers": int, "max_epochs": int, "slots": int, "config": {...},
     "buffers":  [{"name", "kind", "dtype", "shape": [int], "placement", "rank": int|null,
                   "source": null | {"key": str, "ranges": [[start, stop], ...]}}],
     "counters": [{"name", "rank", "width"}],
     "tasks":    [{"id", "rank", "worker", "op", "ins": [region], "outs": [region],
                   "params": {...}, "waits": [{"counter", "threshold", "offset"}],
                   "signals": [{"counter", "amount"}], "group": str|null}]}

    region = {"buffer": str, "rank": int, "ranges": [[bound, bound], ...]}
    bound  = int | {"const": int, "coef": int}          (const + coef * s)

Reading requires ``version``, ``name``, ``ranks``, ``workers``, ``buffers``, ``counters``
and ``tasks`` (an empty list is ``[]``), accepts missing optional fields (their defaults)
and rejects unknown fields and wrong types with :class:`IRJsonError`, whose ``path`` names
the field, e.g. ``tasks[3].waits[0].threshold``. Like the text parser it does no semantic validation.
Floats round-trip bit-exactly (Python's json writes ``repr``); non-finite floats are
written as ``Infinity`` / ``NaN`` (Python's json extension).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ground.errors import AmkError
from ir.text import gc_paused
from ir.program import (
    IR_VERSION, Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task,
    Wait, WeightSource,
)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class IRJsonError(AmkError):
    """A malformed JSON program.

    Attributes: ``file``, ``path`` (e.g. ``"tasks[3].waits[0].threshold"``, ``""`` for the
    document), ``message``, and ``line``/``column`` (1-based) for JSON syntax errors, else
    None. ``str(e)`` is ``"file: path: message"`` or ``"file:line:column: message"``.
    """

    def __init__(self, file: str, path: str, message: str, line: int | None = None,
                 column: int | None = None):
        self.file, self.path, self.message = file, path, message
        self.line, self.column = line, column
        if line is not None:
            text = f"{file}:{line}:{column}: {message}"
        elif path:
            text = f"{file}: {path}: {message}"
        else:
            text = f"{file}: {message}"
        super().__init__(text)


# ------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------

def _bound_json(b: Bound):
    return b.const if not b.coef else {"const": b.const, "coef": b.coef}


def region_to_json(r: Region) -> dict:
    return {"buffer": r.buffer, "rank": r.rank,
            "ranges": [[_bound_json(x.start), _bound_json(x.stop)] for x in r.ranges]}


def _value_json(v: Any, where: str):
    """Check a param/config value is representable (and in the text form too)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if hasattr(v, "__index__"):  # numpy integers: the same value as a Python int
        return v.__index__()
    if isinstance(v, list):
        return [_value_json(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise ValueError(f"{where}: key {k!r} is not a string")
            out[k] = _value_json(x, f"{where}.{k}")
        return out
    raise ValueError(f"{where}: {type(v).__name__} values cannot be written in the IR "
                     "(use int, float, str, bool, None, list or dict)")


def buffer_to_json(b: Buffer) -> dict:
    src = None
    if b.source is not None:
        src = {"key": b.source.key, "ranges": [list(r) for r in b.source.ranges]}
    return {"name": b.name, "kind": b.kind, "dtype": b.dtype, "shape": list(b.shape),
            "placement": b.placement, "rank": b.rank, "source": src}


def task_to_json(t: Task) -> dict:
    return {
        "id": t.id, "rank": t.rank, "worker": t.worker, "op": t.op,
        "ins": [region_to_json(r) for r in t.ins],
        "outs": [region_to_json(r) for r in t.outs],
        "params": _value_json(t.params, f"task {t.id!r} params"),
        "waits": [{"counter": w.counter, "threshold": w.threshold, "offset": w.offset}
                  for w in t.waits],
        "signals": [{"counter": s.counter, "amount": s.amount} for s in t.signals],
        "group": t.group,
    }


def program_to_json(prog: ScheduleProgram) -> dict:
    """The JSON form of ``prog`` as plain dicts/lists (see the module doc for the layout).

    Raises ValueError for a config/param value the IR cannot hold (e.g. a tuple).
    """
    with gc_paused():
        return _program_to_json(prog)


def _program_to_json(prog: ScheduleProgram) -> dict:
    tg = prog.target
    return {
        "version": prog.version,
        "name": prog.name,
        "target": {"name": tg.name, "sms": tg.sms, "max_workers": tg.max_workers,
                   "backend": tg.backend},
        "ranks": prog.ranks,
        "workers": prog.workers,
        "max_epochs": prog.max_epochs,
        "slots": prog.slots,
        "config": _value_json(prog.config, "config"),
        "buffers": [buffer_to_json(b) for b in prog.buffers],
        "counters": [{"name": c.name, "rank": c.rank, "width": c.width} for c in prog.counters],
        "tasks": [task_to_json(t) for t in prog.tasks],
    }


def _dump(v) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))


def dumps(prog: ScheduleProgram) -> str:
    """Canonical JSON text: top-level fields one per line, one buffer/counter/task per line.

    ``loads(dumps(p)) == p`` and ``dumps(loads(dumps(p))) == dumps(p)``.
    """
    with gc_paused():
        return _dumps(program_to_json(prog))


def _dumps(obj: dict) -> str:
    lines = ["{"]
    keys = list(obj)
    for i, key in enumerate(keys):
        comma = "," if i < len(keys) - 1 else ""
        val = obj[key]
        if key in ("buffers", "counters", "tasks") and val:
            lines.append(f" {_dump(key)}: [")
            lines.extend(f"  {_dump(x)}," for x in val[:-1])
            lines.append(f"  {_dump(val[-1])}")
            lines.append(f" ]{comma}")
        else:
            lines.append(f" {_dump(key)}: {_dump(val)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------

class _Bad(Exception):
    """A field error; ``parts`` is the path from the failing field up (reversed)."""

    def __init__(self, part: str, message: str):
        super().__init__(message)
        self.parts = [part] if part else []
        self.message = message


def json_type(v) -> str:
    """The JSON-schema type of a value: ``null``, ``boolean``, ``integer``, ``number``,
    ``string``, ``array`` or ``object`` (anything else)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _type_name(v) -> str:
    """The value's JSON type as a message names it (an integer is a number)."""
    t = json_type(v)
    return "number" if t == "integer" else t


def _want(v, what: str) -> str:
    try:
        shown = json.dumps(v)
    except (TypeError, ValueError):
        return f"expected {what}, got a Python {type(v).__name__}"
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"expected {what}, got {_type_name(v)} {shown}"


def _get_typed(d: dict, key: str, typ: type, what: str, default=...):
    """``d[key]``, exactly of type ``typ`` (``what``: its name in messages); ``default``
    when absent, which ``...`` makes a missing-field error."""
    v = d.get(key, default)
    if v is ...:
        raise _Bad(key, f"missing field ({what})")
    if type(v) is not typ:
        raise _Bad(key, _want(v, what))
    return v


def _get_int(d: dict, key: str, default=...):
    return _get_typed(d, key, int, "an integer", default)


def _get_opt_int(d: dict, key: str, default):
    v = d.get(key, default)
    if v is None:
        return None
    if type(v) is not int:
        raise _Bad(key, _want(v, "an integer or null"))
    return v


def _get_str(d: dict, key: str, default=...):
    return _get_typed(d, key, str, "a string", default)


def _get_opt_str(d: dict, key: str):
    v = d.get(key)
    if v is not None and type(v) is not str:
        raise _Bad(key, _want(v, "a string or null"))
    return v


def _get_list(d: dict, key: str, required: bool = False) -> list:
    if key not in d:
        if required:
            raise _Bad(key, "missing field (an array)")
        return []
    v = d[key]
    if type(v) is not list:
        raise _Bad(key, _want(v, "an array"))
    return v


def _obj(v, what: str, fields: frozenset[str]) -> dict:
    if type(v) is not dict:
        raise _Bad("", _want(v, f"an object ({what})"))
    if not fields.issuperset(v):
        extra = sorted(set(v) - fields)
        raise _Bad(extra[0], f"unknown field in {what} (known: {', '.join(sorted(fields))})")
    return v


def _items(seq: list, fn):
    out = []
    for i, x in enumerate(seq):
        try:
            out.append(fn(x))
        except _Bad as e:
            e.parts.append(f"[{i}]")
            raise
    return out


def _in(part: str, fn, *args):
    try:
        return fn(*args)
    except _Bad as e:
        e.parts.append(part)
        raise


def _key_part(k: str) -> str:
    return f".{k}" if _IDENT.fullmatch(k) else f"[{json.dumps(k)}]"


def _check_value(v):
    """A copy of a param/config value: null, bool, number, string, array or object."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if type(v) is list:
        return _items(v, _check_value)
    if type(v) is dict:
        return {k: _in(_key_part(k), _check_value, x) for k, x in v.items()}
    raise _Bad("", _want(v, "a JSON value"))


_BOUND_F = frozenset({"const", "coef"})
_REGION_F = frozenset({"buffer", "rank", "ranges"})
_WAIT_F = frozenset({"counter", "threshold", "offset"})
_SIGNAL_F = frozenset({"counter", "amount"})
_TASK_F = frozenset({"id", "rank", "worker", "op", "ins", "outs", "params", "waits", "signals",
                     "group"})
_BUFFER_F = frozenset({"name", "kind", "dtype", "shape", "placement", "rank", "source"})
_SOURCE_F = frozenset({"key", "ranges"})
_COUNTER_F = frozenset({"name", "rank", "width"})
_TARGET_F = frozenset({"name", "sms", "max_workers", "backend"})
_PROGRAM_F = frozenset({"version", "name", "target", "ranks", "workers", "max_epochs", "slots",
                        "config", "buffers", "counters", "tasks"})


# Bounds and ranges repeat a lot in big programs; the objects are frozen, so share them.
_BOUNDS: dict[tuple[int, int], Bound] = {}
_RANGES: dict[tuple, Range] = {}
_CACHE_LIMIT = 1 << 20


def _bound(v) -> Bound:
    if type(v) is int:
        key = (v, 0)
    elif type(v) is dict:
        _obj(v, "bound", _BOUND_F)
        key = (_get_int(v, "const"), _get_int(v, "coef", 0))
    else:
        raise _Bad("", _want(v, 'an integer or {"const": int, "coef": int}'))
    b = _BOUNDS.get(key)
    if b is None:
        if len(_BOUNDS) > _CACHE_LIMIT:
            _BOUNDS.clear()
        b = _BOUNDS[key] = Bound(*key)
    return b


def _pair(v, fn):
    if type(v) is not list or len(v) != 2:
        raise _Bad("", _want(v, "a [start, stop] pair"))
    return _in("[0]", fn, v[0]), _in("[1]", fn, v[1])


def _range(v) -> Range:
    if type(v) is list and len(v) == 2 and type(v[0]) is int and type(v[1]) is int:
        key = (v[0], v[1])  # the common concrete case, without building Bounds first
        r = _RANGES.get(key)
        if r is None:
            if len(_RANGES) > _CACHE_LIMIT:
                _RANGES.clear()
            r = _RANGES[key] = Range(_bound(v[0]), _bound(v[1]))
        return r
    a, b = _pair(v, _bound)
    return Range(a, b)


def _region(v) -> Region:
    _obj(v, "region", _REGION_F)
    out = []
    for i, x in enumerate(_get_list(v, "ranges", True)):
        try:
            out.append(_range(x))
        except _Bad as e:
            e.parts += [f"[{i}]", "ranges"]
            raise
    return Region(_get_str(v, "buffer"), _get_int(v, "rank"), tuple(out))


def _wait(v) -> Wait:
    _obj(v, "wait", _WAIT_F)
    return Wait(_get_str(v, "counter"), _get_int(v, "threshold"), _get_int(v, "offset", 0))


def _signal(v) -> Signal:
    _obj(v, "signal", _SIGNAL_F)
    return Signal(_get_str(v, "counter"), _get_int(v, "amount", 1))


def _params(d: dict, key: str) -> dict:
    v = d.get(key, {})
    if type(v) is not dict:
        raise _Bad(key, _want(v, "an object"))
    return _in(key, _check_value, v) if v else {}


def _task(v) -> Task:
    _obj(v, "task", _TASK_F)
    tid = _get_str(v, "id")
    try:
        return Task(
            id=tid, rank=_get_int(v, "rank"), worker=_get_int(v, "worker"),
            op=_get_str(v, "op"),
            ins=tuple(_in("ins", _items, _get_list(v, "ins"), _region)),
            outs=tuple(_in("outs", _items, _get_list(v, "outs"), _region)),
            params=_params(v, "params"),
            waits=tuple(_in("waits", _items, _get_list(v, "waits"), _wait)),
            signals=tuple(_in("signals", _items, _get_list(v, "signals"), _signal)),
            group=_get_opt_str(v, "group"),
        )
    except _Bad as e:
        e.message += f" (task {tid!r})"
        raise


def _int_value(v) -> int:
    if type(v) is not int:
        raise _Bad("", _want(v, "an integer"))
    return v


def _source(v) -> WeightSource | None:
    if v is None:
        return None
    _obj(v, "source", _SOURCE_F)
    ranges = _in("ranges", _items, _get_list(v, "ranges"), lambda p: _pair(p, _int_value))
    return WeightSource(_get_str(v, "key"), tuple(ranges))


def _buffer(v) -> Buffer:
    _obj(v, "buffer", _BUFFER_F)
    name = _get_str(v, "name")
    try:
        placement = _get_str(v, "placement", "local")
        return Buffer(
            name=name, kind=_get_str(v, "kind"), dtype=_get_str(v, "dtype"),
            shape=tuple(_in("shape", _items, _get_list(v, "shape", True), _int_value)),
            placement=placement,
            rank=_get_opt_int(v, "rank", None if placement == "symmetric" else 0),
            source=_in("source", _source, v.get("source")),
        )
    except _Bad as e:
        e.message += f" (buffer {name!r})"
        raise


def _counter(v) -> Counter:
    _obj(v, "counter", _COUNTER_F)
    return Counter(_get_str(v, "name"), _get_int(v, "rank"), _get_int(v, "width", 32))


def _target(v) -> Target:
    _obj(v, "target", _TARGET_F)
    d = Target()
    return Target(name=_get_str(v, "name", d.name), sms=_get_int(v, "sms", d.sms),
                  max_workers=_get_int(v, "max_workers", d.max_workers),
                  backend=_get_str(v, "backend", d.backend))


# Top-level fields a program must have; the rest default as in the text form's optional
# header lines. An empty list is written ``[]``: a missing list is a truncated or mistyped
# file, not an empty program.
_PROGRAM_REQUIRED = ("version", "name", "ranks", "workers", "buffers", "counters", "tasks")


def _program(obj) -> ScheduleProgram:
    _obj(obj, "program", _PROGRAM_F)
    for key in _PROGRAM_REQUIRED:  # name the first missing field, in layout order
        if key not in obj:
            what = "an array" if key in ("buffers", "counters", "tasks") else \
                "a string" if key == "name" else "an integer"
            raise _Bad(key, f"missing top-level field {key!r} ({what}; "
                            f"required: {', '.join(_PROGRAM_REQUIRED)})")
    version = _get_int(obj, "version")
    if version != IR_VERSION:
        raise _Bad("version", f"unsupported IR version {version} (this amk reads version "
                              f"{IR_VERSION})")
    d = ScheduleProgram(name="", ranks=0, workers=0)
    config = obj.get("config", {})
    if type(config) is not dict:
        raise _Bad("config", _want(config, "an object"))
    config = _in("config", _check_value, config)
    return ScheduleProgram(
        name=_get_str(obj, "name"),
        ranks=_get_int(obj, "ranks"),
        workers=_get_int(obj, "workers"),
        target=_in("target", _target, obj["target"]) if "target" in obj else Target(),
        max_epochs=_get_int(obj, "max_epochs", d.max_epochs),
        slots=_get_int(obj, "slots", d.slots),
        config=config,
        buffers=_in("buffers", _items, _get_list(obj, "buffers", True), _buffer),
        counters=_in("counters", _items, _get_list(obj, "counters", True), _counter),
        tasks=_in("tasks", _items, _get_list(obj, "tasks", True), _task),
        version=version,
    )


def _join_path(parts: list[str]) -> str:
    """Reversed parts -> ``tasks[3].waits[0].threshold``."""
    out = ""
    for p in reversed(parts):
        if not p:
            continue
        if p.startswith("["):
            out += p
        elif p.startswith("."):
            out += p
        else:
            out += ("." if out else "") + p
    return out


def program_from_json(obj: Any, filename: str = "<json>") -> ScheduleProgram:
    """Build a ScheduleProgram from its JSON form (a dict as ``json.loads`` returns it).

    Missing optional fields take their defaults; unknown fields and wrong types raise
    IRJsonError with the field's path. No semantic validation. The returned program
    shares no mutable objects with ``obj`` (params and config are copied).
    """
    try:
        with gc_paused():
            prog = _program(obj)
    except _Bad as e:
        raise IRJsonError(filename, _join_path(e.parts), e.message) from None
    return prog


def loads(text: str, filename: str = "<json>") -> ScheduleProgram:
    """Parse JSON text into a program; a JSON syntax error names file:line:column."""
    try:
        with gc_paused():
            obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise IRJsonError(filename, "", f"invalid JSON: {e.msg}", e.lineno, e.colno) from None
    return program_from_json(obj, filename)
