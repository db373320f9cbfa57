"""Grading decisions as plain functions: from test evidence to solved or not, and from that to the reward.

Only structured evidence counts as a pass, and first the evidence itself is judged
(:func:`tampering`): the grader's own report (:mod:`rollbus.grading.report`) must show every test run that
started also finished, the process must not have died of a signal, and the grade's canaries
(:mod:`rollbus.grading.canaries`) must be reported as they are; otherwise the grade is ``tampered``. Then:
swepro, every ``fail_to_pass`` and ``pass_to_pass`` test PASSED (in the grader's report where it names the
test, else as the row's parser read the log); eval_cmd and f2p_script, exit status 0, every test run ended
with status 0 and every test the runner reported PASSED. Skipped, xfailed, errored or missing is never
passed; zero tests is never solved. A command that runs no pytest or unittest the grader can see is judged by
its exit status (and, for a unittest ``OK`` line in its output, that line) alone.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from rollbus.grading import canaries as canary
from rollbus.grading import report
from rollbus.grading.flags import UNEXPECTED_TESTS

PASSED, FAILED, SKIPPED, ERROR, MISSING = "PASSED", "FAILED", "SKIPPED", "ERROR", "MISSING"
XFAIL, XPASS = report.XFAIL, report.XPASS
STATUSES = (PASSED, FAILED, SKIPPED, XFAIL, XPASS, ERROR, MISSING)
_RANK = {PASSED: 0, SKIPPED: 1, XFAIL: 1, XPASS: 2, FAILED: 2, ERROR: 3, MISSING: 4}
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
TAMPERED = "tampered"
TIMEOUT = "timeout"
SANDBOX_FAILED = "sandbox_failed"
BAD_ROW = "bad_row"
GRADING_SETUP_FAILED = "grading_setup_failed"
PARSER_FAILED = "parser_failed"
ROLLOUT_FAILED = "rollout_failed"
GRADER_ERROR = "grader_error"  # the grader itself raised: its fault, not the patch's (the cause in the note)


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest test class

    name: str
    status: str


@dataclass(frozen=True)
class Verdict:
    """What running the row's grader showed: solved or why not, and the tests where known."""

    solved: bool
    failure_kind: str | None
    tests: tuple[TestResult, ...] = ()
    note: str = ""
    flags: tuple[str, ...] = ()
    observed: tuple[str, ...] = ()  # what the changed code was seen doing while the tests ran
    wildcard_expected: bool = False  # a test compared by name an agreeing value of the changed code


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


def grader_error(exc: BaseException) -> GradeResult:
    """The verdict for an exception inside the grader: reward 0, the cause and where it was raised."""
    where = exc.__traceback__
    while where is not None and where.tb_next is not None:
        where = where.tb_next
    place = f" at {where.tb_frame.f_code.co_filename}:{where.tb_lineno}" if where is not None else ""
    return failed(GRADER_ERROR, f"{type(exc).__name__}: {str(exc)[:1000]}{place}")


def final(
    outcome: Verdict, flags: Iterable[str], zeroing: Iterable[str], details: Mapping[str, Any]
) -> GradeResult:
    """The reward: 1 only when the tests solved it and no zeroing flag is raised."""
    flags = tuple(sorted(set(flags) | set(outcome.flags)))
    zeroed = sorted(set(flags) & set(zeroing))
    solved = outcome.solved and not zeroed
    kind = outcome.failure_kind if not outcome.solved else (FLAGGED if zeroed else None)
    info = {**details, "tests_passed": outcome.solved, **({"note": outcome.note} if outcome.note else {})}
    if outcome.observed:
        info["observed"] = list(outcome.observed)
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


