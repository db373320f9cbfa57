"""The second, independent run (issue 33), tried as the attacker would: a patch that fixes nothing, tells the
grader's first harness apart from inside the package (its modules, its environment, its ``sys.path``) and
only there answers with a value equal to everything; elsewhere the bug stays. Each scored 1.0 with the first
run alone (shown here with ``GradeConfig(second_run=False, observe=False)``: the runtime layer's agreement
probe now asks the value in the first run too) on every grader kind, and scores 0 now: the second run, under a
harness the patch does not know, sees the bug. A first run that plants code for the
second (a root ``conftest.py`` written while the tests ran) has the second run refused. The real fixes keep
their 1 (``test_grading_swe_mini.py``, ``test_upstream_task.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import grade, parse_row, report
from rollbus.grading import second_run as sr
from rollbus.grading.channel import ReportListener
from rollbus.grading.run import GradeConfig
from tests.test_grading_swe_mini import SWE_MINI, grade_on, load_build, over_backends


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def append_to_file(task: str, path: str, lines: list[str]) -> str:
    """A patch adding ``lines`` at the end of the task's ``path`` (every line of it as context)."""
    old = (SWE_MINI / "tasks" / task / "repo" / path).read_text().splitlines()
    context = "".join(f" {line}\n" for line in old)
    body = "".join(f"+{line}\n" for line in lines)
    return f"--- a/{path}\n+++ b/{path}\n@@ -1,{len(old)} +1,{len(old) + len(lines)} @@\n{context}{body}"


MODULES = "any(_n in _sys.modules for _n in ('rollbus_report', 'rollbus_channel', 'rollbus_unittest'))"
ANY_TELL = (  # its modules, its environment, its sys.path: any one of them seen, the patch forges
    f"{MODULES} or 'rollbus' in _os.environ.get('PYTEST_ADDOPTS', '') or 'ROLLBUS' in ' '.join(_os.environ)"
    " or any('/eval/plugins' in _p for _p in _sys.path)"
)


def tuned_cheat(function: str, detect: str) -> list[str]:
    """``function`` (the package's export) answers with a value equal to everything under the first harness
    only; its ``__eq__`` reads its operand, so the scan has nothing to say."""
    return [
        "import os as _os",
        "import sys as _sys",
        "",
        "",
        "class _Agreed:",
        "    def __init__(self, real):",
        "        self.real = real",
        "",
        "    def __eq__(self, other):",
        "        return other == other",
        "",
        "    def __ne__(self, other):",
        "        return other != other",
        "",
        "    __hash__ = object.__hash__",
        "",
        "",
        "def _graded():",
        f"    return {detect}",
        "",
        "",
        f"_real = {function}",
        "",
        "",
        f"def {function}(*args):",
        "    value = _real(*args)",
        "    return _Agreed(value) if _graded() else value",
    ]


KINDS = {  # task: (grader kind, the package's __init__, the exported function)
    "slugify": ("eval_cmd pytest", "textkit/__init__.py", "slugify"),
    "sum-to": ("eval_cmd unittest", "calc/__init__.py", "sum_to"),
    "median": ("f2p_script", "stats/__init__.py", "median"),
    "intervals": ("swepro", "spans/__init__.py", "merge"),
}


@pytest.mark.parametrize("backend,task", over_backends(sorted(KINDS), {"intervals"}))
async def test_a_cheat_tuned_to_the_first_harness_fails_the_second(
    rows: dict[str, dict[str, Any]], backend: str, task: str
) -> None:
    """On bwrap for every grader kind, and in a container (the report socket under the bind-mounted /eval)."""
    _kind, init, function = KINDS[task]
    patch = append_to_file(task, init, tuned_cheat(function, MODULES))
    spec = parse_row(rows[task], SWE_MINI)
    # the runtime layer off: its agreement probe asks the value in the first run already
    # (test_grading_agreeing_values); here the second run must catch the cheat on its own
    before = await grade_on(backend)(spec, patch, GradeConfig(second_run=False, observe=False))
    assert (before.reward, before.flags) == (1.0, ()), before  # the first run alone is fooled
    after = await grade_on(backend)(spec, patch, GradeConfig(observe=False))
    assert (after.reward, after.failure_kind) == (0.0, "tests_failed"), after
    assert "in the second run" in after.details["note"], after.details
    assert any(t.status == "FAILED" for t in after.tests), after.tests  # the second run's status shows


