"""The text form of a ScheduleProgram: ``parse_program`` and ``format_program``.

The format (docs/ir.md; grammar in ir/grammar.lark) has one declaration or task per line
and ``#`` comments::

    amk 1
    program "allreduce-2r-slots"
    target generic sms=132 max_workers=132 backend=sim
    ranks 2 workers 1
    epochs max=1048576 slots=2
    config allreduce="oneshot" reuse="slots"
    buffer rx activation f32 [2, 2, 8] symmetric
    counter c.rx.r0 @r0 width=32
    task put.r0.to1 @r0.w0 put(x.r0[0:8]) -> (rx@r1[s:s+1, 0:1, 0:8]) signal(c.rx.r1 += 1) group=ar0

Parsing is syntactic only: an unknown buffer, counter or op still parses (the validator
reports it with the task id). Syntax errors raise :class:`IRParseError` with
``file:line:column`` and the tokens that were expected.

Speed: the lowering emits programs of 100k+ tasks, and lark's LALR parser costs ~170 us
per task line. Lines in the canonical spelling (what ``format_program`` writes) therefore
go through a regex fast path (``_fast_task`` and friends) that accepts a SUBSET of the
grammar and builds the same objects; any line it does not accept is parsed by lark, which
either builds it or reports the error. tests/test_ir_text.py checks that both paths agree.

Round trips are exact: ``parse_program(format_program(p)) == p`` and
``format_program(parse_program(t)) == t`` for canonical ``t``. Floats print with
``repr`` (bit-exact), strings with JSON escapes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from ground.errors import AmkError
from ir.program import (
    IR_VERSION, Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task,
    Wait, WeightSource,
)

GRAMMAR_PATH = Path(__file__).with_name("grammar.lark")

# Header lines: each at most once. `amk` must come first; `program` and `ranks` are required.
HEADER_LINES = ("amk", "program", "target", "ranks", "epochs", "config")
_TARGET_FIELDS = {"sms": int, "max_workers": int, "backend": str}
_EPOCH_FIELDS = {"max": "max_epochs", "slots": "slots"}

# Words that are keywords somewhere in the grammar: the formatter quotes a name spelled
# like one of them, so the output never depends on the contextual lexer's mercy.
_RESERVED = frozenset({
    "amk", "program", "target", "ranks", "workers", "epochs", "config", "buffer", "counter",
    "task", "local", "symmetric", "src", "width", "wait", "signal", "group", "s", "true",
    "false", "null", "inf", "nan",
})
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")

# Readable words for lark's regex terminal names (string terminals print as 'literal').
_TERMINAL_WORDS = {
    "NAME": "a name",
    "STRING": 'a quoted string',
    "UINT": "an integer",
    "NEGINT": "an integer",
    "FLOAT": "a float",
    "LOC": "a worker location @rR.wW",
    "RANK": "a rank @rN",
    "EOFF": "an epoch offset @e-N",
    "$END": "end of line",
}


class IRParseError(AmkError):
    """A syntax error in the text form.

    Attributes: ``file``, ``line`` and ``column`` (1-based), ``message``, ``expected``
    (readable descriptions of what would have been accepted; may be empty).
    ``str(e) == "file:line:column: message (expected a, b or c)"``. A subclass of
    ``AmkError`` (exit code 2), so the CLI prints it on one line.
    """

    def __init__(self, file: str, line: int, column: int, message: str,
                 expected: list[str] | None = None):
        self.file, self.line, self.column = file, line, column
        self.message = message
        self.expected = list(expected or [])
        text = f"{file}:{line}:{column}: {message}"
        if self.expected:
            text += f" (expected {_or_list(self.expected)})"
        super().__init__(text)


@contextlib.contextmanager
def gc_paused():
    """Pause Python's cyclic garbage collector while building or printing a big program.

    Building 150k tasks allocates millions of small acyclic objects; every generation-2
    collection then walks the whole heap, which made parsing 2-4x slower. The collector's
    previous state is restored on exit.

    Re-enabling alone would leave every object built meanwhile in the youngest generation,
    whose count is far over its threshold: the next allocation would scan them all (0.2 s
    after parsing 61k tasks). So on exit they are moved to the oldest generation without a
    scan (``gc.freeze`` then ``gc.unfreeze``, which also resets the young count), where a
    long-lived program belongs. Only after a big build (over ``_PROMOTE_AFTER`` new tracked
    objects: a small one is scanned at once, as usual), and not when the caller has frozen
    objects of its own (unfreezing would release them too).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_count()[0] > _PROMOTE_AFTER and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


_PROMOTE_AFTER = 10_000  # new GC-tracked objects (the young threshold is 700)


def _or_list(words: list[str]) -> str:
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


class _LineError(Exception):
    """An error inside one line: column (1-based), message, expected words."""

    def __init__(self, column: int, message: str, expected: list[str] | None = None):
        super().__init__(message)
        self.column, self.message, self.expected = column, message, expected or []


