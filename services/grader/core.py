"""From a ``diff`` event to its ``reward`` record: the one path the service and ``rollbus grade`` share."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollbus.failures import INFRASTRUCTURE, failure_class, is_infrastructure, reward_cause
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
    diff: Mapping[str, Any], base_dir: Path, config: GradeConfig, *, grade_failed_rollouts: bool = False
) -> GradeResult:
    """The grade of one ``diff`` event (its ``task_metadata`` is the row's metadata, copied by the runner)."""
    if diff.get("patch_truncated"):
        return failed(v.PATCH_TRUNCATED, "the runner cut the patch at its size cap")
    rollout_failure = diff.get("failure_kind") or (diff.get("error") and "error")
    # an infrastructure failure is never graded: its patch (if any) says nothing of the policy
    if rollout_failure and (not grade_failed_rollouts or is_infrastructure(rollout_failure)):
        result = failed(
            v.ROLLOUT_FAILED, f"the rollout ended with {rollout_failure}: {diff.get('error') or ''}"
        )
        return GradeResult(
            **{**result.__dict__, "details": {**result.details, "rollout_failure": rollout_failure}}
        )
    row = {"metadata": diff.get("task_metadata") or "{}", "label": diff.get("label")}
    try:
        patch = diff_patch(diff)
    except Exception as exc:  # the grader always answers
        return v.grader_error(exc)
    return await grade_row(row, patch, base_dir, config, diff.get("image_digest"))


def diff_patch(diff: Mapping[str, Any]) -> bytes:
    """The diff's patch as the bytes git wrote (diff v3 carries bytes; a v1/v2 string reads back as its UTF-8
    bytes through schema resolution, and a str from elsewhere is encoded the same way): never decoded here,
    so a changed file in any encoding reaches the grader whole."""
    patch = diff.get("patch") or b""
    return patch.encode("utf-8", "surrogateescape") if isinstance(patch, str) else bytes(patch)


def reward_record(diff: Mapping[str, Any], result: GradeResult) -> dict[str, Any]:
    """The ``reward`` event for ``diff`` graded as ``result`` (schema v3): with the failure's class and
    cause (:mod:`rollbus.failures`), and the re-run the runner submitted for an infrastructure failure."""
    rollout_failure = result.details.get("rollout_failure")
    cause = reward_cause(result.failure_kind, rollout_failure if isinstance(rollout_failure, str) else None)
    kind = failure_class(cause)
    return {
        "rollout_id": diff["rollout_id"],
        "attempt_id": diff.get("attempt_id") or "",
        "group_id": diff.get("group_id") or "",
        "group_size": diff.get("group_size") or 1,
        "reward": result.reward,
        "solved": result.solved,
        "applied_cleanly": result.applied_cleanly,
        "failure_kind": result.failure_kind,
        "flags": list(result.flags),
        "tests": [{"name": t.name, "status": t.status} for t in result.tests],
        "details": json.dumps(dict(result.details), default=str),
        "step_rewards": [],
        "infos": "[]",
        "image_digest": result.details.get("image_digest"),  # set by a container backend's grade only
        "at": int(time.time() * 1000),
        "failure_class": kind,
        "failure_cause": cause,
        "rerun_rollout_id": diff.get("rerun_rollout_id") if kind == INFRASTRUCTURE else None,
    }


def without_bulk(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` without its per-test results and details, for a reward event too large for the bus: they are
    the bulk, and the verdict itself always fits."""
    note = json.dumps({"note": "per-test results and details dropped: the reward event was too large"})
    return {**record, "tests": [], "details": note}