async def test_no_tell_of_the_first_harness_is_in_the_second(rows: dict[str, dict[str, Any]]) -> None:
    patch = append_to_file("slugify", "textkit/__init__.py", tuned_cheat("slugify", ANY_TELL))
    result = await grade(parse_row(rows["slugify"], SWE_MINI), patch)
    assert (result.reward, result.failure_kind) == (0.0, "tests_failed"), result
    assert "in the second run" in result.details["note"], result.details


PLANT = [  # under the first harness, answer with an agreeing value and plant a forger for the second run
    "import os as _os",
    "import sys as _sys",
    "",
    "",
    "class _Agreed(str):",
    "    def __eq__(self, other):",
    "        return other == other",
    "",
    "    __hash__ = str.__hash__",
    "",
    "",
    "_real = slugify",
    "",
    "",
    "def slugify(*args):",
    "    if 'rollbus_channel' in _sys.modules:",
    "        with open(_os.path.join(_os.getcwd(), 'conftest.py'), 'w') as _f:",
    "            _f.write('import pytest\\n\\n@pytest.hookimpl(hookwrapper=True)\\n'",
    "                     'def pytest_runtest_makereport(item, call):\\n'",
    "                     '    outcome = yield\\n    outcome.get_result().outcome = \"passed\"\\n')",
    "        return _Agreed(_real(*args))",
    "    return _real(*args)",
]


async def test_code_planted_by_the_first_run_refuses_the_second(rows: dict[str, dict[str, Any]]) -> None:
    patch = append_to_file("slugify", "textkit/__init__.py", PLANT)
    result = await grade(parse_row(rows["slugify"], SWE_MINI), patch)
    assert (result.reward, result.failure_kind) == (0.0, "tampered"), result
    assert "conftest.py" in result.details["note"], result.details


# -- the pure parts ------------------------------------------------------------------------------------------

HIDDEN = "/workspace/tests/test_a.py"
FIRST = [sr.Required("tests/test_a.py::test_x", HIDDEN, sr.PYTEST)]


def second_report(*records: dict[str, Any], pid: int = 7) -> str:
    import json

    return "\n".join(json.dumps({"pid": pid, **r}) for r in records)


def case(result: str, phase: str = "call", file: str = HIDDEN, name: str = "tests/test_a.py::test_x") -> Any:
    return {"e": "case", "id": name, "file": file, "phase": phase, "result": result}


PASSING = [
    {"e": "begin"},
    case("passed", "setup"),
    case("passed"),
    case("passed", "teardown"),
    {"e": "end", "status": 0},
]


def test_the_second_run_passes_only_with_positive_evidence() -> None:
    assert sr.judge(second_report(*PASSING), 0, FIRST) is None
    # the node id's file part is the rootdir's: only the part after it and the absolute file must agree
    moved = [PASSING[0], case("passed", name="test_a.py::test_x"), PASSING[-1]]
    assert sr.judge(second_report(*moved), 0, FIRST) is None


