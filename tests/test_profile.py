"""``amk profile``: the per-task trace of one decode step (lowering/trace.py, amk/profile.py).

The trace-event checker runs over fresh simulated traces and over every committed
``bench/results/**/trace*.json[.gz]`` (the GPU traces ``amk profile --backend triton`` writes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_cli_conventions import amk, error_lines, one_json_object

ROOT = Path(__file__).resolve().parents[1]
MODEL = "config:tiny-llama"


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    """Simulated traces of the tiny model at tp 1 and tp 2, written by the command."""
    d = tmp_path_factory.mktemp("trace")
    out = {}
    for tp in (1, 2):
        path = d / f"trace-tp{tp}.json"
        r = amk("profile", MODEL, "--tp", tp, "--workers", 4, "--trace", path, "--json")
        assert r.returncode == 0, r.stderr[-2000:]
        out[tp] = (one_json_object(r.stdout), json.loads(path.read_text()))
    return out


def test_sim_trace_is_valid_and_simulated(traces):
    from lowering.trace import check_trace

    summary, trace = traces[1]
    assert check_trace(trace) == []
    assert summary["ok"] is True and summary["clock"] == "simulated"
    assert trace["otherData"]["clock"] == "simulated"
    assert "PREDICTED" in trace["otherData"]["clock_note"]
    roof = trace["otherData"]["roofline"]
    assert roof["roofline_us"] > 0 and roof["predicted_latency_us"] >= roof["roofline_us"]
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "wait"]
    assert len(slices) == summary["tasks"] == trace["otherData"]["tasks"]
    gemv = next(e for e in slices if "gemv" in e["args"]["op"] and e["dur"] > 0)
    a = gemv["args"]
    assert a["bytes"] > 0 and a["stage"] and a["layer"] in (0, 1)
    assert a["gbps"] == pytest.approx(a["bytes"] / (gemv["dur"] * 1e-6) / 1e9, rel=1e-2)


def test_one_process_per_rank_one_track_per_worker(traces):
    _, trace = traces[2]
    ev = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {(r, w) for r in range(2) for w in range(4)}
    used = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "X"}
    assert used <= threads and {p for p, _ in used} == {0, 1}


def test_flows_go_from_a_signal_to_the_wait_it_releases(traces, tmp_path):
    """Every flow starts in a slice of a task that signals the counter and ends in the wait
    (or task) slice of a task that waits on it, on the tracks of those tasks; at tp 2 some
    flows cross ranks (the all-reduce)."""
    from lowering.trace import check_trace

    for tp in (1, 2):
        _, trace = traces[tp]
        assert check_trace(trace) == []
        ev = trace["traceEvents"]
        tasks = {e["name"]: e for e in ev if e["ph"] == "X" and e["cat"] != "wait"}
        by_id: dict = {}
        for e in ev:
            if e["ph"] in ("s", "f"):
                by_id.setdefault(e["id"], {})[e["ph"]] = e
        assert by_id, "no flow events"
        cross = 0
        for fid, pair in by_id.items():
            s, f = pair["s"], pair["f"]
            counter = s["name"].split(">=")[0]
            src = next(t for t in tasks.values() if (t["pid"], t["tid"]) == (s["pid"], s["tid"])
                       and t["ts"] <= s["ts"] <= t["ts"] + t["dur"])
            assert any(x.startswith(counter + "+=") for x in src["args"]["signals"]), (fid, src["name"])
            dst = [t for t in tasks.values() if (t["pid"], t["tid"]) == (f["pid"], f["tid"])
                   and any(w.startswith(s["name"]) for w in t["args"]["waits"])]
            assert dst, f"flow {fid}: no task on the end's track waits on {s['name']}"
            cross += s["pid"] != f["pid"]
        if tp == 2:
            assert cross > 0


def test_releases_pick_the_signal_that_reaches_the_threshold():
    """Two producers signal c (+1 each); a consumer waits c >= 2: the later signal releases
    it, and the flow goes from that producer."""
    from ir.program import Buffer, Counter, ScheduleProgram, Signal, Task, Wait
    from lowering.trace import build_trace, check_trace, releases

    prog = ScheduleProgram(name="p", ranks=1, workers=3,
                           buffers=[Buffer("x", "activation", "f32", (4,))],
                           counters=[Counter("c", 0)],
                           tasks=[Task("a", 0, 0, "nop", signals=(Signal("c", 1),)),
                                  Task("b", 0, 1, "nop", signals=(Signal("c", 1),)),
                                  Task("z", 0, 2, "nop", waits=(Wait("c", 2),))])
    times = {0: (0.0, 0.0, 1e-6), 1: (0.0, 0.0, 3e-6), 2: (0.0, 3e-6, 4e-6)}
    assert releases(prog, times) == [(1, 2, 0)]
    trace = build_trace(prog, times, clock="gpu")
    assert check_trace(trace) == []
    s = next(e for e in trace["traceEvents"] if e["ph"] == "s")
    f = next(e for e in trace["traceEvents"] if e["ph"] == "f")
    assert (s["tid"], f["tid"]) == (1, 2) and f["ts"] >= s["ts"]
    wait = next(e for e in trace["traceEvents"] if e.get("cat") == "wait")
    assert wait["tid"] == 2 and wait["ts"] == 0 and wait["dur"] == pytest.approx(3.0)
    assert wait["ts"] <= f["ts"] <= wait["ts"] + wait["dur"]


def test_gpu_stamps_become_the_trace(traces):
    """The GPU path's conversion: PROF rows (queue head, waits met, signals done; ns) of the
    table's rows, mapped by (rank, task id) onto the program, give a valid ``gpu`` trace."""
    from amk.profile import prof_times
    from ir.io import load_program
    from lowering.trace import build_trace, check_trace

    prog = load_program(str(ROOT / "examples" / "schedules" / "norm_gemv_w2.amk"))
    rows = list(reversed(range(len(prog.tasks))))  # the table's order differs from the program's
    prof = np.zeros((len(rows), 10), dtype=np.int64)
    base = 5_000_000_000
    for row, k in enumerate(rows):
        prof[row, :3] = (base + 1000 * k, base + 1000 * k + 200, base + 1000 * k + 900)
    times = prof_times(prog, prof, [prog.tasks[k].id for k in rows], [prog.tasks[k].rank for k in rows])
    assert times[0] == pytest.approx((0.0, 0.2e-6, 0.9e-6))
    trace = build_trace(prog, times, clock="gpu", meta={"device": "test"})
    assert check_trace(trace) == [] and trace["otherData"]["clock"] == "gpu"


