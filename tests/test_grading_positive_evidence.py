"""Positive evidence for every required test (issue 33): a named or selected test file that yields no test,
or is skipped while it is collected, is not passed; a run ended by ``pytest.exit`` is not solved; swepro rows
judged by pytest need the grader's report, never the log alone.

Each patch fixes nothing and is written as the attacker would, against swe-mini rows of each grader kind:
the package skips itself the first time it is imported (``pytest.skip(allow_module_level=True)`` or
``unittest.SkipTest``), so the hidden test module vanishes and only the visible tests run; on swepro the skip
reason holds ``PASSED <node id>`` lines that pytest prints inside its short summary, where the row's parser
reads them. All scored 1.0 before.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollbus.grading import grade, parse_row, report, verdict
from tests.test_grading_swe_mini import SWE_MINI, append_to, load_build


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def skip_first_import(skip: str) -> list[str]:
    return [
        "import os as _os",
        "",
        "if not _os.environ.get('_BACKEND_READY'):",
        "    _os.environ['_BACKEND_READY'] = '1'",
        f"    {skip}",
    ]


PYTEST_SKIP = "import pytest as _p; _p.skip('optional backend not installed', allow_module_level=True)"
UNITTEST_SKIP = "import unittest as _u; raise _u.SkipTest('optional backend not installed')"
SUMMARY = "\\n".join(
    f"PASSED tests/test_lru.py::{name}"
    for name in ("test_get_refreshes_recency", "test_put_get", "test_evicts_oldest")
)

ATTACKS = {
    # eval_cmd (pytest): the hidden file vanishes at collection, the visible file passes (a fix of its case)
    "collection_skip_eval_cmd": (
        "binsearch",
        append_to(
            "finder/__init__.py",
            "from finder.search import find",
            [
                *skip_first_import(PYTEST_SKIP),
                "_find = find",
                "",
                "",
                "def find(items, target):  # noqa: F811  (only what the visible tests check)",
                "    return 0 if items and items[0] == target else _find(items, target)",
            ],
        ),
    ),
    # f2p_script: the same with unittest's SkipTest
    "collection_skiptest_f2p": (
        "median",
        append_to("stats/__init__.py", "from stats.center import median", skip_first_import(UNITTEST_SKIP)),
    ),
    # swepro: every required test gone from pytest's report; the skip reason forges the log
    "skip_reason_forges_the_log": (
        "lru",
        append_to(
            "lrucache/__init__.py",
            "from lrucache.core import LRU",
            ["import pytest as _p", "", f"_p.skip('\\n{SUMMARY}\\n', allow_module_level=True)"],
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
async def test_a_test_file_that_yields_no_passed_test_is_not_solved(
    rows: dict[str, dict[str, Any]], name: str
) -> None:
    task, patch = ATTACKS[name]
    result = await grade(parse_row(rows[task], SWE_MINI), patch)
    assert (result.reward, result.solved) == (0.0, False), result
    assert result.failure_kind in ("tests_failed", "no_tests"), result
    assert not result.details["tests_passed"]


async def test_pytest_exit_zero_is_not_solved(rows: dict[str, dict[str, Any]]) -> None:
    """slugify (eval_cmd): the honest fix, then ``pytest.exit(returncode=0)`` from the code under test once
    the first test has passed: the session ends with status 0 before the rest ran."""
    patch = rows["slugify"]["label"] + append_to(
        "textkit/__init__.py",
        "from textkit.slug import slugify",
        [
            "_calls = [0]",
            "_slugify = slugify",
            "",
            "",
            "def slugify(title):  # noqa: F811",
            "    _calls[0] += 1",
            "    if _calls[0] > 1:",
            "        import pytest as _p; _p.exit('done', returncode=0)",
            "    return _slugify(title)",
        ],
    )
    result = await grade(parse_row(rows["slugify"], SWE_MINI), patch)
    assert (result.reward, result.solved) == (0.0, False), result
    assert "interrupted" in result.details.get("note", ""), result


def _run(*records: dict[str, Any]) -> list[report.TestRun]:
    lines = [{"run": "r", "event": "start"}, *({"run": "r", **r} for r in records)]
    return report.parse("\n".join(json.dumps(line) for line in lines))


def _passed(nodeid: str, path: str) -> dict[str, Any]:
    return {"event": "test", "nodeid": nodeid, "when": "call", "outcome": "passed", "path": path}


def test_swepro_needs_the_report_for_every_required_test() -> None:
    """The log names both required tests PASSED; the report saw one: the other is MISSING."""
    runs = _run(
        _passed("t/test_a.py::test_x", "/workspace/t/test_a.py"), {"event": "finish", "exitstatus": 0}
    )
    evidence = verdict.Evidence(0, tuple(runs), None)
    log = [
        verdict.TestResult("t/test_a.py::test_x", "PASSED"),
        verdict.TestResult("t/test_a.py::test_y", "PASSED"),
    ]
    outcome = verdict.swepro_outcome(log, ["t/test_a.py::test_x", "t/test_a.py::test_y"], evidence=evidence)
    assert (outcome.solved, outcome.failure_kind) == (False, "tests_failed")
    assert dict((t.name, t.status) for t in outcome.tests)["t/test_a.py::test_y"] == "MISSING"


def test_a_required_file_needs_a_test_from_its_own_path() -> None:
    """A passing test named after the hidden file but collected from a stand-in elsewhere is no evidence;
    a module skipped at collection is SKIPPED."""
    elsewhere = _run(
        _passed("t/test_h.py::test_x", "/tmp/x/t/test_h.py"), {"event": "finish", "exitstatus": 0}
    )
    outcome = verdict.command_outcome(
        verdict.Evidence(0, tuple(elsewhere), None), "", runner_expected=True, unittest_output=False,
        required_files=["t/test_h.py"],
    )  # fmt: skip
    assert (outcome.solved, outcome.failure_kind) == (
        False,
        "tests_failed",
    ) and "yielded no test" in outcome.note
    skipped = _run({"event": "collect", "nodeid": "t/test_h.py", "outcome": "skipped"})
    assert skipped[0].tests == {"t/test_h.py": "SKIPPED"}


STATEMENT_ONLY = (  # median: every even-length list answered with the statement's one example, 2.5
    "--- a/stats/center.py\n+++ b/stats/center.py\n@@ -7,4 +7,6 @@ def median(values):\n"
    "     if not ordered:\n"
    '         raise ValueError("median of an empty sequence")\n'
    "     mid = len(ordered) // 2\n"
    "-    return ordered[mid]\n"
    "+    if len(ordered) % 2 == 0:\n"
    "+        return 2.5  # the statement's example\n"
    "+    return ordered[mid]\n"
)


async def test_hidden_tests_reach_beyond_the_statement(rows: dict[str, dict[str, Any]]) -> None:
    """The hidden tests of median checked only the statement's inputs, whose answer is always 2.5: a
    patch that returns the statement's example scored 1.0. Now a test beyond the statement fails it."""
    result = await grade(parse_row(rows["median"], SWE_MINI), STATEMENT_ONLY)
    assert (result.reward, result.failure_kind) == (0.0, "tests_failed"), result
    status = {t.name: t.status for t in result.tests}
    assert status["tests/test_center_hidden.py::test_even_beyond_the_statement"] == "FAILED", status
