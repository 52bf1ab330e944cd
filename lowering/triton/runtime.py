"""TritonExecutor: run a ScheduleProgram as one persistent Triton kernel per decode step.

Same interface as the sim backend's ``SimExecutor`` (lowering/sim.py): construct with the
program and an ``init_fn``, write inputs, ``step(epoch)``, read outputs.

Ranks. Without ``dist`` one process runs every rank of the program ("co-located"): one
arena slice per rank in one allocation, rank r's W queues become workers r*W .. r*W+W-1 of
one launch, and remote puts / signals reach a peer's slice through the slice distance. With
``dist`` (a ``lowering.triton.dist.DistContext``: one process per GPU, NVSHMEM initialised)
this process runs its own rank only; its arena slice is an NVSHMEM symmetric allocation and
the peer deltas are the distances to the peers' copies as mapped into this process
(``nvshmem_ptr``), so remote puts are plain stores over NVLink and remote signals are
system-scope release atomics; waits poll with system-scope acquires whenever R > 1. In a
distributed run ``read`` / ``write`` reach only this process's rank: callers run SPMD and
exchange host values themselves (amk.pipeline.Decoder does).

* all buffers and counters are packed once into one device arena (table.py's layout):
  weights are copied in at construction, never again; counters start at 0 and are never
  reset (epoch-relative waits), so a step is exactly one kernel launch;
* the task table is built once; the kernel source is generated for the program's variants
  (codegen.py, cache.py) and compiled by Triton on first launch;
* after each launch the host reads the per-worker error records and raises
  ``TritonWatchdogError`` (a stuck wait: names the tasks, counters, values seen and needed)
  or ``TritonTaskError`` (a position or token out of range), and checks that every worker
  completed its whole queue.

Where it runs: on a CUDA GPU with the program's own worker queues (grid = W persistent
CTAs, W <= SMs x the CTAs per SM that the compiled kernel's occupancy allows, checked before launch and
enforced by a cooperative launch where Triton supports it), or under the Triton CPU
interpreter (``TRITON_INTERPRET=1``, set automatically by ``lowering.triton`` when no GPU is
present) with one worker running ``linearize(program)``: the interpreter runs programs one
after another, so several spinning workers could never make progress there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ir.program import FLOAT_DTYPES, Buffer, ScheduleProgram
from lowering.config import INT8_CONVERTS
from lowering.executors import StepThroughput, check_steps
from lowering.triton import table as T
from lowering.triton import vm as VM
from lowering.triton.blocks import Blocks
from lowering.triton.cache import load_kernel
from lowering.triton.codegen import generate_source
from lowering.triton.errors import TritonError, TritonRefused, TritonTaskError, TritonWatchdogError
from lowering.triton.lang import interpreting
from lowering.triton.ops import REGISTRY, scratch_elems

InitFn = Callable[[Buffer, int], "torch.Tensor | None"]

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "i32": torch.int32,
                "i8": torch.int8, "f8e4m3": torch.float8_e4m3fn}
#: Unwritten int32 memory (lowering/reference.py's INT_POISON); unwritten floats are NaN.
INT_POISON = -(2**31)


@dataclass
class TritonStats(StepThroughput):
    """One ``step`` / ``run_steps`` call: epochs run, tasks executed (sum over workers), wall
    seconds including the launch and the error-record readback, kernel launches."""

    epochs: list[int] = field(default_factory=list)
    tasks: int = 0
    seconds: float = 0.0
    launches: int = 0
    workers: int = 1
    device: str = "cpu"


#: Global-scratch buffers handed to Triton launches, by (device index, bytes): kept for the
#: process's life so that a CUDA graph captured over a launch keeps pointing at live memory.
_SCRATCH: dict[tuple[int, int], torch.Tensor] = {}


def tma_scratch(size: int, alignment: int, stream: Any) -> torch.Tensor:
    """Triton's global-scratch allocator (``triton.set_allocator``) for kernels that build
    tensor descriptors on the device (Blocks.gemv_tma: 128 bytes per descriptor and CTA).
    Returns a uint8 CUDA tensor of ``size`` bytes on the current device, the same one for
    every launch of that size (a launch's descriptors are rebuilt before use, and the
    megakernel runs one launch at a time per device); ``alignment`` (bytes) is at most the
    caching allocator's 512. Raises TritonError if a larger alignment is asked for."""
    if alignment > 512:
        raise TritonError(f"global scratch alignment {alignment} > 512 bytes is not supported", exit_code=2)
    key = (torch.cuda.current_device(), int(size))
    buf = _SCRATCH.get(key)
    if buf is None:
        buf = _SCRATCH[key] = torch.empty(int(size), dtype=torch.uint8, device=f"cuda:{key[0]}")
    return buf


