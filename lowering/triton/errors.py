"""The Triton backend's errors: ``TritonError`` (exit code 1: the run failed; 2 for a bad
argument) and its kinds, raised by the executor (runtime.py) and the launch knobs (blocks.py).
"""

from __future__ import annotations

from typing import Any

from ground.errors import AmkError
from lowering.executors import TaskFailure


class TritonError(AmkError):
    """A failure of the Triton backend (exit code 1: the run failed)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message, exit_code)


class TritonRefused(TritonError):
    """The validator rejected the program (construct with ``check=False`` to run it anyway)."""

    def __init__(self, verdict: Any):
        self.verdict = verdict
        classes = ", ".join(sorted(getattr(verdict, "classes", []) or [])) or "unknown"
        super().__init__(f"the validator rejected the schedule ({classes}); refusing to run it "
                         "on the triton backend", exit_code=2)


class TritonWatchdogError(TritonError):
    """A wait exceeded the watchdog bound. ``stuck`` lists one dict per failed worker:
    worker, task, op, queue_index, counter, seen, needed, kind ("timeout" | "aborted")."""

    def __init__(self, message: str, stuck: list[dict[str, Any]]):
        super().__init__(message)
        self.stuck = stuck


class TritonTaskError(TaskFailure, TritonError):
    """An op refused its operands at run time (position or token out of range); ``task`` and
    ``epoch`` name where (lowering.executors.TaskFailure)."""
