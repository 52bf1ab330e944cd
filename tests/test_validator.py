"""Tests of the static validator (validator/): one accepted and one rejected example per check.

Each rejected example is minimal and its expected class is asserted; the accepted twin
differs only in the one detail that makes it safe.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ir.builder import ProgramBuilder
from ir.examples import allreduce
from ir.program import Bound, Range, Region, Signal, Target, Wait
from validator import Verdict, validate
from validator import structure as structure_mod
from validator.synth import transformer_schedule


def ok(prog, **kw) -> Verdict:
    v = validate(prog, **kw)
    assert v.ok, [(f.cls, f.message) for f in v.errors]
    json.dumps(v.to_json())  # every witness is JSON-serialisable
    return v


def rejected(prog, cls: str, **kw) -> Verdict:
    v = validate(prog, **kw)
    assert not v.ok
    assert cls in v.classes, [(f.cls, f.message) for f in v.errors]
    json.dumps(v.to_json())
    return v


def finding(v: Verdict, cls: str):
    return next(f for f in v.errors if f.cls == cls)


# ------------------------------------------------------------------ small program makers
def copy_chain(n=16, write=(0, 16), read=(0, 16), kind="activation"):
    """x -> a (write) -> y (read), one worker."""
    b = ProgramBuilder("cc", ranks=1, workers=1)
    b.buffer("x", "io_input", "f32", (n,), rank=0)
    b.buffer("a", kind, "f32", (n,), rank=0)
    b.buffer("y", "io_output", "f32", (n,), rank=0)
    w0, w1 = write
    r0, r1 = read
    b.task("w", 0, 0, "copy", ins=[f"x[{w0}:{w1}]"], outs=[f"a[{w0}:{w1}]"])
    b.task("r", 0, 0, "copy", ins=[f"a[{r0}:{r1}]"], outs=[f"y[{r0}:{r1}]"])
    return b.build()


def two_writers(sync: bool, th: int = 2, workers: int = 3):
    """Two workers each write half of a; a third reads all of it after waiting on c."""
    b = ProgramBuilder("tw", ranks=1, workers=workers)
    b.buffer("x", "io_input", "f32", (16,), rank=0)
    b.buffer("a", "activation", "f32", (16,), rank=0)
    b.buffer("y", "io_output", "f32", (16,), rank=0)
    b.counter("c", rank=0)
    b.task("w0", 0, 0, "copy", ins=["x[0:8]"], outs=["a[0:8]"], signals=["c+=1"])
    b.task("w1", 0, 1, "copy", ins=["x[8:16]"], outs=["a[8:16]"], signals=["c+=1"])
    b.task("r", 0, 2, "copy", ins=["a[0:16]"], outs=["y[0:16]"],
           waits=[f"c>={th}"] if sync else [])
    return b.build()


def inversion(cross_rank: bool, inverted: bool = True):
    """w0: wait c1 then signal c0; w1: wait c0 then signal c1 (the queue-inversion deadlock).
    Not inverted: w1 signals before it waits."""
    R, W = (2, 1) if cross_rank else (1, 2)
    b = ProgramBuilder("inv", ranks=R, workers=W)
    r1, w1 = (1, 0) if cross_rank else (0, 1)
    b.counter("c0", rank=r1)  # waited on by the second queue
    b.counter("c1", rank=0)  # waited on by the first queue
    b.task("a", 0, 0, "nop", waits=["c1>=1"], signals=["c0+=1"])
    if inverted:
        b.task("b", r1, w1, "nop", waits=["c0>=1"], signals=["c1+=1"])
    else:
        b.task("b0", r1, w1, "nop", signals=["c1+=1"])
        b.task("b1", r1, w1, "nop", waits=["c0>=1"])
    return b.build()


def put_program(mode: str, ranks: int = 2):
    """Rank 0 puts x into rb@1 and then makes rank 1's counter c reach 1 by ``mode``;
    rank 1 waits on c and copies rb to y, then returns a credit."""
    b = ProgramBuilder("p", ranks=ranks, workers=2)
    b.buffer("x", "io_input", "f32", (8,), rank=0)
    b.buffer("rb", "activation", "f32", (8,), placement="symmetric")
    b.buffer("y", "io_output", "f32", (8,), rank=1)
    b.counter("c", rank=1)
    b.counter("cr", rank=0)
    b.counter("co", rank=0)
    if ranks > 2:
        b.counter("c2", rank=2)
    pws = {"put_with_signal": ["c+=1"],
           "pws_and_own": ["c+=1", "co+=1"],  # also signals a counter on its own rank
           "pws_and_third": ["c2+=1", "c+=1"],  # also signals a counter on rank 2
           "own_relay": ["co+=1"],  # only its own rank; another worker relays to rank 1
           "third_relay": ["c2+=1"]}.get(mode, [])  # only rank 2, which relays to rank 1
    b.task("put", 0, 0, "put", ins=["x[0:8]"], outs=["rb@1[0:8]"], signals=pws,
           waits=["cr>=1@prev"])
    if mode == "pws_and_own":
        b.task("own", 0, 1, "nop", waits=["co>=1"])
    elif mode == "pws_and_third":
        b.task("third", 2, 0, "nop", waits=["c2>=1"])
    elif mode == "own_relay":
        b.task("relay", 0, 1, "nop", waits=["co>=1"], signals=["c+=1"])
    elif mode == "third_relay":
        b.task("relay", 2, 0, "nop", waits=["c2>=1"], signals=["c+=1"])
    if mode == "quiet":
        b.task("q", 0, 0, "quiet")
        b.task("s", 0, 0, "nop", signals=["c+=1"])
    elif mode == "no_quiet":
        b.task("s", 0, 0, "nop", signals=["c+=1"])
    elif mode == "fence_same_rank":
        b.task("f", 0, 0, "fence")
        b.task("s", 0, 0, "nop", signals=["c+=1"])
    elif mode == "fence_other_rank":  # fence, then signal rank 2, which relays to rank 1
        b.task("f", 0, 0, "fence")
        b.task("s", 0, 0, "nop", signals=["c2+=1"])
        b.task("relay", 2, 0, "nop", waits=["c2>=1"], signals=["c+=1"])
    b.task("rd", 1, 0, "copy", ins=["rb@1[0:8]"], outs=["y[0:8]"], waits=["c>=1"],
           signals=["cr+=1"])
    return b.build()


def shared_counter_allreduce(ranks: int):
    """One-shot all-reduce with two slots but ONE arrival counter per destination shared by
    all sources (the first version of ir.examples.allreduce): unsafe for 3+ ranks, because
    a fast peer's next-step signal can stand in for a slow peer's signal of this step."""
    n = 8
    b = ProgramBuilder("ar-shared", ranks=ranks, workers=1, slots=2)
    b.buffer("rx", "activation", "f32", (2, ranks, n), placement="symmetric")
    for r in range(ranks):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (n,), rank=r)
        b.counter(f"c.rx.r{r}", rank=r)
    for r in range(ranks):
        for p in range(ranks):
            if p != r:
                b.task(f"put.r{r}.to{p}", r, 0, "put", ins=[f"x.r{r}[0:{n}]"],
                       outs=[f"rx@{p}[s:s+1, {r}:{r + 1}, 0:{n}]"], signals=[f"c.rx.r{p}+=1"])
        b.task(f"self.r{r}", r, 0, "copy", ins=[f"x.r{r}[0:{n}]"],
               outs=[f"rx@{r}[s:s+1, {r}:{r + 1}, 0:{n}]"])
        b.task(f"sum.r{r}", r, 0, "reduce", ins=[f"rx[s:s+1, 0:{ranks}, 0:{n}]"],
               outs=[f"y.r{r}[0:{n}]"], waits=[f"c.rx.r{r}>={ranks - 1}"])
    return b.build()


def no_credit_allreduce(ranks: int):
    """One slot and no credit: a peer's put of step e+1 can overwrite the receive buffer
    before this rank's reduce of step e has read it."""
    n = 8
    b = ProgramBuilder("ar-nocredit", ranks=ranks, workers=1, slots=1)
    b.buffer("rx", "activation", "f32", (ranks, n), placement="symmetric")
    for r in range(ranks):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (n,), rank=r)
        for s in range(ranks):
            if s != r:
                b.counter(f"c.rx.r{r}.from{s}", rank=r)
    for r in range(ranks):
        for p in range(ranks):
            if p != r:
                b.task(f"put.r{r}.to{p}", r, 0, "put", ins=[f"x.r{r}[0:{n}]"],
                       outs=[f"rx@{p}[{r}:{r + 1}, 0:{n}]"], signals=[f"c.rx.r{p}.from{r}+=1"])
        b.task(f"self.r{r}", r, 0, "copy", ins=[f"x.r{r}[0:{n}]"],
               outs=[f"rx@{r}[{r}:{r + 1}, 0:{n}]"])
        b.task(f"sum.r{r}", r, 0, "reduce", ins=[f"rx[0:{ranks}, 0:{n}]"],
               outs=[f"y.r{r}[0:{n}]"],
               waits=[f"c.rx.r{r}.from{s}>=1" for s in range(ranks) if s != r])
    return b.build()


