"""Human review of proposals (``amk search --approve``): a file handshake in the search directory.

Before a proposal (a config or an edit list) is evaluated, the search writes
``OUT/review/pending/<id>.json`` (``id`` = ``trial-NNNN``: the trial number, the proposer, the
candidate id, the config, the edit list, the description) and waits until a decision file
``OUT/review/approved/<id>.json`` or ``OUT/review/rejected/<id>.json`` appears (``amk ui``
writes it; so may any tool: ``{"candidate_id": ..., "comment": ...}``). A decision whose
candidate id differs from the pending proposal's (left over from a killed run) is set aside
and the search keeps waiting. Approved: the trial is evaluated as usual. Rejected: the trial is
recorded as REJECTED with the reason ``rejected in review`` (and the comment) and the search
proposes the next one. All files are written atomically.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Callable

from ground.errors import AmkError
from ground.files import atomic_write_json

REVIEW = "review"
DECISIONS = ("approved", "rejected")
ID_RE = re.compile(r"trial-\d{4,}")


def review_id(trial: int) -> str:
    """The id of trial ``trial``'s proposal: ``trial-NNNN``."""
    return f"trial-{trial:04d}"


def check_id(pid: str) -> str:
    """``pid`` if it is a proposal id (``trial-NNNN``); AmkError (exit 2) otherwise, so a
    name never leads outside the review directory."""
    if not isinstance(pid, str) or not ID_RE.fullmatch(pid):
        raise AmkError(f"not a proposal id: {pid!r} (expected trial-NNNN)")
    return pid


def pending(out: str | Path) -> list[dict[str, Any]]:
    """The proposals of search directory ``out`` waiting for a decision, oldest first."""
    d = Path(out) / REVIEW / "pending"
    items = []
    for p in sorted(d.glob("trial-*.json")):
        if not ID_RE.fullmatch(p.stem):
            continue
        try:
            obj = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now; the next listing has it
        if not any((Path(out) / REVIEW / k / p.name).exists() for k in DECISIONS):
            items.append(obj)
    return items


def decided(out: str | Path) -> list[dict[str, Any]]:
    """The decisions taken in ``out`` (each with ``id`` and ``decision``), by id."""
    items = []
    for k in DECISIONS:
        for p in sorted((Path(out) / REVIEW / k).glob("trial-*.json")):
            try:
                obj = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            items.append({**obj, "id": p.stem, "decision": k})
    return sorted(items, key=lambda o: o["id"])


def decide(out: str | Path, pid: str, approve: bool, comment: str = "") -> dict[str, Any]:
    """Write the decision on pending proposal ``pid`` of search directory ``out``; returns
    the decision object. AmkError (exit 2) for a bad id, a proposal that is not pending or
    one already decided."""
    check_id(pid)
    root = Path(out) / REVIEW
    src = root / "pending" / f"{pid}.json"
    if not src.is_file():
        raise AmkError(f"no pending proposal {pid} in {out}")
    for k in DECISIONS:
        if (root / k / f"{pid}.json").exists():
            raise AmkError(f"proposal {pid} was already {k}")
    prop = json.loads(src.read_text())
    kind = "approved" if approve else "rejected"
    obj = {"id": pid, "decision": kind, "candidate_id": prop.get("candidate_id"),
           "comment": str(comment)[:2000], "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "proposal": prop}
    (root / kind).mkdir(parents=True, exist_ok=True)
    atomic_write_json(root / kind / f"{pid}.json", obj)
    return obj


class ReviewGate:
    """The search's side of the handshake: ``ask`` writes the pending file and blocks until a
    decision for the same candidate arrives (polling every ``poll_s`` seconds)."""

    def __init__(self, out: str | Path, poll_s: float = 0.2, say: Callable[[str], None] | None = None):
        self.root = Path(out) / REVIEW
        self.poll_s = poll_s
        self.say = say

    def ask(self, trial: int, proposal: dict[str, Any]) -> tuple[bool, str]:
        """Hold ``proposal`` (JSON-ready: candidate_id, proposer, config, edits, ...) for
        review; returns (approved, comment)."""
        pid = review_id(trial)
        cid = proposal.get("candidate_id")
        (self.root / "pending").mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.root / "pending" / f"{pid}.json",
                          {**proposal, "id": pid, "trial": trial,
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        if self.say:
            self.say(f"trial {trial}: waiting for review of {pid} (amk ui, or write "
                     f"{self.root / 'approved' / (pid + '.json')})")
        while True:
            for kind in DECISIONS:
                p = self.root / kind / f"{pid}.json"
                if not p.is_file():
                    continue
                try:
                    obj = json.loads(p.read_text())
                except (OSError, json.JSONDecodeError):
                    continue
                if obj.get("candidate_id") not in (None, cid):  # a stale decision: set it aside
                    p.replace(p.with_name(f"{pid}.stale-{int(time.time())}.json.old"))
                    continue
                (self.root / "pending" / f"{pid}.json").unlink(missing_ok=True)
                return kind == "approved", str(obj.get("comment") or "")
            time.sleep(self.poll_s)
