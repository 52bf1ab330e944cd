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
    assert set(sweep.LOWERING_AXES) == lc - {"dtype", "max_seq"}
    bf = {f.name for f in fields(Blocks)}
    assert {f for f, _ in sweep.BLOCKS_AXES.values()} <= bf


def test_tp_spawns_one_process_per_rank(monkeypatch):
    """``--tp R`` (outside a rank process) hands the same command line to amk.launch.spawn with
    this script as the program, for the sweep and for the profiler's ``--spawn``."""
    import importlib.util
    import sys
    from pathlib import Path

    from amk import launch

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("profile_megakernel", root / "bench" / "profile_megakernel.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    calls = []
    monkeypatch.setattr(launch, "in_spawned_rank", lambda: False)
    monkeypatch.setattr(launch, "spawn", lambda argv, ranks, prefix=None: calls.append((argv, ranks, prefix)) or 7)
    argv = ["config:llama-3.1-8b", "--tp", "2", "--tile-reduce", "0,256"]
    assert sweep.main(argv) == 7
    assert calls[-1][0] == argv and calls[-1][1] == 2
    assert calls[-1][2][0] == sys.executable and calls[-1][2][1].endswith("megakernel_sweep.py")
    argv = ["config:llama-3.1-8b", "--tp", "4", "--spawn", "--tile-reduce", "256"]
    assert prof.main(argv) == 7
    assert calls[-1][0] == argv and calls[-1][1] == 4 and calls[-1][2][1].endswith("profile_megakernel.py")
    pts = sweep.sweep_points(sweep.parser().parse_args(["m", "--tile-reduce", "0,256", "--allreduce", "oneshot,twoshot"]))
    assert {(p["config"]["tile_reduce"], p["config"]["allreduce"]) for p in pts} == {
        (0, "oneshot"), (0, "twoshot"), (256, "oneshot"), (256, "twoshot")}


def test_free_symmetric_refuses_a_foreign_tensor():
    """DistContext.free_symmetric only gives back tensors from symmetric_bytes (checked before
    any NVSHMEM call, so the error names the mistake)."""
    import pytest
    import torch

    from lowering.triton.dist import DistContext, DistError

    ctx = DistContext(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(DistError, match="not allocated by symmetric_bytes"):
        ctx.free_symmetric(torch.zeros(4))