# ------------------------------------------------------------------------------------
# formatting
# ------------------------------------------------------------------------------------

def format_ident(name: str) -> str:
    """A name as the text form writes it: bare if it is a plain name, else a JSON string."""
    if isinstance(name, str) and _NAME_RE.fullmatch(name) and name not in _RESERVED:
        return name
    return format_string(name)


def format_string(s: str) -> str:
    """A JSON string literal (escapes for quotes, backslashes and control characters)."""
    if not isinstance(s, str):
        raise ValueError(f"expected a string, got {type(s).__name__} {s!r}")
    try:
        out = json.dumps(s, ensure_ascii=False)
        out.encode("utf-8")
        return out
    except UnicodeEncodeError:  # lone surrogates: keep them as \u escapes
        return json.dumps(s, ensure_ascii=True)


def format_value(v: Any, where: str = "value") -> str:
    """A param/config value: int, float (repr, bit-exact), str, bool, None, list, dict."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, float):
        return float.__repr__(float(v))  # 'inf', '-inf', 'nan', '1e-05', '-0.0'
    if isinstance(v, str):
        return format_string(v)
    if hasattr(v, "__index__"):  # int, and integer types such as numpy.int64 (lossless)
        return int.__repr__(v.__index__())
    if isinstance(v, list):
        return "[" + ", ".join(format_value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    if isinstance(v, dict):
        return "{" + _format_kvs(v, where, ", ") + "}"
    raise ValueError(
        f"{where}: {type(v).__name__} values cannot be written in the IR "
        "(use int, float, str, bool, None, list or dict)")


def _format_kvs(d: dict, where: str, sep: str) -> str:
    parts = []
    for k, v in d.items():
        if not isinstance(k, str):
            raise ValueError(f"{where}: key {k!r} is not a string")
        parts.append(f"{format_ident(k)}={format_value(v, f'{where}[{k!r}]')}")
    return sep.join(parts)


def _int(v: Any, where: str) -> int:
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise ValueError(f"{where}: expected an int, got {type(v).__name__} {v!r}")
    return v.__index__()


def format_bound(b: Bound) -> str:
    """``7``, ``s``, ``-s``, ``2*s``, ``2*s+1``, ``s-1``."""
    const, coef = b.const, b.coef
    if not coef:
        return str(const)
    head = "s" if coef == 1 else "-s" if coef == -1 else f"{coef}*s"
    if const > 0:
        return f"{head}+{const}"
    if const < 0:
        return f"{head}{const}"
    return head


def format_region(r: Region, task_rank: int) -> str:
    """``name[a:b, c:d]``; ``name@rK[...]`` when the region's rank differs from the task's."""
    rank = "" if r.rank == task_rank else f"@r{_int(r.rank, 'region rank')}"
    body = ", ".join(f"{format_bound(x.start)}:{format_bound(x.stop)}" for x in r.ranges)
    return f"{format_ident(r.buffer)}{rank}[{body}]"


def format_wait(w: Wait) -> str:
    text = f"{format_ident(w.counter)} >= {_int(w.threshold, 'wait threshold')}"
    off = _int(w.offset, "wait offset")
    if off == -1:
        return text + " @prev"
    if off:
        return text + f" @e{off:+d}"
    return text


def format_task(t: Task) -> str:
    """One ``task`` line (without newline)."""
    rank = _int(t.rank, f"task {t.id!r} rank")
    parts = [
        f"task {format_ident(t.id)} @r{rank}.w{_int(t.worker, f'task {t.id!r} worker')} "
        f"{format_ident(t.op)}({', '.join(format_region(r, rank) for r in t.ins)})"
    ]
    if t.outs:
        parts.append(f"-> ({', '.join(format_region(r, rank) for r in t.outs)})")
    if t.params:
        parts.append("{" + _format_kvs(t.params, f"task {t.id!r} params", ", ") + "}")
    if t.waits:
        parts.append(f"wait({', '.join(format_wait(w) for w in t.waits)})")
    if t.signals:
        parts.append("signal(" + ", ".join(
            f"{format_ident(s.counter)} += {_int(s.amount, 'signal amount')}"
            for s in t.signals) + ")")
    if t.group is not None:
        parts.append(f"group={format_ident(t.group)}")
    return " ".join(parts)


def format_buffer(b: Buffer) -> str:
    """One ``buffer`` line: name kind dtype [shape] [placement] [@rK] [src="key"[ranges]]."""
    shape = ", ".join(str(_int(d, f"buffer {b.name!r} shape")) for d in b.shape)
    parts = [f"buffer {format_ident(b.name)} {format_ident(b.kind)} {format_ident(b.dtype)} "
             f"[{shape}]"]
    if b.placement == "symmetric":
        parts.append("symmetric")
    elif b.placement != "local":
        parts.append(format_string(b.placement))
    if b.rank is not None:
        parts.append(f"@r{_int(b.rank, f'buffer {b.name!r} rank')}")
    if b.source is not None:
        src = f"src={format_string(b.source.key)}"
        if b.source.ranges:
            src += "[" + ", ".join(
                f"{_int(a, 'source range')}:{_int(c, 'source range')}"
                for a, c in b.source.ranges) + "]"
        parts.append(src)
    return " ".join(parts)


def format_counter(c: Counter) -> str:
    return (f"counter {format_ident(c.name)} @r{_int(c.rank, f'counter {c.name!r} rank')} "
            f"width={_int(c.width, f'counter {c.name!r} width')}")


def format_program(prog: ScheduleProgram) -> str:
    """The canonical text of ``prog`` (ends with a newline).

    Header lines, then buffers, counters and tasks in list order (a worker's queue order
    is the order of its task lines). The config line is omitted when the config is empty.
    Raises ValueError for a value the format cannot hold (e.g. a tuple in ``config``).
    """
    with gc_paused():
        return _format_program(prog)


def _format_program(prog: ScheduleProgram) -> str:
    tg = prog.target
    lines = [
        f"amk {_int(prog.version, 'version')}",
        f"program {format_string(prog.name)}",
        f"target {format_ident(tg.name)} sms={_int(tg.sms, 'target sms')} "
        f"max_workers={_int(tg.max_workers, 'target max_workers')} "
        f"backend={format_ident(tg.backend)}",
        f"ranks {_int(prog.ranks, 'ranks')} workers {_int(prog.workers, 'workers')}",
        f"epochs max={_int(prog.max_epochs, 'max_epochs')} slots={_int(prog.slots, 'slots')}",
    ]
    if prog.config:
        lines.append("config " + _format_kvs(prog.config, "config", " "))
    if prog.buffers:
        lines.append("")
        lines.extend(format_buffer(b) for b in prog.buffers)
    if prog.counters:
        lines.append("")
        lines.extend(format_counter(c) for c in prog.counters)
    if prog.tasks:
        lines.append("")
        lines.extend(format_task(t) for t in prog.tasks)
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------
# lark path: the grammar is the definition of the language
# ------------------------------------------------------------------------------------

def _col(tok) -> int:
    """A token's 1-based column (1 when lark gives none)."""
    return getattr(tok, "column", None) or 1


