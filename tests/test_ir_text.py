"""Text and JSON forms of the schedule IR: exact round trips, errors, speed, docs.

Round trips are checked on the all-reduce examples, on a program that uses every op and
every corner of the syntax, and on seeded random programs. Equality is checked both as
dataclass equality and as equality of the printed forms (which also catches 1 vs 1.0,
True vs 1 and -0.0 vs 0.0, all of which compare equal as Python values).
"""

from __future__ import annotations

import json
import math
import random
import re
import struct
import time
from pathlib import Path

import pytest

from ground.errors import AmkError
from ir import jsonio, text
from ir.builder import ProgramBuilder
from ir.examples import allreduce
from ir.io import load_program, save_program
from ir.jsonio import IRJsonError, program_from_json, program_to_json
from ir.ops import OPS
from ir.program import (
    Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task, Wait,
    WeightSource,
)
from ir.text import IRParseError, format_program, parse_program

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------
# programs
# ------------------------------------------------------------------------------------

def kitchen_sink() -> ScheduleProgram:
    """Every op, symbolic bounds, weight sources, odd names, every value type."""
    b = ProgramBuilder(
        "kitchen sink \"v1\"\t\u00e9", ranks=3, workers=2, slots=2, max_epochs=0,
        target=Target(name="h100 sxm", sms=132, max_workers=0, backend="triton"),
        config={"tile": 64, "eps": 1e-5, "neg": -3, "zero": 0.0, "negzero": -0.0,
                "big": 1.7976931348623157e308, "tiny": 5e-324, "tenth": 0.1, "on": True,
                "off": False, "none": None, "algo": "one\\shot\n", "inf": math.inf,
                "ninf": -math.inf, "list": [1, 2.5, "x", [], [None, False]],
                "map": {"a": {"b c": [1]}, "true": "s"}, "": "empty key"},
    )
    H, V, HD = 64, 32, 16
    for r in range(3):
        b.buffer(f"x.r{r}", "io_input", "bf16", (H,), rank=r)
        b.buffer(f"tok.r{r}", "io_input", "i32", (1,), rank=r)
        b.buffer(f"pos.r{r}", "io_input", "i32", (1,), rank=r)
        b.buffer(f"emb.r{r}", "weight", "bf16", (V, H), rank=r,
                 source=WeightSource("model.embed_tokens.weight", ((0, V), (0, H))))
        b.buffer(f"norm.r{r}", "weight", "bf16", (H,), rank=r,
                 source=WeightSource("model.norm.weight"))
        b.buffer(f"inv.r{r}", "weight", "f32", (HD // 2,), rank=r,
                 source=WeightSource("amk.rope_inv_freq", ((-4, 0),)))
        b.buffer(f"kc.r{r}", "kv_cache", "bf16", (2, 128, HD), rank=r)
        b.buffer(f"vc.r{r}", "kv_cache", "bf16", (2, 128, HD), rank=r)
        b.buffer(f"h.r{r}", "activation", "f32", (H,), rank=r)
        b.buffer(f"am.r{r}", "scratch", "f32", (2,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "i32", (1,), rank=r)
        b.counter(f"c.r{r}", rank=r)
        b.counter(f"wide.r{r}", rank=r, width=64)
    b.buffer("rx", "activation", "f32", (2, 3, H), placement="symmetric")
    b.buffer("pairs", "scratch", "f32", (3, 2), placement="symmetric")
    b.prog.buffers.append(Buffer("task", "s", "true", (), "symmetric", 2, None))  # reserved words
    b.prog.buffers.append(Buffer("odd place", "scratch", "f16", (0, -1), "global", None,
                                 WeightSource("k\"ey", ())))
    b.prog.buffers.append(Buffer("nowhere", "activation", "f32", (4,), "local", None, None))
    b.prog.counters.append(Counter("group", -1, 0))
    b.prog.counters.append(Counter("c 2", 0, 32))
    r = 0
    b.task("embed", r, 0, "embed", ins=["emb.r0[0:32, 0:64]", "tok.r0[0:1]"], outs=["h.r0[0:64]"],
           group="g")
    b.task("norm", r, 0, "rmsnorm", ins=["h.r0[0:64]", "norm.r0[0:64]"], outs=["x.r0[0:64]"],
           params={"dim": 64, "eps": 1e-06})
    b.task("gemv", r, 1, "gemv", ins=["x.r0[0:64]", "emb.r0[0:16, 0:64]", "h.r0[0:16]"],
           outs=["h.r0[16:32]"], waits=["c.r0>=0", "c.r0>=-3", "wide.r0>=2@prev"])
    b.task("rope", r, 1, "rope", ins=["h.r0[0:32]", "inv.r0[0:8]", "pos.r0[0:1]"],
           outs=["h.r0[32:64]"], params={"head_dim": 16})
    b.task("kv", r, 0, "kv_append", ins=["h.r0[0:32]", "h.r0[32:64]", "pos.r0[0:1]"],
           outs=["kc.r0[0:2, 5:6, 0:16]", "vc.r0[0:2, 5:6, 0:16]"], params={"head_dim": 16})
    b.task("attn", r, 0, "attention",
           ins=["h.r0[0:64]", "kc.r0[0:2, 0:128, 0:16]", "vc.r0[0:2, 0:128, 0:16]", "pos.r0[0:1]"],
           outs=["x.r0[0:64]"], params={"head_dim": 16, "scale": 0.25})
    b.task("silu", r, 0, "silu_mul", ins=["h.r0[0:32]", "h.r0[32:64]"], outs=["x.r0[0:32]"])
    b.task("add", r, 0, "add", ins=["h.r0[0:64]", "x.r0[0:64]"], outs=["h.r0[0:64]"])
    b.task("red", r, 0, "reduce", ins=["rx[s:s+1, 0:3, 0:64]", "h.r0[0:64]"], outs=["x.r0[0:64]"],
           signals=["c.r1+=2", "c.r0+=0"])
    b.task("amax", r, 0, "argmax", ins=["h.r0[0:64]"], outs=["am.r0[0:2]"],
           params={"offset": 0, "mode": "first", "flag": True, "neg": -7, "f": -2.5e-10})
    b.task("amc", r, 0, "argmax_combine", ins=["pairs[0:3, 0:2]"], outs=["y.r0[0:1]"])
    b.task("gemm", r, 1, "gemm", ins=["emb.r0[0:4, 0:16]", "emb.r0[0:16, 8:24]", "kc.r0[1:2, 0:4, 0:16]"],
           outs=["kc.r0[0:1, 0:4, 0:16]"])
    b.task("cp", r, 0, "copy", ins=["x.r0[0:64]"], outs=["h.r0[0:64]"])
    b.task("ngemv", r, 1, "norm_gemv", ins=["x.r0[0:64]", "norm.r0[0:64]", "emb.r0[0:16, 0:64]"],
           outs=["h.r0[0:16]"], params={"eps": 1e-05})
    b.task("gres", r, 1, "gemv_res", ins=["x.r0[0:64]", "emb.r0[0:16, 0:64]", "h.r0[0:16]"],
           outs=["h.r0[0:16]"])
    b.task("sw", r, 1, "swiglu_gemv",
           ins=["x.r0[0:64]", "h.r0[0:64]", "emb.r0[0:16, 0:64]", "h.r0[16:32]"], outs=["x.r0[0:16]"])
    b.task("rngemv", r, 1, "reduce_norm_gemv",
           ins=["rx[s:s+1, 0:3, 0:64]", "h.r0[0:64]", "norm.r0[0:64]", "emb.r0[0:16, 0:64]"],
           outs=["h.r0[16:32]"], params={"eps": 1e-06})
    b.task("rapp", r, 0, "rope_append", ins=["h.r0[0:32]", "h.r0[32:64]", "inv.r0[0:8]", "pos.r0[0:1]"],
           outs=["kc.r0[0:2, 0:128, 0:16]", "vc.r0[0:2, 0:128, 0:16]"], params={"head_dim": 16})
    b.task("ratt", r, 0, "rope_attention",
           ins=["h.r0[0:64]", "kc.r0[0:2, 0:128, 0:16]", "vc.r0[0:2, 0:128, 0:16]", "pos.r0[0:1]",
                "inv.r0[0:8]"], outs=["x.r0[0:64]"], params={"head_dim": 16, "scale": 0.25})
    b.task("rattkv", r, 0, "rope_attention_kv",
           ins=["h.r0[0:64]", "h.r0[0:32]", "h.r0[32:64]", "kc.r0[0:2, 0:128, 0:16]", "vc.r0[0:2, 0:128, 0:16]",
                "pos.r0[0:1]", "inv.r0[0:8]"], outs=["x.r0[0:64]"], params={"head_dim": 16, "scale": 0.25})
    b.task("attcomb", r, 1, "attention_combine", ins=["rx[0:2, 0:1, 0:18]"], outs=["x.r0[0:16]"],
           params={"head_dim": 16, "parts": 2})
    b.task("put", r, 0, "put", ins=["h.r0[0:64]"], outs=["rx@2[2*s:2*s+1, 0:1, 0:64]"],
           signals=["c.r2+=1"], group="ar.l0")
    b.task("q", r, 0, "quiet")
    b.task("f", r, 1, "fence", waits=[Wait("c.r0", 1, -2), Wait("c.r0", 1, 3)])
    b.task("n", 2, 1, "nop", signals=[Signal("group", -1)], group="")
    # symbolic bounds of every shape, negative constants, other-rank local regions
    b.task("sym", 1, 0, "copy",
           ins=[Region("rx", 1, (Range(Bound(0, 1), Bound(1, 1)), Range(Bound(-3, -1), Bound(3, -2)),
                                  Range(Bound(-1, 5), Bound(0, 0))))],
           outs=[Region("x.r0", 0, (Range.of(-5, 0),))])
    b.task("unknown", 1, 1, "no_such_op", ins=["no_such_buffer[0:1]"], waits=["no_such>=1"])
    b.task("sink", 1, 1, "nop", params={"list": [1, [2.0, "3"]], "map": {"k": None, "s": {}},
                                        "nan": math.nan})
    b.prog.tasks.append(Task("weird \"id\"", 2, 0, "wait", (Region("s", 2, ()),), (), {}, (), (),
                             "true"))
    b.prog.tasks.append(Task("0starts-with-digit", -1, -2, "nop", group="0g"))
    return b.build()


def random_program(seed: int) -> ScheduleProgram:
    """A random (not necessarily valid) program exercising the syntax."""
    rng = random.Random(seed)
    names = ["a", "b.c", "x-y", "_u", "l0.q.r1", "s", "task", "true", "with space",
             "quo\"te", "\u00fcml", "tab\there", "back\\slash", "7seven", "", "inf", "#hash"]

    def name():
        return rng.choice(names) + (str(rng.randint(0, 9)) if rng.random() < 0.5 else "")

    def scalar():
        k = rng.randrange(7)
        if k == 0:
            return rng.randint(-10**20, 10**20)
        if k == 1:
            return struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if k == 2:
            return rng.choice([0.0, -0.0, 1.0, 1e16, 1e-7, 0.5, math.inf, -math.inf])
        if k == 3:
            return name()
        if k == 4:
            return rng.choice([True, False, None])
        if k == 5:
            return [scalar() for _ in range(rng.randrange(3))]
        return {name(): scalar() for _ in range(rng.randrange(3))}

    def bound():
        return Bound(rng.randint(-9, 99), rng.choice([0, 0, 0, 1, 2, -1, -3]))

    def region(rank):
        nd = rng.randrange(4)
        return Region(name(), rank if rng.random() < 0.7 else rng.randint(-1, 4),
                      tuple(Range(bound(), bound()) for _ in range(nd)))

    ranks = rng.randint(1, 4)
    prog = ScheduleProgram(
        name=name(), ranks=ranks, workers=rng.randint(0, 9),
        target=Target(name(), rng.randint(0, 200), rng.randint(0, 200), name()),
        max_epochs=rng.randint(0, 1 << 40), slots=rng.randint(1, 3),
        config={name(): scalar() for _ in range(rng.randrange(4))},
    )
    for _ in range(rng.randrange(6)):
        src = None
        if rng.random() < 0.4:
            src = WeightSource(name(), tuple((rng.randint(-5, 5), rng.randint(0, 99))
                                             for _ in range(rng.randrange(3))))
        placement = rng.choice(["local", "symmetric", "other one"])
        prog.buffers.append(Buffer(
            name(), name(), name(), tuple(rng.randint(0, 99) for _ in range(rng.randrange(4))),
            placement, rng.choice([None, rng.randint(-1, 4)]), src))
    for _ in range(rng.randrange(5)):
        prog.counters.append(Counter(name(), rng.randint(-1, 4), rng.choice([32, 64, 7])))
    for _ in range(rng.randrange(12)):
        rank = rng.randint(-1, 4)
        prog.tasks.append(Task(
            id=name(), rank=rank, worker=rng.randint(-1, 9), op=name(),
            ins=tuple(region(rank) for _ in range(rng.randrange(4))),
            outs=tuple(region(rank) for _ in range(rng.randrange(3))),
            params={name(): scalar() for _ in range(rng.randrange(4))},
            waits=tuple(Wait(name(), rng.randint(-5, 50), rng.choice([0, 0, -1, -2, 1]))
                        for _ in range(rng.randrange(3))),
            signals=tuple(Signal(name(), rng.randint(-2, 5)) for _ in range(rng.randrange(3))),
            group=rng.choice([None, name()]),
        ))
    return prog


def _has_nan(p: ScheduleProgram) -> bool:
    """Whether a config/param value is NaN (NaN != NaN defeats dataclass equality)."""
    def walk(v):
        if isinstance(v, float):
            return math.isnan(v)
        if isinstance(v, list):
            return any(walk(x) for x in v)
        if isinstance(v, dict):
            return any(walk(x) for x in v.values())
        return False
    return walk(p.config) or any(walk(t.params) for t in p.tasks)


def assert_text_roundtrip(p: ScheduleProgram, check_eq: bool = True) -> str:
    t = format_program(p)
    q = parse_program(t)
    assert format_program(q) == t
    if check_eq:
        assert q == p
    return t


def assert_json_roundtrip(p: ScheduleProgram, check_eq: bool = True) -> dict:
    j = program_to_json(p)
    q = program_from_json(j)
    assert _json_text(program_to_json(q)) == _json_text(j)
    s = jsonio.dumps(p)
    assert jsonio.dumps(jsonio.loads(s)) == s
    if check_eq:
        assert q == p
        assert jsonio.loads(s) == p
    return j


def _json_text(j) -> str:
    return json.dumps(j)  # NaN-safe comparison: 'NaN' == 'NaN' as text


# ------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------

@pytest.mark.parametrize("ranks,workers", [(2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("reuse", ["slots", "credit"])
def test_allreduce_roundtrips(ranks, workers, reuse):
    p = allreduce(ranks, 8, workers=workers, reuse=reuse)
    t = assert_text_roundtrip(p)
    assert_json_roundtrip(p)
    # the two forms are equivalent: text -> program -> JSON == program -> JSON
    assert program_to_json(parse_program(t)) == program_to_json(p)
    if reuse == "credit":
        assert "@prev" in t


def test_kitchen_sink_text_roundtrip():
    p = kitchen_sink()
    t = format_program(p)
    q = parse_program(t)
    assert format_program(q) == t
    # NaN != NaN: compare everything but the one NaN param, then the NaN itself
    nan_q = q.task_map()["sink"].params.pop("nan")
    nan_p = p.copy()
    nan_p.task_map()["sink"].params.pop("nan")
    assert math.isnan(nan_q)
    assert q == nan_p
    assert set(OPS) <= {t.op for t in p.tasks}


def test_kitchen_sink_json_roundtrip():
    p = kitchen_sink()
    j = program_to_json(p)
    assert _json_text(program_to_json(program_from_json(j))) == _json_text(j)
    s = jsonio.dumps(p)
    assert jsonio.dumps(jsonio.loads(s)) == s
    # text and JSON describe the same program
    assert format_program(jsonio.loads(s)) == format_program(p)
    assert jsonio.dumps(parse_program(format_program(p))) == s


def test_kitchen_sink_values_keep_types_and_bits():
    p = kitchen_sink()
    for q in (parse_program(format_program(p)), jsonio.loads(jsonio.dumps(p))):
        for key, v in p.config.items():
            w = q.config[key]
            assert type(w) is type(v), key
            if isinstance(v, float):
                assert struct.pack("d", v) == struct.pack("d", w), key
        assert q.config["algo"] == "one\\shot\n"
        assert q.name == p.name
        amax = q.task_map()["amax"].params
        assert amax == {"offset": 0, "mode": "first", "flag": True, "neg": -7, "f": -2.5e-10}
        assert type(amax["flag"]) is bool and type(amax["offset"]) is int


def test_canonical_text_shape():
    """Spot-check the printed forms the docs promise."""
    t = format_program(kitchen_sink())
    assert "task put @r0.w0 put(h.r0[0:64]) -> (rx@r2[2*s:2*s+1, 0:1, 0:64]) " \
           "signal(c.r2 += 1) group=ar.l0" in t
    assert "copy(rx[s:s+1, -s-3:-2*s+3, 5*s-1:0]) -> (x.r0@r0[-5:0])" in t
    assert "wait(c.r0 >= 0, c.r0 >= -3, wide.r0 >= 2 @prev)" in t
    assert "wait(c.r0 >= 1 @e-2, c.r0 >= 1 @e+3)" in t
    assert 'buffer emb.r0 weight bf16 [32, 64] @r0 src="model.embed_tokens.weight"[0:32, 0:64]' in t
    assert 'buffer norm.r0 weight bf16 [64] @r0 src="model.norm.weight"\n' in t
    assert 'buffer "task" "s" "true" [] symmetric @r2\n' in t
    assert 'buffer "odd place" scratch f16 [0, -1] "global" src="k\\"ey"\n' in t
    assert "buffer nowhere activation f32 [4] local" not in t
    assert "buffer nowhere activation f32 [4]\n" in t
    assert 'counter "group" @r-1 width=0' in t
    assert 'task "0starts-with-digit" @r-1.w-2 nop() group="0g"' in t
    assert 'nop() signal("group" += -1) group=""' in t


def test_symbolic_bound_spellings():
    for text_b, bound in [("7", Bound(7)), ("-7", Bound(-7)), ("s", Bound(0, 1)),
                          ("-s", Bound(0, -1)), ("2*s", Bound(0, 2)), ("2*s+1", Bound(1, 2)),
                          ("s-1", Bound(-1, 1)), ("-3*s-4", Bound(-4, -3)), ("0", Bound(0))]:
        assert text.format_bound(bound) == text_b
        line = f"task t @r0.w0 nop(b[{text_b}:0])"
        assert text._parse_line_lark(line)[1].ins[0].ranges[0].start == bound
        assert text._FastParser().line(line)[1].ins[0].ranges[0].start == bound
    # non-canonical spellings parse (through lark) to the same bounds
    t = text._parse_line_lark("task t @r0.w0 nop(b[ 2 * s + 1 : s - 1 , 0*s+4:-s+0 ])")[1]
    assert t.ins[0].ranges == (Range(Bound(1, 2), Bound(-1, 1)), Range(Bound(4), Bound(0, -1)))


@pytest.mark.parametrize("seed", range(150))
def test_random_programs_roundtrip(seed):
    p = random_program(seed)
    t = format_program(p)
    q = parse_program(t)
    assert format_program(q) == t
    j = program_to_json(p)
    assert _json_text(program_to_json(program_from_json(j))) == _json_text(j)
    assert format_program(program_from_json(j)) == t
    if not _has_nan(p):  # NaN breaks ==; the text equality above still holds
        assert q == p
        assert program_from_json(j) == p


# ------------------------------------------------------------------------------------
# the fast path accepts a subset of the grammar and agrees with lark
# ------------------------------------------------------------------------------------

def _lark_or_error(line: str):
    try:
        return text._parse_line_lark(line)
    except text._LineError as e:
        return ("error", e.column, e.message)


def _mutations(line: str, rng: random.Random, n: int):
    alphabet = list(" ,:[]()@{}=+-*#\"\\sr0123456789.abwxe<>") + ["@prev", "s+1", "->", ">="]
    for _ in range(n):
        chars = list(line)
        for _ in range(rng.randint(1, 3)):
            k = rng.randrange(3)
            i = rng.randrange(len(chars) + 1)
            if k == 0 and chars:
                del chars[min(i, len(chars) - 1)]
            elif k == 1:
                chars.insert(i, rng.choice(alphabet))
            elif chars:
                chars[min(i, len(chars) - 1)] = rng.choice(alphabet)
        yield "".join(chars)


def test_fast_path_agrees_with_lark():
    rng = random.Random(7)
    progs = [kitchen_sink(), allreduce(3, 8, reuse="credit"), allreduce(2, 8)]
    progs += [random_program(s) for s in range(40)]
    lines = [ln for p in progs for ln in format_program(p).splitlines()
             if ln.startswith(("task ", "buffer ", "counter ", "amk ", "program ", "target ",
                               "ranks ", "epochs ", "config "))]
    hits = {"canonical": 0, "mutated": 0}
    for line in lines:
        for k, cand in enumerate([line, *_mutations(line, rng, 6)]):
            got = text._FastParser().line(cand)
            ref = _lark_or_error(cand)
            if got is not None:
                hits["mutated" if k else "canonical"] += 1
                assert ref == got, cand  # never accepts what lark rejects; same objects
    # the comparison is only meaningful if the fast path took many lines, mutated ones too
    assert hits["canonical"] > 100 and hits["mutated"] > 80, hits


def test_canonical_big_program_never_falls_back_to_lark(monkeypatch):
    p = allreduce(4, 64, workers=3, reuse="credit")
    p.tasks = [t for t in p.tasks for _ in range(3)]
    t = format_program(p)
    calls = []
    real = text._parse_line_lark

    def spy(line):
        calls.append(line)
        return real(line)

    monkeypatch.setattr(text, "_parse_line_lark", spy)
    assert parse_program(t) == p
    assert calls == []  # every line took the fast path: lark is not even built


def test_config_with_keyword_keys_takes_the_fast_path(monkeypatch):
    # the lowering's config holds "workers", a keyword the formatter quotes; building lark
    # for that one line cost ~90 ms of every `amk validate` of a lowered schedule
    p = allreduce(2, 8)
    p.config = {"tile": 64, "workers": 4, "policy": "round_robin", "eps": 1e-05,
                "fuse": False, "max": None, "a b=c": "x y=1", "model": "config:llama"}
    t = format_program(p)
    assert 'config tile=64 "workers"=4' in t
    line = next(ln for ln in t.splitlines() if ln.startswith("config "))
    rng = random.Random(3)
    took = 0
    for k, cand in enumerate([line, *_mutations(line, rng, 300)]):
        got = text._FastParser().line(cand)
        if got is not None:
            took += 1
            assert got == _lark_or_error(cand), cand
    assert took > 30
    for dup in ('config "tile"=1 tile=2', 'config w=1 "w"=2'):
        assert text._FastParser().line(dup) is None  # lark reports the duplicate key
        assert _lark_or_error(dup)[0] == "error"
    calls = []
    real = text._parse_line_lark
    monkeypatch.setattr(text, "_parse_line_lark", lambda ln: calls.append(ln) or real(ln))
    assert parse_program(t) == p
    assert calls == []


# ------------------------------------------------------------------------------------
# text syntax details
# ------------------------------------------------------------------------------------

HEAD = "amk 1\nprogram p\nranks 2 workers 1\n"


def test_comments_blank_lines_crlf_and_header_order():
    src = ("# leading comment\n\n   \namk 1   # version\r\n"
           "ranks 2 workers 1\r\n"
           "buffer x io_input f32 [8] @r0   # trailing\n"
           "program \"p # not a comment\"\n"
           "task t @r0.w0 put(x[0:8]) -> (rx@r1[s:s+1]) {k=\"a#b\"} # c\n"
           "\tcounter c @r1\n")
    p = parse_program(src)
    assert p.name == "p # not a comment"
    assert p.tasks[0].params == {"k": "a#b"}
    assert p.tasks[0].outs[0].rank == 1 and p.tasks[0].ins[0].rank == 0
    assert p.counters == [Counter("c", 1, 32)]
    assert p.target == Target() and p.slots == 1 and p.max_epochs == 1 << 20
    assert p.config == {}


def test_lenient_spellings_parse_through_lark():
    src = HEAD + ("task t@r1.w0 put ( x [ 0 : 8 ] )->( rx @r0 [0:8] ) { a = 1 ,b=[ ] } "
                  "wait ( c>=1@prev , d >= 2 @e-1 ) signal ( c+=1 ) group = \"g\"\n"
                  "buffer \"x\" io_input f32 [ 8 ] local @r1 src = \"k\" [ 0 : 8 ]\n"
                  "target \"t\" backend=\"sim\" sms=1\nepochs slots=2\nconfig\n")
    p = parse_program(src)
    t = p.tasks[0]
    assert (t.rank, t.worker, t.op, t.group) == (1, 0, "put", "g")
    assert t.outs[0] == Region("rx", 0, (Range.of(0, 8),))
    assert t.params == {"a": 1, "b": []}
    assert t.waits == (Wait("c", 1, -1), Wait("d", 2, -1))
    assert p.buffers[0] == Buffer("x", "io_input", "f32", (8,), "local", 1,
                                  WeightSource("k", ((0, 8),)))
    assert p.target == Target("t", 1, 132, "sim") and p.slots == 2 and p.config == {}


def test_parser_does_no_semantic_validation():
    src = HEAD + ("task t @r9.w99 frobnicate(nobuf[0:1]) -> (nobuf2@r7[5:1]) "
                  "wait(nocounter >= 1) signal(other += 3)\n"
                  "task t @r0.w0 nop()\n"
                  "buffer b nokind f99 [-1] \"weird\"\n"
                  "counter c @r-5 width=3\n")
    p = parse_program(src)
    assert [t.id for t in p.tasks] == ["t", "t"]
    assert p.tasks[0].op == "frobnicate" and p.tasks[0].outs[0].rank == 7
    assert p.buffers[0].kind == "nokind" and p.buffers[0].placement == "weird"


def _err(src: str, filename: str = "f.amk") -> IRParseError:
    with pytest.raises(IRParseError) as ei:
        parse_program(src, filename)
    e = ei.value
    assert isinstance(e, AmkError) and e.exit_code == 2
    assert str(e).startswith(f"{e.file}:{e.line}:{e.column}: {e.message}")
    assert "\n" not in str(e)
    return e


def test_error_bad_token_has_position_and_expected():
    e = _err(HEAD + "task t @r0.w0 put(x[0:8]) -> (y[0:8]) wait(c > 1)\n")
    assert (e.file, e.line, e.column) == ("f.amk", 4, 46)
    assert e.message == "unexpected character '>'"
    assert e.expected == ["'>='"]  # exactly what fits here, not LALR's merged lookahead
    assert str(e) == "f.amk:4:46: unexpected character '>' (expected '>=')"


def test_error_missing_bracket():
    e = _err(HEAD + "task t @r0.w0 put(x[0:8) -> (y[0:8])\n")
    assert (e.line, e.column) == (4, 24)
    assert e.message == "unexpected ')'"
    assert e.expected == ["'*'", "','", "']'"]


def test_error_bad_number_and_bad_name():
    e = _err(HEAD + "buffer x activation f32 [8, 2.5]\n")
    assert (e.line, e.column, e.message) == (4, 30, "unexpected float '.5'")
    assert e.expected == ["','", "']'"]
    e = _err(HEAD + "buffer x activation f32 [8, x]\n")
    assert (e.line, e.column, e.expected) == (4, 29, ["an integer"])
    e = _err(HEAD + "task t @r0.w0 nop() {a=1, b=x}\n")
    assert (e.line, e.column, e.message) == (4, 29, "unexpected name 'x'")
    assert "a quoted string" in e.expected and "a float" in e.expected
    e = _err(HEAD + "counter 9c @r0\n")
    assert (e.line, e.column) == (4, 9)
    assert e.expected == ["a name", "a quoted string"]
    e = _err(HEAD + "bogus line\n")
    assert (e.line, e.column, e.message) == (4, 1, "unexpected name 'bogus'")
    assert "'task'" in e.expected and "end of line" in e.expected
    e = _err(HEAD + "task t @r0 nop()\n")
    assert (e.line, e.column) == (4, 8)
    assert e.expected == ["a worker location @rR.wW"]


def test_error_end_of_line_and_unterminated_string():
    e = _err(HEAD + "task t @r0.w0 put(x[0:8]\n")
    assert (e.line, e.column) == (4, 25)
    assert e.message == "unexpected end of line" and e.expected == ["')'", "','"]
    e = _err('amk 1\nprogram "abc\n')
    assert (e.line, e.column) == (2, 9)
    assert "string" in e.message


def test_error_duplicate_and_missing_header_lines():
    e = _err(HEAD + "buffer x io_input f32 [1] @r0\n  ranks 4 workers 1\n")
    assert (e.line, e.column) == (5, 3)
    assert e.message == "duplicate 'ranks' line (the first is on line 3)"
    e = _err("amk 1\nconfig a=1\nranks 1 workers 1\nconfig b=2\nprogram x\n")
    assert e.line == 4 and "duplicate 'config'" in e.message
    e = _err("amk 1\nranks 1 workers 1\n")
    assert "missing the 'program \"NAME\"' line" in e.message
    e = _err("amk 1\nprogram x\n")
    assert "'ranks R workers W'" in e.message
    e = _err("# only a comment\nprogram x\namk 1\n")
    assert (e.line, e.column) == (2, 1) and "first line must be the format version" in e.message
    e = _err("")
    assert "missing" in e.message


def test_error_version_target_epochs_fields():
    e = _err("amk 7\n")
    assert (e.line, e.column) == (1, 5) and "unsupported IR version 7" in e.message
    e = _err(HEAD + "target t sms=10 foo=1\n")
    assert (e.line, e.column) == (4, 17) and e.message == "unknown target field 'foo'"
    assert e.expected == ["'sms'", "'max_workers'", "'backend'"]
    e = _err(HEAD + "target t sms=\"x\"\n")
    assert "sms must be an integer" in e.message
    e = _err(HEAD + "target t backend=3\n")
    assert (e.line, e.column) == (4, 18) and "backend must be a name" in e.message
    e = _err(HEAD + "epochs slots=1 slots=2\n")
    assert "duplicate epochs field 'slots'" in e.message
    e = _err(HEAD + "epochs max=1.5\n")
    assert "max must be an integer" in e.message


def test_error_duplicate_keys():
    e = _err(HEAD + "task t @r0.w0 nop() {a=1, b=2, a=3}\n")
    assert (e.line, e.column) == (4, 32) and e.message == "duplicate key 'a'"
    e = _err(HEAD + "config a={x=1, x=2}\n")
    assert e.message == "duplicate key 'x'"


def test_error_line_numbers_in_a_big_file():
    p = allreduce(4, 8, reuse="credit")
    lines = format_program(p).splitlines()
    lines[-3] = lines[-3].replace("wait(", "wait((")
    e = _err("\n".join(lines) + "\n", "big.amk")
    assert e.line == len(lines) - 2
    assert e.column == lines[-3].index("((") + 2


def test_format_rejects_unrepresentable_values():
    p = allreduce(2, 8)
    p.config["tiles"] = (1, 2)
    with pytest.raises(ValueError, match="tuple"):
        format_program(p)
    with pytest.raises(ValueError, match="tuple"):
        program_to_json(p)


# ------------------------------------------------------------------------------------
# JSON errors
# ------------------------------------------------------------------------------------

def _jerr(obj, filename="p.json") -> IRJsonError:
    with pytest.raises(IRJsonError) as ei:
        program_from_json(obj, filename)
    assert isinstance(ei.value, AmkError)
    return ei.value


def test_json_field_paths():
    j = program_to_json(allreduce(2, 8))
    j["tasks"][3]["waits"] = [{"counter": "c", "threshold": "1"}]
    e = _jerr(j)
    assert e.path == "tasks[3].waits[0].threshold"
    assert str(e).startswith("p.json: tasks[3].waits[0].threshold: expected an integer")
    assert "put.r1.to0" in str(e)

    j = program_to_json(allreduce(2, 8))
    j["tasks"][0]["outs"][0]["ranges"][0][1] = {"const": 1, "coef": True}
    assert _jerr(j).path == "tasks[0].outs[0].ranges[0][1].coef"

    j = program_to_json(allreduce(2, 8))
    j["buffers"][1]["shape"] = [8.0]
    assert _jerr(j).path == "buffers[1].shape[0]"

    j = program_to_json(allreduce(2, 8))
    del j["tasks"][2]["op"]
    e = _jerr(j)
    assert e.path == "tasks[2].op" and "missing field" in e.message

    j = program_to_json(allreduce(2, 8))
    j["tasks"][2]["wiats"] = []
    e = _jerr(j)
    assert e.path == "tasks[2].wiats" and "unknown field" in e.message

    j = program_to_json(allreduce(2, 8))
    j["ranks"] = True
    assert _jerr(j).path == "ranks"

    j = program_to_json(allreduce(2, 8))
    j["version"] = 3
    assert "unsupported IR version 3" in _jerr(j).message

    assert _jerr([]).path == ""
    j = program_to_json(allreduce(2, 8))
    j["buffers"][0]["source"] = {"key": "k", "ranges": [[0, 1, 2]]}
    assert _jerr(j).path == "buffers[0].source.ranges[0]"
    j = program_to_json(allreduce(2, 8))
    j["config"] = {"a b": [1, {"c": {1, 2}}]}
    assert _jerr(j).path == 'config["a b"][1].c'


@pytest.mark.parametrize("key", ["version", "name", "ranks", "workers", "buffers",
                                 "counters", "tasks"])
def test_json_required_top_level_fields(key):
    j = program_to_json(allreduce(2, 8))
    del j[key]
    e = _jerr(j)
    assert e.path == key and f"missing top-level field '{key}'" in e.message
    assert str(e).startswith(f"p.json: {key}: missing top-level field")


def test_json_empty_lists_are_an_empty_program():
    p = program_from_json({"version": 1, "name": "e", "ranks": 1, "workers": 1,
                           "buffers": [], "counters": [], "tasks": []})
    assert p.tasks == [] and p.buffers == [] and p.counters == []


def test_parse_records_task_positions():
    text = ('amk 1\nprogram "p"\nranks 1 workers 1\n# a comment\n'
            'task a @r0.w0 nop()\n\n   task b @r0.w0 nop() # indented, with a comment\n'
            'task "c d" @r0.w0 nop()\n')
    positions: list[tuple[int, int]] = []
    p = parse_program(text, "p.amk", positions)
    assert [t.id for t in p.tasks] == ["a", "b", "c d"]
    assert positions == [(5, 1), (7, 4), (8, 1)]
    assert parse_program(text) == p  # the same program without positions


def test_json_defaults_for_missing_optional_fields():
    p = program_from_json({
        "version": 1, "name": "min", "ranks": 1, "workers": 1,
        "buffers": [{"name": "b", "kind": "scratch", "dtype": "f32", "shape": [4]},
                    {"name": "sym", "kind": "scratch", "dtype": "f32", "shape": [],
                     "placement": "symmetric"}],
        "counters": [{"name": "c", "rank": 0}],
        "tasks": [{"id": "t", "rank": 0, "worker": 0, "op": "nop",
                   "waits": [{"counter": "c", "threshold": 1}], "signals": [{"counter": "c"}]}],
    })
    assert p.buffers[0].rank == 0 and p.buffers[1].rank is None
    assert p.tasks[0].waits == (Wait("c", 1, 0),) and p.tasks[0].signals == (Signal("c", 1),)
    assert p.counters[0].width == 32 and p.target == Target() and p.slots == 1


def test_json_syntax_error_position():
    with pytest.raises(IRJsonError) as ei:
        jsonio.loads('{"version": 1,\n  "name": }', "bad.json")
    e = ei.value
    assert (e.line, e.column) == (2, 11)
    assert str(e).startswith("bad.json:2:11: invalid JSON")


def test_json_does_not_alias_input():
    j = program_to_json(kitchen_sink())
    p = program_from_json(j)
    p.config["list"].append(99)
    p.task_map()["amax"].params["offset"] = 5
    assert 99 not in j["config"]["list"]
    assert j["tasks"][9]["params"]["offset"] == 0


# ------------------------------------------------------------------------------------
# files
# ------------------------------------------------------------------------------------

def test_load_save_by_suffix_and_content(tmp_path):
    p = allreduce(3, 4, reuse="credit")
    for name in ("p.amk", "p.json", "p.txt", "noext"):
        path = save_program(p, tmp_path / name)
        assert load_program(path) == p
    assert (tmp_path / "p.json").read_text().startswith("{")
    assert (tmp_path / "p.amk").read_text().startswith("amk 1\n")
    # a JSON document under another suffix is recognised by its content
    (tmp_path / "j.ir").write_text(jsonio.dumps(p))
    assert load_program(tmp_path / "j.ir") == p
    assert sorted(x.name for x in tmp_path.iterdir()) == sorted(
        ["p.amk", "p.json", "p.txt", "noext", "j.ir"])  # no temporary files left behind


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(AmkError, match="cannot read .*missing.amk"):
        load_program(tmp_path / "missing.amk")
    (tmp_path / "bin.amk").write_bytes(b"amk 1\n\xff\xfe")
    with pytest.raises(AmkError, match="not UTF-8"):
        load_program(tmp_path / "bin.amk")
    (tmp_path / "bad.amk").write_text(HEAD + "task x\n")
    with pytest.raises(IRParseError) as ei:
        load_program(tmp_path / "bad.amk")
    assert str(ei.value).startswith(f"{tmp_path / 'bad.amk'}:4:7: unexpected end of line")
    (tmp_path / "bad.json").write_text('{"version": 1}')
    with pytest.raises(IRJsonError, match="bad.json: name: missing top-level field .name."):
        load_program(tmp_path / "bad.json")


# ------------------------------------------------------------------------------------
# docs stay true
# ------------------------------------------------------------------------------------

def _doc() -> str:
    return (ROOT / "docs" / "ir.md").read_text()


def test_docs_example_is_the_allreduce():
    doc = _doc()
    m = re.search(r"<!-- example: allreduce\(2, 8, reuse=\"slots\"\) -->\s*```text\n(.*?)```",
                  doc, re.S)
    assert m, "docs/ir.md lost its generated example block"
    # if this fails after a change to ir.examples: python tests/test_ir_text.py --update-docs
    assert parse_program(m.group(1), "docs/ir.md") == allreduce(2, 8, reuse="slots")
    assert m.group(1) == format_program(allreduce(2, 8, reuse="slots"))


def test_docs_cover_every_op_and_line_type():
    doc = _doc()
    for op in OPS:
        assert f"`{op}`" in doc, op
    for kw in ("amk", "program", "target", "ranks", "epochs", "config", "buffer", "counter",
               "task"):
        assert f"`{kw}" in doc, kw
    # every JSON snippet in the doc that claims to be a program loads
    for block in re.findall(r"<!-- json-program -->\s*```json\n(.*?)```", doc, re.S):
        jsonio.loads(block, "docs/ir.md")


# ------------------------------------------------------------------------------------
# speed
# ------------------------------------------------------------------------------------

def big_program(n_tasks: int) -> ScheduleProgram:
    """A lowering-shaped program: gemv tiles with waits, signals and a put per task."""
    b = ProgramBuilder("big", ranks=2, workers=132, slots=2, config={"tile": 16})
    for r in range(2):
        b.buffer(f"x.r{r}", "activation", "bf16", (4096,), rank=r)
        b.buffer(f"w.r{r}", "weight", "bf16", (14336, 4096), rank=r,
                 source=WeightSource("model.layers.0.mlp.up_proj.weight", ((0, 14336), (0, 4096))))
        b.buffer(f"y.r{r}", "activation", "f32", (14336,), rank=r)
        for w in range(132):
            b.counter(f"c.{r}.{w}", rank=r)
    b.buffer("rx", "activation", "f32", (2, 2, 14336), placement="symmetric")
    for i in range(n_tasks):
        r, w, row = i % 2, (i // 2) % 132, (i // 264) * 16 % 14336
        b.task(f"l{i // 1000}.gemv.{i}", r, w, "gemv",
               ins=[Region(f"x.r{r}", r, (Range.of(0, 4096),)),
                    Region(f"w.r{r}", r, (Range.of(row, row + 16), Range.of(0, 4096)))],
               outs=[Region(f"y.r{r}", r, (Range.of(row, row + 16),)),
                     Region("rx", 1 - r, (Range(Bound(0, 1), Bound(1, 1)), Range.of(r, r + 1),
                                          Range.of(row, row + 16)))],
               params={"tile": 16}, waits=[f"c.{r}.{w}>={i % 7}", f"c.{r}.{(w + 1) % 132}>=1@prev"],
               signals=[f"c.{1 - r}.{w}+=1"], group=f"g{i % 3}")
    return b.build()


def test_parse_speed_small():
    p = big_program(10_000)
    t = format_program(p)
    t0 = time.perf_counter()
    q = parse_program(t)
    dt = time.perf_counter() - t0
    assert q == p
    assert dt < 5.0, f"parsing 10k task lines took {dt:.2f}s"


@pytest.mark.slow
def test_parse_speed_150k_tasks():
    p = big_program(150_000)
    t = format_program(p)
    t0 = time.perf_counter()
    q = parse_program(t)
    dt = time.perf_counter() - t0
    assert len(q.tasks) == 150_000 and q.tasks[-1] == p.tasks[-1]
    assert dt < 15.0, f"parsing 150k task lines took {dt:.2f}s"


def test_numpy_integers_are_written_as_ints():
    np = pytest.importorskip("numpy")
    p = allreduce(2, 8)
    p.config["n"] = np.int64(5)
    p.tasks[0].params["k"] = np.int32(-3)
    for q in (parse_program(format_program(p)), jsonio.loads(jsonio.dumps(p))):
        assert q.config["n"] == 5 and type(q.config["n"]) is int
        assert q.tasks[0].params == {"k": -3}
    p.config["f"] = np.float32(0.5)  # would not round-trip as a float32: refuse
    with pytest.raises(ValueError, match="float32"):
        format_program(p)


def update_docs_example() -> bool:
    """Rewrite the generated example block of docs/ir.md; True if it changed.

    Run ``PYTHONPATH=. python tests/test_ir_text.py --update-docs`` after changing
    ``ir.examples.allreduce`` or the formatter (then re-read the walk-through below it).
    """
    path = ROOT / "docs" / "ir.md"
    doc = path.read_text()
    new = re.sub(r"(<!-- example: allreduce\(2, 8, reuse=\"slots\"\) -->\s*```text\n)(.*?)(```)",
                 lambda m: m.group(1) + format_program(allreduce(2, 8, reuse="slots")) + m.group(3),
                 doc, count=1, flags=re.S)
    if new != doc:
        path.write_text(new)
    return new != doc


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--update-docs"]:
        print("docs/ir.md updated" if update_docs_example() else "docs/ir.md already current")
    else:
        print("usage: python tests/test_ir_text.py --update-docs")


def test_parse_leaves_no_young_generation_to_scan():
    # the objects of a parsed program move to the oldest generation unscanned: without
    # that, the first allocation after a 61k-task parse spent 0.2 s scanning them
    import gc

    p = allreduce(4, 64, workers=3, reuse="credit")
    p.tasks = [t for t in p.tasks for _ in range(400)]  # 8k tasks (duplicate ids parse)
    t = format_program(p)
    assert gc.isenabled()
    gc.collect()
    prog = parse_program(t)
    assert gc.get_count()[0] < 700 and gc.isenabled()
    old = {id(o) for o in gc.get_objects(generation=2)}
    assert id(prog.tasks[-1]) in old and id(prog.tasks[0].ins[0]) in old
    gc.collect()
    small = parse_program(format_program(allreduce(2, 8)))  # a small build: left young
    assert id(small.tasks[-1]) not in {id(o) for o in gc.get_objects(generation=2)}
    gc.disable()  # a caller that manages the collector keeps its state
    try:
        parse_program(t)
        assert not gc.isenabled()
    finally:
        gc.enable()
    sentinel = [[]]
    gc.freeze()  # and objects the caller froze stay frozen
    try:
        frozen = gc.get_freeze_count()
        parse_program(t)
        # frozen objects that die meanwhile leave the count, so bound it, and follow one
        assert frozen - 1000 <= gc.get_freeze_count() <= frozen and gc.isenabled()
        assert id(sentinel) not in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()
    assert id(sentinel) in {id(o) for o in gc.get_objects()}
