"""The ``attn_kv_split`` lowering knob (flash-decoding's split-KV): a query-head group's
positions attended by several part tasks on several workers, whose partial records an
``attention_combine`` task merges (lowering/lower.py ``_attend``, ir/ops.py "Split-KV
attention"). Checked op by op against the unsplit reference, for structure and validity, and
for results against the unsplit schedule (sim) and the megakernel (interpreter, GPU)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from ir.ops import OPS
from lowering.config import LoweringConfig
from lowering.lower import lower
from lowering.reference import apply_op
from lowering.sim import SimExecutor
from tests.test_lowering import _validate, graph_of
from tests.test_triton_megakernel import TOKENS, _has_validator, cpu_only, decodes_alike, gpu, lowered, run_decode

ATT = ("attention", "rope_attention", "rope_attention_kv")


def _operands(op: str, hq: int, g: int, d: int, s: int, pos: int, seed: int = 0) -> list[torch.Tensor]:
    """Random fp32 inputs of ``op`` (q, [k, v,] kc, vc, pos[, inv_freq])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq * d, generator=gen)
    kc, vc = torch.randn(g, s, d, generator=gen), torch.randn(g, s, d, generator=gen)
    p = torch.tensor([pos], dtype=torch.int32)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if op == "attention":
        return [q, kc, vc, p]
    if op == "rope_attention":
        return [q, kc, vc, p, inv]
    k, v = torch.randn(g * d, generator=gen), torch.randn(g * d, generator=gen)
    return [q, k, v, kc, vc, p, inv]


@pytest.mark.parametrize("op", ATT)
@pytest.mark.parametrize("parts,pos", [(2, 7), (3, 10), (4, 2), (5, 0)])
def test_parts_combine_to_the_unsplit_attention(op, parts, pos):
    """The P partial records of the reference, merged by attention_combine, equal the unsplit
    op to fp32 rounding, including parts with no position (pos + 1 < P: m = -inf, l = 0)."""
    hq, g, d, s = 4, 2, 8, 16
    ins = _operands(op, hq, g, d, s, pos)
    params = {"head_dim": d, "scale": 1 / math.sqrt(d)}
    whole = torch.empty(hq * d)
    apply_op(op, params, ins, [whole])
    recs = torch.empty(parts, hq, d + 2)
    for c in range(parts):
        apply_op(op, dict(params, parts=parts, part=c), ins, [recs[c].view(-1)])
    n = pos + 1
    for c in range(parts):
        empty = (c + 1) * n // parts == c * n // parts
        assert bool(torch.isneginf(recs[c, :, d]).all()) == empty
    out = torch.empty(hq * d)
    apply_op("attention_combine", {"head_dim": d, "parts": parts}, [recs.view(-1)], [out])
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("params,outd,n_out,msg", [
    ({"parts": 2, "part": 2}, "f32", 4 * 10, "param part must be an int in [0, 2)"),
    ({"parts": 0, "part": 0}, "f32", 4 * 10, "param parts must be an int >= 1"),
    ({"parts": 2}, "f32", 4 * 10, "param part must be an int in [0, 2)"),
    ({"parts": 2, "part": 1}, "bf16", 4 * 10, "writes f32 partial records, the output is bf16"),
    ({"parts": 2, "part": 1}, "f32", 4 * 8, "the output has 32"),
])
def test_split_kv_params_are_checked(params, outd, n_out, msg):
    """A malformed split (part out of range, no part, a bf16 or wrongly sized record) is named."""
    spec = OPS["attention"]
    errs = spec.check([(32,), (2, 16, 8), (2, 16, 8), ()], ["f32", "f32", "f32", "i32"], [(n_out,)], [outd],
                      {"head_dim": 8, "scale": 0.5, **params})
    assert any(msg in e for e in errs), errs


def test_combine_checks_the_record_count():
    errs = OPS["attention_combine"].check([(3, 4, 10)], ["f32"], [(32,)], ["bf16"], {"head_dim": 8, "parts": 2})
    assert errs and "2 parts of 4 query heads" in errs[0]


@pytest.mark.parametrize("name,R", [("tiny-llama", 1), ("tiny-qwen2", 2), ("tiny-qwen3", 1)])
@pytest.mark.parametrize("fuse,late", [(False, False), (True, False), (True, True)])
def test_split_kv_schedules_are_valid(name, R, fuse, late):
    """attn_kv_split 3: every query-head group's attention becomes 3 parts (each on a worker
    apart when workers allow) and one combine that waits on them, and the schedule passes the
    validator."""
    if late and name == "tiny-qwen3":
        pytest.skip("late_append does nothing with a q/k norm")
    g = graph_of(name)
    base = LoweringConfig(max_seq=32, tile=32, workers=6, fuse=fuse, late_append=late, attn_split=2)
    one, three = lower(g, R, config=base), lower(g, R, config=base.replace(attn_kv_split=3))
    n1 = sum(t.op in ATT for t in one.tasks)
    parts = [t for t in three.tasks if t.op in ATT]
    combines = [t for t in three.tasks if t.op == "attention_combine"]
    assert len(parts) == 3 * n1 and len(combines) == n1
    assert {t.params["part"] for t in parts} == {0, 1, 2}
    for c in combines:
        group = c.id.rsplit(".", 1)[0]
        mine = [t for t in parts if t.id.rsplit(".", 1)[0] == group]
        assert len(mine) == 3 and len({t.worker for t in mine}) == 3
        assert all(t.signals[0].counter == c.waits[0].counter for t in mine) or \
            {t.worker for t in mine} == {c.worker}
    _validate(three)


