"""Start one process per rank for a ``--tp R`` run on the GPU backend (torchrun-compatible).

``spawn(argv, R)`` re-runs ``python -m amk <argv>`` R times with the torchrun environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and the
no-multicast settings, so a command started by a user with ``--tp 2`` and the same command
started under ``torchrun --nproc-per-node 2 -m amk ...`` run the same code path
(``lowering.triton.dist.init_distributed``).

Rank 0's stdout is the command's output; other ranks' stdout is discarded (they compute the
same result) and their stderr is kept, prefixed with the rank. When one rank fails, the
others are terminated (they would otherwise wait on it forever); Ctrl-C is forwarded to
every rank, which then shuts NVSHMEM down (dist.py). The exit code is the first failing
rank's code, else 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

from lowering.triton.dist import NO_MULTICAST_ENV, env_world

#: Seconds the launcher gives ranks to exit after the first one failed or Ctrl-C.
GRACE_S = 10.0


def in_spawned_rank() -> bool:
    """True in a process started by ``spawn`` or torchrun (RANK / WORLD_SIZE set)."""
    return env_world() is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pump(stream, rank: int) -> None:
    for line in iter(stream.readline, b""):
        sys.stderr.write(f"[rank {rank}] {line.decode(errors='replace')}")
        sys.stderr.flush()


def spawn(argv: Sequence[str], ranks: int, prefix: Sequence[str] | None = None) -> int:
    """Run ``python -m amk *argv`` as ``ranks`` processes (see module doc); returns the exit
    code. ``argv`` is the user's command line without the program name; ``prefix`` replaces
    ``[sys.executable, "-m", "amk"]`` (e.g. ``[sys.executable, "bench/comm.py"]``)."""
    port = _free_port()
    procs: list[subprocess.Popen] = []
    pumps = []
    for r in range(ranks):
        env = dict(os.environ)
        env.update(NO_MULTICAST_ENV)
        env.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), PYTHONUNBUFFERED="1")
        p = subprocess.Popen([*(prefix or [sys.executable, "-m", "amk"]), *argv], env=env,
                             stdout=None if r == 0 else subprocess.DEVNULL,
                             stderr=None if r == 0 else subprocess.PIPE)
        procs.append(p)
        if r:
            t = threading.Thread(target=_pump, args=(p.stderr, r), daemon=True)
            t.start()
            pumps.append(t)
    code = 0
    try:
        while True:
            states = [p.poll() for p in procs]
            failed = [c for c in states if c not in (None, 0)]
            if failed:
                code = failed[0]
                break
            if all(c == 0 for c in states):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        code = 130
    _stop(procs)
    for t in pumps:
        t.join(timeout=1.0)
    return code


def _stop(procs: list[subprocess.Popen]) -> None:
    """Interrupt ranks still running (after a failure or Ctrl-C: SIGINT, so they unwind and
    release NVSHMEM), then kill those still alive after ``GRACE_S``."""
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        left = max(0.0, deadline - time.monotonic())
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def tp_entry(ranks: int, backend: str, colocate: bool = False) -> tuple[int | None, Any]:
    """How a command with ``--tp R --backend B`` runs; returns (exit code, DistContext):

    * ``(None, None)``: this process runs every rank itself: R = 1, the sim backend, the
      Triton interpreter (no GPU), or ``colocate`` (all R ranks' workers on one GPU, for
      testing schedules without R GPUs);
    * ``(code, None)``: this process was the launcher: it spawned R rank processes running
      the same command line (``spawn``) and ``code`` is their exit code;
    * ``(None, ctx)``: this process is one rank of a multi-GPU run (spawned, or started by
      torchrun); ``ctx`` is its ``DistContext``. Ranks other than 0 write nothing to stdout.

    Raises AmkError when R GPUs are needed but fewer are visible.
    """
    if ranks <= 1 or backend != "triton":
        return None, None
    from lowering.triton.lang import interpreting
    if interpreting() or colocate:
        return None, None
    from lowering.triton.dist import init_distributed
    if not in_spawned_rank():
        import torch
        n = torch.cuda.device_count()
        if n < ranks:
            from ground.errors import AmkError
            raise AmkError(f"--tp {ranks} on the triton backend runs one process per GPU, but "
                           f"{n} GPU(s) are visible; add --colocate to run all ranks on one GPU")
        return spawn(sys.argv[1:], ranks), None
    ctx = init_distributed(ranks)
    if ctx.rank != 0:
        sys.stdout = open(os.devnull, "w")
    return None, ctx


def script_entry(script: str, argv: Sequence[str] | None, ranks: int) -> tuple[int | None, Any]:
    """``tp_entry`` for a bench script run as ``python SCRIPT ... --tp R`` (R > 1): in the
    launcher, spawn R ranks running ``SCRIPT`` with the same arguments (``argv``; None: this
    process's own) and return (their exit code, None); inside a rank (spawned or torchrun),
    return (None, this rank's DistContext). Raises DistError as ``init_distributed``."""
    if not in_spawned_rank():
        return spawn(sys.argv[1:] if argv is None else argv, ranks, prefix=[sys.executable, script]), None
    from lowering.triton.dist import init_distributed
    return None, init_distributed(ranks)