def test_skewed_gpu_stamps_still_give_a_valid_trace():
    """GPU stamps come from the clocks of different SMs: a signal stamped after the waiter
    was released still gets an arrow inside both slices; one stamped after the waiter ended
    gets none (counted in otherData.flows_dropped)."""
    from ir.program import Buffer, Counter, ScheduleProgram, Signal, Task, Wait
    from lowering.trace import build_trace, check_trace

    prog = ScheduleProgram(name="p", ranks=1, workers=3,
                           buffers=[Buffer("x", "activation", "f32", (4,))],
                           counters=[Counter("c", 0), Counter("d", 0)],
                           tasks=[Task("a", 0, 0, "nop", signals=(Signal("c", 1), Signal("d", 1))),
                                  Task("z", 0, 1, "nop", waits=(Wait("c", 1),)),
                                  Task("y", 0, 2, "nop", waits=(Wait("d", 1),))])
    times = {0: (0.0, 1e-6, 5e-6), 1: (0.0, 4e-6, 6e-6), 2: (0.0, 2e-6, 3e-6)}
    trace = build_trace(prog, times, clock="gpu")
    assert check_trace(trace) == []
    assert trace["otherData"]["flows"] == 2 and trace["otherData"]["flows_dropped"] == 0
    times[2] = (0.0, 0.2e-6, 0.4e-6)  # y ended before a's slice began: no arrow
    trace = build_trace(prog, times, clock="gpu")
    assert check_trace(trace) == []
    assert trace["otherData"]["flows"] == 1 and trace["otherData"]["flows_dropped"] == 1


