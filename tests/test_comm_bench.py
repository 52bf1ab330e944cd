"""bench/comm.py: argument parsing, verdict and report logic, the kernels' protocol under the
Triton interpreter (fake ranks in one tensor), a CPU compile of every kernel variant for
sm_90 (Triton + ptxas, no GPU), and on 2 GPUs a whole small run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ground.errors import AmkError
from bench import comm as C

ROOT = Path(__file__).resolve().parents[1]
interpreter_only = pytest.mark.skipif(not C.INTERPRET, reason="kernel protocol tests run under TRITON_INTERPRET=1")


# ---------------------------------------------------------------- argument parsing
def test_parse_sizes_suffixes_and_order():
    assert C.parse_sizes("4K,8K,16K,64K,256K,1M") == [4096, 8192, 16384, 65536, 262144, 1 << 20]
    assert C.parse_sizes("64, 2KB ,1MiB,64") == [64, 2048, 1 << 20]
    assert C.parse_sizes("8k") == [8192]


@pytest.mark.parametrize("text, needle", [
    ("abc", "'abc' is not a size"),
    ("4Q", "'4Q' is not a size"),
    ("-4K", "is not a size"),
    ("100", "not a positive multiple of 32 bytes"),
    ("0", "not a positive multiple"),
    ("128M", "larger than 64M"),
    (" , ", "no size given"),
])
def test_parse_sizes_rejects(text, needle):
    with pytest.raises(AmkError) as e:
        C.parse_sizes(text)
    assert needle in str(e.value) and "--sizes" in str(e.value)
    assert e.value.exit_code == 2


def test_parse_variants_and_parts():
    vs = C.parse_ar_variants("lean,mk,ld_volatile_one/st_release_sys,lean")
    assert [v.name for v in vs] == ["lean", "mk", "ld_volatile_one/st_release_sys"]
    assert (vs[0].poll.name, vs[0].signal.name) == ("ld_acquire_sys_one", "red_release_sys")
    assert vs[2].poll.code == C.P_VOL_ONE and vs[2].signal.code == C.S_ST
    for bad in ("fast", "ld_volatile_one/xx", "a/b/c", ""):
        with pytest.raises(AmkError, match="--ar-variants"):
            C.parse_ar_variants(bad)
    assert C.parse_parts("nccl,pingpong") == ["pingpong", "nccl"]
    with pytest.raises(AmkError, match="unknown part 'gemm'"):
        C.parse_parts("pingpong,gemm")


def _no_rank_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("argv, needle", [
    (["--ranks", "2", "--sizes", "4K,3"], "--sizes: 3 = 3 bytes"),
    (["--ranks", "1"], "--ranks: 1 is outside [2, 64]"),
    (["--ranks", "2", "--iters", "0"], "--iters: 0"),
    (["--ranks", "2", "--timeout-ms", "0"], "--timeout-ms"),
    (["--ranks", "2", "--parts", "x"], "unknown part 'x'"),
    (["--ranks", "2", "--json", "/nonexistent/dir/out.json"], "--json: directory"),
    ([], "give --ranks R"),
])
def test_main_bad_input_exits_2_with_one_line(argv, needle, capsys, monkeypatch):
    _no_rank_env(monkeypatch)
    assert C.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_main_argparse_errors_exit_2(monkeypatch):
    _no_rank_env(monkeypatch)
    with pytest.raises(SystemExit) as e:
        C.main(["--iters", "many"])
    assert e.value.code == 2


def test_validate_rounds_pingpong_to_whole_batches():
    st = C.validate(C.build_parser().parse_args(["--pp-iters", "101", "--pp-batch", "20"]))
    assert st.pp_iters == 120 and st.timeout_ns == 2_000_000_000
    assert st.to_json()["ar_variants"] == {"lean": "ld_acquire_sys_one/red_release_sys",
                                           "mk": "ld_acquire_sys_all/atomic_add_release_sys"}
    json.dumps(st.to_json())


# ---------------------------------------------------------------- planning and layout
@pytest.mark.parametrize("n, max_ctas, min_chunk", [
    (2048, 132, 1024), (4096, 132, 1024), (524288, 132, 1024), (48, 8, 16), (80, 2, 16), (16, 132, 1024),
    (131072, 132, 1024), (1 << 25, 132, 1024)])
def test_plan_ctas_covers_exactly(n, max_ctas, min_chunk):
    grid, chunk = C.plan_ctas(n, max_ctas, min_chunk)
    assert 1 <= grid <= max_ctas and chunk % 16 == 0
    assert (grid - 1) * chunk < n <= grid * chunk  # every CTA has work, all elements covered
    assert chunk >= min(min_chunk, n) or grid == max_ctas


def test_plan_ctas_known_values():
    assert C.plan_ctas(4096, 132, 1024) == (4, 1024)  # 8 KB: 4 CTAs of 2 KB
    assert C.plan_ctas(524288, 132, 1024) == (132, 3984)  # 1 MB: every SM
    with pytest.raises(ValueError):
        C.plan_ctas(40, 4, 16)


def test_buffer_layout_regions_disjoint_and_aligned():
    lay = C.buffer_layout(4, 1 << 19, 132)
    regions = [(lay.flags, 64), (lay.bar, 4 * 4), (lay.ctr, 4 * 4 * 132), (lay.recv, 2 * 4 * (1 << 19) * 2)]
    for (a, na), (b, _) in zip(regions, regions[1:]):
        assert a + na <= b
    assert all(off % 256 == 0 for off, _ in regions)
    assert lay.ctrl_bytes == lay.recv and lay.total >= lay.recv + 2 * 4 * (1 << 19) * 2


def test_delta_tables():
    db, di = C.delta_tables({0: -(1 << 30), 2: 1 << 31}, 3, 1)
    assert db == [-(1 << 29), 0, 1 << 30] and di == [-(1 << 28), 0, 1 << 29]
    with pytest.raises(AmkError, match="not a multiple of 32"):
        C.delta_tables({1: 48}, 2, 0)
    with pytest.raises(AmkError, match="no peer delta for rank 1"):
        C.delta_tables({}, 2, 0)


# ---------------------------------------------------------------- verdicts
def test_allreduce_check_exact_nccl_tolerance_and_stale_data():
    x = C.make_inputs(256, 4)
    ref = C.reference_sum(x)  # [3, n] fp32
    y = ref.to(torch.bfloat16)
    c = C.allreduce_check(y, ref, exact=True, ranks=4)
    assert c["ok"] and c["mismatches"] == 0 and c["max_err_ulp"] <= 0.5
    # one element one ulp off: not bit-exact, but within NCCL's tolerance
    bits = y.view(torch.int16).clone()
    bits[1, 5] += 1
    y1 = bits.view(torch.bfloat16)
    assert not C.allreduce_check(y1, ref, exact=True, ranks=4)["ok"]
    c1 = C.allreduce_check(y1, ref, exact=False, ranks=4)
    assert c1["ok"] and c1["mismatches"] == 1 and 0.5 < c1["max_err_ulp"] <= 1.5
    # a stale slot: rank 2's input of another row
    stale = (ref - x[2, 1].float() + x[2, 0].float()).to(torch.bfloat16)
    c2 = C.allreduce_check(stale, ref, exact=False, ranks=4)
    assert not c2["ok"] and c2["max_err_ulp"] > 3
    nan = y.clone()
    nan[0, 0] = float("nan")
    assert not C.allreduce_check(nan, ref, exact=False, ranks=4)["ok"]
    # broadcasting: several output rows against one reference row
    assert C.allreduce_check(y[0].expand(5, -1), ref[0], exact=True, ranks=4)["elements"] == 5 * y.shape[1]


def test_ulp_bf16():
    u = C.ulp_bf16(torch.tensor([1.0, 1.5, 2.0, 3.99, -4.0]))
    assert u.tolist() == [2 ** -7, 2 ** -7, 2 ** -6, 2 ** -6, 2 ** -5]


def test_describe_errors():
    rows = [[0] * C.ERR_W, [C.KIND_TIMEOUT, 7, 1, 6, 8, 0, 0, 0], [C.KIND_ABORTED, 7, 1, 6, 8, 0, 0, 0]]
    lines = C.describe_errors(rows, 0, "lean loop")
    assert lines == ["rank 0 lean loop CTA 1 iteration 7: timed out waiting for rank 1's signal (counter 6, needed 8)",
                     "rank 0 lean loop CTA 2 iteration 7: stopped after another CTA of this rank timed out waiting "
                     "for rank 1's signal (counter 6, needed 8)"]


def test_sync_ops_filters_ordering_instructions():
    ptx = ("\tld.param.b64 %rd1, [k_param_0];\n\t@%p2 ld.global.sys.acquire.b32 %r3, [ %rd1 + 0 ];\n"
           "\tadd.s32 %r1, %r2, 1;\n\tbar.sync 0;\n{ .reg .pred %pi; bar.red.and.pred %po, 0, %pi; }\n"
           "ld.global.v4.b32 {%r1,%r2,%r3,%r4}, [%rd2];\n@%amk_q red.release.sys.global.add.s32 [%rd6], 1;\n")
    assert C.sync_ops(ptx) == ["@%p2 ld.global.sys.acquire.b32 %r3, [ %rd1 + 0 ]", "bar.sync 0",
                               "bar.red.and.pred %po, 0, %pi", "@%amk_q red.release.sys.global.add.s32 [%rd6], 1"]


# ---------------------------------------------------------------- rows, summary, report
def _sig(poll, sig, rt, ok=True):
    return C.signal_row(C.POLLS[poll], C.SIGNALS[sig], [{"ok": ok, "detail": "d", "rt_us": rt, "event_rt_us": 9.0},
                                                        {"ok": True, "detail": "d"}])


def _ar(size, impl, variant, mode, us, ok=True):
    return C.allreduce_row(impl, variant, mode, size, [{"ok": ok, "detail": "x", "samples_us": us},
                                                       {"ok": True, "detail": "y"}])


def test_rows_and_summary_target_met():
    s1 = _sig("rmw_triton", "atomic_add_release_sys", [20.0, 21.0, 19.0])
    s2 = _sig("ld_acquire_sys_one", "red_release_sys", [3.0, 3.2, 2.8])
    s3 = _sig("ld_volatile_one", "st_release_sys", [1.0, 1.0], ok=False)  # faster but wrong: ignored
    assert s1["one_way_us"]["median"] == 10.0 and s1["round_trip_us"]["median"] == 20.0 and s1["verdict"]
    assert not s3["verdict"] and "rank 0: d" in s3["detail"]
    rows = [_ar(8192, "amk", "lean", "loop", [4.0, 5.0, 6.0]), _ar(8192, "amk", "mk", "loop", [7.0]),
            _ar(8192, "amk", "lean", "graph", [9.0]), _ar(8192, "nccl", "all_reduce", "graph", [8.0, 8.5]),
            _ar(8192, "nccl", "all_reduce", "eager", [15.0])]
    assert rows[0]["algbw_GBps"] == pytest.approx(8192 / 5e3, abs=1e-3)
    s = C.summarize([s1, s2, s3], rows)
    assert s["fastest_signal"] == {"variant": "ld_acquire_sys_one/red_release_sys", "one_way_us": 1.5}
    assert s["first_probe_signal"]["one_way_us"] == 10.0
    assert s["target_8K"] == {"amk_variant": "lean", "amk_loop_us": 5.0, "nccl_graph_us": 8.25, "met": True}


def test_summary_target_not_met_or_not_measured():
    rows = [_ar(8192, "amk", "lean", "loop", [9.0]), _ar(8192, "nccl", "all_reduce", "graph", [8.0])]
    assert C.summarize([], rows)["target_8K"]["met"] is False
    wrong = [_ar(8192, "amk", "lean", "loop", [1.0], ok=False), _ar(8192, "nccl", "all_reduce", "graph", [8.0])]
    assert C.summarize([], wrong)["target_8K"]["met"] is None
    assert C.summarize([], [_ar(4096, "amk", "lean", "loop", [1.0])])["target_8K"]["met"] is None
    assert C.summarize([], [])["fastest_signal"] is None


def test_row_without_samples_fails():
    r = C.allreduce_row("amk", "lean", "loop", 4096, [{"ok": True, "detail": "fine"}])
    assert not r["verdict"] and r["per_op_us"] is None and r["detail"] == "no timing samples"
    s = C.signal_row(C.POLLS["rmw_one"], C.SIGNALS["st_release_sys"], [{"ok": True, "detail": "idle"}])
    assert not s["verdict"]


def test_report_json_and_render():
    meta = {"bench": "comm", "command": "python bench/comm.py --ranks 2", "ranks": 2,
            "device": {"name": "NVIDIA H200", "torch": "2.11", "triton": "3.6"}, "topology": "GPU0 X NV18"}
    sig = [_sig("ld_acquire_sys_one", "red_release_sys", [3.0]), _sig("rmw_one", "st_release_sys", [2.0], ok=False)]
    ar = [_ar(8192, "amk", "lean", "loop", [4.0]), _ar(8192, "nccl", "all_reduce", "graph", [8.0])]
    rep = C.build_report(meta, sig, ar)
    back = json.loads(json.dumps(rep))
    assert back["all_verdicts"] is False and back["summary"]["target_8K"]["met"] is True
    assert back["command"].startswith("python bench/comm.py") and back["topology"] == "GPU0 X NV18"
    from rich.console import Console
    buf = io.StringIO()
    C.render(rep, Console(file=buf, width=200, highlight=False))
    out = buf.getvalue()
    assert "ld_acquire_sys_one" in out and "NO" in out and "yes" in out
    assert "failed rmw_one/st_release_sys: rank 0: d" in out
    assert "met" in out and "some verdicts failed" in out


# ---------------------------------------------------------------- kernels under the interpreter
class FakeRanks:
    """R ranks' symmetric buffers as rows of one tensor: rank r's copy is row r, so the
    peer delta from r to p is (p - r) * row length, exactly what peer_deltas gives on a GPU."""

    def __init__(self, R: int, n: int, grid: int):
        self.R, self.n, self.grid = R, n, grid
        self.recv = torch.zeros(R, 2 * R * n, dtype=torch.bfloat16)
        self.ctr = torch.zeros(R, grid * R, dtype=torch.int32)
        self.err = [torch.zeros(grid, C.ERR_W, dtype=torch.int32) for _ in range(R)]
        self.abort = [torch.zeros(1, dtype=torch.int32) for _ in range(R)]
        self.epoch = torch.zeros(1, dtype=torch.int64)

    def deltas(self, r):
        db = torch.tensor([(p - r) * 2 * self.R * self.n for p in range(self.R)], dtype=torch.int64)
        di = torch.tensor([(p - r) * self.grid * self.R for p in range(self.R)], dtype=torch.int64)
        return db, di

    def launch(self, r, x, y, chunk, k_off, y_off, phase, block, poll=C.P_ACQ_SYS_ONE, sig=C.S_RED, timeout=20):
        db, di = self.deltas(r)
        C._k_allreduce[(self.grid,)](x, y, self.recv[r], self.ctr[r], db, di, self.epoch, self.err[r],
                                     self.abort[r], r, self.R, self.n, chunk, k_off, 1, y_off, timeout,
                                     BLOCK=block, POLL=poll, SIG=sig, PHASE=phase)


@interpreter_only
@pytest.mark.parametrize("R, n, max_ctas, block, sig", [(3, 48, 8, 16, C.S_RED), (2, 80, 2, 32, C.S_ST),
                                                        (4, 32, 4, 16, C.S_ATOMIC)])
def test_allreduce_kernel_fake_ranks_bit_exact(R, n, max_ctas, block, sig):
    grid, chunk = C.plan_ctas(n, max_ctas, 16)
    f = FakeRanks(R, n, grid)
    x = C.make_inputs(2 * n, R)
    ref = C.reference_sum(x)
    iters = 5  # > 2 slots and > 3 input rows: slot reuse and row reuse both exercised
    ys = [torch.full((iters, n), -7.0, dtype=torch.bfloat16) for _ in range(R)]
    for i in range(iters):  # a valid interleaving: everyone pushes, then everyone reduces
        for phase in (1, 2):
            for r in range(R):
                f.launch(r, x[r].contiguous(), ys[r], chunk, i, i, phase, block, sig=sig)
    for r in range(R):
        assert int(f.err[r].abs().sum()) == 0, f.err[r]
        for i in range(iters):
            c = C.allreduce_check(ys[r][i], ref[i % 3], exact=True, ranks=R)
            assert c["ok"], (r, i, c)
    # counter (r, c, s) counts source s's arrivals on chunk c: iters for peers, 0 for itself
    want = torch.tensor([[0 if s == r else iters for c in range(grid) for s in range(R)] for r in range(R)],
                        dtype=torch.int32)
    assert torch.equal(f.ctr, want)


@interpreter_only
def test_allreduce_kernel_missing_push_times_out_and_aborts():
    R, n = 3, 48
    grid, chunk = C.plan_ctas(n, 8, 16)
    f = FakeRanks(R, n, grid)
    x = C.make_inputs(2 * n, R)
    y = torch.zeros(1, n, dtype=torch.bfloat16)
    f.launch(1, x[1].contiguous(), y, chunk, 0, 0, phase=2, block=16, timeout=5)  # reduce with no push
    err = f.err[1].tolist()
    assert err[0][:5] == [C.KIND_TIMEOUT, 0, 0, 0, 1]  # CTA 0: source 0 never arrived, needed 1
    assert all(row[0] == C.KIND_ABORTED for row in err[1:])  # the others stop at once
    assert int(f.abort[1]) == 1 and int(y.view(torch.int16).abs().sum()) == 0
    lines = C.describe_errors(err, 1, "test")
    assert len(lines) == grid and "timed out waiting for rank 0's signal (counter 0, needed 1)" in lines[0]


@interpreter_only
@pytest.mark.parametrize("sig", [C.S_ATOMIC, C.S_ST, C.S_RED])
def test_pingpong_kernel_loopback(sig):
    flags = torch.zeros(16, dtype=torch.int32)
    di = torch.zeros(2, dtype=torch.int64)
    err = torch.zeros(C.ERR_W, dtype=torch.int32)
    warm, iters, batch = 3, 12, 4
    stamps = torch.full((iters // batch + 1,), -1, dtype=torch.int64)
    # role 0 with itself as peer: signal own flag, then wait for it
    C._k_pingpong[(1,)](flags, di, stamps, err, 0, 0, warm, iters, batch, 10, POLL=C.P_ACQ_SYS_ONE, SIG=sig)
    assert int(err.abs().sum()) == 0 and int(flags[0]) == warm + iters
    assert stamps.tolist() == [warm + j * batch for j in range(iters // batch + 1)]  # round numbers here
    # role 1 waits first: nobody signals, so round trip 1 times out and is recorded
    flags.zero_()
    C._k_pingpong[(1,)](flags, di, stamps, err, 0, 1, warm, iters, batch, 4, POLL=C.P_ACQ_SYS_ONE, SIG=sig)
    assert err.tolist()[:5] == [C.KIND_TIMEOUT, 1, 0, 0, 1] and int(flags[0]) == 0


@interpreter_only
def test_barrier_kernel_two_fake_ranks():
    bar = torch.zeros(2, 2, dtype=torch.int32)
    errs = [torch.zeros(1, C.ERR_W, dtype=torch.int32) for _ in range(2)]
    aborts = [torch.zeros(1, dtype=torch.int32) for _ in range(2)]
    dis = [torch.tensor([(p - r) * 2 for p in range(2)], dtype=torch.int64) for r in range(2)]
    # rank 0 arrives first and (sequential interpreter) gives up; its signal is still delivered
    C._k_barrier[(1,)](bar[0], dis[0], errs[0], aborts[0], 0, 2, 1, 3, POLL=C.P_ACQ_SYS_ONE, SIG=C.S_RED)
    assert errs[0].tolist()[0][:5] == [C.KIND_TIMEOUT, 1, 1, 0, 1]
    C._k_barrier[(1,)](bar[1], dis[1], errs[1], aborts[1], 1, 2, 1, 3, POLL=C.P_ACQ_SYS_ONE, SIG=C.S_RED)
    assert int(errs[1].abs().sum()) == 0 and bar.tolist() == [[0, 1], [1, 0]]


# ---------------------------------------------------------------- sm_90 compile (no GPU needed)
def _has_ptxas() -> bool:
    try:
        import triton.backends.nvidia as nv
    except Exception:
        return False
    return (Path(nv.__file__).parent / "bin" / "ptxas").exists()


_COMPILE_SCRIPT = r"""
import json, re, sys
from bench import comm as C
out = C.compile_kernels(90)
facts = {k: {"acq_sys": "ld.acquire.sys.global.b32" in p, "acq_gpu": "ld.acquire.gpu.global.b32" in p,
             "rlx": "ld.relaxed.sys.global.b32" in p, "vol": "ld.volatile.global.b32 %amk_v" in p,
             "atom": "atom.acquire.sys.global.add.s32" in p, "st_rel": "st.release.sys.global.b32" in p,
             "red_rel": "red.release.sys.global.add.s32" in p, "fence": "fence.acq_rel.sys" in p,
             "tid": "%tid.x" in p, "bar_red": "bar.red.and.pred" in p,
             "v4_store": "st.global.v4.b32" in p, "v4_load": "ld.global.v4.b32" in p}
         for k, p in out.items()}
