"""The verdict's evidence: the grader's report (parse), canaries, tampering, and the outcomes built on them.

Pure functions tried exhaustively, then the shipped pytest plugin and unittest runner run for real (the
sandbox's interpreter and this venv's, so pytest 7 and 9 both) over small test trees, outside any sandbox:
what they write is what the pure functions read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollbus.grading import canaries as canary
from rollbus.grading import report
from rollbus.grading.channel import Channel
from rollbus.grading.run import PLUGIN_SOURCES, channel_config
from rollbus.grading.verdict import (
    Evidence,
    TestResult,
    command_outcome,
    swepro_outcome,
    tampering,
    unexpected,
)

GRADING = Path(__file__).resolve().parents[1] / "rollbus" / "grading"


def fixed_canaries() -> canary.Canaries:
    names = iter(["mod000", "Case00", "pass01", "pass02", "fail01", "fail02"])
    return canary.make(token=lambda n: next(names), numbers=lambda n: 4)


CAN = fixed_canaries()


def lines(*records: dict) -> str:
    return "".join(json.dumps({"run": "s", **r}) + "\n" for r in records)


START, FINISH0, FINISH1 = (
    {"event": "start"},
    {"event": "finish", "exitstatus": 0},
    {"event": "finish", "exitstatus": 1},
)


def rec(nodeid: str, outcome: str, when: str = "call", xfail: bool = False) -> dict:
    return {"event": "test", "nodeid": nodeid, "when": when, "outcome": outcome, "xfail": xfail}


def canary_records(ok: bool = True) -> list[dict]:
    fail = "failed" if ok else "passed"
    return [
        rec(f"t/{CAN.filename}::{CAN.must_pass[0]}", "passed"),
        rec(f"t/{CAN.filename}::{CAN.must_fail[0]}", fail),
    ]


# -- report --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("phases", "status"),
    [
        ({"setup": ("passed", False), "call": ("passed", False), "teardown": ("passed", False)}, "PASSED"),
        ({"setup": ("passed", False), "call": ("failed", False)}, "FAILED"),
        ({"setup": ("failed", False)}, "ERROR"),
        ({"setup": ("passed", False), "call": ("passed", False), "teardown": ("failed", False)}, "ERROR"),
        ({"call": ("error", False)}, "ERROR"),
        ({"setup": ("skipped", False)}, "SKIPPED"),
        ({"setup": ("passed", False), "call": ("skipped", False)}, "SKIPPED"),
        ({"setup": ("passed", False), "call": ("skipped", True)}, "XFAIL"),
        ({"setup": ("passed", False), "call": ("passed", True)}, "XPASS"),
        ({"setup": ("passed", False)}, "ERROR"),  # never called
    ],
)
def test_a_tests_status_is_its_worst_phase(phases: dict, status: str) -> None:
    assert report.status(phases) == status


def test_test_runs_and_their_ends() -> None:
    text = lines(START, rec("a::t", "passed"), rec("a::u", "failed"), FINISH1)
    text += json.dumps({"run": "z", "event": "start"}) + "\n"
    text += json.dumps({"run": "z", "event": "collect", "nodeid": "b.py", "outcome": "failed"}) + "\n"
    first, second = report.parse(text)
    assert (first.finished, first.exitstatus, first.tests) == (True, 1, {"a::t": "PASSED", "a::u": "FAILED"})
    assert (second.finished, second.exitstatus, second.tests) == (False, None, {"b.py": "ERROR"})
    assert report.merged([first, second]) == {"a::t": "PASSED", "a::u": "FAILED", "b.py": "ERROR"}


def test_a_phase_reported_twice_keeps_its_worse_outcome() -> None:
    """unittest: ``addFailure`` rebound to call ``addSuccess`` reports the call twice; the failure stays."""
    (test_run,) = report.parse(lines(START, rec("m.C.t", "failed"), rec("m.C.t", "passed"), FINISH0))
    assert test_run.tests == {"m.C.t": "FAILED"}


@pytest.mark.parametrize(
    "text",
    [
        "not json\n",
        "[]\n",
        json.dumps({"event": "start"}) + "\n",
        lines(START, START),
        lines(rec("a::t", "passed")),
        lines(START, FINISH0, rec("a::t", "passed")),
        lines(START, {"event": "finish"}),
        lines(START, rec("a::t", "weird")),
        lines(START, {"event": "test", "outcome": "passed"}),
        lines(START, {"event": "surprise"}),
    ],
)
def test_anything_the_grader_does_not_write_is_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="report line"):
        report.parse(text)


# -- canaries ------------------------------------------------------------------------------------------------


def test_canaries_are_fresh_importable_and_answer_as_they_must(tmp_path: Path) -> None:
    first, second = canary.make(), canary.make()
    assert first.names().isdisjoint(second.names()) and first.module != second.module
    assert first.module.startswith("test_") and all(n.startswith("test_") for n in first.names())
    (tmp_path / first.filename).write_text(first.source)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", first.filename],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    for name in first.must_pass:
        assert f"PASSED {first.filename}::" in done.stdout and name in done.stdout
    assert done.stdout.count("FAILED ") == 2 and "2 failed, 2 passed" in done.stdout


@pytest.mark.parametrize(
    ("statuses", "problem"),
    [
        ({"pass01": "PASSED", "pass02": "PASSED", "fail01": "FAILED", "fail02": "FAILED"}, None),
        ({"pass02": "PASSED", "fail02": "FAILED"}, None),  # a unittest run: the methods only
        ({"pass01": "PASSED", "fail01": "PASSED"}, "canaries reported wrongly: fail01 (must fail) PASSED"),
        ({"pass01": "SKIPPED", "fail01": "FAILED"}, "canaries reported wrongly: pass01 (must pass) SKIPPED"),
        ({"pass01": "PASSED", "fail01": "SKIPPED"}, "canaries reported wrongly: fail01 (must fail) SKIPPED"),
        ({"pass01": "PASSED"}, canary.DID_NOT_RUN),
        ({}, canary.DID_NOT_RUN),
    ],
)
def test_canary_check(statuses: dict[str, str], problem: str | None) -> None:
    results = {f"t/{CAN.filename}::TestCase00::test_{name}": s for name, s in statuses.items()}
    results["t/test_x.py::test_real"] = "FAILED"
    assert canary.check(results, CAN) == (
        problem and problem.replace("pass01", "test_pass01").replace("fail01", "test_fail01")
    )


def test_canary_names_in_every_runner_spelling() -> None:
    spellings = ["a/test_m.py::test_pass01", "a/test_m.py::C::test_pass01", "a/test_m.py::test_pass01[1]"]
    for name in [*spellings, "test_mod000.TestCase00.test_pass01"]:
        assert canary.is_canary(name, CAN)
    assert not canary.is_canary("a/test_m.py::test_pass01x", CAN)


# -- tampering and outcomes ----------------------------------------------------------------------------------


def evidence(exit_code: int, *records: dict, error: str = "") -> Evidence:
    return Evidence(exit_code, tuple(report.parse(lines(*records))), CAN, error)


HONEST = [START, rec("t/test_x.py::test_a", "passed"), *canary_records(), FINISH0]


@pytest.mark.parametrize(
    ("case", "why"),
    [
        (evidence(0, *HONEST), None),
        (evidence(137, *HONEST), "killed (SIGKILL"),
        (evidence(-9, *HONEST), "killed (SIGKILL"),
        (evidence(0, START, rec("t/test_x.py::test_a", "passed")), "never finished"),
        (evidence(0, error="report line 3 is not JSON"), "rewritten"),
        (evidence(0, START, rec("t/test_x.py::test_a", "failed"), *canary_records(), FINISH0), "status 0"),
        (
            evidence(0, START, rec("t/test_x.py::test_a", "passed"), *canary_records(ok=False), FINISH0),
            "wrongly",
        ),
        (evidence(0, START, rec("t/test_x.py::test_a", "passed"), FINISH0), canary.DID_NOT_RUN),
        (evidence(1, START, rec("t/test_x.py::test_a", "failed"), FINISH1), None),  # -x stopped before them
        (evidence(4, START, FINISH0), None),  # nothing ran: zero tests, not tampering
        (
            evidence(0, START, rec("t/test_x.py::test_a", "passed", xfail=True), *canary_records(), FINISH0),
            None,
        ),
    ],
)
def test_tampering(case: Evidence, why: str | None) -> None:
    found = tampering(case)
    assert (found is None) == (why is None) and (why is None or why in str(found)), found


def with_canaries(*records: dict, status: int = 0) -> list[dict]:
    return [START, *records, *canary_records(), {"event": "finish", "exitstatus": status}]


@pytest.mark.parametrize(
    ("case", "kwargs", "kind"),
    [
        (evidence(0, *with_canaries(rec("tests/test_x.py::a", "passed"))), {}, None),
        (evidence(1, *with_canaries(rec("tests/test_x.py::a", "failed"), status=1)), {}, "tests_failed"),
        (evidence(0, *with_canaries(rec("tests/test_x.py::a", "failed"), status=1)), {}, "report_mismatch"),
        (
            evidence(
                0, *with_canaries(rec("tests/test_x.py::a", "passed"), rec("tests/test_x.py::b", "skipped"))
            ),
            {},
            "tests_failed",
        ),
        (
            evidence(0, *with_canaries(rec("tests/test_x.py::a", "skipped", xfail=True))),
            {},
            "tests_failed",
        ),
        (evidence(0, *with_canaries(rec("tests/test_x.py::a", "skipped"))), {}, "tests_failed"),
        (evidence(5, *with_canaries(status=5)), {}, "tests_failed"),
        (evidence(0, *with_canaries()), {}, "no_tests"),
        (evidence(0, *with_canaries(rec("tests/test_x.py::a", "passed", xfail=True))), {}, "tests_failed"),
        (evidence(0), {"runner_expected": True}, "tampered"),  # pytest ran, nothing reported
        (evidence(2), {"runner_expected": True}, "tests_failed"),
        (evidence(0), {}, None),  # a command the grader cannot watch: its exit status
        (evidence(137), {}, "tampered"),
        (evidence(0, START, rec("tests/test_x.py::a", "passed")), {}, "tampered"),
    ],
)
def test_command_outcome(case: Evidence, kwargs: dict, kind: str | None) -> None:
    args = {"runner_expected": False, "unittest_output": False} | kwargs
    outcome = command_outcome(case, "", **args)
    assert outcome.failure_kind == kind and outcome.solved == (kind is None), outcome
    assert all(not canary.is_canary(t.name, CAN) for t in outcome.tests)


@pytest.mark.parametrize(
    ("output", "kind"),
    [
        ("...\nRan 3 tests in 0.001s\n\nOK\n", None),
        ("", "report_mismatch"),
        ("Ran 0 tests in 0.000s\n\nOK\n", "no_tests"),
        ("Ran 3 tests in 0.001s\n\nFAILED (failures=1)\n", "report_mismatch"),
        ("Ran 3 tests in 0.001s\n\nOK (skipped=3)\n", "tests_failed"),
        ("Ran 3 tests in 0.001s\n\nOK (skipped=1)\n", "tests_failed"),
        ("Ran 3 tests in 0.001s\n\nOK (expected failures=1)\n", "tests_failed"),
    ],
)
def test_a_unittest_run_the_grader_cannot_watch_needs_a_bare_ok(output: str, kind: str | None) -> None:
    outcome = command_outcome(Evidence(0, (), CAN), output, runner_expected=False, unittest_output=True)
    assert outcome.failure_kind == kind


def test_tests_from_files_the_row_does_not_run_are_flagged() -> None:
    files = ["tests/test_x.py", "tests/test_y.py"]
    assert unexpected({"tests/test_x.py::a": "PASSED", "tests/test_y.py::C::b[1]": "PASSED"}, files) == ()
    assert unexpected({"tests/test_x.py::a": "PASSED", "src/test_z.py::a": "PASSED"}, files) == (
        "unexpected_tests",
    )
    assert unexpected({"tests.test_x.Case.test_a": "PASSED"}, files) == ()
    assert unexpected({"evil.Case.test_a": "PASSED"}, files) == ("unexpected_tests",)
    assert unexpected({"anything::a": "PASSED"}, []) == ()  # the row names no files: nothing to compare


REQUIRED = ["tests/test_x.py::a", "tests/test_x.py::b"]


@pytest.mark.parametrize(
    ("parsed", "records", "kind"),
    [
        ({"tests/test_x.py::a": "PASSED", "tests/test_x.py::b": "PASSED"}, ["passed", "passed"], None),
        (
            {"tests/test_x.py::a": "PASSED", "tests/test_x.py::b": "PASSED"},
            ["passed", "failed"],
            "report_mismatch",
        ),
        (
            {"tests/test_x.py::a": "PASSED", "tests/test_x.py::b": "PASSED"},
            ["passed", "skipped"],
            "report_mismatch",
        ),
        ({"tests/test_x.py::a": "PASSED"}, ["passed"], "tests_failed"),  # b missing
        (
            {"tests/test_x.py::a": "PASSED", "tests/test_x.py::b": "SKIPPED"},
            ["passed", "skipped"],
            "tests_failed",
        ),
        (
            {"tests/test_x.py::a": "PASSED", "tests/test_x.py::b": "XFAIL"},
            ["passed", "passed"],
            "tests_failed",
        ),
        ({}, [], "no_tests"),
    ],
)
def test_swepro_needs_the_log_and_the_report_to_agree(
    parsed: dict, records: list[str], kind: str | None
) -> None:
    reported = [TestResult(n, s) for n, s in parsed.items()]
    tests = [rec(n, o) for n, o in zip(REQUIRED, records, strict=False)]
    outcome = swepro_outcome(
        reported,
        REQUIRED,
        evidence=evidence(1, *with_canaries(*tests, status=int("failed" in records))),
        selected_files=["tests/test_x.py"],
    )
    assert outcome.failure_kind == kind, outcome


def test_swepro_with_a_log_but_no_report_is_tampered() -> None:
    reported = [TestResult(n, "PASSED") for n in REQUIRED]
    assert swepro_outcome(reported, REQUIRED, evidence=evidence(0)).failure_kind == "tampered"
    killed = evidence(137, START, rec(REQUIRED[0], "passed"))
    assert swepro_outcome(reported, REQUIRED, evidence=killed).failure_kind == "tampered"


# -- the shipped plugin and runner, for real -----------------------------------------------------------------

INTERPRETERS = [sys.executable] + [p for p in ["/usr/bin/python3"] if Path(p).exists()]


def run_plugin(
    tmp_path: Path, python: str, args: list[str], tests: dict[str, str], raw: list[str] | None = None
) -> tuple[int, list]:
    """A run of ``tests`` (path -> source) with the grader's plugin (or runner), its channel and canaries (in
    ``tests/``, in memory); ``raw`` gets the report's text."""
    plugins, repo = tmp_path / "plugins", tmp_path / "repo"
    plugins.mkdir(parents=True)
    for name, source in PLUGIN_SOURCES.items():
        shutil.copyfile(GRADING / source, plugins / name)
    for rel, source in tests.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(source)
    (repo / "tests").mkdir(exist_ok=True)
    channel = Channel(channel_config(str(repo), CAN, ["tests"]))
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(plugins),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTEST_ADDOPTS": "-p rollbus_report",
        **channel.env,
    }
    argv = [python, "-m", "pytest", "-p", "no:cacheprovider", *args]
    if args and args[0] == "unittest":
        argv = [python, str(plugins / "rollbus_unittest.py"), *args[1:]]
    try:
        done = subprocess.run(
            argv, cwd=repo, env=env, capture_output=True, text=True, check=False, timeout=120,
            pass_fds=channel.fds,
        )  # fmt: skip
        text = channel.collect()
    finally:
        channel.close()
    if raw is not None:
        raw.append(text)
    return done.returncode, report.parse(text)


