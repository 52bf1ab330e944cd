"""Schedule edits (ir/edits.py, lowering/placement.py, amk edit): the schema, planted unsafe
edits rejected by the right validator class before any backend exists, safe edits accepted
and still matching the unedited schedule on the sim, views, and the command's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from amk.editing import edit_program
from ground.errors import AmkError
from ir.edits import POLICIES, EditError, apply_edits, load_edits, parse_edits, stage_of
from ir.examples import allreduce
from ir.io import load_program, save_program
from ir.text import parse_program
from lowering.config import LoweringConfig
from lowering.config import POLICIES as LOWERING_POLICIES
from lowering.lower import lower
from lowering.placement import apply_edits as apply_all
from lowering.views import slice_program, summary, timeline

ROOT = Path(__file__).resolve().parents[1]


def amk(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "amk", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


@lru_cache(maxsize=None)
def tiny(weights: bool = False):
    """tiny-llama (2 layers) resolved with seeded weights, its graph and a TP-2 lowering."""
    from amk.pipeline import import_graph, resolve

    res = resolve("config:tiny-llama", weights=weights)
    graph = import_graph(res)
    prog = lower(graph, 2, config=LoweringConfig(max_seq=16, workers=4))
    return res, graph, prog


@pytest.fixture()
def no_backend(monkeypatch):
    """Any construction of a sim or triton executor fails the test."""
    import lowering.sim as sim

    def boom(*a, **k):
        raise AssertionError("a backend executor was constructed for an edited schedule")

    monkeypatch.setattr(sim.SimExecutor, "__init__", boom)
    try:
        import lowering.triton.runtime as rt

        monkeypatch.setattr(rt.TritonExecutor, "__init__", boom)
    except ImportError:
        pass


# -- the schema ------------------------------------------------------------------------------
@pytest.mark.parametrize("edits, msg", [
    ({"op": "move"}, "expected a JSON list"),
    ([{"op": "move", "task": "a", "worker": "1"}], "edit 0 (move): field 'worker': expected an integer >= 0, got \"1\""),
    ([{"op": "swap", "a": "x", "b": "y"}, {"op": "fly"}], "edit 1: field 'op': unknown op \"fly\""),
    ([{"op": "split"}], "edit 0 (split): missing required field 'task'"),
    ([{"op": "add_wait", "task": "t", "counter": "c", "threshold": 1, "offset": 2}],
     "edit 0 (add_wait): field 'offset': expected 0 (this step) or -1"),
    ([{"op": "replace", "stage": "l0.q", "policy": "fastest"}], "field 'policy': expected one of round_robin"),
    ([{"op": "drop_signal", "task": "t", "counter": "c", "amount": 1}], "edit 0 (drop_signal): unknown field 'amount'"),
    ([{"op": "move", "task": "t", "before": "a", "after": "b"}], "at most one of 'before', 'after', 'position'"),
    (["move"], "edit 0: expected an object"),
])
def test_schema_errors_name_index_and_field(edits, msg):
    with pytest.raises(EditError) as exc:
        parse_edits(edits)
    assert msg in str(exc.value)
    assert exc.value.exit_code == 2 and "\n" not in str(exc.value)


def test_invalid_json_names_line_and_column():
    with pytest.raises(EditError, match=r"e.json:2:1: invalid JSON"):
        load_edits('[{"op": "move",\n}]', "e.json")


def test_policies_agree_with_the_lowering():
    assert POLICIES == LOWERING_POLICIES


def test_stage_names():
    assert stage_of("l0.q.t3.r1") == "l0.q"
    assert stage_of("l0.attn.red.t0.r0") == "l0.attn.red"
    assert stage_of("l0.q.t3_1.r0") == "l0.q"


def test_apply_errors_name_the_edit():
    prog = allreduce(2, 8)
    with pytest.raises(EditError, match=r"edit 0 \(move\): field 'task': no task 'nope'"):
        apply_edits(prog, parse_edits([{"op": "move", "task": "nope", "worker": 0}]))
    with pytest.raises(EditError, match="different ranks"):
        apply_edits(prog, parse_edits([{"op": "swap", "a": "sum.r0", "b": "sum.r1"}]))
    with pytest.raises(EditError, match="split cuts GEMV-family tiles"):
        apply_edits(prog, parse_edits([{"op": "split", "task": "sum.r0"}]))
    with pytest.raises(EditError, match="replace needs the lowering"):
        apply_edits(prog, parse_edits([{"op": "replace", "stage": "sum", "policy": "balanced"}]))


# -- planted unsafe edits: rejected with the right class, no backend ------------------------------
DEADLOCK = [{"op": "move", "task": "sum.r0", "before": "put.r0.to1"},
            {"op": "move", "task": "sum.r1", "position": 0}]
LATE_DELIVERY = [{"op": "drop_signal", "task": "put.r1.to0", "counter": "c.rx.r0.from1"},
                 {"op": "add_signal", "task": "self.r1", "counter": "c.rx.r0.from1"}]
NO_CREDIT = [{"op": "drop_wait", "task": "put.r0.to1", "counter": "c.cr.r0"}]


def test_deadlock_cycle_rejected_with_cycle_witness(no_backend):
    new, v = edit_program(allreduce(2, 8), DEADLOCK)
    assert [t.id for t in new.tasks[:3]] == ["sum.r0", "put.r0.to1", "self.r0"]
    assert v.classes == {"DeadlockCycle"}
    f = v.errors[0]
    assert set(f.tasks) == {"sum.r0", "sum.r1"}
    edges = json.dumps(f.witness["cycle"])
    assert "c.rx.r0.from1" in edges and "c.rx.r1.from0" in edges


def test_cross_worker_race_rejected(no_backend):
    _, _, prog = tiny()
    t = prog.task_map()["l0.q.t0.r0"]
    ln1 = prog.task_map()["l0.ln1.r0"]
    assert t.worker != ln1.worker and [w.counter for w in t.waits] == ["c.l0.ln1.r0"]
    _, v = edit_program(prog, [{"op": "drop_wait", "task": "l0.q.t0.r0", "counter": "c.l0.ln1.r0"}])
    assert "ReadWriteRace" in v.classes
    f = next(f for f in v.errors if f.cls == "ReadWriteRace")
    assert set(f.tasks) == {"l0.ln1.r0", "l0.q.t0.r0"}
    assert "l0.ln1.r0" in json.dumps(f.witness)


def test_missing_credit_rejected(no_backend):
    _, v = edit_program(allreduce(2, 8, reuse="credit"), NO_CREDIT)
    assert v.classes == {"ReceiveBufferReuseWithoutCredit"}
    assert set(v.errors[0].tasks) == {"sum.r1", "put.r0.to1"}


def test_put_read_before_delivery_rejected(no_backend):
    _, v = edit_program(allreduce(2, 8), LATE_DELIVERY)
    assert v.classes == {"RemoteReadBeforeDelivery"}
    assert set(v.errors[0].tasks) == {"put.r1.to0", "sum.r0"}


def test_dropped_signal_is_unsatisfiable(no_backend):
    _, v = edit_program(allreduce(2, 8), [{"op": "drop_signal", "task": "put.r1.to0",
                                           "counter": "c.rx.r0.from1"}])
    assert "UnsatisfiableWait" in v.classes


def test_rejected_edit_never_runs_through_mcp(no_backend, tmp_path):
    from amk.mcp_server import Tools

    tools = Tools(tmp_path)
    save_program(allreduce(2, 8), tmp_path / "ar.amk")
    (tmp_path / "ar.amk.meta.json").write_text(json.dumps({"model": "config:tiny-llama", "tp": 2}))
    r = tools.edit("ar.amk", DEADLOCK, "dead.amk")
    assert r["ok"] is False and r["classes"] == ["DeadlockCycle"] and r["written"] is None
    assert not (tmp_path / "dead.amk").exists()
    save_program(apply_edits(allreduce(2, 8), parse_edits(DEADLOCK)), tmp_path / "dead.amk")
    (tmp_path / "dead.amk.meta.json").write_text(json.dumps({"model": "config:tiny-llama", "tp": 2}))
    r = tools.run_sim("dead.amk", 1)
    assert r["ok"] is False and r["error_type"] == "rejected"
    assert r["verdict"]["classes"] == ["DeadlockCycle"]


# -- safe edits: accepted and still the same logits on the sim ----------------------------------
SAFE = {
    "move": [{"op": "move", "task": "l0.q.t0.r0", "after": "l0.rope_k.r0"}],
    "replace": [{"op": "replace", "stage": "l0.gate", "policy": "balanced"},
                {"op": "replace", "stage": "l0.attn.red", "policy": "stage", "rank": 1}],
    "split": [{"op": "split", "task": "l0.attn.w.t0.r0", "rows": 24},
              {"op": "split", "task": "l1.q.t0.r1"}],
    "merge_refine": [{"op": "merge", "a": "l0.mlp.w.t0.r0", "b": "l0.mlp.w.t1.r0"},
                     {"op": "refine_wait", "counter": "c.l1.attn.part.r0"}],
}


def _sim_logits(prog, graph, state, steps: int = 2) -> dict[int, torch.Tensor]:
    from amk.pipeline import Decoder, check_tokens, make_executor

    ex = make_executor(prog, graph, state, "sim", check=False)
    return Decoder(prog, ex).teacher_forced(check_tokens(graph.spec.vocab, steps), list(range(steps)))


def test_safe_edits_accepted_and_match_the_sim():
    res, graph, prog = tiny(weights=True)
    q = prog.queues()[(0, prog.task_map()["l0.q.t0.r0"].worker)]
    ids = [t.id for t in q]
    assert ids.index("l0.rope_k.r0") == ids.index("l0.q.t0.r0") + 1  # adjacent in one queue
    state = res.model.state_dict()
    base = _sim_logits(prog, graph, state)
    for name, edits in SAFE.items():
        new, v = edit_program(prog, edits)
        assert v.ok, (name, [(f.cls, f.message) for f in v.errors])
        assert [t.id for t in new.tasks] != [t.id for t in prog.tasks] or \
            [t.worker for t in new.tasks] != [t.worker for t in prog.tasks] or \
            [t.waits for t in new.tasks] != [t.waits for t in prog.tasks], name
        got = _sim_logits(new, graph, state)
        for pos in base:
            assert torch.allclose(got[pos], base[pos], atol=1e-5, rtol=1e-5), (name, pos)


def test_split_adjusts_the_consumers_threshold():
    _, _, prog = tiny()
    new = apply_all(prog, parse_edits([{"op": "split", "task": "l0.attn.w.t0.r0", "rows": 24}]))
    tm = new.task_map()
    a, b = tm["l0.attn.w.t0_0.r0"], tm["l0.attn.w.t0_1.r0"]
    assert a.ins[1].concrete() == ((0, 24), (0, 64)) and b.ins[1].concrete() == ((24, 64), (0, 64))
    n_old = prog.signals_per_epoch()["c.l0.attn.part.r0"]
    assert new.signals_per_epoch()["c.l0.attn.part.r0"] == n_old + 1
    for t in new.tasks:
        for w in t.waits:
            if w.counter == "c.l0.attn.part.r0":
                assert w.threshold == n_old + 1


def test_replace_repairs_queue_order_with_counters():
    _, _, prog = tiny()
    new = apply_all(prog, parse_edits([{"op": "replace", "stage": "l0.gate", "policy": "round_robin"}]))
    added = [c.name for c in new.counters if c.name.startswith("c.place.")]
    assert added  # the up/silu tiles lost their gate tile's queue order
    with pytest.raises(EditError, match="no task of stage 'l9.q'"):
        apply_all(prog, parse_edits([{"op": "replace", "stage": "l9.q", "policy": "stage"}]))


# -- views ---------------------------------------------------------------------------------------
def test_summary_and_slices():
    _, _, prog = tiny()
    s = summary(prog)
    assert s["program"]["tasks"] == len(prog.tasks)
    assert s["predicted"]["timeline_makespan_us"] > 0 and "PREDICTED" in s["predicted"]["label"]
    assert s["critical_path"][-1]["task"].startswith("lm.")
    assert {w["at"] for w in s["workers"]} == {f"@r{r}.w{w}" for r in range(2) for w in range(4)}
    assert all(w["idle_us"] >= 0 for w in s["workers"])
    row = next(r for r in s["stages"] if r["stage"] == "l0.q" and r["rank"] == 0)
    assert row["tasks"] == sum(1 for t in prog.tasks if stage_of(t.id) == "l0.q" and t.rank == 0)
    assert len(json.dumps(s)) < 40_000
    text = slice_program(prog, layer=0, rank=1)
    part = parse_program(text)
    assert part.tasks and all(t.id.startswith("l0.") and t.rank == 1 for t in part.tasks)
    with pytest.raises(AmkError, match="at least one of"):
        slice_program(prog)
    with pytest.raises(AmkError, match="more than 5"):
        slice_program(prog, rank=0, max_tasks=5)


def test_timeline_lists_stuck_tasks_of_a_deadlock():
    tl = timeline(apply_edits(allreduce(2, 8), parse_edits(DEADLOCK)))
    assert len(tl.stuck) == 6


# -- amk edit ------------------------------------------------------------------------------------
@pytest.fixture()
def files(tmp_path):
    save_program(allreduce(2, 8), tmp_path / "ar.amk")
    (tmp_path / "dead.json").write_text(json.dumps(DEADLOCK))
    (tmp_path / "safe.json").write_text(json.dumps([{"op": "swap", "a": "put.r0.to1", "b": "self.r0"}]))
    (tmp_path / "bad.json").write_text(json.dumps([{"op": "move", "task": "sum.r0", "worker": -1}]))
    (tmp_path / "missing.json").write_text(json.dumps([{"op": "drop_wait", "task": "sum.r0",
                                                        "counter": "nope"}]))
    return tmp_path


def test_amk_edit_accepted_writes(files):
    p = amk("edit", files / "ar.amk", files / "safe.json", "--out", files / "new.json")
    assert p.returncode == 0, p.stderr
    assert "accepted" in p.stdout and "wrote" in p.stdout
    assert [t.id for t in load_program(files / "new.json").tasks][:2] == ["self.r0", "put.r0.to1"]


def test_amk_edit_rejected_exit_1_with_witness(files):
    p = amk("edit", files / "ar.amk", files / "dead.json", "--out", files / "new.amk")
    assert p.returncode == 1
    assert "DeadlockCycle" in p.stdout and "c.rx.r0.from1" in p.stdout and "witness" in p.stdout
    assert "not written" in p.stdout and not (files / "new.amk").exists()
    p = amk("edit", files / "ar.amk", files / "dead.json", "--out", files / "new.amk", "--force", "--json")
    assert p.returncode == 1
    obj = json.loads(p.stdout)
    assert obj["ok"] is False and obj["classes"] == ["DeadlockCycle"] and obj["written"]
    assert (files / "new.amk").exists()


def test_amk_edit_bad_input_exit_2(files):
    p = amk("edit", files / "ar.amk", files / "bad.json", "--out", files / "n.amk")
    assert p.returncode == 2
    assert "edit 0 (move): field 'worker': expected an integer >= 0, got -1" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    p = amk("edit", files / "ar.amk", files / "missing.json")
    assert p.returncode == 2 and "task 'sum.r0' has no wait on 'nope'" in p.stderr
    p = amk("edit", files / "nothere.amk", files / "safe.json")
    assert p.returncode == 2 and "cannot read" in p.stderr
    p = amk("edit", files / "ar.amk")
    assert p.returncode == 2 and "give EDITS.json" in p.stderr
    assert not (files / "n.amk").exists()


def test_amk_edit_summary_and_slice(files):
    p = amk("edit", "--summary", files / "ar.amk", "--rank", "1")
    assert p.returncode == 0, p.stderr
    assert "critical path:" in p.stdout and "idle per worker" in p.stdout
    assert "task sum.r1 @r1.w0" in p.stdout and "task sum.r0" not in p.stdout
