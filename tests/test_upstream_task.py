"""The real upstream task (examples/upstream: ``parse`` 1.20.1 -> 1.20.2, built from the released sdists).

Its reference fix (the library diff between the releases) scores 1 through the real grader, and a no-op patch
scores 0 with exactly the fix release's two new tests failing: the bug is real, the tests show it, and nothing
else in the suite stands between the base release and a reward. Building needs PyPI once (``pip download``);
the sdists are cached in examples/upstream/sdists/ and checked against their hashes.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import GradingSpec, grade, parse_row
from rollbus.grading.verdict import PASSED

UPSTREAM = Path(__file__).resolve().parents[1] / "examples" / "upstream"
NEW_TESTS = {"test_hyphen_inside_field_name", "test_hyphen_inside_field_name_collision_handling"}


def load_build() -> Any:
    """``examples/upstream/build.py`` as a module (it is a script, not a package)."""
    spec = importlib.util.spec_from_file_location("upstream_build", UPSTREAM / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


@pytest.fixture(scope="module")
def row() -> dict[str, Any]:
    (only,) = load_build().build()  # tasks.jsonl checked against what the sdists build
    return only


@pytest.fixture(scope="module")
def spec(row: dict[str, Any]) -> GradingSpec:
    return parse_row(row, UPSTREAM)


def short(name: str) -> str:
    return re.split(r"[:.]", name)[-1]


async def test_the_fix_release_diff_scores_one(row: dict[str, Any], spec: GradingSpec) -> None:
    result = await grade(spec, row["label"])
    assert (result.reward, result.solved, result.failure_kind, result.flags) == (1.0, True, None, ()), result
    assert result.details["apply_method"] == "git-apply-3way"
    passed = [t.name for t in result.tests if t.status == PASSED]
    assert NEW_TESTS <= {short(name) for name in passed} and len(passed) == len(result.tests) > 90


async def test_a_no_op_patch_scores_zero_on_the_new_tests_alone(spec: GradingSpec) -> None:
    result = await grade(spec, "")
    assert (result.reward, result.solved, result.applied_cleanly) == (0.0, False, True), result
    assert result.failure_kind == "tests_failed"
    assert {short(t.name) for t in result.tests if t.status != PASSED} == NEW_TESTS


def test_the_fix_is_library_code_and_the_image_holds_only_the_base_release(
    row: dict[str, Any], spec: GradingSpec
) -> None:
    assert re.findall(r"^diff --git a/(\S+) b/", row["label"], flags=re.M) == ["parse.py"]
    assert '-__version__ = "1.20.1"' in row["label"] and '+__version__ = "1.20.2"' in row["label"]
    refs = subprocess.run(
        ["git", "-C", str(spec.image), "for-each-ref", "--format=%(refname)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    commits = subprocess.run(
        ["git", "-C", str(spec.image), "rev-list", "--all"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert (refs, len(commits)) == (["refs/heads/main"], 1)
    assert not (spec.image / "tests" / "test_parse.py").read_text().count("hyphen")


def identity(path: Path) -> tuple[int, int]:
    """Which file ``path`` is: a file removed and made again has a new change time, even on a reused inode."""
    st = path.stat()
    return st.st_ino, st.st_ctime_ns


def test_a_second_build_leaves_the_image_it_made_for_its_readers(spec: GradingSpec) -> None:
    # pytest workers build and grade side by side: a rebuild under a grader read "not a git repository"
    held = [
        spec.image / ".git" / "HEAD",
        spec.image / "parse.py",
        UPSTREAM / "eval" / "parse" / "tests" / "test_parse.py",
    ]
    before = [identity(path) for path in held]
    load_build().build()
    assert [identity(path) for path in held] == before


def test_an_image_made_by_another_recipe_is_remade(tmp_path: Path) -> None:
    build = load_build()
    helpers = build.swe_mini_build()
    base = build.unpack(build.sdist(*build.BASE), tmp_path / "base")
    image = tmp_path / "image"
    build.make_image(helpers, base, image)
    marker = image / ".git" / helpers.STAMP
    made = identity(image / "parse.py")
    marker.write_text("another recipe")
    build.make_image(helpers, base, image)
    assert marker.read_text() == build.source_stamp(helpers) and identity(image / "parse.py") != made
