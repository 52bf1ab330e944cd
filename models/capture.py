"""Capture a function written with torch ops and torch.distributed collectives and recognise
which communication + compute pattern of models/collectives.py it computes.

How it works
------------
``capture(fn, world, shapes, dtype)`` traces ``fn`` with torch's own graph capture,
``torch.compile(fn, backend=<collector>, fullgraph=True, dynamic=False)``, on CPU tensors of
the given shapes (``torch.empty``: no data is read or written) while a fake process group of
``world`` ranks (torch's ``FakeStore`` and ``"fake"`` backend, this process as rank 0) is the
default group. Dynamo turns ``dist.all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce`` and ``all_to_all_single`` into ``_c10d_functional`` ops, each followed by a
``wait_tensor`` and an in-place ``copy_`` into the user's output tensor. The collector keeps
the FX graph and, instead of running it, hands back uninitialised tensors of its outputs'
shapes, so the function returns and what it returns shows which output is its result. A
process group that already exists (the capture may run inside a torchrun job) is set aside
while the fake one is the default and restored afterwards.

The graph is then evaluated symbolically, node by node in program order: each tensor becomes
a parameter of the function, an allocation, a view chain (reshape / permute), a collective,
a matmul or a stage of an RMSNorm; ``copy_`` rebinds its destination (that is how the
in-place collectives write). The returned value must be one of

======================  =======================================================================
pattern                 the function computes
======================  =======================================================================
AllGatherMatmul         ``all_gather_into_tensor(x) @ w``
MatmulReduceScatter     ``reduce_scatter_tensor(x @ w)`` (sum)
MatmulAllReduce         ``all_reduce(x @ w)`` (sum), optionally followed by RMSNorm written as
                        HF does (``y * rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)``, then
                        ``g * .``) or as ``torch.nn.functional.rms_norm(y, (N,), g, eps)``
UlyssesCombine          ``all_to_all_single(o)`` then ``.reshape(R, S/R, C).permute(1, 0, 2)
                        .reshape(S/R, R*C) @ w``
======================  =======================================================================

where ``@`` is any of ``@``, ``torch.matmul``, ``torch.mm``, ``Tensor.matmul`` / ``mm``, or
``F.linear(x, w)`` (``w`` given as ``[N, K]`` and used transposed; ``w.t()`` / ``w.T`` before
``@`` likewise), and float casts (``.float()``, ``.to(dtype)``, ``.type_as``) may appear
anywhere. Anything else is refused with an AmkError (exit code 2) on one line that names the
op and its place in the user's source (``file:line``, from the node's stack trace): an op
outside this list, a collective over a subgroup or with another reduction than sum, uneven
all-to-all splits, two collectives or two matmuls in one function (one pattern per
function), a tensor that is not a parameter, a function dynamo cannot capture in one graph
(its reason), a dimension that does not divide by the world size.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import itertools
import operator
import os
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from ground.errors import AmkError
from models.collectives import (DTYPES, AllGatherMatmul, MatmulAllReduce, MatmulReduceScatter, Pattern,
                                UlyssesCombine)

#: What the refusals list as the ops amk dist lowers.
KNOWN = ("known: all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single; "
         "@ / matmul / mm / F.linear; reshape, view, permute, transpose, t, contiguous, flatten; "
         "pow, mean, +, rsqrt, * of an RMSNorm, F.rms_norm; float casts; torch.empty / zeros")
#: The four patterns, as the refusals describe them.
PATTERNS_TEXT = ("all_gather_into_tensor -> matmul, matmul -> reduce_scatter_tensor, "
                 "matmul -> all_reduce (-> RMSNorm), all_to_all_single -> Ulysses layout -> matmul")
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True)
class Operand:
    """Which parameter of the function a pattern operand is. ``transposed``: the function
    takes the weight as ``[N, K]`` and uses its transpose (``F.linear``, ``w.t()``)."""

    param: str
    transposed: bool = False


@dataclass(frozen=True)
class Captured:
    """A recognised function: its pattern (global shapes, world size, dtype), the parameter of
    each pattern operand (``x``, ``w``, ``g``, ``o``), the function's signature and name, the
    values of its non-tensor parameters at capture time (``constants``; dynamo specialised the
    graph on them), the shapes it was captured with, the dtype of its result, and the
    recognised steps as ``(what, file:line)`` pairs."""

    pattern: Pattern
    operands: dict[str, Operand]
    signature: inspect.Signature
    name: str
    where: str
    shapes: dict[str, tuple[int, ...]]
    constants: dict[str, Any] = field(default_factory=dict)
    out_dtype: torch.dtype = torch.bfloat16
    steps: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        """One line: the pattern with its dimensions and world size and where it was found."""
        dims = ", ".join(f"{k}={v}" for k, v in self.pattern.dims().items())
        extra = ""
        if isinstance(self.pattern, MatmulAllReduce) and self.pattern.norm:
            extra = f", RMSNorm eps={self.pattern.eps:g}"
        return f"{self.pattern.kind} ({dims}{extra}; world {self.pattern.world}, {self.pattern.dtype})"

    def operand_shapes(self) -> dict[str, tuple[int, ...]]:
        """Rank-local shape of each pattern operand as the function takes it (a transposed
        weight as ``[N, K]``)."""
        want = self.pattern.operands()
        return {k: tuple(reversed(want[k])) if op.transposed else want[k] for k, op in self.operands.items()}

    def bind(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        """The pattern's operands from a call ``fn(*args, **kwargs)``, in the pattern's layout
        (a transposed weight comes back as ``[K, N]``, a view). Raises AmkError when an
        argument is missing, is not a tensor, has another shape than captured, or a non-tensor
        parameter differs from the value the graph was captured with."""
        try:
            ba = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise AmkError(f"{self.name}: {e}") from None
        ba.apply_defaults()
        for name, value in self.constants.items():
            got = ba.arguments.get(name, value)
            if not _same_constant(got, value):
                raise AmkError(f"{self.name}: {name}={got!r} differs from {value!r}, the value it was "
                               "captured with; distribute it again with that value as the default")
        out = {}
        for op, spec in self.operands.items():
            t = ba.arguments.get(spec.param)
            if not isinstance(t, torch.Tensor):
                raise AmkError(f"{self.name}: argument {spec.param} must be a tensor, got {type(t).__name__}")
            want = self.shapes[spec.param]
            if tuple(t.shape) != want:
                raise AmkError(f"{self.name}: argument {spec.param} has shape {tuple(t.shape)}, "
                               f"captured with {want}")
            out[op] = t.t() if spec.transposed else t
        return out


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return a is b


# ----------------------------------------------------------------------------- places
def where(path: str, line: int | str) -> str:
    """``path:line`` with ``path`` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            path = rel
    except ValueError:  # another drive
        pass
    return f"{path}:{line}"


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _user_frame(frames: list[tuple[str, int]]) -> str | None:
    """The innermost frame outside torch's own package, as ``file:line``."""
    for path, line in reversed(frames):
        if not os.path.abspath(path).startswith(_TORCH_DIR):
            return where(path, line)
    return where(*frames[-1]) if frames else None


