"""Knob metadata: every knob of ``lowering.config`` (the lowering's and the Triton kernel's) is
declared once, as a dataclass field made by ``knob(...)``: its default, one description, its
allowed values and the knobs it needs to have an effect. From that declaration come

* the command-line flags (``add_flags``): one spelling per knob, ``--`` + the field name with
  dashes (``tile_qkv`` -> ``--tile-qkv``), booleans as ``0|1``; a sweep's comma lists of the
  same spellings (``add_flags(..., lists=True)``);
* the checks (``check``) and their one-line messages, which name the field and its flag;
* the combinations that do nothing (``inert``): a knob set where another knob, or a single
  rank, leaves it without effect, e.g. ``--fuse-reduce 1`` at ``--tp 1``;
* the tables of docs/lowering.md and docs/triton.md (``markdown_table``; scripts/knob_docs.py
  writes them, tests/test_knobs.py checks they are current).

A knob *acts* when it is on (a boolean) or away from its default (any other type); only a knob
that acts can be refused for doing nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from ground.errors import AmkError


def flag_of(name: str) -> str:
    """The command-line spelling of knob ``name``: ``tile_qkv`` -> ``--tile-qkv``."""
    return "--" + name.replace("_", "-")


def show(value: Any) -> str:
    """A knob value as it is written on the command line (booleans as 0 / 1)."""
    if isinstance(value, bool):
        return str(int(value))
    return str(value)


@dataclass(frozen=True)
class Need:
    """A condition for a knob to act: field ``field`` passes ``test``; ``text`` says it in
    flag form (``--fuse 1``), ``unset`` what to set the knob to instead."""

    field: str
    test: Callable[[Any], bool]
    text: str


def on(name: str) -> Need:
    """The boolean knob ``name`` is on."""
    return Need(name, lambda v: v is True, f"{flag_of(name)} 1")


def positive(name: str) -> Need:
    """The integer knob ``name`` is above 0."""
    return Need(name, lambda v: isinstance(v, int) and v > 0, f"{flag_of(name)} >= 1")


def equal(name: str, value: Any) -> Need:
    """Knob ``name`` is ``value``."""
    return Need(name, lambda v: v == value, f"{flag_of(name)} {show(value)}")


def one_of(name: str, values: Sequence[Any]) -> Need:
    """Knob ``name`` is one of ``values``."""
    vals = tuple(values)
    return Need(name, lambda v: v in vals, f"{flag_of(name)} {' or '.join(map(show, vals))}")


@dataclass(frozen=True)
class Knob:
    """One knob's declaration (a field's metadata, see ``knob``).

    ``kind``: bool, int or str. ``choices``: the allowed values (empty: any of the kind, within
    ``lo`` .. ``hi``, a power of two when ``pow2``, a multiple of ``multiple``). ``zero``: what
    0 means when it is allowed below ``lo`` or outside ``pow2`` (``off``, ``tile``, ...).
    ``check``: a further rule of the value alone (returns the problem or None). ``needs``: the
    conditions under which the knob acts; ``multi_rank``: it acts only at more than one rank;
    ``single_rank``: only at one rank.
    ``metavar``: the flag's value in --help; ``values``: the allowed values in words, where
    ``check`` holds the rule."""

    name: str
    default: Any
    help: str
    kind: type
    choices: tuple = ()
    lo: int | None = None
    hi: int | None = None
    pow2: bool = False
    multiple: int = 1
    zero: str = ""
    check: Callable[[Any], str | None] | None = None
    needs: tuple[Need, ...] = ()
    multi_rank: bool = False
    single_rank: bool = False
    metavar: str | None = None
    values: str = ""

    @property
    def flag(self) -> str:
        return flag_of(self.name)

    def acts(self, value: Any) -> bool:
        """Whether ``value`` asks the knob for an effect: on (a boolean), else not the default."""
        if self.kind is bool:
            return value is True
        return value != self.default

    def allowed(self) -> str:
        """The allowed values in words (for --help, messages and the docs)."""
        if self.values:
            return self.values
        if self.kind is bool:
            return "0 or 1"
        if self.choices:
            return ", ".join(map(show, self.choices))
        if self.kind is not int:
            return ""
        what = "a power of two" if self.pow2 else "an integer"
        if self.multiple > 1:
            what = f"a multiple of {self.multiple}"
        lo = self.lo if self.lo is not None else None
        rng = f" in {lo}..{self.hi}" if lo is not None and self.hi is not None else (
            f" >= {lo}" if lo is not None else "")
        zero = f"0 ({self.zero}) or " if self.zero else ""
        return zero + what + rng

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed (None when it is)."""
        if self.kind is bool:
            return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            return f"expected an integer, got {value!r}"
        if self.kind is str and not isinstance(value, str):
            return f"expected a string, got {value!r}"
        if self.choices:
            if value not in self.choices:
                return f"expected one of {', '.join(map(show, self.choices))}, got {value!r}"
        elif self.kind is int and not (self.zero and value == 0):
            bad = ((self.lo is not None and value < self.lo) or (self.hi is not None and value > self.hi)
                   or (self.pow2 and (value < 1 or value & (value - 1))) or value % self.multiple)
            if bad:
                return f"must be {self.allowed()}, got {value}"
        return self.check(value) if self.check else None

    def parse(self, text: str) -> Any:
        """A flag's value: ``0`` / ``1`` (or false / true) for a boolean, an integer for an
        integer knob, the text otherwise (argparse ``type``; the range is ``problem``'s)."""
        if self.kind is bool:
            t = text.strip().lower()
            if t in ("1", "true"):
                return True
            if t in ("0", "false"):
                return False
            raise argparse.ArgumentTypeError(f"expected 0 or 1, got {text!r}")
        if self.kind is int:
            try:
                return int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        return text

    def parse_list(self, text: str) -> list[Any]:
        """A sweep flag's comma list of values."""
        vals = [self.parse(x) for x in text.split(",") if x.strip()]
        if not vals:
            raise argparse.ArgumentTypeError("expected a comma list of values")
        return vals