PASSING = {"tests/test_x.py": "def test_a():\n    assert 1 + 1 == 2\n\n\ndef test_b():\n    assert True\n"}


@pytest.mark.parametrize("python", INTERPRETERS)
@pytest.mark.parametrize("extra", [[], ["-x"], ["-k", "test_a"], ["-q", "-rA"]])
def test_the_plugin_reports_and_canaries_leave_pytests_answer_alone(
    tmp_path: Path, python: str, extra: list[str]
) -> None:
    code, test_runs = run_plugin(tmp_path, python, [*extra, "tests/test_x.py"], PASSING)
    assert code == 0  # the failing canaries do not fail the run, -x does not stop at them
    (test_run,) = test_runs
    assert test_run.finished and test_run.exitstatus == 0
    assert canary.check(test_run.tests, CAN) is None  # and -k did not deselect them
    own = {n: s for n, s in test_run.tests.items() if not canary.is_canary(n, CAN)}
    assert own == (
        {"tests/test_x.py::test_a": "PASSED"}
        if "-k" in extra
        else dict.fromkeys(["tests/test_x.py::test_a", "tests/test_x.py::test_b"], "PASSED")
    )


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_plugin_keeps_no_tests_and_failures_as_pytest_says(tmp_path: Path, python: str) -> None:
    code, (test_run,) = run_plugin(
        tmp_path / "a", python, ["tests/test_none.py"], {"tests/test_none.py": "X = 1\n"}
    )
    assert code == 5 and test_run.exitstatus == 5  # canaries ran, yet "no tests collected"
    failing = {"tests/test_x.py": "def test_a():\n    assert 1 == 2\n"}
    code, (test_run,) = run_plugin(tmp_path / "b", python, ["tests/test_x.py"], failing)
    assert code == 1 and test_run.tests["tests/test_x.py::test_a"] == "FAILED"


