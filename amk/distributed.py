"""``amk.distribute``: a function written with torch ops and torch.distributed collectives,
replaced by amk's fused, validated schedule of the same computation (docs/dist.md).

``distribute(fn, world=R, shapes={...}, dtype="bf16", backend="sim", config=None)`` captures
``fn`` (models/capture.py: dynamo under a fake process group of R ranks), recognises its
pattern (models/collectives.py), lowers it to one ScheduleProgram of R ranks
(lowering/collectives.py: GEMM tiles, puts with signals, local reductions, communication
overlapped with compute), validates it (validator.validate: deadlock and race freedom) and
returns a callable with ``fn``'s signature. Called in every process of an initialised process
group of R ranks (torchrun; rank = ``dist.get_rank()``), it computes what ``fn`` computes:

* ``backend="sim"``: every process all-gathers the operands over the group (the group's own
  backend: gloo for CPU tensors, NCCL for CUDA tensors), runs the whole program for all R
  ranks on the CPU reference executor (lowering.sim.SimExecutor) and returns its own rank's
  output, on the device and in the dtype ``fn`` returns. A reference, not a fast path.
* ``backend="triton"``: each process runs its own rank of the persistent Triton megakernel
  (lowering.triton.runtime.TritonExecutor) on GPU ``LOCAL_RANK``, peers reached through NVSHMEM
  symmetric memory (lowering.triton.dist: the arena is an NVSHMEM allocation, puts are stores
  over NVLink, signals system-scope atomics). The process group is the caller's; NVSHMEM is
  initialised on the first call (collective: every rank must call) and finalised at exit.

The helpers below (``load_config``, ``lower``, ``seeded_inputs``, ``run_sim``, ``compare``;
the last three from search/patterns.py, which a pattern's ``amk search`` runs) are what
``amk dist`` (amk/commands/dist.py) runs too.
"""

from __future__ import annotations

import atexit
import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ground.errors import AmkError
# TOL, INPUT_STD, seeded_inputs and compare live in search.patterns (a pattern's search checks
# its trials with them too); amk dist, the examples and amk.distributed's callers take them here
from search.patterns import INPUT_STD, TOL, compare, seeded_inputs  # noqa: F401

BACKENDS = ("sim", "triton")


# ----------------------------------------------------------------------------- config
def load_config(config: Any, pattern: str | None = None, source: str | None = None) -> tuple[Any, Any]:
    """(CollectiveConfig, KernelConfig or None) from ``config``: None (defaults), a
    CollectiveConfig, a dict of collective knobs or of parts (``{"collective": {...},
    "kernel": {...}}``), or a config file path (docs/lowering.md). ``pattern`` (a pattern
    kind) also refuses knobs that do nothing for it; ``source`` names a dict's file in the
    messages. Raises AmkError naming the field."""
    from lowering.config import CollectiveConfig, KernelConfig, collective_part

    kernel = None
    if config is None:
        return CollectiveConfig().validate("config", pattern), None
    if isinstance(config, CollectiveConfig):
        return config.validate("config", pattern), None
    if isinstance(config, (str, os.PathLike)):
        from ground.files import read_json

        obj, source = read_json(config, "config file"), str(config)
    elif isinstance(config, dict):
        obj, source = config, source or "config"
    else:
        raise AmkError(f"config must be None, a CollectiveConfig, a dict or a file path, got {type(config).__name__}")
    if isinstance(obj, dict) and isinstance(obj.get("kernel"), dict):
        kernel = KernelConfig.from_json(obj["kernel"], f"{source}: kernel")
    return CollectiveConfig.from_json(collective_part(obj, source), source, pattern), kernel


def target_for(backend: str, device: torch.device | None = None):
    """The Target a pattern is lowered and validated for: the sim's default, or for
    ``triton`` the CUDA device's SMs (amk.bench.cuda_target) when one is visible."""
    from ir.program import Target

    if backend == "triton" and torch.cuda.is_available():
        from amk.bench import cuda_target

        dev = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        return cuda_target(torch.cuda.get_device_properties(dev))
    return Target(backend=backend)


@dataclass
class Lowered:
    """A pattern's validated program, its Binding (lowering/collectives.py), the verdict and
    the seconds that lowering and validation took."""

    program: Any
    binding: Any
    verdict: Any
    lower_s: float
    validate_s: float


def lower(pattern: Any, cfg: Any, backend: str = "sim", target: Any = None) -> Lowered:
    """Lower ``pattern`` with CollectiveConfig ``cfg`` for ``backend`` and validate the program
    (``validator.validate`` against that backend's op set). The verdict may reject: the caller
    decides (``distribute`` raises, ``amk dist`` prints the findings)."""
    from lowering.collectives import lower_pattern
    from validator import validate

    t0 = time.perf_counter()
    program, binding = lower_pattern(pattern, cfg, target or target_for(backend))
    t1 = time.perf_counter()
    verdict = validate(program, backend=backend)
    return Lowered(program, binding, verdict, t1 - t0, time.perf_counter() - t1)


