"""Tensor-parallel split math: which heads, columns and vocabulary rows each rank owns.

All splits are contiguous blocks, as even as possible (the first ``n mod R`` ranks get one
more), so 9 query heads over 4 ranks become 3, 2, 2, 2. A rank may own no query heads (3
query heads over 4 ranks): it then skips attention, contributes no partial sum to the
attention all-reduce but still receives the reduced result (``check_split`` returns a note
naming such ranks).

``check_split`` checks a split before any lowering and raises ``SplitError`` (a ValueError)
with the model's counts when the schedule could not express it: fewer vocabulary rows than
ranks, a rank with fewer than 2 MLP columns (a one-column weight slice [H, 1] is the same
IR region shape as a one-row slice, so the down projection's GEMV would be mis-shaped), a
two-shot all-reduce block of one hidden column, or a fused all-reduce over more ranks than
a GEMV tile has mirror outputs.

GQA: a rank computes K/V for every KV head that one of its query heads uses (head h uses KV
head ``h // (Hq / Hkv)``, as in HF ``repeat_kv``). A KV head whose query group spans two ranks
is replicated: both ranks project it and keep their own copy of its KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

# Columns an MLP slice needs at least: a slice of one column cannot be told from one row.
MIN_MLP_COLUMNS = 2
# Most ranks a ``fused`` all-reduce spans: a GEMV tile stores to itself and R - 1 peers
# (ir.ops.MAX_MIRRORS mirror outputs).
MAX_FUSED_RANKS = 8


class SplitError(ValueError):
    """A tensor-parallel split the lowering cannot express; the message names the counts."""


def split_even(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous ``(start, stop)`` blocks, sizes differing
    by at most one, larger blocks first. Raises ValueError for n < 0 or parts < 1."""
    if n < 0 or parts < 1:
        raise ValueError(f"cannot split {n} into {parts} parts")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


def split_aligned(n: int, parts: int, align: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous blocks whose boundaries are multiples of
    ``align`` (the last block ends at n). Units of ``align`` elements are dealt as evenly as
    possible. Falls back to ``split_even`` when there are fewer units than parts, so that no
    rank is left empty when n >= parts."""
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    units = -(-n // align)
    if units < parts:
        return split_even(n, parts)
    blocks = split_even(units, parts)
    return [(min(a * align, n), min(b * align, n)) for a, b in blocks]


def tiles(start: int, stop: int, tile: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into tiles of ``tile`` elements (the last may be shorter)."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return [(a, min(a + tile, stop)) for a in range(start, stop, tile)]


@dataclass(frozen=True)
class RankShard:
    """What rank ``rank`` owns.

    ``q_heads``: global query heads [h0, h1); ``kv_heads``: global KV heads [g0, g1) it needs
    (empty when it has no query heads); ``cols``: intermediate columns [c0, c1) of the MLP;
    ``vocab``: vocabulary rows [v0, v1) of the LM head.
    """

    rank: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    cols: tuple[int, int]
    vocab: tuple[int, int]

    n_q = property(lambda self: _width(self.q_heads), doc="query heads of this rank")
    n_kv = property(lambda self: _width(self.kv_heads), doc="KV heads this rank needs")
    n_cols = property(lambda self: _width(self.cols), doc="MLP intermediate columns")
    n_vocab = property(lambda self: _width(self.vocab), doc="vocabulary rows of the LM head")


def _width(span: tuple[int, int]) -> int:
    """The length of a half-open ``[start, stop)`` span."""
    return span[1] - span[0]


@dataclass(frozen=True)
class Partition:
    """The split of a model over ``ranks`` ranks (one RankShard per rank)."""

    ranks: int
    group: int
    shards: tuple[RankShard, ...]

    def kv_group_heads(self, rank: int, kv_head: int) -> tuple[int, int]:
        """Global query heads [lo, hi) of ``rank`` that attend with global ``kv_head``."""
        h0, h1 = self.shards[rank].q_heads
        return max(h0, kv_head * self.group), min(h1, (kv_head + 1) * self.group)

    def replicated_kv_heads(self) -> list[int]:
        """KV heads held by more than one rank."""
        count: dict[int, int] = {}
        for s in self.shards:
            for g in range(*s.kv_heads):
                count[g] = count.get(g, 0) + 1
        return sorted(g for g, c in count.items() if c > 1)


def partition(heads: int, kv_heads: int, intermediate: int, vocab: int, ranks: int,
              align: int = 1) -> Partition:
    """Split query heads (even contiguous blocks), MLP columns and vocabulary (blocks aligned
    to ``align`` where possible) over ``ranks`` ranks.

    Raises ValueError when heads is not a multiple of kv_heads, or when the vocabulary has
    fewer rows than ranks (every rank must own LM-head rows: the cross-rank argmax relies on
    every rank taking part).
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into {kv_heads} KV-head groups")
    if vocab < ranks:
        raise SplitError(f"vocabulary of {vocab} rows cannot be split over {ranks} ranks")
    group = heads // kv_heads
    qb = split_even(heads, ranks)
    cb = split_aligned(intermediate, ranks, align)
    thin = [r for r, (a, b) in enumerate(cb) if b - a < MIN_MLP_COLUMNS]
    if thin:
        sizes = sorted({cb[r][1] - cb[r][0] for r in thin})
        got = _count(sizes[0], "column") if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} columns"
        raise SplitError(f"{intermediate} MLP columns over {ranks} ranks leave {_ranks(thin)} "
                         f"with {got} (each rank needs at least {MIN_MLP_COLUMNS})")
    vb = split_aligned(vocab, ranks, align)
    shards = []
    for r in range(ranks):
        h0, h1 = qb[r]
        kv = (h0 // group, (h1 - 1) // group + 1) if h1 > h0 else (0, 0)
        shards.append(RankShard(r, (h0, h1), kv, cb[r], vb[r]))
    return Partition(ranks, group, tuple(shards))


def _ranks(rs: list[int]) -> str:
    """"rank 3" / "ranks 3-6" / "ranks 1, 4" for a sorted list of rank indices."""
    if len(rs) == 1:
        return f"rank {rs[0]}"
    if rs == list(range(rs[0], rs[-1] + 1)):
        return f"ranks {rs[0]}-{rs[-1]}"
    return "ranks " + ", ".join(map(str, rs))


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}" + ("" if n == 1 else "s")


