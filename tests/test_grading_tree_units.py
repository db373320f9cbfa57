"""The grader's strict patch reading, tree flags and host-side restore, tried with the patches and trees an
attacker would write: other diff formats, paths past the first hunk, upper-case metadata, modules that shadow
the test toolchain, a later commit's files taken out without a checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus.grading import flags as fl
from rollbus.grading import toolchain, trees
from rollbus.grading.patches import PatchRejected, sanitize
from rollbus.grading.rows import BadRow, parse_restore

UNIFIED = b"diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
CONTEXT = b"*** a/x.py\n--- b/x.py\n***************\n*** 1,2 ****\n  a\n! b\n--- 1,2 ----\n  a\n! c\n"


def kind_of(patch: bytes) -> str | None:
    try:
        sanitize(patch, 100_000)
    except PatchRejected as exc:
        return exc.kind
    return None


@pytest.mark.parametrize(
    "patch",
    [
        CONTEXT,  # a context diff alone
        UNIFIED + CONTEXT,  # behind a unified section (GNU patch applied both)
        UNIFIED + b"***************\n*** 1 ****\n! b\n--- 1 ----\n! c\n",  # context hunks in a git section
        b"2c2\n< b\n---\n> c\n",  # a normal diff
        b"2c\nc\n.\n",  # an ed diff
        UNIFIED + b"2c2\n< b\n---\n> c\n",
        b"d2 1\na2 1\nc\n",  # RCS
    ],
)
def test_other_diff_formats_are_refused_by_name(patch: bytes) -> None:
    assert kind_of(patch) == "unsupported_patch_format"


@pytest.mark.parametrize(
    "smuggled",
    [
        b"--- a/../up.py\n+++ b/../up.py\n@@ -1 +1 @@\n-a\n+b\n",  # a second file header after the hunk
        b"diff --git a/y.py b/y.py\nrename from y.py\nrename to ../y.py\n",
        b"diff --git a/y.py b/y.py\ncopy from /etc/passwd\ncopy to y.py\n",
        b"diff --git a/../y b/../y\n--- a/../y\n+++ b/../y\n@@ -1 +1 @@\n-a\n+b\n",
        b"--- a/y.py\n+++ /etc/cron.d/y\n@@ -1 +1 @@\n-a\n+b\n",
    ],
)
def test_every_file_header_is_checked_not_only_the_first(smuggled: bytes) -> None:
    assert kind_of(UNIFIED + smuggled) == "malformed_patch"


@pytest.mark.parametrize(
    "junk",
    [
        b"rename from ../y.py\n",  # a git header line with no diff --git before it
        b"some words between sections\n",
        b" a\n",  # more lines than the hunk counts
    ],
)
def test_nothing_outside_the_counted_hunks_reaches_git_apply(junk: bytes) -> None:
    assert kind_of(UNIFIED + junk + UNIFIED.replace(b"x.py", b"z.py")) == "malformed_patch"


def test_a_short_hunk_is_malformed() -> None:
    assert kind_of(UNIFIED.replace(b"+c\n", b"")) == "malformed_patch"


def test_what_is_offered_is_what_was_parsed() -> None:
    """Blank lines, a mail preamble and a format-patch signature are dropped; hunks keep every byte."""
    latin1 = UNIFIED.replace(b"+c", b"+caf\xe9\r")
    mail = b"From: x\nSubject: [PATCH] y\n\n" + latin1 + b"\n" + b"-- \n2.39.5\n\n"
    clean = sanitize(mail, 10_000)
    assert clean.patch == latin1 and clean.paths == ("x.py",)
    assert sanitize(latin1.decode("utf-8", errors="surrogateescape"), 10_000).patch == latin1


def test_sections_into_the_git_directory_are_stripped() -> None:
    hook = b"--- /dev/null\n+++ b/.GIT/hooks/post-checkout\n@@ -0,0 +1 @@\n+exit 0\n"
    clean = sanitize(UNIFIED + hook, 10_000)
    assert clean.patch == UNIFIED and clean.stripped_git == (".GIT/hooks/post-checkout",)


lines = st.lists(st.sampled_from([b"a", b"b", b"caf\xe9", b"+x", b"-y", b"*** 1 ****", b"@@ x"]), max_size=4)


@given(st.lists(st.tuples(lines, lines), min_size=1, max_size=3))
def test_git_style_patches_round_trip(hunks: list[tuple[list[bytes], list[bytes]]]) -> None:
    """Any unified diff of any bytes is offered to git apply exactly as written."""
    body = b""
    for old, new in hunks:
        body += b"@@ -1,%d +1,%d @@\n" % (len(old), len(new))
        body += b"".join(b"-" + line + b"\n" for line in old) + b"".join(b"+" + line + b"\n" for line in new)
    patch = b"diff --git a/f b/f\n--- a/f\n+++ b/f\n" + body
    assert sanitize(patch, 100_000).patch == patch


# -- flags on the tree --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "planted",
    ["X-1.0.DIST-INFO", "x-1.0.Dist-Info", "src/X.EGG-INFO", "EVIL.PTH", "x.Egg-Link"],
)
def test_metadata_names_are_compared_as_their_loader_compares_them(planted: str) -> None:
    changes = {planted: "added", f"{planted}/entry_points.txt": "added"}
    assert fl.SITE_HOOKS in fl.path_flags(changes, (), set())


def test_the_toolchain_is_pytests_installed_closure() -> None:
    """Read from the distributions the tests' python3 has: pytest's own modules and its requirements'."""
    modules = toolchain.modules()
    assert {"pytest", "_pytest", "pluggy", "iniconfig", "packaging"} <= modules
    requires = subprocess.run(
        ["python3", "-c", "import importlib.metadata as m; print(m.requires('pytest'))"],
        env={"PATH": toolchain.SANDBOX_PATH},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "attrs" in requires:  # pytest before 7.3
        assert {"attr", "attrs"} <= modules
    assert not modules & {"lrucache", "calc", "json", "tests"}


@pytest.mark.parametrize("where", ["", "tests/", "src/"])
def test_a_new_module_of_the_toolchain_is_flagged(where: str) -> None:
    """Every module of the closure, as a package or a module file, where ``sys.path`` finds it first."""
    modules = toolchain.modules()
    for name in modules:
        for changes in (
            {f"{where}{name}": "added", f"{where}{name}/__init__.py": "added"},
            {f"{where}{name}.py": "added"},
        ):
            assert fl.SHADOWS_TOOLCHAIN in fl.path_flags(changes, (), set(), modules), changes


def test_the_repositorys_own_toolchain_package_may_grow() -> None:
    """The packaging project adds a module to its own packaging/: not a shadow (the package was there)."""
    changes = {"packaging/new.py": "added"}
    assert fl.SHADOWS_TOOLCHAIN not in fl.path_flags(changes, (), set(), frozenset({"packaging"}))
    assert fl.SHADOWS_TOOLCHAIN not in fl.path_flags(changes, (), {"pkg"}, frozenset({"pkg"}))


# -- swepro's later commit, read on the host -----------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "git checkout fix",
        "git checkout -f fix -- t.py",
        "git checkout fix -- ../t.py",
        "git checkout fix -- /etc/t.py",
        "git checkout fix -- .",
        "bash restore.sh",
        "git checkout fix -- 'unterminated",
    ],
)
def test_restore_lines_other_than_a_checkout_of_paths_are_bad_rows(line: str) -> None:
    with pytest.raises(BadRow):
        parse_restore(line)


