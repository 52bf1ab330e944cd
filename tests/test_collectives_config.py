"""The knobs of the lowered communication patterns (lowering.config.CollectiveConfig): one
declaration each, flags made from it, one-line errors naming the field and its flag, a config
file's "collective" part next to the lowering and kernel parts."""

from __future__ import annotations

import argparse
import json

import pytest

from ground.errors import AmkError
from lowering.config import AmkConfig, CollectiveConfig, collective_from_args
from lowering.knobs import add_flags, knobs_of


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="amk dist")
    ap.add_argument("--config")
    add_flags(ap, CollectiveConfig)
    return ap


def test_defaults_are_valid_and_every_knob_has_a_flag_and_a_description():
    assert CollectiveConfig().validate() == CollectiveConfig()
    actions = {a.dest: a for a in _parser()._actions}
    for k in knobs_of(CollectiveConfig):
        assert actions[k.name].option_strings == [k.flag] and k.help
        assert actions[k.name].help.replace("%%", "%").startswith(k.help.rstrip("."))


@pytest.mark.parametrize("argv,message", [
    (["--tile-m", "-1"], "amk dist: --tile-m: must be 0 (by size) or an integer >= 1, got -1"),
    (["--chunks", "65"], "amk dist: --chunks: must be an integer in 1..64, got 65"),
    (["--allreduce", "ring"], "amk dist: --allreduce: expected one of oneshot, twoshot, got 'ring'"),
    (["--allreduce", "twoshot"], "amk dist: --allreduce twoshot does nothing for allgather_matmul (only for "
                                 "matmul_allreduce): set --allreduce oneshot"),
    (["--whole-k", "1"], "--whole-k 1 does nothing for allgather_matmul (only for ulysses_combine)"),
    (["--reduce-rows", "8"], "--reduce-rows 8 does nothing for allgather_matmul"),
    (["--direct", "1"], "--direct 1 does nothing for allgather_matmul"),
])
def test_flags_are_checked_in_one_line(argv, message):
    args = _parser().parse_args(argv)
    with pytest.raises(AmkError) as ei:
        collective_from_args(args, "amk dist", "allgather_matmul")
    assert message in str(ei.value) and "\n" not in str(ei.value) and ei.value.exit_code == 2


def test_direct_stores_need_the_two_shot_all_reduce():
    args = _parser().parse_args(["--direct", "1"])
    with pytest.raises(AmkError, match="--direct 1 does nothing for matmul_allreduce with --allreduce oneshot"):
        collective_from_args(args, "amk dist", "matmul_allreduce")
    assert collective_from_args(args, "amk dist", "matmul_reduce_scatter").direct
    args = _parser().parse_args(["--direct", "1", "--allreduce", "twoshot"])
    assert collective_from_args(args, "amk dist", "matmul_allreduce").direct


def test_a_knob_for_the_pattern_is_accepted():
    args = _parser().parse_args(["--allreduce", "twoshot", "--reduce-rows", "8", "--workers", "16"])
    cfg = collective_from_args(args, "amk dist", "matmul_allreduce")
    assert (cfg.allreduce, cfg.reduce_rows, cfg.workers) == ("twoshot", 8, 16)
    assert collective_from_args(_parser().parse_args(["--whole-k", "1"]), "amk dist", "ulysses_combine").whole_k


def test_one_file_holds_the_collective_part_next_to_the_others(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"collective": {"tile_m": 64, "chunks": 2}, "kernel": {"num_warps": 4},
                             "lowering": {"tile": 16}}))
    assert CollectiveConfig.from_file(f) == CollectiveConfig(tile_m=64, chunks=2)
    both = AmkConfig.from_file(f)  # the model config ignores the collective part
    assert both.kernel.num_warps == 4 and both.lowering.tile == 16
    args = _parser().parse_args(["--config", str(f), "--tile-m", "32"])
    assert collective_from_args(args, "amk dist", "allgather_matmul") == CollectiveConfig(tile_m=32, chunks=2)
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"tile_n": 64}))
    assert CollectiveConfig.from_file(flat).tile_n == 64


@pytest.mark.parametrize("obj,message", [
    ({"collective": {"tile": 64}}, "unknown field 'tile'; known collective fields: allreduce, chunks"),
    ({"collective": {"tile_m": "big"}}, "field 'tile_m' (--tile-m): expected an integer, got 'big'"),
    ({"collective": [1]}, "\"collective\" must be a JSON object of collective knobs, got list"),
    ({"collective": {"allreduce": "twoshot"}}, "--allreduce twoshot does nothing for ulysses_combine"),
])
def test_bad_files_are_one_line_naming_the_file(tmp_path, obj, message):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(obj))
    with pytest.raises(AmkError) as ei:
        CollectiveConfig.from_file(f, "ulysses_combine")
    assert str(ei.value).startswith(str(f)) and message in str(ei.value) and "\n" not in str(ei.value)


def test_bad_json_names_line_and_column(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text('{"collective": {"tile_m": 64,}}')
    with pytest.raises(AmkError, match=r"bad.json:1:30: invalid JSON"):
        CollectiveConfig.from_file(f)
