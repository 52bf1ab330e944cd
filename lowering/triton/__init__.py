"""The ``triton`` backend: a ScheduleProgram run as one persistent Triton kernel per decode step.

* ops/: the op registry and one module per op family (device functions, row decoders,
  table encoding and dispatch); lang.py: the device helpers they share;
* layout.py: the task table's format; table.py: ScheduleProgram -> task table;
* vm.py: the kernel's queue loop steps, counter waits, release signals and watchdog;
  codegen.py: the kernel source per program; cache.py: its module; offline.py: an sm_90
  compile without a GPU;
* ring.py: the weight ring; runtime.py: ``TritonExecutor`` with the sim's interface;
  blocks.py: its launch knobs; errors.py; standalone.py: one op alone (tests);
  graph.py: CUDA-graph decoding; dist.py: the multi-GPU bootstrap.

See docs/triton.md.

Importing this package on a machine without a CUDA GPU sets ``TRITON_INTERPRET=1`` (unless
the variable is already set): Triton decides between its CPU interpreter and the compiler
when the jit functions are created, and the interpreter is the only way to run them without
a GPU. On a GPU machine, set ``TRITON_INTERPRET=1`` yourself to force the interpreter.
"""

from __future__ import annotations

import os

#: The megakernel's version for tuned configs (search/tunedb.py's kernel fingerprint): bump it
#: when the generated kernel changes what a config means or which config is fastest, so tuned
#: entries measured on the old kernel stop being used by default. A change that speeds every
#: config of a path alike (the L2 evict-first weight loads) leaves the entries current; their
#: recorded ms are then upper bounds until `amk tune` measures them again. Read as text,
#: without importing this package.
VM_VERSION = 1


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

from lowering.triton.blocks import Blocks  # noqa: E402
from lowering.triton.errors import (  # noqa: E402
    TritonError, TritonRefused, TritonTaskError, TritonWatchdogError,
)
from lowering.triton.layout import TableError, Variant  # noqa: E402
from lowering.triton.runtime import TritonExecutor, TritonStats  # noqa: E402
from lowering.triton.table import LinearizeError, TaskTable, build_layout, build_table, linearize  # noqa: E402

__all__ = [
    "Blocks", "LinearizeError", "TableError", "TaskTable", "TritonError", "TritonExecutor",
    "TritonRefused", "TritonStats", "TritonTaskError", "TritonWatchdogError", "Variant",
    "build_layout", "build_table", "linearize",
]
