"""The op set of the schedule IR: arity, operand dtypes, params, and shape rules.

Every backend (``sim`` in lowering/sim.py, ``triton`` in lowering/triton/) implements
exactly these semantics; the validator checks programs against these specs. Operand
shapes are compared after *squeezing* axes of extent 1, so ``q[2:3, 0:64]`` (one head of a
``[9, 64]`` buffer) has shape ``(64,)``.

Op semantics (x, y are operands in the order of ``ins`` / ``outs``; fp32 accumulation):

==============  ==============================================================================
op              meaning
==============  ==============================================================================
embed           y[:] = table[token[0], :]                      ins (table[V,H], token[1] i32)
rmsnorm         y = x / sqrt(mean(x^2 over each group of ``dim``) + eps) * w   (w has ``dim``)
gemv            y = W @ x (+ bias)                             ins (x[K], W[N,K], bias[N]?)
rope            rotate-half RoPE (HF Llama convention) of each ``head_dim`` slice of x at
                position pos[0] with frequencies inv_freq[head_dim/2] (fp32)
kv_append       kc[:, pos, :] = k ; vc[:, pos, :] = v           outs (kc[G,S,D], vc[G,S,D])
attention       decode GQA: o[h] = softmax(q[h] . kc[h//(Hq/G), :pos+1]^T * scale) @ vc[...]
silu_mul        y = silu(g) * u
add             y = a + b
reduce          y = sum_k P[k, :] (+ residual)                 ins (P[k,N], residual[N]?)
                (P may be any region [k, ...] whose trailing axes hold N = numel(y)
                elements, e.g. partials [k, rows, C] summed into y [rows, C])
argmax          y = (max(x), offset + first argmax(x)) as two fp32
argmax_combine  token[0] = index of the pair with the largest value (lowest index on ties)
norm_gemv       y = W @ (x / sqrt(mean(x^2) + eps) * norm_w) (+ bias): RMSNorm fused into
                the GEMV prologue (every tile recomputes the norm of the whole x)
                                                               ins (x[K], norm_w[K], W[N,K], bias[N]?)
gemv_res        y = W @ x + r: the residual add fused into the epilogue
                                                               ins (x[K], W[N,K], r[N])
swiglu_gemv     y = W @ (silu(g) * u) (+ r): SiLU*mul fused into the prologue
                                                               ins (g[K], u[K], W[N,K], r[N]?)
reduce_norm_gemv
                y = W @ rmsnorm(h) (+ bias), h = sum_k P[k, :] + r rounded to r's dtype:
                an all-reduce's final sum (``reduce`` with a residual) fused into the
                prologue of norm_gemv, so the consuming GEMV tiles read the partials
                instead of waiting for a reduce stage    ins (P[k,K], r[K], norm_w[K], W[N,K], bias[N]?)
rope_append     kc[:, pos, :] = rope(k) ; vc[:, pos, :] = v    ins (k, v, inv_freq, pos)
rope_attention  attention (as above) of rope(q) at pos          ins (q, kc, vc, pos, inv_freq)
rope_attention_kv
                rope_attention whose position pos takes its key and value from the current
                token's k and v (rope(k) and v, each rounded to its cache's dtype, exactly
                what rope_append writes there) instead of the caches, which it reads at
                0 .. pos-1 only; the cache append may then run after the attention
                                                               ins (q, k, v, kc, vc, pos, inv_freq)
attention_combine
                o[h] = sum_c e^(m_c,h - M_h) acc_c,h / sum_c e^(m_c,h - M_h) l_c,h with
                M_h = max_c m_c,h: the ``parts`` partial records of split-KV attention
                (see "Split-KV attention") merged     ins (p[parts, Hq, head_dim+2] f32)
gemm            y = a @ b (+ r)                                ins (a[M,K], b[K,N], r[M,N]?)
                                                               outs (y[M,N])
copy            y = x (dtype cast between float dtypes allowed)
put             dst (a symmetric buffer, usually on another rank) = src, same dtype
quiet           complete every pending put of this worker (nvshmem_quiet)
fence           order this worker's earlier puts before its later ones, per destination
                rank (nvshmem_fence)
nop             no data; carries waits and signals (credits, barriers)
==============  ==============================================================================

**Mirror outputs.** The GEMV family (gemv, norm_gemv, gemv_res, swiglu_gemv, reduce_norm_gemv) may list up to
``MAX_MIRRORS`` more outputs after y: each receives a copy of y, so it must have y's shape
and dtype. A mirror is a region of a symmetric buffer on another rank (usually y's own
region there): the peer stores of a one-shot all-reduce fused into the GEMV tile that
computes the partial (``LoweringConfig.allreduce = "fused"``). The validator treats a
mirror like a put's destination: a remote write that its consumer may read only after a
wait that includes the task's own signal to that rank (put-with-signal).

**Quantized weights.** The weight ``W`` of a GEMV-family op may be ``i8`` or ``f8e4m3``
(``QUANT_DTYPES``): the task then carries one more input after all the others, the weight's
per-row scales ``scale[N]`` (f32), and computes ``y = scale * (W @ x)`` (W converted to fp32,
the scale applied once per row after the dot product) and then the op's bias / residual. An
``i8`` weight may instead carry one scale per group of G consecutive K elements of a row,
``scale[N, K / G]`` (a 2-D region; G >= 2 divides K; one group is a row), and computes
``y[n] = sum_g scale[n, g] * (W[n, gG:(g+1)G] @ x[gG:(g+1)G])`` (GGUF's Q8_0: G = 32). An
``i8`` weight's scales may be f16. A weight of a float dtype takes no scale. ``OpSpec.scaled``
marks these ops; ``scale_index`` says whether a task has the scale operand.

**Split-KV attention.** ``attention``, ``rope_attention`` and ``rope_attention_kv`` take the
optional params ``parts`` (P >= 1) and ``part`` (0 <= c < P), flash-decoding's split of the
positions over several tasks (Dao et al., "Flash-Decoding for long-context inference", 2023).
With P >= 2 the task attends to positions ``[floor(c n / P), floor((c + 1) n / P))`` of the
``n = pos + 1`` positions only, and its output is not o but one f32 *partial record* of
``head_dim + 2`` elements per query head: ``(sum_t e^(s_t - m) v_t, m, sum_t e^(s_t - m))``
over its positions t, with ``s_t`` the scaled score and ``m`` the largest of them; a part with
no position (n < P) writes ``(0, -inf, 0)``. ``attention_combine`` merges the P records of
each head into o (param ``parts``). P = 1 is the unsplit op.

**gemm shapes.** A ``gemm`` operand is a row-major region like any other (a row block of an
``[M, K]`` buffer, a column block ``w[0:K, c0:c1]`` of a weight, ...), and its check sees
squeezed shapes, so an ``[M, K]`` tile with M == 1 arrives as ``(K,)`` and a ``[K, N]`` one
with N == 1 as ``(K,)``. The element counts fix the dimensions (``gemm_dims``):
``numel(a) * numel(b) / numel(y) = K^2``, then ``M = numel(a) / K`` and ``N = numel(b) / K``;
the check then requires the squeezed shapes of a, b, r and y to be those of ``[M, K]``,
``[K, N]``, ``[M, N]`` and ``[M, N]`` (so a transposed operand is refused, naming it). When
a and b are both 2-D after squeezing, no axis was dropped and they give M, K, N directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ir.program import FLOAT_DTYPES, QUANT_DTYPES

Shape = tuple[int, ...]


def squeeze(shape: Shape) -> Shape:
    """Drop axes of extent 1: ``(1, 64) -> (64,)``, ``(1, 1) -> ()``."""
    return tuple(d for d in shape if d != 1)


def numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# A check receives squeezed operand shapes, dtypes and params and returns problems.
CheckFn = Callable[[list[Shape], list[str], list[Shape], list[str], dict], list[str]]


@dataclass(frozen=True)
class OpSpec:
    """Declaration of one IR op.

    ``ins`` / ``outs``: operand role names in order; ``optional_ins``: roles that may
    follow ``ins``. ``in_dtypes`` / ``out_dtypes``: per role, the allowed dtypes.
    ``params``: required param names and their Python types; ``optional_params`` likewise.
    ``kind``: ``compute``, ``comm`` (moves data between ranks) or ``sync`` (no data).
    ``backends``: backends that implement the op. ``mirrors``: how many mirror outputs
    (copies of the first output, see the module doc) a task may add after ``outs``.
    ``scaled``: the op's ``w`` operand may be quantized (``QUANT_DTYPES``), with its per-row
    scales as one more, last, input (module doc, "Quantized weights"); ``max_ins`` counts
    the inputs without it, ``max_ins_all`` with it.
    """

    name: str
    kind: str
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    in_dtypes: tuple[tuple[str, ...], ...]
    out_dtypes: tuple[tuple[str, ...], ...]
    optional_ins: tuple[str, ...] = ()
    optional_in_dtypes: tuple[tuple[str, ...], ...] = ()
    params: dict[str, type] = field(default_factory=dict)
    optional_params: dict[str, type] = field(default_factory=dict)
    check: CheckFn | None = None
    backends: frozenset[str] = frozenset({"sim", "triton"})
    mirrors: int = 0
    scaled: bool = False

    @property
    def min_outs(self) -> int:
        return len(self.outs)

    @property
    def max_outs(self) -> int:
        return len(self.outs) + self.mirrors

    def dtypes_for_out(self, i: int) -> tuple[str, ...]:
        """Allowed dtypes of output ``i`` (a mirror output: those of the first output)."""
        return self.out_dtypes[i] if i < len(self.outs) else self.out_dtypes[0]

    def arity_ok(self, n_ins: int, n_outs: int) -> bool:
        """Whether a task with ``n_ins`` inputs and ``n_outs`` outputs fits this op (a scaled
        op's inputs may include the scale operand; its check says whether they must)."""
        return self.min_ins <= n_ins <= self.max_ins_all and self.min_outs <= n_outs <= self.max_outs

    def arity_text(self) -> str:
        """'2-3 inputs and 1 output' / '... and 1-8 outputs' (for error messages)."""
        def count(lo: int, hi: int, noun: str) -> str:
            return f"{lo} {noun}{'' if lo == 1 else 's'}" if lo == hi else f"{lo}-{hi} {noun}s"

        return (f"{count(self.min_ins, self.max_ins_all, 'input')} and "
                f"{count(self.min_outs, self.max_outs, 'output')}")

    @property
    def min_ins(self) -> int:
        return len(self.ins)

    @property
    def max_ins(self) -> int:
        return len(self.ins) + len(self.optional_ins)

    @property
    def max_ins_all(self) -> int:
        """Most inputs a task may have: ``max_ins``, plus the scale of a quantized weight."""
        return self.max_ins + (1 if self.scaled else 0)

    @property
    def w_index(self) -> int | None:
        """Index of the ``w`` (weight) operand among the ins of a scaled op, else None."""
        return self.ins.index("w") if self.scaled else None

    def operand_index(self, role: str, n_ins: int) -> int:
        """Index of the required role ``role`` in a task's operands (its ``n_ins`` ins, then
        its outs). Raises ValueError for a role the op does not have."""
        if role in self.ins:
            return self.ins.index(role)
        if role in self.outs:
            return n_ins + self.outs.index(role)
        raise ValueError(f"op {self.name} has no operand {role!r}")

    def dtypes_for_in(self, i: int) -> tuple[str, ...]:
        """Allowed dtypes of input ``i`` (for a scaled op, index ``max_ins`` is the scale:
        f32; at a lower index a scale sits in an optional operand's slot, whose dtypes
        include f32, and the op's check tells it apart)."""
        if i < len(self.ins):
            return self.in_dtypes[i]
        if i - len(self.ins) < len(self.optional_in_dtypes):
            return self.optional_in_dtypes[i - len(self.ins)]
        if self.scaled and i == self.max_ins:
            return F32 + ("f16",)  # f16: an i8 weight's scales only (the op's check)
        raise IndexError(f"op {self.name} has no input {i}")


def scale_index(spec: OpSpec, in_dtypes: "list[str] | tuple[str, ...]") -> int | None:
    """Index of a task's scale operand (the last input) when ``spec`` is scaled and the task's
    weight operand has a quantized dtype (``in_dtypes``: the dtypes of its ins), else None."""
    wi = spec.w_index
    if wi is None or wi >= len(in_dtypes) or in_dtypes[wi] not in QUANT_DTYPES:
        return None
    return len(in_dtypes) - 1


F = FLOAT_DTYPES
Q = QUANT_DTYPES
I32 = ("i32",)
F32 = ("f32",)
ANY = ("bf16", "f16", "f32", "i32")


def _n(shape: Shape) -> int:
    return numel(shape)


def _check_embed(ins, ind, outs, outd, p):
    table, token = ins
    errs = []
    if len(table) != 2:
        errs.append(f"embed: table must be 2-D [vocab, hidden], got {table}")
        return errs
    if _n(token) != 1:
        errs.append(f"embed: token must hold 1 element, got shape {token}")
    if _n(outs[0]) != table[1]:
        errs.append(f"embed: output has {_n(outs[0])} elements, table rows have {table[1]}")
    return errs


def _check_rmsnorm(ins, ind, outs, outd, p):
    x, w = ins[0], ins[1]
    dim = p.get("dim")
    errs = []
    if not isinstance(dim, int) or dim <= 0:
        return [f"rmsnorm: param dim must be a positive int, got {dim!r}"]
    if _n(w) != dim:
        errs.append(f"rmsnorm: weight has {_n(w)} elements, dim={dim}")
    if _n(x) % dim:
        errs.append(f"rmsnorm: input has {_n(x)} elements, not a multiple of dim={dim}")
    if _n(outs[0]) != _n(x):
        errs.append(f"rmsnorm: output has {_n(outs[0])} elements, input {_n(x)}")
    return errs + _eps_errors("rmsnorm", p)


def _eps_errors(op: str, p) -> list[str]:
    """The RMSNorm epsilon param: a number in (0, 1)."""
    eps = p.get("eps")
    if not isinstance(eps, (int, float)) or not (0 < eps < 1):
        return [f"{op}: param eps must be in (0, 1), got {eps!r}"]
    return []


def _check_gemv(ins, ind, outs, outd, p):
    x, w = ins[0], ins[1]
    errs = []
    if len(w) == 1:  # a single output row squeezes to (K,)
        n, k = 1, w[0]
    elif len(w) == 2:
        n, k = w
    else:
        return [f"gemv: weight must be 2-D [N, K], got {w}"]
    if _n(x) != k:
        errs.append(f"gemv: input has {_n(x)} elements, weight has K={k} columns")
    if _n(outs[0]) != n:
        errs.append(f"gemv: output has {_n(outs[0])} elements, weight has N={n} rows")
    if len(ins) > 2 and _n(ins[2]) != n:
        errs.append(f"gemv: bias has {_n(ins[2])} elements, weight has N={n} rows")
    return errs


def _check_rope(ins, ind, outs, outd, p):
    x, inv_freq, pos = ins
    hd = p.get("head_dim")
    if not isinstance(hd, int) or hd <= 0 or hd % 2:
        return [f"rope: param head_dim must be a positive even int, got {hd!r}"]
    errs = []
    if _n(x) % hd:
        errs.append(f"rope: input has {_n(x)} elements, not a multiple of head_dim={hd}")
    if _n(inv_freq) != hd // 2:
        errs.append(f"rope: inv_freq has {_n(inv_freq)} elements, expected head_dim/2={hd // 2}")
    if _n(pos) != 1:
        errs.append(f"rope: pos must hold 1 element, got {pos}")
    if _n(outs[0]) != _n(x):
        errs.append(f"rope: output has {_n(outs[0])} elements, input {_n(x)}")
    return errs


def _cache_dims(shape: Shape, hd: int) -> tuple[int, int] | None:
    """(kv heads, max seq) of a squeezed cache region whose last axis is head_dim."""
    if not shape or shape[-1] != hd:
        return None
    if len(shape) == 2:
        return 1, shape[0]
    if len(shape) == 3:
        return shape[0], shape[1]
    return None


def _check_kv_append(ins, ind, outs, outd, p):
    k, v, pos = ins
    hd = p.get("head_dim")
    if not isinstance(hd, int) or hd <= 0:
        return [f"kv_append: param head_dim must be a positive int, got {hd!r}"]
    errs = []
    for name, cache, src in (("k cache", outs[0], k), ("v cache", outs[1], v)):
        dims = _cache_dims(cache, hd)
        if dims is None:
            errs.append(f"kv_append: {name} region {cache} is not [kv_heads, seq, head_dim={hd}]")
            continue
        if _n(src) != dims[0] * hd:
            errs.append(f"kv_append: {name} holds {dims[0]} heads but the source has {_n(src)} elements")
    if _n(pos) != 1:
        errs.append(f"kv_append: pos must hold 1 element, got {pos}")
    return errs


def _check_attention(ins, ind, outs, outd, p):
    q, kc, vc, pos = ins
    hd = p.get("head_dim")
    if not isinstance(hd, int) or hd <= 0:
        return [f"attention: param head_dim must be a positive int, got {hd!r}"]
    errs = []
    if _n(q) % hd:
        return [f"attention: q has {_n(q)} elements, not a multiple of head_dim={hd}"]
    hq = _n(q) // hd
    dk, dv = _cache_dims(kc, hd), _cache_dims(vc, hd)
    if dk is None or dv is None:
        return [f"attention: cache regions {kc}, {vc} are not [kv_heads, seq, head_dim={hd}]"]
    if dk != dv:
        errs.append(f"attention: k cache {kc} and v cache {vc} differ")
    g = dk[0]
    if hq % g:
        errs.append(f"attention: {hq} query heads do not split over {g} kv heads")
    errs += _split_kv_errors(p, hq, hd, _n(outs[0]), outd[0] if outd else None)
    if _kv_parts(p) == 1 and _n(outs[0]) != _n(q):
        errs.append(f"attention: output has {_n(outs[0])} elements, q has {_n(q)}")
    if _n(pos) != 1:
        errs.append(f"attention: pos must hold 1 element, got {pos}")
    sc = p.get("scale")
    if not isinstance(sc, (int, float)) or sc <= 0:
        errs.append(f"attention: param scale must be positive, got {sc!r}")
    return errs


def _kv_parts(p) -> int:
    """The ``parts`` param of an attention task (1 when absent or malformed: the check
    reports a malformed one)."""
    v = p.get("parts", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1


def _split_kv_errors(p, hq: int, hd: int, n_out: int, out_dtype: str | None) -> list[str]:
    """The split-KV params of an attention task (module doc, "Split-KV attention"): ``parts``
    >= 1, ``part`` in [0, parts) (both or neither), and with parts >= 2 an f32 output of
    hq * (head_dim + 2) elements (one partial record per query head)."""
    if "parts" not in p and "part" not in p:
        return []
    P, c = p.get("parts"), p.get("part")
    if not (isinstance(P, int) and not isinstance(P, bool) and P >= 1):
        return [f"attention: param parts must be an int >= 1, got {P!r}"]
    if not (isinstance(c, int) and not isinstance(c, bool) and 0 <= c < P):
        return [f"attention: param part must be an int in [0, {P}), got {c!r}"]
    if P == 1:
        return []
    errs = []
    if out_dtype is not None and out_dtype != "f32":
        errs.append(f"attention: a split-KV part (parts={P}) writes f32 partial records, the output is {out_dtype}")
    if n_out != hq * (hd + 2):
        errs.append(f"attention: a split-KV part writes {hq} query heads x (head_dim + 2) = "
                    f"{hq * (hd + 2)} elements, the output has {n_out}")
    return errs


def _check_attention_combine(ins, ind, outs, outd, p):
    hd, P = p.get("head_dim"), p.get("parts")
    if not isinstance(hd, int) or isinstance(hd, bool) or hd <= 0:
        return [f"attention_combine: param head_dim must be a positive int, got {hd!r}"]
    if not isinstance(P, int) or isinstance(P, bool) or P < 1:
        return [f"attention_combine: param parts must be a positive int, got {P!r}"]
    n = _n(outs[0])
    if n % hd:
        return [f"attention_combine: output has {n} elements, not a multiple of head_dim={hd}"]
    want = P * (n // hd) * (hd + 2)
    if _n(ins[0]) != want:
        return [f"attention_combine: {P} parts of {n // hd} query heads x (head_dim + 2) are {want} "
                f"elements, the partials region has {_n(ins[0])}"]
    return []


def _check_same_numel(name: str):
    def check(ins, ind, outs, outd, p):
        n = _n(outs[0])
        bad = [i for i, s in enumerate(ins) if _n(s) != n]
        if bad:
            return [f"{name}: operands differ in size: ins {[_n(s) for s in ins]}, out {n}"]
        return []

    return check


def _check_reduce(ins, ind, outs, outd, p):
    part, y = ins[0], outs[0]
    n = _n(y)
    errs = []
    # [k, N] or [k, rows, C] (trailing axes hold N = numel(y)); one partial squeezes to y's
    # own shape or, flat, to N elements
    rows_ok = len(part) >= 2 and _n(part[1:]) == n
    if not (rows_ok or part == y or (len(part) != 2 and _n(part) == n)):
        if len(part) == 2:
            errs.append(f"reduce: partials have width {part[1]}, output {n}")
        else:
            errs.append(f"reduce: partials {part} are not [k, ...] with {n} elements (the output's) "
                        "after the first axis")
    if len(ins) > 1 and _n(ins[1]) != n:
        errs.append(f"reduce: residual has {_n(ins[1])} elements, output {n}")
    return errs


def gemm_dims(na: int, nb: int, ny: int) -> tuple[int, int, int] | None:
    """(M, K, N) of a gemm whose a, b and y hold ``na`` = M*K, ``nb`` = K*N and ``ny`` = M*N
    elements (K^2 = na * nb / ny), or None when no positive integers fit. The shapes must
    still be checked: the counts alone do not tell [M, K] from [K, M]."""
    if na <= 0 or nb <= 0 or ny <= 0:
        return None
    kk, rem = divmod(na * nb, ny)
    k = math.isqrt(kk)
    if rem or k * k != kk or na % k or nb % k:
        return None
    return na // k, k, nb // k


def _check_gemm(ins, ind, outs, outd, p):
    """a [M, K] @ b [K, N] (+ r [M, N]) -> y [M, N] on squeezed shapes (module doc, "gemm
    shapes"): one line naming the operand that does not fit."""
    a, b, y = ins[0], ins[1], outs[0]
    head = f"gemm: a {list(a)} @ b {list(b)} -> y {list(y)}"
    if len(a) == 2 and len(b) == 2:  # no unit axis was dropped: the shapes are [M, K], [K, N]
        if a[1] != b[0]:
            return [f"{head}: a has K={a[1]} columns, b has K={b[0]} rows"]
        dims = (a[0], a[1], b[1])
    else:
        dims = gemm_dims(_n(a), _n(b), _n(y))
        if dims is None:
            return [f"{head}: no M, K, N give a [M, K] ({_n(a)} elements), b [K, N] ({_n(b)}), "
                    f"y [M, N] ({_n(y)})"]
    m, k, n = dims
    want = {"a": (m, k), "b": (k, n), "r": (m, n), "y": (m, n)}
    got = [("a", a), ("b", b)] + ([("r", ins[2])] if len(ins) > 2 else []) + [("y", y)]
    for role, shape in got:
        if shape != squeeze(want[role]):
            return [f"gemm: {role} is {list(shape)}, expected {list(want[role])} (M={m}, K={k}, N={n} "
                    f"from a {list(a)} @ b {list(b)} -> y {list(y)}; axes of extent 1 dropped)"]
    return []


def _check_argmax(ins, ind, outs, outd, p):
    errs = []
    if _n(outs[0]) != 2:
        errs.append(f"argmax: output must hold 2 elements (value, index), got {outs[0]}")
    off = p.get("offset")
    if not isinstance(off, int) or off < 0:
        errs.append(f"argmax: param offset must be a non-negative int, got {off!r}")
    if _n(ins[0]) < 1:
        errs.append("argmax: empty input")
    return errs


def _check_argmax_combine(ins, ind, outs, outd, p):
    errs = []
    pairs = ins[0]
    if not (pairs == (2,) or (len(pairs) == 2 and pairs[1] == 2)):
        errs.append(f"argmax_combine: input must be [k, 2] (value, index) pairs, got {pairs}")
    if _n(outs[0]) != 1:
        errs.append(f"argmax_combine: output must hold 1 element, got {outs[0]}")
    return errs


def _check_put(ins, ind, outs, outd, p):
    errs = []
    if _n(ins[0]) != _n(outs[0]):
        errs.append(f"put: source has {_n(ins[0])} elements, destination {_n(outs[0])}")
    if ind[0] != outd[0]:
        errs.append(f"put: source dtype {ind[0]} differs from destination dtype {outd[0]}")
    return errs


def _check_norm_gemv(ins, ind, outs, outd, p):
    x, nw, w = ins[0], ins[1], ins[2]
    errs = _check_gemv([x, w] + list(ins[3:]), ind, outs, outd, p)
    errs = [e.replace("gemv:", "norm_gemv:") for e in errs]
    if _n(nw) != _n(x):
        errs.append(f"norm_gemv: norm weight has {_n(nw)} elements, input {_n(x)}")
    return errs + _eps_errors("norm_gemv", p)


def _check_reduce_norm_gemv(ins, ind, outs, outd, p):
    part, r = ins[0], ins[1]
    k = _n(r)
    errs = [e.replace("norm_gemv:", "reduce_norm_gemv:")
            for e in _check_norm_gemv([r] + list(ins[2:]), ind[1:], outs, outd, p)]
    if len(part) == 2:
        if part[1] != k:
            errs.append(f"reduce_norm_gemv: partials have width {part[1]}, residual {k}")
    elif _n(part) != k:  # one partial squeezes to (K,)
        errs.append(f"reduce_norm_gemv: partials {part} do not match the residual's {k} elements")
    if ind[0] != ind[1]:
        errs.append(f"reduce_norm_gemv: partials are {ind[0]}, the residual {ind[1]} (the sum is "
                    "rounded to one dtype)")
    return errs


def _check_gemv_res(ins, ind, outs, outd, p):
    x, w, r = ins
    errs = [e.replace("gemv:", "gemv_res:") for e in _check_gemv([x, w], ind, outs, outd, p)]
    if _n(r) != _n(outs[0]):
        errs.append(f"gemv_res: residual has {_n(r)} elements, output {_n(outs[0])}")
    return errs


def _check_swiglu_gemv(ins, ind, outs, outd, p):
    g, u, w = ins[0], ins[1], ins[2]
    errs = [e.replace("gemv:", "swiglu_gemv:") for e in _check_gemv([g, w], ind, outs, outd, p)]
    if _n(u) != _n(g):
        errs.append(f"swiglu_gemv: gate has {_n(g)} elements, up {_n(u)}")
    if len(ins) > 3 and _n(ins[3]) != _n(outs[0]):
        errs.append(f"swiglu_gemv: residual has {_n(ins[3])} elements, output {_n(outs[0])}")
    return errs


def _check_rope_append(ins, ind, outs, outd, p):
    k, v, inv_freq, pos = ins
    errs = [e.replace("kv_append:", "rope_append:")
            for e in _check_kv_append([k, v, pos], ind, outs, outd, p)]
    hd = p.get("head_dim")
    if isinstance(hd, int) and hd > 0 and _n(inv_freq) != hd // 2:
        errs.append(f"rope_append: inv_freq has {_n(inv_freq)} elements, expected head_dim/2={hd // 2}")
    if isinstance(hd, int) and hd % 2:
        errs.append(f"rope_append: head_dim must be even, got {hd}")
    return errs


def _check_rope_attention(ins, ind, outs, outd, p):
    q, kc, vc, pos, inv_freq = ins
    errs = [e.replace("attention:", "rope_attention:")
            for e in _check_attention([q, kc, vc, pos], ind, outs, outd, p)]
    hd = p.get("head_dim")
    if isinstance(hd, int) and hd > 0 and _n(inv_freq) != hd // 2:
        errs.append(f"rope_attention: inv_freq has {_n(inv_freq)} elements, expected head_dim/2={hd // 2}")
    return errs


#: Most mirror outputs a GEMV-family task may carry in the IR (a one-shot all-reduce over up
#: to 8 ranks); a backend may accept fewer (triton: table.MAX_MIRRORS).
MAX_MIRRORS = 7


def _with_mirrors(check: CheckFn) -> CheckFn:
    """``check`` on the task's first output, plus: every mirror output has its shape and dtype."""
    def run(ins, ind, outs, outd, p):
        errs = check(ins, ind, outs[:1], outd[:1], p)
        for k in range(1, len(outs)):
            if outs[k] != outs[0] or outd[k] != outd[0]:
                errs.append(f"mirror output {k} is {outd[k]} {outs[k]}; the first output is "
                            f"{outd[0]} {outs[0]} (a mirror receives a copy of it)")
        return errs

    return run


def _scaled(name: str, check: CheckFn, w_index: int, max_ins: int) -> CheckFn:
    """``check`` of a GEMV-family op with a possibly quantized weight (module doc,
    "Quantized weights"): a quantized ``w`` needs its scales [N] f32 as the last input, which
    is checked and stripped; a float ``w`` takes at most ``max_ins`` inputs (no scale)."""
    def run(ins, ind, outs, outd, p):
        if w_index >= len(ind) or ind[w_index] not in QUANT_DTYPES:
            if len(ins) > max_ins:
                return [f"{name}: {len(ins)} inputs, at most {max_ins} with a {ind[w_index]} weight "
                        f"(only a quantized weight, {'/'.join(QUANT_DTYPES)}, takes a scale input)"]
            return check(ins, ind, outs, outd, p)
        if len(ins) <= w_index + 1:
            return [f"{name}: the weight is {ind[w_index]} but the task has no scale input (a "
                    "quantized weight's scales are the task's last input)"]
        w, s = ins[w_index], ins[-1]
        rows = 1 if len(w) <= 1 else w[0]
        k = _n(w) // max(rows, 1)
        errs = []
        # shapes arrive squeezed: the scale count tells [N] from [N, K / G]
        ns = _n(s)
        if ind[-1] != "f32" and not (ind[-1] == "f16" and ind[w_index] == "i8"):
            errs.append(f"{name}: the scale input is {ind[-1]}, expected f32 (or f16 for an i8 weight)")
        if ns != rows:  # one scale per group of K elements
            groups = ns // rows if rows else 0
            if ind[w_index] != "i8":
                errs.append(f"{name}: the scale input has {ns} elements, the weight has N={rows} rows "
                            f"(per-group scales need an i8 weight, not {ind[w_index]})")
            elif groups * rows != ns or groups < 1 or k % groups or k // groups < 2:
                errs.append(f"{name}: the scale input has {ns} elements, the weight has N={rows} rows and "
                            f"K={k} (per row: N scales; per group of G >= 2 dividing K: N x K / G)")
        return errs + check(ins[:-1], ind[:-1], outs, outd, p)

    return run


def _gemv_spec(name, ins, in_dtypes, check, **kw) -> OpSpec:
    """A GEMV-family spec: its ``w`` may be quantized (Q dtypes added), with mirrors."""
    wi = ins.index("w")
    in_dtypes = tuple(d + Q if i == wi else d for i, d in enumerate(in_dtypes))
    max_ins = len(ins) + len(kw.get("optional_ins", ()))
    return OpSpec(name=name, kind="compute", ins=ins, outs=("y",), in_dtypes=in_dtypes,
                  out_dtypes=(F,), check=_scaled(name, _with_mirrors(check), wi, max_ins),
                  mirrors=MAX_MIRRORS, scaled=True, **kw)


def _spec(name, kind, ins, outs, in_dtypes, out_dtypes, **kw) -> OpSpec:
    return OpSpec(name=name, kind=kind, ins=ins, outs=outs, in_dtypes=in_dtypes,
                  out_dtypes=out_dtypes, **kw)


def _check_rope_attention_kv(ins, ind, outs, outd, p):
    q, k, v, kc, vc, pos, inv_freq = ins
    errs = [e.replace("rope_attention:", "rope_attention_kv:")
            for e in _check_rope_attention([q, kc, vc, pos, inv_freq], ind, outs, outd, p)]
    hd = p.get("head_dim")
    dk = _cache_dims(kc, hd) if isinstance(hd, int) and hd > 0 else None
    if dk is not None:
        for name, src in (("k", k), ("v", v)):
            if _n(src) != dk[0] * hd:
                errs.append(f"rope_attention_kv: the caches hold {dk[0]} heads but {name} has {_n(src)} elements")
    if isinstance(hd, int) and hd % 2:
        errs.append(f"rope_attention_kv: head_dim must be even, got {hd}")
    return errs


#: The optional split-KV params of the attention ops (module doc, "Split-KV attention").
SPLIT_KV = {"parts": int, "part": int}

OPS: dict[str, OpSpec] = {
    s.name: s
    for s in [
        _spec("embed", "compute", ("table", "token"), ("y",), (F, I32), (F,), check=_check_embed),
        _spec("rmsnorm", "compute", ("x", "w"), ("y",), (F, F), (F,),
              params={"dim": int, "eps": float}, check=_check_rmsnorm),
        _gemv_spec("gemv", ("x", "w"), (F, F), _check_gemv,
                   optional_ins=("bias",), optional_in_dtypes=(F,)),
        _spec("rope", "compute", ("x", "inv_freq", "pos"), ("y",), (F, F32, I32), (F,),
              params={"head_dim": int}, check=_check_rope),
        _spec("kv_append", "compute", ("k", "v", "pos"), ("kc", "vc"), (F, F, I32), (F, F),
              params={"head_dim": int}, check=_check_kv_append),
        _spec("attention", "compute", ("q", "kc", "vc", "pos"), ("o",), (F, F, F, I32), (F,),
              params={"head_dim": int, "scale": float}, optional_params=SPLIT_KV,
              check=_check_attention),
        _spec("silu_mul", "compute", ("g", "u"), ("y",), (F, F), (F,),
              check=_check_same_numel("silu_mul")),
        _spec("add", "compute", ("a", "b"), ("y",), (F, F), (F,), check=_check_same_numel("add")),
        _spec("reduce", "compute", ("partials",), ("y",), (F,), (F,),
              optional_ins=("residual",), optional_in_dtypes=(F,), check=_check_reduce),
        _spec("argmax", "compute", ("x",), ("y",), (F,), (F32,),
              params={"offset": int}, check=_check_argmax),
        _spec("argmax_combine", "compute", ("pairs",), ("token",), (F32,), (I32,),
              check=_check_argmax_combine),
        _gemv_spec("norm_gemv", ("x", "norm_w", "w"), (F, F, F), _check_norm_gemv,
                   optional_ins=("bias",), optional_in_dtypes=(F,), params={"eps": float}),
        _gemv_spec("reduce_norm_gemv", ("partials", "r", "norm_w", "w"), (F, F, F, F),
                   _check_reduce_norm_gemv, optional_ins=("bias",), optional_in_dtypes=(F,),
                   params={"eps": float}),
        _gemv_spec("gemv_res", ("x", "w", "r"), (F, F, F), _check_gemv_res),
        _gemv_spec("swiglu_gemv", ("g", "u", "w"), (F, F, F), _check_swiglu_gemv,
                   optional_ins=("r",), optional_in_dtypes=(F,)),
        _spec("rope_append", "compute", ("k", "v", "inv_freq", "pos"), ("kc", "vc"),
              (F, F, F32, I32), (F, F), params={"head_dim": int}, check=_check_rope_append),
        _spec("rope_attention", "compute", ("q", "kc", "vc", "pos", "inv_freq"), ("o",),
              (F, F, F, I32, F32), (F,), params={"head_dim": int, "scale": float},
              optional_params=SPLIT_KV, check=_check_rope_attention),
        _spec("rope_attention_kv", "compute", ("q", "k", "v", "kc", "vc", "pos", "inv_freq"), ("o",),
              (F, F, F, F, F, I32, F32), (F,), params={"head_dim": int, "scale": float},
              optional_params=SPLIT_KV, check=_check_rope_attention_kv),
        _spec("attention_combine", "compute", ("p",), ("o",), (F32,), (F,),
              params={"head_dim": int, "parts": int}, check=_check_attention_combine),
        _spec("gemm", "compute", ("a", "b"), ("y",), (F, F), (F,), optional_ins=("r",),
              optional_in_dtypes=(F,), check=_check_gemm),
        _spec("copy", "compute", ("x",), ("y",), (ANY,), (ANY,), check=_check_same_numel("copy")),
        _spec("put", "comm", ("src",), ("dst",), (ANY,), (ANY,), check=_check_put),
        _spec("quiet", "sync", (), (), (), ()),
        _spec("fence", "sync", (), (), (), ()),
        _spec("nop", "sync", (), (), (), ()),
    ]
}

PARAM_TYPES = (int, float, str)
