"""Quantized GEMV weights in the Triton megakernel: int8 / float8e4nv weight tiles converted
to fp32 in registers inside the streaming GEMV, the per-row scale applied once after the
dot product, or (q8_0: int8 with 32-column groups) each group's products summed and then
multiplied once by its scale (an f16 value, stored as f32 by the lowering). Under the
interpreter against the sim (tiny Llama), and compiled offline for sm_90 with the GPU
machines' Triton (AMK_DEVICE_TRITON) without spills."""

from __future__ import annotations

import os

import pytest
import torch

from lowering.config import weight_knobs
from lowering.sim import SimExecutor
from tests.test_triton_megakernel import TOKENS, _device_triton_compile, cpu_only, lowered, run_decode

pytest.importorskip("triton")
from lowering.triton.runtime import TritonExecutor  # noqa: E402

DEVICE_TRITON = pytest.mark.skipif(
    not os.environ.get("AMK_DEVICE_TRITON"),
    reason="AMK_DEVICE_TRITON (a folder holding the GPU machines' Triton 3.6) unset")


@cpu_only
@pytest.mark.parametrize("weights,fuse,dtype,blocks", [
    ("int8", False, "f32", {}), ("fp8", True, "f32", {}), ("int8", True, "bf16", {}),
    # per-group scales through each K-loop form: plain, pair, unrolled, pipelined
    ("q8_0", False, "f32", {}), ("q8_0", True, "bf16", dict(gemv_n=16, gemv_k=64, gemv_unroll=2)),
    ("q8_0", True, "f32", dict(gemv_n=16, gemv_k=32, gemv_unroll=4, w_preload=64)),
    ("q8_0", True, "f32", dict(gemv_n=16, gemv_k=16, gemv_unroll=2)),  # blocks inside a group
    ("q8_0", True, "bf16", dict(gemv_n=16, gemv_k=128, gemv_stages=3)),
    ("q8_0", True, "f32", dict(gemv_n=16, gemv_k=32, gemv_stages=3)),  # pipelined, a block a group
    ("q8_0", True, "f32", dict(gemv_n=16, gemv_k=16, gemv_stages=2)),  # pipelined, blocks inside a group
    # the int8 conversion through I2F (the default avoids it); quantized GEMVs in blocks of their own rows
    ("int8", True, "f32", dict(int8_convert="cvt")), ("q8_0", True, "bf16", dict(int8_convert="cvt")),
    ("fp8", True, "bf16", dict(gemv_n=16, gemv_k=64, q_gemv_n=32, gemv_unroll=2))])
def test_quantized_tiny_model_matches_sim(weights, fuse, dtype, blocks):
    from lowering.triton.runtime import Blocks

    prog, init, _ = lowered("tiny-llama", workers=2, dtype=dtype, fuse=fuse, **weight_knobs(weights))
    ex = TritonExecutor(prog, init, check=False, **({"blocks": Blocks(**blocks)} if blocks else {}))
    scaled = [v for v in ex.table.variants if v.flag("scale")]
    qdt = {"int8": "i8", "fp8": "f8e4m3", "q8_0": "i8"}[weights]
    assert scaled and all(qdt in v.dtypes for v in scaled), [v.describe() for v in ex.table.variants]
    assert all(v.flag("gscale") == (weights == "q8_0") for v in scaled)
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    for (lg, nt), (ls, ns) in zip(run_decode(ex, TOKENS[:3]), run_decode(sim, TOKENS[:3])):
        if dtype == "f32":
            torch.testing.assert_close(lg, ls, rtol=1e-4, atol=2e-5)
        else:
            assert (lg - ls).abs().max() <= 0.02 * ls.abs().max()
        assert nt == ns


