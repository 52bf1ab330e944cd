"""Tensor-parallel HF baselines (amk.baselines_tp).

HF tensor parallelism runs on the CPU over gloo, so the two-rank tests run in CI: two
processes of tests/tp_baselines_driver.py shard a tiny random Qwen3 with its HF TP plan and
must produce the greedy tokens of the single-process HF model. The GPU test runs the same
code path as ``amk bench --tp 2`` (NCCL, bf16, CUDA graph).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amk.baselines import BaselineResult, judge, reference_tokens
from amk.baselines_tp import (MARKER, check_default_group, check_tp_shapes, cuda_backend,
                              gather_tp, prepare_tp_checkpoint)
from ground.errors import AmkError
from ground.timing import Timing
from models.sources import resolve_model

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "tp_baselines_driver.py"
MODEL = "config:tiny-qwen3"  # 6 query / 2 KV heads: splits over 2 ranks
N_TOKENS, PROMPT_LEN = 10, 5


class FakeCtx:
    """A DistContext stand-in for one process: ``rows`` are what all_gather returns."""

    def __init__(self, rank=0, world=1, rows=None):
        self.rank, self.world, self.rows = rank, world, rows
        self.device = torch.device("cpu")

    def broadcast_object(self, obj, src):
        return obj

    def all_gather_object(self, obj):
        return self.rows if self.rows is not None else [obj]

    def barrier(self):
        pass


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(mode: str, out_dir: Path, ranks: int = 2, timeout: float = 240.0) -> dict:
    """Start ``ranks`` driver processes with torchrun variables; rank 0's result.json."""
    port = _port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        procs.append(subprocess.Popen(
            [sys.executable, str(DRIVER), mode, MODEL, str(out_dir), str(N_TOKENS),
             str(PROMPT_LEN)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out.decode(errors="replace")[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * ranks, f"ranks exited with {codes}:\n" + "\n---\n".join(logs)
    return json.loads((out_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def reference():
    """Single-process HF greedy tokens of MODEL (fp32, CPU) for the driver's prompt."""
    model = resolve_model(MODEL).model
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN), generator=g)
    return prompt[0].tolist(), reference_tokens(model, prompt, N_TOKENS)


# ------------------------------------------------------------------ checks and bookkeeping


def test_check_tp_shapes():
    check_tp_shapes(resolve_model(MODEL, weights=False).config, 2)
    with pytest.raises(AmkError, match="KV heads 2 not divisible by --tp 3"):
        check_tp_shapes(resolve_model(MODEL, weights=False).config, 3)
    # tiny-llama: 3 query heads, 1 KV head
    with pytest.raises(AmkError, match="query heads 3 and KV heads 1 not divisible by --tp 2"):
        check_tp_shapes(resolve_model("config:tiny-llama", weights=False).config, 2)


def test_cuda_backend_parsing():
    assert cuda_backend("cpu:gloo,cuda:nccl") == "nccl"
    assert cuda_backend("cpu:gloo,cuda:gloo") == "gloo"
    assert cuda_backend("nccl") == "nccl"
    assert cuda_backend("cpu:gloo") is None


def test_default_group_required():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(AmkError, match="torch.distributed initialised"):
        check_default_group(torch.device("cpu"))


def test_prepare_checkpoint_written_once_and_equal(tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = prepare_tp_checkpoint(MODEL, FakeCtx(), tmp_path / "ck", dtype="fp32")
    marker = ckpt / MARKER
    assert marker.is_file() and (ckpt / "config.json").is_file()
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    assert prepare_tp_checkpoint(MODEL, FakeCtx(), tmp_path / "ck", dtype="fp32") == ckpt
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before  # reused
    # another seed is another model: written again
    prepare_tp_checkpoint(MODEL, FakeCtx(), tmp_path / "ck", dtype="fp32", seed=7)
    assert json.loads(marker.read_text())["seed"] == 7
    loaded = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    want = resolve_model(MODEL, seed=7).model.state_dict()
    got = loaded.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_prepare_checkpoint_hf_dir_in_place(tmp_path):
    resolve_model(MODEL).model.save_pretrained(str(tmp_path / "hf"))
    assert prepare_tp_checkpoint(str(tmp_path / "hf"), FakeCtx(), tmp_path / "unused") \
        == (tmp_path / "hf").resolve()
    assert not (tmp_path / "unused").exists()


def test_prepare_checkpoint_rank0_failure_reaches_every_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(AmkError, match="rank 0: cannot write the TP checkpoint"):
        prepare_tp_checkpoint(MODEL, FakeCtx(), blocker / "ck", dtype="fp32")
    # a non-zero rank writes nothing and raises rank 0's error
    rank1 = FakeCtx(rank=1, world=2)
    rank1.broadcast_object = lambda obj, src: ("error", "disk full")
    with pytest.raises(AmkError, match="rank 0: disk full"):
        prepare_tp_checkpoint(MODEL, rank1, tmp_path / "ck1", dtype="fp32")
    assert not (tmp_path / "ck1").exists()


def _row(tokens, median, rank, note=""):
    return ("hf_tp_eager", tokens, Timing(median, median, median, median, 5), note,
            {"rank": rank, "world": 2})


def test_gather_tp_max_median_and_agreement():
    rows = [_row([1, 2, 3], 1.0, 0), _row([1, 2, 3], 1.5, 1)]
    res = gather_tp(FakeCtx(world=2, rows=rows), BaselineResult("hf_tp_eager", [], None))
    assert res.timing.median_ms == 1.5 and res.extra["slowest_rank"] == 1
    assert res.extra["per_rank_median_ms"] == [1.0, 1.5] and res.extra["ranks_agree"]
    assert res.tokens == [1, 2, 3] and "rank" not in res.extra
    assert judge(res, [1, 2, 3]).correct
    # ranks that disagree keep only the common prefix, which fails the verdict
    rows = [_row([1, 2, 3], 1.0, 0), _row([1, 9, 3], 1.0, 1)]
    res = gather_tp(FakeCtx(world=2, rows=rows), BaselineResult("hf_tp_eager", [], None))
    assert res.tokens == [1] and not res.extra["ranks_agree"]
    assert "ranks disagree after token 1" in res.note
    assert judge(res, [1, 2, 3]).correct is False


# ------------------------------------------------------------------ two ranks, CPU, gloo


def test_tp_eager_two_ranks_cpu(tmp_path, reference):
    """HF TP over 2 CPU ranks (gloo): eager tokens equal single-process HF, weights really
    sharded, and a failing compiler falls back to the plain static-cache step, recorded."""
    prompt, ref = reference
    out = run_ranks("cpu-eager", tmp_path)
    assert out["prompt"] == prompt
    q = out["sharded"]["model.layers.0.self_attn.q_proj.weight"]
    assert q == [[96, 64], [48, 64]]  # 6 heads x 16, half on each rank
    assert out["sharded"]["model.layers.1.mlp.down_proj.weight"] == [[64, 160], [64, 80]]
    eager, fallback, moded = out["rows"]
    assert eager["name"] == "hf_tp_eager" and eager["tokens"] == ref
    assert eager["ranks_agree"] and len(eager["per_rank_median_ms"]) == 2
    assert eager["latency_ms_median"] == max(eager["per_rank_median_ms"])
    assert fallback["name"] == "hf_tp_compiled" and fallback["tokens"] == ref
    assert fallback["compiled"] is False and fallback["compiled_per_rank"] == [False, False]
    assert "ranks 0,1: compile (warm-up)" in fallback["compile_error"]
    assert "test: compiler refused" in fallback["compile_error"]
    assert "torch.compile failed" in fallback["note"]
    # --baseline-compile-mode at --tp R: one row per mode, named by it (here it falls back too)
    assert moded["name"] == "hf_tp_compiled[max-autotune-no-cudagraphs]" and moded["tokens"] == ref
    assert moded["compiled"] is False


@pytest.mark.slow
def test_tp_compiled_two_ranks_cpu(tmp_path, reference):
    """torch.compile (inductor) traces the HF TP step over gloo; tokens equal HF's."""
    _, ref = reference
    (row,) = run_ranks("cpu-compiled", tmp_path, timeout=500)["rows"]
    assert row["compiled"] is True and row["compile_error"] is None, row
    assert row["tokens"] == ref


# ------------------------------------------------------------------ two GPUs, NCCL


@pytest.mark.multigpu(2)
def test_tp_baselines_two_gpus(tmp_path):
    """``run_tp_baselines`` as bench --tp 2 calls it: NCCL, bf16, CUDA graph; both rows
    timed and correct against the single-GPU HF reference."""
    out = run_ranks("gpu", tmp_path, timeout=500)
    eager, graph = out["rows"]
    for row in (eager, graph):
        assert row["latency_ms_median"] and row["correct"], row
    assert graph["name"] == "hf_tp_compiled_graph" and graph["cuda_graph"] is True
    assert isinstance(graph["compiled"], bool)
