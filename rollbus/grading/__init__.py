"""Grading an agent's patch against a dataset row: pure decisions (patches, flags, verdicts) and one I/O edge
(:func:`grade`, sandboxed). The grader service and ``rollbus grade`` both call :func:`grade`."""

from rollbus.grading.flags import ZEROING
from rollbus.grading.patches import PatchRejected, Sanitized, sanitize
from rollbus.grading.rows import BadRow, GradingSpec, absolute_paths, parse_metadata, parse_row
from rollbus.grading.run import GradeConfig, grade, grade_sync
from rollbus.grading.verdict import GradeResult, TestResult, failed

__all__ = [
    "ZEROING",
    "BadRow",
    "GradeConfig",
    "GradeResult",
    "GradingSpec",
    "PatchRejected",
    "Sanitized",
    "TestResult",
    "absolute_paths",
    "failed",
    "grade",
    "grade_sync",
    "parse_metadata",
    "parse_row",
    "sanitize",
]
