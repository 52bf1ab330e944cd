"""The search space: knobs come from LoweringConfig, every value changes the lowered
program, candidate ids are canonical, candidates outside the space are refused."""

from __future__ import annotations

import dataclasses
import random

import pytest

from lowering.config import LoweringConfig
from lowering.lower import lower
from models.graph import build_graph, spec_from_config
from models.recipes import build_config
from search.space import (
    FIXED, SEARCHABLE, Knob, SearchSpace, SpaceError, program_fingerprint, space_for,
)


def _graph(name: str):
    spec = spec_from_config(build_config(name))
    return spec, build_graph(spec, name=name)


def test_every_lowering_field_is_classified():
    names = {f.name for f in dataclasses.fields(LoweringConfig)}
    assert names == set(SEARCHABLE) | set(FIXED)
    assert not set(SEARCHABLE) & set(FIXED)


def test_unclassified_field_is_an_error():
    @dataclasses.dataclass(frozen=True)
    class Wider(LoweringConfig):
        pipeline_depth: int = 1

    spec, _ = _graph("tiny-llama")
    with pytest.raises(SpaceError, match="pipeline_depth"):
        space_for(spec, 2, 132, config_cls=Wider)


def test_space_shape_follows_model_and_ranks():
    spec, _ = _graph("tiny-llama")
    s1, s2 = space_for(spec, 1, 132), space_for(spec, 2, 132)
    assert "allreduce" not in s1.names and s1.fixed["allreduce"] == "oneshot"
    assert "allreduce" in s2.names
    for sp in (s1, s2):
        d = LoweringConfig()
        for k in sp.knobs:
            assert k.default == getattr(d, k.name)
        assert sp.fixed["max_seq"] == d.max_seq and sp.fixed["dtype"] == d.dtype
    few = space_for(spec, 2, 8)
    assert max(few.knob("workers").values) <= 8


@pytest.mark.parametrize("model,ranks", [("tiny-llama", 2), ("tiny-qwen3", 3), ("tiny-qwen2", 1)])
def test_every_knob_value_changes_the_program(model, ranks):
    """A knob value the lowering ignores is a bug: each value of each knob (others at their
    defaults) must give a different schedule than every other value of that knob."""
    spec, graph = _graph(model)
    sp = space_for(spec, ranks, 132)
    base = sp.default()
    for k in sp.knobs:
        prints = {}
        # wave only matters when tile is finer than a wave of workers, and the stage policy
        # only where whole-step totals would unbalance a stage (several tiles per worker):
        # test them at the finest tile (down_split_k too: its chunks are whole gate/up tiles)
        fine = k.name in ("wave", "policy", "down_split_k")
        at = {**base, "tile": min(sp.knob("tile").values)} if fine else base
        if k.name in ("late_append", "fuse_reduce", "down_split_k"):  # change fused programs only
            at = {**at, "fuse": True}
        for v in k.values:
            cfg = LoweringConfig(**sp.lowering_config({**at, k.name: v}))
            prints[v] = program_fingerprint(lower(graph, ranks, config=cfg))
        assert len(set(prints.values())) == len(prints), (k.name, prints)


def test_fingerprint_ignores_name_and_recorded_config():
    spec, graph = _graph("tiny-llama")
    p = lower(graph, 2, config=LoweringConfig())
    q = p.copy()
    q.name, q.config = "other", {"x": 1}
    assert program_fingerprint(p) == program_fingerprint(q)
    q.tasks[0].worker = (q.tasks[0].worker + 1) % max(q.workers, 2)
    assert program_fingerprint(p) != program_fingerprint(q)


def _space() -> SearchSpace:
    return SearchSpace([Knob("tile", (16, 32, 64, 128), 64, True, "rows"),
                        Knob("workers", (1, 2, 4, 8), 4, True),
                        Knob("policy", ("round_robin", "balanced"), "round_robin"),
                        Knob("one", (7,), 7)],
                       {"dtype": "f32", "max_seq": 256})


def test_candidate_id_is_canonical():
    sp = _space()
    assert sp.names == ["tile", "workers", "policy"]  # one-value knobs are not searchable
    a = sp.candidate_id({"tile": 32, "workers": 4, "policy": "round_robin"})
    b = sp.candidate_id({"policy": "round_robin", "tile": 32})  # key order, defaults
    assert a == b and a.startswith("k-") and len(a) == 14
    assert a != sp.candidate_id({"tile": 16})
    other = SearchSpace(sp.knobs, {"dtype": "bf16", "max_seq": 256})
    assert other.candidate_id({"tile": 32}) != a  # fixed fields are part of the id
    assert len({sp.candidate_id(c) for c in sp.all()}) == sp.size() == 32


@pytest.mark.parametrize("bad,msg", [
    ({"tile": 48}, "not one of"),
    ({"tile": "64"}, "not one of"),
    ({"workers": True}, "not one of"),
    ({"tile": 64.0}, "not one of"),
    ({"colour": "red"}, "unknown knob"),
    ({"dtype": "bf16"}, "held fixed"),
])
def test_candidates_outside_the_space_are_refused(bad, msg):
    sp = _space()
    assert any(msg in p for p in sp.check(bad))
    with pytest.raises(SpaceError, match=msg):
        sp.candidate_id(bad)


def test_mutation_and_neighbours_stay_in_space_and_differ():
    sp = _space()
    rng = random.Random(0)
    for _ in range(200):
        c = sp.random(rng)
        m = sp.mutate(c, rng, n_knobs=rng.choice((1, 2)))
        assert not sp.check(m) and m != sp.canonical(c)
    nb = list(sp.neighbours({"tile": 16, "workers": 4, "policy": "balanced"}))
    assert {"tile": 32, "workers": 4, "policy": "balanced"} in nb
    assert all(sum(n[k] != v for k, v in {"tile": 16, "workers": 4,
                                           "policy": "balanced"}.items()) == 1 for n in nb)
    assert len(nb) == 1 + 2 + 1


def test_json_schema_matches_knobs():
    sp = _space()
    sch = sp.json_schema()
    assert sch["type"] == "object" and sch["additionalProperties"] is False
    assert sch["required"] == sp.names
    assert sch["properties"]["tile"] == {"type": "integer", "enum": [16, 32, 64, 128],
                                         "description": "rows (default 64)"}
    assert sch["properties"]["policy"]["type"] == "string"
    assert SearchSpace.from_json(sp.to_json()).to_json() == sp.to_json()


def test_bad_knob_declarations():
    with pytest.raises(ValueError, match="default"):
        Knob("tile", (1, 2), 3)
    with pytest.raises(ValueError, match="twice"):
        Knob("tile", (1, 1), 1)
    with pytest.raises(ValueError, match="both"):
        SearchSpace([Knob("tile", (1, 2), 1)], {"tile": 1})


def test_late_append_only_without_qk_norm():
    """late_append changes only the fused attention of a model without q/k norm (Qwen3 has
    its own q/k chains), so the space offers it there only."""
    for model, has in (("tiny-llama", True), ("tiny-qwen3", False)):
        spec, _ = _graph(model)
        names = {k.name for k in space_for(spec, 1, 132).knobs}
        assert ("late_append" in names) == has, model
