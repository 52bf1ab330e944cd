"""`amk bench` options: --config FILE and the knob flags into one AmkConfig (amk.bench.bench_config),
then the Triton executor's options (lowering.triton.blocks.kernel_options)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from amk.bench import MAX_WORKERS_PER_SM, bench_config, cuda_target
from ground.errors import AmkError
from lowering.triton.blocks import kernel_options

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*flags: str, sms: int = 132):
    from amk.cli import build_parser

    return bench_config(build_parser().parse_args(["bench", "config:tiny-llama", *flags]), sms)


def test_blocks_from_flags():
    opts = kernel_options(_cfg("--gemv-block", "16x1024", "--gemv-unroll", "2", "--attention-block", "64",
                               "--num-warps", "4").kernel)
    b = opts["blocks"]
    assert opts["num_warps"] == 4
    assert (b.gemv_n, b.gemv_k, b.gemv_unroll, b.attention_t) == (16, 1024, 2, 64)
    assert b.elide_waits and b.coalesce_signals  # the table sync optimisations are on by default


def test_bench_defaults():
    """Without a file or flags: one worker per SM, bf16, max_seq from the tokens, and the
    kernel knobs' defaults (8 warps, 32 x 512 GEMV blocks)."""
    cfg = _cfg("--tokens", "300", sms=114)
    assert (cfg.lowering.workers, cfg.lowering.dtype, cfg.lowering.max_seq) == (114, "bf16", 316)
    assert (cfg.kernel.num_warps, cfg.kernel.gemv_block) == (8, "32x512")
    assert _cfg("--workers", "66", "--dtype", "f32").lowering.workers == 66


@pytest.mark.parametrize("flags,needle", [
    (("--gemv-block", "16by512"), "--gemv-block: expected NxK"),
    (("--gemv-block", "12x512"), "power of two"),
    (("--attention-block", "48"), "--attention-block: must be a power of two"),
    (("--gemv-stages", "9"), "--gemv-stages"),
    (("--prefetch", "9"), "--prefetch"),
    (("--gemv-unroll", "3"), "--gemv-unroll: expected one of 1, 2, 4, 8, 16"),
    (("--maxnreg", "300"), "--maxnreg"),
    (("--x-chunk", "3000"), "--x-chunk: must be a power of two"),
    (("--w-preload", "1000"), "--w-preload"),
    (("--gemv-block", "16x128", "--w-preload", "64"), "--w-preload): must be 0 or a power of two of at least "
                                                      "--gemv-block K = 128"),
    (("--prefetch", "1", "--prefetch-cap", "1000"), "--prefetch-cap"),
    (("--roll", "9"), "--roll"),
    (("--prefetch-rows", "-1"), "--prefetch-rows"),
    (("--prefetch-cap", "65536"), "--prefetch-cap 65536 does nothing without --prefetch >= 1"),
    (("--x-stage", "0"), "--x-reuse 1 does nothing without --x-stage 1"),
    (("--fuse", "1", "--fuse-reduce", "1"), "--fuse-reduce 1 does nothing at one rank (--tp 1)"),
])
def test_bad_flags_name_the_flag(flags, needle):
    with pytest.raises(AmkError) as e:
        _cfg(*flags)
    assert needle in str(e.value) and e.value.exit_code == 2, str(e.value)


def test_flags_reach_blocks():
    b = kernel_options(_cfg().kernel)["blocks"]
    assert (b.maxnreg, b.x_stage, b.x_reuse, b.x_chunk, b.w_preload, b.prefetch_cap, b.roll) == \
        (0, True, True, 8192, 0, 0, 0)  # the defaults: automatic cap, staging on, the rest off
    b = kernel_options(_cfg("--maxnreg", "128", "--x-stage", "0", "--x-reuse", "0", "--x-chunk", "1024",
                            "--w-preload", "1024", "--prefetch", "1", "--prefetch-cap", "65536",
                            "--prefetch-rows", "16", "--roll", "1").kernel)["blocks"]
    assert (b.maxnreg, b.x_stage, b.x_reuse, b.x_chunk, b.w_preload, b.prefetch, b.prefetch_cap,
            b.prefetch_rows, b.roll) == (128, False, False, 1024, 1024, 1, 65536, 16, 1)


