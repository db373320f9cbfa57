"""How an attempt ended, as plain data: its failure kind, its patch (trimmed and capped), its diff event.

Pure functions over plain values, so every failure path is tested without a sandbox. A patch is bytes from
capture to the grader: a changed file in any encoding is carried as it is, never decoded.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollbus.events import DiffEvent
from rollbus.sandbox import Completed

# Failure kinds a runner names on `diffs` (the grader scores them 0; operators count them).
BAD_TASK = "bad_task"  # the task's metadata is not a JSON object: it can never run
BOOT_FAILED = "boot_failed"  # the sandbox (or its image) could not be built, after retries
INSTALL_FAILED = "install_failed"  # the agent (the Claude Code binary) could not be made available
SESSION_FAILED = "session_failed"  # the adapter refused or did not answer the sessions API
TIMEOUT = "timeout"  # the agent ran past its wall-clock budget and was killed
AGENT_CRASHED = "agent_crashed"  # the CLI exited non-zero (or was killed by a signal) on its own
MAX_TURNS = "max_turns"  # the CLI stopped at --max-turns
PATCH_TOO_LARGE = "patch_too_large"  # the patch exceeded the cap and was cut
PATCH_FAILED = "patch_failed"  # git gave no patch (it hit the capture's limits, or the repository is broken)
RUNNER_ERROR = "runner_error"  # a runner bug or host failure before the agent started (the error says which)
SANDBOX_BROKEN = "sandbox_broken"  # the sandbox failed once the agent had run in it: it may have broken it

# Sandbox-reported kinds that do not end a rollout badly: the agent's chatter was cut, its work is on disk.
NOT_FAILURES = ("output_truncated",)
_DIFF_HEADER = re.compile(rb"^diff --git a/(.*?) b/(.*)$")


def classify(completed: Completed) -> str | None:
    """The failure kind of a finished agent run, or None when it ended normally.

    A limit the sandbox enforced wins (``Completed.failure_kind``: ``memory_limit``, ``pids_limit``,
    ``disk_full``, ``timeout``, ...; a cut output is not a failure); then the budget; then the CLI's own
    account of the run; then its exit status.
    """
    reported = getattr(completed, "failure_kind", None)
    if reported and reported not in NOT_FAILURES:
        return str(reported)
    if completed.timed_out:
        return TIMEOUT
    result = final_result(completed.stdout)
    if result is not None and result.get("subtype") == "error_max_turns":
        return MAX_TURNS
    if completed.exit_code != 0:
        return AGENT_CRASHED
    return None


def final_result(stdout: str) -> dict[str, Any] | None:
    """The CLI's closing stream-json ``result`` event, if it printed one."""
    for line in reversed(stdout.strip().splitlines()):
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("type") == "result":
            return event
    return None


def agent_turns(stdout: str) -> int:
    result = final_result(stdout)
    turns = result.get("num_turns", 0) if result else 0
    return turns if isinstance(turns, int) and turns >= 0 else 0


def drop_paths(patch: bytes, excluded: list[str]) -> bytes:
    """``patch`` without the file sections of ``excluded`` paths (a path or a directory prefix)."""
    if not excluded or not patch:
        return patch
    sections = re.split(rb"(?m)^(?=diff --git )", patch)
    kept = []
    names = [e.encode() for e in excluded]
    for section in sections:
        match = _DIFF_HEADER.match(section.split(b"\n", 1)[0])
        if match and any(_under(p, e) for p in match.groups() for e in names):
            continue
        kept.append(section)
    return b"".join(kept)


def _under(path: bytes, excluded: bytes) -> bool:
    return path == excluded or path.startswith(excluded + b"/")


def cap_patch(patch: bytes, max_bytes: int) -> tuple[bytes, bool]:
    """At most ``max_bytes``, cut at a line end; True if anything was cut."""
    if len(patch) <= max_bytes:
        return patch, False
    cut = patch[:max_bytes]
    return cut[: cut.rfind(b"\n") + 1], True


@dataclass(frozen=True)
class AttemptResult:
    """What one attempt produced, before it becomes a diff event."""

    attempt_id: str
    patch: bytes = b""
    exit_status: int = -1
    wall_time_s: float = 0.0
    turns: int = 0
    failure_kind: str | None = None
    error: str | None = None
    patch_truncated: bool = False
    image_digest: str | None = None  # the container image the agent ran (sha256:...); None on bwrap


def diff_event(
    task: Mapping[str, Any],
    outcome: AttemptResult,
    now_ms: int | None = None,
    rerun_rollout_id: str | None = None,
) -> DiffEvent:
    """The ``diffs`` event of ``outcome`` (the task's group, metadata and label copied for the grader; a field
    the task lacks keeps the event's default; ``rerun_rollout_id``: the re-run submitted for an
    infrastructure failure)."""
    copied = {task_field: task[task_field] for task_field in _COPIED if task_field in task}
    return DiffEvent(
        rollout_id=task["rollout_id"], attempt_id=outcome.attempt_id, patch=outcome.patch,
        exit_status=outcome.exit_status, wall_time_s=outcome.wall_time_s, turns=outcome.turns,
        error=outcome.error, failure_kind=outcome.failure_kind, patch_truncated=outcome.patch_truncated,
        image_digest=outcome.image_digest, at=int(time.time() * 1000) if now_ms is None else now_ms,
        rerun_rollout_id=rerun_rollout_id, **{_COPIED[name]: value for name, value in copied.items()},
    )  # fmt: skip


# the task's fields a diff carries for the grader: task field -> diff field
_COPIED = {"group_id": "group_id", "group_size": "group_size", "metadata": "task_metadata", "label": "label"}
