"""Tests of the independent dynamic oracle (validator/oracle.py): each problem class on a
minimal program that has it and a minimal one that does not, the seeds, determinism and
independence from the static validator's code."""

from __future__ import annotations

import ast
import pathlib

import pytest

from ir.builder import ProgramBuilder
from ir.examples import allreduce
from ir.program import Counter, Region, Signal, Target, Task, Wait
from validator import oracle, seeds

ROOT = pathlib.Path(__file__).resolve().parents[1]


def check(prog, **kw):
    kw.setdefault("runs", 64)
    return oracle.check(prog, **kw)


def two_rank_put(signal: str, between: tuple[str, ...] = (), n: int = 4, ranks: int = 2,
                 relay: bool = False, workers: int = 1):
    """Rank 0 puts x into rank 1's inbox; how rank 1 learns of it varies:
    ``signal="pws"``: put-with-signal; ``"nop"``: a later nop on the same worker signals
    (after the ops in ``between``: "quiet" / "fence"). With ``relay`` the nop signals a
    counter on rank 2 that relays to rank 1 (so a fence does not order the put)."""
    b = ProgramBuilder("put", ranks, workers, target=Target(max_workers=4))
    b.buffer("inbox", "activation", "f32", (n,), placement="symmetric")
    b.buffer("x", "io_input", "f32", (n,), rank=0)
    b.buffer("y", "io_output", "f32", (n,), rank=1)
    b.counter("c1", 1)
    b.counter("cr", 0)
    if relay:
        b.counter("c2", 2)
    sig = ["c1+=1"] if signal == "pws" else []
    b.task("put", 0, 0, "put", ins=[f"x[0:{n}]"], outs=[f"inbox@1[0:{n}]"], signals=sig,
           waits=["cr>=1@prev"])
    for i, op in enumerate(between):
        b.task(f"{op}{i}", 0, 0, op)
    if signal == "nop":
        b.task("notify", 0, 0, "nop", signals=["c2+=1" if relay else "c1+=1"])
    if relay:
        b.task("relay", 2, 0, "nop", waits=["c2>=1"], signals=["c1+=1"])
    b.task("read", 1, 0, "copy", ins=[f"inbox[0:{n}]"], outs=[f"y[0:{n}]"], waits=["c1>=1"],
           signals=["cr+=1"])
    return b.build()


# -- seeds and reference examples ----------------------------------------------------------

@pytest.mark.parametrize("prog", seeds.hand_seeds(), ids=lambda p: f"{p.name}.{p.workers}w")
def test_every_hand_seed_is_safe(prog):
    res = check(prog, runs=32)
    assert res.safe, [p.message for p in res.problems]


