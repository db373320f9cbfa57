"""The one place a ``reward`` event is built, whoever graded the rollout (the grader a patch, the gym runner
an episode): its failure's class from its cause (:mod:`rollbus.failures`), a re-run named only for an
infrastructure failure (only that is re-run), and when it was written: two writers building the record by
hand would drift on these."""

from __future__ import annotations

import time
from collections.abc import Sequence

from rollbus.events.records import RewardEvent, TestResult
from rollbus.failures import INFRASTRUCTURE, failure_class


def reward_event(
    *,
    rollout_id: str,
    attempt_id: str,
    group_id: str,
    group_size: int,
    reward: float,
    solved: bool,
    applied_cleanly: bool,
    details: str,
    failure_kind: str | None,
    cause: str | None,
    flags: Sequence[str] = (),
    tests: Sequence[TestResult] = (),
    step_rewards: Sequence[float] = (),
    infos: str = "[]",
    image_digest: str | None = None,
    rerun_rollout_id: str | None = None,
    at_ms: int | None = None,
) -> RewardEvent:
    """The reward of one attempt. ``failure_kind`` is the grader's verdict, ``cause`` the kind that decides
    who is at fault (the runner's, for a rollout it failed before grading; :func:`rollbus.failures.
    reward_cause`); ``rerun_rollout_id`` is kept only when that fault is the infrastructure's."""
    kind = failure_class(cause)
    return RewardEvent(
        rollout_id=rollout_id, attempt_id=attempt_id, group_id=group_id, group_size=group_size,
        reward=float(reward), solved=solved, applied_cleanly=applied_cleanly, details=details,
        failure_kind=failure_kind, flags=list(flags), tests=list(tests),
        step_rewards=[float(r) for r in step_rewards], infos=infos, image_digest=image_digest,
        at=int(time.time() * 1000) if at_ms is None else at_ms,
        failure_class=kind, failure_cause=cause,
        rerun_rollout_id=rerun_rollout_id if kind == INFRASTRUCTURE else None,
    )  # fmt: skip
