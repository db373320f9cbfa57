"""The grader's pure parts: patch sanitising, machinery flags, rows and verdicts, tried exhaustively."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollbus.grading import flags as fl
from rollbus.grading.patches import PatchRejected, added_lines, header_paths, sanitize, unquote
from rollbus.grading.rows import BadRow, EvalCmd, F2PScript, Swepro, absolute_paths, parse_row, string_list
from rollbus.grading.run import untouched_python_files
from rollbus.grading.trees import Entry
from rollbus.grading.verdict import TestResult, final, parse_parser_output, swepro_outcome

TEXT = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
BINARY = (
    "diff --git a/img.png b/img.png\nnew file mode 100644\nindex 0000000..1111111\nGIT binary patch\n"
    "literal 3\nKcmZQz00001\n\nliteral 0\nHcmV?d00001\n\n"
)


# -- patches ------------------------------------------------------------------------------------------------


def test_binary_sections_are_stripped_and_text_kept() -> None:
    clean = sanitize(TEXT + BINARY, 10_000)
    assert clean.patch == TEXT.encode()
    assert clean.stripped_binary == ("img.png",)
    assert (
        sanitize(
            BINARY.replace("GIT binary patch", "Binary files a/img.png and b/img.png differ"), 10_000
        ).patch
        == b""
    )


def test_preamble_is_dropped_and_plain_unified_diffs_accepted() -> None:
    assert sanitize("From: someone\nSubject: hi\n\n" + TEXT, 10_000).patch == TEXT.encode()
    plain = "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+b\n"
    assert sanitize(plain, 10_000).paths == ("x.py",)


@pytest.mark.parametrize(
    ("patch", "kind"),
    [
        (TEXT * 100, "patch_too_large"),
        ("nothing to see\n", "malformed_patch"),
        (TEXT.replace("+b", "+\x00"), "malformed_patch"),
        (TEXT.replace("x.py", "../x.py"), "malformed_patch"),
        ("--- /etc/passwd\n+++ /etc/passwd\n@@ -1 +1 @@\n-a\n+b\n", "malformed_patch"),
    ],
)
def test_unusable_patches_are_named_failures(patch: str, kind: str) -> None:
    with pytest.raises(PatchRejected) as caught:
        sanitize(patch, 1000)
    assert caught.value.kind == kind


def test_only_newlines_end_lines() -> None:
    """A form feed inside a hunk line (Python sources have them) does not start a fake file section."""
    patch = TEXT.replace("+b\n", "+b\x0cdiff --git a/evil b/evil\n")
    assert sanitize(patch, 10_000).paths == ("x.py",)


def test_empty_patch_is_empty() -> None:
    assert sanitize("", 10).patch == b"" and sanitize(b"\n  \n", 10).patch == b""


def test_quoted_and_spaced_paths() -> None:
    assert (
        header_paths('"a/sp\\303\\251cial name.py" "b/sp\\303\\251cial name.py"') == ["spécial name.py"] * 2
    )
    assert header_paths("a/my file.py b/my file.py") == ["my file.py", "my file.py"]
    assert unquote('"tab\\there"') == "tab\there"


def test_added_lines_skip_headers() -> None:
    assert added_lines(TEXT) == ["b"]


@given(st.text(max_size=400))
def test_sanitize_only_ever_rejects_by_name(text: str) -> None:
    try:
        clean = sanitize(text, 300)
    except PatchRejected as exc:
        assert exc.kind in ("patch_too_large", "malformed_patch", "unsupported_patch_format")
    else:
        data = text.encode("utf-8", errors="surrogateescape")
        assert b"\x00" not in clean.patch and len(clean.patch) <= len(data) + len(clean.sections)
        assert all(
            not PurePosixPath(p).is_absolute() and ".." not in PurePosixPath(p).parts for p in clean.paths
        )


# -- flags --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "change", "flag"),
    [
        ("tests/test_calc.py", "modified", fl.TOUCHES_TESTS),
        ("tests/test_calc.py", "deleted", fl.TOUCHES_TESTS),
        ("pkg/conftest.py", "added", fl.TOUCHES_CONFTEST),
        ("setup.cfg", "added", fl.TOUCHES_TEST_CONFIG),
        ("pyproject.toml", "modified", fl.TOUCHES_TEST_CONFIG),
        ("tox.ini", "added", fl.TOUCHES_TEST_CONFIG),
        ("lib/sitecustomize.py", "added", fl.SITE_HOOKS),
        ("usercustomize/__init__.py", "added", fl.SITE_HOOKS),
        ("x.pth", "added", fl.SITE_HOOKS),
        ("pkg/__pycache__/m.cpython-311.pyc", "added", fl.TOUCHES_BYTECODE),
        ("m.pyc", "added", fl.TOUCHES_BYTECODE),
        ("unittest/__main__.py", "added", fl.SHADOWS_STDLIB),
        ("unittest", "added", fl.SHADOWS_STDLIB),
        ("json.py", "added", fl.SHADOWS_STDLIB),
        ("tests/random.py", "added", fl.SHADOWS_STDLIB),
        (".git/hooks/pre-commit", "added", fl.TOUCHES_GIT),
        ("evil-1.0.dist-info/entry_points.txt", "added", fl.SITE_HOOKS),
        ("src/x.egg-info/entry_points.txt", "added", fl.SITE_HOOKS),
        ("pytest.py", "added", fl.SHADOWS_TOOLCHAIN),
        ("tests/_pytest/__init__.py", "added", fl.SHADOWS_TOOLCHAIN),
    ],
)
def test_machinery_paths_are_flagged(path: str, change: str, flag: str) -> None:
    parents = [str(p) for p in PurePosixPath(path).parents if str(p) != "."]
    changes = {path: change} | {p: "added" for p in parents if change == "added"}  # as trees.changes has it
    assert flag in fl.path_flags(changes, (), {"pkg"}, frozenset({"pytest", "_pytest"}))
    assert flag in fl.ZEROING


@pytest.mark.parametrize(
    "path", ["pkg/json.py", "pkg/core.py", "tests/test_new.py", "README.md", "test/helpers.py", "docs/x.md"]
)
def test_ordinary_changes_are_not_flagged(path: str) -> None:
    assert fl.path_flags({path: "added"}, (), {"pkg"}) == set()


def test_a_new_package_init_in_a_test_directory_is_flagged() -> None:
    assert fl.path_flags({"tests/__init__.py": "added"}, (), ()) == {fl.TOUCHES_TESTS}
    assert fl.path_flags({"pkg/__init__.py": "added"}, (), ()) == set()


def test_row_test_files_are_flagged_even_when_added() -> None:
    assert fl.path_flags({"tests/test_hidden.py": "added"}, {"tests/test_hidden.py"}, ()) == {
        fl.TOUCHES_TESTS
    }


def test_modifying_an_existing_toolchain_module_is_not_shadowing() -> None:
    """A repository that is pytest edits its own ``src/_pytest``: only new modules of these names are fake."""
    assert fl.SHADOWS_TOOLCHAIN not in fl.path_flags({"src/_pytest/runner.py": "modified"}, (), set())


@given(
    st.lists(
        st.sampled_from(["a", "tests", "pkg", "json", "x.py", "conftest.py", "__init__.py"]),
        min_size=1,
        max_size=4,
    )
)
def test_stdlib_shadowing_needs_a_stdlib_name(parts: list[str]) -> None:
    path = PurePosixPath(*parts)
    if fl.shadows_stdlib(path, set()):
        assert any(fl.module_name(p) in fl.STDLIB for p in parts)


# -- rows ---------------------------------------------------------------------------------------------------


def row(**metadata: object) -> dict[str, object]:
    return {"prompt": "p", "metadata": {"image": "img", "workdir": "/workspace", **metadata}}


SWEPRO = {
    "run_script_path": "run.sh",
    "parser_script_path": "parser.py",
    "before_repo_set_cmd": "git reset --hard b\ngit checkout f -- t.py\n",
    "selected_test_files_to_run": "['t.py']",
    "fail_to_pass": '["t.py::a"]',
    "pass_to_pass": "[]",
}


def test_each_grader_kind_parses(tmp_path: Path) -> None:
    assert isinstance(parse_row(row(eval_cmd="pytest"), tmp_path).grader, EvalCmd)
    f2p = parse_row(row(remote_env_info={"f2p_script": "import sys"}), tmp_path)
    assert isinstance(f2p.grader, F2PScript)
    spec = parse_row(row(swepro=SWEPRO), tmp_path)
    assert isinstance(spec.grader, Swepro)
    assert spec.grader.selected_test_files == ("t.py",) and spec.grader.required == ("t.py::a",)
    assert spec.grader.restore_cmd == "git checkout f -- t.py"
    assert spec.grader.run_script == tmp_path / "run.sh" and spec.image == tmp_path / "img"
    assert spec.test_files() == {"t.py"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (row(), "no grader"),
        (row(eval_cmd="x", swepro=SWEPRO), "more than one grader"),
        (row(eval_cmd="x", workdir="relative"), "workdir"),
        ({"metadata": "{not json"}, "not JSON"),
        ({"metadata": {"workdir": "/w", "eval_cmd": "x"}}, "no image"),
        (row(swepro={**SWEPRO, "fail_to_pass": "not a list"}), "list literal"),
        (row(swepro={**SWEPRO, "before_repo_set_cmd": ""}), "before_repo_set_cmd"),
        (row(eval_cmd="x", eval_files={"../up.py": "a"}), "inside the workdir"),
    ],
)
def test_bad_rows_say_why(bad: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(BadRow, match=message):
        parse_row(bad, tmp_path)


@given(st.lists(st.text(max_size=10), max_size=5))
def test_string_lists_as_lists_or_literals(items: list[str]) -> None:
    assert string_list(items, "x") == items
    assert string_list(repr(items), "x") == items
    assert string_list(json.dumps(items), "x") == items


def test_absolute_paths_resolve_every_host_path(tmp_path: Path) -> None:
    metadata = {"image": "images/a", "swepro": dict(SWEPRO), "eval_files": {"t.py": "hidden/t.py"}}
    out = absolute_paths(metadata, tmp_path)
    assert out["image"] == str(tmp_path / "images/a")
    assert out["swepro"]["parser_script_path"] == str(tmp_path / "parser.py")
    assert out["eval_files"] == {"t.py": str(tmp_path / "hidden/t.py")}
    assert metadata["image"] == "images/a"  # the input is not changed


# -- verdicts -----------------------------------------------------------------------------------------------


def test_swepro_needs_every_required_test_passed() -> None:
    passed = [TestResult("a", "PASSED"), TestResult("b", "PASSED")]
    assert swepro_outcome(passed, ["a", "b"]).solved
    assert swepro_outcome(passed, ["a", "c"]).failure_kind == "tests_failed"
    assert ("c", "MISSING") in [(t.name, t.status) for t in swepro_outcome(passed, ["a", "c"]).tests]
    assert not swepro_outcome([TestResult("a", "SKIPPED")], ["a"]).solved
    assert not swepro_outcome([TestResult("a", "ERROR")], ["a"]).solved
    assert swepro_outcome([], ["a"]).failure_kind == "no_tests"
    assert swepro_outcome(passed, []).failure_kind == "no_tests"


statuses = st.sampled_from(["PASSED", "FAILED", "SKIPPED", "ERROR", "passed", "weird"])


@given(st.lists(st.tuples(st.sampled_from("abcd"), statuses), max_size=8), st.lists(st.sampled_from("abcd")))
def test_swepro_solved_iff_every_required_name_only_ever_passed(
    reports: list[tuple[str, str]], required: list[str]
) -> None:
    parsed = parse_parser_output(json.dumps({"tests": [{"name": n, "status": s} for n, s in reports]}))
    outcome = swepro_outcome(parsed, required)
    only_passed = {n for n, _ in reports} - {n for n, s in reports if s.upper() != "PASSED"}
    assert outcome.solved == (bool(reports) and bool(required) and set(required) <= only_passed)


@pytest.mark.parametrize("text", ["[]", '{"tests": {}}', '{"tests": [{"status": "PASSED"}]}', "not json"])
def test_malformed_parser_output_is_rejected(text: str) -> None:
    with pytest.raises(ValueError):
        parse_parser_output(text)


def test_zeroing_flags_zero_a_solved_grade() -> None:
    solved = swepro_outcome([TestResult("a", "PASSED")], ["a"])
    assert final(solved, {fl.SITE_HOOKS}, fl.ZEROING, {}).reward == 0.0
    assert final(solved, {fl.SITE_HOOKS}, fl.ZEROING, {}).failure_kind == "flagged"
    assert final(solved, {fl.BINARY_STRIPPED}, fl.ZEROING, {}).reward == 1.0
    assert final(solved, {fl.SITE_HOOKS}, (), {}).reward == 1.0


def test_only_base_python_files_the_patch_left_alone_may_hold_tests() -> None:
    """What a row's command over a whole directory may collect besides the files it names: not a file the
    patch added, edited or deleted, nothing under ``.git``, no directory."""
    file, folder = Entry("file", 0o644, 1, 0), Entry("dir", 0o755, 0, 0)
    pristine = {
        "tests": folder, "tests/test_old.py": file, "tests/test_edited.py": file, "tests/test_gone.py": file,
        "tests/data.txt": file, ".git/hooks/x.py": file, "pkg.py": folder,
    }  # fmt: skip
    changed = {"tests/test_edited.py": "modified", "tests/test_gone.py": "deleted", "tests/new.py": "added"}
    assert untouched_python_files(pristine, changed) == {"tests/test_old.py"}