def _bad(trace: dict, edit) -> list[str]:
    from lowering.trace import check_trace

    t = copy.deepcopy(trace)
    edit(t)
    return check_trace(t)


def test_the_checker_rejects_broken_traces(traces):
    from lowering.trace import check_trace

    _, trace = traces[1]
    ev = trace["traceEvents"]
    xi = next(i for i, e in enumerate(ev) if e["ph"] == "X")
    si = next(i for i, e in enumerate(ev) if e["ph"] == "s")
    assert check_trace([]) and check_trace({"events": []})
    assert any("ph" in p for p in _bad(trace, lambda t: t["traceEvents"][xi].update(ph="Q")))
    assert any("dur" in p for p in _bad(trace, lambda t: t["traceEvents"][xi].pop("dur")))
    assert any("ts" in p for p in _bad(trace, lambda t: t["traceEvents"][xi].update(ts=-1)))
    assert any("lacks" in p for p in _bad(trace, lambda t: t["traceEvents"].pop(si)))
    assert any("clock" in p for p in _bad(trace, lambda t: t["otherData"].update(clock="wall")))
    assert any("thread_name" in p for p in _bad(
        trace, lambda t: t.update(traceEvents=[e for e in t["traceEvents"] if e["name"] != "thread_name"])))

    def overlap(t):
        x = t["traceEvents"][xi]
        t["traceEvents"].append({**x, "name": "other", "ts": x["ts"] + x["dur"] / 2, "dur": x["dur"]})
    assert any("overlaps" in p for p in _bad(trace, overlap))


COMMITTED = sorted([*(ROOT / "bench" / "results").glob("**/trace*.json"),
                    *(ROOT / "bench" / "results").glob("**/trace*.json.gz")])


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(ROOT)) for p in COMMITTED])
def test_committed_traces_are_valid(path):
    from lowering.trace import check_trace, read_trace

    assert check_trace(read_trace(str(path))) == []