def _node_where(node: Any, default: str) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = [(p, int(n)) for p, n in _FRAME.findall(trace)]
    return _user_frame(frames) or default


# ----------------------------------------------------------------------------- fake group
_names = itertools.count(1)


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[Any]:
    """A fake process group of ``world`` ranks (this process as rank 0) as the default group,
    for tracing only; yields it. An existing default group and its subgroups are set aside and
    restored afterwards (the fake group gets a name no other group has, so torch's registry of
    group names keeps theirs)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_available():
        raise AmkError("torch.distributed is not available in this torch build")
    maps = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")
    # init_process_group also sets these module globals
    scalars = ("_group_count", "_backend", "_default_pg_init_method")
    saved = {k: getattr(c10d, k) for k in maps + scalars if hasattr(c10d, k)}
    saved_world = c10d._world
    prior = saved_world.default_pg
    for k in maps:
        setattr(c10d, k, {})
    # A fresh name: the default group of a real job is "0", registered in torch's C++ name
    # registry; the fake group must not replace it there.
    c10d._group_count = 1_000_000 + next(_names)
    c10d._world = c10d._World()
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        yield c10d._world.default_pg
    finally:
        for pg, name in list(c10d._world.pg_names.items()):
            with contextlib.suppress(Exception):
                pg.shutdown()
            with contextlib.suppress(Exception):
                c10d._unregister_process_group(name)
        c10d._world = saved_world
        for k, v in saved.items():
            setattr(c10d, k, v)
        rank = prior.rank() if prior is not None and prior != dist.GroupMember.NON_GROUP_MEMBER else -1
        torch._C._distributed_c10d._set_global_rank(rank)


# ----------------------------------------------------------------------------- values
class _V:
    """A symbolic tensor value of the captured graph."""

    shape: tuple[int, ...]


@dataclass(eq=False)
class _Input(_V):
    param: str
    shape: tuple[int, ...]


@dataclass(eq=False)
class _Alloc(_V):
    shape: tuple[int, ...]


@dataclass(eq=False)
class _View(_V):
    """``base`` through view steps: ``("reshape", shape)`` or ``("permute", dims)``."""

    base: _V
    steps: tuple[tuple[str, tuple[int, ...]], ...]
    shape: tuple[int, ...]


@dataclass(eq=False)
class _Pending(_V):
    kind: str
    arg: _V
    loc: str
    shape: tuple[int, ...]


@dataclass(eq=False)
class _Coll(_V):
    kind: str
    arg: _V
    loc: str
    shape: tuple[int, ...]


@dataclass(eq=False)
class _MatMul(_V):
    a: _V
    b: _V
    loc: str
    shape: tuple[int, ...]


@dataclass(eq=False)
class _Norm(_V):
    """A stage of an RMSNorm of ``v``: ``sq`` (v^2), ``ms`` (mean of v^2 over the last dim),
    ``mse`` (+ eps), ``inv`` (rsqrt of that), ``rms`` (sqrt of that), ``normed`` (v * inv),
    ``rmsnorm`` (normed * g)."""

    stage: str
    v: _V
    loc: str
    shape: tuple[int, ...]
    eps: float | None = None
    g: _V | None = None


_NORM_TEXT = {"sq": "v.pow(2)", "ms": "v.pow(2).mean(-1)", "mse": "mean(v^2) + eps", "inv": "rsqrt(mean(v^2) + eps)",
              "rms": "sqrt(mean(v^2) + eps)", "normed": "v * rsqrt(mean(v^2) + eps)", "rmsnorm": "rms_norm(v) * g"}


def _describe(v: Any) -> str:
    """A short expression for a value (used in refusals)."""
    if isinstance(v, _Input):
        return v.param
    if isinstance(v, _Alloc):
        return "an uninitialised tensor"
    if isinstance(v, _View):
        return f"a view of {_describe(v.base)}"
    if isinstance(v, (_Coll, _Pending)):
        return f"{v.kind}({_describe(v.arg)})"
    if isinstance(v, _MatMul):
        return f"matmul({_describe(v.a)}, {_describe(v.b)})"
    if isinstance(v, _Norm):
        return _NORM_TEXT[v.stage].replace("v", _describe(v.v), 1) if v.stage != "rmsnorm" else \
            f"rms_norm({_describe(v.v)}) * {_describe(v.g)}"
    if isinstance(v, (int, float)):
        return repr(v)
    return type(v).__name__


# ----------------------------------------------------------------------------- op names
def _fn_table() -> dict[Any, str]:
    import torch.nn.functional as F

    t: dict[Any, str] = {
        operator.matmul: "matmul", torch.matmul: "matmul", torch.mm: "matmul",
        torch._C._nn.linear: "linear", F.linear: "linear",
        torch.rms_norm: "rms_norm", F.rms_norm: "rms_norm",
        operator.add: "add", torch.add: "add", operator.mul: "mul", torch.mul: "mul",
        operator.truediv: "div", torch.div: "div",
        operator.pow: "pow", torch.pow: "pow", torch.mean: "mean",
        torch.rsqrt: "rsqrt", torch.sqrt: "sqrt",
        torch.empty: "alloc", torch.empty_like: "alloc", torch.zeros: "alloc", torch.zeros_like: "alloc",
        torch.reshape: "reshape", torch.permute: "permute", torch.transpose: "transpose", torch.t: "t",
        torch.flatten: "flatten", builtins.getattr: "getattr",
    }
    return t


_METHODS = {
    "matmul": "matmul", "mm": "matmul", "__matmul__": "matmul",
    "reshape": "reshape", "view": "reshape", "flatten": "flatten", "permute": "permute",
    "transpose": "transpose", "t": "t", "contiguous": "same",
    "to": "cast", "float": "cast", "bfloat16": "cast", "half": "cast", "type_as": "cast",
    "pow": "pow", "mean": "mean", "rsqrt": "rsqrt", "sqrt": "sqrt", "mul": "mul", "add": "add", "div": "div",
    "copy_": "copy_", "new_empty": "alloc", "new_zeros": "alloc",
}

_OPERATORS = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
              operator.matmul: "@", operator.pow: "**", operator.neg: "unary -",
              operator.getitem: "indexing ([])", operator.setitem: "indexed assignment",
              operator.iadd: "+=", operator.imul: "*=", operator.isub: "-="}


def op_name(node: Any) -> str:
    """How a user would name the op of an FX node: ``torch.sort``, ``Tensor.relu``,
    ``torch.nn.functional.gelu``, ``torch.distributed.broadcast``, ``the - operator``."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return f"module {target}"
    if node.op == "get_attr":
        return f"attribute {target}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ns, _, rest = str(target).partition(".")
        name = rest.split(".")[0]
        if ns == "_c10d_functional":
            return f"torch.distributed {name}"
        return f"torch.ops.{ns}.{name}"
    if target in _OPERATORS:
        return f"the {_OPERATORS[target]} operator"
    name = getattr(target, "__name__", repr(target))
    import torch.nn.functional as F

    for mod, prefix in ((torch, "torch"), (F, "torch.nn.functional"), (torch.linalg, "torch.linalg"),
                        (torch.special, "torch.special"), (torch.fft, "torch.fft")):
        if getattr(mod, name, None) is target:
            return f"{prefix}.{name}"
    if getattr(torch._C._nn, name, None) is target:
        return f"torch.nn.functional.{name}"
    if target is builtins.getattr:
        return "getattr"
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module else name