class _AtomRules:
    """Transformer rules of the atoms: names, numbers, strings, keywords, lists and maps."""

    def ident(self, c):
        tok = c[0]
        return _Pos(json.loads(tok) if tok.type == "STRING" else str(tok), _col(tok))

    def int(self, c):
        return _Pos(int(c[0]), _col(c[0]))

    def float(self, c):
        return float(c[0])

    def string(self, c):
        return json.loads(c[0])

    def true(self, c):
        return True

    def false(self, c):
        return False

    def null(self, c):
        return _NULL  # not None: lark uses None for an absent optional item

    def pos_inf(self, c):
        return math.inf

    def neg_inf(self, c):
        return -math.inf

    def nan(self, c):
        return math.nan

    def list(self, c):
        return [] if c == [None] else [_plain(v) for v in c]

    def kv(self, c):
        return (c[0], _plain(c[1]))

    def map(self, c):
        return _kv_dict([kv for kv in c if kv is not None])


class _RegionRules:
    """Transformer rules of regions, bounds, params, waits and signals."""

    def const_bound(self, c):
        return Bound(c[0].value)

    def sym_bound(self, c):
        coef = 1 if c[0] is None else c[0].value
        return Bound(c[1] or 0, coef)

    def neg_sym_bound(self, c):
        return Bound(c[0] or 0, -1)

    def plus_offset(self, c):
        return int(c[0])

    def minus_offset(self, c):
        return -int(c[0])

    def neg_offset(self, c):
        return int(c[0])

    def range(self, c):
        return Range(c[0], c[1])

    def region(self, c):
        name, rank, *ranges = c
        ranges = tuple(r for r in ranges if r is not None)
        return (name.value, None if rank is None else int(rank[2:]), ranges)

    def regions(self, c):
        return [r for r in c if r is not None]

    def outs(self, c):
        return c[0]

    def params(self, c):
        return _kv_dict([kv for kv in c if kv is not None])

    def prev_epoch(self, c):
        return -1

    def epoch_offset(self, c):
        return int(c[0][2:])

    def wait(self, c):
        return Wait(c[0].value, c[1].value, 0 if c[2] is None else c[2])

    def waits(self, c):
        return tuple(w for w in c if w is not None)

    def signal(self, c):
        return Signal(c[0].value, c[1].value)

    def signals(self, c):
        return tuple(s for s in c if s is not None)

    def group(self, c):
        return c[0].value


class _TaskRules:
    """The transformer rule of a task line."""

    def task_line(self, c):
        tid, loc, op, ins, outs, params, waits, signals, group = c
        rank_s, worker_s = loc[2:].split(".w")
        rank = int(rank_s)
        return ("task", Task(
            id=tid.value, rank=rank, worker=int(worker_s), op=op.value,
            ins=tuple(_region(r, rank) for r in ins),
            outs=tuple(_region(r, rank) for r in (outs or ())),
            params=params or {}, waits=waits or (), signals=signals or (),
            group=group))


