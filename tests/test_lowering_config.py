"""LoweringConfig.validate: each bad field named with what it allows."""

from __future__ import annotations

import pytest

from ground.errors import AmkError
from lowering.config import LoweringConfig


@pytest.mark.parametrize("field,value,message", [
    ("tile", 0, "field 'tile': must be >= 1, got 0"),
    ("attn_split", -2, "field 'attn_split': must be >= 1, got -2"),
    ("tile_qkv", -1, "field 'tile_qkv': must be >= 0 (0: the same as tile), got -1"),
    ("workers", True, "field 'workers': expected an integer, got True"),
    ("tile_reduce", 1.5, "field 'tile_reduce': expected an integer, got 1.5"),
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