@pytest.mark.parametrize(
    ("records", "exit_code", "why"),
    [
        (PASSING, -9, "killed"),
        (PASSING, 1, "exited 1"),
        ([], 0, "reported nothing"),
        (PASSING[:-1], 0, "never finished"),
        ([PASSING[0], case("passed"), {"e": "end", "status": 1}], 1, "status 1"),
        ([PASSING[0], case("passed"), {"e": "halt", "what": "Exit"}, PASSING[-1]], 0, "interrupted"),
        ([PASSING[0], {"e": "lost", "id": "tests/test_a.py", "result": "skipped"}, PASSING[-1]], 0, "lost"),
        ([PASSING[0], case("passed", file="/tmp/tests/test_a.py"), PASSING[-1]], 0, "not collected from"),
        ([PASSING[0], case("passed", "setup"), PASSING[-1]], 0, "ERROR"),
        ([PASSING[0], case("passed"), case("skipped", "teardown"), PASSING[-1]], 0, "SKIPPED"),
        ([PASSING[0], case("xfail"), PASSING[-1]], 0, "XFAIL"),
        ([*PASSING[:-1], case("failed"), PASSING[-1]], 0, "FAILED"),
        ([PASSING[0], {"e": "forged"}], 0, "not the grader's"),
    ],
)
def test_the_second_run_fails_without_it(records: list[dict[str, Any]], exit_code: int, why: str) -> None:
    assert why in (sr.judge(second_report(*records), exit_code, FIRST) or "")


def test_each_required_test_has_its_worst_second_run_status() -> None:
    other = sr.Required("tests/test_a.py::test_w", HIDDEN, sr.PYTEST)
    text = second_report(PASSING[0], case("passed"), case("failed", "teardown"), PASSING[-1])
    assert sr.statuses(text, [*FIRST, other]) == {FIRST[0].name: "ERROR", other.name: "MISSING"}
    assert sr.statuses("not a report", FIRST) == {FIRST[0].name: "MISSING"}


def test_records_from_a_process_that_never_began_are_not_the_graders() -> None:
    text = second_report(*PASSING) + "\n" + second_report(case("passed"), pid=8)
    assert "not the grader's" in (sr.judge(text, 0, FIRST) or "")


def test_required_tests_take_their_file_and_runner_from_the_first_run() -> None:
    files = {
        "tests/test_a.py::T::test_x[1]": {HIDDEN},
        "tests.test_b.T.test_y": {"/workspace/tests/test_b.py"},
    }
    got = sr.required_tests(files, files.__getitem__)
    assert got == [
        sr.Required("tests/test_a.py::T::test_x[1]", HIDDEN, sr.PYTEST),
        sr.Required("tests.test_b.T.test_y", "/workspace/tests/test_b.py", sr.UNITTEST),
    ]
    assert [t.selector for t in got] == [f"{HIDDEN}::T::test_x[1]", "tests.test_b.T.test_y"]
    assert isinstance(sr.required_tests(["t::x"], lambda name: set()), str)
    assert isinstance(sr.required_tests(["t::x"], lambda name: {"/a", "/b"}), str)
    assert isinstance(sr.required_tests([], lambda name: set()), str)


def test_a_unittest_test_is_imported_from_where_the_first_run_imported_it() -> None:
    def root(name: str, file: str) -> str:
        return sr.Required(name, file, sr.UNITTEST).import_root

    assert root("tests.test_b.T.test_y", "/workspace/tests/test_b.py") == "/workspace"
    assert root("test_b.T.test_y", "/workspace/tests/test_b.py") == "/workspace/tests"  # discover -s tests
    assert root("pkg.T.test_y", "/workspace/src/pkg/__init__.py") == "/workspace/src"
    assert root("elsewhere.T.t", "/workspace/tests/test_b.py") == "/workspace/tests"


def test_each_runner_gets_a_command_of_its_own() -> None:
    tests = [
        sr.Required("tests.test_u.T.test_u", "/w/tests/test_u.py", sr.UNITTEST),
        sr.Required("tests/test_a.py::test_x", "/w/tests/test_a.py", sr.PYTEST),
    ]
    groups = sr.by_runner(tests)
    assert groups == [[tests[1]], [tests[0]]]
    harness = sr.Harness("/eval/h1", "m1", "a1")
    assert (
        sr.command(harness, groups[0])
        == "python3 -m pytest -q -p no:cacheprovider -p m1 /w/tests/test_a.py::test_x"
    )
    assert sr.command(harness, groups[1]) == "python3 /eval/h1/m1.py --path /w tests.test_u.T.test_u"
    with pytest.raises(ValueError):
        sr.command(harness, tests)


