"""The grader always answers (issue 33): whatever happens while grading is a verdict, never a crash.

A patch written as the attacker would: a changed file whose attribute chain is so deep that walking its syntax
tree exhausts the scanner's recursion (it crashed ``rollbus grade`` and dead-lettered the diff), and one
5000-term expression the scanner's parser gives up on while the package raises the real interpreter's
recursion limit (the scan used to return no findings for it, so the file was never judged). Both are
graded ``unscannable`` (zeroing); any other exception inside a grade is the verdict ``grader_error``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollbus.cli import main
from rollbus.grading import grade, parse_row, run, tamper
from tests.test_grading_swe_mini import SWE_MINI, load_build

DATASET = SWE_MINI / "tasks.jsonl"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def new_file(path: str, lines: list[str]) -> str:
    body = "".join(f"+{line}\n" for line in lines)
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n{body}"


DEEP_CHAIN = new_file("textkit/deep.py", ["import os", "x = os" + ".path" * 1500])
LONG_SUM = new_file(
    "textkit/long.py",
    ["import sys", "sys.setrecursionlimit(100000)", "TOTAL = " + " + ".join(["1"] * 5000)],
)


def test_what_the_scan_cannot_parse_or_walk_is_a_finding() -> None:
    for patch in (DEEP_CHAIN, LONG_SUM):
        source = "\n".join(line[1:] for line in patch.splitlines()[3:])
        assert ("unscannable", "the scan could not read this file") in tamper.findings(source)
    assert tamper.findings("def f(:\n") == [("unscannable", "the scan could not read this file")]


@pytest.mark.parametrize("extra", [DEEP_CHAIN, LONG_SUM], ids=["deep_attribute_chain", "long_expression"])
async def test_a_file_the_scan_cannot_read_scores_zero_flagged(
    rows: dict[str, dict[str, Any]], extra: str
) -> None:
    spec = parse_row(rows["slugify"], SWE_MINI)
    result = await grade(spec, rows["slugify"]["label"] + extra)
    assert (result.reward, result.failure_kind) == (0.0, "flagged"), result
    assert "unscannable" in result.flags and result.details["tests_passed"], result


async def test_any_exception_while_grading_is_the_verdict_grader_error(
    rows: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: object) -> set[str]:
        raise KeyError("the scanner broke")

    monkeypatch.setattr(run, "raise_flags", broken)
    result = await grade(parse_row(rows["slugify"], SWE_MINI), rows["slugify"]["label"])
    assert (result.reward, result.solved, result.failure_kind) == (0.0, False, "grader_error"), result
    assert "KeyError" in result.details["note"] and "the scanner broke" in result.details["note"]


def test_rollbus_grade_answers_for_the_deep_chain(
    rows: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    patch = tmp_path / "deep.patch"
    patch.write_text(rows["slugify"]["label"] + DEEP_CHAIN)
    code = main(["grade", str(DATASET), str(patch), "--instance-id", "swe-mini__slugify", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert (code, result["reward"], result["failure_kind"]) == (1, 0.0, "flagged")
    assert "unscannable" in result["flags"]