class _DeclarationRules:
    """Transformer rules of buffer and counter lines."""

    def shape(self, c):
        return tuple(d.value for d in c if d is not None)

    def local(self, c):
        return "local"

    def symmetric(self, c):
        return "symmetric"

    def other_placement(self, c):
        return json.loads(c[0])

    def src_range(self, c):
        return (c[0].value, c[1].value)

    def src_ranges(self, c):
        return tuple(r for r in c if r is not None)

    def source(self, c):
        return WeightSource(json.loads(c[0]), c[1] or ())

    def buffer_line(self, c):
        name, kind, dtype, shape, placement, rank, source = c
        return ("buffer", Buffer(
            name=name.value, kind=kind.value, dtype=dtype.value, shape=shape,
            placement=placement or "local",
            rank=None if rank is None else int(rank[2:]), source=source))

    def width(self, c):
        return c[0].value

    def counter_line(self, c):
        name, rank, width = c
        return ("counter", Counter(name.value, int(rank[2:]), 32 if width is None else width))


class _HeaderRules:
    """Transformer rules of the header lines (amk, program, target, ranks, epochs, config)."""

    def version_line(self, c):
        return ("amk", _Pos(int(c[0]), _col(c[0])))

    def program_line(self, c):
        return ("program", c[0].value)

    def setting(self, c):
        key, val = c
        if hasattr(val, "type"):  # a bare NAME token is a string here
            val = str(val)
        return (_Pos(str(key), _col(key)), _plain(val), _value_col(c[1], key))

    def target_line(self, c):
        return ("target", (c[0].value, c[1:]))

    def ranks_line(self, c):
        return ("ranks", (c[0].value, c[1].value))

    def epochs_line(self, c):
        return ("epochs", c)

    def config_line(self, c):
        return ("config", _kv_dict(c))


def _build_transformer():
    """The lark Transformer that builds one line's item from its parse tree: the rule
    classes above, on lark's Transformer (imported here: lark loads only when a line is not
    in the canonical spelling the fast path reads)."""
    from lark import Transformer

    class LineTransformer(_AtomRules, _RegionRules, _TaskRules, _DeclarationRules,
                          _HeaderRules, Transformer):
        """Builds one line's item: ``(kind, payload)``, or None for a blank/comment line."""

        def empty(self, c):
            return None

        def line(self, c):
            return c[0]

    return LineTransformer()


class _Pos:
    """A value with the column it came from (for errors reported after parsing)."""

    __slots__ = ("value", "column")

    def __init__(self, value, column: int):
        self.value, self.column = value, column

    def __eq__(self, other) -> bool:  # the fast path and lark must build equal headers
        return isinstance(other, _Pos) and (self.value, self.column) == (other.value,
                                                                         other.column)

    def __hash__(self) -> int:
        return hash((self.value, self.column))

    def __repr__(self) -> str:
        return f"_Pos({self.value!r}, {self.column})"


_NULL = object()


def _plain(v):
    if isinstance(v, _Pos):
        return v.value
    return None if v is _NULL else v


def _value_col(tok, key) -> int:
    if isinstance(tok, _Pos):
        return tok.column
    c = getattr(tok, "column", None)
    return c if c else (getattr(key, "column", 1) or 1)


def _kv_dict(kvs) -> dict:
    """A dict from ``(key _Pos, value)`` pairs; a repeated key is an error (it would be lost)."""
    out: dict[str, Any] = {}
    for key, val in kvs:
        if key.value in out:
            raise _LineError(key.column, f"duplicate key {key.value!r}")
        out[key.value] = val
    return out


def _region(r, task_rank: int) -> Region:
    name, rank, ranges = r
    return Region(name, task_rank if rank is None else rank, ranges)


@lru_cache(maxsize=1)
def _lark():
    from lark import Lark

    return Lark(GRAMMAR_PATH.read_text(), parser="lalr", lexer="contextual", start="line",
                maybe_placeholders=True, transformer=_build_transformer(),
                propagate_positions=False)


@lru_cache(maxsize=1)
def _terminal_words() -> dict[str, str]:
    words = dict(_TERMINAL_WORDS)
    for t in _lark().terminals:
        if t.pattern.type == "str":
            words[t.name] = f"'{t.pattern.value}'"
    return words


def _readable(names) -> list[str]:
    words = _terminal_words()
    out = {words.get(n, n) for n in names if not n.startswith("__IGNORE")}
    # literals first, then descriptions, each sorted: stable messages for tests and users
    return sorted(out, key=lambda w: (not w.startswith("'"), w))


def _parse_line_lark(line: str):
    """Parse one line with lark; raise _LineError on a syntax error."""
    from lark.exceptions import UnexpectedInput, VisitError

    try:
        return _lark().parse(line)
    except VisitError as e:  # an error raised inside a transformer callback
        if isinstance(e.orig_exc, _LineError):
            raise e.orig_exc from None
        raise
    except UnexpectedInput:
        pass
    raise _diagnose(line)


