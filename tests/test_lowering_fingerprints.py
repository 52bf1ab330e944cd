"""Lowered programs stay byte-identical across refactors (tests/lowering_fingerprints.py)."""

from __future__ import annotations

import json

import pytest

from tests import lowering_fingerprints as F


@pytest.mark.parametrize("model,tp,cfg", F.CASES, ids=[F.case_key(*c) for c in F.CASES])
def test_lowered_program_is_unchanged(model, tp, cfg):
    """The program's text form hashes to the recorded fingerprint; a change that alters a
    lowered program on purpose records new ones (``python tests/lowering_fingerprints.py
    --write``) and says why in its commit."""
    want = json.loads(F.DATA.read_text())
    assert F.fingerprint(model, tp, cfg) == want[F.case_key(model, tp, cfg)]
