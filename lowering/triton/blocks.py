"""The Triton backend's launch knobs: ``Blocks``, the megakernel's compile-time block sizes and
options (the search and ``amk bench`` set them; runtime.TritonExecutor launches with them).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowering.triton.errors import TritonError


@dataclass
class Blocks:
    """Compile-time block sizes of the megakernel (elements). ``attention_d`` and
    ``attention_q`` are raised to cover the program's head_dim and GQA group if smaller.
    ``gemv_stages``: the GEMV weight pipeline depth (ops/gemv.py gemv_ex ``STAGES``: 1 = one
    [gemv_n, gemv_k] block in flight; S >= 2 = S - 1 blocks in flight through cp.async into
    S - 1 shared-memory buffers). Raises TritonError (exit code 2) if it is not 1..8.
    ``prefetch``: L2 prefetch look-ahead in tasks (0 = off; D: at the start of task i the
    worker starts an L2 bulk prefetch of task i + D's GEMV weight tile, so weight streaming
    overlaps waits and other tasks; vm.l2_prefetch). Must be 0..8. ``row_prefetch``:
    at the start of each task, prefetch the next task's table row into L1
    (vm.row_prefetch), so its decode does not wait on L2 or DRAM.
    ``gemv_unroll``: the GEMV's
    K loop unrolled 1, 2, 4, 8 or 16 times (STAGES = 1 only), so that many weight blocks can
    be in flight. ``elide_waits`` / ``coalesce_signals``: table options (table.elide_waits,
    table.coalesced_signals): skip a wait an earlier task of the same worker already did;
    release several consecutive tiles' signals with one atomic. ``maxnreg``: ptxas's register
    cap per thread; 0 (the default) = automatic: none while the workers fit one CTA per SM,
    else the most that lets ceil(workers / SMs) CTAs share an SM's 64K registers
    (``regs_for_ctas``), so a grid of two workers per SM fits whatever the largest op
    variant would have asked for. Must be 0 or 24..255. ``x_stage`` (default on): norm_gemv and
    swiglu_gemv compute their prologue f(x) once per task into a per-worker scratch row and
    stream W against it (ops/gemv.py gemv_ex ``X_STAGE``) instead of recomputing f inside the weight
    loop (H200, Llama-3.2-1B shape: 2.35 -> 1.91 ms per token). ``x_reuse``
    (default on, with ``x_stage``): a GEMV whose f(x) the worker's previous staging task
    already left in the scratch skips the x pass (table.staged_x_reuse). ``x_chunk``: elements
    of x the staging pass loads at once (at least gemv_n x gemv_k; a power of two); an x that
    fits is loaded once, RMSNorm's sum of squares included. ``w_preload`` (elements, 0 = off;
    a power of two, at least gemv_k, 2 x gemv_k when gemv_unroll is 2): a GEMV task loads
    the first ``w_preload`` columns of its first row block before its waits (weights only,
    layout.FLAG_W_CONST) and runs its waits inside the op, after decoding its operands
    (ops/gemv.py t_gemv), so the wait, the decode and the x pass overlap that part of the
    weight stream. ``prefetch_cap`` (bytes, a multiple of 16; 0 = whole tile): the task-ahead
    L2 prefetch covers at most the tile's first ``prefetch_cap`` bytes; ``prefetch_rows`` (0 =
    no limit): at most its first ``prefetch_rows`` weight rows (table.prefetch_ahead; unlike a
    byte cap it still covers a wide tile's whole first row block). ``roll`` (row blocks,
    0 = off): a GEMV tile of several row blocks prefetches row block j + roll into L2 while
    it streams row block j (ops/gemv.py gemv_ex ``ROLL``).
    ``lean_release``: a task that signals a peer fences at system scope once, on thread 0 after
    the CTA barrier, and signals each peer with a relaxed ``red`` (vm.finish_task
    ``LEAN``), instead of a fence in every thread and one ``red.release.sys`` per peer, each of
    which waits for the one before (the fused all-reduce's tiles at tp 4: about 8 us of
    barrier + signals per tile, docs/benchmarks.md). On by default:
    faster at tp 2 (fused all-reduce: 4.05 -> 3.94 ms) and tp 4 (one-shot 3.02 -> 2.91 ms, fused
    3.30 -> 2.86 ms) on the H200s; the same ordering (a fence, then relaxed writes, is a release
    in the PTX memory model).
    ``gemv_tma`` (needs gemv_stages >= 2 and w_preload 0; gemv_n and gemv_k at most 256, the
    TMA box limit): every GEMV variant whose W is contiguous and 16-byte aligned streams its
    [gemv_n, gemv_k] blocks through a tensor descriptor, TMA copies into gemv_stages - 1
    shared-memory buffers that hold no registers (ops/gemv.py gemv_ex ``W_TMA``); the launch then
    gets a global-scratch allocator for the descriptors (``tma_scratch``).
    ``ring`` (pages per worker, 0 = off): GEMV tasks whose bf16 weights no task writes stream
    them through a ring of ``ring`` shared-memory pages of ``ring_rows`` x ``ring_cols``
    elements, copied ahead of the tasks that use them, across their waits (ring.py); the launch
    gets ``ring x (page + 8)`` bytes of dynamic shared memory beyond the kernel's own."""

    elementwise: int = 1024
    gemv_n: int = 16
    gemv_k: int = 256
    rope: int = 64
    attention_t: int = 32
    attention_d: int = 64
    attention_q: int = 1
    pairs: int = 64
    gemv_stages: int = 1
    gemv_unroll: int = 1
    prefetch: int = 0
    row_prefetch: bool = True
    elide_waits: bool = True
    coalesce_signals: bool = True
    maxnreg: int = 0
    x_stage: bool = True
    x_reuse: bool = True
    x_chunk: int = 8192
    w_preload: int = 0
    prefetch_cap: int = 0
    prefetch_rows: int = 0
    roll: int = 0
    lean_release: bool = True
    gemv_tma: bool = False
    ring: int = 0
    ring_rows: int = 4
    ring_cols: int = 2048

    def __post_init__(self) -> None:
        if not isinstance(self.maxnreg, int) or not (self.maxnreg == 0 or 24 <= self.maxnreg <= 255):
            raise TritonError(f"maxnreg must be 0 (automatic) or an integer in 24..255, got {self.maxnreg!r}",
                              exit_code=2)
        if not isinstance(self.gemv_stages, int) or not 1 <= self.gemv_stages <= 8:
            raise TritonError(f"gemv_stages must be an integer in 1..8, got {self.gemv_stages!r}", exit_code=2)
        if self.gemv_unroll not in (1, 2, 4, 8, 16):
            raise TritonError(f"gemv_unroll must be 1, 2, 4, 8 or 16, got {self.gemv_unroll!r}", exit_code=2)
        if not isinstance(self.x_chunk, int) or self.x_chunk < 1 or self.x_chunk & (self.x_chunk - 1):
            raise TritonError(f"x_chunk must be a power of two, got {self.x_chunk!r}", exit_code=2)
        wp = self.w_preload
        if not isinstance(wp, int) or isinstance(wp, bool) or wp < 0 or wp & (wp - 1) or (
                wp and wp < self.gemv_k * (2 if self.gemv_unroll == 2 else 1)):
            raise TritonError(f"w_preload must be 0 or a power of two of at least gemv_k = {self.gemv_k} "
                              f"({2 * self.gemv_k} with gemv_unroll 2), got {wp!r}", exit_code=2)
        if not isinstance(self.prefetch_cap, int) or self.prefetch_cap < 0 or self.prefetch_cap % 16:
            raise TritonError(f"prefetch_cap must be 0 or a positive multiple of 16 bytes, got "
                              f"{self.prefetch_cap!r}", exit_code=2)
        if not isinstance(self.prefetch_rows, int) or self.prefetch_rows < 0:
            raise TritonError(f"prefetch_rows must be a non-negative integer, got {self.prefetch_rows!r}",
                              exit_code=2)
        if not isinstance(self.roll, int) or not 0 <= self.roll <= 8:
            raise TritonError(f"roll must be an integer in 0..8, got {self.roll!r}", exit_code=2)
        if not isinstance(self.prefetch, int) or not 0 <= self.prefetch <= 8:
            raise TritonError(f"prefetch must be an integer in 0..8, got {self.prefetch!r}", exit_code=2)
        if self.gemv_tma:
            if self.gemv_stages < 2:
                raise TritonError(f"gemv_tma needs gemv_stages 2..8 (its copies are pipelined), got "
                                  f"gemv_stages {self.gemv_stages}", exit_code=2)
            if self.w_preload:
                raise TritonError(f"gemv_tma needs w_preload 0 (the first block would be loaded twice), "
                                  f"got w_preload {self.w_preload}", exit_code=2)
            if self.gemv_n > 256 or self.gemv_k > 256:
                raise TritonError(f"gemv_tma needs gemv_n and gemv_k of at most 256 (a TMA box's limit), "
                                  f"got gemv_n {self.gemv_n}, gemv_k {self.gemv_k}", exit_code=2)
        if not isinstance(self.ring, int) or isinstance(self.ring, bool) or not 0 <= self.ring <= 32:
            raise TritonError(f"ring must be an integer in 0..32 (weight pages per worker), got {self.ring!r}",
                              exit_code=2)
        for name, lo, hi in (("ring_rows", 1, 64), ("ring_cols", 8, 8192)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi or v & (v - 1):
                raise TritonError(f"{name} must be a power of two in {lo}..{hi}, got {v!r}", exit_code=2)

    @property
    def ring_page(self) -> int:
        """Bytes of one weight-ring page (ring_rows x ring_cols bf16)."""
        return self.ring_rows * self.ring_cols * 2