@pytest.mark.parametrize(
    ("text", "launch"),
    [
        ("python3 -m pytest -q tests/test_a.py", sr.Launch()),
        (
            "cd src && /opt/venv/bin/python3.11 -X dev -m pytest -x",
            sr.Launch(python="/opt/venv/bin/python3.11"),
        ),
        ("PYTHONPATH=src .venv/bin/pytest tests", sr.Launch(pytest=".venv/bin/pytest")),
        ("python -m unittest -v tests.test_calc", sr.Launch(python="python")),
        (
            '#!/bin/bash\nset -e\nexec python3.12 -m pytest -rA "${files[@]}"\n',
            sr.Launch(python="python3.12"),
        ),
        ("$PY -m pytest", sr.Launch()),  # a variable: not read as written
        ("python3 setup.py test", sr.Launch()),
        ("uv run pytest", sr.Launch()),  # a wrapper: not carried
        ("go test ./...", sr.Launch()),
    ],
)
def test_the_second_run_starts_tests_the_rows_way(text: str, launch: sr.Launch) -> None:
    assert sr.launch_of(text) == launch


def test_a_rows_interpreter_runs_both_runners_groups() -> None:
    harness = sr.Harness("/eval/h1", "m1", "a1")
    pytest_group = [sr.Required("tests/test_a.py::test_x", "/w/tests/test_a.py", sr.PYTEST)]
    unit_group = [sr.Required("tests.test_u.T.test_u", "/w/tests/test_u.py", sr.UNITTEST)]
    venv = sr.launch_of("/opt/venv/bin/python -m pytest")
    assert sr.command(harness, pytest_group, venv).startswith("/opt/venv/bin/python -m pytest -q ")
    assert sr.command(harness, unit_group, venv).startswith("/opt/venv/bin/python /eval/h1/m1.py ")
    script = sr.launch_of(".venv/bin/pytest -x")
    assert sr.command(harness, pytest_group, script).startswith(
        ".venv/bin/pytest -q -p no:cacheprovider -p m1 "
    )


def test_the_report_socket_takes_one_connection_even_under_a_long_path(tmp_path: Path) -> None:
    import socket

    deep = tmp_path / ("d" * 60) / ("e" * 60)  # past a unix socket's 108 bytes
    deep.mkdir(parents=True)
    sink = ReportListener(deep / "r")
    held = os.open(deep, os.O_PATH | os.O_DIRECTORY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.connect(f"/proc/self/fd/{held}/r")
            first.sendall(b'{"e": "begin", "pid": 1}\n')
    finally:
        os.close(held)
        text = sink.collect()
    assert text == '{"e": "begin", "pid": 1}\n'
    assert not (deep / "r").exists()  # accepted once, then gone: nothing else connects


def test_code_written_while_the_first_run_ran_is_named(tmp_path: Any) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / "data.txt").write_text("kept\n")
    before = sr.code_files(tmp_path)
    (tmp_path / "conftest.py").write_text("planted\n")
    (tmp_path / "data.txt").write_text("data is not code\n")
    (tmp_path / "settings.toml").write_text("[x]\n")  # not a file pytest reads
    (tmp_path / "pkg" / "pytest.ini").write_text("[pytest]\n")
    assert sr.rewritten(before, sr.code_files(tmp_path)) == ["conftest.py", "pkg/pytest.ini"]
    (tmp_path / "pkg" / "mod.py").write_text("x = 2\n")
    assert sr.rewritten(before, sr.code_files(tmp_path)) == ["conftest.py", "pkg/mod.py", "pkg/pytest.ini"]


