"""`amk bench` option parsing into TritonExecutor options (amk.bench.backend_options)."""

from __future__ import annotations

import argparse

import pytest

from amk.bench import MAX_WORKERS_PER_SM, backend_options, cuda_target
from ground.errors import AmkError


def _args(**kw):
    base = dict(gemv_block="16x512", num_warps=8, gemv_stages=1, prefetch=0, attention_block=32, gemv_unroll=1)
    base.update(kw)
    return argparse.Namespace(**base)


def test_blocks_from_flags():
    opts = backend_options(_args(gemv_block="16x1024", gemv_unroll=2, attention_block=64, num_warps=4))
    b = opts["blocks"]
    assert opts["num_warps"] == 4
    assert (b.gemv_n, b.gemv_k, b.gemv_unroll, b.attention_t) == (16, 1024, 2, 64)
    assert b.elide_waits and b.coalesce_signals  # the table sync optimisations are on by default


@pytest.mark.parametrize("kw,needle", [
    (dict(gemv_block="16by512"), "expected NxK"),
    (dict(gemv_block="12x512"), "power of two"),
    (dict(attention_block=48), "--attention-block must be a power of two"),
    (dict(gemv_stages=9), "--gemv-stages"),
    (dict(prefetch=9), "--prefetch"),
])
def test_bad_flags_name_the_flag(kw, needle):
    with pytest.raises(AmkError, match=needle):
        backend_options(_args(**kw))


def test_bad_unroll_is_refused():
    with pytest.raises(AmkError, match="--gemv-unroll must be 1, 2, 4, 8 or 16"):
        backend_options(_args(gemv_unroll=3))


def test_blocks_errors_use_flag_names():
    """Blocks' own range checks reach the user with the flag names, field names replaced."""
    with pytest.raises(AmkError) as e:
        backend_options(_args(gemv_block="16x128", w_preload=64))
    assert "--w-preload" in str(e.value) and "--gemv-block K = 128" in str(e.value)
    assert "w_preload" not in str(e.value) and "gemv_k" not in str(e.value)


def test_cuda_target_allows_several_workers_per_sm():
    props = argparse.Namespace(name="GPU", multi_processor_count=132)
    t = cuda_target(props)
    assert (t.sms, t.max_workers, t.backend) == (132, MAX_WORKERS_PER_SM * 132, "triton")


def test_maxnreg_flag_reaches_blocks_and_is_checked():
    assert backend_options(_args()).get("blocks").maxnreg == 0  # automatic by default
    assert backend_options(_args(maxnreg=128))["blocks"].maxnreg == 128
    with pytest.raises(AmkError, match="--maxnreg"):
        backend_options(_args(maxnreg=300))


def test_x_stage_flag_reaches_blocks():
    assert backend_options(_args()).get("blocks").x_stage is True  # on by default
    assert backend_options(_args(x_stage=0))["blocks"].x_stage is False


def test_x_reuse_and_x_chunk_flags_reach_blocks():
    b = backend_options(_args())["blocks"]
    assert b.x_reuse is True and b.x_chunk == 8192  # the defaults
    b = backend_options(_args(x_reuse=0, x_chunk=1024))["blocks"]
    assert b.x_reuse is False and b.x_chunk == 1024
    with pytest.raises(AmkError, match="--x-chunk must be a power of two"):
        backend_options(_args(x_chunk=3000))


def test_w_preload_flag_reaches_blocks():
    assert backend_options(_args())["blocks"].w_preload == 0  # off by default
    assert backend_options(_args(w_preload=1024))["blocks"].w_preload == 1024
    for bad in (1000, 8):  # not a power of two; below the GEMV block's K
        with pytest.raises(AmkError, match="--w-preload"):
            backend_options(_args(w_preload=bad))


def test_prefetch_cap_and_roll_flags_reach_blocks():
    b = backend_options(_args())["blocks"]
    assert (b.prefetch_cap, b.roll) == (0, 0)  # off by default
    b = backend_options(_args(prefetch_cap=65536, roll=1))["blocks"]
    assert (b.prefetch_cap, b.roll) == (65536, 1)
    with pytest.raises(AmkError, match="--prefetch-cap"):
        backend_options(_args(prefetch_cap=1000))
    with pytest.raises(AmkError, match="--roll"):
        backend_options(_args(roll=9))


def test_prefetch_rows_flag_reaches_blocks():
    assert backend_options(_args(prefetch_rows=16))["blocks"].prefetch_rows == 16
    with pytest.raises(AmkError, match="--prefetch-rows"):
        backend_options(_args(prefetch_rows=-1))


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