# ------------------------------------------------------------------ reference schedules
@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("reuse", ["slots", "credit"])
def test_allreduce_examples_accepted(ranks, reuse):
    v = ok(allreduce(ranks, 8, reuse=reuse))
    assert v.stats["tasks"] == ranks * (ranks + 1)


@pytest.mark.parametrize("workers", [2, 3])
def test_allreduce_more_workers_accepted(workers):
    ok(allreduce(3, 8, workers=workers, reuse="credit"))


def test_synthetic_transformer_accepted():
    for reuse in ("credit", "slots"):
        p = transformer_schedule(2, 4, 2, hidden=256, inter=512, q_heads=8, kv_heads=4,
                                 seq=16, qkv_tiles=8, o_tiles=8, gu_tiles=8, act_tiles=4,
                                 down_tiles=8, chunks=2, reuse=reuse)
        ok(p)


# ------------------------------------------------------------------ structure
def test_duplicate_task_id():
    p = copy_chain()
    p.tasks[1] = dataclasses.replace(p.tasks[1], id="w")
    rejected(p, "DuplicateTask")


def test_unknown_op_and_backend():
    p = copy_chain()
    p.tasks[0] = dataclasses.replace(p.tasks[0], op="matmul3")
    rejected(p, "UnknownOp")
    rejected(copy_chain(), "UnknownBackend", backend="cuda")
    ok(copy_chain(), backend="triton")


def test_arity():
    b = ProgramBuilder("ar", ranks=1, workers=1)
    b.buffer("x", "io_input", "f32", (16,), rank=0)
    b.buffer("y", "io_output", "f32", (8,), rank=0)
    b.task("g", 0, 0, "gemv", ins=["x[0:16]"], outs=["y[0:8]"])
    rejected(b.build(), "BadArity")


def gemv_prog(w_region="w[0:8, 0:16]", x_region="x[0:16]", y_region="y[0:8]",
              wshape=(8, 16), xdtype="f32"):
    b = ProgramBuilder("g", ranks=1, workers=1)
    b.buffer("x", "io_input", xdtype, (16,), rank=0)
    b.buffer("w", "weight", "bf16", wshape, rank=0)
    b.buffer("y", "io_output", "f32", (8,), rank=0)
    b.task("g", 0, 0, "gemv", ins=[x_region, w_region], outs=[y_region])
    return b.build()


