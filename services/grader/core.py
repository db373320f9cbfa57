"""From a ``diff`` event to its ``reward`` record: the one path the service and ``rollbus grade`` share."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollbus.events import DiffEvent, RewardEvent, TestResult
from rollbus.events.reward import reward_event
from rollbus.failures import is_infrastructure, reward_cause
from rollbus.grading import BadRow, GradeConfig, GradeResult, failed, grade, parse_row
from rollbus.grading import verdict as v
from rollbus.grading.backends import BackendUnavailable, grade_function
from rollbus.task_image import ImageFieldError, parse_digest


async def grade_row(
    row: Mapping[str, Any],
    patch: bytes | str,
    base_dir: Path,
    config: GradeConfig,
    image_digest: str | None = None,
) -> GradeResult:
    """Grade ``patch`` against ``row`` (relative paths resolve against ``base_dir``); a bad row is a grade.
    ``image_digest``: the container image the agent ran, which a container backend grades in."""
    try:
        spec = parse_row(row, base_dir)
        digest = parse_digest(image_digest, "the diff's image_digest")
    except (BadRow, ImageFieldError) as exc:
        return failed(v.BAD_ROW, str(exc))
    except Exception as exc:  # the grader always answers
        return v.grader_error(exc)
    try:
        grade_on = grade if config.backend == "local" else grade_function(config.backend)
    except BackendUnavailable as exc:  # the operator's choice, not the patch's doing: infrastructure
        return failed(v.GRADING_SETUP_FAILED, str(exc))
    return await grade_on(dataclasses.replace(spec, image_digest=digest), patch, config)


async def grade_diff(
    diff: DiffEvent | Mapping[str, Any], base_dir: Path, config: GradeConfig, *,
    grade_failed_rollouts: bool = False,
) -> GradeResult:
    """The grade of one ``diff`` event (its ``task_metadata`` is the row's metadata, copied by the runner)."""
    diff = DiffEvent.from_dict(diff)
    if diff.patch_truncated:
        return failed(v.PATCH_TRUNCATED, "the runner cut the patch at its size cap")
    rollout_failure = diff.failure_kind or (diff.error and "error")
    # an infrastructure failure is never graded: its patch (if any) says nothing of the policy
    if rollout_failure and (not grade_failed_rollouts or is_infrastructure(rollout_failure)):
        result = failed(v.ROLLOUT_FAILED, f"the rollout ended with {rollout_failure}: {diff.error or ''}")
        return GradeResult(
            **{**result.__dict__, "details": {**result.details, "rollout_failure": rollout_failure}}
        )
    row = {"metadata": diff.task_metadata or "{}", "label": diff.label}
    try:
        patch = diff_patch(diff)
    except Exception as exc:  # the grader always answers
        return v.grader_error(exc)
    return await grade_row(row, patch, base_dir, config, diff.image_digest)


def diff_patch(diff: DiffEvent) -> bytes:
    """The diff's patch as the bytes git wrote (diff v3 carries bytes; a v1/v2 string reads back as its UTF-8
    bytes through schema resolution, and a str from elsewhere is encoded the same way): never decoded here,
    so a changed file in any encoding reaches the grader whole."""
    patch: bytes | str = diff.patch or b""
    return patch.encode("utf-8", "surrogateescape") if isinstance(patch, str) else bytes(patch)


def reward_record(diff: DiffEvent | Mapping[str, Any], result: GradeResult) -> RewardEvent:
    """The ``reward`` event for ``diff`` graded as ``result``: with the failure's class and cause
    (:mod:`rollbus.failures`), and the re-run the runner submitted for an infrastructure failure."""
    diff = DiffEvent.from_dict(diff)
    rollout_failure = result.details.get("rollout_failure")
    cause = reward_cause(result.failure_kind, rollout_failure if isinstance(rollout_failure, str) else None)
    return reward_event(
        rollout_id=diff.rollout_id, attempt_id=diff.attempt_id, group_id=diff.group_id,
        group_size=diff.group_size, reward=result.reward, solved=result.solved,
        applied_cleanly=result.applied_cleanly, details=json.dumps(dict(result.details), default=str),
        failure_kind=result.failure_kind, cause=cause, flags=result.flags,
        tests=[TestResult(name=t.name, status=t.status) for t in result.tests],
        image_digest=result.details.get("image_digest"),  # set by a container backend's grade only
        rerun_rollout_id=diff.rerun_rollout_id,
    )  # fmt: skip


def without_bulk(reward: RewardEvent) -> RewardEvent:
    """``reward`` without its per-test results and details, for a reward event too large for the bus: they
    are the bulk, and the verdict itself always fits."""
    note = json.dumps({"note": "per-test results and details dropped: the reward event was too large"})
    return dataclasses.replace(reward, tests=[], details=note)
