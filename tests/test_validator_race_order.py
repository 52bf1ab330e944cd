"""The race checks list overlapping pairs unordered first and order them (the flat sweep's
order, which decides which findings are reported and in what order) only when there is a
finding to report: an accepted program takes one unordered pass, a rejected one gets the
findings of the ordered pass."""

from __future__ import annotations

from ir.examples import allreduce
from tests.test_validator import copy_chain, no_credit_allreduce
from validator import races, validate


def _spy(monkeypatch) -> list[bool]:
    calls: list[bool] = []
    real = races._check

    def spy(ix, win, hb, rep):
        calls.append(rep.ordered)
        return real(ix, win, hb, rep)

    monkeypatch.setattr(races, "_check", spy)
    return calls


def _as_data(v) -> list:
    return [(f.cls, f.message, f.tasks, f.buffers, f.witness) for f in v.errors]


def test_accepted_program_takes_one_unordered_pass(monkeypatch):
    calls = _spy(monkeypatch)
    assert validate(allreduce(3, 8, reuse="credit")).ok
    assert calls == [False]


def test_rejected_program_reports_the_ordered_findings(monkeypatch):
    for prog, cls in ((no_credit_allreduce(2), "ReceiveBufferReuseWithoutCredit"),
                      (copy_chain(write=(0, 12)), "PartialCoverageRead")):
        monkeypatch.setattr(races, "check", lambda ix, win, hb: races._check(
            ix, win, hb, races._Reporter()))  # ordered from the start, as before
        ordered = _as_data(validate(prog))
        monkeypatch.undo()
        calls = _spy(monkeypatch)
        v = validate(prog)
        monkeypatch.undo()
        assert not v.ok and calls == [False, True]
        assert cls in {f.cls for f in v.errors}
        assert _as_data(v) == ordered