print(json.dumps(facts))
"""


@pytest.mark.skipif(not _has_ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90_on_cpu():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(facts) == len(C.POLLS) * len(C.SIGNALS) + len(C.AR_PRESETS) + 1
    want_poll = {"rmw_one": "atom", "ld_acquire_sys_all": "acq_sys", "ld_acquire_sys_warp": "acq_sys",
                 "ld_acquire_sys_one": "acq_sys", "ld_relaxed_sys_one": "rlx", "ld_volatile_one": "vol",
                 "ld_acquire_gpu_all": "acq_gpu"}
    for poll, key in want_poll.items():
        for sig in C.SIGNALS:
            f = facts[f"pingpong:{poll}/{sig}"]
            assert f[key] and f["bar_red"], (poll, sig, f)
            if poll in ("ld_relaxed_sys_one", "ld_volatile_one"):
                assert f["fence"]
    for poll in C.POLLS:
        assert facts[f"pingpong:{poll}/st_release_sys"]["st_rel"]
        assert facts[f"pingpong:{poll}/red_release_sys"]["red_rel"]
    lean, mk = facts["allreduce:lean"], facts["allreduce:mk"]
    assert lean["acq_sys"] and lean["red_rel"] and lean["fence"] and lean["tid"]
    assert mk["acq_sys"] and mk["fence"] and not mk["red_rel"]
    for f in (lean, mk):  # peer stores and slot loads are 16-byte vectors
        assert f["v4_store"] and f["v4_load"]
    assert facts["barrier"]["red_rel"] and facts["barrier"]["acq_sys"]


# ---------------------------------------------------------------- 2 GPUs
@pytest.mark.multigpu(2)
def test_two_rank_bench_all_verdicts(tmp_path):
    out = tmp_path / "comm.json"
    cmd = [sys.executable, "bench/comm.py", "--ranks", "2", "--sizes", "4K,8K,64K", "--iters", "20",
           "--reps", "3", "--pp-iters", "200", "--pp-warm", "20", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    rep = json.loads(out.read_text())
    assert rep["ranks"] == 2 and rep["signal"] and rep["allreduce"]
    assert len(rep["signal"]) == len(C.POLLS) * len(C.SIGNALS)
    for row in rep["signal"] + rep["allreduce"]:
        assert row["verdict"], row
    assert rep["all_verdicts"] is True
