"""The evaluator: A/B timing logic with a fake timer, the roofline floor, the kernel audit,
the subprocess worker (timeout, crash, restart) and the verdicts of ``decide``."""

from __future__ import annotations

import random
import time

import pytest

from search.evaluator import (
    Evaluator, ab_interleaved, below_floor, foreign_kernels, roofline_floor_ms,
    weight_bytes_per_rank,
)
from search.loop import LoopState, SearchSettings, decide
from search.proposers import Proposal
from search.records import Record
from search.space import Knob, SearchSpace
from tests.test_search_cheats import request


class FakeTimer:
    """Per-step times from the identity of the function run: ``base[fn]`` ms * (1 + noise)."""

    def __init__(self, base, noise=0.0, seed=0):
        self.base, self.noise = base, noise
        self.rng = random.Random(seed)
        self.calls = []

    def __call__(self, fn, steps):
        self.calls.append(fn)
        return [self.base[fn] * (1 + self.rng.uniform(-self.noise, self.noise))
                for _ in range(steps)]


def a():
    pass


def b():
    pass


def test_ab_keeps_a_clear_win():
    t = FakeTimer({a: 1.0, b: 0.8}, noise=0.005)
    r = ab_interleaved(a, b, t, rounds=6, steps=10, warmup=0)
    assert r.faster and r.ratio == pytest.approx(0.8, rel=0.02)
    assert r.a_ms == pytest.approx(1.0, rel=0.01) and r.b_ms == pytest.approx(0.8, rel=0.01)
    assert r.noise < 0.01 and r.threshold == pytest.approx(0.99)
    # interleaved: every round times A, B and A again, in rotating orders
    assert len(t.calls) == 18 and len(set(r.order)) == 6


def test_ab_rejects_a_win_inside_the_noise():
    t = FakeTimer({a: 1.0, b: 0.97}, noise=0.06, seed=3)
    r = ab_interleaved(a, b, t, rounds=7, steps=5, warmup=0)
    assert r.noise > 0.03 and not r.faster
    t = FakeTimer({a: 1.0, b: 0.995})  # below min_gain even without noise
    assert not ab_interleaved(a, b, t, rounds=3, steps=3, warmup=0, min_gain=0.01).faster
    t = FakeTimer({a: 1.0, b: 1.2})
    assert not ab_interleaved(a, b, t, rounds=3, steps=3, warmup=0).faster


def test_ab_cancels_slow_drift():
    """A machine that slows down over time must not favour whichever side ran first."""
    clock = {"t": 0}

    def timer(fn, steps):
        clock["t"] += 1
        base = 1.0 if fn is a else 1.0  # identical kernels
        return [base * (1 + 0.01 * clock["t"])] * steps

    r = ab_interleaved(a, b, timer, rounds=6, steps=2, warmup=0)
    assert not r.faster and abs(r.ratio - 1) < 0.02


def test_ab_bad_arguments():
    with pytest.raises(ValueError):
        ab_interleaved(a, b, FakeTimer({a: 1, b: 1}), rounds=1)
    with pytest.raises(ValueError):
        ab_interleaved(a, b, lambda fn, n: [], rounds=2, steps=1)


def test_foreign_kernels():
    assert foreign_kernels(["amk_megakernel_r0", "amk_megakernel_r0"], ["amk_"]) == []
    assert foreign_kernels(["amk_megakernel", "ampere_sgemm_128x64", "elementwise_kernel"],
                           ["amk_"]) == ["ampere_sgemm_128x64", "elementwise_kernel"]


def test_roofline_floor_counts_weights_once_and_one_embedding_row():
    from lowering.config import LoweringConfig
    from lowering.lower import lower
    from models.graph import build_graph, spec_from_config
    from models.recipes import build_config

    spec = spec_from_config(build_config("tiny-llama"))
    g = build_graph(spec, name="t")
    p = lower(g, 2, config=LoweringConfig(tile=32))
    per_rank = weight_bytes_per_rank(p)
    held = {r: 0 for r in range(2)}
    for buf in p.buffers:
        if buf.kind == "weight":
            held[buf.rank if buf.rank is not None else 0] += buf.nbytes
    emb = next(b for b in p.buffers if b.kind == "weight" and b.source and
               "embed_tokens" in b.source.key and b.rank == 0)
    # every held weight is read except all embedding rows but one (unless lm_head reads it)
    assert 0 < per_rank[0] <= held[0]
    assert per_rank[0] >= held[0] - emb.nbytes
    # tile width does not change the weight traffic
    q = lower(g, 2, config=LoweringConfig(tile=128, workers=8))
    assert weight_bytes_per_rank(q) == per_rank
    f = roofline_floor_ms(p, 1e12)
    assert f == pytest.approx(max(per_rank) / 1e12 * 1e3)
    assert roofline_floor_ms(p, 1e12, cache_bytes=10 ** 12) == 0.0
    assert below_floor(f * 0.5, f) and not below_floor(f * 0.99, f) and not below_floor(f, f)
    with pytest.raises(ValueError):
        roofline_floor_ms(p, 0)


