"""Settings of the grader: how one grade runs (shared with ``rollbus grade``) and how the service consumes."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import model_validator

from rollbus.grading import GradeConfig
from rollbus.grading.backends import grade_function
from rollbus.sandbox.scratch import SCRATCH_BYTES
from rollbus.settings import Field, ServiceConsumerSettings, Settings


class GradingOptions(Settings):
    """How one patch is graded; ``rollbus grade`` reads the same flags and ``ROLLBUS_GRADER_*`` variables as
    the service, so a grade reproduced by hand is the grade the service gave."""

    model_config = Settings.scoped("grader")

    grade_timeout: float = Field(600.0, gt=0, description="seconds one grade may take, all steps included")
    max_patch_bytes: int = Field(2**20, gt=0, description="patches larger than this fail as patch_too_large")
    zero_flagged: bool = Field(
        True, description="score 0 when a patch touches grading machinery (the flags are reported either way)"
    )
    log_excerpt_bytes: int = Field(
        8192, ge=0, description="bytes of test output kept in the reward's details"
    )
    data_dir: Path = Field(
        Path("."), description="directory that relative host paths in task metadata resolve against"
    )
    readonly_tests: bool = Field(
        True,
        description="mount the row's test directories read-only while the tests run (code under test "
        "cannot rewrite tests it has not been collected with yet)",
    )
    scratch_dir: Path | None = Field(
        None, description="where grading copies of images are made (unset: TMPDIR)"
    )
    scratch_bytes: int = Field(
        SCRATCH_BYTES,
        gt=0,
        description="size of one grade's scratch filesystem (the image's copy, the base, the repository and "
        "what tests write); a write past it fails as it is written and the grade fails as disk_full",
    )

    backend: Literal["local", "docker"] = Field(
        "local",
        description="sandbox backend of the grade (local: bwrap over host repository images; docker: the "
        "row's container image, pinned to the diff's image digest)",
    )

    @model_validator(mode="after")
    def _backend_here(self) -> Self:
        if self.backend != "local":
            grade_function(self.backend)  # a backend not in this build stops the command at once, named
        return self

    def grade_config(self) -> GradeConfig:
        return GradeConfig(
            timeout_s=self.grade_timeout,
            max_patch_bytes=self.max_patch_bytes,
            zero_flagged=self.zero_flagged,
            log_excerpt_bytes=self.log_excerpt_bytes,
            scratch_dir=self.scratch_dir,
            scratch_bytes=self.scratch_bytes,
            readonly_tests=self.readonly_tests,
            backend=self.backend,
        )


class DiffGrading(GradingOptions):
    """How a ``diff`` event is graded: one patch's options, plus what to do with a failed rollout's patch
    (shared by the service and ``rollbus regrade``)."""

    grade_failed_rollouts: bool = Field(
        False,
        description="grade the patch of a rollout the runner reported as failed (default: reward 0, "
        "failure kind rollout_failed)",
    )


class GraderSettings(DiffGrading, ServiceConsumerSettings):
    """Settings of `rollbus grader` (flags --x-y, variables ROLLBUS_GRADER_X_Y)."""

    model_config = ServiceConsumerSettings.scoped("grader")

    consumer_group: str = Field(
        "rollbus-grader", min_length=1, description="Kafka consumer group on diffs (add graders to scale)"
    )
    max_batch: int = Field(1, ge=1, description="diffs fetched per poll (they are graded one after another)")
