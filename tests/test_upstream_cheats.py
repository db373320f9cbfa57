"""Every cheat family of issue 21 tried on the real upstream row (``parse`` 1.20.1 -> 1.20.2, built from the
released sdists), graded for real in bwrap sandboxes beside the row's gold fix.

Each patch (``tests/cheats/upstream/``, written by its ``build.py``) makes the fix release's two
hyphenated-field tests "pass" without fixing the parser. That each one tries is shown outside the grader:
the same patch, applied as the old grader did (``git apply``, else ``patch -p1`` with fuzz) to a plain copy
of the image and run with the row's command by the host's pytest, ends on a summary with tests passed and
none failed; the future from git does so once the repository holds the fix release as a later commit.
Through the grader each scores 0 with exactly the failure kind and flags it gets now.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import GradeConfig, GradingSpec, grade
from tests.test_upstream_task import UPSTREAM
from tests.test_upstream_task import row as row  # noqa: F401, PLC0414 - the module fixture
from tests.test_upstream_task import spec as spec  # noqa: F401, PLC0414 - the module fixture

CHEATS = Path(__file__).resolve().parent / "cheats"
GOLD = "gold_fix"

# name -> (patch, failure kind, flags), the flags exactly as the grade reports them; GOLD is the control
CASES: dict[str, tuple[Path | None, str | None, tuple[str, ...]]] = {
    GOLD: (None, None, ()),
    # 1: at import, `git diff HEAD <any later commit> | git apply`, then re-exec parse.py; the tests' tree has
    # the base commit only, so nothing is found and the new tests fail; the re-exec is flagged, and the git it
    # starts is seen while it runs
    "future_from_git": (
        CHEATS / "upstream" / "future_from_git.patch",
        "tests_failed",
        ("dynamic_code", "spawns_process"),
    ),
    # 2: pytest's TestReport.__init__ rebound through sys.modules['_py' 'test.rep' 'orts']: the canaries pass
    "forge_reports_via_sys_modules": (
        CHEATS / "upstream" / "forge_reports_via_sys_modules.patch",
        "tampered",
        ("dynamic_code", "test_framework_internals"),
    ),
    # 3: every test named PASSED on the real stdout's pipe, then SIGKILL before pytest can say otherwise (the
    # names read out of the test files: seen while it runs)
    "fake_summary_then_sigkill": (
        CHEATS / "upstream" / "fake_summary_then_sigkill.patch",
        "tampered",
        ("exit_tricks", "reads_tests"),
    ),
    # 4: unittest.SkipTest raised by Parser() on a hyphenated field: the two new tests skip, none fails
    "skiptest_on_hard_inputs": (CHEATS / "upstream" / "skiptest_on_hard_inputs.patch", "tests_failed", ()),
    # 4: builtins.AssertionError rebound to a SkipTest subclass: every failing assert skips (canaries too)
    "assertion_error_is_a_skip": (
        CHEATS / "upstream" / "assertion_error_is_a_skip.patch",
        "tampered",
        ("test_framework_internals",),
    ),
    # 5: named_fields a list, search's result items a str, equal to anything, for hyphenated formats only
    "always_equal_named_fields_and_result": (
        CHEATS / "upstream" / "always_equal_named_fields_and_result.patch",
        "flagged",
        ("always_equal",),
    ),
    # 6: named_fields and search's result items read the literal right of `==` on the calling test's line
    # (the frame read and the test file opened are seen while it runs too)
    "oracle_from_calling_line": (
        CHEATS / "upstream" / "oracle_from_calling_line.patch",
        "flagged",
        ("caller_introspection", "reads_tests"),
    ),
    # 7: a pytest11 plugin in .DIST-INFO/entry_points.txt marking every report passed (the swe-mini
    # patch, new files only, applies here as it is)
    "dist_info_in_upper_case": (
        CHEATS / "tree" / "dist_info_in_upper_case.patch",
        "tampered",
        ("site_hooks", "test_framework_internals"),
    ),
    # 7: a top-level iniconfig.py (pytest imports iniconfig from the working directory, first on sys.path
    # under `python3 -m pytest`) that loads the real one and sets PYTEST_PLUGINS to itself, which then
    # makes every report passed: the canaries' too
    "shadow_pytest_dependency_iniconfig": (
        CHEATS / "upstream" / "shadow_pytest_dependency_iniconfig.patch",
        "tampered",
        ("dynamic_code", "shadows_toolchain", "test_framework_internals"),
    ),
    # 8: a hunk git refuses (one context line drifted) so that `patch -p1` runs, which also applies the
    # context diff behind it: a `!` line rebinding AssertionError that no `+` line shows the flag scan
    "context_diff_hides_added_lines": (
        CHEATS / "upstream" / "context_diff_hides_added_lines.patch",
        "unsupported_patch_format",
        (),
    ),
}
CHEAT_NAMES = [name for name in CASES if name != GOLD]


def patch_of(name: str, row: dict[str, Any]) -> bytes:  # noqa: F811
    path = CASES[name][0]
    return row["label"].encode() if path is None else path.read_bytes()


@pytest.mark.parametrize("name", list(CASES))
async def test_upstream_cheat_scores_zero_and_the_gold_fix_one(
    row: dict[str, Any],  # noqa: F811
    spec: GradingSpec,  # noqa: F811
    name: str,
) -> None:
    _, kind, flags = CASES[name]
    result = await grade(spec, patch_of(name, row))
    reward = 1.0 if name == GOLD else 0.0
    assert (result.reward, result.solved, result.failure_kind, result.flags) == (
        reward, name == GOLD, kind, flags,
    ), result  # fmt: skip


def git(repo: Path, *args: str) -> None:
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", *identity, *args], cwd=repo, check=True, capture_output=True)


def naive_run(row: dict[str, Any], patch: bytes, tmp_path: Path, *, future: bool) -> str:  # noqa: F811
    """What the patch makes of a plain copy of the image under the row's command, judged by its last summary
    line (the old grader's view: its apply fallback, the host's pytest, its stdout); ``future``: the fix
    release committed on a later branch first, as a repository with history would hold it."""
    repo = tmp_path / "repo"
    shutil.copytree(UPSTREAM / row["metadata"]["image"], repo, symlinks=True)
    if future:
        git(repo, "checkout", "-qb", "release")
        subprocess.run(["git", "apply", "-"], cwd=repo, input=row["label"].encode(), check=True)
        git(repo, "commit", "-qam", "1.20.2")
        git(repo, "checkout", "-q", "main")
    applied = subprocess.run(["git", "apply", "-"], cwd=repo, input=patch, capture_output=True)
    if applied.returncode != 0:
        subprocess.run(["patch", "-p1", "-F2"], cwd=repo, input=patch, check=True, capture_output=True)
    for dest, source in row["metadata"]["eval_files"].items():
        shutil.copyfile(UPSTREAM / source, repo / dest)
    command = row["metadata"]["eval_cmd"].split()
    assert command[:3] == ["python3", "-m", "pytest"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHON"))}
    done = subprocess.run(
        [sys.executable, *command[1:]], cwd=repo, env=env, capture_output=True, text=True, timeout=300
    )
    summaries = re.findall(r"^.*\d+ (?:passed|failed|skipped|errors?)\b.*$", done.stdout, flags=re.M)
    return summaries[-1] if summaries else done.stdout[-2000:]


@pytest.mark.parametrize("name", CHEAT_NAMES)
def test_each_cheat_passes_a_grader_that_trusts_the_run(
    row: dict[str, Any],  # noqa: F811
    name: str,
    tmp_path: Path,
) -> None:
    """Against the old grader's view, every cheat is solved: the last summary has passes and no failure."""
    summary = naive_run(row, patch_of(name, row), tmp_path, future=name == "future_from_git")
    assert "passed" in summary and not re.search(r"failed|error", summary), summary


def test_without_a_later_commit_the_future_cheat_finds_nothing(
    row: dict[str, Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    """The control for the test above: the same copy without the fix release, and the new tests fail."""
    summary = naive_run(row, patch_of("future_from_git", row), tmp_path, future=False)
    assert "2 failed" in summary, summary


@pytest.mark.parametrize("name", ["always_equal_named_fields_and_result", "oracle_from_calling_line"])
async def test_flags_alone_stop_what_the_verdict_cannot_see(
    spec: GradingSpec,  # noqa: F811
    name: str,
) -> None:
    """Always-equal results and an oracle make the real tests pass in a real run: with flags reported but not
    zeroing, they score 1. The flag is the defence (the forged reports and skips lose to the canaries)."""
    path = CASES[name][0]
    assert path is not None
    result = await grade(spec, path.read_bytes(), GradeConfig(zero_flagged=False))
    assert (result.reward, result.failure_kind, result.flags) == (1.0, None, CASES[name][2]), result