def _diagnose(line: str) -> _LineError:
    """Re-run a failing line token by token to find the error and what was expected.

    lark's own ``expected`` sets come from LALR states that merge contexts (after a
    name, everything that may follow any name), so instead the parser is stepped
    interactively and asked which terminals it really ``accepts()`` at the failure point.
    """
    from lark.exceptions import UnexpectedCharacters, UnexpectedToken, VisitError

    ip = _lark().parse_interactive(line)
    tokens = ip.lexer_thread.lex(ip.parser_state)
    try:
        while True:
            try:
                tok = next(tokens)
            except StopIteration:
                before = ip.copy()
                try:
                    ip.feed_eof()
                except UnexpectedToken:
                    return _LineError(len(line) + 1, "unexpected end of line",
                                      _readable(before.accepts()))
                break  # pragma: no cover - the line parsed after all
            except UnexpectedCharacters as e:  # no terminal matches here
                ch = line[e.pos_in_stream] if 0 <= e.pos_in_stream < len(line) else ""
                msg = (f"unexpected character {ch!r}" if ch != '"' else
                       "unterminated string or bad escape (strings use JSON escapes)")
                return _LineError(e.column, msg, _readable(ip.accepts()))
            except UnexpectedToken as e:  # a token that is valid elsewhere, not here
                return _LineError(e.column, f"unexpected {_describe(e.token)}",
                                  _readable(ip.accepts()))
            before = ip.copy()
            try:
                ip.feed_token(tok)
            except UnexpectedToken:
                return _LineError(tok.column, f"unexpected {_describe(tok)}",
                                  _readable(before.accepts()))
    except VisitError as e:  # pragma: no cover - a callback error surfaced on the way
        if isinstance(e.orig_exc, _LineError):
            return e.orig_exc
        raise
    except _LineError as e:  # pragma: no cover
        return e
    return _LineError(1, "syntax error")  # pragma: no cover - lark and the stepper disagree


_TOKEN_NOUNS = {"NAME": "name", "STRING": "string", "UINT": "integer", "NEGINT": "integer",
                "FLOAT": "float", "LOC": "location", "RANK": "rank", "EOFF": "epoch offset"}


def _describe(tok) -> str:
    """``'task'`` for a keyword or punctuation, ``name 'foo'`` for a regex token."""
    text = str(tok)
    if len(text) > 40:
        text = text[:37] + "..."
    noun = _TOKEN_NOUNS.get(tok.type)
    return f"{noun} {text!r}" if noun else f"'{text}'"


# ------------------------------------------------------------------------------------
# fast path: canonical task / buffer / counter lines by regex (a subset of the grammar)
# ------------------------------------------------------------------------------------

_N = r"[A-Za-z_][A-Za-z0-9_.\-]*"                      # NAME
_SS = r'"[^"\\\x00-\x1f]*"'                               # a string without escapes
_I = r"-?[0-9]+"
_BD = r"(?:-?[0-9]+|(?:-?[0-9]+\*|-)?s(?:[+-][0-9]+)?)"   # bound
_RG = rf"{_N}(?:@r{_I})?\[(?:{_BD}:{_BD}(?:, ?{_BD}:{_BD})*)?\]"   # region
_RGS = rf"(?:{_RG}(?:, ?{_RG})*)?"
_FL = r"-?(?:[0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)"
_VAL = rf"(?:{_FL}|{_I}|{_SS}|true|false|null|inf|-inf|nan)"
_KV = rf"{_N}={_VAL}"
_WT = rf"{_N} ?>= ?{_I}(?: @prev| @e[+-][0-9]+)?"
_SG = rf"{_N} ?\+= ?{_I}"

