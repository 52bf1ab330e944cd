"""What the two executors of a ScheduleProgram share: the sim (lowering/sim.py) and the
Triton megakernel (lowering/triton/).

* ``TaskFailure``: the base of each backend's "an op failed in task T at epoch E" error
  (``SimTaskError``, ``TritonTaskError``), carrying ``task`` and ``epoch``;
* ``StepThroughput``: the ``tasks_per_s`` of each backend's per-call statistics;
* ``check_steps``: the checks before ``run_steps`` runs ``count`` epochs.
"""

from __future__ import annotations


class TaskFailure(Exception):
    """An op failed while the executor ran task ``task`` (an id) in decode step ``epoch``.

    A mixin ahead of the backend's own error class (``class SimTaskError(TaskFailure,
    SimError)``): the message goes to that class's constructor.
    """

    def __init__(self, message: str, task: str, epoch: int):
        super().__init__(message)
        self.task = task
        self.epoch = epoch


class StepThroughput:
    """Mixin of a statistics dataclass with ``tasks`` (count) and ``seconds`` (wall)."""

    tasks: int
    seconds: float

    @property
    def tasks_per_s(self) -> float:
        """Tasks per wall second (inf for a call that took no measurable time)."""
        return self.tasks / self.seconds if self.seconds > 0 else float("inf")


def check_steps(broken: str | None, count: int, first: int, max_epochs: int,
                error: type[Exception]) -> None:
    """Before running epochs ``first .. first + count - 1``: raise ``error`` if an earlier
    failure left the executor unusable (``broken``: its description) or the last epoch
    exceeds the program's ``max_epochs``; ValueError for ``count < 1``."""
    if broken:
        raise error(f"the executor is unusable after an earlier failure: {broken}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if first + count > max_epochs:
        raise error(f"epoch {first + count - 1} exceeds the program's max_epochs {max_epochs}")
