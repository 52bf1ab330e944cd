"""Tests of the adversarial corpus (validator/corpus.py) and `amk validate-corpus`."""

from __future__ import annotations

import copy
import json
import random

import pytest

from amk.cli import main
from validator import corpus, oracle

REQUIRED = {
    "cross_rank_wait_cycle", "queue_inversion", "unsatisfiable_threshold",
    "partial_wait_shared_counter", "dropped_wait", "dropped_signal", "missing_quiet",
    "fence_across_ranks", "put_signal_data_overrun", "recv_reuse_without_credit",
    "overlapping_unordered_writes", "partial_coverage_read", "region_out_of_range",
    "param_out_of_range", "collective_order_mismatch", "counter_reuse_without_epochs",
    "workers_beyond_coresidency",
    # the validator's contract on signals and thresholds (docs/ir.md)
    "put_signal_relay", "wait_zero_threshold", "threshold_beyond_range",
    "safe_put_signal_other_rank", "safe_credit_zero_threshold",
}


@pytest.fixture(scope="module")
def hand():
    seeds, info = corpus.seed_programs(include_lowered=False)
    return seeds


def test_classes_cover_the_issue():
    names = [c.name for c in corpus.CLASSES]
    assert len(names) == len(set(names)) >= 20
    assert REQUIRED <= set(names)
    assert any(c.intent == "safe" for c in corpus.CLASSES)
    assert {c.intent for c in corpus.CLASSES} == {"safe", "unsafe"}


@pytest.mark.parametrize("cls", corpus.CLASSES, ids=lambda c: c.name)
def test_each_class_applies_and_leaves_its_input_alone(cls, hand):
    rng = random.Random(cls.name)
    made = 0
    for label, prog in hand:
        before = copy.deepcopy(prog)
        out = cls.fn(prog, rng)
        assert prog == before, f"{cls.name} modified its input {label}"
        if out is not None:
            assert out is not prog
            made += 1
    assert made > 0, f"{cls.name} applies to no seed"


@pytest.mark.parametrize("cls", [c for c in corpus.CLASSES if c.intent == "safe"],
                         ids=lambda c: c.name)
def test_safe_classes_stay_safe(cls, hand):
    rng = random.Random(7)
    checked = 0
    for label, prog in hand[::3]:
        out = cls.fn(prog, rng)
        if out is None:
            continue
        res = oracle.check(out, runs=16, seed=1)
        assert res.safe, (label, [p.message for p in res.problems])
        checked += 1
    assert checked


@pytest.mark.parametrize("name", sorted({n for n in REQUIRED if not n.startswith("safe_")} | {
                                                     "missing_quiet", "early_signal",
                                                     "remote_read", "counter_overflow",
                                                     "non_monotone_signal",
                                                     "wait_previous_epoch"}))