# ----------------------------------------------------------------------------- evaluation
class _Eval:
    """Symbolic evaluation of one captured graph (module docstring)."""

    def __init__(self, gm: Any, sources: dict[str, tuple[str | None, str]], func: str, func_where: str,
                 world: int, world_group: str, params: dict[str, tuple[int, ...]]):
        self.gm, self.sources, self.func, self.func_where = gm, sources, func, func_where
        self.R, self.world_group, self.params = world, world_group, params
        self.vals: dict[Any, Any] = {}
        self.colls: list[tuple[str, str]] = []  # (kind, loc)
        self.matmuls: list[str] = []
        self.pending: dict[int, tuple[_Pending, Any]] = {}
        self.fns = _fn_table()
        self.steps: list[tuple[str, str]] = []
        self.out_dtype: torch.dtype | None = None
        self.groups: dict[str, list[int]] = {}  # subgroups by name, for the refusal

    # -- helpers
    def refuse(self, node: Any, what: str) -> AmkError:
        return AmkError(f"{_node_where(node, self.func_where)}: {what}")

    def unknown(self, node: Any) -> AmkError:
        return self.refuse(node, f"{op_name(node)} is not an op amk dist lowers ({KNOWN})")

    def outside(self, node: Any, args: list) -> AmkError:
        shown = " and ".join(_describe(a) for a in args if isinstance(a, (_V, int, float)))
        return self.refuse(node, f"{op_name(node)} on {shown} is not part of a pattern amk dist lowers "
                                 f"(one of: {PATTERNS_TEXT})")

    @staticmethod
    def shape_of(node: Any) -> tuple[int, ...]:
        ev = node.meta.get("example_value")
        return tuple(int(d) for d in ev.shape) if isinstance(ev, torch.Tensor) else ()

    def val(self, a: Any) -> Any:
        import torch.fx as fx

        if isinstance(a, fx.Node):
            return self.vals[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.val(x) for x in a)
        return a

    # -- the walk
    def run(self, index: int | None = None) -> tuple[_V, Any]:
        """Evaluate every node; (the value of the function's result, its node). ``index``: the
        graph output the function returns (None: the graph's only tensor output)."""
        out_node = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.vals[node] = self.placeholder(node)
            elif node.op == "output":
                out_node = node
            elif node.op in ("call_function", "call_method"):
                self.vals[node] = self.call(node)
            else:
                raise self.unknown(node)
        for p, node in self.pending.values():
            raise self.refuse(node, f"the result of {p.kind} is never waited for (wait_tensor); "
                                    "amk dist lowers collectives whose result the function uses")
        outs = [a for a in _flatten(out_node.args[0] if out_node is not None else ())]
        tensors = [a for a in outs if isinstance(self.vals.get(a), _V)]
        if index is not None and index < len(outs) and isinstance(self.vals.get(outs[index]), _V):
            tensors = [outs[index]]
        if len(tensors) != 1:
            raise AmkError(f"{self.func_where}: {self.func} returns {len(tensors)} tensors; amk dist lowers "
                           "a function that returns one tensor")
        ev = tensors[0].meta.get("example_value")
        self.out_dtype = ev.dtype if isinstance(ev, torch.Tensor) else None
        return self.vals[tensors[0]], tensors[0]

    def placeholder(self, node: Any) -> _V:
        name, what = self.sources.get(node.name, (None, str(node.target)))
        if name is None or name not in self.params:
            raise AmkError(f"{self.func_where}: {self.func} reads the tensor {what}, which is not one of its "
                           f"parameters with a shape ({', '.join(self.params) or 'none'}); pass it as a parameter")
        return _Input(name, self.params[name])

    def call(self, node: Any) -> Any:
        if node.op == "call_method":
            kind = _METHODS.get(node.target)
        elif isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            ns, _, rest = str(node.target).partition(".")
            return self.c10d(node, rest.split(".")[0]) if ns == "_c10d_functional" else _raise(self.unknown(node))
        else:
            try:
                kind = self.fns.get(node.target)
            except TypeError:  # unhashable target
                kind = None
        if kind is None:
            raise self.unknown(node)
        args = [self.val(a) for a in node.args]
        kwargs = {k: self.val(v) for k, v in node.kwargs.items()}
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, _Pending):
                raise self.refuse(node, f"uses the result of {a.kind} without waiting for it")
        return getattr(self, f"op_{kind}")(node, args, kwargs)

    # -- collectives
    def c10d(self, node: Any, name: str) -> Any:
        args = [self.val(a) for a in node.args]
        if name == "wait_tensor":
            p = args[0]
            if not isinstance(p, _Pending):
                raise self.unknown(node)
            self.pending.pop(id(p), None)
            return _Coll(p.kind, p.arg, p.loc, self.shape_of(node))
        if name not in COLLECTIVES:
            raise self.refuse(node, f"torch.distributed {name} is not a collective amk dist lowers "
                                    f"(known: {', '.join(COLLECTIVES)})")
        loc = _node_where(node, self.func_where)
        group = args[-1]
        if str(group) != self.world_group:
            raise self.refuse(node, f"{name} over a subgroup ({_group_text(group, self.groups)}); amk dist lowers "
                                    f"collectives over the whole world of {self.R} ranks (group=None)")
        if name in ("all_reduce", "reduce_scatter_tensor") and str(args[1]).lower() != "sum":
            raise self.refuse(node, f"{name} with op {args[1]}; amk dist lowers the sum")
        if name == "all_to_all_single":
            rows = args[0].shape[0] if isinstance(args[0], _V) and args[0].shape else 0
            for splits in (args[1], args[2]):
                if splits is not None and len(set(int(s) for s in splits)) > 1:
                    raise self.refuse(node, f"all_to_all_single with uneven splits {list(splits)}; amk dist "
                                            f"lowers equal splits of {rows // self.R if self.R else rows} rows")
        x = args[0]
        if not isinstance(x, _V):
            raise self.unknown(node)
        if len(self.colls) >= 1:
            k0, l0 = self.colls[0]
            raise self.refuse(node, f"{name} is a second collective in {self.func} (the first: {k0} at {l0}); "
                                    "one pattern per function: split it into one function per pattern")
        self.colls.append((name, loc))
        self.steps.append((name, loc))
        p = _Pending(name, x, loc, self.shape_of(node))
        self.pending[id(p)] = (p, node)
        return p

    # -- matmuls
    def op_matmul(self, node, args, kwargs):
        a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
        return self.matmul(node, a, b)

    def op_linear(self, node, args, kwargs):
        x = args[0]
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if bias is not None:
            raise self.refuse(node, "torch.nn.functional.linear with a bias; amk dist lowers the matmul "
                                    "without a bias (add the bias after the fused call)")
        if not isinstance(w, _V) or len(w.shape) != 2:
            raise self.outside(node, args)
        return self.matmul(node, x, self.view(w, ("permute", (1, 0)), (w.shape[1], w.shape[0])))

    def matmul(self, node, a, b):
        if not isinstance(a, _V) or not isinstance(b, _V):
            raise self.outside(node, [a, b])
        for v in (a, b):
            if len(v.shape) != 2:
                raise self.refuse(node, f"matmul of a {len(v.shape)}-D tensor ({_describe(v)}, shape "
                                        f"{list(v.shape)}); amk dist lowers 2-D [rows, K] @ [K, N]")
        loc = _node_where(node, self.func_where)
        if self.matmuls:
            raise self.refuse(node, f"a second matmul in {self.func} (the first at {self.matmuls[0]}); "
                                    "one pattern per function: split it into one function per pattern")
        self.matmuls.append(loc)
        self.steps.append(("matmul", loc))
        return _MatMul(a, b, loc, self.shape_of(node))

    # -- views
    def view(self, v: _V, step: tuple[str, tuple[int, ...]], shape: tuple[int, ...]) -> _V:
        kind, arg = step
        if kind == "permute" and arg == tuple(range(len(arg))):
            return v
        if kind == "reshape" and tuple(shape) == tuple(v.shape):
            return v
        base, steps = (v.base, list(v.steps)) if isinstance(v, _View) else (v, [])
        if steps and steps[-1][0] == kind == "reshape":
            steps[-1] = step
        elif steps and steps[-1][0] == kind == "permute":
            p = steps[-1][1]
            steps[-1] = ("permute", tuple(p[i] for i in arg))
            if steps[-1][1] == tuple(range(len(arg))):
                steps.pop()
        else:
            steps.append(step)
        if not steps or (len(steps) == 1 and steps[0][0] == "reshape" and tuple(shape) == tuple(base.shape)):
            return base
        return _View(base, tuple(steps), tuple(shape))

    def _tensor_arg(self, node, args):
        if not args or not isinstance(args[0], _V):
            raise self.outside(node, args)
        return args[0]

    def op_reshape(self, node, args, kwargs):
        v = self._tensor_arg(node, args)
        return self.view(v, ("reshape", self.shape_of(node)), self.shape_of(node))

    op_flatten = op_reshape

    def op_permute(self, node, args, kwargs):
        v = self._tensor_arg(node, args)
        dims = args[1:] if len(args) > 2 or (len(args) == 2 and isinstance(args[1], int)) else \
            (args[1] if len(args) > 1 else kwargs.get("dims"))
        n = len(v.shape)
        return self.view(v, ("permute", tuple(int(d) % n for d in dims)), self.shape_of(node))

    def op_transpose(self, node, args, kwargs):
        v = self._tensor_arg(node, args)
        n = len(v.shape)
        d0 = int(args[1] if len(args) > 1 else kwargs["dim0"]) % n
        d1 = int(args[2] if len(args) > 2 else kwargs["dim1"]) % n
        perm = list(range(n))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return self.view(v, ("permute", tuple(perm)), self.shape_of(node))

    def op_t(self, node, args, kwargs):
        v = self._tensor_arg(node, args)
        if len(v.shape) < 2:
            return v
        return self.view(v, ("permute", (1, 0)), self.shape_of(node))

    def op_getattr(self, node, args, kwargs):
        v = self._tensor_arg(node, args)
        attr = args[1] if len(args) > 1 else None
        n = len(v.shape)
        if attr == "T":
            return self.view(v, ("permute", tuple(reversed(range(n)))), self.shape_of(node))
        if attr == "mT" and n >= 2:
            return self.view(v, ("permute", tuple(range(n - 2)) + (n - 1, n - 2)), self.shape_of(node))
        raise self.refuse(node, f"Tensor.{attr} is not an op amk dist lowers ({KNOWN})")

    def op_same(self, node, args, kwargs):
        return self._tensor_arg(node, args)

    def op_cast(self, node, args, kwargs):
        v = self._tensor_arg(node, args)
        for a in itertools.chain(args[1:], kwargs.values()):
            if isinstance(a, torch.dtype) and a not in _FLOATS:
                raise self.refuse(node, f"a cast to {a}; amk dist lowers float tensors only")
        return v

    def op_alloc(self, node, args, kwargs):
        return _Alloc(self.shape_of(node))

    def op_copy_(self, node, args, kwargs):
        dst, src = args[0], args[1]
        if not isinstance(dst, _V) or not isinstance(src, _V):
            raise self.outside(node, args)
        if isinstance(dst, _Input):
            raise self.refuse(node, f"{self.func} writes into its parameter {dst.param}; amk dist lowers "
                                    "functions that return their result")
        if isinstance(dst, _View):
            raise self.refuse(node, f"writes into a view of {_describe(dst.base)}; amk dist lowers "
                                    "collectives into whole tensors")
        if tuple(dst.shape) != tuple(src.shape):
            raise self.refuse(node, f"copies a {list(src.shape)} tensor into a {list(dst.shape)} one")
        self.vals[node.args[0]] = src  # the destination holds the value from here on
        return src

    # -- RMSNorm
    def op_pow(self, node, args, kwargs):
        v, e = args[0], args[1] if len(args) > 1 else kwargs.get("exponent")
        if isinstance(v, _V) and not isinstance(v, _Norm) and e == 2:
            return _Norm("sq", v, _node_where(node, self.func_where), self.shape_of(node))
        raise self.outside(node, args)

    def op_mean(self, node, args, kwargs):
        v = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if isinstance(v, _Norm) and v.stage == "sq":
            n = len(v.shape)
            if not isinstance(dim, int) or dim % n != n - 1 or not keep:
                raise self.refuse(node, f"the mean of an RMSNorm over dim={dim}, keepdim={keep}; amk dist "
                                        "lowers the mean over the last dim with keepdim=True")
            return _Norm("ms", v.v, v.loc, self.shape_of(node))
        raise self.outside(node, args)

    def op_add(self, node, args, kwargs):
        a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(b, _Norm) and isinstance(a, (int, float)):
            a, b = b, a
        if isinstance(a, _Norm) and a.stage == "ms" and isinstance(b, (int, float)) and "alpha" not in kwargs:
            return _Norm("mse", a.v, a.loc, self.shape_of(node), eps=float(b))
        raise self.outside(node, args)

    def op_rsqrt(self, node, args, kwargs):
        v = args[0]
        if isinstance(v, _Norm) and v.stage == "mse":
            return _Norm("inv", v.v, v.loc, self.shape_of(node), eps=v.eps)
        raise self.outside(node, args)

    def op_sqrt(self, node, args, kwargs):
        v = args[0]
        if isinstance(v, _Norm) and v.stage == "mse":
            return _Norm("rms", v.v, v.loc, self.shape_of(node), eps=v.eps)
        raise self.outside(node, args)

    def op_div(self, node, args, kwargs):
        a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(b, _Norm) and b.stage == "rms" and a is b.v and "rounding_mode" not in kwargs:
            return _Norm("normed", a, b.loc, self.shape_of(node), eps=b.eps)
        raise self.outside(node, args)

    def op_mul(self, node, args, kwargs):
        a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(a, _V) and a is b and not isinstance(a, _Norm):
            return _Norm("sq", a, _node_where(node, self.func_where), self.shape_of(node))
        for u, v in ((a, b), (b, a)):
            if isinstance(v, _Norm) and v.stage == "inv" and u is v.v:
                return _Norm("normed", u, v.loc, self.shape_of(node), eps=v.eps)
            if isinstance(v, _Norm) and v.stage == "normed" and isinstance(u, _Input):
                if tuple(u.shape) != (v.shape[-1],):
                    raise self.refuse(node, f"the RMSNorm weight {u.param} has shape {list(u.shape)}, "
                                            f"expected [{v.shape[-1]}]")
                return _Norm("rmsnorm", v.v, v.loc, self.shape_of(node), eps=v.eps, g=u)
        raise self.outside(node, args)

    def op_rms_norm(self, node, args, kwargs):
        names = ("input", "normalized_shape", "weight", "eps")
        a = dict(zip(names, args))
        a.update(kwargs)
        v, shape, g, eps = a.get("input"), a.get("normalized_shape"), a.get("weight"), a.get("eps")
        if not isinstance(v, _V) or isinstance(v, _Norm):
            raise self.outside(node, args)
        if tuple(shape) != (v.shape[-1],):
            raise self.refuse(node, f"rms_norm over the trailing dims {list(shape)}; amk dist lowers "
                                    f"the norm over the last dim ([{v.shape[-1]}])")
        if not isinstance(g, _Input):
            raise self.refuse(node, "rms_norm without a weight parameter; amk dist lowers RMSNorm(y) * g "
                                    "with g a parameter of the function")
        if tuple(g.shape) != (v.shape[-1],):
            raise self.refuse(node, f"the RMSNorm weight {g.param} has shape {list(g.shape)}, "
                                    f"expected [{v.shape[-1]}]")
        if eps is None:
            ev = node.args[0].meta.get("example_value")
            eps = torch.finfo(ev.dtype if isinstance(ev, torch.Tensor) else torch.float32).eps
        loc = _node_where(node, self.func_where)
        return _Norm("rmsnorm", v, loc, self.shape_of(node), eps=float(eps), g=g)


