"""The search space of `amk search`: the lowering knobs, their allowed values, candidate ids.

A *candidate* is a plain dict ``{knob name: value}`` holding every searchable knob of
``lowering.config.LoweringConfig``; the knobs the search must not change (``fixed``: e.g.
``max_seq`` and ``dtype``, which change what is computed, not how it is scheduled) are
held constant for the whole search and are part of the candidate's lowering config but
not of the space.

The knobs are the lowering's config class's fields: ``space_for`` classifies each as
searchable or fixed (a field it does not classify is an error) and derives its values from
the model and target; each knob's description is its declaration's (lowering.knobs). Every
searchable value must change the lowered program where the knob acts (a knob the lowering
ignores is a bug; tests/test_search_space.py checks it for every value). A candidate may set
a knob that another leaves without effect (``late_append`` without ``fuse``): it lowers to
the same program, and the config files the search writes hold it at its default.

The canonical id of a candidate is ``"k-" + sha256(canonical JSON)[:12]`` where the
canonical JSON is the full lowering config (fixed fields included) with sorted keys, so
two spellings of the same config (key order, a default left out) get one id.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ground.errors import AmkError
from ir.jsonio import json_type


class SpaceError(AmkError):
    """A candidate that is not a point of the search space (unknown knob, bad value)."""


@dataclass(frozen=True)
class Knob:
    """One searchable knob.

    ``values``: the allowed values, in order (for an ordinal knob, neighbours in this
    tuple are "close": mutation moves to an adjacent value). ``default``: the lowering's
    default, always one of ``values``. ``help``: one line for the user and the LLM prompt.
    """

    name: str
    values: tuple[Any, ...]
    default: Any
    ordinal: bool = False
    help: str = ""

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError(f"knob {self.name!r} has no values")
        if self.default not in self.values:
            raise ValueError(f"knob {self.name!r}: default {self.default!r} is not one of "
                             f"{list(self.values)}")
        if len(set(map(repr, self.values))) != len(self.values):
            raise ValueError(f"knob {self.name!r} lists a value twice: {list(self.values)}")


class KnobLookup:
    """Lookups shared by the spaces over a ``knobs`` list (search and tune)."""

    knobs: list

    def knob(self, name: str) -> Any:
        """The knob called ``name``; KeyError if the space has none."""
        for k in self.knobs:
            if k.name == name:
                return k
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [k.name for k in self.knobs]

    def default_of(self, name: str) -> Any:
        """The default value of knob ``name``."""
        return self.knob(name).default

    def json_schema(self, required: bool = True) -> dict[str, Any]:
        """JSON schema (draft 2020-12 subset) of a candidate: an object whose properties
        are the knobs, each an ``enum`` of its allowed values (described by its help line
        and default); no other keys; every knob required unless ``required`` is False
        (a partial candidate: knob changes)."""
        props = {}
        for k in self.knobs:
            t = json_type(k.values[0])
            props[k.name] = {"type": t if t in ("boolean", "integer", "number") else "string",
                             "enum": list(k.values),
                             "description": f"{k.help or k.name} (default {self.default_of(k.name)!r})"}
        out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            out["required"] = self.names
        return out


@dataclass
class SearchSpace(KnobLookup):
    """The knobs and the fixed part of the lowering config.

    ``knobs``: searchable knobs (only knobs with two or more values are kept: a one-value
    knob cannot be searched). ``fixed``: lowering-config fields held constant.
    """

    knobs: list[Knob]
    fixed: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.knobs = [k for k in self.knobs if len(k.values) >= 2]
        names = [k.name for k in self.knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate knob names: {names}")
        clash = set(names) & set(self.fixed)
        if clash:
            raise ValueError(f"knobs {sorted(clash)} are both searchable and fixed")

    # -- lookups --------------------------------------------------------------------
    def size(self) -> int:
        """Number of distinct candidates (the product of the knobs' value counts)."""
        n = 1
        for k in self.knobs:
            n *= len(k.values)
        return n

    # -- points ---------------------------------------------------------------------
    def default(self) -> dict[str, Any]:
        """The lowering's default candidate."""
        return {k.name: k.default for k in self.knobs}

    def check(self, candidate: dict[str, Any]) -> list[str]:
        """Problems that make ``candidate`` not a point of the space (empty when it is).

        Keys must be knob names; values must be among the knob's allowed values (with
        the knob's JSON type: ``64`` for an integer knob, not ``"64"`` or ``64.0``).
        Missing knobs are filled with defaults by ``canonical`` and are not a problem.
        """
        problems = []
        if not isinstance(candidate, dict):
            return [f"a candidate must be an object of knobs, got {type(candidate).__name__}"]
        for key, value in candidate.items():
            try:
                k = self.knob(key)
            except KeyError:
                hint = " (held fixed for this search)" if key in self.fixed else ""
                problems.append(f"unknown knob {key!r}{hint}; knobs: {', '.join(self.names)}")
                continue
            if not same_type(value, k.values[0]) or value not in k.values:
                problems.append(f"knob {key!r}: {value!r} is not one of {list(k.values)}")
        return problems

    def canonical(self, candidate: dict[str, Any]) -> dict[str, Any]:
        """``candidate`` with every knob present, in knob order. Raises SpaceError."""
        problems = self.check(candidate)
        if problems:
            raise SpaceError("; ".join(problems))
        return {k.name: candidate.get(k.name, k.default) for k in self.knobs}

    def lowering_config(self, candidate: dict[str, Any]) -> dict[str, Any]:
        """The full lowering-config dict (fixed fields + the candidate's knobs)."""
        out = dict(self.fixed)
        out.update(self.canonical(candidate))
        return out

    def candidate_id(self, candidate: dict[str, Any]) -> str:
        """Canonical id: ``k-`` + 12 hex digits of sha256 of the full config's JSON."""
        text = json.dumps(self.lowering_config(candidate), sort_keys=True,
                          separators=(",", ":"))
        return "k-" + hashlib.sha256(text.encode()).hexdigest()[:12]

    def describe(self, candidate: dict[str, Any], base: dict[str, Any] | None = None) -> str:
        """``tile=64 workers=8 policy=balanced``; with ``base``, only the knobs that differ
        (``workers 8->16``), or ``(same)``."""
        c = self.canonical(candidate)
        if base is None:
            return " ".join(f"{k}={v}" for k, v in c.items())
        b = self.canonical(base)
        diffs = [f"{k} {b[k]}->{v}" for k, v in c.items() if b[k] != v]
        return ", ".join(diffs) if diffs else "(same)"

    def random(self, rng: random.Random) -> dict[str, Any]:
        """A uniformly random candidate."""
        return {k.name: rng.choice(k.values) for k in self.knobs}

    def mutate(self, candidate: dict[str, Any], rng: random.Random,
               n_knobs: int = 1) -> dict[str, Any]:
        """Change ``n_knobs`` distinct knobs of ``candidate``: an ordinal knob moves to an
        adjacent value (two steps with probability 1/4), a categorical one to another
        value. The result always differs from ``candidate`` when the space has a knob."""
        c = self.canonical(candidate)
        if not self.knobs:
            return c
        for k in rng.sample(self.knobs, min(n_knobs, len(self.knobs))):
            i = k.values.index(c[k.name])
            if k.ordinal:
                dist = 2 if rng.random() < 0.25 else 1
                js = [j for j in (i - dist, i + dist) if 0 <= j < len(k.values)] or \
                     [j for j in (i - 1, i + 1) if 0 <= j < len(k.values)]
                j = rng.choice(js)
            else:
                j = rng.choice([x for x in range(len(k.values)) if x != i])
            c[k.name] = k.values[j]
        return c

    def neighbours(self, candidate: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Every candidate that differs from ``candidate`` in exactly one knob (ordinal
        knobs: adjacent values only)."""
        c = self.canonical(candidate)
        for k in self.knobs:
            i = k.values.index(c[k.name])
            js = [i - 1, i + 1] if k.ordinal else [j for j in range(len(k.values)) if j != i]
            for j in js:
                if 0 <= j < len(k.values):
                    yield {**c, k.name: k.values[j]}

    def all(self) -> Iterator[dict[str, Any]]:
        """Every candidate (the cartesian product; mind ``size()``)."""
        def rec(i: int, acc: dict[str, Any]) -> Iterator[dict[str, Any]]:
            if i == len(self.knobs):
                yield dict(acc)
                return
            for v in self.knobs[i].values:
                acc[self.knobs[i].name] = v
                yield from rec(i + 1, acc)
        yield from rec(0, {})

    # -- schemas --------------------------------------------------------------------
    def optuna_distributions(self) -> dict[str, Any]:
        """``{knob: optuna CategoricalDistribution}`` (optuna imported lazily)."""
        from optuna.distributions import CategoricalDistribution

        return {k.name: CategoricalDistribution(list(k.values)) for k in self.knobs}

    def to_json(self) -> dict[str, Any]:
        return {"knobs": [{"name": k.name, "values": list(k.values), "default": k.default,
                           "ordinal": k.ordinal, "help": k.help} for k in self.knobs],
                "fixed": dict(self.fixed)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> "SearchSpace":
        knobs = [Knob(d["name"], tuple(d["values"]), d["default"], bool(d.get("ordinal")),
                      d.get("help", "")) for d in data["knobs"]]
        return SearchSpace(knobs, dict(data.get("fixed", {})))


def same_type(value: Any, ref: Any) -> bool:
    """JSON-type equality: bool is not int, int is not float, str is str."""
    if isinstance(ref, bool) or isinstance(value, bool):
        return isinstance(ref, bool) and isinstance(value, bool)
    if isinstance(ref, int):
        return isinstance(value, int)
    if isinstance(ref, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(ref))


def space_from_knob_specs(specs: Sequence[Any], fixed: dict[str, Any]) -> SearchSpace:
    """Build a SearchSpace from the lowering's knob declarations.

    ``specs``: objects or dicts with ``name``, ``values``, ``default`` and optionally
    ``ordinal`` and ``help``.
    """
    knobs = []
    for s in specs:
        get = s.get if isinstance(s, dict) else (lambda a, d=None, s=s: getattr(s, a, d))
        knobs.append(Knob(str(get("name")), tuple(get("values")), get("default"),
                          bool(get("ordinal", False)), str(get("help", "") or "")))
    return SearchSpace(knobs, fixed)


# -- the space of the lowering's knobs ------------------------------------------------
# How `amk search` treats each field of lowering.config.LoweringConfig: searchable, or fixed
# for a whole search. The allowed values of the enumerated fields come from lowering.config
# (POLICIES, ALLREDUCE_ALGOS); integer ranges are derived from the model and target by
# ``space_for``; each knob's description is its declaration's (lowering.knobs). A field missing
# here is an error (tests/test_search_space.py), so a new knob cannot be silently left out.
SEARCHABLE = ("tile", "workers", "policy", "allreduce", "fuse", "wave", "attn_split", "attn_kv_split", "tile_qkv",
              "tile_gate_up", "tile_lm_head", "tile_reduce", "late_append", "fuse_reduce", "down_split_k")
# Fixed for a whole search: they change what is computed or how much can be decoded, not
# how the step is scheduled (the user picks them with --dtype / --max-seq / --weights /
# --quantize-lm-head or --config).
FIXED = ("max_seq", "dtype", "weights", "quantize_lm_head", "weight_group")

TILE_CHOICES = (16, 32, 64, 128, 256, 512)
# q/k/v is a narrow stage: the tiles that fit it in one or two rounds of workers are small,
# and not all powers of two (24 rows: Llama-3.2-1B's 3072 rows in 128 tiles)
QKV_TILE_CHOICES = (16, 24, 32, 48, 64, 96, 128)
WORKER_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
# a reduce tile moves a few hundred bytes: the useful ones are far wider than a GEMV tile
REDUCE_TILE_CHOICES = (64, 128, 256, 512, 1024, 2048)


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def space_for(spec: Any, ranks: int, max_workers: int, fixed: dict[str, Any] | None = None,
              config_cls: Any = None) -> SearchSpace:
    """The search space for a model (``models.graph.ModelSpec``), ``ranks`` and a target
    with ``max_workers`` co-resident workers per rank.

    tile: powers of two from 16 up to the next power of two of the largest tiled extent
    (hidden, intermediate / R, vocabulary / R) — a larger tile would equal that one.
    workers: powers of two up to ``max_workers`` and up to the number of tiles of the
    largest stage at the smallest tile (more workers would idle). policy, allreduce: the
    lowering's own enumerations; allreduce only when ranks > 1 (R = 1 has no all-reduce).
    fuse, wave: False, True; fuse_reduce: False, True when ranks > 1;
    late_append: False, True for models without q/k norm (it changes
    only the fused attention; with fuse off it is the same schedule). tile_gate_up, tile_lm_head: 0 (= tile) and the choices above the
    default tile and below the stage's rows on one rank. tile_qkv: 0 and QKV_TILE_CHOICES
    other than the default tile and below the most query rows of one rank. attn_split: 1, 2, 4, ... below the most query heads one rank
    holds of one KV head, and that count itself (one query head per task); 1 without GQA.
    attn_kv_split: 1, 2, 4, 8 (flash-decoding's split-KV: parts per query-head group).
    tile_reduce (ranks > 1 only): 0 and REDUCE_TILE_CHOICES above the default tile and below
    the hidden size. down_split_k (ranks 1 only): 1, 2, 4.
    ``fixed``: values of the non-searchable fields (defaults: the lowering's). Raises
    SpaceError if LoweringConfig has a field this module does not classify.
    """
    from dataclasses import fields as dc_fields

    from lowering import config as lc

    from lowering.knobs import knob_named

    cls = config_cls or lc.LoweringConfig
    names = [f.name for f in dc_fields(cls)]
    unknown = [n for n in names if n not in SEARCHABLE and n not in FIXED]
    if unknown:
        raise SpaceError(f"LoweringConfig has fields {unknown} that search/space.py does not "
                         "classify as searchable or fixed")
    default = cls()
    extent = max(int(spec.hidden), -(-int(spec.intermediate) // ranks),
                 -(-int(spec.vocab) // ranks), int(spec.heads) * int(spec.head_dim))
    knobs: list[Knob] = []
    for name in names:
        if name not in SEARCHABLE:
            continue
        d = getattr(default, name)
        if name == "tile":
            vals = sorted({t for t in TILE_CHOICES if t <= _next_pow2(extent)} | {d})
            knobs.append(Knob(name, tuple(vals), d, True, knob_named(cls, name).help))
        elif name == "workers":
            cap = min(max_workers, _next_pow2(-(-extent // min(TILE_CHOICES))))
            vals = sorted({w for w in WORKER_CHOICES if w <= cap} | ({d} if d <= cap else set()))
            dd = d if d in vals else vals[-1]
            knobs.append(Knob(name, tuple(vals), dd, True, knob_named(cls, name).help))
        elif name in ("tile_gate_up", "tile_lm_head"):
            # 0 (= tile) or a coarser tile that still cuts the stage: the heavy stages want
            # fewer, larger tasks; a tile covering the whole stage equals wave's choice
            rows = -(-int(spec.intermediate if name == "tile_gate_up" else spec.vocab) // ranks)
            vals = sorted({0, d} | {t for t in TILE_CHOICES if default.tile < t < rows})
            if len(vals) > 1:
                knobs.append(Knob(name, tuple(vals), d, True, knob_named(cls, name).help))
        elif name == "tile_qkv":
            # q, k and v are tiled apart: a tile covering a rank's q rows covers k and v too
            # (any larger one is the same schedule), and the default tile is what 0 means
            q_rows = -(-int(spec.heads) // ranks) * int(spec.head_dim)
            vals = sorted({0, d} | {t for t in QKV_TILE_CHOICES if t < q_rows and t != default.tile})
            if len(vals) > 1:
                knobs.append(Knob(name, tuple(vals), d, True, knob_named(cls, name).help))
        elif name == "policy":
            knobs.append(Knob(name, tuple(lc.POLICIES), d, False, knob_named(cls, name).help))
        elif name in ("fuse", "wave"):
            knobs.append(Knob(name, (False, True), d, False, knob_named(cls, name).help))
        elif name == "late_append":
            # only the fused attention of a model without q/k norm has a late append
            if not getattr(spec, "qk_norm", False):
                knobs.append(Knob(name, (False, True), d, False, knob_named(cls, name).help))
        elif name == "attn_split":
            from lowering.partition import partition

            part = partition(int(spec.heads), int(spec.kv_heads), int(spec.intermediate),
                             int(spec.vocab), ranks)
            grp = max([hi - lo for r, s in enumerate(part.shards) for g in range(*s.kv_heads)
                       for lo, hi in [part.kv_group_heads(r, g)]] or [1])
            vals = sorted({s for s in (1, 2, 4, 8, 16) if s < grp} | {1, grp})
            knobs.append(Knob(name, tuple(vals), d, True, knob_named(cls, name).help))
        elif name == "attn_kv_split":
            vals = sorted({1, 2, 4, 8, d})
            knobs.append(Knob(name, tuple(vals), d, True, knob_named(cls, name).help))
        elif name == "tile_reduce":
            vals = sorted({0, d} | {t for t in REDUCE_TILE_CHOICES if default.tile < t < int(spec.hidden)})
            if ranks > 1 and len(vals) > 1:
                knobs.append(Knob(name, tuple(vals), d, True, knob_named(cls, name).help))
        elif name == "down_split_k":
            if ranks == 1:  # it acts at one rank only
                knobs.append(Knob(name, (1, 2, 4), d, True, knob_named(cls, name).help))
        elif name == "fuse_reduce":
            if ranks > 1:  # R = 1 has no all-reduce
                knobs.append(Knob(name, (False, True), d, False, knob_named(cls, name).help))
        elif name == "allreduce":
            if ranks > 1:
                knobs.append(Knob(name, tuple(lc.ALLREDUCE_ALGOS), d, False, knob_named(cls, name).help))
        else:  # a searchable field with no rule here
            raise SpaceError(f"search/space.py has no value rule for knob {name!r}")
    # the quantization knobs at their defaults are left out: a search's configs (and their
    # canonical JSON) stay those of an unquantized lowering (amk search refuses the others)
    quant = ("weights", "quantize_lm_head", "weight_group")
    fx = {n: getattr(default, n) for n in names if n in FIXED and n not in quant}
    fx.update(fixed or {})
    # A knob left out (allreduce at R=1) keeps its default as a fixed value.
    for k in SEARCHABLE:
        if k in names and k not in {kn.name for kn in knobs}:
            fx.setdefault(k, getattr(default, k))
    return SearchSpace(knobs, fx)


def program_fingerprint(program: Any) -> str:
    """sha256 of everything a ScheduleProgram schedules (ranks, workers, slots, buffers,
    counters, tasks), leaving out its ``name`` and the ``config`` dict it records, so two
    programs get one fingerprint exactly when the lowering produced the same schedule."""
    import dataclasses

    h = hashlib.sha256()
    h.update(repr((program.ranks, program.workers, program.slots, program.max_epochs,
                   dataclasses.astuple(program.target))).encode())
    for b in program.buffers:
        h.update(repr(dataclasses.astuple(b)).encode())
    for c in program.counters:
        h.update(repr(dataclasses.astuple(c)).encode())
    for t in program.tasks:
        h.update(repr((t.id, t.rank, t.worker, t.op, t.ins, t.outs, sorted(t.params.items()),
                       t.waits, t.signals, t.group)).encode())
    return h.hexdigest()
