"""The Triton backend's launch parameters: ``Blocks``, the megakernel's compile-time block sizes
and options, and ``kernel_options``, which makes them (and the warps) from the kernel knobs of
``lowering.config.KernelConfig`` (runtime.TritonExecutor launches with them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ground.errors import AmkError
from lowering.config import KernelConfig
from lowering.triton.errors import TritonError


@dataclass
class Blocks:
    """The megakernel's compile-time block sizes (elements) and options: the kernel knobs of
    ``lowering.config.KernelConfig`` (described there; ``attention_t`` is its
    ``attention_block``, ``gemv_n`` x ``gemv_k`` its ``gemv_block``) and the sizes the executor
    derives. ``attention_d`` and ``attention_q`` are raised to cover the program's head_dim and
    GQA group if smaller, and ``attention_t`` lowered to keep attention's [Q, T, D] fp32
    product within ~64 registers per thread. ``elementwise``, ``rope``, ``pairs``: the
    element-wise, RoPE and pair-op blocks. ``gemm_m`` x ``gemm_n`` x ``gemm_k``: the largest
    block of the ``gemm`` op (ops/gemm.py; powers of two >= 16, tl.dot's minimum), lowered per
    program to the smallest power of two >= 16 covering its largest tile's M, N and K (the
    executor; not a KernelConfig knob yet). The defaults are the library's (small blocks, the
    CPU tests'); ``amk`` commands build a Blocks from a KernelConfig (``from_kernel``). A
    value KernelConfig does not allow raises TritonError (exit code 2) naming the knob's flag.
    ``ring_page``: bytes of one weight-ring page."""

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
    q_tma: bool = False
    q_gemv_n: int = 0
    int8_convert: str = "prmt"
    ring: int = 0
    ring_rows: int = 4
    ring_cols: int = 2048
    gemm_m: int = 64
    gemm_n: int = 64
    gemm_k: int = 64

    def __post_init__(self) -> None:
        for f in ("gemm_m", "gemm_n", "gemm_k"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 16 or v & (v - 1):
                raise TritonError(f"Blocks.{f} must be a power of two >= 16 (tl.dot's smallest block), "
                                  f"got {v!r}", exit_code=2)
        # KernelConfig's rules, once: the knobs' ranges and the rules between them (a knob
        # that does nothing is the command line's business, not the library's)
        try:
            self.kernel().validate("Blocks", combinations=False)
        except AmkError as err:
            raise TritonError(str(err), exit_code=2) from None

    def kernel(self, num_warps: int = KernelConfig.num_warps) -> KernelConfig:
        """These blocks' knobs as a KernelConfig (not validated), with ``num_warps``."""
        shared = {f: getattr(self, f) for f in _SAME}
        return KernelConfig(num_warps=num_warps, gemv_block=f"{self.gemv_n}x{self.gemv_k}",
                            attention_block=self.attention_t, **shared)

    @classmethod
    def from_kernel(cls, kc: KernelConfig) -> "Blocks":
        """The Blocks of kernel knobs ``kc``."""
        return cls(gemv_n=kc.gemv_n, gemv_k=kc.gemv_k, attention_t=kc.attention_block,
                   **{f: getattr(kc, f) for f in _SAME})

    def gemm_blocks(self, dims: dict[str, int]) -> tuple[int, int, int]:
        """(GEMM_M, GEMM_N, GEMM_K) for a program whose largest gemm tile is ``dims``
        (``TaskTable.dims``' ``gemm_m`` / ``gemm_n`` / ``gemm_k``): per axis the smallest
        power of two >= 16 that covers it, at most this Blocks' size."""
        def fit(cap: int, d: int) -> int:
            b = 16
            while b < min(cap, d):
                b *= 2
            return min(b, cap)

        return (fit(self.gemm_m, dims.get("gemm_m", 1)), fit(self.gemm_n, dims.get("gemm_n", 1)),
                fit(self.gemm_k, dims.get("gemm_k", 1)))

    @property
    def ring_page(self) -> int:
        """Bytes of one weight-ring page (ring_rows x ring_cols bf16)."""
        return self.ring_rows * self.ring_cols * 2


#: KernelConfig fields that Blocks holds under the same name.
_SAME = ("gemv_stages", "gemv_unroll", "prefetch", "row_prefetch", "elide_waits", "coalesce_signals", "maxnreg",
         "x_stage", "x_reuse", "x_chunk", "w_preload", "prefetch_cap", "prefetch_rows", "roll", "lean_release",
         "gemv_tma", "q_tma", "q_gemv_n", "int8_convert", "ring", "ring_rows", "ring_cols")


def kernel_options(kc: KernelConfig) -> dict[str, Any]:
    """TritonExecutor options (``num_warps``, ``blocks``) of kernel knobs ``kc``."""
    return {"num_warps": kc.num_warps, "blocks": Blocks.from_kernel(kc)}
