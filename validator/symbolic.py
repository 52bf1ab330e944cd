"""z3 witnesses for slot-parametric (double-buffered) regions.

Regions may use the slot symbol ``s = epoch mod slots`` (ir/program.py). The race checks
decide overlaps exactly by evaluating every slot value (the symbol ranges over the finite
set 0..slots-1); this module states the same question to z3 -- "exist an epoch e such that
region A at slot e mod slots and region B at slot (e + d) mod slots overlap" -- and returns
the model as the witness of a reported conflict.
"""

from __future__ import annotations

from typing import Any

import z3

from validator.structure import Index


def overlap_model(ix: Index, ja: int, jb: int, d: int = 0) -> dict[str, Any] | None:
    """A z3 model ``{epoch, slot_a, slot_b}`` in which region ``ja`` (in epoch e) and region
    ``jb`` (in epoch e + d) overlap on every axis, or None if z3 finds none."""
    S = ix.slots
    e = z3.Int("e")
    sa, sb = z3.Int("slot_a"), z3.Int("slot_b")
    sol = z3.Solver()
    sol.set("timeout", 2000)
    sol.add(e >= 0, sa == e % S, sb == (e + d) % S)
    nax = len(ix.buf_shape[int(ix.r_buf[ja])])
    for a in range(nax):
        alo = int(ix.lo_c[ja, a]) + int(ix.lo_k[ja, a]) * sa
        ahi = int(ix.hi_c[ja, a]) + int(ix.hi_k[ja, a]) * sa
        blo = int(ix.lo_c[jb, a]) + int(ix.lo_k[jb, a]) * sb
        bhi = int(ix.hi_c[jb, a]) + int(ix.hi_k[jb, a]) * sb
        sol.add(alo < bhi, blo < ahi)
    if sol.check() != z3.sat:
        return None
    m = sol.model()
    return {"epoch": m.eval(e).as_long(), "slot_a": m.eval(sa).as_long(),
            "slot_b": m.eval(sb).as_long(), "slots": S, "step_distance": d,
            "solver": "z3"}