_TASK_RE = re.compile(
    rf"task ({_N}) @r({_I})\.w({_I}) ({_N})\(({_RGS})\)"
    rf"(?: -> \(({_RGS})\))?"
    rf"(?: \{{((?:{_KV}(?:, ?{_KV})*)?)\}})?"
    rf"(?: wait\(((?:{_WT}(?:, ?{_WT})*)?)\))?"
    rf"(?: signal\(((?:{_SG}(?:, ?{_SG})*)?)\))?"
    rf"(?: group=({_N}))?"
)
_REGION_RE = re.compile(rf"({_N})(?:@r({_I}))?\[([^\]]*)\]")
_BOUND_RE = re.compile(r"(-?[0-9]+)|(?:(-?[0-9]+)\*|(-))?s([+-][0-9]+)?")
_KV_RE = re.compile(rf"({_N})=({_VAL})")
_WAIT_RE = re.compile(rf"({_N}) ?>= ?({_I})(?: (@prev)| @e([+-][0-9]+))?")
_SIG_RE = re.compile(rf"({_N}) ?\+= ?({_I})")
_COUNTER_RE = re.compile(rf"counter ({_N}) @r({_I})(?: width=({_I}))?")
_BUFFER_RE = re.compile(
    rf"buffer ({_N}) ({_N}) ({_N}) \[((?:{_I}(?:, ?{_I})*)?)\]( symmetric| local)?"
    rf"(?: @r({_I}))?(?: src=({_SS})(?:\[((?:{_I}:{_I}(?:, ?{_I}:{_I})*)?)\])?)?"
)
_INT_RE = re.compile(_I)
# canonical header lines (what format_program writes), by their first word; anything else
# goes to lark
_HEADER_RE = {
    "amk": re.compile(r"amk ([0-9]+)"),
    "program": re.compile(rf"program ({_SS})"),
    "ranks": re.compile(rf"ranks ({_I}) workers ({_I})"),
    "target": re.compile(rf"target ({_N}) (sms)=({_I}) (max_workers)=({_I}) (backend)=({_N})"),
    "epochs": re.compile(rf"epochs (max)=({_I}) (slots)=({_I})"),
    # a key may be quoted: the formatter quotes keys spelled like keywords ("workers")
    "config": re.compile(rf"config((?: (?:{_N}|{_SS})={_VAL})*)"),
}
_KV_POS_RE = re.compile(rf" ({_N}|{_SS})=({_VAL})")
_KEYWORD_VALUES = {"true": True, "false": False, "null": None, "inf": math.inf,
                   "-inf": -math.inf, "nan": math.nan}