def test_schedule_file_and_bad_input(tmp_path):
    sched = ROOT / "examples" / "schedules" / "norm_gemv_w2.amk"
    out = tmp_path / "t.json"
    r = amk("profile", sched, "--seq-len", 1, "--trace", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "simulated trace" in r.stdout and out.is_file()
    r = amk("profile", sched, "--backend", "triton", "--json")
    assert r.returncode == 2
    assert "schedule file" in one_json_object(r.stdout)["error"]
    r = amk("profile", tmp_path / "missing.amk")
    assert r.returncode == 2 and error_lines(r.stderr) == [f"error: {tmp_path / 'missing.amk'}: no such schedule file"]
    r = amk("profile", MODEL, "--seq-len", 0)
    assert r.returncode == 2 and "--seq-len must be >= 1" in r.stderr


def test_triton_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the triton path runs (tests/test_triton_megakernel.py's machines)")
    r = amk("profile", MODEL, "--backend", "triton", "--json")
    assert r.returncode == 2
    assert "needs a CUDA GPU" in one_json_object(r.stdout)["error"]


def test_gpu_trace_glue_with_a_stand_in_kernel(monkeypatch):
    """amk.profile.gpu_trace end to end with a stand-in for the profiled megakernel (no GPU
    here): it asks the decoder for ``profile=True``, runs ``seq_len`` steps, reads the
    ``_prof`` buffer as rows of ``vm.PROF_W`` stamps and writes a ``gpu`` trace."""
    import torch

    from amk.profile import gpu_trace
    from ir.io import load_program
    from lowering.config import KernelConfig
    from lowering.trace import check_trace
    from lowering.triton import vm

    prog = load_program(str(ROOT / "examples" / "schedules" / "norm_gemv_w2.amk"))
    rows = [k for w in range(prog.workers) for k, t in enumerate(prog.tasks) if t.worker == w]
    seen: dict = {}

    class Table:
        task_ids = [prog.tasks[k].id for k in rows]
        task_ranks = [prog.tasks[k].rank for k in rows]
        n_tasks = len(rows)

    class Ex:
        table = Table()
        _prof = torch.zeros(len(rows) * vm.PROF_W, dtype=torch.int64)

    class Dec:
        ex = Ex()

        def step(self, tok, pos):
            seen.setdefault("steps", []).append(pos)
            clock = 10**9 + 10_000 * pos
            for row, k in enumerate(rows):  # each worker runs its queue back to back
                w = prog.tasks[k].worker
                base = clock + 1000 * sum(1 for r in rows[:row] if prog.tasks[r].worker == w)
                self.ex._prof[row * vm.PROF_W:row * vm.PROF_W + 3] = torch.tensor([base, base + 100, base + 900])
            return tok

    class Built:  # stands in for what amk.pipeline builds
        program = prog

        def decoder(self, backend, backend_options):
            seen["backend"], seen["options"] = backend, backend_options
            return Dec()

    class Props:
        name = "Stand-in GPU"

    _stand_in_cuda(monkeypatch, Props)
    trace = gpu_trace(Built(), KernelConfig(), 4, meta={"model": "stand-in"})
    assert seen["backend"] == "triton" and seen["options"]["profile"] is True and seen["steps"] == [0, 1, 2, 3]
    assert check_trace(trace) == []
    o = trace["otherData"]
    assert o["clock"] == "gpu" and o["device"] == "Stand-in GPU" and o["traced_step"] == 3
    assert o["traced_tasks"] == len(prog.tasks) and o["step_us"] == pytest.approx(
        max(sum(1 for t in prog.tasks if t.worker == w) for w in range(prog.workers)) - 0.1)


def _stand_in_cuda(monkeypatch, props) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props())


def test_gpu_trace_gathers_the_ranks_of_a_multi_gpu_run(monkeypatch):
    """One process per GPU: rank 0's kernel stamps only its own tasks; gpu_trace gathers every
    rank's (ids, ranks, stamps) through the DistContext and builds one trace with a process
    per rank and the all-reduce's flows across them."""
    import torch

    from amk.profile import gpu_trace
    from ir.io import load_program
    from lowering.config import KernelConfig
    from lowering.trace import check_trace
    from lowering.triton import vm

    prog = load_program(str(ROOT / "examples" / "schedules" / "allreduce_r2.amk"))
    assert prog.ranks == 2

    def stamps(rank: int) -> tuple[list[str], list[list[int]]]:
        ids, rows, nxt = [], [], {}
        for t in prog.tasks:
            if t.rank == rank:
                s = nxt.get(t.worker, 2_000_000_000 + 137 * rank)
                ids.append(t.id)
                rows.append([s, s + 50, s + 700])
                nxt[t.worker] = s + 1000
        return ids, rows

    ids0, rows0 = stamps(0)

    class Ex:
        class table:
            task_ids = ids0
            task_ranks = [0] * len(ids0)
            n_tasks = len(ids0)
        _prof = torch.zeros(len(ids0) * vm.PROF_W, dtype=torch.int64)

    for i, row in enumerate(rows0):
        Ex._prof[i * vm.PROF_W:i * vm.PROF_W + 3] = torch.tensor(row)

    class Dec:
        ex = Ex()

        def step(self, tok, pos):
            return tok

    class Built:  # stands in for what amk.pipeline builds
        program = prog

        def decoder(self, backend, backend_options):
            assert backend_options["dist"] is ctx and backend_options["profile"] is True
            return Dec()

    class Ctx:
        rank, world, device = 0, 2, torch.device("cpu")

        def all_gather_object(self, obj):
            ids1, rows1 = stamps(1)
            return [obj, {"ids": ids1, "ranks": [1] * len(ids1), "prof": rows1, "device": "GPU1"}]

    class Props:
        name = "GPU0"

    ctx = Ctx()
    _stand_in_cuda(monkeypatch, Props)
    trace = gpu_trace(Built(), KernelConfig(), 2, ctx=ctx)
    assert check_trace(trace) == []
    o = trace["otherData"]
    assert o["devices"] == ["GPU0", "GPU1"] and "globaltimer" in o["clock_sync"]
    assert o["traced_tasks"] == len(prog.tasks)
    ev = trace["traceEvents"]
    assert {e["pid"] for e in ev if e["ph"] == "X"} == {0, 1}
    s = {e["id"]: e["pid"] for e in ev if e["ph"] == "s"}
    assert any(s[e["id"]] != e["pid"] for e in ev if e["ph"] == "f"), "no flow across ranks"


def test_a_gz_trace_name_is_written_gzip_and_reads_back(tmp_path):
    """`--trace X.json.gz` writes the trace gzip-compressed (the viewers open it as it is);
    read_trace reads it back, and the format check passes."""
    import gzip

    from lowering.trace import check_trace, read_trace

    out = tmp_path / "t.json.gz"
    r = amk("profile", ROOT / "examples" / "schedules" / "norm_gemv_w2.amk", "--seq-len", 1, "--trace", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert gzip.decompress(out.read_bytes()).startswith(b'{"traceEvents"')
    assert check_trace(read_trace(str(out))) == []


def test_task_durations_round_trip_every_task_id(traces):
    """``task_durations`` of a trace of `amk profile --trace`: one entry per task slice, of
    every rank, keyed by the program's task id, its ``dur`` in seconds; a trace without task
    slices or an object that is no trace is one AmkError line."""
    from ground.errors import AmkError
    from lowering.trace import task_durations

    for tp in (1, 2):
        summary, trace = traces[tp]
        slices = {e["name"]: e["dur"] for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "wait"}
        d = task_durations(trace)
        assert set(d) == set(slices) and len(d) == summary["tasks"]
        assert all(abs(d[k] - slices[k] * 1e-6) < 1e-15 for k in d)
        ranks = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] in d}
        assert ranks == set(range(tp))
    meta = [e for e in traces[1][1]["traceEvents"] if e["ph"] == "M"]
    for bad, msg in (({"traceEvents": meta}, "the trace holds no task slices"),
                     ([], "not a trace")):
        with pytest.raises(AmkError) as err:
            task_durations(bad, "t.json")
        assert str(err.value).startswith(f"t.json: {msg}") and "\n" not in str(err.value)