FIXTURES = {
    "pkg/__init__.py": "",
    "pkg/helpers.py": "import pytest\n\n\n@pytest.fixture(autouse=True)\ndef ready():\n    return 1\n",
    "tests/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef honest():\n    return 2\n",
    "tests/test_x.py": "from pkg.helpers import ready\n\n\ndef test_a(honest):\n    assert honest == 2\n",
}


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_plugin_names_fixtures_set_up_from_outside_test_files(tmp_path: Path, python: str) -> None:
    """Through pytest's public ``pytest_fixture_setup``: the imported autouse fixture is named with its file;
    the conftest's fixture and pytest's own are not."""
    raw: list[str] = []
    code, _ = run_plugin(tmp_path, python, ["tests/test_x.py"], FIXTURES, raw)
    assert code == 0
    fixtures = [e for e in report.audit(raw[0]) if e.kind == "fixture"]
    assert [(Path(e.actor).relative_to(tmp_path / "repo").as_posix(), e.detail) for e in fixtures] == [
        ("pkg/helpers.py", "fixture ready")
    ]


@pytest.mark.parametrize("python", INTERPRETERS)
def test_a_run_left_through_os_exit_never_finishes(tmp_path: Path, python: str) -> None:
    leaving = {"tests/test_x.py": "import os\n\n\ndef test_a():\n    os._exit(0)\n"}
    code, (test_run,) = run_plugin(tmp_path, python, ["tests/test_x.py"], leaving)
    assert code == 0 and not test_run.finished


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_unittest_runner_is_python_m_unittest_plus_canaries(tmp_path: Path, python: str) -> None:
    tests = {
        "tests/__init__.py": "",
        "tests/test_u.py": "import unittest\n\n\nclass T(unittest.TestCase):\n"
        "    def test_ok(self):\n        self.assertEqual(2, 2)\n\n"
        "    def test_skip(self):\n        raise unittest.SkipTest('later')\n",
        "unittest/__init__.py": "raise SystemExit(0)\n",  # a shadow the runner must not pick up
    }
    code, (test_run,) = run_plugin(tmp_path, python, ["unittest", "-v", "tests.test_u"], tests)
    assert code == 0 and test_run.finished and test_run.exitstatus == 0
    assert canary.check(test_run.tests, CAN) is None
    own = {n: s for n, s in test_run.tests.items() if not canary.is_canary(n, CAN)}
    assert own == {"tests.test_u.T.test_ok": "PASSED", "tests.test_u.T.test_skip": "SKIPPED"}