class _FastParser:
    """Regex parsing of canonical lines with caches for the strings that repeat
    (ranges, waits, signals). Returns None for any line it does not fully accept."""

    def __init__(self):
        self.ranges: dict[str, tuple[Range, ...]] = {}
        self.bounds: dict[str, Bound] = {}
        self.waits: dict[str, tuple[Wait, ...]] = {}
        self.signals: dict[str, tuple[Signal, ...]] = {}
        self.params: dict[str, dict[str, Any]] = {}
        self.region_cache: dict[int, dict[str, Region]] = {}  # per task rank: text -> Region

    def bound(self, text: str) -> Bound:
        b = self.bounds.get(text)
        if b is None:
            m = _BOUND_RE.fullmatch(text)
            if m.group(1) is not None:
                b = Bound(int(m.group(1)))
            else:
                coef = -1 if m.group(3) else int(m.group(2)) if m.group(2) else 1
                b = Bound(int(m.group(4)) if m.group(4) else 0, coef)
            self.bounds[text] = b
        return b

    def range_tuple(self, body: str) -> tuple[Range, ...]:
        rs = self.ranges.get(body)
        if rs is None:
            out = []
            if body:
                for part in body.split(","):
                    a, b = part.strip().split(":")
                    out.append(Range(self.bound(a), self.bound(b)))
            rs = self.ranges[body] = tuple(out)
        return rs

    def regions(self, text: str | None, rank: int) -> tuple[Region, ...] | None:
        """The regions of an ``ins``/``outs`` group of a task on ``rank`` (None: a name is a
        keyword, lark decides). Equal region texts of one rank give one shared Region."""
        if not text:
            return ()
        pieces = text.split("], ")  # canonical separator; ']' occurs nowhere else
        if text.count("]") != len(pieces):  # e.g. "a[0:1],b[0:1]": the general reader
            return self._regions_findall(text, rank)
        cache = self.region_cache.get(rank)
        if cache is None:
            cache = self.region_cache[rank] = {}
        out = []
        for piece in pieces:
            r = cache.get(piece)
            if r is None:  # the line matched _TASK_RE: piece is NAME[@rK][BODY or NAME[@rK][BODY]
                head, _, body = piece.partition("[")
                name, at, rk = head.partition("@r")
                if name in _RESERVED:
                    return None
                r = cache[piece] = Region(name, int(rk) if at else rank,
                                          self.range_tuple(body.rstrip("]")))
            out.append(r)
        return tuple(out)

    def _regions_findall(self, text: str, rank: int) -> tuple[Region, ...] | None:
        out = tuple(  # findall gives '' for an absent @rK
            Region(name, int(rk) if rk else rank, self.range_tuple(body))
            for name, rk, body in _REGION_RE.findall(text))
        return None if any(r.buffer in _RESERVED for r in out) else out

    def task(self, line: str):
        m = _TASK_RE.fullmatch(line)
        if m is None:
            return None
        tid, rank_s, worker_s, op, ins, outs, params, waits, signals, group = m.groups()
        if tid in _RESERVED or op in _RESERVED or (group is not None and group in _RESERVED):
            return None
        rank = int(rank_s)
        pd: dict[str, Any] = {}
        if params:
            known = self.params.get(params)
            if known is None:
                for k, v in _KV_RE.findall(params):
                    if k in pd or k in _RESERVED:
                        return None  # duplicate key: lark reports it
                    pd[k] = _fast_value(v)
                self.params[params] = pd
            pd = dict(known or pd)  # each task owns its params dict
        wt: tuple[Wait, ...] = ()
        if waits:
            wt = self.waits.get(waits)
            if wt is None:
                out = []
                for name, th, prev, off in _WAIT_RE.findall(waits):
                    if name in _RESERVED:
                        return None
                    out.append(Wait(name, int(th), -1 if prev else int(off) if off else 0))
                wt = self.waits[waits] = tuple(out)
        sg: tuple[Signal, ...] = ()
        if signals:
            sg = self.signals.get(signals)
            if sg is None:
                out2 = []
                for name, amount in _SIG_RE.findall(signals):
                    if name in _RESERVED:
                        return None
                    out2.append(Signal(name, int(amount)))
                sg = self.signals[signals] = tuple(out2)
        ins_r = self.regions(ins, rank)
        outs_r = self.regions(outs, rank)
        if ins_r is None or outs_r is None:
            return None
        return ("task", Task(tid, rank, int(worker_s), op, ins_r, outs_r, pd, wt, sg, group))

    def buffer(self, line: str):
        m = _BUFFER_RE.fullmatch(line)
        if m is None:
            return None
        name, kind, dtype, shape, placement, rank, src, src_ranges = m.groups()
        if name in _RESERVED or kind in _RESERVED or dtype in _RESERVED:
            return None
        source = None
        if src is not None:
            rr = ()
            if src_ranges:
                rr = tuple((int(a), int(b)) for a, b in
                           (p.strip().split(":") for p in src_ranges.split(",")))
            source = WeightSource(src[1:-1], rr)
        return ("buffer", Buffer(
            name, kind, dtype,
            tuple(int(d) for d in shape.split(",")) if shape else (),
            placement.strip() if placement else "local",
            None if rank is None else int(rank), source))

    def counter(self, line: str):
        m = _COUNTER_RE.fullmatch(line)
        if m is None or m.group(1) in _RESERVED:
            return None
        width = m.group(3)
        return ("counter", Counter(m.group(1), int(m.group(2)), 32 if width is None else int(width)))

    def header(self, line: str):
        """A canonical header line as lark's transformer builds it (columns included),
        or None. Importing and building the lark parser costs ~70 ms, more than parsing
        a small program, so a canonical file never needs it."""
        head = line[:line.find(" ")]
        rx = _HEADER_RE.get(head)
        m = rx.fullmatch(line) if rx is not None else None
        if m is None:
            return None
        if head == "amk":
            return ("amk", _Pos(int(m.group(1)), m.start(1) + 1))
        if head == "program":
            return ("program", m.group(1)[1:-1])
        if head == "ranks":
            return ("ranks", (int(m.group(1)), int(m.group(2))))
        if head == "target":
            if m.group(1) in _RESERVED or m.group(7) in _RESERVED:
                return None
            return ("target", (m.group(1), [
                (_Pos(m.group(k), m.start(k) + 1), conv(m.group(k + 1)), m.start(k + 1) + 1)
                for k, conv in ((2, int), (4, int), (6, str))]))
        if head == "epochs":
            return ("epochs", [(_Pos(m.group(k), m.start(k) + 1), int(m.group(k + 1)),
                                m.start(k + 1) + 1) for k in (1, 3)])
        if head == "config":
            out: dict[str, Any] = {}
            for k, v in _KV_POS_RE.findall(m.group(1)):
                if k[0] == '"':
                    k = k[1:-1]  # no escapes (_SS): the JSON string's value
                elif k in _RESERVED:
                    return None
                if k in out:
                    return None  # a duplicate key: lark reports it
                out[k] = _fast_value(v)
            return ("config", out)
        return None

    def line(self, line: str):
        if "#" in line:  # comments (possibly inside strings): leave to lark
            return None
        if line.startswith("task "):
            return self.task(line)
        if line.startswith("buffer "):
            return self.buffer(line)
        if line.startswith("counter "):
            return self.counter(line)
        if line.startswith(_HEADER_STARTS):
            return self.header(line)
        return None


_HEADER_STARTS = tuple(f"{h} " for h in HEADER_LINES)
_BLANK = " \t\f\r"  # the whitespace grammar.lark ignores


def _fast_value(text: str):
    if text[0] == '"':
        return text[1:-1]
    kw = _KEYWORD_VALUES.get(text, _fast_value)
    if kw is not _fast_value:
        return kw
    if _INT_RE.fullmatch(text):
        return int(text)
    return float(text)


# ------------------------------------------------------------------------------------
# file level
# ------------------------------------------------------------------------------------

def parse_line(line: str, fast: _FastParser | None = None):
    """Parse one line (no newline) into ``(kind, payload)`` or None for blank/comment.

    Raises _LineError. ``fast``: a fast-path parser to try first.
    """
    if fast is not None:
        item = fast.line(line)
        if item is not None:
            return item
    return _parse_line_lark(line)