@cpu_only
@pytest.mark.parametrize("blocks", [{}, dict(gemv_n=16, gemv_k=128, gemv_stages=3)])
def test_f16_group_scales_match_sim(blocks, tmp_path):
    """The lowering stores q8_0's scales as f32, so the pipelined K loop streams them with
    the weights; a schedule whose group scales are f16 (GGUF's own width, e.g. written by
    hand) still runs: its calls name the f16 scale dtype (the kernel reads them from the f16
    arena, one block ahead in the pipelined loop) and decode as the sim does."""
    import dataclasses

    from lowering.triton.runtime import Blocks

    prog, init, _ = lowered("tiny-llama", workers=2, dtype="bf16", fuse=True, **weight_knobs("q8_0"))
    scales = {b.name for b in prog.buffers if b.kind == "weight" and b.name.startswith("s.") and len(b.shape) == 2}
    assert scales and all(b.dtype == "f32" for b in prog.buffers if b.name in scales)
    p16 = prog.copy()
    p16.buffers = [dataclasses.replace(b, dtype="f16") if b.name in scales else b for b in p16.buffers]
    ex = TritonExecutor(p16, init, check=False, **({"blocks": Blocks(**blocks)} if blocks else {}))
    grouped = [v for v in ex.table.variants if v.flag("gscale")]
    assert grouped and all("f16" in v.dtypes for v in grouped)
    calls = [ln for ln in ex.emit_source(tmp_path / "k.py").read_text().splitlines() if "SCALE_GROUP=32" in ln]
    assert calls and all("DS=tl.float16" in ln for ln in calls), calls
    sim = SimExecutor(prog, init, check=False, policy="in_order")
    for (lg, nt), (ls, ns) in zip(run_decode(ex, TOKENS[:3]), run_decode(sim, TOKENS[:3])):
        assert (lg - ls).abs().max() <= 0.02 * ls.abs().max()
        assert nt == ns


@cpu_only
@pytest.mark.parametrize("weights", ["int8", "q8_0"])
def test_int8_magic_conversion_is_exact(weights):
    """int8_convert magic (no I2F) gives the same fp32 logits, bit for bit, as the conversion,
    and the kernel knobs reach the generated calls (I8_CVT, GEMV_NQ rows for quantized W)."""
    from lowering.triton.runtime import Blocks

    prog, init, _ = lowered("tiny-llama", workers=2, dtype="f32", fuse=True, **weight_knobs(weights))
    got = {}
    for cvt in ("cvt", "magic", "prmt"):  # prmt runs as magic under the interpreter
        ex = TritonExecutor(prog, init, check=False, blocks=Blocks(int8_convert=cvt, q_gemv_n=32))
        got[cvt] = run_decode(ex, TOKENS[:2])
    for other in ("magic", "prmt"):
        for (a, ta), (b, tb) in zip(got["cvt"], got[other]):
            assert torch.equal(a, b) and ta == tb


@cpu_only
def test_quantized_gemv_calls_take_the_quantized_knobs(tmp_path):
    """Scaled int8 GEMVs name I8_CVT, GEMV_NQ and Q_TMA; fp8 ones GEMV_NQ and Q_TMA (no
    int8 conversion); the float GEMVs (the LM head) keep GEMV_N and GEMV_TMA; per-group
    scales never take TMA."""
    for weights, magic, tma in (("int8", True, True), ("fp8", False, True), ("q8_0", True, False)):
        q, qi, _ = lowered("tiny-llama", workers=2, dtype="bf16", fuse=True, **weight_knobs(weights))
        src = TritonExecutor(q, qi, check=False).emit_source(tmp_path / f"{weights}.py").read_text()
        scaled = [ln for ln in src.splitlines() if "HAS_SCALE=True" in ln]
        plain = [ln for ln in src.splitlines() if "t_gemv(" in ln and "HAS_SCALE" not in ln]
        assert scaled and plain
        assert all("GEMV_NQ" in ln and ("I8_CVT=I8_CVT" in ln) == magic for ln in scaled), scaled
        assert all(("W_TMA=Q_TMA" in ln) == tma for ln in scaled), scaled
        assert all("GEMV_N," in ln and "I8_CVT" not in ln and "W_TMA=GEMV_TMA" in ln for ln in plain), plain


@cpu_only
def test_unquantized_variants_carry_no_scale(tmp_path):
    """An unquantized program's GEMV variants (and so its generated dispatch) are unchanged."""
    prog, init, _ = lowered("tiny-llama", workers=2, fuse=True)
    ex = TritonExecutor(prog, init, check=False)
    assert not any(v.flag("scale") for v in ex.table.variants)
    assert "HAS_SCALE" not in ex.emit_source(tmp_path / "k.py").read_text()
    q, qi, _ = lowered("tiny-llama", workers=2, fuse=True, weights="int8")
    assert "HAS_SCALE=True" in TritonExecutor(q, qi, check=False).emit_source(tmp_path / "q.py").read_text()


