"""Which failed samples are re-run, and as what: pure functions over the task record."""

from __future__ import annotations

import pytest

from rollbus.events import TaskEvent
from rollbus.services.sandbox_runner.rerun import rerun_rollout_id, rerun_task


@pytest.mark.parametrize(
    ("rollout_id", "sample", "attempt", "expected"),
    [
        ("swe-mini__sum-to-ab12-1", 1, 1, "swe-mini__sum-to-ab12.r1-1"),  # the engine's `-K` suffix stays
        ("swe-mini__sum-to-ab12.r1-1", 1, 2, "swe-mini__sum-to-ab12.r2-1"),  # from a re-run: same stem
        ("swe-mini__sum-to-ab12-1", 1, 2, "swe-mini__sum-to-ab12.r2-1"),
        ("free-form", 0, 1, "free-form.r1"),  # no sample suffix: appended
        ("free-form.r1", 0, 3, "free-form.r3"),
    ],
)
def test_a_reruns_id_is_derived_from_the_first_rollouts(rollout_id, sample, attempt, expected) -> None:
    assert rerun_rollout_id(rollout_id, sample, attempt) == expected


def task(**extra) -> TaskEvent:
    return TaskEvent(**{"rollout_id": "row-g-3", "group_id": "row-g", "sample_index": 3, "group_size": 4,
                        "prompt": "p", "metadata": "{}", "submitted_at": 1, **extra})  # fmt: skip


def test_an_infrastructure_failure_is_rerun_as_the_same_sample_with_the_next_attempt() -> None:
    rerun = rerun_task(task(), "boot_failed", retries=2, now_ms=9)
    assert rerun == task(rollout_id="row-g.r1-3", attempt=1, submitted_at=9)  # the rest as the task's
    again = rerun_task(rerun, "session_failed", retries=2, now_ms=10)
    assert again is not None and (again.rollout_id, again.attempt) == ("row-g.r2-3", 2)
    assert rerun_task(again, "boot_failed", retries=2) is None  # the budget is spent


def test_the_same_failed_task_always_submits_the_same_rerun() -> None:
    """A runner killed between the re-run and the diff runs the task again: the same rollout, run once."""
    one, two = rerun_task(task(), "boot_failed", 2, now_ms=1), rerun_task(task(), "runner_error", 2)
    assert one is not None and two is not None and one.rollout_id == two.rollout_id


@pytest.mark.parametrize("kind", [None, "timeout", "agent_crashed", "sandbox_broken", "bad_task", "unknown"])
def test_policy_failures_bad_rows_and_successes_are_not_rerun(kind) -> None:
    assert rerun_task(task(), kind, retries=5) is None


def test_no_budget_no_rerun() -> None:
    assert rerun_task(task(), "boot_failed", retries=0) is None