# -- the subprocess worker ----------------------------------------------------------------
def _gone(pid: int, wait_s: float = 10.0) -> bool:
    end = time.time() + wait_s
    while time.time() < end:
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_worker_timeout_kills_and_next_candidate_gets_a_fresh_worker(tmp_path):
    ev = Evaluator(tmp_path / "worker.log", timeout_s=120)
    try:
        ok = ev.evaluate(request(), tmp_path / "t0")
        assert ok["status"] == "ok", ok.get("reason")
        pid = ok["worker_pid"]
        ok2 = ev.evaluate(request(prompt_seed=9), tmp_path / "t1")
        assert ok2["worker_pid"] == pid  # persistent: the model was loaded once
        hang = ev.evaluate(request(hooks={"executor": "tests.test_search_cheats:hanging_executor"}),
                           tmp_path / "t2", timeout_s=3)
        assert hang["status"] == "timeout" and "3 s" in hang["reason"]
        assert _gone(pid)
        again = ev.evaluate(request(), tmp_path / "t3")
        assert again["status"] == "ok" and again["worker_pid"] != pid
        crash = ev.evaluate(request(hooks={"executor": "tests.test_search_cheats:crashing_executor"}),
                            tmp_path / "t4")
        assert crash["status"] == "crash" and "exit code 3" in crash["reason"]
        assert ev.evaluate(request(), tmp_path / "t5")["status"] == "ok"
    finally:
        ev.close()


@pytest.mark.slow
def test_fresh_isolation_uses_one_process_per_candidate(tmp_path):
    ev = Evaluator(tmp_path / "worker.log", timeout_s=120, isolation="fresh")
    try:
        p1 = ev.evaluate(request(), tmp_path / "a")["worker_pid"]
        p2 = ev.evaluate(request(), tmp_path / "b")["worker_pid"]
        assert p1 != p2 and _gone(p1)
    finally:
        ev.close()


# -- decide ---------------------------------------------------------------------------------
def _space():
    return SearchSpace([Knob("tile", (32, 64), 64, True)], {})


def _inc(lat=1.0):
    return Record(0, None, "baseline", "k-0", {"tile": 64}, "KEEP", latency_ms=lat,
                  timing_source="predicted", roofline_ms=0.1)


def _ok(lat, source="predicted", floor=0.1, **timing):
    return {"status": "ok", "floor_ms": floor, "correctness": {"passed": True},
            "timing": {"source": source, "median_ms": lat, "spread_ms": 0.0, **timing}}


def test_decide_verdicts():
    sp, s = _space(), SearchSettings(model="m", out="o")
    prop = Proposal({"tile": 32}, "mutation", 0)
    st = LoopState(baseline=_inc(), incumbent=_inc(), best=_inc())
    r = decide(_ok(0.5), prop, 1, st, sp, s)
    assert r.status == "KEEP" and r.latency_ms == 0.5 and r.timing_source == "predicted"
    assert r.speedup_vs_start == 2.0 and r.pct_roofline == pytest.approx(20.0)
    assert r.incumbent_ms == 1.0
    assert decide(_ok(1.0), prop, 1, st, sp, s).status == "REVERT"
    below = decide(_ok(0.01), prop, 1, st, sp, s)  # a worker that skipped its floor check
    assert below.status == "FAIL" and "below the roofline floor" in below.reason
    assert below.latency_ms is None
    rej = decide({"status": "rejected", "reason": "validator: DeadlockCycle"}, prop, 1, st, sp, s)
    assert rej.status == "REJECTED" and rej.latency_ms is None
    assert decide({"status": "timeout", "reason": "t"}, prop, 1, st, sp, s).status == "TIMEOUT"
    assert decide({"status": "crash", "reason": "c"}, prop, 1, st, sp, s).status == "FAIL"
    nots = decide({"status": "ok", "timing": {}}, prop, 1, st, sp, s)
    assert nots.status == "FAIL" and nots.latency_ms is None
    # measured: the A/B verdict decides, not the raw medians
    ab = {"faster": False, "ratio": 0.97, "threshold": 0.95, "noise": 0.05}
    m = decide(_ok(0.9, "measured", incumbent_ms=0.93, ab=ab), prop, 1, st, sp, s)
    assert m.status == "REVERT" and m.incumbent_ms == 0.93 and "A/A noise" in m.reason
    ab = {"faster": True, "ratio": 0.8, "threshold": 0.99, "noise": 0.004}
    assert decide(_ok(0.8, "measured", incumbent_ms=1.0, ab=ab), prop, 1, st, sp, s).status == "KEEP"
    # no incumbent yet: the first correct candidate is kept as the start
    first = decide(_ok(2.0), Proposal({"tile": 64}, "baseline"), 0, LoopState(), sp, s)
    assert first.status == "KEEP" and first.speedup_vs_start == 1.0