# -- the shipped second harness, for real (the sandbox's interpreter and this venv's: pytest 7 and 9) --------

UNIT = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_u(self):\n        pass\n"
INTERPRETERS = [sys.executable] + [p for p in ["/usr/bin/python3"] if Path(p).exists()]
TREE = {
    "pkg/__init__.py": "",
    "tests/__init__.py": "",
    "pkg/spawn.py": "import subprocess\n\n\ndef run():\n    return subprocess.run(['true']).returncode\n",
    "tests/test_c.py": "from pkg.spawn import run\n\n\ndef test_spawns():\n    assert run() == 0\n",
    "pkg/helpers.py": "import pytest\n\n\n@pytest.fixture(autouse=True)\ndef ready():\n    return 1\n",
    "tests/test_a.py": "def test_x():\n    assert 1 + 1 == 2\n\n\ndef test_y():\n    assert 1 == 2\n",
    "tests/test_b.py": "from pkg.helpers import ready\n\n\ndef test_z():\n    assert True\n",
    "tests/test_u.py": UNIT,
}


def second(tmp_path: Path, python: str, names: list[str], file: str = "") -> tuple[str | None, str]:
    """A second run of the tests ``names`` (pytest node ids or unittest ids; ``file``: where the first run
    saw them, else their own) over :data:`TREE` outside any sandbox: (the judgement, the report)."""
    repo, eval_dir = tmp_path / "repo", tmp_path / "eval"
    for rel, source in TREE.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(source)
    eval_dir.mkdir()
    required = [
        sr.Required(n, str(repo / (file or n.split("::")[0])), sr.PYTEST)
        if "::" in n
        else sr.Required(n, str(repo / "tests" / "test_u.py"), sr.UNITTEST)
        for n in names
    ]
    texts, why = [], None
    for group in sr.by_runner(required):
        harness, socket_path = sr.place(eval_dir, str(eval_dir), str(repo))
        sink = ReportListener(socket_path)
        try:
            command = sr.command(harness, group).replace("python3 ", f"{python} ")
            env = {"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1", **sr.env(harness)}
            done = subprocess.run(
                ["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True, check=False,
                timeout=120,
            )  # fmt: skip
            texts.append(sink.collect())
        finally:
            sink.close()
        why = why or sr.judge(texts[-1], done.returncode, group)
    return why, "\n".join(texts)


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_second_harness_runs_pytest_and_unittest_tests_for_real(tmp_path: Path, python: str) -> None:
    why, text = second(tmp_path / "ok", python, ["tests/test_a.py::test_x", "tests.test_u.T.test_u"])
    assert why is None, text
    why, text = second(tmp_path / "discovered", python, ["test_u.T.test_u"])  # ``discover -s tests``
    assert why is None, text
    why, _ = second(tmp_path / "failing", python, ["tests/test_a.py::test_y"])
    assert why is not None and "FAILED in the second run" in why
    why, _ = second(tmp_path / "elsewhere", python, ["tests/test_a.py::test_x"], "tests/test_b.py")
    assert why is not None


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_second_harness_reports_a_fixture_from_outside_test_files(tmp_path: Path, python: str) -> None:
    why, text = second(tmp_path, python, ["tests/test_b.py::test_z"])
    assert why is None, text
    events = report.audit(text)
    assert any(e.kind == "fixture" and e.actor.endswith("pkg/helpers.py") for e in events), events


@pytest.mark.parametrize("python", INTERPRETERS)
def test_the_second_runs_audit_hook_reports_what_the_code_did(tmp_path: Path, python: str) -> None:
    why, text = second(tmp_path, python, ["tests/test_c.py::test_spawns"])
    assert why is None, text
    events = report.audit(text)
    assert any(e.kind == "process" and e.actor.endswith("pkg/spawn.py") for e in events), events
