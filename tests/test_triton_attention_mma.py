"""The attention_mma kernel knob: decode attention's two products per position block on
tensor cores (tl.dot over bf16 blocks, query rows padded to 16, probabilities rounded to the
cache dtype). Under the interpreter against the sim for each attention op (attention,
rope_attention, rope_attention_kv, split-KV parts), with f32 caches falling back to the fp32
products bit for bit; compiled offline for sm_90 with the GPU machines' Triton: tensor-core
instructions, no spills."""

from __future__ import annotations

import os

import pytest
import torch

from lowering.sim import SimExecutor
from tests.test_triton_megakernel import TOKENS, _device_triton_compile, cpu_only, lowered, run_decode

pytest.importorskip("triton")
from lowering.triton.runtime import Blocks, TritonExecutor  # noqa: E402


def _ops(ex) -> set[str]:
    return {v.op for v in ex.table.variants}


def _assert_matches_sim(ex, prog, init, toks):
    """The executor's logits within bf16 rounding of the sim's, the same greedy tokens."""
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    for (lg, nt), (ls, ns) in zip(run_decode(ex, toks), run_decode(sim, toks)):
        assert (lg - ls).abs().max() <= 0.02 * ls.abs().max()
        assert nt == ns


@cpu_only
@pytest.mark.parametrize("fuse,late,kv_split,op", [
    (False, False, 1, "attention"), (True, False, 1, "rope_attention"),
    (True, True, 1, "rope_attention_kv"), (True, True, 2, "rope_attention_kv")])
def test_mma_attention_matches_sim_in_bf16(fuse, late, kv_split, op):
    """bf16 tiny Llama: the tensor-core attention's logits stay within bf16 rounding of the
    sim's (p is rounded to bf16 for the second product) and its greedy tokens are the sim's;
    the knob reaches the generated calls."""
    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=fuse, late_append=late,
                            attn_kv_split=kv_split, max_seq=48)
    ex = TritonExecutor(prog, init, check=False, blocks=Blocks(attention_mma=True))
    assert op in _ops(ex)
    assert "MMA=ATT_MMA" in ex.source and ex._launch_options()["ATT_MMA"] is True
    _assert_matches_sim(ex, prog, init, (TOKENS * 4)[:12])


@cpu_only
def test_mma_attention_spans_several_position_blocks():
    """With 16-position blocks and 20 decode steps the online softmax runs over two blocks on
    the tensor-core path too (its running max and sum carried between dots)."""
    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True, late_append=True, max_seq=32)
    ex = TritonExecutor(prog, init, check=False, blocks=Blocks(attention_mma=True, attention_t=16))
    _assert_matches_sim(ex, prog, init, (TOKENS * 4)[:20])


@cpu_only
def test_f32_caches_keep_the_fp32_products():
    """An f32 program's attention ignores the knob: logits bit for bit those without it."""
    prog, init, _ = lowered("tiny-llama", workers=2, dtype="f32", fuse=True)
    got = [run_decode(TritonExecutor(prog, init, check=False, blocks=Blocks(attention_mma=m)), TOKENS[:3])
           for m in (False, True)]
    for (a, ta), (b, tb) in zip(*got):
        assert torch.equal(a, b) and ta == tb


@pytest.mark.skipif(not os.environ.get("AMK_DEVICE_TRITON"),
                    reason="AMK_DEVICE_TRITON (a folder holding the GPU machines' Triton 3.6) unset")
@pytest.mark.parametrize("late", [False, True])
def test_device_triton_compiles_mma_attention(tmp_path, late):
    """Fused bf16 tiny Llama at 8 warps with attention_mma compiles for sm_90 with the GPU
    machines' Triton: the attention's products are tensor-core instructions (mma.sync or
    wgmma; none without the knob), no spills."""
    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True, late_append=late)
    reps = {}
    for mma in (False, True):
        ex = TritonExecutor(prog, init, check=False, num_warps=8,
                            blocks=Blocks(gemv_n=16, gemv_k=128, gemv_unroll=8, attention_mma=mma))
        version, reps[mma] = _device_triton_compile(ex, tmp_path / str(mma))
    assert reps[False]["mma_sync"] + reps[False]["wgmma"] == 0, reps
    assert reps[True]["mma_sync"] + reps[True]["wgmma"] > 0, reps
    if reps[True]["regs"] is not None:
        assert reps[True]["regs"] <= 255 and reps[True]["local_bytes"] == 0, (version, reps)
