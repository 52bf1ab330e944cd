"""One source per op: every IR op (ir/ops.py OPS) has each place that docs/ir.md's checklist
"Adding an op" names, and each place agrees with the op's OpSpec.

``missing_places(op)`` is the checklist as code: the places of ``PLACES`` (in the checklist's
order) that an op lacks. A sample task per op (``SAMPLES``) is run through the validator's
structure pass, the reference implementation, the sim backend, and the Triton backend's table
and code generator; docs/ir.md's op table is compared with the specs. Fast: no kernel runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from ir import ops as ir_ops
from ir.builder import ProgramBuilder
from ir.ops import OPS, OpSpec, squeeze
from ir.program import ScheduleProgram
from lowering.reference import IMPLS, INT_POISON, apply_op
from lowering.sim import SimExecutor
from lowering.triton import layout as L
from lowering.triton.codegen import generate_source
from lowering.triton.layout import TableError
from lowering.triton.ops import FAMILIES, NOT_SUPPORTED, REGISTRY
from lowering.triton.table import build_layout, build_table, linearize
from validator.structure import check_structure

ROOT = Path(__file__).resolve().parents[1]
IR_MD = ROOT / "docs" / "ir.md"

#: The places docs/ir.md's checklist "Adding an op" names, in its order (missing_places).
PLACES = ("ir/ops.py", "lowering/reference.py", "validator/", "lowering/triton/ops/", "docs/ir.md",
          "tests/test_op_registry.py")

#: The sample programs' buffers: name -> (kind, dtype, shape); ``dst`` is symmetric.
BUFFERS = {
    "x": ("activation", "f32", (16,)), "u": ("activation", "f32", (16,)), "y": ("activation", "f32", (16,)),
    "w": ("weight", "f32", (16,)), "W": ("weight", "f32", (8, 16)), "y8": ("activation", "f32", (8,)),
    "r8": ("activation", "f32", (8,)), "tab": ("weight", "f32", (8, 16)), "tok": ("io_input", "i32", (1,)),
    "pos": ("io_input", "i32", (1,)), "inv": ("weight", "f32", (4,)), "P": ("activation", "f32", (2, 16)),
    "q": ("activation", "f32", (32,)), "o": ("activation", "f32", (32,)), "kc": ("kv_cache", "f32", (2, 4, 8)),
    "vc": ("kv_cache", "f32", (2, 4, 8)), "am": ("activation", "f32", (2,)), "pairs": ("activation", "f32", (2, 2)),
    "next": ("io_output", "i32", (1,)), "dst": ("activation", "f32", (16,)),
    "B": ("weight", "f32", (16, 8)), "Y": ("activation", "f32", (2, 8)),
    "rec": ("activation", "f32", (3, 4, 10)),
}
_KC, _VC = "kc[0:2, 0:4, 0:8]", "vc[0:2, 0:4, 0:8]"
_ATT = {"head_dim": 8, "scale": 0.35}

#: A sample task of every IR op: (inputs, outputs, params), regions of BUFFERS on rank 0
#: (``put`` writes rank 1's ``dst``).
SAMPLES: dict[str, tuple[list[str], list[str], dict]] = {
    "embed": (["tab[0:8, 0:16]", "tok[0:1]"], ["y[0:16]"], {}),
    "rmsnorm": (["x[0:16]", "w[0:16]"], ["y[0:16]"], {"dim": 16, "eps": 1e-5}),
    "gemv": (["x[0:16]", "W[0:8, 0:16]"], ["y8[0:8]"], {}),
    "rope": (["x[0:16]", "inv[0:4]", "pos[0:1]"], ["y[0:16]"], {"head_dim": 8}),
    "kv_append": (["x[0:16]", "u[0:16]", "pos[0:1]"], [_KC, _VC], {"head_dim": 8}),
    "attention": (["q[0:32]", _KC, _VC, "pos[0:1]"], ["o[0:32]"], _ATT),
    "silu_mul": (["x[0:16]", "u[0:16]"], ["y[0:16]"], {}),
    "add": (["x[0:16]", "u[0:16]"], ["y[0:16]"], {}),
    "reduce": (["P[0:2, 0:16]", "x[0:16]"], ["y[0:16]"], {}),
    "argmax": (["x[0:16]"], ["am[0:2]"], {"offset": 100}),
    "argmax_combine": (["pairs[0:2, 0:2]"], ["next[0:1]"], {}),
    "norm_gemv": (["x[0:16]", "w[0:16]", "W[0:8, 0:16]"], ["y8[0:8]"], {"eps": 1e-5}),
    "reduce_norm_gemv": (["P[0:2, 0:16]", "x[0:16]", "w[0:16]", "W[0:8, 0:16]"], ["y8[0:8]"], {"eps": 1e-5}),
    "gemv_res": (["x[0:16]", "W[0:8, 0:16]", "r8[0:8]"], ["y8[0:8]"], {}),
    "swiglu_gemv": (["x[0:16]", "u[0:16]", "W[0:8, 0:16]"], ["y8[0:8]"], {}),
    "rope_append": (["x[0:16]", "u[0:16]", "inv[0:4]", "pos[0:1]"], [_KC, _VC], {"head_dim": 8}),
    "rope_attention": (["q[0:32]", _KC, _VC, "pos[0:1]", "inv[0:4]"], ["o[0:32]"], _ATT),
    "rope_attention_kv": (["q[0:32]", "x[0:16]", "u[0:16]", _KC, _VC, "pos[0:1]", "inv[0:4]"], ["o[0:32]"], _ATT),
    "attention_combine": (["rec[0:3, 0:4, 0:10]"], ["o[0:32]"], {"head_dim": 8, "parts": 3}),
    "gemm": (["P[0:2, 0:16]", "B[0:16, 0:8]"], ["Y[0:2, 0:8]"], {}),
    "copy": (["x[0:16]"], ["y[0:16]"], {}),
    "put": (["x[0:16]"], ["dst@1[0:16]"], {}),
    "quiet": ([], [], {}),
    "fence": ([], [], {}),
    "nop": ([], [], {}),
}


def sample_program(op: str) -> ScheduleProgram:
    """A one-task program of ``op``'s sample (two ranks when it writes rank 1)."""
    ins, outs, params = SAMPLES[op]
    ranks = 2 if any("@1" in r for r in outs) else 1
    b = ProgramBuilder(f"sample-{op}", ranks=ranks, workers=1)
    used = {re.match(r"\w+", r).group(0) for r in ins + outs}
    for name in sorted(used):
        kind, dtype, shape = BUFFERS[name]
        b.buffer(name, kind, dtype, shape, placement="symmetric" if name == "dst" else "local")
    b.task(f"t.{op}", 0, 0, op, ins=ins, outs=outs, params=params)
    return b.build()


