"""``late_append``'s KV-cache appends: one ``rope_append`` task per LATE_APPEND_HEADS KV heads
of a rank (lowering/lower.py ``_late_append``), each on the least-loaded worker, so a model
with many KV heads (SmolLM2-1.7B: 32) does not put one long append on a worker that also
streams a down-projection tile. Checked for structure, validity and results (sim and the
interpreter megakernel) with a small chunk so the tiny models split."""

from __future__ import annotations

import pytest
import torch

import lowering.lower as lower_mod
from ir.program import Target
from lowering.config import LoweringConfig
from lowering.lower import LATE_APPEND_HEADS, lower
from lowering.sim import SimExecutor
from tests.test_lowering import _validate, graph_of
from tests.test_triton_megakernel import TOKENS, _has_validator, cpu_only, decodes_alike, lowered, run_decode


def _appends(prog):
    return [t for t in prog.tasks if t.op == "rope_append"]


def test_many_kv_heads_split_into_chunks_on_separate_workers():
    """SmolLM2-1.7B's shape (32 KV heads, two layers): four appends a layer, 8 heads each,
    together writing every cache head once, on four workers, each waiting on the layer's
    attention counter; the schedule validates."""
    g = graph_of("smollm2-1.7b", layers=2)
    prog = lower(g, 1, config=LoweringConfig(workers=132, tile=16, fuse=True, late_append=True, policy="stage",
                                             dtype="bf16", max_seq=64),
                 target=Target(name="t", sms=132, max_workers=132, backend="triton"))
    for i in range(2):
        mine = [t for t in _appends(prog) if t.id.startswith(f"l{i}.")]
        assert [t.id for t in mine] == [f"l{i}.rope_append.c{c}.r0" for c in range(32 // LATE_APPEND_HEADS)]
        assert len({t.worker for t in mine}) == len(mine)
        heads = [(t.outs[0].ranges[0].start.const, t.outs[0].ranges[0].stop.const) for t in mine]
        assert heads == [(a, a + LATE_APPEND_HEADS) for a in range(0, 32, LATE_APPEND_HEADS)]
        assert len({(w.counter, w.offset, w.threshold) for t in mine for w in t.waits}) == 1
    _validate(prog)


def test_a_rank_of_few_heads_keeps_one_append():
    """Up to LATE_APPEND_HEADS KV heads a rank (Llama-3.2-1B: 8) the append stays one task
    with its former id, so those schedules are unchanged."""
    prog, _, _ = lowered("tiny-llama", workers=5, fuse=True, late_append=True, attn_split=2)
    assert [t.id for t in _appends(prog)] == [f"l{i}.rope_append.r0" for i in range(len(_appends(prog)))]


@pytest.fixture
def one_head_chunks(monkeypatch):
    """Appends of one KV head each, so tiny-qwen2's two KV heads split."""
    monkeypatch.setattr(lower_mod, "LATE_APPEND_HEADS", 1)


@pytest.mark.parametrize("workers", [6, 2])
def test_split_appends_validate(one_head_chunks, workers):
    """Two appends a layer (one a KV head) validate, apart or sharing a worker."""
    prog = lower(graph_of("tiny-qwen2"), 1, config=LoweringConfig(max_seq=32, tile=32, workers=workers, fuse=True,
                                                                  late_append=True, attn_split=2))
    assert [t.id for t in _appends(prog)] == [f"l{i}.rope_append.c{c}.r0" for i in range(2) for c in range(2)]
    _validate(prog)


def test_split_appends_give_the_same_tokens_in_the_sim(one_head_chunks, monkeypatch):
    """Splitting the append changes no value: the sim's logits and tokens equal those of the
    one-append schedule."""
    outs = []
    for heads in (1, 64):
        monkeypatch.setattr(lower_mod, "LATE_APPEND_HEADS", heads)
        prog, init, _ = lowered("tiny-qwen2", workers=5, fuse=True, late_append=True, attn_split=2)
        assert len(_appends(prog)) == (4 if heads == 1 else 2)
        outs.append(run_decode(SimExecutor(prog, init, check=False, policy="random", seed=3), TOKENS))
    for (l1, t1), (l2, t2) in zip(*outs):
        torch.testing.assert_close(l1, l2, rtol=0, atol=0)
        assert t1 == t2


@cpu_only
def test_split_appends_on_the_megakernel_match_the_sim(one_head_chunks):
    """The megakernel (interpreter, bf16, fused) runs the split appends to the sim's logits."""
    from lowering.triton import TritonExecutor

    prog, init, _ = lowered("tiny-qwen2", workers=5, dtype="bf16", fuse=True, late_append=True, attn_split=2)
    assert len(_appends(prog)) == 4
    ex = TritonExecutor(prog, init, check=_has_validator())
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    decodes_alike(ex, sim, TOKENS[:4], rtol=2e-2, atol=2e-2)
