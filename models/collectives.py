"""Communication + compute patterns of tensor- and sequence-parallel layers, and their math.

A pattern is what ``amk dist`` recognises in a user's function written with torch ops and
torch.distributed collectives (models/capture.py) and what the lowering turns into one
schedule (lowering/collectives.py). Each pattern here is a frozen dataclass of *global*
shapes plus the world size R; ``operands()`` gives every rank's input shapes and
``reference()`` computes every rank's output from all ranks' inputs in torch (fp32
accumulation, rounded to the output dtype), the math the original function computes over a
process group. Shapes follow torch: activations row-major ``[rows, features]``, the weight
``w`` of ``x @ w`` is ``[K, N]``.

===================  ========================================  ==============================
pattern              rank r's inputs                           rank r's output
===================  ========================================  ==============================
AllGatherMatmul      x [M/R, K], w [K, N]                       all_gather(x) @ w   [M, N]
MatmulReduceScatter  x [M, K], w [K, N]                         reduce_scatter(x @ w) [M/R, N]
                                                                (sum; rank r keeps rows
                                                                r*M/R .. (r+1)*M/R - 1)
MatmulAllReduce      x [M, K], w [K, N] (+ g [N] with norm)     all_reduce(x @ w) [M, N], then
                                                                RMSNorm(. ) * g when ``norm``
UlyssesCombine       o [S, C] (the full sequence, the rank's     a2a(o) @ w         [S/R, N]
                     C = H/R * D head columns), w [R*C, N]
===================  ========================================  ==============================

``UlyssesCombine`` is the output side of Ulysses sequence parallelism (DeepSpeed-Ulysses,
Jacobs et al. 2023): ``all_to_all_single`` sends rows ``j*S/R .. (j+1)*S/R - 1`` of rank r's
attention output to rank j, which lays the R pieces side by side (rank r's at columns
``r*C .. (r+1)*C - 1``: ``out.reshape(R, S/R, C).permute(1, 0, 2).reshape(S/R, R*C)``) and
applies the output projection.

RMSNorm is HF Llama's: ``y / sqrt(mean(y^2) + eps) * g`` over each row, in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ground.errors import AmkError

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _divides(name: str, value: int, world: int) -> None:
    if value % world:
        raise AmkError(f"{name}={value} is not divisible by the world size {world}")


@dataclass(frozen=True)
class Pattern:
    """Base of the patterns: the world size and the element dtype (``bf16``, ``f16``, ``f32``)."""

    world: int
    dtype: str

    kind = "pattern"

    def check(self) -> "Pattern":
        """Return self, or raise AmkError (exit code 2) naming the dimension that does not fit."""
        if self.world < 1:
            raise AmkError(f"world size {self.world} must be >= 1")
        if self.dtype not in DTYPES:
            raise AmkError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name, value in self.dims().items():
            if value < 1:
                raise AmkError(f"{name}={value} must be >= 1")
        self._check()
        return self

    def dims(self) -> dict[str, int]:
        """The pattern's global dimensions by name."""
        raise NotImplementedError

    def _check(self) -> None:
        pass

    def operands(self) -> dict[str, tuple[int, ...]]:
        """Rank-local input shapes by operand name (the same on every rank)."""
        raise NotImplementedError

    def output_shape(self) -> tuple[int, ...]:
        """Rank-local output shape."""
        raise NotImplementedError

    def reference(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Every rank's output from every rank's inputs (``inputs[r][name]``), in torch.

        Accumulates in fp32 and rounds once to ``dtype``. Raises AmkError when the number of
        ranks or an operand's shape differs from ``operands()``.
        """
        if len(inputs) != self.world:
            raise AmkError(f"{self.kind}: {len(inputs)} ranks of inputs for world size {self.world}")
        want = self.operands()
        for r, ins in enumerate(inputs):
            for name, shape in want.items():
                if name not in ins:
                    raise AmkError(f"{self.kind}: rank {r} has no operand {name!r}")
                if tuple(ins[name].shape) != shape:
                    raise AmkError(f"{self.kind}: rank {r} operand {name!r} has shape "
                                   f"{tuple(ins[name].shape)}, expected {shape}")
        f32 = [{k: v.float() for k, v in ins.items()} for ins in inputs]
        dt = DTYPES[self.dtype]
        return [y.to(dt) for y in self._math(f32)]

    def _math(self, x: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        raise NotImplementedError

    def flops(self) -> int:
        """Multiply-adds x 2 of one rank's share of the pattern's GEMM."""
        raise NotImplementedError


@dataclass(frozen=True)
class AllGatherMatmul(Pattern):
    """``y = all_gather(x, dim 0) @ w``: x ``[M/R, K]`` per rank, w ``[K, N]``, y ``[M, N]``."""

    m: int = 0
    n: int = 0
    k: int = 0
    kind = "allgather_matmul"

    def dims(self):
        return {"M": self.m, "N": self.n, "K": self.k}

    def _check(self):
        _divides("M", self.m, self.world)

    def operands(self):
        return {"x": (self.m // self.world, self.k), "w": (self.k, self.n)}

    def output_shape(self):
        return (self.m, self.n)

    def _math(self, x):
        gathered = torch.cat([ins["x"] for ins in x], dim=0)
        return [gathered @ ins["w"] for ins in x]

    def flops(self):
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class MatmulReduceScatter(Pattern):
    """``y = reduce_scatter(x @ w, sum, dim 0)``: x ``[M, K]``, w ``[K, N]``, y ``[M/R, N]``."""

    m: int = 0
    n: int = 0
    k: int = 0
    kind = "matmul_reduce_scatter"

    def dims(self):
        return {"M": self.m, "N": self.n, "K": self.k}

    def _check(self):
        _divides("M", self.m, self.world)

    def operands(self):
        return {"x": (self.m, self.k), "w": (self.k, self.n)}

    def output_shape(self):
        return (self.m // self.world, self.n)

    def _math(self, x):
        total = sum(ins["x"] @ ins["w"] for ins in x)
        rows = self.m // self.world
        return [total[r * rows:(r + 1) * rows] for r in range(self.world)]

    def flops(self):
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class MatmulAllReduce(Pattern):
    """``y = all_reduce(x @ w, sum)`` (then ``RMSNorm(y) * g`` when ``norm``): x ``[M, K]``,
    w ``[K, N]``, g ``[N]``, y ``[M, N]``."""

    m: int = 0
    n: int = 0
    k: int = 0
    norm: bool = False
    eps: float = 1e-6
    kind = "matmul_allreduce"

    def dims(self):
        return {"M": self.m, "N": self.n, "K": self.k}

    def _check(self):
        if self.norm and not self.eps > 0:
            raise AmkError(f"RMSNorm eps={self.eps} must be > 0")

    def operands(self):
        ops = {"x": (self.m, self.k), "w": (self.k, self.n)}
        if self.norm:
            ops["g"] = (self.n,)
        return ops

    def output_shape(self):
        return (self.m, self.n)

    def _math(self, x):
        total = sum(ins["x"] @ ins["w"] for ins in x)
        if self.norm:
            # HF rounds the sum to the activation dtype before the norm (as the all-reduce does)
            total = total.to(DTYPES[self.dtype]).float()
            total = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + self.eps)
            return [total * ins["g"] for ins in x]
        return [total for _ in x]

    def flops(self):
        return 2 * self.m * self.n * self.k


@dataclass(frozen=True)
class UlyssesCombine(Pattern):
    """``y = a2a(o) @ w``: o ``[S, C]`` per rank (C = its heads' columns), w ``[R*C, N]``,
    y ``[S/R, N]`` (module doc)."""

    s: int = 0
    c: int = 0
    n: int = 0
    kind = "ulysses_combine"

    def dims(self):
        return {"S": self.s, "C": self.c, "N": self.n}

    def _check(self):
        _divides("S", self.s, self.world)

    def operands(self):
        return {"o": (self.s, self.c), "w": (self.world * self.c, self.n)}

    def output_shape(self):
        return (self.s // self.world, self.n)

    def _math(self, x):
        rows = self.s // self.world
        out = []
        for j, ins in enumerate(x):
            pieces = torch.cat([src["o"][j * rows:(j + 1) * rows] for src in x], dim=1)
            out.append(pieces @ ins["w"])
        return out

    def flops(self):
        return 2 * (self.s // self.world) * self.world * self.c * self.n


PATTERNS: dict[str, type[Pattern]] = {p.kind: p for p in
                                      (AllGatherMatmul, MatmulReduceScatter, MatmulAllReduce, UlyssesCombine)}