def init_value(buf, rank: int) -> torch.Tensor:
    """A buffer's contents for the sample runs: valid tokens, positions and argmax pairs,
    positive frequencies, seeded normal floats elsewhere."""
    if buf.name in ("tok", "pos"):
        return torch.tensor([3 if buf.name == "tok" else 2], dtype=torch.int32)
    if buf.name == "pairs":
        return torch.tensor([[1.0, 5.0], [2.0, 7.0]])
    g = torch.Generator().manual_seed(sum(map(ord, buf.name)))
    v = torch.randn(buf.shape, generator=g)
    return v.abs() * 0.1 if buf.name == "inv" else v


def _poison(shape, dtype: str) -> torch.Tensor:
    """Unwritten memory as the backends poison it: NaN, or INT_POISON for i32."""
    if dtype == "i32":
        return torch.full(shape, INT_POISON, dtype=torch.int32)
    return torch.full(shape, float("nan"))


def _written(t: torch.Tensor) -> bool:
    """Whether any element of ``t`` differs from the poison."""
    return bool((t != INT_POISON).any()) if t.dtype == torch.int32 else not bool(t.float().isnan().all())


def _docs_op_rows() -> dict[str, list[str]]:
    """docs/ir.md's op table: op -> its cells (kind, ins, outs, params, meaning)."""
    text = IR_MD.read_text()
    section = text[text.index("\n## Ops\n"):text.index("\n## JSON form\n")]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| `(\w+)` \|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split(" | ")]
    return rows


