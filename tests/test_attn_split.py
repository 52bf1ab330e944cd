"""The ``attn_split`` lowering knob: a KV head's query heads attended by several tasks on
several workers (lowering/lower.py ``attn_head_groups``), checked for structure, validity
and results against the unsplit schedule (sim) and the megakernel (interpreter)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lowering.config import LoweringConfig
from lowering.lower import lower
from lowering.sim import SimExecutor
from tests.test_lowering import _validate, graph_of
from tests.test_triton_megakernel import TOKENS, _has_validator, cpu_only, decodes_alike, gpu, lowered, run_decode


@pytest.mark.parametrize("name,R", [("tiny-llama", 1), ("tiny-qwen2", 2), ("tiny-qwen3", 3)])
@pytest.mark.parametrize("fuse", [False, True])
def test_split_attention_tasks_are_valid(name, R, fuse):
    """attn_split 2 gives min(2, group) attention tasks per (rank, KV head), each over a
    disjoint query-head range, and the schedule passes the validator."""
    g = graph_of(name)
    base = LoweringConfig(max_seq=32, tile=32, workers=4, fuse=fuse)
    one, two = lower(g, R, config=base), lower(g, R, config=base.replace(attn_split=2))
    att = ("attention", "rope_attention")
    n1 = sum(c for op, c in Counter(t.op for t in one.tasks).items() if op in att)
    n2 = sum(c for op, c in Counter(t.op for t in two.tasks).items() if op in att)
    assert n2 > n1
    outs = {}
    for t in two.tasks:
        if t.op in att:  # query-head ranges of one output buffer never overlap
            key = (t.rank, t.outs[0].buffer, t.id.split(".")[0])
            rg = t.outs[0].ranges[0]
            lo, hi = rg.start.at(0), rg.stop.at(0)
            for a, b in outs.get(key, []):
                assert hi <= a or b <= lo, (t.id, (lo, hi), (a, b))
            outs.setdefault(key, []).append((lo, hi))
    _validate(two)


def test_split_fused_attention_waits_on_the_appends():
    """With fuse and a split, each rope_attention runs apart from its KV head's rope_append
    and waits on the counter every append of the rank signals."""
    prog = lower(graph_of("tiny-llama"), 1, config=LoweringConfig(max_seq=32, workers=4, fuse=True,
                                                                  attn_split=3))
    apps = [t for t in prog.tasks if t.op == "rope_append"]
    atts = [t for t in prog.tasks if t.op == "rope_attention"]
    assert len(atts) == 3 * len(apps)
    for a in apps:
        assert [s.counter for s in a.signals] == [f"c.{a.id.split('.')[0]}.kvc.r0"]
        assert all(t.worker != a.worker for t in atts if t.id.startswith(a.id.split(".")[0] + "."))
    for t in atts:
        layer = t.id.split(".")[0]
        assert any(w.counter == f"c.{layer}.kvc.r0" for w in t.waits), t


@pytest.mark.parametrize("fuse", [False, True])
def test_split_attention_gives_the_same_logits_in_the_sim(fuse):
    """Each query head's attention is the same computation whichever task runs it: the sim's
    logits with attn_split 3 match the unsplit schedule's to fp32 rounding (torch's batched
    products may sum in another order for a different head count) and give the same tokens."""
    outs = []
    for split in (1, 3):
        prog, init, _ = lowered("tiny-llama", workers=4, fuse=fuse, attn_split=split)
        outs.append(run_decode(SimExecutor(prog, init, check=False, policy="random", seed=3), TOKENS))
    for (l1, t1), (l2, t2) in zip(*outs):
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
        assert t1 == t2


@cpu_only
def test_split_attention_on_the_megakernel_matches_the_sim():
    """The megakernel (interpreter, bf16, fused) runs the split schedule to the sim's logits."""
    from lowering.triton import TritonExecutor

    prog, init, _ = lowered("tiny-llama", workers=4, dtype="bf16", fuse=True, attn_split=3)
    ex = TritonExecutor(prog, init, check=_has_validator())
    # one query head a task: the kernel's single-head path (BLOCK_Q = 1), head lanes addressed
    # from each head's first element
    assert ex.table.dims["group"] == 1
    att = [v for v in ex.table.variants if "attention" in v.op]
    assert att and all(v.flag("headvec") for v in att)
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    decodes_alike(ex, sim, TOKENS[:3], rtol=2e-2, atol=2e-2)


@gpu
def test_gpu_split_attention_matches_the_sim():
    """On a GPU (W persistent CTAs, fused, bf16, the 16x128 unroll-8 GEMV): the split
    schedule's logits and tokens match the sim's."""
    from lowering.triton import TritonExecutor
    from lowering.triton.runtime import Blocks

    prog, init, _ = lowered("tiny-llama", workers=6, dtype="bf16", fuse=True, attn_split=3, max_seq=64)
    ex = TritonExecutor(prog, init, check=_has_validator(), num_warps=8,
                        blocks=Blocks(gemv_n=16, gemv_k=128, gemv_unroll=8))
    assert not ex.linear
    sim = SimExecutor(prog, init, check=False, policy="random", seed=1)
    decodes_alike(ex, sim, TOKENS, rtol=2e-2, atol=2e-2)