def test_tile_regions_and_shapes():
    ok(gemv_prog())
    v = rejected(gemv_prog(w_region="w[0:8, 8:24]"), "RegionOutOfBounds")  # tile past the end
    assert finding(v, "RegionOutOfBounds").witness["range"] == [8, 24]
    rejected(gemv_prog(x_region="x[0:12]", w_region="w[0:8, 0:16]"), "ShapeMismatch")
    rejected(gemv_prog(y_region="y[0:4]"), "ShapeMismatch")
    rejected(gemv_prog(xdtype="i32"), "BadDtype")


def test_params():
    def norm(params):
        b = ProgramBuilder("n", ranks=1, workers=1)
        b.buffer("x", "io_input", "f32", (16,), rank=0)
        b.buffer("w", "weight", "f32", (16,), rank=0)
        b.buffer("y", "io_output", "f32", (16,), rank=0)
        b.task("n", 0, 0, "rmsnorm", ins=["x[0:16]", "w[0:16]"], outs=["y[0:16]"],
               params=params)
        return b.build()
    ok(norm({"dim": 16, "eps": 1e-6}))
    rejected(norm({"dim": 16}), "BadParams")  # eps missing
    rejected(norm({"dim": 16, "eps": 2.0}), "BadParams")  # out of range
    rejected(norm({"dim": 16, "eps": math.nan}), "BadParams")
    rejected(norm({"dim": 12, "eps": 1e-6}), "ShapeMismatch")  # dim vs the weight region
    rejected(norm({"dim": "16", "eps": 1e-6}), "BadParams")


def test_slot_regions_bounds_and_extent():
    def prog(lo, hi, slots=2):
        b = ProgramBuilder("s", ranks=1, workers=1, slots=slots)
        b.buffer("x", "io_input", "f32", (4,), rank=0)
        b.buffer("a", "activation", "f32", (2, 4), rank=0)
        b.buffer("y", "io_output", "f32", (4,), rank=0)
        b.task("w", 0, 0, "copy", ins=["x[0:4]"], outs=[f"a[{lo}:{hi}, 0:4]"])
        b.task("r", 0, 0, "copy", ins=[f"a[{lo}:{hi}, 0:4]"], outs=["y[0:4]"])
        return b.build()
    ok(prog("s", "s+1"))
    v = rejected(prog("s+1", "s+2"), "RegionOutOfBounds")  # slot 1 reaches row 2
    assert finding(v, "RegionOutOfBounds").witness["slot"] == 1
    rejected(prog("s", "2*s+1"), "BadRegion")  # extent changes with the slot


def test_remote_read_write_wait():
    b = ProgramBuilder("r", ranks=2, workers=1)
    b.buffer("x", "io_input", "f32", (4,), rank=1)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.task("t", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"])
    rejected(b.build(), "RemoteRead")
    b = ProgramBuilder("w", ranks=2, workers=1)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=1)
    b.task("t", 0, 0, "put", ins=["x[0:4]"], outs=["y[0:4]"])
    rejected(b.build(), "RemoteWriteToLocal")
    b = ProgramBuilder("rw", ranks=2, workers=1)
    b.counter("c", rank=1)
    b.task("s", 1, 0, "nop", signals=["c+=1"])
    b.task("t", 0, 0, "nop", waits=["c>=1"])
    rejected(b.build(), "RemoteWait")


def test_unknown_buffer_and_counter():
    p = copy_chain()
    t = p.tasks[1]
    p.tasks[1] = dataclasses.replace(t, ins=(Region("nope", 0, (Range.of(0, 4),)),))
    rejected(p, "UnknownBuffer")
    p = copy_chain()
    p.tasks[0] = dataclasses.replace(p.tasks[0], signals=(Signal("ghost", 1),))
    rejected(p, "UnknownCounter")


@pytest.mark.parametrize("amount", [0, -1])
def test_non_monotone_signal(amount):
    b = ProgramBuilder("m", ranks=1, workers=1)
    b.counter("c", 0)
    b.task("a", 0, 0, "nop", signals=["c+=1"])
    b.task("b", 0, 0, "nop", waits=["c>=1"])
    ok(b.build())
    p = b.build()
    p.tasks[0] = dataclasses.replace(p.tasks[0], signals=(Signal("c", amount),))
    rejected(p, "NonMonotoneCounter")


def test_counter_overflow():
    def prog(max_epochs, amount=4, width=32):
        b = ProgramBuilder("o", ranks=1, workers=1, max_epochs=max_epochs)
        b.counter("c", 0, width=width)
        b.task("a", 0, 0, "nop", signals=[f"c+={amount}"])
        b.task("b", 0, 0, "nop", waits=[f"c>={amount}"])
        return b.build()
    ok(prog(1 << 20))
    v = rejected(prog(1 << 30), "CounterOverflow")  # 4 * 2^30 > 2^31 - 1
    assert finding(v, "CounterOverflow").witness["per_epoch"] == 4
    ok(prog(1 << 30, width=64))


def test_workers_within_coresidency():
    def prog(workers, max_workers):
        b = ProgramBuilder("w", ranks=1, workers=workers,
                           target=Target(sms=132, max_workers=max_workers))
        b.task("a", 0, workers - 1, "nop")
        return b.build()
    ok(prog(8, 8))
    rejected(prog(9, 8), "TooManyWorkers")
    # Triton: the limit is max_workers (CTAs per SM x SMs), not one worker per SM; the
    # runtime re-checks the compiled kernel's occupancy before launching
    ok(prog(264, 264), backend="triton")
    rejected(prog(265, 264), "TooManyWorkers", backend="triton")