def test_config_file_and_flags(tmp_path):
    """A config file's kernel part reaches the kernel; a flag overrides it."""
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"lowering": {"tile": 16, "fuse": True}, "kernel": {"gemv_block": "16x128",
                                                                               "gemv_unroll": 8}}))
    cfg = _cfg("--config", str(f), "--gemv-unroll", "4")
    assert (cfg.lowering.tile, cfg.lowering.fuse, cfg.kernel.gemv_block, cfg.kernel.gemv_unroll) == \
        (16, True, "16x128", 4)


def test_cuda_target_allows_several_workers_per_sm():
    props = argparse.Namespace(name="GPU", multi_processor_count=132)
    t = cuda_target(props)
    assert (t.sms, t.max_workers, t.backend) == (132, MAX_WORKERS_PER_SM * 132, "triton")


def test_register_cap_lets_every_worker_be_resident():
    """Automatic cap: none at one worker per SM; at two or three 8-warp workers per SM, the
    most registers at which they share the SM's 64K (allocated in units of 256 per warp)."""
    from lowering.triton.runtime import Blocks, TritonError, register_cap, regs_for_ctas

    assert register_cap(0, 132, 132, 256) is None
    assert register_cap(0, 264, 132, 256) == 128  # 2 x 8 warps x 32 threads x 128 = 65536
    assert register_cap(0, 133, 132, 256) == 128  # one SM needs two
    assert register_cap(0, 396, 132, 256) == 80   # 3 x 256 threads x 85 rounded down to 8
    assert register_cap(0, 264, 132, 128) == 248  # 2 x 4 warps: at most 255, a multiple of 8
    assert register_cap(168, 132, 132, 256) == 168  # an explicit cap is kept
    for ctas, threads in ((2, 256), (3, 256), (4, 128), (8, 64)):
        r = regs_for_ctas(ctas, threads)
        assert r % 8 == 0 and ctas * -(-threads // 32) * 32 * r <= 65536, (ctas, threads, r)
    with pytest.raises(ValueError):
        regs_for_ctas(32, 1024)
    with pytest.raises(TritonError, match="maxnreg"):
        Blocks(maxnreg=8)


def test_baseline_compile_modes():
    from amk.baselines import compile_modes

    flag = "--baseline-compile-mode"
    assert compile_modes("default,max-autotune-no-cudagraphs", flag) == [None, "max-autotune-no-cudagraphs"]
    assert compile_modes("max-autotune,max-autotune", flag) == ["max-autotune"]
    with pytest.raises(AmkError, match="unknown mode 'fast'"):
        compile_modes("default,fast", flag)


def test_results_table_shows_names_and_notes_verbatim():
    """A (b) row's compile mode in brackets reaches the printed table (rich would take
    "[max-autotune-no-cudagraphs]" for markup and drop it)."""
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from amk.commands.bench import results_table

    timing = SimpleNamespace(median_ms=1.3883, p10_ms=1.385, p90_ms=1.391)
    res = [SimpleNamespace(name="hf_compiled_graph[max-autotune-no-cudagraphs]", timing=timing, correct=True,
                           note="diverges at token 2 [near-tie]"),
           SimpleNamespace(name="hf_eager", timing=None, correct=False, note="")]
    rows = [{"roofline_pct": 41.9, "tokens_per_s": 720.0}, {"roofline_pct": None, "tokens_per_s": None}]
    out = io.StringIO()
    Console(file=out, width=200).print(results_table("t", res, rows))
    text = out.getvalue()
    assert "hf_compiled_graph[max-autotune-no-cudagraphs]" in text and "[near-tie]" in text
    assert "1.3883" in text and "41.9" in text and "720" in text


def test_json_is_a_flag_and_out_names_the_file(tmp_path, capsys):
    """`--json` prints the result object to stdout (one line); `--out FILE` writes it whole."""
    import json

    from amk.cli import build_parser
    from amk.bench import write_result

    args = build_parser().parse_args(["bench", "config:tiny-llama", "--json", "--out",
                                      str(tmp_path / "r" / "bench.json")])
    assert args.json is True and args.out == str(tmp_path / "r" / "bench.json")
    result = {"model": "config:tiny-llama", "latency_ms_median": 0.5, "roofline_pct": float("nan")}
    write_result(args, result, final=False)  # --tp R rewrites the file after each stage
    assert capsys.readouterr().out == ""
    write_result(args, result)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and json.loads(out)["roofline_pct"] is None  # strict JSON
    assert json.loads((tmp_path / "r" / "bench.json").read_text()) == {**result, "roofline_pct": None}


def test_fastest_baseline_is_the_fastest_correct_run_and_speedup_is_against_it():
    """A same-run comparison is made against the fastest correct, timed baseline run; an
    incorrect faster run and an untimed row do not count."""
    from amk.baselines import BaselineResult, fastest, run_name, speedup_summary
    from ground.timing import Timing

    def t(ms):
        return Timing.of([ms] * 5)

    rows = [BaselineResult("hf_eager", [], t(9.0), True),
            BaselineResult("hf_compiled_graph[max-autotune-no-cudagraphs]", [], t(1.41), True),
            BaselineResult(run_name("hf_compiled_graph[max-autotune-no-cudagraphs]", 2), [], t(1.38), True),
            BaselineResult("wrong_but_fast", [], t(0.5), False),
            BaselineResult("failed", [], None, False, "failed: X")]
    assert run_name("hf_eager", 1) == "hf_eager" and rows[2].name.endswith(" #2")
    assert fastest(rows) is rows[2]
    ours = BaselineResult("amk_megakernel", [], t(1.20), True)
    s = speedup_summary(ours, rows)
    assert s["fastest_baseline"] == rows[2].name
    assert abs(s["speedup"] - 1.38 / 1.20) < 1e-9
    assert speedup_summary(ours, rows[3:]) == {"fastest_baseline": None, "fastest_baseline_ms": None,
                                               "speedup": None}


def test_fresh_compile_turns_inductor_caches_off_inside_only():
    """A repeated baseline is compiled with inductor's caches off (its autotuner runs again);
    the setting is restored afterwards."""
    import torch._inductor.config as cfg

    from amk.baselines import fresh_compile

    before = cfg.force_disable_caches
    with fresh_compile():
        assert cfg.force_disable_caches is True
    assert cfg.force_disable_caches == before
    with fresh_compile(1):  # the first run compiles as a user's would
        assert cfg.force_disable_caches == before


def test_inductor_counter_delta_keeps_what_grew():
    """The warm-up's inductor counters: growth only, from torch's own Counter."""
    from torch._dynamo.utils import counters

    from amk.baselines import inductor_counter_delta

    before = dict(counters["inductor"])
    counters["inductor"]["amk_test_bench"] += 3
    counters["inductor"]["amk_test_hit"] += 1
    try:
        assert inductor_counter_delta(before, counters["inductor"]) == {"amk_test_bench": 3, "amk_test_hit": 1}
        assert inductor_counter_delta(dict(counters["inductor"]), counters["inductor"]) == {}
    finally:
        del counters["inductor"]["amk_test_bench"], counters["inductor"]["amk_test_hit"]


def test_baseline_runs_below_one_is_one_line():
    r = subprocess.run([sys.executable, "-m", "amk", "bench", "config:tiny-llama", "--baseline-runs", "0"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == ["error: --baseline-runs must be at least 1, got 0"]
