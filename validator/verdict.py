"""The result of validating a ScheduleProgram: a verdict with findings and their witnesses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Finding:
    """One error found in a schedule.

    ``cls``: the error class (e.g. ``DeadlockCycle``, ``UnorderedWrites``); ``tasks`` and
    ``buffers``: the ids involved; ``witness``: JSON-serialisable evidence (a cycle path,
    a racing pair with both regions, a z3 model, ...).
    """

    cls: str
    message: str
    tasks: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    witness: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["class"] = d.pop("cls")
        return d


@dataclass
class Verdict:
    """``ok`` is True iff ``errors`` is empty. ``stats`` holds counts and timings (seconds)."""

    errors: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def classes(self) -> set[str]:
        return {f.cls for f in self.errors}

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "errors": [f.to_json() for f in self.errors], "stats": self.stats}