def swepro_outcome(
    reported: list[TestResult],
    required: Iterable[str],
    *,
    evidence: Evidence | None = None,
    selected_files: Sequence[str] = (),
    workdir: str = "/workspace",
) -> Verdict:
    """Solved iff every required test is PASSED. With ``evidence`` (a row whose tests pytest runs), tampering
    is judged first, and each required test needs the grader's report: collected from its own file, run,
    passed (and not contradicted by the log); a test the report never names is MISSING, whatever the log
    says. Without it (a Go or JavaScript row), the parser's reading of the log decides."""
    required = list(dict.fromkeys(required))
    ours: dict[str, str] = {}
    flags: tuple[str, ...] = ()
    if evidence is not None:
        if why := tampering(evidence):
            return Verdict(False, TAMPERED, _results(reported, required, {}, evidence.canaries), why)
        ours = evidence.tests()
        if not evidence.test_runs and reported:
            note = "the log reports tests, but no pytest run reported to the grader"
            return Verdict(False, TAMPERED, _results(reported, required, {}, evidence.canaries), note)
        flags = unexpected(ours, [f.split(" | ")[0] for f in selected_files])
    by_name = {t.name: t.status for t in reported}
    tests = _results(reported, required, ours, evidence.canaries if evidence else None, evidence is not None)
    if not reported and not ours:
        return Verdict(False, NO_TESTS, tests, "the parser reported no tests", flags)
    if not required:
        return Verdict(False, NO_TESTS, tests, "the row names no fail_to_pass or pass_to_pass tests", flags)
    contradicted = [n for n in required if by_name.get(n) == PASSED and ours.get(n, PASSED) != PASSED]
    if contradicted:
        note = f"the log says passed, the grader's report does not: {contradicted[:5]}"
        return Verdict(False, REPORT_MISMATCH, tests, note, flags)
    status = {t.name: t.status for t in tests}
    bad = [n for n in required if status.get(n) != PASSED]
    if bad:
        return Verdict(False, TESTS_FAILED, tests, f"{len(bad)} required tests not passed: {bad[:5]}", flags)
    if evidence is not None:
        if what := evidence.interrupted():
            note = f"a test run was interrupted ({what}: pytest.exit or KeyboardInterrupt): not solved"
            return Verdict(False, TESTS_FAILED, tests, note, flags)
        if elsewhere := collected_elsewhere(evidence, required, workdir):
            note = f"required tests collected from files other than their own: {elsewhere[:5]}"
            return Verdict(False, TESTS_FAILED, tests, note, flags)
    return Verdict(True, None, tests, "", flags)


def _results(
    reported: list[TestResult],
    required: list[str],
    ours: Mapping[str, str],
    canaries: canary.Canaries | None,
    report_required: bool = False,
) -> tuple[TestResult, ...]:
    """Each required test's status (the worse of the grader's report and the log; with ``report_required``,
    MISSING where the grader's report does not name it), then the parser's other tests."""
    by_name = {t.name: t.status for t in reported}
    tests = [
        TestResult(n, MISSING if report_required and n not in ours else _worse(ours.get(n), by_name.get(n)))
        for n in required
    ]
    tests += [t for t in reported if t.name not in set(required)]
    if canaries is not None:
        tests = [t for t in tests if not canary.is_canary(t.name, canaries)]
    return tuple(tests[:MAX_TESTS_REPORTED])


def _worse(ours: str | None, parsed: str | None) -> str:
    """A required test's status: the worse of the grader's report and the log, where both name it."""
    known = [s for s in (ours, parsed) if s is not None]
    return max(known, key=_RANK.__getitem__) if known else MISSING


# -- the grader's own evidence -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """How the test command ended and what the grader's report says about it."""

    exit_code: int
    test_runs: tuple[report.TestRun, ...]
    canaries: canary.Canaries | None
    report_error: str = ""  # the report exists but is not the grader's (malformed): set, test_runs empty

    def tests(self) -> dict[str, str]:
        """Every reported test but the canaries, by name."""
        return self.without_canaries(report.merged(list(self.test_runs)))

    def interrupted(self) -> str:
        """What ended a run before its end (``Exit``, ``KeyboardInterrupt``), or ""."""
        return next((r.interrupted for r in self.test_runs if r.interrupted), "")

    def files_of(self, name: str) -> set[str]:
        return report.paths(list(self.test_runs)).get(name, set())

    def without_canaries(self, tests: Mapping[str, str]) -> dict[str, str]:
        if self.canaries is None:
            return dict(tests)
        return {n: s for n, s in tests.items() if not canary.is_canary(n, self.canaries)}