def parse_program(text: str, filename: str = "<string>",
                  positions: list[tuple[int, int]] | None = None) -> ScheduleProgram:
    """Parse the text form into a ScheduleProgram (no semantic validation).

    ``filename`` only labels errors. ``positions``: if a list is given, the 1-based
    ``(line, column)`` of each task line is appended to it, in task order (so that a later
    error about ``prog.tasks[i]`` can point at ``file:line:column``). Raises IRParseError
    (file:line:column, message, expected) on a syntax error, an unsupported version, a
    repeated header line, a missing ``amk``/``program``/``ranks`` line, a repeated key in a
    params/config map, or a target/epochs field that does not exist or has the wrong type.
    """
    with gc_paused():
        return _parse_program(text, filename, positions)


def _parse_program(text: str, filename: str,
                   positions: list[tuple[int, int]] | None = None) -> ScheduleProgram:
    fast = _FastParser()
    header: dict[str, tuple[int, Any]] = {}
    buffers: list[Buffer] = []
    counters: list[Counter] = []
    tasks: list[Task] = []
    add_task, add_buffer, add_counter = tasks.append, buffers.append, counters.append
    fast_task = fast.task
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    seen_content = False
    for lineno, line in enumerate(lines, 1):
        if line.endswith("\r"):
            line = line[:-1]
        try:
            if line.startswith("task ") and "#" not in line:
                item = fast_task(line) or _parse_line_lark(line)
            elif not line.lstrip(_BLANK).startswith("#") and line.strip(_BLANK):
                item = parse_line(line, fast)
            else:  # blank or comment-only (the grammar's ignored whitespace and COMMENT)
                continue
        except _LineError as e:
            raise IRParseError(filename, lineno, e.column, e.message, e.expected) from None
        if item is None:
            continue
        kind, payload = item
        if not seen_content:
            seen_content = True
            if kind != "amk":
                raise IRParseError(filename, lineno, _first_col(line),
                                   f"the first line must be the format version 'amk {IR_VERSION}'",
                                   ["'amk'"])
        if kind == "task":
            add_task(payload)
            if positions is not None:
                positions.append((lineno, 1 if line[0] == "t" else _first_col(line)))
        elif kind == "buffer":
            add_buffer(payload)
        elif kind == "counter":
            add_counter(payload)
        else:
            if kind in header:
                raise IRParseError(filename, lineno, _first_col(line),
                                   f"duplicate '{kind}' line (the first is on line "
                                   f"{header[kind][0]})")
            header[kind] = (lineno, payload)
            if kind == "amk" and payload.value != IR_VERSION:
                raise IRParseError(filename, lineno, payload.column,
                                   f"unsupported IR version {payload.value} (this amk reads "
                                   f"version {IR_VERSION})", [str(IR_VERSION)])
    end_line = max(len(lines), 1)
    end_col = len(lines[-1].rstrip("\r")) + 1 if lines else 1
    for required, example in (("amk", f"amk {IR_VERSION}"), ("program", 'program "NAME"'),
                              ("ranks", "ranks R workers W")):
        if required not in header:
            raise IRParseError(filename, end_line, end_col,
                               f"missing the '{example}' line", [f"'{required}'"])
    prog = ScheduleProgram(name=header["program"][1], ranks=header["ranks"][1][0],
                           workers=header["ranks"][1][1], version=header["amk"][1].value,
                           buffers=buffers, counters=counters, tasks=tasks)
    if "target" in header:
        lineno, (name, settings) = header["target"]
        prog.target = Target(name=name)
        for key, val, vcol in _settings(filename, lineno, "target", settings, _TARGET_FIELDS):
            setattr(prog.target, key, val)
    if "epochs" in header:
        lineno, settings = header["epochs"]
        fields = {k: int for k in _EPOCH_FIELDS}
        for key, val, vcol in _settings(filename, lineno, "epochs", settings, fields):
            setattr(prog, _EPOCH_FIELDS[key], val)
    if "config" in header:
        prog.config = header["config"][1]
    return prog


def _first_col(line: str) -> int:
    return len(line) - len(line.lstrip()) + 1


def _settings(filename, lineno, what, settings, fields: dict[str, type]):
    """Check the key=value settings of a target/epochs line; yield (key, value, column)."""
    seen = set()
    for key, val, vcol in settings:
        if key.value not in fields:
            raise IRParseError(filename, lineno, key.column,
                               f"unknown {what} field {key.value!r}",
                               [f"'{k}'" for k in fields])
        if key.value in seen:
            raise IRParseError(filename, lineno, key.column,
                               f"duplicate {what} field {key.value!r}")
        seen.add(key.value)
        want = fields[key.value]
        if want is int and (isinstance(val, bool) or not isinstance(val, int)):
            raise IRParseError(filename, lineno, vcol,
                               f"{what} field {key.value} must be an integer, got {val!r}",
                               ["an integer"])
        if want is str and not isinstance(val, str):
            raise IRParseError(filename, lineno, vcol,
                               f"{what} field {key.value} must be a name or string, got {val!r}",
                               ["a name", "a quoted string"])
        yield key.value, val, vcol
