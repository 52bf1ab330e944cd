"""bench/dist.py on the CPU: argument parsing, the refusal without GPUs, and the report (rows,
honest speedups, the table, the JSON file) on fake timings. The GPU run itself is the lead's
(torchrun --nproc-per-node 2 bench/dist.py ...)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import dist as D
from ground.errors import AmkError, rank_exit_code
from tests.test_dist_api import one_rank_group

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, **(env or {}))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        e.pop(k, None)
    return subprocess.run([sys.executable, str(ROOT / "bench" / "dist.py"), *argv], capture_output=True, text=True,
                          cwd=ROOT, env=e, timeout=120)


def _settings(*argv: str) -> D.Settings:
    return D.validate(D.build_parser().parse_args(list(argv)))


# ---------------------------------------------------------------- arguments
def test_sizes_cubes_triples_and_the_default_sets():
    assert D.parse_sizes("256, 1024x512x2048") == [(256, 256, 256), (1024, 512, 2048)]
    assert _settings().sizes == [(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)]
    assert _settings("--quick").sizes == [(1024, 1024, 1024), (4096, 4096, 4096)]
    st = _settings("--patterns", "allgather_matmul,ulysses_combine", "--methods", "nccl,amk")
    assert st.patterns == ["allgather_matmul", "ulysses_combine"] and st.methods == ["nccl", "amk"]
    assert st.repeats == 2 and st.both_allreduce


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "12x"], "--sizes: '12x' is not a number or MxNxK"),
    (["--sizes", "0"], "--sizes: '0' must be N or MxNxK with each dimension in 1..65536"),
    (["--sizes", "1x2"], "must be N or MxNxK"),
    (["--patterns", "allgather"], "--patterns: allgather is not one of allgather_matmul"),
    (["--methods", "nccl,mpi"], "--methods: mpi is not one of nccl, nccl_graph, symm_mem, amk"),
    (["--repeats", "1"], "--repeats: 1 is outside [2, 100]"),
    (["--tile-m", "-2"], "--tile-m: must be 0 (by size) or an integer >= 1, got -2"),
    (["--allreduce", "ring"], "--allreduce: expected one of oneshot, twoshot, got 'ring'"),
    (["--gemv-stages", "9"], "--gemv-stages: must be an integer in 1..8"),
    (["--out", "/nonexistent/dir/r.json"], "--out: directory /nonexistent/dir does not exist"),
])
def test_bad_arguments_are_one_line(argv, message):
    with pytest.raises(AmkError) as ei:
        _settings(*argv)
    assert message in str(ei.value) and "\n" not in str(ei.value) and ei.value.exit_code == 2


def test_a_config_file_gives_the_collective_and_kernel_knobs(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"collective": {"tile_m": 64, "allreduce": "twoshot"}, "kernel": {"num_warps": 4}}))
    st = _settings("--config", str(f), "--tile-n", "256")
    assert st.collective == {"tile_m": 64, "allreduce": "twoshot", "tile_n": 256}
    assert st.kernel == {"num_warps": 4} and not st.both_allreduce


@pytest.mark.parametrize("sizes,world,message", [
    ("1000", 3, "--sizes 1000x1000x1000: allgather_matmul at 3 ranks: M=1000 is not divisible by the world size 3"),
    ("12x8x9", 2, "ulysses_combine needs K = R * C, but K=9 is not divisible by the world size 2"),
])
def test_sizes_a_pattern_cannot_split_are_refused(sizes, world, message):
    with pytest.raises(AmkError) as ei:
        D.check_shapes(_settings("--sizes", sizes), world)
    assert message in str(ei.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without GPUs")
def test_without_gpus_it_exits_2_in_one_line():
    r = _run("--quick")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == ["bench/dist.py: error: needs CUDA GPUs, none is visible; run on a "
                                             "multi-GPU machine with torchrun --nproc-per-node 2 bench/dist.py ..."]


def test_bad_arguments_exit_2_before_looking_for_gpus():
    r = _run("--sizes", "8x8x8x8")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "bench/dist.py: error: --sizes: '8x8x8x8' must be N or MxNxK with each dimension in 1..65536"]


# ---------------------------------------------------------------- the report
def _rank(ms: list[float], err: float = 0.01, tol: float = 0.1, **kw) -> dict:
    return dict(repeats_ms=ms, max_abs_err=err, tol=tol, **kw)


def _fake_rows() -> list[dict]:
    dims, f = (1024, 1024, 1024), 2 * 1024 ** 3
    return [
        D.method_row("allgather_matmul", dims, "nccl", [_rank([1.0, 0.9]), _rank([1.1, 0.95])], f),
        D.method_row("allgather_matmul", dims, "symm_mem", [_rank([0.8, 0.7]), _rank([0.85, 0.9])], f),
        D.method_row("allgather_matmul", dims, "amk", [_rank([0.5, 0.6], tasks=10, workers=4, validate_s=0.1),
                                                       _rank([0.55, 0.5], err=0.5)], f),
        D.method_row("ulysses_combine", dims, "nccl", [_rank([2.0, 2.0]), _rank([2.0, 2.2])], f),
        D.method_row("ulysses_combine", dims, "symm_mem", [{"unavailable": "no fused op"}] * 2, f),
        D.method_row("ulysses_combine", dims, "amk", [_rank([2.5, 2.4]), {"error": "compile failed"}], f),
    ]


def test_speedups_are_against_the_fastest_nccl_repeat_and_charge_the_slowest_repeat():
    rep = D.build_report({"device": "fake", "world": 2}, _fake_rows())
    rows = {(r["pattern"], r["method"]): r for r in rep["rows"]}
    nccl = rows[("allgather_matmul", "nccl")]
    assert nccl["repeats_ms"] == [1.1, 0.95]  # slowest rank per repeat
    sm = rows[("allgather_matmul", "symm_mem")]
    assert sm["time_ms"] == 0.9 and sm["speedup"] == pytest.approx(0.95 / 0.9) and sm["ok"]
    assert nccl["speedup"] == pytest.approx(0.95 / 1.1) and nccl["speedup"] < 1
    wrong = rows[("allgather_matmul", "amk")]  # fast but wrong on rank 1: no speedup claimed
    assert wrong["ok"] is False and wrong["speedup"] is None and wrong["max_abs_err"] == 0.5
    assert rows[("ulysses_combine", "symm_mem")]["status"] == "unavailable"
    failed = rows[("ulysses_combine", "amk")]
    assert failed["status"] == "failed" and failed["detail"] == "rank 1: compile failed" and failed["speedup"] is None
    summ = {s["pattern"]: s for s in rep["summary"]}
    assert summ["allgather_matmul"]["fastest"] == "symm_mem" and summ["ulysses_combine"]["fastest"] == "nccl"
    assert rep["all_verdicts"] is False


def test_the_baseline_is_the_fastest_correct_nccl_repeat_eager_or_graphed():
    dims, f = (256, 256, 256), 2 * 256 ** 3
    rows = [D.method_row("allgather_matmul", dims, "nccl", [_rank([0.1, 0.12])] * 2, f),
            D.method_row("allgather_matmul", dims, "nccl_graph", [_rank([0.04, 0.05])] * 2, f),
            D.method_row("allgather_matmul", dims, "amk", [_rank([0.02, 0.025])] * 2, f)]
    amk = {r["method"]: r for r in D.build_report({}, rows)["rows"]}["amk"]
    assert amk["speedup"] == pytest.approx(0.04 / 0.025)
    wrong_graph = [rows[0], D.method_row("allgather_matmul", dims, "nccl_graph", [_rank([0.01], err=1.0)] * 2, f),
                   rows[2]]
    amk = {r["method"]: r for r in D.build_report({}, wrong_graph)["rows"]}["amk"]
    assert amk["speedup"] == pytest.approx(0.1 / 0.025)  # a wrong baseline is no baseline


def test_the_table_and_the_json_file(tmp_path):
    from rich.console import Console
    rep = D.build_report({"device": "fake", "world": 2, "torch": "x"}, _fake_rows())
    buf = io.StringIO()
    D.render(rep, Console(file=buf, width=250, highlight=False, color_system=None))
    text = buf.getvalue()
    assert "1.100 / 0.950" in text and "1.06x" in text and "WRONG" in text and "unavailable" in text
    assert "ulysses_combine 1024x1024x1024 amk: failed: rank 1: compile failed" in text
    assert "allgather_matmul 1024x1024x1024: fastest is symm_mem (0.900 ms), 1.06x NCCL's fastest repeat: " \
           "faster than NCCL" in text
    assert "some verdicts failed" in text
    out = D.write_report(str(tmp_path / "r.json"), rep)
    back = json.loads(out.read_text())
    assert back["rows"][2]["speedup"] is None and back["all_verdicts"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temp file left behind


def test_a_report_file_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(AmkError, match=str(tmp_path / "d")):
        D.write_report(str(tmp_path / "d"), {"rows": []})


@pytest.mark.filterwarnings("ignore::FutureWarning")  # the *_tensor collectives' deprecation notes
def test_the_originals_on_one_rank_are_the_patterns_math(tmp_path):
    # the functions bench/dist.py times as "nccl" (world size 1 over gloo in this process)
    from models.collectives import MatmulAllReduce
    with one_rank_group(tmp_path):
        for name in D.PATTERNS:
            p = D.pattern_of(name, 1, 8, 16, 8)
            gen = torch.Generator().manual_seed(0)
            ins = {k: torch.randn(s, generator=gen) for k, s in p.operands().items()}
            want = p.reference([ins])[0]
            assert torch.allclose(D.original(name, ins), want.float(), atol=0.05), name
        assert isinstance(D.pattern_of("matmul_allreduce_rmsnorm", 1, 8, 8, 8), MatmulAllReduce)


class _OneRank:
    """The DistContext surface Rank uses, for one CPU rank over gloo."""

    rank, world, device = 0, 1, torch.device("cpu")

    def barrier(self):
        pass

    def all_gather_object(self, obj):
        return [obj]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_rank_runs_the_originals_and_reports_the_missing_fused_ops(tmp_path):
    # the flow of one rank (inputs, the original's output, timing repeats, verdicts, rows)
    # without GPUs: the originals over a one-process gloo group, the symmetric-memory ops
    # unavailable for CPU tensors
    with one_rank_group(tmp_path):
        st = _settings("--sizes", "8x16x8", "--methods", "nccl,symm_mem", "--iters", "2", "--warmup", "0")
        rows = D.Rank(st, _OneRank()).run()
    assert len(rows) == 2 * len(D.PATTERNS)
    for r in rows:
        if r["method"] == "nccl":
            assert r["status"] == "ran" and r["ok"] and r["max_abs_err"] == 0 and len(r["repeats_ms"]) == 2
        elif r["pattern"] in ("allgather_matmul", "matmul_reduce_scatter"):
            assert r["status"] == "unavailable" and r["detail"]  # no CPU kernel for the fused op
        else:
            assert r["detail"] == "torch has no fused symmetric-memory op for this pattern"


def test_a_rank_error_is_one_line_naming_the_rank(monkeypatch, capsys):
    """ground.errors.rank_exit_code, which bench/dist.py and bench/comm.py end with."""
    def fails():
        raise AmkError("no GPUs", exit_code=2)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setenv("RANK", "1")
    assert rank_exit_code("bench/dist.py", fails) == 2
    assert capsys.readouterr().err == "bench/dist.py: error: rank 1: no GPUs\n"
    monkeypatch.delenv("RANK")
    assert rank_exit_code("bench/dist.py", fails) == 2
    assert capsys.readouterr().err == "bench/dist.py: error: no GPUs\n"
    assert rank_exit_code("bench/comm.py", interrupted) == 130
    assert capsys.readouterr().err == "bench/comm.py: interrupted\n"
    assert rank_exit_code("bench/comm.py", lambda: 0) == 0