def tampering(evidence: Evidence) -> str | None:
    """Why the evidence of a run cannot be believed, or None. The process must end on its own (no signal),
    every test run that started must finish, the report must be the grader's, a test run that says it
    succeeded must hold no failure, and the canaries must be reported as they are."""
    code = evidence.exit_code
    if code < 0 or code >= 128:
        number = -code if code < 0 else code - 128
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        return f"the test process was killed ({name}, exit status {code})"
    if evidence.report_error:
        return f"the grader's report was rewritten: {evidence.report_error}"
    if any(not s.finished for s in evidence.test_runs):
        return "a test run never finished: it was killed, or left through os._exit or a signal inside a test"
    for run in evidence.test_runs:
        own = evidence.without_canaries(run.tests)
        if run.exitstatus == 0 and not run.interrupted and any(v in (FAILED, ERROR) for v in own.values()):
            return "a test run ended with status 0 while its report holds failures"
    if evidence.canaries is None or not evidence.test_runs:
        return None
    everything = report.merged(list(evidence.test_runs))
    if not everything:
        return None  # nothing ran at all: not tampering, zero tests
    problem = canary.check(everything, evidence.canaries)
    if problem is None:
        return None
    stopped = any(v != PASSED for v in evidence.tests().values())
    if problem == canary.DID_NOT_RUN and stopped:
        return None  # a real failure stopped the run (-x) before the canaries
    return problem


def without_evidence(
    evidence: Evidence, tests: Mapping[str, str], required_files: Iterable[str], workdir: str
) -> str | None:
    """Why the grader's own record does not show every required test file passing, or None: each file
    (repository-relative) must have yielded at least one test collected from it at its absolute path in the
    sandbox (``workdir``/file), and that test passed. A file that vanished (skipped while collected, never
    collected, a test of that name reported from another file) has no positive evidence."""
    by_file: dict[str, list[str]] = {}
    for name in tests:
        for path in evidence.files_of(name):
            by_file.setdefault(path, []).append(name)
    for rel in sorted(set(required_files)):
        where = str(PurePosixPath(workdir) / rel)
        names = by_file.get(where, [])
        if not names:
            return f"{rel} yielded no test the grader saw collected from {where}"
        if any(tests[n] != PASSED for n in names):
            return f"a test of {rel} did not pass"
    return None


def collected_elsewhere(evidence: Evidence, names: Iterable[str], workdir: str) -> list[str]:
    """Required pytest node ids the grader saw collected from somewhere other than their own file in the
    sandbox's repository (a stand-in of the same relative path and test name, elsewhere)."""
    out = []
    for name in names:
        rel = name.split("::", 1)[0]
        expected = str(PurePosixPath(workdir) / rel)
        files = evidence.files_of(name)
        if "::" in name and files and files != {expected}:
            out.append(name)
    return out


def unexpected(tests: Mapping[str, str], expected_files: Iterable[str]) -> tuple[str, ...]:
    """:data:`UNEXPECTED_TESTS` when a test comes from none of the files the row runs (nothing to say when the
    row names no files): a test made up at run time, or collected from a planted module."""
    files = {str(PurePosixPath(f)) for f in expected_files if f}
    if not files:
        return ()
    modules = {f.removesuffix(".py").replace("/", ".") for f in files}
    for name in tests:
        if "::" in name:
            if name.split("::", 1)[0] not in files:
                return (UNEXPECTED_TESTS,)
        elif not any(name.startswith(m + ".") for m in modules):
            return (UNEXPECTED_TESTS,)
    return ()


