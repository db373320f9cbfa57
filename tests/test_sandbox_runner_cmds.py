"""``rollbus sandbox run`` and ``rollbus submit`` as users run them (real bwrap sandboxes, no broker needed
for what is checked here), tried as the policy would: the agent's sandbox of a swepro row holds no trace of
the fix commit the grader restores tests from, nor any eval-only file."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SWE_MINI = ROOT / "examples" / "swe-mini"


def rollbus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbus", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def swe_mini() -> Path:
    built = subprocess.run([sys.executable, str(SWE_MINI / "build.py")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return SWE_MINI / "tasks.jsonl"


def line_of(dataset: Path, instance_id: str) -> tuple[int, dict]:
    for number, text in enumerate(dataset.read_text().splitlines(), start=1):
        row = json.loads(text)
        if row["metadata"]["instance_id"] == instance_id:
            return number, row
    raise AssertionError(instance_id)


def test_agent_sandbox_of_a_swepro_row_cannot_reach_the_fix(swe_mini: Path) -> None:
    number, row = line_of(swe_mini, "swe-mini__intervals")
    fix = re.findall(r"git checkout ([0-9a-f]{40}) --", row["metadata"]["swepro"]["before_repo_set_cmd"])[0]
    probe = (
        f"git log --all --oneline | wc -l; git cat-file -e {fix} && echo FIX-VISIBLE; "
        "git for-each-ref | wc -l; ls -a; ls / ; test -e /opt/claude-code/claude && echo CLI"
    )
    done = rollbus("sandbox", "run", str(swe_mini), "--line", str(number), "--role", "agent", "--",
                   "sh", "-c", probe)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0] == "1" and "FIX-VISIBLE" not in lines, done.stdout  # one commit, the fix unreachable
    assert "CLI" in lines and "hidden" not in lines and "swepro" not in lines and "tasks.jsonl" not in lines


def test_grader_sandbox_has_the_full_image_and_exit_status_passes_through(swe_mini: Path) -> None:
    number, _ = line_of(swe_mini, "swe-mini__intervals")
    probe = "git branch --list fix | wc -l; test -e /opt/claude-code/claude || echo NO-CLI; exit 3"
    done = rollbus("sandbox", "run", str(swe_mini), "--line", str(number), "--role", "grader", "--",
                   "sh", "-c", probe)  # fmt: skip
    assert done.returncode == 3 and done.stdout.split() == ["1", "NO-CLI"], (done.stdout, done.stderr)


def test_sandbox_run_refuses_a_bad_row_and_a_missing_command(tmp_path: Path) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text('{"prompt": "p", "metadata": {"workdir": "/workspace"}}\n')
    done = rollbus("sandbox", "run", str(dataset), "--", "true")
    assert done.returncode == 2 and f"{dataset}:1: no image" in done.stderr
    assert rollbus("sandbox", "run", str(dataset)).returncode == 2


def test_submit_reports_an_unreadable_dataset_and_a_bad_flag(tmp_path: Path) -> None:
    done = rollbus("submit", str(tmp_path / "missing.jsonl"))
    assert done.returncode == 2 and "cannot read" in done.stderr and "Traceback" not in done.stderr
    done = rollbus("submit", str(tmp_path / "missing.jsonl"), "--n-samples-per-prompt", "0")
    assert done.returncode == 2 and "--n-samples-per-prompt" in done.stderr and "Traceback" not in done.stderr
