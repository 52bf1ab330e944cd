"""``down_split_k``: the down projection cut along K into column chunks at one rank
(lowering/lower.py ``mlp_in`` and ``_row_split_k``). Each chunk's tiles wait only on the
gate/up tiles of its columns and write a partial row; reduce tiles sum the partials with the
residual, and the next RMSNorm + GEMV tiles sum them themselves. Checked for structure,
validity, values (sim against the unsplit schedule, interpreter megakernel against the sim)
and the knob's rules."""

from __future__ import annotations

import os

import pytest
import torch

from ground.errors import AmkError
from lowering.config import LoweringConfig
from lowering.lower import lower
from lowering.sim import SimExecutor
from tests.test_lowering import _validate, graph_of
from tests.test_triton_megakernel import TOKENS, _has_validator, cpu_only, decodes_alike, lowered, run_decode


def _cols(buf) -> tuple[int, int]:
    return tuple(buf.source.ranges[1])


@pytest.mark.parametrize("split,wave", [(2, False), (3, True)])
def test_each_chunk_waits_only_on_its_columns(split, wave):
    """Per layer: ``split`` weight buffers covering the MLP columns once, in order; each
    chunk's down tiles wait on their chunk's counter alone, which exactly the gate/up tiles
    of those columns signal; the next layer's q/k/v tiles sum the partials themselves; the
    schedule validates."""
    g = graph_of("tiny-llama", layers=2)
    prog = lower(g, 1, config=LoweringConfig(tile=16, workers=6, fuse=True, wave=wave, down_split_k=split,
                                             max_seq=16))
    bufs = {b.name: b for b in prog.buffers}
    n = g.spec.intermediate
    for i in range(2):
        chunks = [bufs[f"w.l{i}.mlp.k{c}.r0"] for c in range(split)]
        spans = [_cols(b) for b in chunks]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert f"w.l{i}.mlp.r0" not in bufs  # no unsplit copy of the weight
        for c, (k0, k1) in enumerate(spans):
            down = [t for t in prog.tasks if t.id.startswith(f"l{i}.mlp.k{c}.")]
            assert down and {w.counter for t in down for w in t.waits} <= {f"c.l{i}.act.k{c}.r0"}
            producers = [t for t in prog.tasks if f"c.l{i}.act.k{c}.r0" in {s.counter for s in t.signals}]
            rows = sorted((t.outs[0].ranges[0].start.const, t.outs[0].ranges[0].stop.const) for t in producers)
            assert rows[0][0] == k0 and rows[-1][1] == k1
            assert all(t.op == "swiglu_gemv" and t.ins[0].ranges[0].start.const == k0 for t in down)
    qkv = [t for t in prog.tasks if t.id.split(".")[:2] in (["l1", "q"], ["l1", "k"], ["l1", "v"])]
    assert qkv and all(t.op == "reduce_norm_gemv" and t.ins[0].buffer == "kp.l0.mlp.r0" for t in qkv)
    _validate(prog)


@pytest.mark.parametrize("name,kw", [("tiny-llama", dict(late_append=True)),
                                     ("tiny-qwen3", dict(wave=True, attn_split=2))])
def test_the_sim_gives_the_unsplit_values(name, kw):
    """The split schedule computes the same step: logits within float rounding of the
    unsplit schedule's (the partials are summed in another order), the same tokens."""
    outs = []
    for split in (1, 2, 4):
        prog, init, _ = lowered(name, workers=5, fuse=True, tile=16, down_split_k=split, **kw)
        assert any(t.op == "reduce" for t in prog.tasks) == (split > 1)
        outs.append(run_decode(SimExecutor(prog, init, check=False, policy="random", seed=5), TOKENS))
    for other in outs[1:]:
        for (l1, t1), (l2, t2) in zip(outs[0], other):
            torch.testing.assert_close(l1, l2, rtol=0, atol=1e-5)
            assert t1 == t2


@cpu_only
@pytest.mark.parametrize("kw", [dict(down_split_k=2, late_append=True),
                                dict(down_split_k=3, wave=True, weights="int8")])
def test_the_megakernel_matches_the_sim(kw):
    """The megakernel (interpreter, bf16) runs the chunked down tiles, the reduce tiles and
    the summing norm tiles to the sim's logits (also with int8 weights and their scales)."""
    from lowering.triton import TritonExecutor

    prog, init, _ = lowered("tiny-llama", workers=5, dtype="bf16", fuse=True, tile=16, **kw)
    ex = TritonExecutor(prog, init, check=_has_validator())
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    decodes_alike(ex, sim, TOKENS[:4], rtol=2e-2, atol=2e-2)


def test_the_knob_acts_at_one_rank_with_fused_ops():
    """Refused where it would do nothing (one line naming the flag), ignored by a lowering
    that checks no combinations; at its default the program's config line omits it."""
    with pytest.raises(AmkError, match="--down-split-k 2 does nothing at 2 ranks"):
        LoweringConfig(fuse=True, down_split_k=2).validate("cfg", 2)
    with pytest.raises(AmkError, match="--down-split-k 2 does nothing without --fuse 1"):
        LoweringConfig(down_split_k=2).validate("cfg", 1)
    with pytest.raises(AmkError, match="down_split_k"):
        LoweringConfig(down_split_k=9).validate("cfg", 1)
    g = graph_of("tiny-llama", layers=1)
    two = lower(g, 2, config=LoweringConfig(tile=16, workers=4, fuse=True, down_split_k=2, max_seq=16))
    assert not any(".k1." in t.id for t in two.tasks)
    assert "down_split_k" not in lower(g, 1, config=LoweringConfig(tile=16, fuse=True)).config
    assert lower(g, 1, config=LoweringConfig(tile=16, fuse=True, down_split_k=2)).config["down_split_k"] == 2


@pytest.mark.skipif(not os.environ.get("AMK_DEVICE_TRITON"),
                    reason="AMK_DEVICE_TRITON (a folder holding the GPU machines' Triton, .ci/run installs 3.6) unset")
def test_device_triton_compiles_the_split_down_tiles(tmp_path):
    """With the GPU machines' Triton (3.6), the megakernel holding the chunked down tiles,
    the local reduce and the summing norm tiles compiles offline for sm_90 within 255
    registers and without spills (fused bf16 tiny Llama, 8 warps)."""
    from lowering.triton import TritonExecutor
    from lowering.triton.runtime import Blocks
    from tests.test_triton_megakernel import _device_triton_compile

    prog, init, _ = lowered("tiny-llama", workers=6, dtype="bf16", fuse=True, late_append=True, tile=16,
                            down_split_k=2)
    ex = TritonExecutor(prog, init, check=False, num_warps=8,
                        blocks=Blocks(gemv_n=16, gemv_k=128, gemv_unroll=8))
    assert {"reduce", "reduce_norm_gemv", "swiglu_gemv"} <= {v.op for v in ex.table.variants}
    version, rep = _device_triton_compile(ex, tmp_path)
    if rep["regs"] is not None:
        assert rep["regs"] <= 255 and rep["local_bytes"] == 0, (version, rep)