def rejected(verdict: Any) -> AmkError:
    """The error (exit code 1) for a program the validator rejected: its first findings."""
    head = "; ".join(f"{f.cls}: {f.message}" for f in verdict.errors[:3])
    more = f" (+{len(verdict.errors) - 3} more)" if len(verdict.errors) > 3 else ""
    return AmkError(f"the validator rejected the lowered schedule: {head}{more}", exit_code=1)


# ----------------------------------------------------------------------------- sim runs
def run_sim(lowered: Lowered, inputs: list[dict[str, torch.Tensor]], *, seed: int = 0,
            policy: str = "random", executor: Any = None, epoch: int = 0) -> tuple[list[torch.Tensor], Any]:
    """Run one epoch of the lowered program on the sim with every rank's operands
    (``inputs[r][name]``, the pattern's layout); returns (every rank's output, the executor).
    ``executor``: a SimExecutor of this program to reuse (its next epoch is ``epoch``).
    Raises AmkError (exit code 1) when the sim deadlocks or an op fails."""
    from search.patterns import run_sim as run_program

    return run_program(lowered.program, lowered.binding, inputs, seed=seed, policy=policy, executor=executor,
                       epoch=epoch)


def run_colocated_triton(lowered: Lowered, inputs: list[dict[str, torch.Tensor]],
                         kernel: Any = None) -> list[torch.Tensor]:
    """Run one epoch of the lowered program as the Triton megakernel with every rank in this
    process (lowering.triton.runtime.TritonExecutor without ``dist``: one GPU, or the Triton
    CPU interpreter when none is present; ``import lowering.triton`` must come before any
    ``import triton``); every rank's output (CPU). ``kernel``: KernelConfig of the kernel
    knobs. Raises AmkError (lowering.triton.errors.TritonError, exit code 1) when the run fails."""
    from lowering.triton.blocks import kernel_options
    from lowering.triton.runtime import TritonExecutor

    b = lowered.binding
    ex = TritonExecutor(lowered.program, None, check=False, **(kernel_options(kernel) if kernel is not None else {}))
    for r, ins in enumerate(inputs):
        b.write_inputs(ex, r, ins)
    ex.step(0)
    return [b.read_output(ex, r, 0) for r in range(len(inputs))]