def _raise(err: Exception):
    raise err


def _flatten(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


def _groups() -> dict[str, list[int]]:
    """Global ranks of every process group of the current default world, by group name."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    out = {}
    if dist.is_available() and dist.is_initialized():
        for pg, name in list(c10d._world.pg_names.items()):
            with contextlib.suppress(Exception):
                out[str(name)] = dist.get_process_group_ranks(pg)
    return out


def _group_text(name: Any, known: dict[str, list[int]]) -> str:
    ranks = known.get(str(name))
    return f"ranks {ranks}" if ranks is not None else f"group {str(name)!r}"


# ----------------------------------------------------------------------------- matching
def _weight(e: _Eval, node: Any, b: _V, what: str) -> tuple[_Input, bool]:
    """The weight operand: a parameter, or its 2-D transpose."""
    if isinstance(b, _Input) and len(b.shape) == 2:
        return b, False
    if isinstance(b, _View) and isinstance(b.base, _Input) and b.steps == (("permute", (1, 0)),):
        return b.base, True
    raise e.refuse(node, f"the right operand of the matmul of {what} is {_describe(b)}; amk dist lowers a weight "
                         "that is a parameter of the function (or its transpose)")


def _left(e: _Eval, node: Any, a: _V, what: str) -> _Input:
    if isinstance(a, _Input) and len(a.shape) == 2:
        return a
    raise e.refuse(node, f"{what} is applied to {_describe(a)}; amk dist lowers it on a 2-D parameter of the function")


def _match(e: _Eval, out: _V, out_node: Any, world: int, dtype: str) -> tuple[Pattern, dict[str, Operand]]:
    R = world
    norm = None
    v = out
    if isinstance(v, _Input):
        raise AmkError(f"{e.func_where}: {e.func} returns its parameter {v.param}; amk dist lowers a function "
                       "that returns its result")
    if isinstance(v, _Norm):
        if v.stage != "rmsnorm":
            raise e.refuse(out_node, f"{e.func} returns {_describe(v)}, an incomplete RMSNorm; amk dist lowers "
                                     "RMSNorm(y) * g (HF's form or torch.nn.functional.rms_norm with a weight)")
        norm, v = v, v.v
    if not e.colls:
        raise AmkError(f"{e.func_where}: {e.func} has no collective; amk dist lowers one of: {PATTERNS_TEXT}")
    if isinstance(v, _Coll) and v.kind == "all_reduce" and isinstance(v.arg, _MatMul):
        mm = v.arg
        x = _left(e, out_node, mm.a, "the matmul before all_reduce")
        w, tr = _weight(e, out_node, mm.b, "x @ w before all_reduce")
        ops = {"x": Operand(x.param), "w": Operand(w.param, tr)}
        kw = {}
        if norm is not None:
            ops["g"] = Operand(norm.g.param)
            kw = dict(norm=True, eps=norm.eps)
        pat = MatmulAllReduce(world=R, dtype=dtype, m=x.shape[0], k=x.shape[1], n=mm.shape[1], **kw)
        return pat, ops
    if norm is not None:
        raise e.refuse(out_node, f"{e.func} applies RMSNorm to {_describe(v)}; amk dist lowers RMSNorm only "
                                 "after matmul -> all_reduce")
    if isinstance(v, _Coll) and v.kind == "reduce_scatter_tensor" and isinstance(v.arg, _MatMul):
        mm = v.arg
        x = _left(e, out_node, mm.a, "the matmul before reduce_scatter_tensor")
        w, tr = _weight(e, out_node, mm.b, "x @ w before reduce_scatter_tensor")
        pat = MatmulReduceScatter(world=R, dtype=dtype, m=x.shape[0], k=x.shape[1], n=mm.shape[1])
        return pat, {"x": Operand(x.param), "w": Operand(w.param, tr)}
    if isinstance(v, _MatMul) and isinstance(v.a, _Coll) and v.a.kind == "all_gather_into_tensor":
        x = _left(e, out_node, v.a.arg, "all_gather_into_tensor")
        w, tr = _weight(e, out_node, v.b, "all_gather(x) @ w")
        pat = AllGatherMatmul(world=R, dtype=dtype, m=x.shape[0] * R, k=x.shape[1], n=v.shape[1])
        return pat, {"x": Operand(x.param), "w": Operand(w.param, tr)}
    if isinstance(v, _MatMul) and isinstance(v.a, _View) and isinstance(v.a.base, _Coll) \
            and v.a.base.kind == "all_to_all_single":
        o = _left(e, out_node, v.a.base.arg, "all_to_all_single")
        S, C = o.shape
        want = (("reshape", (R, S // R, C)), ("permute", (1, 0, 2)), ("reshape", (S // R, R * C)))
        if v.a.steps != want:
            got = " -> ".join(f"{k}{tuple(a)}" for k, a in v.a.steps)
            raise e.refuse(out_node, f"the all_to_all_single result is laid out as {got}; amk dist lowers the "
                                     f"Ulysses layout reshape({R}, {S // R}, {C}).permute(1, 0, 2)"
                                     f".reshape({S // R}, {R * C}) before the matmul")
        w, tr = _weight(e, out_node, v.b, "the Ulysses combine")
        pat = UlyssesCombine(world=R, dtype=dtype, s=S, c=C, n=v.shape[1])
        return pat, {"o": Operand(o.param), "w": Operand(w.param, tr)}
    raise AmkError(f"{e.func_where}: {e.func} computes {_describe(out)}, which is not one of the patterns amk "
                   f"dist lowers: {PATTERNS_TEXT}")


# ----------------------------------------------------------------------------- capture
class _Stop(Exception):
    """Raised by the collected graph instead of running it."""


def _dynamo_reason(err: BaseException) -> str:
    """One line of dynamo's reason for a failed capture."""
    text = str(err)
    m = re.search(r"raised exception (\w+\(.*\))\s*$", text, re.M)
    if m:
        return m.group(1)
    m = re.search(r"got (\w+Error\(.*\))\s*$", text, re.M)
    if m:
        return m.group(1)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    head = lines[0] if lines else type(err).__name__
    expl = next((ln[len("Explanation:"):].strip() for ln in lines if ln.startswith("Explanation:")), "")
    return f"{head}: {expl}" if expl and expl not in head else head


def _err_frames(err: BaseException) -> list[tuple[str, int]]:
    stack = getattr(err, "real_stack", None) or []
    frames = [(f.filename, f.lineno) for f in stack if getattr(f, "filename", None)]
    if not frames:
        frames = [(p, int(n)) for p, n in _FRAME.findall(str(err))]
    return frames


def _parse_shapes(fn_name: str, sig: inspect.Signature,
                  shapes: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    params = sig.parameters
    for p in params.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise AmkError(f"{fn_name}: *{p.name} parameters are not supported; name each tensor parameter")
    for name in shapes:
        if name not in params:
            raise AmkError(f"shape for {name}: {fn_name} has no parameter {name} "
                           f"(its parameters: {', '.join(params) or 'none'})")
    out, consts = {}, {}
    for name, p in params.items():
        if name in shapes:
            dims = shapes[name]
            try:
                dims = tuple(int(d) for d in dims)
            except (TypeError, ValueError):
                raise AmkError(f"shape of {name} must be a tuple of integers, got {dims!r}") from None
            if not dims or any(d < 1 for d in dims):
                raise AmkError(f"shape of {name} must have dimensions >= 1, got {list(dims)}")
            out[name] = dims
        elif p.default is not p.empty:
            consts[name] = p.default
        else:
            raise AmkError(f"{fn_name}: parameter {name} has no shape (give {name}=DIMS) and no default")
    return out, consts


def capture(fn: Callable, world: int, shapes: dict[str, tuple[int, ...]], dtype: str = "bf16") -> Captured:
    """Capture ``fn`` at world size ``world`` with tensor parameters of ``shapes`` (parameter
    name -> rank-local shape) and element type ``dtype`` (``bf16``, ``f16``, ``f32``), and
    recognise its pattern (module docstring).

    Parameters not in ``shapes`` must have defaults; they are captured as constants
    (``Captured.constants``). Returns a ``Captured``. Raises AmkError (exit code 2, one line
    naming file:line) for anything that is not exactly one of the four patterns.
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise AmkError(f"world size must be an integer >= 1, got {world!r}")
    if dtype not in DTYPES:
        raise AmkError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(fn, types.FunctionType):
        raise AmkError(f"amk dist captures a Python function; got {type(fn).__name__}")
    name = fn.__qualname__
    code = fn.__code__
    func_where = where(code.co_filename, code.co_firstlineno)
    sig = inspect.signature(fn)
    dims, consts = _parse_shapes(name, sig, shapes)

    # A copy with a fresh code object: dynamo caches compiled frames on the code object, and
    # a cached frame would run (and skip the collector) when the same shapes come again.
    fresh = types.FunctionType(code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    fresh.__kwdefaults__ = fn.__kwdefaults__
    got: list[Any] = []
    produced: list[torch.Tensor] = []

    def collector(gm, example_inputs):
        # dynamo drops the placeholders' sources once compiled: keep them now
        sources = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                src = getattr(n.meta.get("grapharg"), "source", None)
                local = getattr(src, "local_name", None) if getattr(src, "is_input", False) else None
                shown = getattr(src, "name", n.target)
                sources[n.name] = (local, str(shown() if callable(shown) else shown))
        got.append((gm, sources))
        out_args = [a for n in gm.graph.nodes if n.op == "output" for a in _flatten(n.args[0])]

        def run_empty(*args):
            # the graph's outputs as uninitialised tensors of their shapes: the function then
            # returns, and what it returns shows which graph output (if any) its result is
            outs = []
            for a in out_args:
                ev = getattr(a, "meta", {}).get("example_value")
                if not isinstance(ev, torch.Tensor):
                    raise _Stop()
                outs.append(torch.empty(ev.shape, dtype=ev.dtype))
            produced[:] = outs
            return outs

        return run_empty

    import torch._dynamo

    compiled = torch.compile(fresh, backend=collector, fullgraph=True, dynamic=False)
    dt = DTYPES[dtype]
    tensors = {k: torch.empty(v, dtype=dt) for k, v in dims.items()}  # no pages touched
    ba = sig.bind_partial(**tensors)
    outer = _groups()  # a caller's own groups (a subgroup refusal names their ranks)
    with fake_process_group(world) as pg:
        result: Any = _Stop
        try:
            result = compiled(*ba.args, **ba.kwargs)
        except _Stop:
            pass
        except AmkError:
            raise
        except torch._dynamo.exc.TorchDynamoException as err:
            raise _capture_error(err, name, func_where, world, dims) from None
        except Exception as err:  # an error of the user's code while tracing (dynamo re-raises it)
            raise _capture_error(err, name, func_where, world, dims) from None
        if not got:
            raise AmkError(f"{func_where}: {name} runs no torch op that torch.compile captures; amk dist "
                           f"lowers one of: {PATTERNS_TEXT}")
        index = None
        if result is not _Stop:
            if not isinstance(result, torch.Tensor):
                shown = "None" if result is None else f"a {type(result).__name__}"
                raise AmkError(f"{func_where}: {name} returns {shown}; amk dist lowers a function that returns "
                               "one tensor")
            index = next((i for i, t in enumerate(produced) if t is result), None)
            if index is None:
                raise AmkError(f"{func_where}: {name} returns a tensor it does not compute (one of its "
                               "parameters); amk dist lowers a function that returns its result")
        e = _Eval(got[0][0], got[0][1], name, func_where, world, str(pg.group_name), dims)
        e.groups = {**outer, **_groups()}
        out, out_node = e.run(index)
        pattern, operands = _match(e, out, out_node, world, dtype)
    pattern.check()
    return Captured(pattern=pattern, operands=operands, signature=sig, name=name, where=func_where,
                    shapes=dims, constants=consts, out_dtype=e.out_dtype or dt, steps=tuple(e.steps))


def _capture_error(err: BaseException, name: str, func_where: str, world: int,
                   dims: dict[str, tuple[int, ...]]) -> AmkError:
    frames = _err_frames(err)
    loc = _user_frame(frames) or func_where
    reason = _dynamo_reason(err)
    if "async_op=True" in reason:
        return AmkError(f"{loc}: async_op=True: torch.compile cannot capture an asynchronous collective "
                        "(graph break); call it synchronously (without async_op and wait())")
    in_collective = any(p.endswith("_functional_collectives.py") for p, _ in frames)
    if in_collective:
        bad = [f"{k} {list(v)}" for k, v in dims.items() if v and v[0] % world]
        if bad:
            return AmkError(f"{loc}: the collective needs dimension 0 divisible by the world size {world}: "
                            f"{', '.join(bad)} ({reason})")
    import torch._dynamo

    if isinstance(err, torch._dynamo.exc.TorchDynamoException):
        return AmkError(f"{loc}: torch.compile cannot capture {name} in one graph (graph break): {reason}")
    return AmkError(f"{loc}: {name} failed while being captured: {type(err).__name__}: {err}".splitlines()[0])