def test_restore_line_parts() -> None:
    assert parse_restore("git checkout abc123 -- tests/a.py 'tests/b c.py' ") == (
        "abc123",
        ("tests/a.py", "tests/b c.py"),
    )


def test_later_commit_files_are_read_without_a_checkout(tmp_path: Path) -> None:
    image = tmp_path / "image"
    (image / "tests" / "deep").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    (image / "tests" / "a.py").write_text("old\n")
    subprocess.run([*git, "init", "-q"], cwd=image, check=True)
    subprocess.run([*git, "add", "-A"], cwd=image, check=True)
    subprocess.run([*git, "commit", "-qm", "base", "--allow-empty"], cwd=image, check=True)
    subprocess.run([*git, "checkout", "-qb", "fix"], cwd=image, check=True)
    (image / "tests" / "a.py").write_bytes(b"new caf\xe9\n")
    (image / "tests" / "deep" / "run.sh").write_text("#!/bin/sh\n")
    (image / "tests" / "deep" / "run.sh").chmod(0o755)
    (image / "tests" / "link.py").symlink_to("a.py")
    subprocess.run([*git, "add", "-A"], cwd=image, check=True)
    subprocess.run([*git, "commit", "-qm", "fix"], cwd=image, check=True)
    subprocess.run([*git, "checkout", "-q", "main"], cwd=image, check=True)
    before = sorted(p.name for p in (image / ".git").iterdir())
    out = tmp_path / "out"
    got = trees.checkout_files(image, "fix", ("tests/a.py", "tests/deep", "tests/link.py"), out)
    assert sorted(got) == ["tests/a.py", "tests/deep/run.sh", "tests/link.py"]
    assert (out / "tests" / "a.py").read_bytes() == b"new caf\xe9\n"
    assert (out / "tests" / "deep" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (out / "tests" / "link.py").is_symlink() and (out / "tests" / "link.py").readlink() == Path("a.py")
    assert (image / "tests" / "a.py").read_text() == "old\n"  # the image is untouched
    assert sorted(p.name for p in (image / ".git").iterdir()) == before
    with pytest.raises(trees.RestoreFailed, match="tests/none.py"):
        trees.checkout_files(image, "fix", ("tests/none.py",), tmp_path / "out2")

    repo = tmp_path / "repo"
    (repo / "tests" / "link.py").mkdir(parents=True)  # the patch planted a directory where a file goes
    trees.overlay(out, repo, got)
    assert (repo / "tests" / "link.py").is_symlink()
    assert (repo / "tests" / "a.py").read_bytes() == b"new caf\xe9\n"


# -- git's own diffs ----------------------------------------------------------------------------------------

contents = st.lists(
    st.sampled_from([b"a", b"b", b"caf\xe9", b"\x0cform feed", b"cr\r", b"", b"--- x", b"+++ y", b"@@ z"]),
    max_size=6,
).map(lambda ls: b"\n".join(ls))
edits = st.lists(
    st.tuples(
        st.sampled_from(["write", "delete", "chmod", "rename", "link"]),
        st.sampled_from(["f.py", "d/g.txt", "sp ace.txt", "caf\xe9.txt"]),
        contents,
    ),
    min_size=1,
    max_size=5,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits)
def test_gits_own_diffs_round_trip_and_apply(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    """Whatever the agent's tree holds, the runner's ``git diff --binary`` is read whole and, offered to
    ``git apply`` on the base, rebuilds the agent's tree."""
    root = tmp_path_factory.mktemp("diff")
    base, work = root / "base", root / "work"
    (base / "d").mkdir(parents=True)
    for name in ("f.py", "d/g.txt", "sp ace.txt"):
        (base / name).write_bytes(b"one\ntwo\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "core.quotePath=true"]
    subprocess.run([*git, "init", "-q"], cwd=base, check=True)
    subprocess.run([*git, "add", "-A"], cwd=base, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=base, check=True)
    subprocess.run(["cp", "-a", str(base), str(work)], check=True)
    for op, name, data in ops:
        path = work / name
        if op == "write":
            if path.is_symlink():
                path.unlink()
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(data)
        elif op == "delete" and (path.exists() or path.is_symlink()):
            path.unlink()
        elif op == "chmod" and path.is_file() and not path.is_symlink():
            path.chmod(0o755)
        elif op == "rename" and path.is_file() and not path.is_symlink():
            path.rename(work / f"moved-{path.name}")
        elif op == "link" and not path.exists() and not path.is_symlink():
            path.symlink_to("f.py")
    subprocess.run([*git, "add", "-A"], cwd=work, check=True)
    diff = subprocess.run(
        [*git, "diff", "--cached", "--binary", "HEAD"], cwd=work, check=True, capture_output=True
    ).stdout
    clean = sanitize(diff, 1_000_000)
    if not clean.stripped_binary:
        assert clean.patch == diff
    if clean.patch:
        subprocess.run([*git, "apply", "--index", "-"], input=clean.patch, cwd=base, check=True)
    subprocess.run([*git, "commit", "-qm", "applied", "--allow-empty"], cwd=base, check=True)
    tree = ["rev-parse", "HEAD^{tree}"]
    if not clean.stripped_binary:
        got = subprocess.run([*git, *tree], cwd=base, capture_output=True, check=True).stdout
        want = subprocess.run([*git, "write-tree"], cwd=work, capture_output=True, check=True).stdout
        assert got == want
