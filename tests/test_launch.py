"""amk/launch.py and the CPU-side parts of lowering/triton/dist.py: spawning R rank processes
with the torchrun environment, exit-code propagation, stopping the other ranks when one
fails, and how a ``--tp R`` command decides where it runs."""

from __future__ import annotations

import sys
import time

import pytest

import lowering.triton  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from amk import launch
from ground.errors import AmkError
from lowering.triton import dist

REPORT = ("import os, sys; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], "
          "os.environ['MASTER_PORT'], os.environ['NVSHMEM_DISABLE_NVLS'], file=sys.stderr)")


def test_spawn_runs_every_rank_with_the_torchrun_environment(capfd):
    code = launch.spawn([], 3, prefix=[sys.executable, "-c", REPORT])
    assert code == 0
    err = capfd.readouterr().err
    # ranks 1 and 2 report through the launcher's prefixed stderr; rank 0 writes directly
    for r in range(3):
        assert f"{r} 3 {r} " in err, err
    assert "[rank 1] 1 3 1" in err and "[rank 2] 2 3 2" in err
    ports = {line.split()[-2] for line in err.splitlines() if line.strip()}
    assert len(ports) == 1  # one rendezvous port for all ranks


def test_a_failing_rank_stops_the_others_and_gives_its_code():
    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '1': sys.exit(3)\n"
              "time.sleep(60)\n")
    t0 = time.monotonic()
    code = launch.spawn([], 2, prefix=[sys.executable, "-c", script])
    assert code == 3
    assert time.monotonic() - t0 < launch.GRACE_S + 20  # rank 0 was interrupted, not waited for


def test_tp_entry_runs_in_process_when_no_gpu_runtime_is_needed(monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert launch.tp_entry(1, "triton") == (None, None)
    assert launch.tp_entry(4, "sim") == (None, None)
    # the interpreter (no GPU here) runs all ranks co-located in this process
    assert launch.tp_entry(2, "triton") == (None, None)
    assert launch.tp_entry(2, "triton", colocate=True) == (None, None)


def test_env_world_parsing(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert dist.env_world() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert dist.env_world() == (1, 2, 1)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(dist.DistError, match="outside WORLD_SIZE"):
        dist.env_world()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(dist.DistError, match="bad distributed environment"):
        dist.env_world()


def test_init_distributed_refuses_a_wrong_world_or_no_gpu(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(AmkError, match="not started as a multi-process run"):
        dist.init_distributed(2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(AmkError, match="--tp 4 but WORLD_SIZE=2"):
        dist.init_distributed(4)
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(AmkError, match="needs CUDA GPUs"):
            dist.init_distributed(2)
