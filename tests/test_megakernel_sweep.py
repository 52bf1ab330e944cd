"""bench/megakernel_sweep.py's grid (CPU): every knob is an axis with ``amk bench``'s spelling, and
a point's config is what ``amk bench`` would read from the same flags, so a knob cannot be
dropped or misspelled between the sweep, the config and the row."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lowering.config import KernelConfig, LoweringConfig
from lowering.knobs import knobs_of

_spec = importlib.util.spec_from_file_location("megakernel_sweep",
                                               Path(__file__).parent.parent / "bench" / "megakernel_sweep.py")
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def test_grid_is_the_product_of_named_axes():
    from amk.bench import bench_config

    args = sweep.parser().parse_args(["config:llama-3.2-1b", "--workers", "132", "--tile", "16",
                                      "--policy", "balanced,stage", "--num-warps", "8", "--gemv-block", "16x128",
                                      "--late-append", "0,1", "--roll", "1", "--attention-block", "64",
                                      "--fuse", "1"])
    pts = sweep.sweep_points(args)
    assert len(pts) == 4
    assert {(p["policy"], p["late_append"]) for p in pts} == {
        ("balanced", False), ("balanced", True), ("stage", False), ("stage", True)}
    for p in pts:
        cfg = bench_config(sweep.point_args(args, p), 114)
        assert cfg.lowering.workers == 132 and cfg.lowering.fuse and cfg.lowering.dtype == "bf16"
        assert cfg.kernel.roll == 1 and cfg.kernel.attention_block == 64 and cfg.kernel.gemv_block == "16x128"
    assert sweep.varying_knobs(pts) == {"policy", "late_append"}
    assert sweep.tag_of(pts[1], {"policy", "late_append"}) == "policy=balanced late_append=1"


def test_every_knob_is_an_axis_with_the_bench_spelling():
    """Each knob of both config classes has a sweep flag, spelled as in amk bench."""
    from amk.cli import build_parser

    sweep_flags = {a.option_strings[0] for a in sweep.parser()._actions if a.option_strings}
    bench = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "bench" in a.choices)
    bench_flags = {a.option_strings[0] for a in bench.choices["bench"]._actions if a.option_strings}
    for cls in (LoweringConfig, KernelConfig):
        for k in knobs_of(cls):
            assert k.flag in sweep_flags and k.flag in bench_flags, k.flag


def test_a_point_whose_knob_does_nothing_is_refused_as_amk_bench_would():
    from amk.bench import bench_config
    from ground.errors import AmkError

    args = sweep.parser().parse_args(["m", "--x-stage", "0,1"])
    pts = sweep.sweep_points(args)
    with pytest.raises(AmkError, match="--x-reuse 1 does nothing without --x-stage 1"):
        bench_config(sweep.point_args(args, pts[0]), 132)
    assert bench_config(sweep.point_args(args, pts[1]), 132).kernel.x_stage is True


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
    assert {(p["tile_reduce"], p["allreduce"]) for p in pts} == {
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
