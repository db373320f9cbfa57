"""``rollbus validate``: each task's gold scores 1 and the empty patch 0 through the real grader (bwrap),
the failing check named, resumable by row hash; SWE-bench and SWE-bench Pro rows on tiny local projects."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollbus.cli import main
from rollbus.grading import GradeConfig, grade
from rollbus.grading.backends import BackendUnavailable, grade_function
from rollbus.rows import Row, RowKeys, read_dataset
from rollbus.services.grader import validate as v
from rollbus.services.grader.core import grade_row

ROOT = Path(__file__).resolve().parents[1]
SWE_MINI = ROOT / "examples" / "swe-mini"
GIT_ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
    "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
}  # fmt: skip


@pytest.fixture(scope="module")
def swe_mini() -> list[dict[str, Any]]:
    """swe-mini's rows, their images built, every host path absolute (rows can be written anywhere)."""
    spec = importlib.util.spec_from_file_location("swe_mini_build", SWE_MINI / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    from rollbus.grading.rows import absolute_paths

    return [{**row, "metadata": absolute_paths(row["metadata"], SWE_MINI)} for row in build.build()]


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def by_name(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(r for r in rows if r["metadata"]["instance_id"] == f"swe-mini__{name}")


def test_every_swe_mini_task_validates_and_a_second_run_skips_them(
    swe_mini: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results.jsonl"
    argv = ["validate", str(SWE_MINI / "tasks.jsonl"), "--results", str(results), "--jobs", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    names = [r["metadata"]["instance_id"] for r in swe_mini]
    assert all(f"ok   {name}\n" in out for name in names) and "10 tasks: 10 ok, 0 failed" in out
    recorded = [json.loads(line) for line in results.read_text().splitlines()]
    assert sorted(r["task"] for r in recorded) == sorted(names)
    for record in recorded:  # every bundled task ships a statement-only probe, and none passes (none WEAK)
        gold, empty, probe = record["checks"]
        checks = [(c["check"], c["reward"]) for c in (gold, empty, probe)]
        assert checks == [("gold", 1.0), ("empty", 0.0), ("probe", 0.0)], record
    assert "WEAK" not in out
    assert main(argv) == 0  # nothing graded again: every task is in the results file
    out = capsys.readouterr().out
    assert out.count("(earlier run)") == 10 and "(10 from earlier runs" in out
    assert len(results.read_text().splitlines()) == 10


def test_a_broken_task_fails_naming_its_check(
    swe_mini: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    binsearch, sum_to, roman = (by_name(swe_mini, n) for n in ("binsearch", "sum-to", "roman"))
    wrong_gold = {**binsearch, "label": by_name(swe_mini, "sum-to")["label"]}  # another task's fix
    always = {**sum_to["metadata"], "instance_id": "always", "eval_cmd": "true"}
    always_passes = {**sum_to, "metadata": always}
    no_gold = {**roman, "label": None, "metadata": {**roman["metadata"], "instance_id": "no-gold"}}
    dataset = write(tmp_path / "broken.jsonl", [wrong_gold, always_passes, no_gold])
    with dataset.open("a") as out:
        out.write('{"what": 1}\n')
    assert main(["validate", str(dataset), "--jobs", "3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL swe-mini__binsearch\n       gold: gold scored 0 (patch_failed)" in out
    assert "FAIL always\n       empty: the empty patch scored 1" in out
    assert "FAIL no-gold\n       gold: no gold patch" in out
    assert f"FAIL {dataset}:4\n       load: unknown row shape" in out
    assert "4 tasks: 0 ok, 4 failed" in out
    assert (tmp_path / "broken.jsonl.validate.jsonl").exists()  # the default results file, beside the dataset


def test_a_statement_probe_that_passes_marks_the_task_weak(
    swe_mini: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = by_name(swe_mini, "binsearch")
    weak = {**row, "metadata": {**row["metadata"], "statement_probe": row["label"]}}
    assert main(["validate", str(write(tmp_path / "weak.jsonl", [weak]))]) == 0
    out = capsys.readouterr().out
    assert "WEAK swe-mini__binsearch\n       probe: the statement-only probe scored 1" in out
    assert "1 tasks: 1 ok, 0 failed, 1 weak" in out


def test_resume_grades_only_new_or_changed_tasks(swe_mini: list[dict[str, Any]], tmp_path: Path) -> None:
    graded: list[str] = []

    async def counting(row: dict, patch: str, base: Path, config: GradeConfig) -> Any:
        graded.append(row["metadata"]["instance_id"])
        return await grade_row(row, patch, base, config)

    def rows_of(dataset: Path) -> list[Row]:
        return [r for r in read_dataset(dataset, RowKeys()) if isinstance(r, Row)]

    results = tmp_path / "r.jsonl"
    first = [by_name(swe_mini, "sum-to"), by_name(swe_mini, "slugify")]

    def once(rows: list[dict[str, Any]]) -> list[v.TaskReport]:
        tasks = rows_of(write(tmp_path / "d.jsonl", rows))
        done = v.read_results(results)
        return asyncio.run(v.validate(tasks, tmp_path, counting, GradeConfig(), "local", 2, results, done))

    assert all(r.ok and not r.skipped for r in once(first)) and len(graded) == 6  # gold, empty, probe
    results.write_text(results.read_text() + '{"torn": ')  # a run killed mid-write
    graded.clear()
    changed = {**first[1], "label": first[0]["label"]}  # a changed row is a new task (new hash)
    reports = once([first[0], changed])
    assert graded == ["swe-mini__slugify"] * 3  # its gold, empty and probe only
    assert [(r.skipped, r.ok) for r in reports] == [(True, True), (False, False)]


def test_a_backend_is_chosen_by_name_and_an_absent_one_is_named() -> None:
    from rollbus.grading import container

    assert grade_function("docker") is container.grade  # the container backend, imported only when chosen
    with pytest.raises(BackendUnavailable, match="unknown grading backend 'podman'"):
        grade_function("podman")
    assert grade_function("local") is grade


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, capture_output=True, text=True, check=True)
    return done.stdout.strip()


CALC = 'def add(a, b):\n    return a + b\n\n\ndef double(x):\n    return x + x + 1\n'
CALC_FIXED = CALC.replace("x + x + 1", "2 * x")
OLD_TEST = "from calc import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n"
NEW_TEST = OLD_TEST.replace("from calc import add", "from calc import add, double") + (
    "\n\ndef test_double():\n    assert double(3) == 6\n"
)


def tiny_project(root: Path, *, fix_branch: bool) -> tuple[Path, str, str, str]:
    """A two-file Python project at its buggy base commit; returns (repo, base, fix commit, gold patch)."""
    repo = root / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC)
    (repo / "tests" / "test_calc.py").write_text(OLD_TEST)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD")
    (repo / "calc.py").write_text(CALC_FIXED)
    gold = git(repo, "diff") + "\n"
    fix = ""
    if fix_branch:  # SWE-bench Pro images hold the fix commit the target tests come from
        git(repo, "checkout", "-q", "-b", "fix")
        (repo / "tests" / "test_calc.py").write_text(NEW_TEST)
        git(repo, "commit", "-q", "-am", "fix")
        fix = git(repo, "rev-parse", "HEAD")
        git(repo, "checkout", "-q", "main")
    else:
        git(repo, "checkout", "-q", "--", "calc.py")
    return repo, base, fix, gold


def test_a_swebench_row_on_a_local_project_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, base, _, gold = tiny_project(tmp_path, fix_branch=False)
    scratch = tmp_path / "scratch"
    shutil.copytree(repo, scratch)
    (scratch / "tests" / "test_calc.py").write_text(NEW_TEST)
    test_patch = git(scratch, "diff") + "\n"
    row = {
        "instance_id": "local__calc-1", "repo": "local/calc", "base_commit": base, "patch": gold,
        "test_patch": test_patch, "problem_statement": "double(3) is 7", "image": "repo",
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_double"]),
        "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]), "version": "1.0",
    }  # fmt: skip
    dataset = write(tmp_path / "swebench.jsonl", [row])
    assert main(["validate", str(dataset)]) == 0, capsys.readouterr().out
    assert "ok   local__calc-1" in capsys.readouterr().out
    # the agent's own edit of the test file is undone before test_patch goes on (SWE-bench's order): without
    # the reset, test_patch would not apply over it
    (scratch / "tests" / "test_calc.py").write_text(OLD_TEST + "\n\ndef test_mine():\n    pass\n")
    (scratch / "calc.py").write_text(CALC_FIXED)
    edits_tests = git(scratch, "diff") + "\n"
    record = json.loads(load_rows(dataset)[0])
    result = asyncio.run(grade_row(record, edits_tests, tmp_path, GradeConfig(zero_flagged=False)))
    assert (result.reward, result.flags) == (1.0, ("touches_tests",)), result.details.get("note")
    assert asyncio.run(grade_row(record, edits_tests, tmp_path, GradeConfig())).reward == 0.0  # flagged


def load_rows(dataset: Path) -> list[str]:
    from rollbus.task_formats import load_dataset

    return [x.text for x in load_dataset(dataset) if x.text]


def test_a_published_swepro_row_on_a_local_project_validates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    repo, base, fix, gold = tiny_project(tmp_path, fix_branch=True)
    scripts = tmp_path / "run_scripts" / "local__calc-2"
    scripts.mkdir(parents=True)
    for name in ("run_script.sh", "parser.py"):
        shutil.copy(SWE_MINI / "swepro" / name, scripts / name)
    row = {
        "instance_id": "local__calc-2", "repo": "local/calc", "base_commit": base, "patch": gold,
        "test_patch": "", "problem_statement": "double(3) is 7", "requirements": "double(x) == 2 * x",
        "interface": "No new interfaces are introduced.", "repo_language": "python",
        "fail_to_pass": "['tests/test_calc.py::test_double']",
        "pass_to_pass": "['tests/test_calc.py::test_add']",
        "selected_test_files_to_run": "['tests/test_calc.py']", "dockerhub_tag": "local.calc-2",
        "before_repo_set_cmd": f"git reset --hard {base}\ngit clean -fd\ngit checkout {base}\n"
        f"git checkout {fix} -- tests/test_calc.py",
        "image": "repo", "workdir": "/workspace",  # a local image for this test; published rows name neither
    }  # fmt: skip
    dataset = write(tmp_path / "pro.jsonl", [row])
    assert main(["validate", str(dataset), "--format", "swepro"]) == 0, capsys.readouterr().out
    assert "ok   local__calc-2" in capsys.readouterr().out


def test_a_harbor_task_on_the_local_backend_fails_naming_its_gold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    task = tmp_path / "hello"
    files = {
        "task.toml": 'version = "1.0"\n[agent]\ntimeout_sec = 60\n',
        "instruction.md": "Write hello.txt.\n",
        "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n",
        "tests/test.sh": "echo 1 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "echo hello > /app/hello.txt\n",
    }
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    assert main(["validate", str(task), "--results", str(tmp_path / "r.jsonl")]) == 1
    out = capsys.readouterr().out
    assert "FAIL hello\n       gold: a Harbor solution/solve.sh runs on a container backend" in out


def test_the_bundled_published_swepro_row_validates(
    swe_mini: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = SWE_MINI / "swepro-published.jsonl"
    assert main(["validate", str(dataset), "--results", str(tmp_path / "r.jsonl")]) == 0
    assert "ok   swe-mini__intervals" in capsys.readouterr().out
    from rollbus.services.stack.demo import rows_in

    assert rows_in(dataset) == 1 and rows_in(SWE_MINI / "tasks.jsonl") == 10