@pytest.mark.parametrize("reuse", ["credit", "slots"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_reference_allreduce_is_safe(ranks, reuse):
    assert check(allreduce(ranks, 4, 1, reuse)).safe


def test_allreduce_slots_two_ranks_safe_exhaustively():
    res = check(allreduce(2, 4, 1, "slots"))
    assert res.safe and res.stats["exhaustive"] and res.stats["dfs"] == "complete"


@pytest.mark.parametrize("ranks", [3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_arrival_counter_unsafe_with_three_ranks(ranks, seed):
    # A peer one step ahead signals the shared arrival counter with its next-step put
    # while another peer's put of this step is still in flight: the reduce reads it early.
    res = oracle.check(seeds.shared_arrival_allreduce(ranks), runs=16, seed=seed)
    assert not res.safe
    assert res.classes & {"read_write_race", "uninit_read"}
    p = next(p for p in res.problems if p.cls in ("read_write_race", "uninit_read"))
    assert p.witness["exploration"] in ("random", "exhaustive DFS") and p.witness["trace"]
    # two ranks cannot drift that way: the only peer's next-step put needs this step's
    assert check(seeds.shared_arrival_allreduce(2)).safe


# -- deadlocks -------------------------------------------------------------------------------

def inversion(ranks: int):
    """w0 waits c1 then signals c0; w1 waits c0 then signals c1 (on one rank with two
    workers, or across two ranks)."""
    two = ranks == 2
    b = ProgramBuilder("inv", ranks, 1 if two else 2)
    b.counter("c0", 1 if two else 0)
    b.counter("c1", 0)
    b.task("a", 0, 0, "nop", waits=["c1>=1"])
    b.task("b", 0, 0, "nop", signals=["c0+=1"])
    r, w = (1, 0) if two else (0, 1)
    b.task("c", r, w, "nop", waits=["c0>=1"])
    b.task("d", r, w, "nop", signals=["c1+=1"])
    return b.build()


@pytest.mark.parametrize("ranks", [1, 2])
def test_queue_inversion_deadlocks(ranks):
    res = check(inversion(ranks))
    assert res.classes == {"deadlock"}
    blocked = {b["task"] for b in res.problems[0].witness["blocked"]}
    assert blocked == {"a", "c"}


def test_ordered_queues_do_not_deadlock():
    b = ProgramBuilder("ok", 1, 2)
    b.counter("c0", 0)
    b.counter("c1", 0)
    b.task("b", 0, 0, "nop", signals=["c0+=1"])
    b.task("a", 0, 0, "nop", waits=["c1>=1"])
    b.task("c", 0, 1, "nop", waits=["c0>=1"])
    b.task("d", 0, 1, "nop", signals=["c1+=1"])
    assert check(b.build()).safe


def test_unsatisfiable_threshold_deadlocks():
    b = ProgramBuilder("unsat", 1, 1)
    b.counter("c", 0)
    b.task("s", 0, 0, "nop", signals=["c+=1"])
    b.task("w", 0, 0, "nop", waits=["c>=2"])
    res = check(b.build())
    assert res.classes == {"deadlock"}
    assert res.problems[0].witness["blocked"][0]["waits"][0]["needed"] == 2


# -- remote data visibility: quiet, fence, put-with-signal ---------------------------------

def test_put_with_signal_is_safe():
    assert check(two_rank_put("pws")).safe


def test_signal_may_overtake_put_without_quiet():
    res = check(two_rank_put("nop"))
    assert "read_write_race" in res.classes


@pytest.mark.parametrize("op", ["quiet", "fence"])
def test_quiet_or_fence_before_signal_to_destination_is_safe(op):
    assert check(two_rank_put("nop", (op,))).safe


def test_fence_does_not_order_a_signal_to_another_rank():
    res = check(two_rank_put("nop", ("fence",), ranks=3, relay=True))
    assert "read_write_race" in res.classes


def test_quiet_orders_a_signal_to_another_rank():
    assert check(two_rank_put("nop", ("quiet",), ranks=3, relay=True)).safe


def test_put_signal_to_its_own_rank_publishes_nothing():
    """A put may signal its own rank too; with its destination signal also there the data
    is published, but a signal to its own rank relayed to the destination is not."""
    both = two_rank_put("pws")
    both.counters.append(Counter("co", 0))
    both.tasks[0].signals = both.tasks[0].signals + (Signal("co", 1),)
    assert check(both).safe
    relay = two_rank_put("pws", workers=2)
    relay.counters.append(Counter("co", 0))
    relay.tasks[0].signals = (Signal("co", 1),)
    relay.tasks.insert(1, Task("relay", 0, 1, "nop", waits=(Wait("co", 1),),
                               signals=(Signal("c1", 1),)))
    res = check(relay)
    assert res.classes & {"read_write_race", "uninit_read"}, res.classes


def test_zero_threshold_orders_later_steps():
    """``wait(c >= 0)`` holds at once in step 0 and means ``c >= e N`` in step e: written
    for the credit (N = 1) it protects the receive buffer like ``c >= 1 @prev``."""
    prog = two_rank_put("pws")
    prog.tasks[0].waits = (Wait("cr", 0),)
    assert check(prog).safe
    prog.tasks[0].waits = (Wait("cr", -1),)  # c >= (e - 1) N: one step too early
    assert "read_write_race" in check(prog).classes


def test_threshold_beyond_64_bits_deadlocks():
    prog = two_rank_put("pws")
    prog.tasks[-1].waits = (Wait("c1", 1 << 70),)
    assert check(prog).classes == {"deadlock"}


def test_receive_buffer_reuse_needs_credit():
    prog = two_rank_put("pws")
    prog.tasks[0].waits = ()  # drop the @prev credit wait: next step's put may overwrite
    res = check(prog)
    assert "read_write_race" in res.classes
    assert any(p.witness["first"]["epoch"] != p.witness["second"]["epoch"]
               for p in res.problems if p.cls == "read_write_race")


# -- local races ----------------------------------------------------------------------------

def tiles(cover: int, waits: tuple[str, ...] = ("c>=2",), second_worker: int = 1):
    """Two workers write halves of y (or less: ``cover`` elements of the second half);
    a reader on worker 0 reads all of y."""
    b = ProgramBuilder("tiles", 1, 2)
    b.buffer("x", "io_input", "f32", (8,), rank=0)
    b.buffer("y", "activation", "f32", (8,), rank=0)
    b.buffer("z", "io_output", "f32", (8,), rank=0)
    b.counter("c", 0)
    b.task("t0", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"], signals=["c+=1"])
    b.task("t1", 0, second_worker, "copy", ins=[f"x[4:{4 + cover}]"], outs=[f"y[4:{4 + cover}]"],
           signals=["c+=1"])
    b.task("rd", 0, 0, "copy", ins=["y[0:8]"], outs=["z[0:8]"], waits=list(waits))
    return b.build()


def test_full_coverage_read_is_safe():
    assert check(tiles(4)).safe


def test_partial_coverage_read_is_reported():
    res = check(tiles(3))
    assert res.classes == {"uninit_read"}
    assert "y@0[7:8]" in res.problems[0].message


def test_partial_wait_on_shared_counter_races():
    res = check(tiles(4, waits=("c>=1",)))
    assert res.classes & {"read_write_race", "uninit_read"}
    res = check(tiles(4, waits=("c>=1",)), exhaustive=False)
    assert res.classes & {"read_write_race", "uninit_read"}


def test_overlapping_unordered_writes():
    b = ProgramBuilder("ww", 1, 2)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.task("a", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"])
    b.task("b", 0, 1, "copy", ins=["x[0:2]"], outs=["y[2:4]"])
    res = check(b.build())
    assert res.classes == {"write_write_race"}
    assert "y@0[2:4]" in res.problems[0].witness["cell"]


def test_write_after_read_without_order_races():
    b = ProgramBuilder("war", 1, 2)
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("y", "activation", "f32", (4,), rank=0)
    b.buffer("z", "io_output", "f32", (4,), rank=0)
    b.counter("c", 0)
    b.task("w1", 0, 0, "copy", ins=["x[0:4]"], outs=["y[0:4]"], signals=["c+=1"])
    b.task("rd", 0, 1, "copy", ins=["y[0:4]"], outs=["z[0:4]"], waits=["c>=1"])
    b.task("w2", 0, 0, "add", ins=["x[0:4]", "x[0:4]"], outs=["y[0:4]"])
    assert "read_write_race" in check(b.build()).classes


# -- structural problems ---------------------------------------------------------------------

def small():
    b = ProgramBuilder("s", 2, 1, target=Target(max_workers=2))
    b.buffer("x", "io_input", "f32", (4,), rank=0)
    b.buffer("w", "weight", "f32", (4,), rank=0)
    b.buffer("y", "io_output", "f32", (4,), rank=0)
    b.buffer("sym", "activation", "f32", (4,), placement="symmetric")
    b.counter("c", 0)
    b.counter("c1", 1)
    b.task("n", 0, 0, "rmsnorm", ins=["x[0:4]", "w[0:4]"], outs=["y[0:4]"],
           params={"dim": 4, "eps": 1e-5}, signals=["c+=1"])
    return b


def test_small_is_safe():
    assert check(small().build()).safe


@pytest.mark.parametrize("mutate, cls", [
    (lambda p: setattr(p.tasks[0], "params", {"dim": 3, "eps": 1e-5}), "op_contract"),
    (lambda p: setattr(p.tasks[0], "params", {"dim": 4, "eps": 0.0}), "op_contract"),
    (lambda p: setattr(p.tasks[0], "op", "gemv"), "op_contract"),
    (lambda p: setattr(p, "workers", 3), "too_many_workers"),
    (lambda p: setattr(p, "max_epochs", 1 << 31), "counter_overflow"),
    (lambda p: setattr(p.tasks[0], "signals", (Signal("c", 0),)), "non_monotone"),
    (lambda p: setattr(p.tasks[0], "signals", (Signal("c", -1),)), "non_monotone"),
    (lambda p: setattr(p.tasks[0], "waits", (Wait("c1", 0),)), "remote_wait"),
    (lambda p: setattr(p.tasks[0], "op", "no_such_op"), "unknown_name"),
    (lambda p: setattr(p.tasks[0], "worker", 5), "bad_queue"),
    (lambda p: p.tasks.append(p.tasks[0]), "malformed"),
])
def test_structural_problems(mutate, cls):
    prog = small().build()
    mutate(prog)
    res = check(prog)
    assert cls in res.classes, res.classes


def test_out_of_bounds_region():
    b = small()
    b.task("oob", 0, 0, "copy", ins=["x[0:4]"], outs=["y[1:5]"])
    res = check(b.build())
    assert "out_of_bounds" in res.classes


def test_remote_read_and_remote_write_to_local():
    b = small()
    b.task("rr", 1, 0, "copy", ins=["sym@0[0:4]"], outs=["sym@1[0:4]"])
    b.task("wl", 1, 0, "put", ins=["sym@1[0:4]"], outs=["y[0:4]"])
    res = check(b.build())
    assert {"remote_read", "remote_write_local"} <= res.classes


def test_malformed_program_never_raises():
    prog = small().build()
    prog.tasks[0].ins = (Region("nope", 0, ()),)
    prog.counters[0].width = 7
    res = check(prog)
    assert not res.safe and "malformed" in res.classes


# -- exploration ---------------------------------------------------------------------------

def test_deterministic_in_seed():
    prog = seeds.mini_block(3, 2, reuse="credit")
    prog.tasks[5].waits = ()
    a = oracle.check(prog, runs=8, seed=3, exhaustive=False, all_runs=True).to_json()
    b = oracle.check(prog, runs=8, seed=3, exhaustive=False, all_runs=True).to_json()
    for x in (a, b):
        x["stats"].pop("seconds")
    assert a == b


def test_exhaustive_finds_what_random_finds():
    prog = two_rank_put("nop")
    dfs = oracle.check(prog, runs=0)
    assert dfs.stats["dfs"] == "stopped at a problem"
    assert "read_write_race" in dfs.classes
    assert dfs.problems[0].witness["exploration"] == "exhaustive DFS"


def test_epochs_default():
    assert oracle.default_epochs(allreduce(2, 4, 1, "slots")) == 3
    p = allreduce(2, 4, 1, "slots")
    p.max_epochs = 1
    assert oracle.default_epochs(p) == 1


def test_result_json_shape():
    res = check(inversion(1))
    j = res.to_json()
    assert j["safe"] is False and j["classes"] == ["deadlock"]
    assert set(j["problems"][0]) == {"class", "message", "tasks", "buffers", "witness"}


def test_oracle_is_independent_of_the_static_validator():
    """The oracle may import the IR (data model and op contract) and the standard library
    only: no module of the static validator."""
    tree = ast.parse((ROOT / "validator" / "oracle.py").read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mods.add(node.module or "")
    assert not [m for m in mods if m.startswith("validator")], mods
    assert {m.split(".")[0] for m in mods} <= {"__future__", "random", "time", "collections",
                                              "dataclasses", "typing", "ir"}