def knob(default: Any, help: str, **meta: Any) -> Any:
    """A dataclass field declaring a knob (``Knob``'s fields other than name, default, help
    and kind, which come from the field and ``default``)."""
    return field(default=default, metadata={"knob": dict(meta, help=help)})


def knobs_of(cls_or_obj: Any) -> tuple[Knob, ...]:
    """The knobs of a config class (or instance), in field order."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    cached = cls.__dict__.get("_knobs_cache")
    if cached is not None:
        return cached
    out = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("knob")
        if meta is None:
            continue
        out.append(Knob(name=f.name, default=f.default, kind=type(f.default), **meta))
    out = tuple(out)
    setattr(cls, "_knobs_cache", out)
    return out


def knob_named(cls_or_obj: Any, name: str) -> Knob:
    for k in knobs_of(cls_or_obj):
        if k.name == name:
            return k
    raise KeyError(name)


def field_error(source: str, k: Knob, why: str) -> AmkError:
    """The one-line error for knob ``k``: the source, the field and its flag, why."""
    return AmkError(f"{source}: field {k.name!r} ({k.flag}): {why}")


def check_fields(obj: Any, source: str) -> None:
    """Raise AmkError for the first field of ``obj`` whose value is not allowed."""
    for k in knobs_of(obj):
        why = k.problem(getattr(obj, k.name))
        if why:
            raise field_error(source, k, why)


def inert(obj: Any, ranks: int | None = None) -> Iterator[tuple[Knob, str]]:
    """The knobs of ``obj`` that act but have no effect, each with a one-line reason naming
    the flags: a need another knob does not meet, or (``ranks`` 1) a knob of the all-reduce."""
    for k in knobs_of(obj):
        v = getattr(obj, k.name)
        if not k.acts(v):
            continue
        off = show(False) if k.kind is bool else show(k.default)
        for need in k.needs:
            if not need.test(getattr(obj, need.field)):
                yield k, (f"{k.flag} {show(v)} does nothing without {need.text}: set {need.text} "
                          f"or {k.flag} {off}")
                break
        else:
            if k.multi_rank and ranks == 1:
                yield k, f"{k.flag} {show(v)} does nothing at one rank (--tp 1): set {k.flag} {off}"
            elif k.single_rank and ranks is not None and ranks > 1:
                yield k, f"{k.flag} {show(v)} does nothing at {ranks} ranks (it acts at --tp 1): set {k.flag} {off}"


def check_inert(obj: Any, source: str, ranks: int | None = None) -> None:
    """Raise AmkError (exit code 2) for the first combination of ``obj`` that does nothing."""
    for _, why in inert(obj, ranks):
        raise AmkError(f"{source}: {why}")


def without_inert(obj: Any, ranks: int | None = None) -> Any:
    """``obj`` with every knob that has no effect turned off (a boolean) or set back to its
    default (the same program or kernel: those knobs change nothing)."""
    for _ in range(len(knobs_of(obj)) + 1):
        reset = {k.name: False if k.kind is bool else k.default for k, _ in inert(obj, ranks)}
        if not reset:
            return obj
        obj = dataclasses.replace(obj, **reset)
    raise AssertionError("without_inert did not settle")


# ----------------------------------------------------------------------------- flags
def add_flags(parser: Any, cls: type, *, lists: bool = False, skip: Sequence[str] = (),
              defaults: dict[str, str] | None = None) -> None:
    """Add one flag per knob of ``cls`` to ``parser`` (an ArgumentParser or argument group):
    ``--`` + the name with dashes, dest the field name, no default in the namespace (a flag
    that is not given leaves the knob to the config file or the default). ``lists``: each
    flag takes a comma list of values (a sweep). ``skip``: knobs left out. ``defaults``:
    a command's own default of a knob, in words, shown instead of the field's."""
    for k in knobs_of(cls):
        if k.name in skip:
            continue
        dflt = (defaults or {}).get(k.name, show(k.default))
        allowed = k.allowed()
        text = k.help.rstrip(".") + (f"; {allowed}" if allowed and k.kind is not bool else "") \
            + f" (default {dflt})"
        metavar = k.metavar or ("0|1" if k.kind is bool else "|".join(map(show, k.choices)) if k.choices
                                else "N" if k.kind is int else "VALUE")
        parser.add_argument(k.flag, dest=k.name, default=argparse.SUPPRESS,
                            type=k.parse_list if lists else k.parse,
                            metavar=f"{metavar},..." if lists else metavar,
                            help=text.replace("%", "%%"))


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The knobs of ``cls`` that flags set in ``args`` (those add_flags added and the command
    line gave; an attribute set to None counts as not given), by field name."""
    return {k.name: getattr(args, k.name) for k in knobs_of(cls) if getattr(args, k.name, None) is not None}


# ----------------------------------------------------------------------------- docs
def markdown_table(cls: type) -> str:
    """The docs table of ``cls``'s knobs: field, flag, default, allowed values, what it does
    (the one description) and what it needs to act."""
    rows = ["| field | flag | default | values | what it does |", "|---|---|---|---|---|"]
    for k in knobs_of(cls):
        needs = ([n.text for n in k.needs] + (["--tp > 1"] if k.multi_rank else [])
                 + (["--tp 1"] if k.single_rank else []))
        text = k.help + (f" Acts only with {', '.join(f'`{n}`' for n in needs)}." if needs else "")
        allowed = k.allowed()
        rows.append(f"| `{k.name}` | `{k.flag}` | `{show(k.default)}` | {allowed} | {text} |")
    return "\n".join(rows) + "\n"