def test_stream_share_of_the_profiling_script():
    """bench/profile_megakernel.py's stream-idle share: per worker, the step minus its GEMV
    stream+store time (stamps 4 -> 5), over the step (first stamp to last signals done of all
    workers); waiting is stamps 0 -> 1 summed. Worker 0 streams 600 of a 1000 ns step and
    waits 200; worker 1 runs two non-GEMV tasks and waits 100."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("profile_megakernel", ROOT / "bench" / "profile_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prof = np.zeros((3, 10), dtype=np.int64)
    prof[0] = [0, 200, 1000, 250, 300, 900, 950, 0, 0, 0]  # a GEMV: waits, prologue, stream, end
    prof[1] = [0, 100, 500, 0, 0, 0, 0, 0, 0, 0]
    prof[2] = [500, 500, 1000, 0, 0, 0, 0, 0, 0, 0]
    share = mod.stream_share(types.SimpleNamespace(workers=2, qstart=[0, 1, 3]), prof)
    assert share["span_us"] == pytest.approx(1.0)
    assert share["idle_share_min"] == pytest.approx(0.4) and share["idle_share_max"] == pytest.approx(1.0)
    assert share["idle_share_mean"] == pytest.approx(0.7)
    assert share["wait_share_mean"] == pytest.approx(0.15)
    assert share["other_share_mean"] == pytest.approx(0.55)


def test_attention_parts_of_the_profiling_script():
    """bench/profile_megakernel.py's attention breakdown: stamps 1 -> 7 -> 8 -> 9 -> 6 -> 2
    of the attention tasks (position read, loop start, loop end, op done, signals done),
    means in us; GEMV and other tasks, and attention tasks without the stamps, left out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("profile_megakernel", ROOT / "bench" / "profile_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    prof = np.zeros((4, 10), dtype=np.int64)
    prof[0] = [0, 100, 9000, 0, 0, 0, 8500, 600, 2600, 8100]  # rope_attention_kv
    prof[1] = [0, 300, 7000, 0, 0, 0, 6500, 1100, 2100, 6100]  # attention
    prof[2] = [0, 200, 1000, 250, 300, 900, 950, 5, 5, 5]  # a GEMV on the ring: not attention
    prof[3] = [0, 100, 900, 0, 0, 0, 800, 0, 0, 0]  # an attention task of a build without the stamps
    parts = mod.attention_parts(["rope_attention_kv", "attention", "gemv", "attention"], prof)
    assert parts["tasks"] == 2
    assert parts["decode"] == pytest.approx(0.65) and parts["prologue"] == pytest.approx(1.5)
    assert parts["positions"] == pytest.approx(4.75) and parts["store"] == pytest.approx(0.4)
    assert parts["barrier+signals"] == pytest.approx(0.5)
    assert mod.attention_parts(["gemv"] * 4, prof) == {}


def test_the_stage_timeline_shows_split_kv_combines_apart():
    """bench/profile_megakernel.py's stage timeline groups a layer's split-KV parts under
    ``attn`` and their combines under ``attn.combine``, with the hand-off between them."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("profile_megakernel", ROOT / "bench" / "profile_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ids = ["l1.q.t0.r0", "l1.attn.kv0.s0.r0.p0", "l1.attn.kv0.s0.r0.p1", "l1.attn.kv0.s0.r0.combine",
           "l1.attn.w.t0.r0"]
    prof = np.zeros((5, 10), dtype=np.int64)
    for k, (start, end) in enumerate([(0, 1000), (2000, 5000), (2100, 5500), (6500, 7000), (8000, 9000)]):
        prof[k, 1], prof[k, 2] = start, end
    tab = types.SimpleNamespace(task_ids=ids, task_ranks=[0] * 5)
    rows = {d["stage"]: d for d in mod.stage_timeline(tab, prof, 1, quiet=True)}
    assert list(rows) == ["q", "attn", "attn.combine", "attn.w"]
    assert rows["attn"]["tasks"] == 2 and rows["attn.combine"]["handoff_us"] == pytest.approx(1.0)


def test_the_profiling_script_profiles_what_amk_bench_runs(tmp_path, monkeypatch):
    """bench/profile_megakernel.py's config (profile_config) is amk bench's: the shipped tuned
    entry for the model on the GPU, the knob flags over it; --config, --no-tuned and
    co-located ranks take none."""
    import importlib.util

    from search.tunedb import GpuKey

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("AMK_TUNE_DB", raising=False)
    spec = importlib.util.spec_from_file_location("profile_megakernel", ROOT / "bench" / "profile_megakernel.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    h100 = GpuKey("NVIDIA H100 80GB HBM3", 132)
    shipped = json.loads((ROOT / "bench" / "configs" / "llama-3.2-1b-tuned-h100.json").read_text())
    cfg, line = mod.profile_config(mod.parser().parse_args(["config:llama-3.2-1b", "--gemv-unroll", "4"]), h100, 132)
    assert line.startswith("config: tuned entry") and "1e3e8b74" in line
    assert cfg.lowering.tile_lm_head == shipped["lowering"]["tile_lm_head"] and cfg.lowering.max_seq == 256
    assert cfg.kernel.w_preload == shipped["kernel"]["w_preload"] and cfg.kernel.gemv_unroll == 4
    cfg, line = mod.profile_config(mod.parser().parse_args(["config:llama-3.2-1b", "--no-tuned"]), h100, 132)
    assert "--no-tuned" in line and cfg.kernel.w_preload == 0 and cfg.lowering.workers == 132
    cfg, line = mod.profile_config(mod.parser().parse_args(["config:llama-3.2-1b", "--tp", "2"]), h100, 66,
                                   colocated=True)
    assert "co-located" in line and cfg.lowering.workers == 66 and cfg.kernel.w_preload == 0