def _roles(cell: str) -> list[str]:
    """Operand roles of a docs table cell ("x [K]: float, bias? [N]: float" -> x, bias?)."""
    return [m.group(1) + m.group(2) for m in re.finditer(r"(?:^|, )(\w+)(\??)(?= \[|:)", cell)]


def _checklist() -> list[str]:
    """The first path named in each item of docs/ir.md's "Adding an op" checklist."""
    text = IR_MD.read_text()
    body = text[text.index("\n### Adding an op\n"):]
    body = body[:body.index("\n## ")]
    return [m.group(1) for m in re.finditer(r"^\d+\. `([^`]+)`", body, re.M)]


def missing_places(op: str) -> list[str]:
    """The places of ``PLACES`` that ``op`` lacks: its OpSpec and its line in ir/ops.py's
    docstring, its reference implementation, its acceptance by the validator's op table,
    its Triton registry entry (or a NOT_SUPPORTED reason, matching ``backends``), its row
    in docs/ir.md's op table, its sample task here."""
    spec = OPS.get(op)
    missing = []
    if spec is None or not re.search(rf"^{op}\b", ir_ops.__doc__, re.M):
        missing.append("ir/ops.py")
    if op not in IMPLS:
        missing.append("lowering/reference.py")
    if op not in SAMPLES or check_structure(sample_program(op), "sim").findings:
        missing.append("validator/")
    triton = spec is not None and "triton" in spec.backends
    if (op in REGISTRY) == (op in NOT_SUPPORTED) or (op in REGISTRY) != triton:
        missing.append("lowering/triton/ops/")
    if op not in _docs_op_rows():
        missing.append("docs/ir.md")
    if op not in SAMPLES:
        missing.append("tests/test_op_registry.py")
    return missing


def test_checklist_names_exactly_the_places_the_test_checks():
    assert _checklist() == list(PLACES)
    assert all((ROOT / p).exists() for p in PLACES)


@pytest.mark.parametrize("op", list(OPS))
def test_op_has_every_place(op):
    assert missing_places(op) == []


def test_an_op_declared_nowhere_else_is_caught(monkeypatch):
    """A new OpSpec alone lacks every place (its docstring line included), so the test fails
    until the checklist is done."""
    monkeypatch.setitem(OPS, "scale", OpSpec("scale", "compute", ("x",), ("y",), (("f32",),), (("f32",),)))
    assert missing_places("scale") == list(PLACES)
    monkeypatch.setitem(NOT_SUPPORTED, "gemv", "a reason")  # registered and refused: inconsistent
    assert missing_places("gemv") == ["lowering/triton/ops/"]


def test_the_registry_holds_every_op_of_its_families_once():
    declared = [e.op for f in FAMILIES for e in f.LOWERINGS]
    assert sorted(declared) == sorted(REGISTRY) and len(set(declared)) == len(declared)
    assert not set(NOT_SUPPORTED) & set(REGISTRY)
    for f in FAMILIES:
        assert all(e.module == f.__name__ for e in f.LOWERINGS), f.__name__


@pytest.mark.parametrize("op", sorted(REGISTRY))
def test_registry_entry_agrees_with_the_op_spec(op):
    """Views cover every role of the OpSpec (optional inputs included); the row's params are
    the spec's (optional ones with the default the row stores when a task omits them), int
    or float as declared; a GEMV's weight is the spec's ``w`` role."""
    spec, e = OPS[op], REGISTRY[op]
    assert len(e.views) == spec.max_ins + len(spec.outs)
    assert set(e.views) <= {"flat", "matrix", "partials", "cache"}
    declared = {**spec.params, **{n: t for n, t in spec.optional_params.items() if n in e.param_defaults}}
    assert {n: k for n, k in e.params} == {n: "i" if t is int else "f" for n, t in declared.items()}
    assert set(e.param_defaults) <= set(spec.optional_params)
    assert len(e.params) <= L.N_PARAMS
    assert e.in_place in ("", "same", "residual") and (e.in_place != "residual" or e.gemv is not None)
    if e.gemv is not None:
        assert spec.ins[e.gemv.w] == "w" and spec.mirrors > 0


