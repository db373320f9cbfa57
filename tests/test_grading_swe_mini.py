"""The grader against the swe-mini tasks and the cheating-patch corpus, in real bwrap sandboxes.

Every task: its reference fix scores 1, the empty patch 0. Every cheat in ``tests/cheats/`` (a policy trying
to raise its reward without fixing the bug) scores 0 with the flag and failure kind ``corpus.json`` names,
while the honest fix of the same task still scores 1.
"""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import GradeConfig, GradingSpec, grade, parse_row
from rollbus.grading.backends import grade_function

ROOT = Path(__file__).resolve().parents[1]
SWE_MINI = ROOT / "examples" / "swe-mini"
CHEATS = Path(__file__).resolve().parent / "cheats"
CORPUS = json.loads((CHEATS / "corpus.json").read_text())


def over_backends(values: list[Any], docker: set[str], key: Any = str) -> list[Any]:
    """``(backend, value)`` for every value on ``local``, and on ``docker`` for those whose key is in
    ``docker`` (marked: a Docker engine, started by the project where none answers)."""
    out = [pytest.param("local", v, id=f"local-{key(v)}") for v in values]
    return out + [
        pytest.param("docker", v, id=f"docker-{key(v)}", marks=pytest.mark.docker)
        for v in values
        if key(v) in docker
    ]


def grade_on(backend: str) -> Any:
    """The grade of ``backend`` (:mod:`rollbus.grading.backends`)."""
    return grade if backend == "local" else grade_function(backend)


