"""The pieces the sim and the Triton executor share (lowering/executors.py)."""

from __future__ import annotations

import pytest

from ground.errors import AmkError
from lowering.executors import TaskFailure, check_steps
from lowering.sim import SimError, SimStats, SimTaskError
from lowering.triton import TritonError, TritonStats, TritonTaskError


@pytest.mark.parametrize("cls,base", [(SimTaskError, SimError), (TritonTaskError, TritonError)])
def test_task_errors_carry_task_and_epoch(cls, base):
    e = cls("task t failed", "t", 3)
    assert isinstance(e, TaskFailure) and isinstance(e, base)
    assert (str(e), e.task, e.epoch) == ("task t failed", "t", 3)
    with pytest.raises(TaskFailure, match="task t failed"):
        raise e


def test_triton_task_error_is_a_user_facing_run_failure():
    e = TritonTaskError("token 10 outside the embedding table", "embed", 0)
    assert isinstance(e, AmkError) and e.exit_code == 1


@pytest.mark.parametrize("stats", [SimStats(tasks=10, seconds=2.0), TritonStats(tasks=10, seconds=2.0)])
def test_step_throughput(stats):
    assert stats.tasks_per_s == 5.0
    stats.seconds = 0.0
    assert stats.tasks_per_s == float("inf")


def test_check_steps():
    check_steps(None, 2, 0, 2, SimError)
    with pytest.raises(SimError, match="unusable after an earlier failure: boom"):
        check_steps("boom", 1, 0, 10, SimError)
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        check_steps(None, 0, 0, 10, SimError)
    with pytest.raises(TritonError, match="epoch 10 exceeds the program's max_epochs 10"):
        check_steps(None, 2, 9, 10, TritonError)