@pytest.mark.parametrize("fuse,late", [(False, False), (True, True)])
def test_split_kv_gives_the_same_tokens_in_the_sim(fuse, late):
    """Split-KV changes only the order of the softmax's sums: the sim's logits with
    attn_kv_split 3 match the unsplit schedule's to fp32 rounding, with the same tokens."""
    outs = []
    for parts in (1, 3):
        prog, init, _ = lowered("tiny-llama", workers=5, fuse=fuse, late_append=late, attn_split=2,
                                attn_kv_split=parts)
        outs.append(run_decode(SimExecutor(prog, init, check=False, policy="random", seed=5), TOKENS))
    for (l1, t1), (l2, t2) in zip(*outs):
        torch.testing.assert_close(l1, l2, rtol=1e-4, atol=1e-5)
        assert t1 == t2


@cpu_only
@pytest.mark.parametrize("late", [False, True])
def test_split_kv_on_the_megakernel_matches_the_sim(late):
    """The megakernel (interpreter, bf16, fused) runs the split-KV schedule to the sim's logits."""
    from lowering.triton import TritonExecutor

    prog, init, _ = lowered("tiny-llama", workers=5, dtype="bf16", fuse=True, late_append=late,
                            attn_split=2, attn_kv_split=3)
    ex = TritonExecutor(prog, init, check=_has_validator())
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    decodes_alike(ex, sim, TOKENS[:4], rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.parametrize("late", [False, True])
def test_gpu_split_kv_matches_the_sim(late):
    """On a GPU (persistent CTAs, fused, bf16, the 16x128 unroll-8 GEMV): the split-KV
    schedule's logits and tokens match the sim's over every test token."""
    from lowering.triton import TritonExecutor
    from lowering.triton.runtime import Blocks

    prog, init, _ = lowered("tiny-llama", workers=8, dtype="bf16", fuse=True, late_append=late,
                            attn_split=2, attn_kv_split=4, max_seq=64)
    ex = TritonExecutor(prog, init, check=_has_validator(), num_warps=8,
                        blocks=Blocks(gemv_n=16, gemv_k=128, gemv_unroll=8))
    sim = SimExecutor(prog, init, check=False, policy="random", seed=1)
    decodes_alike(ex, sim, TOKENS, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not os.environ.get("AMK_DEVICE_TRITON"),
                    reason="AMK_DEVICE_TRITON (a folder holding the GPU machines' Triton, .ci/run installs 3.6) unset")
def test_device_triton_compiles_the_split_kv_variants(tmp_path):
    """With the GPU machines' Triton (3.6), the megakernel holding split-KV parts of both fused
    attention ops (late_append and not) and their combine compiles offline for sm_90 within
    255 registers and without spills (fused bf16 tiny Llama, 8 warps)."""
    from lowering.triton import TritonExecutor
    from lowering.triton.runtime import Blocks
    from tests.test_triton_megakernel import _device_triton_compile

    prog, init, _ = lowered("tiny-llama", workers=6, dtype="bf16", fuse=True, late_append=True, attn_split=2,
                            attn_kv_split=3)
    ex = TritonExecutor(prog, init, check=False, num_warps=8,
                        blocks=Blocks(gemv_n=16, gemv_k=128, gemv_unroll=8))
    assert {v.op for v in ex.table.variants if v.flag("partial")} == {"rope_attention_kv"}
    assert "attention_combine" in {v.op for v in ex.table.variants}
    version, rep = _device_triton_compile(ex, tmp_path)
    assert rep["vector_loads"], (version, rep)
    if rep["regs"] is not None:
        assert rep["regs"] <= 255 and rep["local_bytes"] == 0, (version, rep)


def test_the_knob_is_capped_at_what_the_combine_merges():
    """attn_kv_split's upper bound is the Triton combine's BLOCK_P."""
    from lowering.knobs import knob_named
    from lowering.triton.ops.attention import MAX_KV_PARTS

    assert knob_named(LoweringConfig, "attn_kv_split").hi == MAX_KV_PARTS.value


def test_a_combine_without_its_wait_is_a_race():
    """The validator rejects a split-KV schedule whose combine does not wait for its parts,
    naming the race on the partial records."""
    import dataclasses

    from validator.validate import validate

    prog = lower(graph_of("tiny-llama"), 1, config=LoweringConfig(max_seq=32, workers=6, fuse=True, late_append=True,
                                                                  attn_split=2, attn_kv_split=3))
    i = next(k for k, t in enumerate(prog.tasks) if t.op == "attention_combine")
    prog.tasks[i] = dataclasses.replace(prog.tasks[i], waits=())
    v = validate(prog)
    assert not v.ok and "ReadWriteRace" in v.classes
    assert any(prog.tasks[i].id in f.tasks and f.buffers[0].startswith("ap.") for f in v.errors)