def test_unsafe_classes_break_schedules(name, hand):
    cls = corpus.CLASS_MAP[name]
    rng = random.Random(11)
    unsafe = total = 0
    for label, prog in hand:
        out = cls.fn(prog, rng)
        if out is None:
            continue
        total += 1
        unsafe += not oracle.check(out, runs=16, seed=2).safe
    # Some mutations land where other synchronisation already covers them (a dropped wait
    # implied by queue order is still safe): most, not all, must break the schedule.
    assert unsafe >= max(1, total // 2), (unsafe, total)


@pytest.mark.parametrize("name", ["put_signal_relay", "wait_zero_threshold",
                                  "threshold_beyond_range", "safe_put_signal_other_rank",
                                  "safe_credit_zero_threshold"])
def test_signal_and_threshold_classes_agree_with_the_oracle(name, hand):
    """The classes probing the validator's contract on signals to other ranks and on
    epoch-relative thresholds: no false accept, and the safe ones are all accepted."""
    from validator import validate

    cls = corpus.CLASS_MAP[name]
    rng = random.Random(5)
    total = 0
    for label, prog in hand:
        out = cls.fn(prog, rng)
        if out is None:
            continue
        total += 1
        safe = oracle.check(out, runs=16, seed=3).safe
        v = validate(out)
        assert "InternalError" not in v.classes, label
        assert safe or not v.ok, f"false accept: {name} on {label}"
        if cls.intent == "safe":
            assert safe and v.ok, (label, [(f.cls, f.message) for f in v.errors])
    assert total


def test_make_item_is_deterministic(hand):
    for i in (0, 5, 33, 61):
        a, b = corpus.make_item(i, 4, hand), corpus.make_item(i, 4, hand)
        assert a[0] is b[0] and a[1] == b[1] and a[2] == b[2]
        assert a[0] is corpus.CLASSES[i % len(corpus.CLASSES)]


def test_seed_providers_are_pluggable():
    def extra():
        from validator.seeds import ring_allgather

        return [ring_allgather(5, 1)]

    def broken():
        raise RuntimeError("nope")

    seeds, info = corpus.seed_programs(include_lowered=False, extra=[extra, broken])
    assert any(label.startswith("extra:ring-ag-5r1w") for label, _ in seeds)
    assert info["providers"]["broken"].startswith("unavailable: RuntimeError")


def test_seed_checks(hand):
    validate, status = corpus._load_validator()
    sc = corpus.check_seeds(hand, 8, validate)
    assert sc["programs"] == len(hand) and sc["oracle_unsafe"] == []
    for x in sc["validator_rejects"]:  # a rejected seed must at least have a named reason
        assert x["reason"] in corpus.FR_REASONS, x


def test_small_corpus_report(tmp_path):
    report, records = corpus.run_corpus(count=2 * len(corpus.CLASSES), seed=1, jobs=1, runs=8,
                                        include_lowered=False)
    for key in ("total", "unsafe", "false_accepts", "false_rejects", "classes"):
        assert key in report
    assert report["total"] == len(records) == 2 * len(corpus.CLASSES)
    assert set(report["classes"]) == {c.name for c in corpus.CLASSES}
    for d in report["classes"].values():
        assert d["count"] == 2
        assert {"count", "unsafe", "false_accepts", "false_rejects"} <= set(d)
    assert sum(d["unsafe"] for d in report["classes"].values()) == report["unsafe"]
    assert report["false_accepts"] == 0, [r for r in records if r["outcome"] == "false_accept"]
    assert report["false_rejects"] == sum(report["false_reject_reasons"][k]["count"]
                                          for k in report["false_reject_reasons"])
    corpus.write_outputs(str(tmp_path), report, records)
    assert json.loads((tmp_path / "report.json").read_text())["total"] == report["total"]


def test_ci_sized_corpus_has_no_false_accepts():
    """The CI-sized corpus (600 schedules, real lowerings included when they exist)."""
    report, records = corpus.run_corpus(count=600, seed=0, jobs=2)
    assert report["total"] == 600 and report["unsafe"] > 0
    assert report["false_accepts"] == 0, [
        (r["i"], r["class"], r["seed"], r["oracle_classes"]) for r in records
        if r["outcome"] == "false_accept"]


def test_markdown_section_is_replaced(tmp_path):
    report, _ = corpus.run_corpus(count=len(corpus.CLASSES), seed=2, jobs=1, runs=4,
                                  include_lowered=False)
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nprose\n\n" + corpus.MD_BEGIN + "\nold\n" + corpus.MD_END + "\n\ntail\n")
    corpus.update_markdown(str(doc), report)
    text = doc.read_text()
    assert text.startswith("# Title\n\nprose\n\n") and text.endswith("\ntail\n")
    assert "\nold\n" not in text and "| safe_rename | safe |" in text
    corpus.update_markdown(str(doc), report)
    assert doc.read_text() == text


def test_jobs_do_not_change_results():
    a = corpus.run_corpus(count=40, seed=3, jobs=1, runs=4, include_lowered=False)[1]
    b = corpus.run_corpus(count=40, seed=3, jobs=2, runs=4, include_lowered=False)[1]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rs]
    assert strip(a) == strip(b)


def test_cli_validate_corpus(tmp_path, capsys):
    out = tmp_path / "out"
    md = tmp_path / "corpus.md"
    rc = main(["validate-corpus", "--count", str(len(corpus.CLASSES)), "--seed", "5", "--out",
               str(out), "--jobs", "1", "--runs", "4", "--no-lowered", "--markdown", str(md)])
    report = json.loads((out / "report.json").read_text())
    assert rc == (1 if report["false_accepts"] else 0)
    assert report["total"] == len(corpus.CLASSES)
    assert corpus.MD_BEGIN in md.read_text()
    assert "adversarial corpus" in capsys.readouterr().out
    md2 = tmp_path / "again.md"
    assert main(["validate-corpus", "--render", str(out / "report.json"), "--markdown", str(md2)]) == 0
    assert md2.read_text() == md.read_text()


@pytest.mark.parametrize("argv, msg", [
    (["--count", "0"], "--count must be at least 1"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--render", "x.json"], "--render needs --markdown"),
])
def test_cli_errors(argv, msg, capsys):
    assert main(["validate-corpus", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_cli_render_rejects_a_bad_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{\"x\": 1}")
    assert main(["validate-corpus", "--render", str(bad), "--markdown", str(tmp_path / "m.md")]) == 2
    assert "not a report" in capsys.readouterr().err