# ----------------------------------------------------------------------------- the callable
class DistributedFunction:
    """The callable ``distribute`` returns (module docstring): ``fn``'s name, docstring and
    signature, and

    * ``captured``: the models.capture.Captured (pattern, operand binding);
    * ``program`` / ``binding``: the validated ScheduleProgram and its lowering.collectives
      Binding; ``backend``: ``sim`` or ``triton``.
    """

    def __init__(self, fn: Callable, captured: Any, lowered: Lowered, backend: str, kernel: Any = None):
        functools.update_wrapper(self, fn)
        self.__signature__ = captured.signature
        self.captured = captured
        self.lowered = lowered
        self.program = lowered.program
        self.binding = lowered.binding
        self.backend = backend
        self._kernel = kernel
        self._ex: Any = None
        self._graph: Any = None  # the triton path's StepGraph, once its executor has compiled
        self._epoch = 0
        self._ctx: Any = None

    def __repr__(self) -> str:
        return f"<amk.distribute of {self.captured.name}: {self.captured.describe()}, backend {self.backend}>"

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        import torch.distributed as dist

        ops = self.captured.bind(args, kwargs)
        R = self.captured.pattern.world
        if not dist.is_available() or not dist.is_initialized():
            raise AmkError(f"{self.captured.name}: call it in every process of an initialised process group "
                           f"of {R} ranks (torchrun --nproc-per-node {R}; dist.init_process_group)")
        if dist.get_world_size() != R:
            raise AmkError(f"{self.captured.name} was distributed for world size {R}; this process group has "
                           f"{dist.get_world_size()} ranks")
        device = next(iter(ops.values())).device
        if self.backend == "sim":
            y = self._call_sim(dist.get_rank(), ops)
        else:
            y = self._call_triton(dist.get_rank(), ops)
        return y.to(device=device, dtype=self.captured.out_dtype)

    def _operands(self, ops: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from models.collectives import DTYPES

        dt = DTYPES[self.captured.pattern.dtype]
        return {k: v.detach().to(dt).contiguous() for k, v in ops.items()}

    def _call_sim(self, rank: int, ops: dict[str, torch.Tensor]) -> torch.Tensor:
        import torch.distributed as dist

        R = self.captured.pattern.world
        mine = self._operands(ops)
        everyone: list[dict[str, torch.Tensor]] = [{} for _ in range(R)]
        for name in sorted(mine):  # the same order on every rank
            t = mine[name]
            parts = [torch.empty_like(t) for _ in range(R)]
            dist.all_gather(parts, t)
            for r in range(R):
                everyone[r][name] = parts[r].cpu()
        if self._ex is not None and self._epoch >= self.program.max_epochs:
            self._ex, self._epoch = None, 0
        try:
            outs, self._ex = run_sim(self.lowered, everyone, seed=self._epoch, executor=self._ex, epoch=self._epoch)
        except BaseException:
            self._ex, self._epoch = None, 0  # a failed executor is unusable: start afresh next call
            raise
        self._epoch += 1
        return outs[rank]

    def _call_triton(self, rank: int, ops: dict[str, torch.Tensor]) -> torch.Tensor:
        """One epoch on this rank's GPU. The first call of an executor launches through
        ``step`` (it compiles); later calls replay that launch from a CUDA graph (no
        per-call argument packing, lowering.triton.graph.StepGraph). Every call reads the
        kernel's error records before returning, so a failure raises instead of returning a
        wrong tensor; a failed executor is dropped and the next call starts afresh."""
        if self._ex is None or self._epoch >= self.program.max_epochs:
            self._ex, self._graph = self._triton_executor(rank), None
            self._epoch = 0
        ex, b, e = self._ex, self.binding, self._epoch
        try:
            b.write_inputs(ex, rank, self._operands(ops))
            if self._graph is None:
                ex.step(e)
                from lowering.triton.graph import StepGraph
                self._graph = StepGraph(ex)  # captured at the next step boundary
            else:
                self._graph.replay()
                self._graph.check()
        except BaseException:
            self._ex, self._graph, self._epoch = None, None, 0
            raise
        self._epoch += 1
        # the output region read on the device (Binding.read_output would copy to the host)
        reg = b.outputs[rank]
        full = ex._view(reg.buffer, rank)
        idx = tuple(slice(a, z) for a, z in reg.concrete(e % b.slots))
        return full[idx].reshape(self.captured.pattern.output_shape()).clone()

    def _triton_executor(self, rank: int) -> Any:
        if not torch.cuda.is_available():
            raise AmkError("backend triton needs CUDA GPUs, one per rank; none is visible (use backend='sim')")
        try:
            from lowering.triton.blocks import kernel_options
            from lowering.triton.runtime import TritonExecutor
        except ImportError as e:
            raise AmkError(f"backend triton is not available here: {e}") from None
        if self._ctx is None:
            local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
            torch.cuda.set_device(local)
            self._ctx = _caller_group_context(rank, self.captured.pattern.world, local)
            atexit.register(self._ctx.close)
        opts = kernel_options(self._kernel) if self._kernel is not None else {}
        return TritonExecutor(self.program, None, check=False, dist=self._ctx, **opts)


def _caller_group_context(rank: int, world: int, local_rank: int) -> Any:
    """A lowering.triton.dist.DistContext on the caller's process group: its ``close``
    releases NVSHMEM but leaves the group to its owner."""
    from lowering.triton.dist import NO_MULTICAST_ENV, DistContext

    for k, v in NO_MULTICAST_ENV.items():  # no multicast / NVLS (docs/gpu-testing.md)
        os.environ.setdefault(k, v)
    return DistContext(rank=rank, world=world, local_rank=local_rank,
                       device=torch.device("cuda", local_rank), owns_group=False)


def distribute(fn: Callable, *, world: int, shapes: dict[str, tuple[int, ...]], dtype: str = "bf16",
               backend: str = "sim", config: Any = None) -> DistributedFunction:
    """Capture ``fn``, lower its pattern for ``world`` ranks and validate it; the callable that
    runs the fused schedule (module docstring).

    ``shapes``: rank-local shape of each tensor parameter (other parameters need defaults;
    they are fixed at capture). ``dtype``: ``bf16``, ``f16`` or ``f32``. ``backend``: ``sim``
    (any machine) or ``triton`` (one CUDA GPU per rank, NVSHMEM). ``config``: the collective
    knobs (``load_config``). Raises AmkError: exit code 2 for a function or config amk dist
    cannot take (the message names file:line), 1 when the validator rejects the schedule.
    """
    from models.capture import capture

    if backend not in BACKENDS:
        raise AmkError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    captured = capture(fn, world, shapes, dtype)
    cfg, kernel = load_config(config, captured.pattern.kind)
    lowered = lower(captured.pattern, cfg, backend)
    if not lowered.verdict.ok:
        raise rejected(lowered.verdict)
    return DistributedFunction(fn, captured, lowered, backend, kernel)


__all__ = ["BACKENDS", "DistributedFunction", "Lowered", "TOL", "compare", "distribute", "load_config", "lower",
           "rejected", "run_colocated_triton", "run_sim", "seeded_inputs", "target_for"]