@DEVICE_TRITON
@pytest.mark.parametrize("weights,blocks", [
    ("int8", dict(gemv_n=16, gemv_k=128, gemv_unroll=8, x_stage=True, w_preload=1024)),
    ("fp8", dict(gemv_n=16, gemv_k=128, gemv_unroll=8, x_stage=True, w_preload=0)),
    ("int8", dict(gemv_n=64, gemv_k=128, gemv_stages=5, gemv_tma=True)),
    ("q8_0", dict(gemv_n=16, gemv_k=128, gemv_unroll=8, x_stage=True, w_preload=1024)),
    ("q8_0", dict(gemv_n=64, gemv_k=128, gemv_stages=5, gemv_tma=True)),
    ("int8", dict(gemv_n=32, gemv_k=256, gemv_stages=6, gemv_tma=True, q_tma=True, q_gemv_n=64)),
    ("int8", dict(gemv_n=16, gemv_k=128, gemv_unroll=8, x_stage=True, int8_convert="cvt")),
    ("int8", dict(gemv_n=32, gemv_k=256, gemv_stages=6, int8_convert="magic")),
    ("fp8", dict(gemv_n=32, gemv_k=256, gemv_stages=6, gemv_tma=True, q_tma=True)),
])
def test_device_triton_compiles_quantized_gemv(tmp_path, weights, blocks):
    """Fused bf16 tiny Llama with int8 / fp8 weights at 8 warps compiles for sm_90 with the
    GPU machines' Triton: vector weight loads, no spills; with gemv_tma the quantized tiles
    stream through register loads (TMA copies only for the float weights) unless q_tma says
    otherwise; int8_convert prmt (the default) or magic leaves no int8 -> fp32 conversion, and
    prmt's PTX is there for int8 and q8_0 weights unless another conversion is asked for."""
    from lowering.triton.runtime import Blocks

    prog, init, _ = lowered("tiny-llama", workers=3, dtype="bf16", fuse=True, **weight_knobs(weights))
    ex = TritonExecutor(prog, init, check=False, num_warps=8, blocks=Blocks(**blocks))
    version, rep = _device_triton_compile(ex, tmp_path)
    assert rep["vector_loads"], (version, rep)
    if blocks.get("q_tma"):  # the quantized tiles too stream through TMA copies
        plain = TritonExecutor(prog, init, check=False, num_warps=8, blocks=Blocks(**dict(blocks, q_tma=False)))
        assert rep["tma_copies"] > _device_triton_compile(plain, tmp_path / "plain")[1]["tma_copies"], rep
    cvt = blocks.get("int8_convert", "prmt")
    if weights != "fp8":  # int8 -> fp32 conversions only with int8_convert cvt
        assert (rep["int8_to_f32"] == 0) == (cvt != "cvt"), rep
    assert (rep["int8_prmt"] > 0) == (weights != "fp8" and cvt == "prmt"), rep
    if rep["regs"] is not None:
        assert rep["regs"] <= 255 and rep["local_bytes"] == 0, (version, rep)


def test_table_refuses_a_scale_on_a_float_weight():
    """A float-weight GEMV with a bias and one more input is refused, not read as scaled."""
    import dataclasses

    from lowering.triton.layout import TableError
    from lowering.triton.table import build_table

    prog, _, _ = lowered("tiny-llama", workers=1, weights="int8")
    p = prog.copy()
    i = next(k for k, t in enumerate(p.tasks) if t.id == "l0.q.t0.r0")
    t = p.tasks[i]
    for j, b in enumerate(p.buffers):
        if b.name == t.ins[1].buffer:
            p.buffers[j] = dataclasses.replace(b, dtype="f32")
    p.tasks[i] = dataclasses.replace(t, ins=tuple(t.ins) + (t.ins[-1],))
    with pytest.raises(TableError, match=r"l0\.q\.t0\.r0: gemv takes 2\.\.3 inputs, got 4"):
        build_table(p, 0, [[q for q in p.tasks if q.rank == 0]])
