"""The evaluator of `amk search`: run a candidate in a subprocess with a timeout, and the
timing logic (interleaved A/B against the incumbent, A/A noise, the roofline floor).

Per candidate (the work itself is done by search/worker.py in a subprocess):

1. lower the candidate config -> ScheduleProgram;
2. validate it; a rejected program stops here (REJECTED, with the validator's classes):
   it never reaches a backend, so it costs no GPU time;
3. correctness gate against HF eager: fresh random prompt tokens, fed one decode step at a
   time; before EVERY step the program's io_output buffers are poisoned (NaN / int
   sentinel), so an executor that skips work or returns stale outputs fails; logits are
   compared at several positions (max abs error, argmax agreement);
4. timing: on ``sim`` the cost model's prediction (``timing_source = "predicted"``); on
   ``triton`` interleaved A/B rounds against the incumbent with CUDA events (``measured``),
   median of rounds, an A/A measurement of the incumbent against itself in the same rounds
   for the noise; a candidate is faster only if its median ratio beats 1 by more than the
   noise. Any latency below the roofline floor is a measurement error: FAIL.

The subprocess (``python -m search.worker --serve``) stays alive across candidates (the
model is loaded once); a candidate that exceeds its timeout gets the whole process group
killed (SIGKILL), is recorded as TIMEOUT, and the next candidate starts a fresh worker.
``isolation="fresh"`` starts a new worker for every candidate.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ground.errors import AmkError
from ground.files import atomic_write_json
from ir.program import DTYPE_BYTES, ScheduleProgram

# -- the roofline floor ---------------------------------------------------------------


def weight_bytes_per_rank(program: ScheduleProgram) -> list[int]:
    """Bytes of weights each rank must read in one decode step (the memory-roofline traffic).

    Every distinct weight region read by a task counts once; an ``embed`` task reads one
    row of its table (the table region is declared whole). Activations and the KV cache are
    not counted, so the result is a LOWER bound of the traffic (what a floor needs).
    """
    bufs = program.buffer_map()
    seen: list[set] = [set() for _ in range(program.ranks)]
    total = [0] * program.ranks
    for t in program.tasks:
        for i, reg in enumerate(t.ins):
            b = bufs.get(reg.buffer)
            if b is None or b.kind != "weight":
                continue
            key = (reg.buffer, reg.concrete(0))
            if key in seen[t.rank]:
                continue
            seen[t.rank].add(key)
            n = reg.numel()
            if t.op == "embed" and len(reg.shape()) == 2:
                n = reg.shape()[1]
            total[t.rank] += n * DTYPE_BYTES.get(b.dtype, 4)
    return total


def roofline_floor_ms(program: ScheduleProgram, bandwidth_bytes_per_s: float,
                      cache_bytes: int = 0) -> float:
    """The latency no correct decode step of ``program`` can beat, in milliseconds:
    max over ranks of (weight bytes - ``cache_bytes``) / bandwidth.

    ``cache_bytes``: on-chip cache that may hold weights across steps (the L2 of the GPU,
    e.g. 50 MiB on H100); 0 for the cost model, which does not model caches. Source of the
    method: the memory roofline (Williams, Waterman, Patterson, CACM 2009) with the traffic
    of batch-1 decode = the weights.
    """
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    worst = max(weight_bytes_per_rank(program), default=0)
    return max(worst - cache_bytes, 0) / bandwidth_bytes_per_s * 1e3


def below_floor(latency_ms: float, floor_ms: float, slack: float = 0.02) -> bool:
    """True when ``latency_ms`` is below the floor by more than ``slack`` (relative): such a
    timing is a measurement error (work skipped, a stale result, a broken timer)."""
    return latency_ms < floor_ms * (1.0 - slack)


# -- A/B timing -----------------------------------------------------------------------
# A timer runs ``fn`` ``steps`` times and returns per-step milliseconds.
Timer = Callable[[Callable[[], Any], int], Sequence[float]]


def cuda_event_timer(device: Any = None) -> Timer:
    """Per-step CUDA-event timing (one event pair per step, synchronised once per batch).
    Only our kernels run between the events: the step callable launches the megakernel and
    nothing else (inputs are written before the timed batch)."""
    import torch

    def timer(fn: Callable[[], Any], steps: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        torch.cuda.synchronize(device)
        for i in range(steps):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in zip(starts, ends)]

    return timer


@dataclass
class ABResult:
    """Interleaved A/B timing of candidate B against incumbent A.

    a_ms / b_ms: median over rounds of each side's per-round median (ms per step);
    b_spread_ms: p90 - p10 of B's round medians; ratio: median over rounds of
    B / mean(A, A2) (paired, so slow drift of the machine cancels); noise: the A/A noise,
    the 90th percentile over rounds of |A - A2| / mean(A, A2); threshold: the ratio B must
    beat, ``1 - max(noise, min_gain)``; faster: ``ratio < threshold``.
    """

    a_ms: float
    b_ms: float
    b_spread_ms: float
    ratio: float
    noise: float
    threshold: float
    faster: bool
    rounds: int
    order: list[str] = field(default_factory=list)
    raw: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("a_ms", "b_ms", "b_spread_ms", "ratio", "noise",
                                              "threshold", "faster", "rounds", "order", "raw")}


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# Rotating orders of (A, B, A2) so that neither side always runs first or after the other.
_ORDERS = (("A", "B", "A2"), ("B", "A2", "A"), ("A2", "A", "B"),
           ("B", "A", "A2"), ("A", "A2", "B"), ("A2", "B", "A"))


def ab_interleaved(run_a: Callable[[], Any], run_b: Callable[[], Any], timer: Timer, *,
                   rounds: int = 7, steps: int = 20, warmup: int = 3,
                   min_gain: float = 0.01) -> ABResult:
    """Time B (candidate) against A (incumbent) in ``rounds`` interleaved rounds.

    Each round runs ``warmup`` untimed steps of each side, then times ``steps`` steps of
    A, B and A again (A2, the A/A control), in a rotating order. Per side and round the
    median step time is kept. See ABResult for the statistics. Raises ValueError for
    rounds < 2 or steps < 1.
    """
    if rounds < 2 or steps < 1:
        raise ValueError(f"need rounds >= 2 and steps >= 1, got {rounds}, {steps}")
    fns = {"A": run_a, "B": run_b, "A2": run_a}
    per: dict[str, list[float]] = {"A": [], "B": [], "A2": []}
    order = []
    for i in range(rounds):
        seq = _ORDERS[i % len(_ORDERS)]
        order.append("".join(x[0] if x != "A2" else "a" for x in seq))
        for side in seq:
            f = fns[side]
            for _ in range(warmup):
                f()
            samples = list(timer(f, steps))
            if not samples:
                raise ValueError("the timer returned no samples")
            per[side].append(statistics.median(samples))
    a_mean = [(a + a2) / 2 for a, a2 in zip(per["A"], per["A2"])]
    ratios = [b / a if a > 0 else float("inf") for b, a in zip(per["B"], a_mean)]
    noises = [abs(a - a2) / m if m > 0 else float("inf")
              for a, a2, m in zip(per["A"], per["A2"], a_mean)]
    noise = _quantile(noises, 0.9)
    ratio = statistics.median(ratios)
    threshold = 1.0 - max(noise, min_gain)
    return ABResult(
        a_ms=statistics.median(a_mean), b_ms=statistics.median(per["B"]),
        b_spread_ms=_quantile(per["B"], 0.9) - _quantile(per["B"], 0.1),
        ratio=ratio, noise=noise, threshold=threshold, faster=ratio < threshold,
        rounds=rounds, order=order, raw=per)


def measured_ab(run_a: Callable[[], Any], run_b: Callable[[], Any], timer: Timer, timing: dict[str, Any],
                with_incumbent: bool) -> dict[str, Any]:
    """A trial's measured ``timing`` result: ``ab_interleaved`` of incumbent ``run_a`` and
    candidate ``run_b`` with a request's ``timing`` parameters (``rounds`` 7, ``steps`` 20,
    ``warmup`` 3, ``min_gain`` 0.01 where absent) as ``{"source": "measured", "median_ms",
    "spread_ms", "incumbent_ms" (None without an incumbent: A was the candidate itself),
    "ab"}``."""
    ab = ab_interleaved(run_a, run_b, timer, rounds=int(timing.get("rounds", 7)),
                        steps=int(timing.get("steps", 20)), warmup=int(timing.get("warmup", 3)),
                        min_gain=float(timing.get("min_gain", 0.01)))
    return {"source": "measured", "median_ms": ab.b_ms, "spread_ms": ab.b_spread_ms,
            "incumbent_ms": ab.a_ms if with_incumbent else None, "ab": ab.to_json()}


def foreign_kernels(kernel_names: Sequence[str], allowed: Sequence[str]) -> list[str]:
    """The names in ``kernel_names`` (GPU kernels seen in a timed step) that do not start
    with one of the ``allowed`` prefixes: anything but our megakernel (and the tiny copy
    kernels we allow) inside the timed region makes the timing meaningless."""
    return sorted({n for n in kernel_names if not any(n.startswith(p) for p in allowed)})


def profile_kernel_names(fn: Callable[[], Any]) -> list[str]:
    """Names of the CUDA kernels ``fn()`` launches (torch.profiler; CUDA only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for ev in prof.events():
        dev = getattr(ev, "device_type", None)
        if dev is not None and "CUDA" in str(dev):
            names.append(ev.name)
    return names


# -- the subprocess client ------------------------------------------------------------
class WorkerTimeout(Exception):
    """The candidate did not finish within its timeout; the worker was killed."""


class WorkerCrashed(Exception):
    """The worker process died (or broke the protocol) without a result.
    ``tail``: the last lines of its stderr log."""

    def __init__(self, message: str, tail: str = ""):
        super().__init__(message)
        self.tail = tail


class WorkerClient:
    """One ``python -m search.worker --serve`` subprocess.

    Protocol: the parent writes one JSON line ``{"request": PATH, "result": PATH}`` to the
    worker's stdin, both paths absolute (the worker runs in the repository root, not in the
    parent's working directory, so that ``-m search.worker`` imports this package); the worker evaluates the request file, writes the result file
    atomically, and answers one line ``{"done": PATH}`` on its protocol pipe (its original
    stdout; everything the evaluation prints goes to stderr, which is appended to
    ``log_path``). The worker runs in its own session so a timeout kills its whole process
    group (including anything it spawned).
    """

    def __init__(self, log_path: str | os.PathLike, env: dict[str, str] | None = None,
                 python: str | None = None):
        self.log_path = Path(log_path).resolve()
        self.env = env
        self.python = python or sys.executable
        self.proc: subprocess.Popen | None = None
        self._buf = b""

    def _start(self) -> None:
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
        except OSError as err:
            raise AmkError(f"cannot write the worker log {self.log_path}: "
                           f"{err.strerror or err}") from None
        env = dict(os.environ if self.env is None else self.env)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH")
                                    else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(
            [self.python, "-m", "search.worker", "--serve"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log, cwd=root, env=env, start_new_session=True)
        log.close()
        self._buf = b""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the worker's process group and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f:
                    f.close()
            except OSError:
                pass
        self.proc = None

    def close(self) -> None:
        """Ask the worker to exit (EOF on stdin), then make sure it is gone."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def tail(self, n: int = 12) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def run(self, request: dict[str, Any], workdir: str | os.PathLike,
            timeout_s: float) -> dict[str, Any]:
        """Evaluate ``request`` and return the worker's result dict.

        Raises WorkerTimeout (worker killed) or WorkerCrashed (worker died or answered
        garbage; it is killed too, and the next run starts a fresh one).
        """
        if not self.alive:
            self._start()
        wd = Path(workdir).resolve()  # the worker's working directory is not ours
        req_path, res_path = wd / "request.json", wd / "result.json"
        try:
            res_path.unlink(missing_ok=True)
        except OSError as err:
            raise AmkError(f"cannot remove {res_path}: {err.strerror or err}") from None
        atomic_write_json(req_path, request, durable=False)
        line = json.dumps({"request": str(req_path), "result": str(res_path)}) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            tail = self.tail()
            self.kill()
            raise WorkerCrashed("the evaluation worker exited before taking the request", tail)
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise WorkerTimeout(f"no result within {timeout_s:g} s")
                if not sel.select(timeout=min(left, 1.0)):
                    if self.proc.poll() is not None:
                        break
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                self._buf += chunk
        finally:
            sel.close()
        if b"\n" not in self._buf:
            tail = self.tail()
            try:  # its stdout closed: give it a moment to exit so the code is known
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self.kill()
            raise WorkerCrashed(f"the evaluation worker died (exit code {code})", tail)
        msg, self._buf = self._buf.split(b"\n", 1)
        try:
            done = json.loads(msg)
            with open(done["done"], encoding="utf-8") as f:
                return json.load(f)
        except (ValueError, KeyError, OSError) as err:
            tail = self.tail()
            self.kill()
            raise WorkerCrashed(f"the evaluation worker broke the protocol: {err}", tail)


class Evaluator:
    """Runs candidate requests through a WorkerClient (persistent or fresh per candidate).

    ``evaluate(request, workdir)`` returns the worker's result dict, or a result with
    ``status`` ``timeout`` / ``crash`` built here when the subprocess failed. A worker that
    asks for a restart (``restart_worker``: e.g. a CUDA error left its context unusable)
    is replaced before the next candidate.
    """

    def __init__(self, log_path: str | os.PathLike, timeout_s: float = 600.0,
                 isolation: str = "persistent", env: dict[str, str] | None = None):
        if isolation not in ("persistent", "fresh"):
            raise ValueError(f"isolation must be persistent or fresh, got {isolation!r}")
        self.client = WorkerClient(log_path, env=env)
        self.timeout_s = timeout_s
        self.isolation = isolation

    def evaluate(self, request: dict[str, Any], workdir: str | os.PathLike,
                 timeout_s: float | None = None) -> dict[str, Any]:
        t0 = time.monotonic()
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            res = self.client.run(request, workdir, limit)
        except WorkerTimeout as err:
            return {"status": "timeout", "reason": f"evaluation timed out: {err}",
                    "wall_s": time.monotonic() - t0}
        except WorkerCrashed as err:
            tail = " | ".join(err.tail.splitlines()[-3:])
            return {"status": "crash", "reason": f"{err}: {tail}"[:600],
                    "wall_s": time.monotonic() - t0}
        res.setdefault("wall_s", time.monotonic() - t0)
        if self.isolation == "fresh" or res.get("restart_worker"):
            self.client.close()
        return res

    def close(self) -> None:
        self.client.close()


def new_workdir(base: str | os.PathLike, trial: int) -> Path:
    """The scratch directory of one trial's request/result files (absolute; created).
    Raises AmkError when it cannot be created."""
    d = Path(base).resolve() / f"trial-{trial:04d}"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AmkError(f"cannot create {d}: {err.strerror or err}") from None
    return d