def ranks_without_heads(heads: int, ranks: int) -> list[int]:
    """Ranks that own no query head when ``heads`` are split over ``ranks`` (the last
    ``ranks - heads`` ranks when there are more ranks than heads)."""
    return [r for r, (a, b) in enumerate(split_even(heads, ranks)) if a == b]


def check_split(heads: int, kv_heads: int, intermediate: int, vocab: int, hidden: int,
                ranks: int, align: int = 1, allreduce: str = "oneshot") -> list[str]:
    """Check that the lowering can split a model over ``ranks`` ranks, before lowering it.

    Counts are the model's (query heads, KV heads, MLP columns, vocabulary rows, hidden
    size); ``align``: the lowering's ``tile`` (MLP and vocabulary blocks are aligned to it);
    ``allreduce``: the algorithm (``twoshot`` splits the hidden vector over ranks, ``fused``
    stores every partial to all peers from one task). Returns notes for splits that lower
    but leave ranks idle in a stage (ranks without query heads). Raises SplitError naming
    what does not fit.
    """
    partition(heads, kv_heads, intermediate, vocab, ranks, align)
    if ranks > 1 and allreduce == "twoshot":
        hb = split_aligned(hidden, ranks, align)
        thin = [r for r, (a, b) in enumerate(hb) if b - a == 1]
        if thin:
            raise SplitError(f"the two-shot all-reduce splits the hidden size {hidden} over "
                             f"{ranks} ranks into blocks of one column ({_ranks(thin)}); use "
                             "allreduce oneshot or fewer ranks")
    if allreduce == "fused" and ranks > MAX_FUSED_RANKS:
        raise SplitError(f"the fused all-reduce spans at most {MAX_FUSED_RANKS} ranks (a GEMV "
                         f"tile stores to every peer), got {ranks}; use allreduce oneshot")
    notes = []
    idle = ranks_without_heads(heads, ranks)
    if idle:
        one = len(idle) == 1
        notes.append(f"{_count(heads, 'query head')} over {ranks} ranks: {_ranks(idle)} "
                     f"{'owns' if one else 'own'} no query heads and skip{'s' if one else ''} "
                     f"attention ({'it still holds' if one else 'they still hold'} MLP columns "
                     "and vocabulary rows)")
    return notes


def max_ranks(heads: int, kv_heads: int, intermediate: int, vocab: int, hidden: int,
              align: int = 1, allreduce: str = "oneshot", limit: int = 1024) -> int:
    """The largest rank count <= ``limit`` that ``check_split`` accepts (0 if none)."""
    for r in range(min(limit, vocab), 0, -1):
        try:
            check_split(heads, kv_heads, intermediate, vocab, hidden, r, align, allreduce)
        except ValueError:
            continue
        return r
    return 0
