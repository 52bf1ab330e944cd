"""amk.pipeline.Decoder in a distributed (SPMD) run, on the CPU: two gloo processes, each
seeing only its own rank (tests/spmd_decoder_driver.py), must give the logit check and the
greedy tokens of the same schedule decoded in one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from amk import pipeline
from lowering.config import LoweringConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL = "config:tiny-llama"


def test_two_rank_processes_match_one_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.json"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "spmd_decoder_driver.py"), MODEL, str(out)],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    logs = [p.communicate(timeout=300)[0].decode(errors="replace")[-3000:] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(logs)
    got = json.loads(out.read_text())

    # the drivers run with one intra-op thread; CPU matmuls may round differently with more,
    # and the logit check's error is compared exactly
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compilation = pipeline.Compilation.build(MODEL, 2, LoweringConfig(max_seq=40, workers=2))
        dec = compilation.decoder("sim", policy="in_order")
        report = compilation.check(dec)
        tokens = dec.generate([5, 17, 33], 6)
    finally:
        torch.set_num_threads(threads)
    assert got["ok"] and report.ok
    assert got["max_abs_err"] == report.max_abs_err
    assert got["tokens"] == tokens
