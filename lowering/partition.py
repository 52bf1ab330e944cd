"""Tensor-parallel split math: which heads, columns and vocabulary rows each rank owns.

All splits are contiguous blocks, as even as possible (the first ``n mod R`` ranks get one
more), so 9 query heads over 4 ranks become 3, 2, 2, 2. A rank may own nothing (3 query heads
over 4 ranks): it then contributes no partial sum to that all-reduce but still receives the
reduced result.

GQA: a rank computes K/V for every KV head that one of its query heads uses (head h uses KV
head ``h // (Hq / Hkv)``, as in HF ``repeat_kv``). A KV head whose query group spans two ranks
is replicated: both ranks project it and keep their own copy of its KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def n_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_cols(self) -> int:
        return self.cols[1] - self.cols[0]

    @property
    def n_vocab(self) -> int:
        return self.vocab[1] - self.vocab[0]


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
        raise ValueError(f"vocabulary of {vocab} rows cannot be split over {ranks} ranks")
    group = heads // kv_heads
    qb = split_even(heads, ranks)
    cb = split_aligned(intermediate, ranks, align)
    vb = split_aligned(vocab, ranks, align)
    shards = []
    for r in range(ranks):
        h0, h1 = qb[r]
        kv = (h0 // group, (h1 - 1) // group + 1) if h1 > h0 else (0, 0)
        shards.append(RankShard(r, (h0, h1), kv, cb[r], vb[r]))
    return Partition(ranks, group, tuple(shards))