@pytest.mark.parametrize("mutate", [
    lambda p: setattr(p, "ranks", 0),
    lambda p: setattr(p, "tasks", None),
    lambda p: setattr(p.tasks[0], "ins", None),
    lambda p: setattr(p.tasks[0], "params", [1, 2]),
    lambda p: setattr(p.tasks[0], "rank", "zero"),
    lambda p: setattr(p.tasks[0], "waits", (Wait("c", 1.5),)),
    lambda p: setattr(p.tasks[0], "ins", (Region("x", 0, (Range(Bound("0"), Bound(4)),)),)),
    lambda p: setattr(p.tasks[0], "ins", (Region("x", 0, ("0:4",)),)),
    lambda p: setattr(p.buffers[0], "shape", (-4,)),
    lambda p: setattr(p.buffers[0], "dtype", "f64"),
    lambda p: setattr(p.counters[0], "width", 16),
    lambda p: setattr(p.tasks[0], "signals", (Signal("c", 1.0),)),
    lambda p: setattr(p.tasks[0], "params", {"x": [1]}),
    lambda p: setattr(p, "slots", 0),
])
def test_malformed_input_never_raises(mutate):
    b = ProgramBuilder("m", ranks=1, workers=1)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.counter("c", 0)
    b.task("t", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"], signals=["c+=1"])
    p = b.build()
    mutate(p)
    v = validate(p)
    assert not v.ok
    assert "InternalError" not in v.classes, [f.message for f in v.errors]
    json.dumps(v.to_json(), default=str)


def _index_arrays(prog):
    st = structure_mod.check_structure(prog)
    assert not st.fatal
    ix = st.index
    return {k: getattr(ix, k) for k in ("t_rank", "t_worker", "t_op", "r_task", "r_out",
                                        "r_buf", "r_rank", "r_operand", "lo_c", "lo_k",
                                        "hi_c", "hi_k", "w_task", "w_ctr", "w_thr", "w_off",
                                        "s_task", "s_ctr", "s_amt", "ctr_n")}


def test_structure_index_same_for_shared_and_fresh_objects():
    """Shared range / wait / signal tuples (as the text parser builds them) are read once;
    the Index must not depend on it."""
    from ir.text import format_program, parse_program

    small = dict(hidden=256, inter=512, q_heads=8, kv_heads=4, seq=16, qkv_tiles=8, o_tiles=8,
                 gu_tiles=8, act_tiles=4, down_tiles=8, chunks=2)
    for reuse in ("credit", "slots"):
        shared = transformer_schedule(2, 4, 2, reuse=reuse, **small)
        fresh = transformer_schedule(2, 4, 2, reuse=reuse, share=False, **small)
        parsed = parse_program(format_program(fresh))
        want = _index_arrays(fresh)
        for other in (shared, parsed):
            got = _index_arrays(other)
            for k in want:
                assert np.array_equal(np.asarray(want[k]), np.asarray(got[k])), (reuse, k)
    prog = respelled_waits(allreduce(3, 8, reuse="credit"), -1, -1)
    want = _index_arrays(prog)
    got = _index_arrays(parse_program(format_program(prog)))
    assert all(np.array_equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("reuse,counters,digest", [("credit", 72, "2e1a0a3ebfe9e6f3"),
                                                    ("slots", 56, "5f2897846a4da9ec")])
def test_synthetic_schedule_is_pinned(reuse, counters, digest):
    """validator/synth.py builds the same program, byte for byte in the text form, as when
    the benchmark numbers in docs/validator.md were taken; it validates."""
    import hashlib

    from ir.text import format_program

    small = dict(hidden=256, inter=512, q_heads=8, kv_heads=4, seq=16, qkv_tiles=8, o_tiles=8,
                 gu_tiles=8, act_tiles=4, down_tiles=8, chunks=2)
    p = transformer_schedule(2, 4, 2, reuse=reuse, **small)
    assert (len(p.tasks), len(p.buffers), len(p.counters)) == (232, 90, counters)
    assert hashlib.sha256(format_program(p).encode()).hexdigest()[:16] == digest
    ok(p)
    with pytest.raises(ValueError, match="do not split evenly"):
        transformer_schedule(8, 4, 1, **small)  # 4 KV heads over 8 ranks


def test_structure_findings_in_program_order():
    """Every task problem is reported, task by task in program order and within a task in
    the order of the checks (head, arity, regions, dtypes, params, waits, signals), with
    fatal problems skipping only what depends on them."""
    b = ProgramBuilder("m", ranks=2, workers=1)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.buffer("z", "io_input", "i32", (4,), rank=0)
    b.counter("c", 0)
    b.counter("d", 1)
    b.task("a", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"], waits=["c>=1"])
    b.task("b", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"], signals=["c+=1"])
    b.task("c", 0, 0, "reduce", ins=["z[0:4]"], outs=["y[0:4]"])
    b.task("d", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"])
    b.task("e", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"])
    p = b.build()
    t = p.tasks
    t[0] = dataclasses.replace(t[0], outs=(), ins=t[0].ins + (Region("q", 0, t[0].ins[0].ranges),),
                               waits=(Wait("d", 1),))
    t[1] = dataclasses.replace(t[1], rank=5)  # fatal head problem: nothing else checked
    t[2] = dataclasses.replace(t[2], signals=(Signal("c", 0), Signal("nope", 1)))
    t[3] = dataclasses.replace(t[3], id="a")
    t[4] = dataclasses.replace(t[4], ins=(Region("x", 0, (Range(Bound(2), Bound(6)),)),))
    st = structure_mod.check_structure(p)
    assert st.fatal and st.index is None
    assert [(f.cls, f.tasks) for f in st.findings] == [
        ("BadArity", ["a"]), ("UnknownBuffer", ["a"]), ("RemoteWait", ["a"]),
        ("BadTask", ["b"]),
        ("BadDtype", ["c"]), ("NonMonotoneCounter", ["c"]), ("UnknownCounter", ["c"]),
        ("DuplicateTask", ["a"]),
        ("RegionOutOfBounds", ["e"]),
    ]
    assert st.findings[3].message == "task b: rank 5 is not in [0, 2)"
    assert st.findings[-1].witness["range"] == [2, 6]


def test_region_bounds_checked_exactly_for_large_slot_coefficients():
    """A slot coefficient whose product with the last slot leaves int64 is checked with
    exact integers (wrapping arithmetic would make ``[2**64, 2**64 + 4)`` look like
    ``[0, 4)``)."""
    p = gemv_prog()
    p.slots = 5
    big = 1 << 62
    t = p.tasks[0]
    reg = t.ins[0]
    p.tasks[0] = dataclasses.replace(t, ins=(dataclasses.replace(
        reg, ranges=(Range(Bound(0, big), Bound(reg.ranges[0].stop.const, big)),)
        + tuple(reg.ranges[1:])),) + tuple(t.ins[1:]))
    v = rejected(p, "RegionOutOfBounds")
    assert finding(v, "RegionOutOfBounds").witness["slot"] == 4


# ------------------------------------------------------------------ deadlock
@pytest.mark.parametrize("cross_rank", [False, True])
def test_queue_inversion_deadlock(cross_rank):
    v = rejected(inversion(cross_rank), "DeadlockCycle")
    cyc = finding(v, "DeadlockCycle")
    assert set(cyc.tasks) == {"a", "b"}
    assert len(cyc.witness["cycle"]) == 4  # task -> counter -> task -> counter
    ok(inversion(cross_rank, inverted=False))


def test_unsatisfiable_threshold():
    b = ProgramBuilder("u", ranks=1, workers=2)
    b.counter("c", 0)
    b.task("a", 0, 0, "nop", signals=["c+=1"])
    b.task("b", 0, 1, "nop", waits=["c>=1"])
    ok(b.build())
    p = b.build()
    p.tasks[1] = dataclasses.replace(p.tasks[1], waits=(Wait("c", 2),))
    v = rejected(p, "UnsatisfiableWait")
    assert finding(v, "UnsatisfiableWait").witness["signalled_per_step"] == 1
    assert "Deadlock" in v.classes or "DeadlockCycle" in v.classes


def test_stall_without_cycle_reports_blocked_queues():
    b = ProgramBuilder("st", ranks=1, workers=2)
    b.counter("c", 0)
    b.counter("never", 0)
    b.task("a", 0, 0, "nop", waits=["never>=0"], signals=["c+=1"])
    b.task("b", 0, 1, "nop", waits=["c>=1"])
    ok(b.build())
    p = b.build()
    p.tasks[0] = dataclasses.replace(p.tasks[0], waits=(Wait("never", 1),))
    v = rejected(p, "Deadlock")
    blocked = finding(v, "Deadlock").witness["blocked"]
    assert {x["task"] for x in blocked} == {"a", "b"}
    w = next(x for x in blocked if x["task"] == "a")["waits"][0]
    assert (w["counter"], w["value"], w["needed"]) == ("never", 0, 1)


def test_credit_never_returned():
    """A credit nobody returns: N(cr) = 0, so even step 0's ``cr >= 1 @prev`` needs
    (0 - 1) * 0 + 1 = 1 increment. The witness names the launch length."""
    def prog(returned):
        b = ProgramBuilder("cr", ranks=2, workers=1)
        b.counter("c", 1)
        b.counter("cr", 0)
        b.task("put", 0, 0, "nop", waits=["cr>=1@prev"], signals=["c+=1"])
        b.task("get", 1, 0, "nop", waits=["c>=1"], signals=["cr+=1"] if returned else [])
        return b.build()
    ok(prog(True))
    v = rejected(prog(False), "UnsatisfiableWait")
    stall = next(f for f in v.errors if f.cls in ("Deadlock", "DeadlockCycle"))
    assert stall.witness["launch_steps"] == 1


def test_collective_participation():
    b = ProgramBuilder("cp", ranks=2, workers=1)
    b.task("a0", 0, 0, "nop", group="g")
    b.task("a1", 1, 0, "nop", group="g")
    ok(b.build())
    b = ProgramBuilder("cp", ranks=2, workers=1)
    b.task("a0", 0, 0, "nop", group="g")
    b.task("a1", 1, 0, "nop")
    v = rejected(b.build(), "CollectiveParticipation")
    assert finding(v, "CollectiveParticipation").witness["ranks_missing"] == [1]


def test_collective_order():
    def prog(swap):
        b = ProgramBuilder("co", ranks=2, workers=1)
        for r in range(2):
            order = ["g2", "g1"] if (swap and r == 1) else ["g1", "g2"]
            for g in order:
                b.task(f"{g}.r{r}", r, 0, "nop", group=g)
        return b.build()
    ok(prog(False))
    v = rejected(prog(True), "CollectiveOrder")
    assert set(finding(v, "CollectiveOrder").witness["groups"]) == {"g1", "g2"}


# ------------------------------------------------------------------ races within a step
def test_partial_coverage_read():
    ok(copy_chain(write=(0, 16)))
    v = rejected(copy_chain(write=(0, 12)), "PartialCoverageRead")
    assert finding(v, "PartialCoverageRead").witness["uncovered_box"] == [[12, 16]]


def test_uncovered_read():
    b = ProgramBuilder("u", ranks=1, workers=1)
    b.buffer("a", "scratch", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.task("r", 0, 0, "copy", ins=["a[0:4]"], outs=["y[0:4]"])
    rejected(b.build(), "UncoveredRead")
    b = ProgramBuilder("u", ranks=1, workers=1)  # an input holds data before the step
    b.buffer("a", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.task("r", 0, 0, "copy", ins=["a[0:4]"], outs=["y[0:4]"])
    ok(b.build())


def test_coverage_by_several_writes_and_2d_boxes():
    b = ProgramBuilder("c2", ranks=1, workers=2)
    b.buffer("x", "io_input", "f32", (4, 8), rank=0)
    b.buffer("a", "activation", "f32", (4, 8), rank=0)
    b.buffer("y", "io_output", "f32", (4, 8), rank=0)
    b.counter("c", 0)
    b.task("w0", 0, 0, "copy", ins=["x[0:4, 0:4]"], outs=["a[0:4, 0:4]"], signals=["c+=1"])
    b.task("w1", 0, 0, "copy", ins=["x[0:2, 4:8]"], outs=["a[0:2, 4:8]"], signals=["c+=1"])
    b.task("w2", 0, 0, "copy", ins=["x[2:4, 4:8]"], outs=["a[2:4, 4:8]"], signals=["c+=1"])
    b.task("r", 0, 1, "copy", ins=["a[0:4, 0:8]"], outs=["y[0:4, 0:8]"], waits=["c>=3"])
    ok(b.build())
    p = b.build()
    p.tasks.pop(2)  # drop w2: rows 2-3 of columns 4-8 are never written
    p.tasks[-1] = dataclasses.replace(p.tasks[-1], waits=(Wait("c", 2),))
    v = rejected(p, "PartialCoverageRead")
    assert finding(v, "PartialCoverageRead").witness["uncovered_box"] == [[2, 4], [4, 8]]


def test_partial_wait_on_shared_counter():
    ok(two_writers(sync=True, th=2))
    v = rejected(two_writers(sync=True, th=1), "ReadWriteRace")  # c >= 1 of 2 signals
    assert {"w0", "w1"} & set(finding(v, "ReadWriteRace").tasks)


def test_read_write_race_on_persistent_buffer():
    def prog(sync):
        b = ProgramBuilder("kv", ranks=1, workers=2)
        b.buffer("k", "io_input", "f32", (4,), rank=0)
        b.buffer("kc", "kv_cache", "f32", (1, 8, 4), rank=0)
        b.buffer("y", "io_output", "f32", (4,), rank=0)
        b.counter("c", 0)
        b.task("app", 0, 0, "copy", ins=["k[0:4]"], outs=["kc[0:1, 3:4, 0:4]"],
               signals=["c+=1"])
        b.task("rd", 0, 1, "copy", ins=["kc[0:1, 3:4, 0:4]"], outs=["y[0:4]"],
               waits=["c>=1"] if sync else [])
        return b.build()
    ok(prog(True))
    rejected(prog(False), "ReadWriteRace")


def test_unordered_writes():
    def prog(sync):
        b = ProgramBuilder("ww", ranks=1, workers=2)
        b.buffer("x", "io_input", "f32", (8,), rank=0)
        b.buffer("a", "io_output", "f32", (8,), rank=0)
        b.counter("c", 0)
        b.task("w0", 0, 0, "copy", ins=["x[0:6]"], outs=["a[0:6]"], signals=["c+=1"])
        b.task("w1", 0, 1, "copy", ins=["x[4:8]"], outs=["a[4:8]"],
               waits=["c>=1"] if sync else [])
        return b.build()
    ok(prog(True))
    v = rejected(prog(False), "UnorderedWrites")
    assert finding(v, "UnorderedWrites").witness["overlap"] == [[4, 6]]


def test_unordered_writes_symbolic_slot_has_z3_model():
    def prog(row):
        b = ProgramBuilder("z", ranks=1, workers=2, slots=2)
        b.buffer("x", "io_input", "f32", (4,), rank=0)
        b.buffer("a", "io_output", "f32", (2, 4), rank=0)
        b.task("w0", 0, 0, "copy", ins=["x[0:4]"], outs=["a[s:s+1, 0:4]"])
        b.task("w1", 0, 1, "copy", ins=["x[0:4]"], outs=[f"a[{row}:{row + 1}, 0:4]"])
        return b.build()
    v = rejected(prog(1), "UnorderedWrites")  # overlaps when s = 1
    w = finding(v, "UnorderedWrites").witness
    assert w["z3_model"]["slot_a"] == 1 and w["z3_model"]["solver"] == "z3"


# ------------------------------------------------------------------ remote delivery
def test_put_with_signal_and_quiet_accepted():
    ok(put_program("put_with_signal"))
    ok(put_program("quiet"))
    ok(put_program("fence_same_rank"))


@pytest.mark.parametrize("mode, ranks", [("pws_and_own", 2), ("pws_and_third", 3)])
def test_put_may_also_signal_other_ranks(mode, ranks):
    """docs/ir.md: a task may signal counters on any rank, a put included. Its signal to its
    own rank (or a third rank) is accepted; the data is published by its signal to the
    destination rank (put-with-signal)."""
    ok(put_program(mode, ranks))


@pytest.mark.parametrize("mode, ranks", [("own_relay", 2), ("third_relay", 3)])
def test_put_signal_to_another_rank_publishes_no_data(mode, ranks):
    """A put's signal to a counter that is not on its destination rank orders nothing about
    the remote data (NVSHMEM delivers a signal after the data only to the same PE): a relay
    of it to the destination is a read before delivery."""
    v = rejected(put_program(mode, ranks), "RemoteReadBeforeDelivery")
    f = finding(v, "RemoteReadBeforeDelivery")
    assert "put" in f.tasks and "rd" in f.tasks


def test_missing_quiet_before_signal():
    v = rejected(put_program("no_quiet"), "RemoteReadBeforeDelivery")
    w = finding(v, "RemoteReadBeforeDelivery").witness
    assert any("no quiet" in m for m in w["missing"])


def test_fence_to_a_different_rank():
    v = rejected(put_program("fence_other_rank", ranks=3), "RemoteReadBeforeDelivery")
    assert finding(v, "RemoteReadBeforeDelivery").witness["fence_to_other_rank"] is True


# ------------------------------------------------------------------ across steps
@pytest.mark.parametrize("ranks", [2, 3])
def test_receive_buffer_reuse_without_credit(ranks):
    v = rejected(no_credit_allreduce(ranks), "ReceiveBufferReuseWithoutCredit")
    w = finding(v, "ReceiveBufferReuseWithoutCredit").witness
    assert w["steps"] == [0, 1] and w["later"]["access"].startswith("pending write")


@pytest.mark.parametrize("ranks", [3, 4])
def test_shared_arrival_counter_with_slots_is_rejected(ranks):
    v = validate(shared_counter_allreduce(ranks))
    assert not v.ok and "RemoteReadBeforeDelivery" in v.classes
    ok(shared_counter_allreduce(2))  # one source per counter: safe


def test_cross_epoch_late_delivery():
    """Rank 1 writes rb locally each step and tells rank 0, which overwrites it remotely;
    nothing orders that put before rank 1's write of the next step."""
    def prog(wait_for_put):
        b = ProgramBuilder("xe", ranks=2, workers=1)
        b.buffer("x", "io_input", "f32", (4,), rank=1)
        b.buffer("z", "io_input", "f32", (4,), rank=0)
        b.buffer("rb", "io_output", "f32", (4,), placement="symmetric")
        b.counter("c", 0)
        b.counter("c2", 1)
        b.task("w", 1, 0, "copy", ins=["x[0:4]"], outs=["rb@1[0:4]"], signals=["c+=1"])
        if wait_for_put:
            b.task("done", 1, 0, "nop", waits=["c2>=1"])
        b.task("put", 0, 0, "put", ins=["z[0:4]"], outs=["rb@1[0:4]"], waits=["c>=1"],
               signals=["c2+=1"])
        return b.build()
    ok(prog(True))
    rejected(prog(False), "CrossEpochRace")


def test_credit_counts_are_epoch_relative():
    # the credit example waits for the previous step's credits: accepted for 2..4 ranks
    for r in (2, 3, 4):
        v = ok(allreduce(r, 4, reuse="credit"))
        assert v.stats["window_epochs"] == 2


def respelled_waits(prog, offset: int, delta: int):
    """``prog`` with every wait of the given offset rewritten as offset 0 and threshold
    ``t + delta * N(c)``."""
    n = prog.signals_per_epoch()
    for i, t in enumerate(prog.tasks):
        prog.tasks[i] = dataclasses.replace(t, waits=tuple(
            Wait(w.counter, w.threshold + delta * n[w.counter], 0) if w.offset == offset else w
            for w in t.waits))
    return prog


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_credit_spelled_as_a_zero_threshold_is_accepted(ranks):
    """``wait(c >= t - N)`` is satisfied at once in step 0 and means ``c >= (e - 1) N + t``
    in step e: exactly the credit ``wait(c >= t @prev)``. The cross-step reasoning uses the
    step-e threshold, so the respelled credit is accepted like the original."""
    prog = respelled_waits(allreduce(ranks, 8, reuse="credit"), -1, -1)
    assert {w.threshold for t in prog.tasks for w in t.waits if w.counter.startswith("c.cr")} \
        == {0}
    ok(prog)
    # the same spelling for the arrivals waits for the previous step's data: rejected
    bad = respelled_waits(allreduce(ranks, 8, reuse="credit"), 0, -1)
    v = validate(bad)
    assert not v.ok and v.classes & {"RemoteReadBeforeDelivery",
                                     "ReceiveBufferReuseWithoutCredit"}, v.classes


@pytest.mark.parametrize("thr", [1 << 31, 1 << 63, 1 << 70])
def test_threshold_beyond_the_counter_range_is_unsatisfiable(thr):
    """A threshold no counter value can reach is a deadlock diagnosis naming the task, not
    an internal error (the value does not fit the analysis' int64 arrays)."""
    p = allreduce(2, 8, reuse="credit")
    t = p.tasks[-1]
    p.tasks[-1] = dataclasses.replace(t, waits=(Wait(t.waits[0].counter, thr),))
    v = rejected(p, "UnsatisfiableWait")
    assert "InternalError" not in v.classes
    f = finding(v, "UnsatisfiableWait")
    assert f.tasks == [t.id] and f.witness["threshold"] == thr
    assert f"{t.waits[0].counter} >= {thr}" in f.message and "32-bit counter's range" in f.message


def test_threshold_far_below_zero_is_satisfied_at_once():
    p = allreduce(2, 8, reuse="credit")
    t = p.tasks[-1]
    p.tasks[-1] = dataclasses.replace(t, waits=t.waits + (Wait(t.waits[0].counter, -(1 << 70)),))
    ok(p)


def test_verdict_json_keys():
    v = validate(copy_chain(write=(0, 12)))
    d = v.to_json()
    assert set(d) == {"ok", "errors", "stats"}
    assert set(d["errors"][0]) >= {"class", "message", "tasks", "witness"}
    assert d["stats"]["tasks"] == 2 and "timings_s" in d["stats"]


def test_write_after_reads_on_the_same_worker_is_ordered():
    """Readers in one segment, then an in-queue overwrite: ordered by queue order."""
    b = ProgramBuilder("war", ranks=1, workers=2)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("a", "activation", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (2, 4), rank=0)
    b.counter("c", 0)
    b.task("w", 0, 1, "copy", ins=["x[0:4]"], outs=["a[0:4]"], signals=["c+=1"])
    b.task("r0", 0, 0, "copy", ins=["a[0:4]"], outs=["y[0:1, 0:4]"], waits=["c>=1"])
    b.task("r1", 0, 0, "copy", ins=["a[0:4]"], outs=["y[1:2, 0:4]"])
    b.task("w2", 0, 0, "copy", ins=["x[0:4]"], outs=["a[0:4]"])
    ok(b.build())
    p = b.build()  # the overwrite between the two readers: r1 reads the new value, fine
    p.tasks[2], p.tasks[3] = p.tasks[3], p.tasks[2]
    ok(p)
    p = b.build()  # the overwrite on the other worker, unordered with the readers
    p.tasks[3] = dataclasses.replace(p.tasks[3], worker=1)
    rejected(p, "ReadWriteRace")


def test_put_destination_must_be_symmetric():
    b = ProgramBuilder("pl", ranks=1, workers=1)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.task("p", 0, 0, "put", ins=["x[0:4]"], outs=["y[0:4]"])
    rejected(b.build(), "BadRegion")


def shared_credit_allgather(ranks=3, workers=2, n=4):
    """All-gather with ONE credit counter per writer fed by every reader of every peer,
    including readers of their own (local) slot, which need nothing remote: a fast peer's
    next-step credit can stand in for a slow reader's credit, so the writer's next put
    can overwrite a slot before it was read (a real race; the fix: per-source credits)."""
    R, W = ranks, workers
    b = ProgramBuilder("ag-shared-credit", ranks=R, workers=W)
    b.buffer("ag", "activation", "f32", (R, n), placement="symmetric")
    for r in range(R):
        b.buffer(f"x.r{r}", "io_input", "f32", (n,), rank=r)
        b.buffer(f"y.r{r}", "io_output", "f32", (R, n), rank=r)
        b.counter(f"c.self.r{r}", r)
        b.counter(f"c.ag.r{r}", r)
        b.counter(f"c.cr.r{r}", r)
    for r in range(R):
        peers = [p for p in range(R) if p != r]
        for i, p in enumerate(peers):
            b.task(f"put.r{r}.to{p}", r, i % W, "put", ins=[f"x.r{r}[0:{n}]"],
                   outs=[f"ag@{p}[{r}:{r + 1}, 0:{n}]"], waits=[f"c.cr.r{r}>={R * (R - 1)}@prev"],
                   signals=[f"c.ag.r{p}+=1"])
        b.task(f"self.r{r}", r, R % W, "copy", ins=[f"x.r{r}[0:{n}]"],
               outs=[f"ag[{r}:{r + 1}, 0:{n}]"], signals=[f"c.self.r{r}+=1"])
        for p in range(R):
            waits = [f"c.self.r{r}>=1"] if p == r else [f"c.ag.r{r}>={R - 1}"]
            b.task(f"out.r{r}.{p}", r, p % W, "copy", ins=[f"ag[{p}:{p + 1}, 0:{n}]"],
                   outs=[f"y.r{r}[{p}:{p + 1}, 0:{n}]"], waits=waits,
                   signals=[f"c.cr.r{q}+=1" for q in peers])
    return b.build()


def test_shared_credit_counter_is_rejected():
    rejected(shared_credit_allgather(3, 2), "ReceiveBufferReuseWithoutCredit")


def test_progress_callback_names_the_stages():
    stages: list[str] = []
    validate(allreduce(2, 8), progress=stages.append)
    assert stages[0] == "structure"
    assert {"simulation", "happens_before", "races"} <= set(stages)


# ------------------------------------------------------------------ speed paths, same results
def test_box_sweep_lists_the_flat_sweeps_pairs_in_its_order():
    """races._box_pairs (a sweep along each location's most selective axis) returns exactly
    the pairs, and the order, of the row-major flat-interval sweep followed by a box test."""
    from types import SimpleNamespace

    from validator import races

    rng = np.random.default_rng(3)
    n, A = 400, 3
    dims = np.array([[2, 4, 64], [8, 1, 1], [3, 5, 7]])
    buf = rng.integers(0, 3, n)
    loc = buf * 2 + rng.integers(0, 2, n)
    lo = np.zeros((n, A), dtype=np.int64)
    hi = np.ones((n, A), dtype=np.int64)
    for k in range(n):
        for a in range(A):
            d = dims[buf[k], a]
            x = rng.integers(0, d)
            lo[k, a], hi[k, a] = x, rng.integers(x + 1, d + 1)
    strides = np.stack([np.array([d[1] * d[2], d[2], 1]) for d in dims])[buf]
    flo = (lo * strides).sum(axis=1)
    fhi = ((hi - 1) * strides).sum(axis=1) + 1
    acc = SimpleNamespace(loc=loc, sweep_axis=rng.integers(0, A, 6)[loc])
    a, b = np.arange(0, n, 2), np.arange(n)
    i, j = races._overlap_pairs(loc[a], flo[a], fhi[a], loc[b], flo[b], fhi[b])
    keep = races._box_overlap(lo[a[i]], hi[a[i]], lo[b[j]], hi[b[j]])
    ref = list(zip(i[keep].tolist(), j[keep].tolist()))
    gi, gj = races._box_pairs(acc, a, lo, hi, flo[a], fhi[a], b, lo, hi, flo[b], fhi[b])
    assert list(zip(gi.tolist(), gj.tolist())) == ref and len(ref) > 100
    # only the pairs with a marked access on either side, in the same order
    ma, mb = rng.random(len(a)) < 0.2, rng.random(len(b)) < 0.2
    gi, gj = races._box_pairs(acc, a, lo, hi, flo[a], fhi[a], b, lo, hi, flo[b], fhi[b], ma, mb)
    assert list(zip(gi.tolist(), gj.tolist())) == [(x, y) for x, y in ref if ma[x] or mb[y]]


def test_simulation_lookahead_matches_one_segment_at_a_time(monkeypatch):
    """The simulation's lookahead (several segments of a queue per numpy pass) gives every
    segment the same round as testing one segment per pass."""
    from validator import deadlock
    from validator.structure import check_structure
    from validator.window import build_window

    progs = [allreduce(3, 8, workers=2, reuse="credit"), allreduce(4, 8, reuse="slots"),
             transformer_schedule(2, 4, 1, hidden=256, inter=512, q_heads=8, kv_heads=4,
                                  seq=16, qkv_tiles=8, o_tiles=8, gu_tiles=8, act_tiles=4,
                                  down_tiles=8, chunks=2), inversion(cross_rank=True)]
    for p in progs:
        ix = check_structure(p).index
        win = build_window(ix, max(2, p.slots + 1))
        ref = None
        for look in (1, 3, 16):
            monkeypatch.setattr(deadlock, "LOOKAHEAD", look)
            monkeypatch.setattr(deadlock, "_LOOK", np.arange(look))
            sim = deadlock.simulate(ix, win)
            got = (sim.seg_round.tolist(), sim.rounds, sim.stuck,
                   [f.to_json() for f in sim.findings])
            assert ref is None or got == ref, (p.name, look)
            ref = got
