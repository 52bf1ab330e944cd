"""models.capture: each example of examples/distributed/ and the other spellings of the four
patterns are recognised with their shapes and operands; everything else is refused on one line
naming the op and its file:line; an existing process group survives a capture."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ground.errors import AmkError
from models.capture import Operand, capture, where
from models.collectives import AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter, UlyssesCombine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "distributed"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"amk_test_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def line_of(fn, marker: str) -> str:
    """``file:line`` of the line of ``fn``'s source holding ``marker`` (as capture names it)."""
    lines, first = inspect.getsourcelines(fn)
    hits = [first + i for i, text in enumerate(lines) if marker in text]
    assert len(hits) == 1, (marker, hits)
    return where(inspect.getsourcefile(fn), hits[0])


def first_line(fn) -> str:
    return where(inspect.getsourcefile(fn), fn.__code__.co_firstlineno)


def refused(fn, shapes, world=2, dtype="bf16") -> str:
    with pytest.raises(AmkError) as exc:
        capture(fn, world, shapes, dtype)
    assert exc.value.exit_code == 2
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# ------------------------------------------------------------------------ the examples
@pytest.mark.parametrize("world", [2, 3])
def test_allgather_matmul_example(world):
    m = example("allgather_matmul")
    c = capture(m.allgather_matmul, world, m.shapes(world))
    assert c.pattern == AllGatherMatmul(world=world, dtype="bf16", m=32 * world, n=48, k=64)
    assert c.operands == {"x": Operand("x"), "w": Operand("w")}
    fn = m.allgather_matmul
    assert c.steps == (("all_gather_into_tensor", line_of(fn, "dist.all_gather_into_tensor")),
                       ("matmul", line_of(fn, "return gathered @ w")))
    assert c.operand_shapes() == {"x": (32, 64), "w": (64, 48)}
    assert c.out_dtype == torch.bfloat16 and c.where == first_line(fn)


def test_matmul_reduce_scatter_example_takes_the_weight_transposed():
    m = example("matmul_reduce_scatter")
    c = capture(m.matmul_reduce_scatter, 2, m.shapes(2))
    assert c.pattern == MatmulReduceScatter(world=2, dtype="bf16", m=64, n=48, k=32)
    assert c.operands == {"x": Operand("x"), "w": Operand("w", transposed=True)}
    assert c.operand_shapes() == {"x": (64, 32), "w": (48, 32)}  # as the function takes them
    assert [k for k, _ in c.steps] == ["matmul", "reduce_scatter_tensor"]
    x, w = torch.randn(64, 32), torch.randn(48, 32)
    ops = c.bind((x, w), {})
    assert ops["x"] is x and torch.equal(ops["w"], w.t())  # w in the pattern's [K, N]


def test_matmul_allreduce_rmsnorm_example():
    m = example("matmul_allreduce_rmsnorm")
    c = capture(m.matmul_allreduce_rmsnorm, 4, m.shapes(4), dtype="f32")
    assert c.pattern == MatmulAllReduce(world=4, dtype="f32", m=16, n=48, k=64, norm=True, eps=1e-6)
    assert c.operands == {"x": Operand("x"), "w": Operand("w"), "g": Operand("g")}
    assert c.constants == {"eps": 1e-6}
    assert c.out_dtype == torch.float32
    args = (torch.randn(16, 64), torch.randn(64, 48), torch.randn(48))
    assert set(c.bind(args, {})) == {"x", "w", "g"}
    with pytest.raises(AmkError, match=r"eps=1e-05 differs from 1e-06, the value it was captured with"):
        c.bind(args, {"eps": 1e-5})
    with pytest.raises(AmkError, match=r"argument x has shape \(8, 64\), captured with \(16, 64\)"):
        c.bind((torch.randn(8, 64),) + args[1:], {})


def test_ulysses_combine_example():
    m = example("ulysses_combine")
    c = capture(m.ulysses_combine, 2, m.shapes(2))
    assert c.pattern == UlyssesCombine(world=2, dtype="bf16", s=32, c=16, n=48)
    assert c.operands == {"o": Operand("o"), "w": Operand("w")}
    assert [k for k, _ in c.steps] == ["all_to_all_single", "matmul"]


