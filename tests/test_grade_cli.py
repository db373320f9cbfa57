"""``rollbus grade ROW PATCH [--json]``: the service's grade, printed for a user debugging a 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollbus.cli import main
from tests.test_grading_swe_mini import CHEATS, SWE_MINI, load_build

DATASET = SWE_MINI / "tasks.jsonl"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def write_patch(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fix.patch"
    path.write_text(text)
    return path


def test_json_output_of_a_fix(
    rows: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    patch = write_patch(tmp_path, rows["semver"]["label"])
    assert main(["grade", str(DATASET), str(patch), "--instance-id", "swe-mini__semver", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"reward", "solved", "applied_cleanly", "failure_kind", "flags", "tests"} <= set(result)
    assert (result["reward"], result["solved"], result["failure_kind"]) == (1.0, True, None)
    assert {"name": "tests/test_compare.py::test_numeric_parts", "status": "PASSED"} in result["tests"]


def test_table_output_of_a_cheat_says_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    row = (
        tmp_path / "row.jsonl"
    )  # a one-row file elsewhere: relative paths still resolve (made absolute here)
    line = next(x for x in DATASET.read_text().splitlines() if "swe-mini__lru" in x)
    data = json.loads(line)
    data["metadata"]["image"] = str(SWE_MINI / data["metadata"]["image"])
    for key in ("run_script_path", "parser_script_path"):
        data["metadata"]["swepro"][key] = str(SWE_MINI / data["metadata"]["swepro"][key])
    row.write_text(json.dumps(data) + "\n")
    assert main(["grade", str(row), str(CHEATS / "conftest_passes_everything.patch")]) == 1
    out = capsys.readouterr().out
    assert "failure_kind     tampered" in out and "touches_conftest" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/nonexistent/row.jsonl", "x.patch"], "No such file"),
        ([str(DATASET), str(DATASET), "--instance-id", "nope"], "no row with instance_id 'nope'"),
    ],
)
def test_unusable_input_exits_2(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["grade", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "grade", str(DATASET), str(DATASET), "--max-patch-bytes", "0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--max-patch-bytes='0'" in done.stderr and "Traceback" not in done.stderr