def test_docs_op_table_matches_the_specs():
    rows = _docs_op_rows()
    assert list(rows) == list(OPS)
    for op, (kind, ins, outs, params, _) in rows.items():
        spec = OPS[op]
        assert kind == spec.kind, op
        assert _roles(ins) == list(spec.ins) + [r + "?" for r in spec.optional_ins], op
        assert _roles(outs) == list(spec.outs), op
        want = {**spec.params, **spec.optional_params}
        assert dict(re.findall(r"(\w+) \((int|float|str)\)", params)) == {n: t.__name__ for n, t in want.items()}, op


@pytest.mark.parametrize("op", list(OPS))
def test_sample_runs_through_every_place(op):
    """The sample task: accepted by the validator's structure pass for each backend of the
    op, which indexes its inputs as reads and its outputs as writes; computed by the
    reference implementation and by the sim backend (every output written); encoded by the
    Triton table, whose generated dispatch calls the op's row decoder."""
    prog = sample_program(op)
    t = prog.tasks[0]
    spec = OPS[op]
    for backend in sorted(spec.backends):
        res = check_structure(prog, backend)
        assert not res.findings, res.findings
    ix = check_structure(prog, "sim").index
    regs = [(bool(w), int(k)) for w, k in zip(ix.r_out, ix.r_operand)]
    assert sorted(regs) == [(False, i) for i in range(len(t.ins))] + [(True, i) for i in range(len(t.outs))]

    bufs = prog.buffer_map()
    ins = [init_value(bufs[r.buffer], r.rank)[tuple(slice(a, b) for a, b in r.concrete(0))] for r in t.ins]
    outs = [_poison(r.shape(), bufs[r.buffer].dtype) for r in t.outs]
    apply_op(op, t.params, ins, outs)
    assert all(_written(o) for o in outs), op
    assert [squeeze(tuple(o.shape)) for o in outs] == [squeeze(r.shape()) for r in t.outs]

    sim = SimExecutor(prog, init_value, check=False, policy="in_order")
    sim.step(0)
    for r in t.outs:
        assert _written(sim.read(r.buffer, r.rank)[tuple(slice(a, b) for a, b in r.concrete(0))]), (op, r)

    if op in REGISTRY:
        deltas = {q: q * build_layout(prog, 0).nbytes for q in range(1, prog.ranks)}
        tab = build_table(prog, 0, [linearize(prog, 0)], peer_delta=deltas)
        (v,) = tab.variants
        entry = REGISTRY[op]
        src = generate_source(tab, prog.name, sys_waits=prog.ranks > 1)
        assert entry.call(v).split("(")[0] == entry.decoder_name
        assert entry.call(v)[:-1] in src
        assert f"import {entry.decoder_name}" in src or f", {entry.decoder_name}" in src


def test_triton_refuses_an_op_it_does_not_implement_in_one_line(monkeypatch):
    """An op listed in NOT_SUPPORTED (taken out of the registry here) is refused by the table
    with one line naming the task, the op and the reason."""
    monkeypatch.delitem(REGISTRY, "silu_mul")
    monkeypatch.setitem(NOT_SUPPORTED, "silu_mul", "no kernel yet")
    prog = sample_program("silu_mul")
    with pytest.raises(TableError) as e:
        build_table(prog, 0, [linearize(prog, 0)])
    assert str(e.value) == "task t.silu_mul: op silu_mul is not implemented by the triton backend (no kernel yet)"
    assert e.value.exit_code == 2
