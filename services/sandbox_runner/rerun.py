"""Re-running a sample the infrastructure failed: a new rollout of the same group and sample index, the next
attempt number, up to ``--infra-retries``.

Why a new rollout and not another attempt of the same one: everything downstream answers a rollout once (the
runner commits a task whose diff is on the bus, the grader rewards a rollout's first diff, the segmenter its
first reward), which is what makes a redelivery harmless. The re-run's id is derived from the first rollout's
(``<id>.r<N>``, before the ``-<sample index>`` suffix the engine's scripts key on), so publishing it twice (a
runner killed between publishing it and its diff runs the task again) submits the same rollout twice, and
that is answered once. The re-run is published before the failed attempt's diff, whose ``rerun_rollout_id``
names it: a failed sample whose diff is on the bus always has its re-run on ``tasks``.
"""

from __future__ import annotations

import dataclasses
import re
import time

from rollbus.events import TaskEvent
from rollbus.failures import rerun_helps

_RERUN = re.compile(r"\.r\d+$")


def rerun_rollout_id(rollout_id: str, sample_index: int, attempt: int) -> str:
    """The id of re-run ``attempt`` (1, 2, ...) of the sample whose first rollout (or an earlier re-run) is
    ``rollout_id``: deterministic, the same from any re-run of it."""
    suffix = f"-{sample_index}"
    stem, tail = (rollout_id[: -len(suffix)], suffix) if rollout_id.endswith(suffix) else (rollout_id, "")
    return f"{_RERUN.sub('', stem)}.r{attempt}{tail}"


def rerun_task(
    task: TaskEvent, failure_kind: str | None, retries: int, now_ms: int | None = None
) -> TaskEvent | None:
    """The task that re-runs ``task`` after ``failure_kind``, or None: the failure is not one a new attempt
    can mend (a policy failure, a bad row), or the sample has had ``retries`` re-runs already."""
    if not rerun_helps(failure_kind) or task.attempt >= retries:
        return None
    return dataclasses.replace(
        task,
        rollout_id=rerun_rollout_id(task.rollout_id, task.sample_index, task.attempt + 1),
        attempt=task.attempt + 1,
        submitted_at=int(time.time() * 1000) if now_ms is None else now_ms,
    )