def load_build() -> Any:
    spec = importlib.util.spec_from_file_location("swe_mini_build", SWE_MINI / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def append_to(path: str, context: str, lines: list[str]) -> str:
    """A patch adding ``lines`` after ``context``, the only line of ``path`` (an ``__init__.py``'s import)."""
    body = "".join(f"+{line}\n" for line in lines)
    return f"--- a/{path}\n+++ b/{path}\n@@ -1 +1,{1 + len(lines)} @@\n {context}\n{body}"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    """The dataset's rows by task name, their images built (tasks.jsonl checked against the task files)."""
    built = load_build().build()
    return {row["metadata"]["image"].split("/")[-1]: row for row in built}


def spec_of(rows: dict[str, dict[str, Any]], task: str) -> GradingSpec:
    return parse_row(rows[task], SWE_MINI)


def test_dataset_has_every_grader_kind(rows: dict[str, dict[str, Any]]) -> None:
    kinds = [type(spec_of(rows, task).grader).__name__ for task in rows]
    assert len(rows) >= 10
    assert {kinds.count(k) for k in ("Swepro", "EvalCmd", "F2PScript")} >= {3}
    assert all(row["metadata"]["problem_statement"] and row["label"] for row in rows.values())


@pytest.mark.parametrize("task", sorted(p.name for p in (SWE_MINI / "tasks").iterdir()))
async def test_reference_fix_scores_one_and_empty_patch_zero(
    rows: dict[str, dict[str, Any]], task: str
) -> None:
    """On bwrap; every task's gold and empty patch through the container backend: test_cheats_docker."""
    spec = spec_of(rows, task)
    fixed = await grade(spec, rows[task]["label"])
    assert (fixed.reward, fixed.solved, fixed.failure_kind, fixed.flags) == (1.0, True, None, ()), fixed
    assert fixed.applied_cleanly and fixed.details["apply_method"] == "git-apply-3way"
    assert "image_digest" not in fixed.details
    empty = await grade(spec, "")
    assert (empty.reward, empty.solved, empty.applied_cleanly) == (0.0, False, True)
    assert empty.failure_kind == "tests_failed"


@pytest.mark.parametrize("cheat", CORPUS, ids=[c["name"] for c in CORPUS])
async def test_cheat_scores_zero(rows: dict[str, dict[str, Any]], cheat: dict[str, Any]) -> None:
    """On bwrap; the same corpus through the container backend: test_cheats_docker."""
    spec = spec_of(rows, cheat["task"])
    result = await grade(spec, (CHEATS / f"{cheat['name']}.patch").read_text())
    assert result.reward == 0.0 and not result.solved, result
    assert set(cheat["flags"]) <= set(result.flags), result
    assert result.failure_kind == cheat["failure_kind"], result


async def test_swepro_cheats_never_see_their_test_edits(rows: dict[str, dict[str, Any]]) -> None:
    """The target tests come back from the fix commit after the patch: the rewritten test is gone."""
    spec = spec_of(rows, "lru")
    result = await grade(spec, (CHEATS / "swepro_rewrite_target_test.patch").read_text())
    statuses = {t.name.split("::")[-1]: t.status for t in result.tests}
    assert statuses["test_get_refreshes_recency"] == "FAILED"


async def test_fake_summary_lines_do_not_pass_a_failing_test(rows: dict[str, dict[str, Any]]) -> None:
    result = await grade(spec_of(rows, "lru"), (CHEATS / "fake_pytest_summary.patch").read_text())
    assert ("tests/test_lru.py::test_get_refreshes_recency", "FAILED") in [
        (t.name, t.status) for t in result.tests
    ]


async def test_collection_error_leaves_required_tests_missing(rows: dict[str, dict[str, Any]]) -> None:
    result = await grade(spec_of(rows, "lru"), (CHEATS / "syntax_error_breaks_collection.patch").read_text())
    statuses = {t.name: t.status for t in result.tests}
    assert statuses["tests/test_lru.py::test_get_refreshes_recency"] in ("MISSING", "ERROR")


async def test_flags_can_be_reported_without_zeroing(rows: dict[str, dict[str, Any]]) -> None:
    """With zero_flagged off (an operator's choice), the honest fix plus a flagged extra scores 1, flagged."""
    patch = (CHEATS / "sitecustomize_and_pth.patch").read_text()
    spec = spec_of(rows, "roman")
    assert (await grade(spec, patch)).reward == 0.0
    kept = await grade(spec, patch, GradeConfig(zero_flagged=False))
    assert kept.reward == 1.0 and "site_hooks" in kept.flags and kept.failure_kind is None


async def test_oversized_patch_is_a_named_failure(rows: dict[str, dict[str, Any]]) -> None:
    patch = rows["sum-to"]["label"] + "".join(f"+# padding {i}\n" for i in range(100_000))
    result = await grade(spec_of(rows, "sum-to"), patch, GradeConfig(max_patch_bytes=2**20))
    assert (result.reward, result.failure_kind, result.applied_cleanly) == (0.0, "patch_too_large", False)


async def test_binary_hunks_are_stripped_and_the_rest_applies(rows: dict[str, dict[str, Any]]) -> None:
    binary = (CHEATS / "stale_pyc_hidden_by_gitignore.patch").read_text()
    result = await grade(spec_of(rows, "flatten"), rows["flatten"]["label"] + binary)
    assert result.reward == 1.0 and result.flags == ("binary_stripped",), result
    assert result.details["stripped_binary"] == ["nest/__pycache__/flat.cpython-311.pyc"]


async def test_a_hanging_patch_times_out(rows: dict[str, dict[str, Any]]) -> None:
    hang = (
        rows["median"]["label"]
        .replace(
            "+    if len(ordered) % 2:\n", "+    __import__('time').sleep(3600)\n+    if len(ordered) % 2:\n"
        )
        .replace("@@ -7,4 +7,6 @@", "@@ -7,4 +7,7 @@")
    )
    result = await grade(spec_of(rows, "median"), hang, GradeConfig(timeout_s=5))
    assert (result.reward, result.failure_kind) == (0.0, "timeout"), result


async def test_missing_eval_material_is_a_bad_row(rows: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    row = json.loads(json.dumps(rows["lru"]))
    row["metadata"]["swepro"]["parser_script_path"] = str(tmp_path / "no-parser.py")
    result = await grade(parse_row(row, SWE_MINI), row["label"])
    assert (result.reward, result.failure_kind) == (0.0, "bad_row") and "no-parser.py" in result.details[
        "note"
    ]


async def test_missing_image_is_a_sandbox_failure(rows: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    row = json.loads(json.dumps(rows["roman"]))
    row["metadata"]["image"] = str(tmp_path / "nowhere")
    result = await grade(parse_row(row, SWE_MINI), row["label"])
    assert (result.reward, result.failure_kind) == (0.0, "sandbox_failed")


async def test_tarball_image_and_pre_commands(rows: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """An image given as a tarball (one top-level directory) grades like the directory; ``pre_commands``
    share the grading command's shell."""
    row = json.loads(json.dumps(rows["sum-to"]))
    tarball = tmp_path / "sum-to.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(SWE_MINI / row["metadata"]["image"], arcname="sum-to")
    row["metadata"]["image"] = str(tarball)
    row["metadata"]["pre_commands"] = ["export ROLLBUS_PRE=ready"]
    row["metadata"]["eval_cmd"] = 'test "$ROLLBUS_PRE" = ready && ' + row["metadata"]["eval_cmd"]
    result = await grade(parse_row(row, SWE_MINI), row["label"])
    assert (result.reward, result.failure_kind) == (1.0, None), result


async def test_a_pytest_report_is_checked_even_when_the_command_hides_pytest(
    rows: dict[str, dict[str, Any]],
) -> None:
    """``eval_cmd`` hides pytest from any text search: the grader's report still must agree with exit 0."""
    row = json.loads(json.dumps(rows["median"]))
    del row["metadata"]["remote_env_info"]
    row["metadata"]["eval_cmd"] = "python3 -m py''test -q tests/test_center_hidden.py; exit 0"
    result = await grade(parse_row(row, SWE_MINI), "")
    assert (result.reward, result.failure_kind) == (0.0, "report_mismatch"), result
