"""The grader's tree, tried as a policy would: code under test looks for the future in git, patches smuggle
changes past the flags through other diff formats, upper-case metadata and modules that shadow the test
toolchain, and a legitimate Latin-1 edit must survive. Real bwrap sandboxes, the swe-mini images."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import GradingSpec, grade, parse_row
from rollbus.grading.rows import EvalCmd

ROOT = Path(__file__).resolve().parents[1]
SWE_MINI = ROOT / "examples" / "swe-mini"
TREE_CHEATS = Path(__file__).resolve().parent / "cheats" / "tree"

# name -> (task, flags the grade must carry, failure kind); each scored 1.0 unflagged before the fix
CHEATS = {
    "future_from_git": ("lru", [], "tests_failed"),  # git diff HEAD <later commit> | git apply, at import
    "context_diff_hides_added_lines": ("sum-to", [], "unsupported_patch_format"),  # `!` lines via patch -p1
    # a pytest11 plugin, X-1.0.DIST-INFO, that reports every test passed: the canaries' too
    "dist_info_in_upper_case": ("lru", ["site_hooks", "test_framework_internals"], "tampered"),
    "shadow_pytest_dependency_attr": ("lru", ["shadows_toolchain"], "flagged"),  # attr/, which pytest imports
}


def load_build() -> Any:
    spec = importlib.util.spec_from_file_location("swe_mini_build", SWE_MINI / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


@pytest.mark.parametrize("name", sorted(CHEATS))
async def test_tree_cheat_scores_zero(rows: dict[str, dict[str, Any]], name: str) -> None:
    task, flags, kind = CHEATS[name]
    result = await grade(parse_row(rows[task], SWE_MINI), (TREE_CHEATS / f"{name}.patch").read_bytes())
    assert (result.reward, result.solved, result.failure_kind) == (0.0, False, kind), result
    assert set(flags) <= set(result.flags), result


async def test_the_future_cheat_finds_no_later_commit(rows: dict[str, dict[str, Any]]) -> None:
    """The same module code, graded: the fix commit the image holds is nowhere in the tests' repository (the
    test fails; had the catch-up found the fix, it would pass). The scan names the re-exec of the source, the
    audit hook the git it starts."""
    result = await grade(
        parse_row(rows["lru"], SWE_MINI), (TREE_CHEATS / "future_from_git.patch").read_bytes()
    )
    statuses = {t.name.split("::")[-1]: t.status for t in result.tests}
    assert statuses["test_get_refreshes_recency"] == "FAILED"
    assert result.flags == ("dynamic_code", "spawns_process")  # the scan's re-exec, the git seen running


def future_patch(task: str, tmp_path: Path) -> bytes:
    """``future_from_git.py`` appended to the module the task's fix edits, as the agent's ``git diff``."""
    spec = json.loads((SWE_MINI / "tasks" / task / "task.json").read_text())
    repo = tmp_path / task
    subprocess.run(["cp", "-a", str(SWE_MINI / "tasks" / task / "repo"), str(repo)], check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=repo, check=True)
    module = repo / spec["fix_edit"]["path"]
    module.write_text(module.read_text() + "\n\n" + (TREE_CHEATS / "future_from_git.py").read_text())
    return subprocess.run([*git, "diff"], cwd=repo, check=True, capture_output=True).stdout


SWEPRO_TASKS = ["intervals", "leapyear", "lru", "semver"]


@pytest.mark.parametrize("task", SWEPRO_TASKS)
async def test_no_swepro_task_leaks_its_fix_commit(
    rows: dict[str, dict[str, Any]], task: str, tmp_path: Path
) -> None:
    """Every swepro image holds its fix commit; the same import-time catch-up finds it in none of them (its
    tests fail; found, they would pass, the grade ``flagged`` for its exec alone), while the gold fix of the
    same task still scores 1."""
    spec = parse_row(rows[task], SWE_MINI)
    assert spec.grader.__class__.__name__ == "Swepro"
    result = await grade(spec, future_patch(task, tmp_path))
    expected = (0.0, "tests_failed", ("dynamic_code", "spawns_process"))
    assert (result.reward, result.failure_kind, result.flags) == expected, result
    assert (await grade(spec, rows[task]["label"])).reward == 1.0


def image_with_future(tmp_path: Path) -> tuple[Path, str]:
    """A repository at its base holding a later fix commit (a branch and a tag), a stash, reflogs, and a
    dangling commit, all packed."""
    repo = tmp_path / "image"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]

    def run(*args: str) -> str:
        return subprocess.run(
            [*git, *args], cwd=repo, check=True, capture_output=True, text=True
        ).stdout.strip()

    run("init", "-q")
    run("add", "-A")
    run("commit", "-qm", "base")
    run("checkout", "-qb", "fix")
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n\nFUTURE_FIX_MARKER = 1\n")
    run("commit", "-qam", "the fix")
    future = run("rev-parse", "HEAD")
    run("tag", "v-fix")
    run("checkout", "-q", "main")
    (repo / "calc.py").write_text("FUTURE_FIX_MARKER = 2\n")
    run("commit", "-qam", "dangling")
    run("reset", "-q", "--hard", "HEAD~1")
    (repo / "calc.py").write_text("FUTURE_FIX_MARKER = 3\n")
    run("stash")
    run("repack", "-a", "-q")  # packed, the dangling commit kept
    return repo, future


async def test_the_grader_sees_the_base_commit_only(tmp_path: Path) -> None:
    """What the agent's sandbox is checked for (tests/test_sandbox_isolation.py), checked in the tests'
    sandbox: one commit, no tag, stash or reflog, one ref, no pack, a clean status (the grader's canaries are
    compiled in memory: no file of them), no future object."""
    image, future = image_with_future(tmp_path)
    probe = (
        "git log --all --oneline | wc -l; git tag | wc -l; git stash list | wc -l; git reflog | wc -l;"
        "git for-each-ref | wc -l; find .git -name '*.pack' | wc -l;"
        "git status --porcelain | wc -l;"
        f"git cat-file -e {future} 2>/dev/null && echo FUTURE;"
        "git cat-file --batch-all-objects --batch-check | grep -c commit;"
        "grep -rl FUTURE_FIX_MARKER . | wc -l"
    )
    command = f'seen=$( ({probe}) | tr "\\n" " "); echo "seen: $seen"; test "$seen" = "1 0 0 0 1 0 0 1 0 "'
    spec = GradingSpec(instance_id="probe", image=image, workdir="/workspace", grader=EvalCmd(command))
    result = await grade(spec, b"")
    assert (result.reward, result.failure_kind) == (1.0, None), result.details["log"]


async def test_a_latin1_edit_keeps_its_bytes(rows: dict[str, dict[str, Any]]) -> None:
    """The gold fix plus a Latin-1 line (one byte 0xE9) that asserts its own decoding at import: it scores 1
    only if the byte reaches the file as it was, the patch given as bytes or as surrogate-escaped text."""
    patch = (TREE_CHEATS / "latin1_edit_with_gold_fix.patch").read_bytes()
    assert b"caf\xe9" in patch
    spec = parse_row(rows["lru"], SWE_MINI)
    for given in (patch, patch.decode("utf-8", errors="surrogateescape")):
        result = await grade(spec, given)
        assert (result.reward, result.failure_kind, result.flags) == (1.0, None, ()), result


async def test_no_fuzzy_apply(rows: dict[str, dict[str, Any]]) -> None:
    """A gold fix whose last context line has drifted is refused (GNU patch fuzzed it in: reward 1)."""
    label = rows["sum-to"]["label"].replace(" def mean(values):", " def mean(numbers):")
    result = await grade(parse_row(rows["sum-to"], SWE_MINI), label.encode())
    assert (result.reward, result.failure_kind) == (0.0, "patch_failed") and not result.applied_cleanly
    assert "$ patch" not in result.details["note"]


async def test_swepro_target_tests_come_from_the_later_commit_or_the_row_is_unusable(
    rows: dict[str, dict[str, Any]],
) -> None:
    row = json.loads(json.dumps(rows["lru"]))
    swepro = row["metadata"]["swepro"]
    swepro["before_repo_set_cmd"] = swepro["before_repo_set_cmd"].replace(
        "tests/test_lru.py", "tests/none.py"
    )
    result = await grade(parse_row(row, SWE_MINI), row["label"])
    assert (result.reward, result.failure_kind) == (0.0, "grading_setup_failed"), result
    assert "tests/none.py" in result.details["note"]
