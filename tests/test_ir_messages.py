"""Messages of the IR's JSON reader and op contract: the field, what it needs, what it got."""

from __future__ import annotations

import pytest

from ir.examples import allreduce
from ir.jsonio import IRJsonError, json_type, program_from_json, program_to_json
from ir.ops import OPS


def _error(j) -> IRJsonError:
    with pytest.raises(IRJsonError) as e:
        program_from_json(j, "p.json")
    return e.value


@pytest.mark.parametrize("where,value,want", [
    (("tasks", 0, "rank"), "0", 'tasks[0].rank: expected an integer, got string "0"'),
    (("tasks", 0, "rank"), 1.5, "tasks[0].rank: expected an integer, got number 1.5"),
    (("tasks", 0, "op"), 7, "tasks[0].op: expected a string, got number 7"),
    (("tasks", 0, "op"), None, "tasks[0].op: expected a string, got null null"),
    (("name",), [1], "name: expected a string, got array [1]"),
])
def test_json_field_of_the_wrong_type(where, value, want):
    j = program_to_json(allreduce(2, 8))
    obj = j
    for k in where[:-1]:
        obj = obj[k]
    obj[where[-1]] = value
    assert str(_error(j)).startswith(f"p.json: {want}")


@pytest.mark.parametrize("field,what", [("rank", "an integer"), ("op", "a string")])
def test_json_missing_field(field, what):
    j = program_to_json(allreduce(2, 8))
    del j["tasks"][1][field]
    e = _error(j)
    assert e.path == f"tasks[1].{field}"
    assert e.message.startswith(f"missing field ({what})")


def test_json_type():
    assert [json_type(v) for v in (None, True, 3, 2.5, "s", [1], {})] == [
        "null", "boolean", "integer", "number", "string", "array", "object"]


@pytest.mark.parametrize("op,ins,outs,params", [
    ("rmsnorm", [(16,), (16,)], [(16,)], {"dim": 16}),
    ("norm_gemv", [(16,), (16,), (8, 16)], [(8,)], {}),
])
@pytest.mark.parametrize("eps", [None, 0, 1.5, "1e-5"])
def test_eps_param(op, ins, outs, params, eps):
    p = dict(params) if eps is None else dict(params, eps=eps)
    msgs = OPS[op].check(ins, ["f32"] * len(ins), outs, ["f32"] * len(outs), p)
    assert msgs == [f"{op}: param eps must be in (0, 1), got {eps!r}"]
    assert OPS[op].check(ins, ["f32"] * len(ins), outs, ["f32"] * len(outs),
                         dict(params, eps=1e-5)) == []
