"""The knob surface (lowering.config, lowering.knobs): each bad field named with its flag and
what it allows, every combination that does nothing refused in one line naming the flags, one
config file with a lowering and a kernel part (the older lowering-only form still read), and
``--config FILE`` overridden by the flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest

from ground.errors import AmkError
from lowering.config import AmkConfig, KernelConfig, LoweringConfig, config_from_args, sets
from lowering.knobs import add_flags, inert, knobs_of, without_inert


@pytest.mark.parametrize("field,value,message", [
    ("tile", 0, "field 'tile' (--tile): must be an integer >= 1, got 0"),
    ("attn_split", -2, "field 'attn_split' (--attn-split): must be an integer >= 1, got -2"),
    ("tile_qkv", -1, "field 'tile_qkv' (--tile-qkv): must be 0 (tile) or an integer >= 1, got -1"),
    ("workers", True, "field 'workers' (--workers): expected an integer, got True"),
    ("tile_reduce", 1.5, "field 'tile_reduce' (--tile-reduce): expected an integer, got 1.5"),
    ("policy", "greedy", "field 'policy' (--policy): expected one of round_robin, balanced, stage, got 'greedy'"),
    ("fuse", 1, "field 'fuse' (--fuse): expected true or false, got 1"),
])
def test_integer_fields(field, value, message):
    with pytest.raises(AmkError) as e:
        LoweringConfig(**{field: value}).validate("cfg.json")
    assert str(e.value) == f"cfg.json: {message}"
    assert e.value.exit_code == 2


def test_integer_fields_at_their_minimum_are_accepted():
    cfg = LoweringConfig(tile=1, workers=1, max_seq=1, attn_split=1, tile_qkv=0,
                         tile_gate_up=0, tile_lm_head=0, tile_reduce=0)
    assert cfg.validate() is cfg


@pytest.mark.parametrize("kw,needle", [
    (dict(gemv_block="16by512"), "field 'gemv_block' (--gemv-block): expected NxK"),
    (dict(gemv_block="12x512"), "N must be a power of two, got 12"),
    (dict(attention_block=48), "(--attention-block): must be a power of two >= 1, got 48"),
    (dict(gemv_stages=9), "(--gemv-stages): must be an integer in 1..8, got 9"),
    (dict(prefetch=9), "(--prefetch): must be 0 (off) or an integer in 1..8, got 9"),
    (dict(gemv_unroll=3), "(--gemv-unroll): expected one of 1, 2, 4, 8, 16, got 3"),
    (dict(maxnreg=300), "(--maxnreg): must be 0 (automatic) or an integer in 24..255, got 300"),
    (dict(x_chunk=3000), "(--x-chunk): must be a power of two >= 1, got 3000"),
    (dict(prefetch=1, prefetch_cap=1000), "(--prefetch-cap): must be 0 (the whole tile) or a multiple of 16"),
    (dict(roll=9), "(--roll): must be 0 (off) or an integer in 1..8, got 9"),
    (dict(ring_rows=3, ring=2), "(--ring-rows): must be a power of two in 1..64, got 3"),
    (dict(gemv_block="16x128", w_preload=64), "--w-preload): must be 0 or a power of two of at least "
                                              "--gemv-block K = 128"),
    (dict(gemv_tma=True), "--gemv-tma 1 needs --gemv-stages 2..8"),
    (dict(gemv_tma=True, gemv_stages=4, gemv_block="64x512"), "--gemv-tma 1 needs N and K of --gemv-block at most 256"),
])
def test_kernel_fields_name_the_flag(kw, needle):
    with pytest.raises(AmkError) as e:
        KernelConfig(**kw).validate("k.json")
    assert needle in str(e.value) and str(e.value).startswith("k.json: "), str(e.value)


# every combination in which a knob does nothing, and the flags its message names
INERT = [
    (LoweringConfig, dict(late_append=True), None, "--late-append 1 does nothing without --fuse 1"),
    (LoweringConfig, dict(fuse_reduce=True), 2, "--fuse-reduce 1 does nothing without --fuse 1"),
    (LoweringConfig, dict(fuse=True, fuse_reduce=True, allreduce="twoshot"), 2,
     "--fuse-reduce 1 does nothing without --allreduce oneshot or fused"),
    (LoweringConfig, dict(fuse=True, fuse_reduce=True), 1, "--fuse-reduce 1 does nothing at one rank (--tp 1)"),
    (LoweringConfig, dict(tile_reduce=128), 1, "--tile-reduce 128 does nothing at one rank (--tp 1)"),
    (LoweringConfig, dict(allreduce="twoshot"), 1, "--allreduce twoshot does nothing at one rank (--tp 1)"),
    (KernelConfig, dict(x_stage=False), None, "--x-reuse 1 does nothing without --x-stage 1: set --x-stage 1 "
                                              "or --x-reuse 0"),
    (KernelConfig, dict(prefetch_cap=65536), None, "--prefetch-cap 65536 does nothing without --prefetch >= 1"),
    (KernelConfig, dict(prefetch_rows=16), None, "--prefetch-rows 16 does nothing without --prefetch >= 1"),
    (KernelConfig, dict(ring_rows=16), None, "--ring-rows 16 does nothing without --ring >= 1"),
    (KernelConfig, dict(ring_cols=1024), None, "--ring-cols 1024 does nothing without --ring >= 1"),
    (KernelConfig, dict(gemv_unroll=8, gemv_stages=3), None, "--gemv-unroll 8 does nothing without --gemv-stages 1"),
]


@pytest.mark.parametrize("cls,kw,ranks,message", INERT, ids=[m.split(" does")[0] for *_, m in INERT])
def test_combinations_that_do_nothing_are_refused(cls, kw, ranks, message):
    cfg = cls(**kw)
    with pytest.raises(AmkError) as e:
        cfg.validate("c.json", ranks=ranks)
    assert str(e.value).startswith(f"c.json: {message}") and "\n" not in str(e.value), str(e.value)
    assert e.value.exit_code == 2
    cfg.validate(ranks=ranks, combinations=False)  # the values themselves are fine
    # set back to its default, the knob that did nothing leaves a valid config
    without_inert(cfg, ranks).validate(ranks=ranks)


def test_knobs_that_act_are_accepted():
    LoweringConfig(fuse=True, late_append=True, fuse_reduce=True, allreduce="fused", tile_reduce=256).validate(
        ranks=2)
    KernelConfig(prefetch=1, prefetch_cap=65536, prefetch_rows=16, ring=3, ring_rows=16, ring_cols=1024,
                 gemv_unroll=8).validate()
    KernelConfig(x_stage=False, x_reuse=False, gemv_stages=4, gemv_tma=True, gemv_block="64x128").validate()
    assert list(inert(LoweringConfig(), 1)) == [] and list(inert(KernelConfig())) == []


def test_inert_lowering_knobs_lower_to_the_same_program():
    """A knob refused for doing nothing really does nothing: the lowering gives the same
    program with it and with it set back to its default."""
    from lowering.lower import lower
    from search.space import program_fingerprint
    from tests.test_lowering import graph_of

    g = graph_of("tiny-llama", layers=1)
    for ranks, kw in ((2, dict(late_append=True)), (2, dict(fuse_reduce=True)),
                      (2, dict(fuse=True, fuse_reduce=True, allreduce="twoshot")), (1, dict(fuse=True, fuse_reduce=True)),
                      (1, dict(tile_reduce=32)), (1, dict(allreduce="fused"))):
        cfg = LoweringConfig(tile=32, workers=2, max_seq=16, **kw)
        assert list(inert(cfg, ranks)), kw
        a, b = lower(g, ranks, config=cfg), lower(g, ranks, config=without_inert(cfg, ranks))
        assert program_fingerprint(a) == program_fingerprint(b), kw


def _write(tmp_path, obj, name="c.json"):
    p = tmp_path / name
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return p


def test_one_file_holds_both_parts_and_the_lowering_only_form_still_loads(tmp_path):
    both = _write(tmp_path, {"lowering": {"tile": 16, "fuse": True}, "kernel": {"gemv_block": "16x128", "prefetch": 1}})
    cfg = AmkConfig.from_file(both)
    assert (cfg.lowering.tile, cfg.lowering.fuse, cfg.kernel.gemv_n, cfg.kernel.gemv_k, cfg.kernel.prefetch) == \
        (16, True, 16, 128, 1)
    assert AmkConfig.from_json(cfg.to_json()) == cfg  # what to_json writes reads back
    assert LoweringConfig.from_file(both) == cfg.lowering and KernelConfig.from_file(both) == cfg.kernel
    flat = _write(tmp_path, {"tile": 16, "fuse": True}, "flat.json")
    assert AmkConfig.from_file(flat) == AmkConfig(LoweringConfig(tile=16, fuse=True))
    assert AmkConfig.from_file(_write(tmp_path, {"kernel": {"num_warps": 4}}, "k.json")).lowering == LoweringConfig()


@pytest.mark.parametrize("obj,needle", [
    ({"tile": 16, "gemv_stages": 2}, "unknown field 'gemv_stages' ('gemv_stages' is a kernel knob: put it under "
                                     "\"kernel\")"),
    ({"lowering": {"tile": 16}, "kernel": {"tile": 8}}, "unknown field 'tile' ('tile' is a lowering knob"),
    ({"lowering": [1]}, "\"lowering\" must be a JSON object of lowering knobs, got list"),
    ([1, 2], "expected a JSON object {\"lowering\": {...}, \"kernel\": {...}}, got list"),
    ({"lowering": {"late_append": True}}, "--late-append 1 does nothing without --fuse 1"),
    ('{"lowering": {"tile": }}', ":1:23: invalid JSON"),
])
def test_bad_files_are_one_line_naming_the_file(tmp_path, obj, needle):
    p = _write(tmp_path, obj)
    with pytest.raises(AmkError) as e:
        AmkConfig.from_file(p)
    assert str(e.value).startswith(str(p)) and needle in str(e.value), str(e.value)


def _parser():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    add_flags(ap, LoweringConfig)
    add_flags(ap, KernelConfig)
    return ap


def test_flags_override_the_file(tmp_path):
    p = _write(tmp_path, {"lowering": {"tile": 16, "max_seq": 512}, "kernel": {"gemv_block": "16x128", "x_stage": False,
                                                                              "x_reuse": False}})
    args = _parser().parse_args(["--config", str(p), "--tile", "32", "--gemv-block", "32x256", "--fuse", "1"])
    cfg = config_from_args(args, "amk test", defaults={"workers": 132, "max_seq": 64})
    assert (cfg.lowering.tile, cfg.lowering.fuse, cfg.lowering.workers, cfg.lowering.max_seq) == (32, True, 132, 512)
    assert (cfg.kernel.gemv_block, cfg.kernel.x_stage) == ("32x256", False)
    assert sets(args, "max_seq") and sets(args, "fuse") and not sets(args, "workers")
    # no file: the flags alone
    assert config_from_args(_parser().parse_args(["--num-warps", "4"]), "amk test").kernel.num_warps == 4


@pytest.mark.parametrize("argv,needle", [
    (["--gemv-stages", "9"], "amk test: --gemv-stages: must be an integer in 1..8, got 9"),
    (["--x-stage", "0"], "amk test: --x-reuse 1 does nothing without --x-stage 1"),
    (["--fuse-reduce", "1", "--fuse", "1"], "amk test: --fuse-reduce 1 does nothing at one rank (--tp 1)"),
])
def test_flag_errors_name_the_flag(argv, needle):
    with pytest.raises(AmkError) as e:
        config_from_args(_parser().parse_args(argv), "amk test", ranks=1)
    assert str(e.value).startswith(needle), str(e.value)


def test_bool_flags_take_0_or_1():
    assert _parser().parse_args(["--fuse", "1", "--x-stage", "false"]).x_stage is False
    with pytest.raises(SystemExit):
        _parser().parse_args(["--fuse", "yes"])


def test_every_kernel_knob_reaches_blocks():
    """KernelConfig -> Blocks (lowering/triton/blocks.py) carries every kernel knob but the warps,
    and a Blocks reads back to the same knobs."""
    from lowering.triton.blocks import Blocks, kernel_options

    kc = KernelConfig(num_warps=4, gemv_block="16x1024", gemv_unroll=2, attention_block=64, prefetch=2,
                      prefetch_cap=4096, prefetch_rows=8, roll=1, row_prefetch=False, x_stage=False, x_reuse=False,
                      x_chunk=1024, w_preload=2048, lean_release=False, ring=2, ring_rows=8, ring_cols=512,
                      maxnreg=128, elide_waits=False, coalesce_signals=False)
    opts = kernel_options(kc)
    b = opts["blocks"]
    assert opts["num_warps"] == 4 and (b.gemv_n, b.gemv_k, b.attention_t) == (16, 1024, 64)
    assert b.kernel(num_warps=4) == kc
    for f in fields(KernelConfig):
        if f.name not in ("num_warps", "gemv_block", "attention_block"):
            assert getattr(b, f.name) == getattr(kc, f.name), f.name
    from lowering.triton.errors import TritonError

    with pytest.raises(TritonError, match=r"field 'maxnreg' \(--maxnreg\)"):
        Blocks(maxnreg=8)
    Blocks(x_stage=False)  # a library Blocks is not refused for a knob doing nothing


def test_every_knob_has_one_description_and_flag():
    seen = set()
    for cls in (LoweringConfig, KernelConfig):
        for k in knobs_of(cls):
            assert k.help.endswith(".") and "\n" not in k.help, k.name
            assert k.flag not in seen
            seen.add(k.flag)
            assert k.problem(k.default) is None, k.name
    assert len(seen) == len(fields(LoweringConfig)) + len(fields(KernelConfig))