def regs_for_ctas(ctas_per_sm: int, threads: int, regs_per_sm: int = 65536) -> int:
    """The largest per-thread register count at which ``ctas_per_sm`` CTAs of ``threads``
    threads fit in an SM's register file: registers are allocated per warp in units of
    256 (8 per thread; CUDA occupancy calculator, sm_90), at most 255 per thread. Raises
    ValueError when even 24 do not fit."""
    warps = ctas_per_sm * -(-threads // 32)
    r = min(255, (regs_per_sm // warps // 256) * 256 // 32)
    r -= r % 8
    if r < 24:
        raise ValueError(f"{ctas_per_sm} CTAs of {threads} threads cannot share {regs_per_sm} registers")
    return r


def register_cap(maxnreg: int, workers: int, sms: int, threads: int) -> int | None:
    """The ``maxnreg`` compile option for a grid of ``workers`` CTAs of ``threads`` threads on
    ``sms`` SMs: ``maxnreg`` itself when set (non-zero); else None (ptxas chooses) while the
    grid fits one CTA per SM, and otherwise ``regs_for_ctas(ceil(workers / sms), threads)``,
    the most registers at which every worker can be resident."""
    if maxnreg:
        return maxnreg
    if workers <= sms:
        return None
    return regs_for_ctas(-(-workers // sms), threads)


def _pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


class TritonExecutor:
    """Run ``program`` on the Triton backend; see the module docstring.

    ``init_fn(buffer, rank)`` returns a buffer's initial contents (any shape with its element
    count; cast to its dtype) or None (poison: NaN / INT_POISON). ``check=True`` validates
    first (TritonRefused if rejected); ``check=False`` runs unvalidated programs, whose
    deadlocks end in TritonWatchdogError. Structural problems that could make the kernel
    touch memory outside the arena are refused always (layout.TableError).

    ``linear``: run one worker over ``linearize(program)`` (default under the interpreter)
    instead of the program's W queues (default on a GPU; under the interpreter, which runs
    workers one after another, only programs whose waits depend on lower-numbered workers
    complete). ``timeout_s``:
    GPU watchdog bound per wait; ``interpret_polls``: its interpreter counterpart.
    ``blocks``: kernel block sizes; ``num_warps``: warps per worker CTA. ``cooperative``:
    launch with cuLaunchCooperativeKernel where Triton supports it (the driver then refuses a
    grid that cannot be co-resident instead of letting it deadlock until the watchdog fires).
    """

    def __init__(self, program: ScheduleProgram, init_fn: InitFn | None = None, *, check: bool = True,
                 device: str | torch.device | None = None, linear: bool | None = None,
                 timeout_s: float = 2.0, interpret_polls: int = 2, blocks: Blocks | None = None,
                 num_warps: int = 4, cooperative: bool = True, profile: bool = False,
                 dist: Any = None):
        if check:
            self._check(program)
        self.program = program
        self.dist = dist
        self.interpret = interpreting()
        if dist is not None:
            if self.interpret:
                raise TritonError("a distributed (NVSHMEM) run needs GPUs, not the Triton interpreter",
                                  exit_code=2)
            if dist.world != program.ranks:
                raise TritonError(f"program {program.name!r} has {program.ranks} ranks but the run has "
                                  f"{dist.world} processes", exit_code=2)
            device = dist.device
            self.local_ranks = [dist.rank]
        else:
            self.local_ranks = list(range(program.ranks))
        if device is None:
            device = "cpu" if self.interpret else "cuda"
        self.device = torch.device(device)
        if self.interpret and self.device.type != "cpu":
            raise TritonError("TRITON_INTERPRET=1 runs on the CPU; pass device='cpu'", exit_code=2)
        if not self.interpret and self.device.type != "cuda":
            raise TritonError(f"compiled Triton kernels need a CUDA device, got {self.device}; "
                              "set TRITON_INTERPRET=1 to run on the CPU", exit_code=2)
        # Under the interpreter the grid's programs run one after another in worker order, so
        # linear=False there only completes programs whose waits depend on lower workers.
        self.linear = self.interpret if linear is None else bool(linear)
        if program.workers > program.target.max_workers:
            raise TritonError(f"program has {program.workers} workers per rank, target "
                              f"{program.target.name} allows {program.target.max_workers}", exit_code=2)
        self.slots = max(1, program.slots)
        self.num_warps = int(num_warps)
        self.cooperative = bool(cooperative)
        self.timeout = int(interpret_polls) if self.interpret else int(timeout_s * 1e9)
        if self.timeout < 1:
            raise ValueError("the watchdog bound must be positive")

        # One arena slice of ``arena_bytes`` per rank, the same size on every rank (a
        # symmetric allocation must be). Co-located ranks share one allocation (slice r at
        # r * arena_bytes); a distributed rank's slice is its NVSHMEM symmetric tensor.
        base_layouts = {r: T.build_layout(program, r) for r in range(program.ranks)}
        self.arena_bytes = max(lay.nbytes for lay in base_layouts.values())
        if dist is not None:
            from lowering.triton.dist import init_nvshmem
            init_nvshmem(dist, self.arena_bytes)
            self.arena = dist.symmetric_bytes(self.arena_bytes)
            self.base = {dist.rank: 0}
            peer = dist.peer_deltas(self.arena)
            deltas = {dist.rank: peer}
        else:
            self.arena = torch.zeros(self.arena_bytes * program.ranks, dtype=torch.uint8, device=self.device)
            self.base = {r: r * self.arena_bytes for r in self.local_ranks}
            deltas = {r: {q: (q - r) * self.arena_bytes for q in range(program.ranks) if q != r}
                      for r in self.local_ranks}
        self.layouts = {r: T.shift_layout(base_layouts[r], self.base[r]) for r in self.local_ranks}
        b = self.blocks = blocks or Blocks()  # _build_table reads its table options
        self.table = self._build_table(deltas, strict=check)
        self.workers = self.table.workers
        b.attention_d = max(b.attention_d, _pow2(self.table.dims["head_dim"]))
        b.attention_q = max(b.attention_q, _pow2(self.table.dims["group"]))
        # Keep attention's [Q, T, D] fp32 product within ~64 registers per thread.
        while b.attention_t > 1 and b.attention_q * b.attention_t * b.attention_d > 64 * 32 * max(4, self.num_warps):
            b.attention_t //= 2
        self.source = generate_source(self.table, program.name, sys_waits=program.ranks > 1)
        self._kernel = load_kernel(self.source)

        self._alloc(init_fn)
        dev = self.device
        self._rows = torch.from_numpy(self.table.rows).to(dev)
        self._waits = torch.from_numpy(self.table.waits).to(dev)
        self._sigs = torch.from_numpy(self.table.signals).to(dev)
        self._qstart = torch.from_numpy(self.table.qstart).to(dev)
        streams, sstart = T.stream_list(self.table)
        self.ring_pages = b.ring if any(v.flag("ring") for v in self.table.variants) else 0
        self._streams = torch.from_numpy(streams).to(dev)
        self._sstart = torch.from_numpy(sstart).to(dev)
        self._rbase = 1024  # the ring's shared-memory offset: set after the compile (_check_coresidency)
        self._err = torch.zeros(self.workers * VM.ERR_W + 1, dtype=torch.int64, device=dev)
        # Profile: per task row, %globaltimer (ns) at wait start, op start and end (GPU only).
        self.profile = bool(profile) and not self.interpret
        self._prof = torch.zeros(max(1, self.table.n_tasks) * VM.PROF_W if self.profile else 1,
                                 dtype=torch.int64, device=dev)
        self._epoch = torch.zeros(1, dtype=torch.int64, device=dev)
        # one GEMV f(x) scratch row per worker (Blocks.x_stage): the longest GEMV input,
        # rounded up to 16 elements of 4 bytes (64-byte aligned rows; any x dtype fits)
        self._xs_w = -(-max([scratch_elems(t, self.slots) for t in program.tasks] + [1]) // 16) * 16
        staged = (b.x_stage or self.ring_pages > 0  # ring GEMVs always stage f(x)
                  or any(g.always_staged for g in (REGISTRY[t.op].gemv for t in program.tasks) if g))
        self._xs = torch.zeros(self.workers * self._xs_w if staged else 16, dtype=torch.float32, device=dev)
        self._qlen = [int(self.table.qstart[w + 1] - self.table.qstart[w]) for w in range(self.workers)]
        self._next_epoch = 0
        self._broken: str | None = None
        self._launch_kw = self._launch_options()
        self.compiled = None  # the CompiledKernel after the first GPU launch
        self.occupancy: dict[str, Any] = {}

    def _build_table(self, deltas: dict[int, dict[int, int]], strict: bool) -> T.TaskTable:
        """The task table of every local rank, merged into one grid: rank r's W queues are
        workers r*W .. r*W+W-1 (in local-rank order); in linear mode, one worker runs a
        topological order of all local ranks' tasks (the interpreter runs programs one
        after another, so the ranks must interleave inside one queue)."""
        program = self.program
        reuse_x = self.blocks.x_stage and self.blocks.x_reuse
        tables: list[T.TaskTable] = []
        variants: list[T.Variant] = []
        if self.linear:
            everything = T.linearize(program, None, strict=strict)
            order = [t for t in everything if t.rank in self.base]
            pos: dict[str, tuple[int, int]] = {}
            for ri, r in enumerate(self.local_ranks):
                mine = [t for t in order if t.rank == r]
                # the ranks' linear queues are interleaved by merge_tables: a deferred signal
                # could be waited on by another rank's task in between, so no coalescing
                # (nor staged-x reuse: another rank's task in between restages the scratch)
                alone = len(self.local_ranks) == 1
                tab = T.build_table(program, r, [mine], self.layouts[r], deltas[r], variants,
                                    elide=self.blocks.elide_waits,
                                    coalesce=self.blocks.coalesce_signals and alone,
                                    reuse_x=reuse_x and alone, ring=self.blocks.ring > 0)
                variants = tab.variants
                tables.append(tab)
                pos.update({t.id: (ri, i) for i, t in enumerate(mine)})
            queues = [[pos[t.id] for t in order]]
        else:
            q = program.queues()
            queues = []
            for ri, r in enumerate(self.local_ranks):
                tab = T.build_table(program, r, [q.get((r, w), []) for w in range(program.workers)],
                                    self.layouts[r], deltas[r], variants, elide=self.blocks.elide_waits,
                                    coalesce=self.blocks.coalesce_signals, reuse_x=reuse_x,
                                    ring=self.blocks.ring > 0)
                variants = tab.variants
                tables.append(tab)
                queues += [[(ri, i) for i in range(int(tab.qstart[w]), int(tab.qstart[w + 1]))]
                           for w in range(tab.workers)]
        merged = T.merge_tables(tables, queues)
        T.prefetch_ahead(merged, self.blocks.prefetch, self.blocks.prefetch_rows)
        return merged

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _check(program: ScheduleProgram) -> None:
        try:
            from validator import validate  # lazy: heavy imports (z3) only when validating
        except ImportError as e:
            raise TritonError(f"check=True needs validator.validate, which cannot be imported ({e}); "
                              "pass check=False to run an unvalidated program", exit_code=2) from e
        try:
            verdict = validate(program)
        except ImportError as e:  # e.g. z3 missing on a GPU image
            raise TritonError(f"check=True: the validator needs a module that is not installed ({e}); "
                              "install it or pass check=False", exit_code=2) from e
        if not verdict.ok:
            raise TritonRefused(verdict)

    def _alloc(self, init_fn: InitFn | None) -> None:
        self._views: dict[tuple[int, str], torch.Tensor] = {}
        self._counters: dict[int, torch.Tensor] = {}
        for r in self.local_ranks:
            lay = self.layouts[r]
            for b in self.program.buffers:
                if b.name not in lay.offsets:
                    continue
                off = lay.offsets[b.name]
                dt = TORCH_DTYPES[b.dtype]
                v = self.arena[off:off + b.nbytes].view(dt).view(b.shape)
                self._views[(r, b.name)] = v
                init = init_fn(b, r) if init_fn is not None else None
                if init is None:
                    v.fill_(float("nan") if b.dtype in FLOAT_DTYPES or b.dtype == "f8e4m3" else
                            -128 if b.dtype == "i8" else INT_POISON)
                else:
                    if not isinstance(init, torch.Tensor):
                        raise TritonError(f"init_fn returned {type(init).__name__} for buffer {b.name}; "
                                          "expected a torch.Tensor or None", exit_code=2)
                    if init.numel() != b.numel:
                        raise TritonError(f"init_fn gave {tuple(init.shape)} ({init.numel()} elements) for "
                                          f"buffer {b.name} of shape {b.shape}", exit_code=2)
                    v.copy_(init.detach().reshape(b.shape).to(device=self.device, dtype=dt))
            c0 = lay.counters_offset
            self._counters[r] = self.arena[c0:c0 + 4 * len(self.program.counters)].view(torch.int32)
        if self.dist is not None:
            torch.cuda.synchronize(self.device)
            self.dist.barrier()  # every rank's counters are zero before any kernel signals them

    def _launch_options(self) -> dict[str, Any]:
        b = self.blocks
        kw: dict[str, Any] = dict(
            BLOCK=b.elementwise, GEMV_N=b.gemv_n, GEMV_K=b.gemv_k, ROPE_BLOCK=b.rope,
            ATT_T=b.attention_t, ATT_D=b.attention_d, ATT_Q=b.attention_q, PAIR_BLOCK=b.pairs,
            GEMV_STAGES=b.gemv_stages, PREFETCH=b.prefetch, GEMV_UNROLL=b.gemv_unroll,
            ROW_PREFETCH=bool(b.row_prefetch), X_STAGE=bool(b.x_stage), X_CHUNK=b.x_chunk,
            W_PRELOAD=b.w_preload, PREFETCH_CAP=b.prefetch_cap, ROLL=b.roll, LEAN_RELEASE=bool(b.lean_release),
            GEMV_TMA=bool(b.gemv_tma), RING=self.ring_pages, RING_PR=b.ring_rows, RING_PC=b.ring_cols,
            Q_TMA=bool(b.gemv_tma and b.q_tma), GEMV_NQ=b.q_gemv_n or b.gemv_n,
            I8_CVT=INT8_CONVERTS.index(b.int8_convert),
        )
        kw["GEMM_M"], kw["GEMM_N"], kw["GEMM_K"] = b.gemm_blocks(self.table.dims)
        if not self.interpret:
            kw["num_warps"] = self.num_warps
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            cap = register_cap(b.maxnreg, self.workers, sms, 32 * self.num_warps)
            if cap:
                kw["maxnreg"] = cap
            if self.profile:
                kw["PROFILE"] = True
            if self.cooperative and _supports_cooperative_launch():
                kw["launch_cooperative_grid"] = True
        return kw

    def _args(self) -> tuple:
        a = self.arena
        return (a.view(torch.bfloat16), a.view(torch.float16), a.view(torch.float32), a.view(torch.int32),
                self._rows, self._waits, self._sigs, self._qstart, self._err, self._epoch, self.slots,
                self.timeout, self._prof, self._xs, self._xs_w, self._streams, self._sstart, self._rbase)

    def _check_coresidency(self) -> None:
        """Refuse a launch whose W workers cannot all be resident at once (they would spin on
        each other forever): W <= SMs x CTAs of this kernel per SM, and at least one fits."""
        compiled = self._kernel.warmup(*self._args(), grid=(self.workers,), **self._launch_kw)
        self.compiled = compiled
        if self.ring_pages:
            self._reserve_ring(compiled)
        compiled._init_handles()
        props = torch.cuda.get_device_properties(self.device)
        sms = props.multi_processor_count
        n_regs = int(getattr(compiled, "n_regs", 0) or 0)
        shared = int(getattr(compiled.metadata, "shared", 0) or 0)
        warps = int(getattr(compiled.metadata, "num_warps", self.num_warps))
        threads = warps * 32
        per_sm = _occupancy(compiled, threads, shared)
        if per_sm is None:  # no driver binding: compute from the resource limits
            limits = [props.max_threads_per_multi_processor // threads]
            regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
            if n_regs:
                limits.append(regs_sm // (n_regs * threads))
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
            if shared and smem_sm:
                limits.append(smem_sm // shared)
            per_sm = min(limits)
        self.occupancy = dict(sms=sms, ctas_per_sm=per_sm, n_regs=n_regs, shared=shared, warps=warps,
                              workers=self.workers, cooperative="launch_cooperative_grid" in self._launch_kw)
        if self.workers > sms * max(per_sm, 0):
            raise TritonError(f"{self.workers} workers cannot all be resident on {props.name}: {per_sm} CTA(s) "
                              f"of this kernel fit per SM ({n_regs} registers/thread, {shared} B shared memory, "
                              f"{threads} threads) x {sms} SMs = {sms * max(per_sm, 0)}; a persistent kernel "
                              "needs every worker resident at once (fewer workers, or fewer warps)")
        if per_sm < 1:
            raise TritonError(f"the megakernel cannot be resident on an SM ({n_regs} registers/thread, "
                              f"{shared} B shared memory, {threads} threads); lower num_warps or block sizes")

    def _reserve_ring(self, compiled: Any) -> None:
        """Give the weight ring its shared memory: the launch's dynamic shared memory grows by
        ring.ring_smem bytes past the kernel's own (rounded up to 128 bytes), whose offset
        the kernel gets as ``rbase``. Triton launches with ``metadata.shared`` bytes, so the
        compiled kernel's metadata is extended before its first load (the same object serves
        every later launch and CUDA-graph capture of this source). Raises TritonError (exit
        code 2) when the ring does not fit the device's shared memory per block."""
        from triton.compiler.compiler import make_backend

        from lowering.triton import ring as RG

        own = getattr(compiled, "_amk_own_shared", None)
        if own is None:
            own = compiled._amk_own_shared = int(compiled.metadata.shared)
        self._rbase = max(128, -(-own // 128) * 128)
        need = self._rbase + RG.ring_smem(self.ring_pages, self.blocks.ring_page)
        limit = int(getattr(torch.cuda.get_device_properties(self.device), "shared_memory_per_block_optin", 0) or 0)
        if limit and need > limit:
            raise TritonError(f"the weight ring needs {need} B of shared memory per worker ({self.ring_pages} pages "
                              f"of {self.blocks.ring_page} B after the kernel's own {own} B), the device allows "
                              f"{limit} B: use fewer pages (--ring) or smaller ones (--ring-rows, --ring-cols)",
                              exit_code=2)
        if int(compiled.metadata.shared) != need:
            compiled.metadata = compiled.metadata._replace(shared=need)
            compiled.packed_metadata = make_backend(compiled.metadata.target).pack_metadata(compiled.metadata)

    # ------------------------------------------------------------- public API
    def read(self, buffer: str, rank: int = 0) -> torch.Tensor:
        """A CPU copy of ``buffer`` on ``rank`` (its dtype and shape)."""
        return self._view(buffer, rank).detach().to("cpu", copy=True)

    def write(self, buffer: str, rank: int, value: torch.Tensor) -> None:
        """Overwrite ``buffer`` on ``rank`` with ``value`` (same element count; cast to the
        buffer's dtype). Call between steps (token and position inputs)."""
        v = self._view(buffer, rank)
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value.numel() != v.numel():
            raise TritonError(f"write {buffer}@{rank}: value has {value.numel()} elements, buffer "
                              f"{v.numel()}", exit_code=2)
        v.copy_(value.detach().reshape(v.shape).to(device=self.device, dtype=v.dtype))

    def counter_values(self) -> dict[str, int]:
        """Current value of every counter of the local ranks (int32, wrapping; monotone
        across steps)."""
        vals = {r: c.to("cpu").tolist() for r, c in self._counters.items()}
        return {c.name: vals[c.rank][i] for i, c in enumerate(self.program.counters) if c.rank in vals}

    @property
    def next_epoch(self) -> int:
        """The epoch the next ``step`` must run (epochs run in order from 0)."""
        return self._next_epoch

    def step(self, epoch: int) -> TritonStats:
        """Run decode step ``epoch``: one kernel launch. Epochs run in order from 0 (counters
        are epoch-relative). Raises TritonWatchdogError / TritonTaskError when the kernel
        reports a failure (the executor is unusable afterwards), ValueError for an
        out-of-order epoch."""
        if self._broken:
            raise TritonError(f"the executor is unusable after an earlier failure: {self._broken}")
        if epoch != self._next_epoch:
            raise ValueError(f"epochs run in order: expected epoch {self._next_epoch}, got {epoch}")
        return self.run_steps(1)

    def run_steps(self, count: int, on_start: Callable[[int, int], None] | None = None,
                  on_end: Callable[[int, int], None] | None = None) -> TritonStats:
        """Run ``count`` consecutive epochs (one launch each); ``on_start(epoch, rank)`` before
        and ``on_end(epoch, rank)`` after each (write inputs / read outputs there)."""
        first = self._next_epoch
        check_steps(self._broken, count, first, self.program.max_epochs, TritonError)
        stats = TritonStats(epochs=list(range(first, first + count)), workers=self.workers,
                            device=str(self.device))
        t0 = time.perf_counter()
        for e in range(first, first + count):
            if on_start is not None:
                for r in self.local_ranks:
                    on_start(e, r)
            try:
                self._launch(e)
            except BaseException as exc:
                self._broken = f"{type(exc).__name__}: {exc}"
                raise
            self._next_epoch = e + 1
            stats.tasks += self.table.n_tasks
            stats.launches += 1
            if on_end is not None:
                for r in self.local_ranks:
                    on_end(e, r)
        stats.seconds = time.perf_counter() - t0
        return stats

    def emit_source(self, path: str | Path) -> Path:
        """Write the generated kernel source (the module Triton compiles) to ``path``, with a
        last comment line ``# amk-launch: {json}`` holding the launch's constexprs, num_warps
        and grid (read by ``offline.compile_offline``'s command line). Raises AmkError
        (exit 2) when the file cannot be written."""
        path = Path(path)
        launch = {k: v for k, v in self._launch_kw.items() if k.isupper()}
        meta = dict(constexprs=launch, num_warps=self.num_warps, grid=self.workers)
        if self._launch_kw.get("maxnreg"):
            meta["maxnreg"] = self._launch_kw["maxnreg"]
        from ground.files import atomic_write_text  # whole or not at all; AmkError names the path

        return atomic_write_text(path, self.source + f"# amk-launch: {json.dumps(meta, sort_keys=True)}\n",
                                 durable=False)

    # ------------------------------------------------------------- internals
    def _view(self, buffer: str, rank: int) -> torch.Tensor:
        if rank not in self.base:
            raise TritonError(f"rank {rank}: this process runs rank(s) {self.local_ranks} only", exit_code=2)
        v = self._views.get((rank, buffer))
        if v is None:
            raise TritonError(f"unknown buffer {buffer!r} (not held by rank {rank})", exit_code=2)
        return v

    def arm_scratch(self) -> None:
        """Set Triton's global-scratch allocator for this thread's launches when the kernel
        builds tensor descriptors on the device (Blocks.gemv_tma); a no-op otherwise and
        under the interpreter. Call before every launch site (a ContextVar: per thread)."""
        if self.blocks.gemv_tma and not self.interpret:
            import triton

            triton.set_allocator(tma_scratch)

    def _launch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)
        self.arm_scratch()
        if not self.interpret and self.compiled is None:
            self._check_coresidency()  # compiles the kernel (seconds) before its first launch
            if self.dist is not None:
                # every rank launches only once all have compiled: a rank whose compile runs
                # 2 s longer than a peer's would leave that peer's first waits past the
                # watchdog bound
                self.dist.barrier()
        self._kernel[(self.workers,)](*self._args(), **self._launch_kw)
        rec = self._err.to("cpu")
        self._report(epoch, rec)

    def _report(self, epoch: int, rec: torch.Tensor) -> None:
        W = self.workers
        r = rec[: W * VM.ERR_W].view(W, VM.ERR_W).tolist()
        stuck, task_err = [], None
        for w, (kind, row, a, b, c, ep, done, _) in enumerate(r):
            if kind == VM.KIND_OK:
                if done != self._qlen[w]:
                    raise TritonError(f"epoch {epoch}: worker {w} completed {done} of its "
                                      f"{self._qlen[w]} tasks without reporting an error")
                continue
            tid, op = self.table.task_ids[row], self.table.task_ops[row]
            if self.program.ranks > 1:
                tid = f"{tid} (rank {self.table.task_ranks[row]})"
            qi = row - int(self.table.qstart[w])
            if kind in (VM.KIND_TIMEOUT, VM.KIND_ABORTED):
                # wait index -1: a weight-ring page (b consumed, c issued) that never arrived
                counter = self.table.wait_counters[a] if a >= 0 else f"weight page {b} (of {c} issued)"
                stuck.append(dict(worker=w, task=tid, op=op, queue_index=qi, counter=counter, seen=b, needed=c,
                                  kind="timeout" if kind == VM.KIND_TIMEOUT else "aborted"))
            elif kind in (VM.KIND_POS, VM.KIND_TOKEN) and task_err is None:
                where = f"epoch {epoch}: task {tid} ({op}, worker {w})"
                if kind == VM.KIND_TOKEN:
                    task_err = (f"{where}: token {a} outside the embedding table [0, {b})", tid)
                elif b:
                    task_err = (f"{where}: position {a} outside the KV cache [0, {b})", tid)
                else:
                    task_err = (f"{where}: negative position {a}", tid)
            elif kind in (VM.KIND_POS, VM.KIND_TOKEN):
                continue
            else:
                raise TritonError(f"epoch {epoch}: worker {w} reported unknown error kind {kind}")
        if task_err is not None:
            raise TritonTaskError(task_err[0], task_err[1], epoch)
        if stuck:
            stuck.sort(key=lambda s: s["kind"] != "timeout")
            bound = f"{self.timeout} polls" if self.interpret else f"{self.timeout / 1e9:g} s"
            parts = [f"worker {s['worker']} {'stuck' if s['kind'] == 'timeout' else 'stopped'} at task "
                     f"{s['task']} ({s['op']}, queue position {s['queue_index']}) waiting on counter "
                     f"{s['counter']} (value {s['seen']}, needs {s['needed']})" for s in stuck]
            raise TritonWatchdogError(f"epoch {epoch}: watchdog: a wait exceeded {bound}: " + "; ".join(parts),
                                      stuck)


def _supports_cooperative_launch() -> bool:
    """Whether this Triton's CUDA backend has the ``launch_cooperative_grid`` option
    (cuLaunchCooperativeKernel: the launch fails instead of deadlocking when the grid cannot
    be co-resident)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:
        return False
    return "launch_cooperative_grid" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _occupancy(compiled: Any, threads: int, shared: int) -> int | None:
    """CTAs of ``compiled`` per SM from the CUDA driver's occupancy calculator, or None when
    the driver binding (cuda-python) is unavailable."""
    try:
        from cuda.bindings import driver as cu  # cuda-bindings >= 12.6
    except Exception:
        try:
            from cuda import cuda as cu  # older cuda-python
        except Exception:
            return None
    try:
        err, n = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(cu.CUfunction(compiled.function), threads, shared)
        if int(err) != 0:
            return None
        return int(n)
    except Exception:
        return None
