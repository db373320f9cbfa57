"""Forged verdicts (issue 21, families 2 to 6), graded for real in bwrap sandboxes against swe-mini rows.

Each patch in ``tests/cheats/verdict/`` is what a policy under RL would write to be scored solved without
fixing the bug, on every grader kind: pytest's reports forged through ``sys.modules`` (swepro, eval_cmd,
f2p_script), unittest's result and ``assertEqual`` rebound through an alias, a fake summary on the real
stdout followed by SIGKILL, skips where the bug shows, ``AssertionError`` rebound to a ``SkipTest``, a
unittest run that skips everything, always-equal results and an oracle reading the calling test's line. All
scored 1.0 before (``before`` in ``corpus.json``); each must score 0 with the failure kind and flags named.
Then the structural checks one by one: a process that dies by a signal, a report the code under test
rewrites, canaries that never ran, and the grade's fresh canary names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import GradeConfig, GradingSpec, grade, parse_row
from tests.test_grading_swe_mini import SWE_MINI, load_build

VERDICT = Path(__file__).resolve().parent / "cheats" / "verdict"
CORPUS = json.loads((VERDICT / "corpus.json").read_text())


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def spec_of(rows: dict[str, dict[str, Any]], task: str) -> GradingSpec:
    return parse_row(rows[task], SWE_MINI)


def append_to(label: str, path: str, lines: list[str], context: str) -> str:
    """A patch adding ``lines`` after the line ``context`` (which must be the file's last) of ``path``."""
    body = "".join(f"+{line}\n" for line in lines)
    return label + f"--- a/{path}\n+++ b/{path}\n@@ -1 +1,{1 + len(lines)} @@\n {context}\n{body}"


def test_the_corpus_covers_every_family_and_grader_kind(rows: dict[str, dict[str, Any]]) -> None:
    kinds = {type(spec_of(rows, c["task"]).grader).__name__ for c in CORPUS}
    assert kinds == {"Swepro", "EvalCmd", "F2PScript"}
    assert any(c["task"] == "sum-to" for c in CORPUS)  # unittest
    assert {c["failure_kind"] for c in CORPUS} == {"tampered", "tests_failed", "flagged"}
    assert all(c["before"] == 1.0 for c in CORPUS)


@pytest.mark.parametrize("cheat", CORPUS, ids=[c["name"] for c in CORPUS])
async def test_forged_verdict_scores_zero(rows: dict[str, dict[str, Any]], cheat: dict[str, Any]) -> None:
    """On bwrap; the same corpus through the container backend: test_cheats_docker."""
    patch = (VERDICT / f"{cheat['name']}.patch").read_text()
    result = await grade(spec_of(rows, cheat["task"]), patch)
    assert result.reward == 0.0 and not result.solved, result
    assert set(cheat["flags"]) <= set(result.flags), result
    assert result.failure_kind == cheat["failure_kind"], result


async def test_the_verdict_alone_catches_forgery_when_flags_do_not_zero(
    rows: dict[str, dict[str, Any]],
) -> None:
    """With flags reported but not zeroing, the forged runs still score 0: the canaries, not the scan."""
    for name, task in [("forge_reports_via_sys_modules", "lru"), ("unittest_assertequal_alias", "sum-to")]:
        patch = (VERDICT / f"{name}.patch").read_text()
        result = await grade(spec_of(rows, task), patch, GradeConfig(zero_flagged=False))
        assert (result.reward, result.failure_kind) == (0.0, "tampered"), result
        assert "canaries reported wrongly" in result.details["note"]


async def test_a_required_test_forged_in_the_log_is_not_a_pass(rows: dict[str, dict[str, Any]]) -> None:
    """swepro: the fake summary's PASSED lines, with the real run left to finish, lose to pytest's report."""
    patch = (VERDICT / "fake_summary_then_sigkill.patch").read_text()
    patch = patch.replace("+getattr(_os, 'ki' + 'll')(_os.getpid(), 9)\n", "").replace("+1,20 @@", "+1,19 @@")
    result = await grade(spec_of(rows, "lru"), patch)
    assert result.reward == 0.0 and result.failure_kind in ("tests_failed", "report_mismatch"), result
    status = {t.name: t.status for t in result.tests}
    assert status["tests/test_lru.py::test_get_refreshes_recency"] == "FAILED"


async def test_a_run_that_exits_from_inside_a_test_is_tampered(rows: dict[str, dict[str, Any]]) -> None:
    """f2p: the honest fix plus an ``os._exit(0)`` reached only while the tests run (not at import)."""
    label = rows["roman"]["label"]
    patch = append_to(
        label,
        "numerals/__init__.py",
        ["import os as _o", "def to_roman(n):", "    _o._exit(0)"],
        "from numerals.roman import to_roman",
    )
    result = await grade(spec_of(rows, "roman"), patch)
    assert (result.reward, result.failure_kind) == (0.0, "tampered"), result
    assert "never finished" in result.details["note"]


async def test_a_report_rewritten_by_the_code_under_test_is_tampered(rows: dict[str, dict[str, Any]]) -> None:
    """eval_cmd: the honest fix plus a write of garbage into every pipe and socket the process holds (the
    grader's report channel among them: its path is nowhere to read, its descriptor is the process's own)."""
    label = rows["slugify"]["label"]
    patch = append_to(
        label,
        "textkit/__init__.py",
        [
            "import os as _o",
            "for _fd in _o.listdir('/proc/self/fd'):",
            "    try:",
            "        if _o.readlink(f'/proc/self/fd/{_fd}').startswith(('pipe:', 'socket:')):",
            "            _o.write(int(_fd), b'{}\\n')",
            "    except OSError:",
            "        pass",
        ],
        "from textkit.slug import slugify",
    )
    result = await grade(spec_of(rows, "slugify"), patch)
    assert (result.reward, result.failure_kind) == (0.0, "tampered"), result
    assert "rewritten" in result.details["note"]


async def test_tests_from_nowhere_are_flagged(rows: dict[str, dict[str, Any]]) -> None:
    """eval_cmd names its test files; a test collected from anywhere else raises a flag (here the command
    also runs a package directory, where a patch can plant a test module)."""
    row = json.loads(json.dumps(rows["binsearch"]))
    row["metadata"]["eval_cmd"] += " finder"
    spec = parse_row(row, SWE_MINI)
    label = rows["binsearch"]["label"]
    assert (await grade(spec, label)).reward == 1.0  # nothing planted: no flag
    planted = label + (
        "--- /dev/null\n+++ b/finder/test_extra.py\n@@ -0,0 +1,2 @@\n+def test_made_up():\n+    pass\n"
    )
    result = await grade(spec, planted)
    assert result.reward == 0.0 and "unexpected_tests" in result.flags, result


async def test_canaries_are_fresh_per_grade_and_never_in_the_results(rows: dict[str, dict[str, Any]]) -> None:
    spec = spec_of(rows, "lru")
    first, second = await grade(spec, rows["lru"]["label"]), await grade(spec, rows["lru"]["label"])
    assert first.reward == second.reward == 1.0
    names = [{t.name for t in r.tests} for r in (first, second)]
    assert (
        names[0]
        == names[1]
        == {
            "tests/test_lru.py::test_get_refreshes_recency",
            "tests/test_lru.py::test_get_refreshes_any_key",
            "tests/test_lru.py::test_put_get",
            "tests/test_lru.py::test_evicts_oldest",
        }
    )
    logs = [r.details["log"] for r in (first, second)]
    canaries = [{w for w in log.split() if w.startswith("tests/test_") and "lru" not in w} for log in logs]
    assert canaries[0] and canaries[1] and not canaries[0] & canaries[1]


async def test_a_swepro_row_without_pytest_is_judged_by_its_parser(
    rows: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """A run script that runs no pytest (a Go or JavaScript row) reports to no plugin: its log, read by the
    row's parser, is the verdict, not a missing report taken for tampering."""
    row = json.loads(json.dumps(rows["lru"]))
    script = tmp_path / "run_script.sh"
    names = row["metadata"]["swepro"]["fail_to_pass"] + row["metadata"]["swepro"]["pass_to_pass"]
    summary = "".join(f"PASSED {n}\\n" for n in names)
    script.write_text(f"printf '== short test summary info ==\\n{summary}== 3 passed ==\\n'\n")
    row["metadata"]["swepro"]["run_script_path"] = str(script)
    row["metadata"]["swepro"]["parser_script_path"] = str(SWE_MINI / "swepro" / "parser.py")
    result = await grade(parse_row(row, SWE_MINI), "")
    assert (result.reward, result.failure_kind) == (1.0, None), result
