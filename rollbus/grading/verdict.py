"""Grading decisions as plain functions: from test output to solved or not, and from that to the reward.

Only structured evidence counts as a pass. swepro: every ``fail_to_pass`` and ``pass_to_pass`` test reported
PASSED by the row's parser (missing, errored or skipped is not passed; zero tests is not solved). eval_cmd and
f2p_script: exit status 0, and, when the command ran pytest or unittest, their own report must agree (a
JUnit XML written by pytest, ``Ran N tests`` / ``OK`` from unittest), so an exit status forced to 0
(``atexit`` + ``os._exit(0)``, a crash at import) is not a pass.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PASSED, FAILED, SKIPPED, ERROR, MISSING = "PASSED", "FAILED", "SKIPPED", "ERROR", "MISSING"
STATUSES = (PASSED, FAILED, SKIPPED, ERROR, MISSING)
_RANK = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3, MISSING: 4}
MAX_TESTS_REPORTED = 2000
MAX_TEST_NAME = 1000  # characters; test names come from output the code under test can write to
MAX_REPORT_BYTES = 16 * 2**20

# failure kinds (the reward's failure_kind); None when solved
PATCH_TOO_LARGE = "patch_too_large"
PATCH_TRUNCATED = "patch_truncated"
MALFORMED_PATCH = "malformed_patch"
PATCH_FAILED = "patch_failed"
FLAGGED = "flagged"
TESTS_FAILED = "tests_failed"
NO_TESTS = "no_tests"
REPORT_MISMATCH = "report_mismatch"
TIMEOUT = "timeout"
SANDBOX_FAILED = "sandbox_failed"
BAD_ROW = "bad_row"
GRADING_SETUP_FAILED = "grading_setup_failed"
PARSER_FAILED = "parser_failed"
ROLLOUT_FAILED = "rollout_failed"


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest test class

    name: str
    status: str


@dataclass(frozen=True)
class Outcome:
    """What running the row's grader showed: solved or why not, and the tests where known."""

    solved: bool
    failure_kind: str | None
    tests: tuple[TestResult, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class GradeResult:
    """One grade, in the reward event's words."""

    reward: float
    solved: bool
    applied_cleanly: bool
    failure_kind: str | None
    flags: tuple[str, ...] = ()
    tests: tuple[TestResult, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "solved": self.solved,
            "applied_cleanly": self.applied_cleanly,
            "failure_kind": self.failure_kind,
            "flags": list(self.flags),
            "tests": [{"name": t.name, "status": t.status} for t in self.tests],
            "details": dict(self.details),
        }


def failed(kind: str, note: str = "", *, applied: bool = False, flags: Iterable[str] = ()) -> GradeResult:
    """A grade that ended before the tests could decide anything."""
    return GradeResult(0.0, False, applied, kind, tuple(sorted(flags)), (), {"note": note} if note else {})


def final(
    outcome: Outcome, flags: Iterable[str], zeroing: Iterable[str], details: Mapping[str, Any]
) -> GradeResult:
    """The reward: 1 only when the tests solved it and no zeroing flag is raised."""
    flags = tuple(sorted(set(flags)))
    zeroed = sorted(set(flags) & set(zeroing))
    solved = outcome.solved and not zeroed
    kind = outcome.failure_kind if not outcome.solved else (FLAGGED if zeroed else None)
    info = {**details, "tests_passed": outcome.solved, **({"note": outcome.note} if outcome.note else {})}
    return GradeResult(1.0 if solved else 0.0, solved, True, kind, flags, outcome.tests, info)


# -- swepro --------------------------------------------------------------------------------------------------


def parse_parser_output(text: str) -> list[TestResult]:
    """The parser's ``{"tests": [{"name", "status"}]}``; a name seen twice keeps its worse status.

    Raises ValueError when the JSON is not of that shape.
    """
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("tests"), list):
        raise ValueError('parser output is not {"tests": [...]}')
    merged: dict[str, str] = {}
    for item in data["tests"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"parser output has a malformed test entry: {item!r:.100}")
        status = str(item.get("status", "")).upper()
        status = status if status in _RANK and status != MISSING else ERROR
        name = item["name"][:MAX_TEST_NAME]
        if name not in merged or _RANK[status] > _RANK[merged[name]]:
            merged[name] = status
    return [TestResult(n, s) for n, s in merged.items()]


