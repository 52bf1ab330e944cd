"""bench/megakernel_sweep.py's grid (CPU): every knob flag is a named axis; a point's lowering
knobs build a LoweringConfig and its Blocks knobs a Blocks, so a new knob cannot be dropped or
misaligned between the flag, the config and the row."""
from __future__ import annotations

import importlib.util
from dataclasses import fields
from pathlib import Path

from lowering.config import LoweringConfig
from lowering.triton.runtime import Blocks

_spec = importlib.util.spec_from_file_location("megakernel_sweep",
                                               Path(__file__).parent.parent / "bench" / "megakernel_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_grid_is_the_product_of_named_axes():
    args = sweep.parser().parse_args(["config:llama-3.2-1b", "--workers", "132", "--tile", "16",
                                      "--policy", "balanced,stage", "--warps", "8", "--gemv-block", "16x128",
                                      "--late-append", "0,1", "--roll", "1", "--att-t", "64", "--fuse", "1"])
    pts = sweep.sweep_points(args)
    assert len(pts) == 4
    assert {(p["config"]["policy"], p["config"]["late_append"]) for p in pts} == {
        ("balanced", False), ("balanced", True), ("stage", False), ("stage", True)}
    for p in pts:
        cfg = LoweringConfig(dtype="bf16", **p["config"]).validate()
        assert cfg.workers == 132 and cfg.fuse
        b = Blocks(gemv_n=16, gemv_k=128, **p["blocks"])
        assert b.roll == 1 and b.attention_t == 64
    assert sweep.varying_knobs(pts) == {"policy", "late_append"}
    assert sweep.tag_of(pts[1], {"policy", "late_append"}) == "policy=balanced late_append=1"


def test_every_lowering_knob_is_an_axis():
    """Each LoweringConfig field the sweep can set, and each Blocks axis, names a real field."""
    lc = {f.name for f in fields(LoweringConfig)}
    assert set(sweep.LOWERING_AXES) == lc - {"dtype", "max_seq", "allreduce"}
    bf = {f.name for f in fields(Blocks)}
    assert {f for f, _ in sweep.BLOCKS_AXES.values()} <= bf