# -- eval_cmd / f2p_script -----------------------------------------------------------------------------------


UNITTEST_RAN = re.compile(r"^Ran (\d+) tests? in ", re.MULTILINE)
UNITTEST_OK = re.compile(r"^OK(?: \((.*)\))?$", re.MULTILINE)


def command_outcome(
    evidence: Evidence,
    output: str,
    *,
    runner_expected: bool,
    unittest_output: bool,
    expected_files: Sequence[str] = (),
    required_files: Sequence[str] = (),
    workdir: str = "/workspace",
) -> Verdict:
    """eval_cmd / f2p_script: the evidence holds, exit 0, every run ended with status 0 and ran to its end (no
    ``pytest.exit``, no ``KeyboardInterrupt``), every test PASSED, and every ``required_files`` (the row's
    named test files) yielded a passed test collected from its own path (:func:`without_evidence`).

    ``runner_expected``: the command runs pytest or unittest, so a run must have reported. Without any
    report, exit 0 is all there is, and a unittest run's own ``Ran N tests`` / ``OK`` line must agree
    (``unittest_output``)."""
    tests = evidence.tests()
    results = tuple(TestResult(n, s) for n, s in tests.items())[:MAX_TESTS_REPORTED]
    if why := tampering(evidence):
        return Verdict(False, TAMPERED, results, why)
    code = evidence.exit_code
    if not evidence.test_runs:
        if runner_expected and code == 0:
            return Verdict(
                False, TAMPERED, (), "exit 0, but no pytest or unittest run reported to the grader"
            )
        if code != 0:
            return Verdict(False, TESTS_FAILED, (), f"exit status {code}")
        return _unittest_output(output) if unittest_output else Verdict(True, None, ())
    flags = unexpected(tests, expected_files)
    if what := evidence.interrupted():
        note = f"a test run was interrupted ({what}: pytest.exit or KeyboardInterrupt): not solved"
        return Verdict(False, TESTS_FAILED, results, note, flags)
    if code != 0:
        return Verdict(False, TESTS_FAILED, results, f"exit status {code}", flags)
    ended = [s.exitstatus for s in evidence.test_runs if s.exitstatus != 0]
    if ended:
        return Verdict(
            False, REPORT_MISMATCH, results, f"exit 0, but a test run ended with status {ended[0]}", flags
        )
    if not tests:
        return Verdict(False, NO_TESTS, results, "no test ran", flags)
    bad = [n for n, s in tests.items() if s != PASSED]
    if bad:
        note = f"{len(bad)} tests not passed (skipped, xfailed and errored are not passes): {bad[:5]}"
        return Verdict(False, TESTS_FAILED, results, note, flags)
    if why := without_evidence(evidence, tests, required_files, workdir):
        return Verdict(False, TESTS_FAILED, results, why, flags)
    return Verdict(True, None, results, "", flags)


def _unittest_output(output: str) -> Verdict:
    """A unittest run the grader could not watch: ``Ran N tests`` with N > 0 and a bare ``OK`` (no skips,
    no expected failures: those are not passes)."""
    runs = UNITTEST_RAN.findall(output)
    if not runs:
        return Verdict(False, REPORT_MISMATCH, (), "exit 0 but unittest reported no run")
    if int(runs[-1]) == 0:
        return Verdict(False, NO_TESTS, (), "unittest ran no tests")
    oks = UNITTEST_OK.findall(output)
    if not oks or re.search(r"^FAILED \(", output, re.MULTILINE):
        return Verdict(False, REPORT_MISMATCH, (), "exit 0 but unittest did not report OK")
    if oks[-1]:
        return Verdict(False, TESTS_FAILED, (), f"unittest reported OK ({oks[-1]}): not every test passed")
    return Verdict(True, None, ())


def runs_pytest(command: str) -> bool:
    return bool(re.search(r"\bpytest\b", command))


def runs_unittest(command: str) -> bool:
    return bool(re.search(r"\bunittest\b", command)) and not runs_pytest(command)
