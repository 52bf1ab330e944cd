"""Deep checks over a structurally sound program: deadlock, happens-before, races.

Order: unsatisfiable waits and collective participation (static), the greedy simulation
over the unrolled window (validator/deadlock.py), then, if the queues do not stall, the
happens-before fixpoint (validator/hb.py) and the race checks (validator/races.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from validator import deadlock, hb, races
from validator.structure import Index
from validator.verdict import Finding
from validator.window import build_window


@dataclass
class DeepResult:
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


def window_epochs(slots: int) -> int:
    """E = max(2, slots + 1) unrolled epochs (docs/validator.md, 'The window')."""
    return max(2, slots + 1)


def run_deep_checks(ix: Index, stage) -> DeepResult:
    """Run the deep checks; ``stage(name, fn, *args)`` times each step and traps exceptions."""
    res = DeepResult()
    res.findings += stage("unsatisfiable", deadlock.unsatisfiable_waits, ix) or []
    res.findings += stage("collectives", deadlock.collective_participation, ix) or []
    E = window_epochs(ix.slots)
    win = stage("window", build_window, ix, E)
    if win is None:
        return res
    res.stats["window_epochs"] = E
    res.stats["segments"] = int(win.n_seg)
    sim = stage("simulation", deadlock.simulate, ix, win)
    if sim is None:
        return res
    res.stats["sim_rounds"] = int(sim.rounds)
    res.findings += sim.findings
    if sim.stuck:
        res.stats["races"] = "not checked: the schedule deadlocks"
        return res
    hbr = stage("happens_before", hb.compute, ix, win, sim)
    if hbr is None:
        return res
    res.stats.update(hbr.stats)
    res.findings += hbr.findings
    res.findings += stage("collective_order", deadlock.collective_order, ix, hbr) or []
    res.findings += stage("races", races.check, ix, win, hbr) or []
    return res