def swepro_outcome(reported: list[TestResult], required: Iterable[str]) -> Outcome:
    """Solved iff every required test is reported PASSED; required tests not reported are MISSING."""
    required = list(dict.fromkeys(required))
    by_name = {t.name: t.status for t in reported}
    tests = [TestResult(n, by_name.get(n, MISSING)) for n in required]
    tests += [t for t in reported if t.name not in set(required)]
    tests = tests[:MAX_TESTS_REPORTED]
    if not reported:
        return Outcome(False, NO_TESTS, tuple(tests), "the parser reported no tests")
    if not required:
        return Outcome(False, NO_TESTS, tuple(tests), "the row names no fail_to_pass or pass_to_pass tests")
    bad = [n for n in required if by_name.get(n) != PASSED]
    if bad:
        return Outcome(False, TESTS_FAILED, tuple(tests), f"{len(bad)} required tests not passed: {bad[:5]}")
    return Outcome(True, None, tuple(tests))


# -- eval_cmd / f2p_script -----------------------------------------------------------------------------------


def parse_junit(text: str) -> list[TestResult]:
    """Per-test results from a pytest JUnit XML report; ValueError when it is not one."""
    if len(text) > MAX_REPORT_BYTES:
        raise ValueError("JUnit report is too large")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ValueError(f"JUnit report is not XML: {exc}") from None
    results = []
    for case in root.iter("testcase"):
        name = "::".join(p for p in (case.get("classname", ""), case.get("name", "")) if p)[:MAX_TEST_NAME]
        children = {child.tag for child in case}
        if "error" in children:
            status = ERROR
        elif "failure" in children:
            status = FAILED
        elif "skipped" in children:
            status = SKIPPED
        else:
            status = PASSED
        results.append(TestResult(name, status))
    return results


UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in ", re.MULTILINE)


def command_outcome(
    exit_code: int, output: str, *, runs_pytest: bool, junit: str | None, runs_unittest: bool
) -> Outcome:
    """eval_cmd / f2p_script: exit 0, and the test runner's own report agreeing where there is one."""
    tests: list[TestResult] = []
    if runs_pytest and junit is not None:
        try:
            tests = parse_junit(junit)[:MAX_TESTS_REPORTED]
        except ValueError as exc:
            return Outcome(False, REPORT_MISMATCH, (), str(exc))
    if exit_code != 0:
        return Outcome(False, TESTS_FAILED, tuple(tests), f"exit status {exit_code}")
    if runs_pytest:
        if junit is None:
            return Outcome(False, REPORT_MISMATCH, (), "exit 0 but pytest wrote no report")
        if not tests:
            return Outcome(False, NO_TESTS, (), "pytest ran no tests")
        bad = [t.name for t in tests if t.status not in (PASSED, SKIPPED)]
        if bad or all(t.status == SKIPPED for t in tests):
            return Outcome(False, REPORT_MISMATCH, tuple(tests), f"exit 0 but pytest reported {bad[:5]}")
    if runs_unittest:
        runs = UNITTEST_RAN.findall(output)
        if not runs:
            return Outcome(False, REPORT_MISMATCH, tuple(tests), "exit 0 but unittest reported no run")
        if int(runs[-1]) == 0:
            return Outcome(False, NO_TESTS, tuple(tests), "unittest ran no tests")
        if not re.search(r"^OK\b", output, re.MULTILINE) or re.search(r"^FAILED \(", output, re.MULTILINE):
            return Outcome(False, REPORT_MISMATCH, tuple(tests), "exit 0 but unittest did not report OK")
    return Outcome(True, None, tuple(tests))


def runs_pytest(command: str) -> bool:
    return bool(re.search(r"\bpytest\b", command))


def runs_unittest(command: str) -> bool:
    return bool(re.search(r"\bunittest\b", command)) and not runs_pytest(command)
