"""The Triton backend's op registry: one ``OpLowering`` (layout.py) per IR op, keyed by op name.

Each op family module holds, for the IR ops it implements, the ``@device`` functions that
compute them (exactly what lowering/reference.py defines), the row decoder that reads a
task's operands and params from its table row, and the op's table encoding and dispatch
(its ``OpLowering``: operand views, param slots, variant flags, descriptor checks, in-place
rule, the decoder's call in the generated kernel):

==============  ==========================================================================
module          IR ops
==============  ==========================================================================
gemv.py         gemv, norm_gemv, gemv_res, swiglu_gemv, reduce_norm_gemv
attention.py    rope, kv_append, rope_append, attention, rope_attention, rope_attention_kv,
                attention_combine
norm.py         embed, rmsnorm, silu_mul, add
reduce.py       reduce, argmax, argmax_combine
gemm.py         gemm
comm.py         copy, put, quiet, fence, nop
==============  ==========================================================================

table.py encodes tasks and codegen.py writes the kernel's dispatch by looking ops up here.
Every op of ir/ops.py's OPS is in ``REGISTRY`` or in ``NOT_SUPPORTED`` with the reason, and
its ``OpSpec.backends`` names ``triton`` exactly when it is registered
(tests/test_op_registry.py; the checklist for adding an op is in docs/ir.md).
"""

from __future__ import annotations

from ir.program import Task
from lowering.triton.layout import OpLowering, TableError
from lowering.triton.ops import attention, comm, gemm, gemv, norm, reduce

#: The op family modules, in the order their ops are listed.
FAMILIES = (gemv, attention, norm, reduce, gemm, comm)

#: IR op name -> how the Triton backend runs it.
REGISTRY: dict[str, OpLowering] = {}
for _family in FAMILIES:
    for _entry in _family.LOWERINGS:
        if _entry.op in REGISTRY:
            raise ValueError(f"op {_entry.op} is registered twice ({REGISTRY[_entry.op].module}, {_entry.module})")
        REGISTRY[_entry.op] = _entry

#: IR ops the Triton backend does not implement, with the reason (none at present).
NOT_SUPPORTED: dict[str, str] = {}


def lowering(op: str, where: str = "") -> OpLowering:
    """The registry entry of IR op ``op``. Raises TableError (prefixed with ``where``, e.g.
    "task ID") for an op the Triton backend does not implement, naming the reason."""
    entry = REGISTRY.get(op)
    if entry is None:
        why = NOT_SUPPORTED.get(op)
        prefix = f"{where}: " if where else ""
        raise TableError(f"{prefix}op {op} is not implemented by the triton backend"
                         + (f" ({why})" if why else ""))
    return entry


def scratch_elems(task: Task, slots: int) -> int:
    """Elements of the worker's f(x) scratch row a task needs: a GEMV's K (the longest over
    the slots; its prologue f(x) may be staged there), 0 for other ops."""
    entry = REGISTRY.get(task.op)
    if entry is None or entry.gemv is None:
        return 0
    g = entry.gemv
    return max(task.ins[g.k].numel(s) for s in range(slots))
