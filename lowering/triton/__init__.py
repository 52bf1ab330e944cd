"""The ``triton`` backend: an instruction library of ``@triton.jit`` device functions (ops.py),
a device task table built from a ScheduleProgram (table.py), a generated persistent
megakernel with counter waits, opcode dispatch, release signals and a watchdog
(megakernel.py), and ``TritonExecutor`` with the sim's interface (runtime.py).
See docs/triton.md.

Importing this package on a machine without a CUDA GPU sets ``TRITON_INTERPRET=1`` (unless
the variable is already set): Triton decides between its CPU interpreter and the compiler
when the jit functions are created, and the interpreter is the only way to run them without
a GPU. On a GPU machine, set ``TRITON_INTERPRET=1`` yourself to force the interpreter.
"""

from __future__ import annotations

import os


def _default_interpret() -> None:
    if "TRITON_INTERPRET" in os.environ:
        return
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        os.environ["TRITON_INTERPRET"] = "1"


_default_interpret()

from lowering.triton.table import (  # noqa: E402
    LinearizeError, TableError, TaskTable, Variant, build_layout, build_table, linearize,
)
from lowering.triton.runtime import (  # noqa: E402
    Blocks, TritonError, TritonExecutor, TritonRefused, TritonStats, TritonTaskError,
    TritonWatchdogError,
)

__all__ = [
    "Blocks", "LinearizeError", "TableError", "TaskTable", "TritonError", "TritonExecutor",
    "TritonRefused", "TritonStats", "TritonTaskError", "TritonWatchdogError", "Variant",
    "build_layout", "build_table", "linearize",
]