# ------------------------------------------------------------------------ other spellings
def ag_linear(x, w):
    g = torch.empty(2 * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(g, x)
    return F.linear(g, w)


def ar_mm_t(x, w):
    y = torch.mm(x, w.t())
    dist.all_reduce(y)
    return y


def ar_rms_norm(x, w, g):
    y = x.matmul(w.T)
    dist.all_reduce(y)
    return F.rms_norm(y, (y.shape[-1],), g)


def ar_rms_norm_div(x, w, g):
    y = x @ w
    dist.all_reduce(y, op=dist.ReduceOp.SUM)
    h = y.float()
    h = h / torch.sqrt((h * h).mean(dim=-1, keepdim=True) + 1e-5)
    return h.type_as(y) * g


def uly_view(o, w):
    out = torch.empty_like(o)
    dist.all_to_all_single(out, o)
    return out.view(2, o.shape[0] // 2, o.shape[1]).transpose(0, 1).contiguous().flatten(1) @ w


def ag_single(x, w):
    g = torch.empty(2 * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    dist.all_gather_single(g, x)
    return g @ w.permute(1, 0)


def rs_single(x, w):
    y = x @ w.transpose(0, 1)
    out = torch.empty(y.shape[0] // 2, y.shape[1], dtype=y.dtype)
    dist.reduce_scatter_single(out, y)
    return out


@pytest.mark.skipif(not hasattr(dist, "all_gather_single"), reason="torch without all_gather_single")
def test_the_single_spellings():
    c = capture(ag_single, 2, {"x": (4, 8), "w": (6, 8)})
    assert c.pattern == AllGatherMatmul(world=2, dtype="bf16", m=8, n=6, k=8) and c.operands["w"].transposed
    c = capture(rs_single, 2, {"x": (4, 8), "w": (6, 8)})
    assert c.pattern == MatmulReduceScatter(world=2, dtype="bf16", m=4, n=6, k=8) and c.operands["w"].transposed


def test_other_spellings():
    c = capture(ag_linear, 2, {"x": (4, 8), "w": (6, 8)})
    assert c.pattern == AllGatherMatmul(world=2, dtype="bf16", m=8, n=6, k=8)
    assert c.operands["w"] == Operand("w", transposed=True)
    c = capture(ar_mm_t, 2, {"x": (4, 8), "w": (6, 8)})
    assert c.pattern == MatmulAllReduce(world=2, dtype="bf16", m=4, n=6, k=8)
    assert c.operands["w"].transposed
    c = capture(ar_rms_norm, 2, {"x": (4, 8), "w": (6, 8), "g": (6,)})
    # torch's rms_norm with eps=None takes the input dtype's epsilon
    assert c.pattern == MatmulAllReduce(world=2, dtype="bf16", m=4, n=6, k=8, norm=True,
                                        eps=torch.finfo(torch.bfloat16).eps)
    c = capture(ar_rms_norm_div, 2, {"x": (4, 8), "w": (8, 6), "g": (6,)}, dtype="f16")
    assert c.pattern == MatmulAllReduce(world=2, dtype="f16", m=4, n=6, k=8, norm=True, eps=1e-5)
    c = capture(uly_view, 2, {"o": (4, 3), "w": (6, 5)})
    assert c.pattern == UlyssesCombine(world=2, dtype="bf16", s=4, c=3, n=5)


# ------------------------------------------------------------------------ refusals
def sorts(x, w):
    y = x @ w
    dist.all_reduce(y)
    return torch.sort(y, dim=-1).values


def two_patterns(x, w):
    y = x @ w
    dist.all_reduce(y)
    out = torch.empty(y.shape[0] // 2, y.shape[1], dtype=y.dtype)
    dist.reduce_scatter_tensor(out, y)
    return out


def two_matmuls(x, w, v):
    y = x @ w
    dist.all_reduce(y)
    return y @ v


def async_collective(x, w):
    y = x @ w
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    return y


def prints(x, w):
    y = x @ w
    dist.all_reduce(y)
    print("reduced")
    return y


def reduce_scatter(x, w):
    y = x @ w
    out = torch.empty(y.shape[0] // dist.get_world_size(), y.shape[1], dtype=y.dtype)
    dist.reduce_scatter_tensor(out, y)
    return out


def max_reduce(x, w):
    y = x @ w
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    return y


W_GLOBAL = torch.randn(8, 6, dtype=torch.bfloat16)


def global_weight(x):
    y = x @ W_GLOBAL
    dist.all_reduce(y)
    return y


def linear_bias(x, w, b):
    y = F.linear(x, w, b)
    dist.all_reduce(y)
    return y


def wrong_layout(o, w):
    out = torch.empty_like(o)
    dist.all_to_all_single(out, o)
    return out.reshape(2, o.shape[1], o.shape[0] // 2).reshape(o.shape[0] // 2, 2 * o.shape[1]) @ w


def no_collective(x, w):
    return x @ w


def two_outputs(x, w):
    y = x @ w
    dist.all_reduce(y)
    return y, x


def returns_input(x, w):
    y = x @ w
    dist.all_reduce(y)
    return x


def adds(x, w):
    y = x @ w
    dist.all_reduce(y)
    return y + 1


XW = {"x": (4, 8), "w": (8, 6)}


def test_an_unknown_op_is_named_with_its_line():
    msg = refused(sorts, XW)
    assert msg.startswith(f"{line_of(sorts, 'torch.sort')}: torch.sort is not an op amk dist lowers (known: "
                          "all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single;"), msg
    assert msg.startswith("tests/test_dist_capture.py:")


def test_one_pattern_per_function():
    msg = refused(two_patterns, XW)
    assert msg == (f"{line_of(two_patterns, 'reduce_scatter_tensor(out')}: reduce_scatter_tensor is a second "
                   f"collective in two_patterns (the first: all_reduce at {line_of(two_patterns, 'all_reduce(y)')}); "
                   "one pattern per function: split it into one function per pattern")
    msg = refused(two_matmuls, {**XW, "v": (6, 5)})
    assert msg.startswith(f"{line_of(two_matmuls, 'y @ v')}: a second matmul in two_matmuls (the first at "
                          f"{line_of(two_matmuls, 'x @ w')}); one pattern per function")


def test_async_op_is_refused():
    msg = refused(async_collective, XW)
    assert msg.startswith(f"{line_of(async_collective, 'async_op=True')}: async_op=True: torch.compile cannot "
                          "capture an asynchronous collective (graph break)"), msg


def test_a_graph_break_gives_dynamo_reason():
    msg = refused(prints, XW)
    assert msg.startswith(f"{line_of(prints, 'print(')}: torch.compile cannot capture prints in one graph "
                          "(graph break): "), msg
    assert "print" in msg.split("graph break): ")[1]


def test_a_shape_that_does_not_divide_by_the_world_size():
    msg = refused(reduce_scatter, {"x": (5, 8), "w": (8, 6)})
    assert msg.startswith(f"{line_of(reduce_scatter, 'reduce_scatter_tensor(out')}: the collective needs "
                          "dimension 0 divisible by the world size 2: x [5, 8]"), msg
    msg = refused(uly_view, {"o": (5, 3), "w": (6, 5)})
    assert "divisible by the world size 2: o [5, 3]" in msg


def test_subgroups_and_other_reductions(tmp_path):
    msg = refused(max_reduce, XW)
    assert msg == f"{line_of(max_reduce, 'ReduceOp.MAX')}: all_reduce with op max; amk dist lowers the sum"
    with real_group(tmp_path) as sub:
        def on_subgroup(x, w):
            y = x @ w
            dist.all_reduce(y, group=sub)
            return y

        msg = refused(on_subgroup, XW, world=4)
    assert msg == (f"{line_of(on_subgroup, 'group=sub')}: all_reduce over a subgroup (ranks [0]); amk dist "
                   "lowers collectives over the whole world of 4 ranks (group=None)")


def test_what_is_not_one_of_the_patterns():
    assert refused(global_weight, {"x": (4, 8)}) == (
        f"{first_line(global_weight)}: global_weight reads the tensor G['W_GLOBAL'], which is not one of its "
        "parameters with a shape (x); pass it as a parameter")
    assert refused(linear_bias, {"x": (4, 8), "w": (6, 8), "b": (6,)}).startswith(
        f"{line_of(linear_bias, 'F.linear')}: torch.nn.functional.linear with a bias;")
    assert refused(wrong_layout, {"o": (4, 3), "w": (6, 5)}) == (
        f"{line_of(wrong_layout, 'return out.reshape')}: the all_to_all_single result is laid out as "
        "reshape(2, 6); amk dist lowers the Ulysses layout reshape(2, 2, 3).permute(1, 0, 2).reshape(2, 6) before the matmul")
    assert refused(no_collective, XW) == (
        f"{first_line(no_collective)}: no_collective has no collective; amk dist lowers one of: "
        "all_gather_into_tensor -> matmul, matmul -> reduce_scatter_tensor, matmul -> all_reduce (-> RMSNorm), "
        "all_to_all_single -> Ulysses layout -> matmul")
    assert refused(two_outputs, XW) == (f"{first_line(two_outputs)}: two_outputs returns a tuple; amk dist "
                                        "lowers a function that returns one tensor")
    assert refused(returns_input, XW) == (
        f"{first_line(returns_input)}: returns_input returns its parameter x; amk dist lowers a function that "
        "returns its result")
    assert refused(adds, XW).startswith(
        f"{line_of(adds, 'y + 1')}: the + operator on all_reduce(matmul(x, w)) and 1 is not part of a pattern")


def test_shape_arguments_are_checked():
    assert refused(no_collective, {"x": (4, 8)}) == (
        "no_collective: parameter w has no shape (give w=DIMS) and no default")
    assert refused(no_collective, {**XW, "q": (1,)}) == (
        "shape for q: no_collective has no parameter q (its parameters: x, w)")
    assert refused(no_collective, {"x": (4, 0), "w": (8, 6)}) == "shape of x must have dimensions >= 1, got [4, 0]"
    assert refused(no_collective, XW, world=0) == "world size must be an integer >= 1, got 0"
    assert refused(no_collective, XW, dtype="f64") == "dtype 'f64' is not one of bf16, f16, f32"


# ------------------------------------------------------------------------ the caller's group
class real_group:
    """A real gloo group of one process (FileStore) with a subgroup of rank 0, destroyed after."""

    def __init__(self, tmp_path):
        self.path = tmp_path / "store"

    def __enter__(self):
        store = dist.FileStore(str(self.path), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return dist.new_group([0])

    def __exit__(self, *exc):
        dist.destroy_process_group()


def test_an_existing_process_group_survives_a_capture(tmp_path):
    m = example("allgather_matmul")
    with real_group(tmp_path) as sub:
        import torch.distributed.distributed_c10d as c10d

        world_name = dist.group.WORLD.group_name
        before = (c10d._backend, c10d._default_pg_init_method, c10d._world.group_count)
        c = capture(m.allgather_matmul, 4, m.shapes(4))
        assert c.pattern.world == 4
        assert (c10d._backend, c10d._default_pg_init_method, c10d._world.group_count) == before
        assert dist.get_backend() == "gloo"
        assert dist.get_world_size() == 1 and dist.get_rank() == 0
        assert dist.group.WORLD.group_name == world_name
        t = torch.ones(3)
        dist.all_reduce(t)
        dist.all_reduce(t, group=sub)
        assert torch.equal(t, torch.ones(3))
        # the functional collectives resolve the group by its registered name
        import torch.distributed._functional_collectives as fc

        y = fc.all_reduce(torch.full((2,), 2.0), "sum", dist.group.WORLD)
        assert torch.equal(fc.wait_tensor(y), torch.full((2,), 2.0))
    assert not dist.is_initialized()
