"""Host-side work on a patched tree, tried as a hostile patch would plant things: links out of the copy,
files where directories belong, bytecode anywhere. Nothing outside the copy is read, written or deleted."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus.grading import trees


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "keep.pyc").write_text("host file")
    (secret / "__pycache__").mkdir()
    (secret / "target.py").write_text("host file")
    return secret


def make_repo(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "core.py").write_text("x = 1\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_core.py").write_text("def test(): pass\n")
    return root


def test_changes_are_measured_without_following_links(tmp_path: Path, outside: Path) -> None:
    image = make_repo(tmp_path / "image")
    before = trees.snapshot(image)
    repo = tmp_path / "repo"
    trees.copy_tree(image, repo)
    (repo / "pkg" / "core.py").write_text("x = 2\n")
    (repo / "tests" / "test_core.py").unlink()
    (repo / "tests" / "test_core.py").symlink_to(outside / "target.py")
    (repo / "escape").symlink_to(outside)
    (repo / "pkg" / "new.py").write_text("")
    assert trees.changes(image, before, repo) == {
        "pkg/core.py": "modified",
        "tests/test_core.py": "modified",  # a file became a link
        "escape": "added",
        "pkg/new.py": "added",
    }


def test_same_content_new_mtime_is_not_a_change_but_a_mode_is(tmp_path: Path) -> None:
    image = make_repo(tmp_path / "image")
    before = trees.snapshot(image)
    repo = tmp_path / "repo"
    trees.copy_tree(image, repo)
    os.utime(repo / "pkg" / "core.py", (1, 1))
    assert trees.changes(image, before, repo) == {}
    (repo / "pkg" / "core.py").chmod(0o755)
    assert trees.changes(image, before, repo) == {"pkg/core.py": "modified"}


def test_bytecode_removal_stays_inside(tmp_path: Path, outside: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "pkg" / "__pycache__").mkdir()
    (repo / "pkg" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"\x00")
    (repo / "core.pyc").write_bytes(b"\x00")
    (repo / "link.pyc").symlink_to(outside / "keep.pyc")
    (repo / "tests" / "__pycache__").symlink_to(outside / "__pycache__")
    (repo / "deep").symlink_to(outside)
    assert trees.remove_bytecode(repo) == 4
    assert not any(p.name.endswith(".pyc") or p.name == "__pycache__" for p in repo.rglob("*"))
    assert (outside / "keep.pyc").read_text() == "host file" and (outside / "__pycache__").is_dir()


@pytest.mark.parametrize("plant", ["link_dir", "link_file", "file_as_dir", "dir_as_file"])
def test_eval_files_replace_what_the_patch_planted(tmp_path: Path, outside: Path, plant: str) -> None:
    repo = make_repo(tmp_path / "repo")
    hidden = repo / "tests" / "hidden" / "test_h.py"
    if plant == "link_dir":
        (repo / "tests" / "hidden").symlink_to(outside)
    elif plant == "link_file":
        hidden.parent.mkdir()
        hidden.symlink_to(outside / "target.py")
    elif plant == "file_as_dir":
        (repo / "tests" / "hidden").write_text("not a dir")
    else:
        hidden.mkdir(parents=True)
        (hidden / "inner.py").write_text("")
    trees.place_file(repo, "tests/hidden/test_h.py", b"real test")
    assert hidden.read_bytes() == b"real test" and not hidden.is_symlink()
    assert not (repo / "tests" / "hidden").is_symlink()
    assert sorted(p.name for p in outside.iterdir()) == ["__pycache__", "keep.pyc", "target.py"]
    assert (outside / "target.py").read_text() == "host file"


@pytest.mark.parametrize("dest", ["/etc/x.py", "../x.py", "a/../../x.py", ""])
def test_eval_file_destinations_stay_inside(tmp_path: Path, dest: str) -> None:
    with pytest.raises(ValueError):
        trees.place_file(make_repo(tmp_path / "repo"), dest, b"")


def test_package_dirs(tmp_path: Path) -> None:
    assert trees.package_dirs(make_repo(tmp_path / "repo")) == {"pkg"}


names = st.sampled_from(["a.py", "b.py", "c", "__init__.py"])


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.sampled_from(["write", "delete", "mkdir"]), st.lists(names, min_size=1, max_size=3))
    )
)
def test_changes_name_exactly_what_was_done(tmp_path_factory: pytest.TempPathFactory, ops: list) -> None:
    """Whatever files are written, deleted or made, ``changes`` names every path whose entry differs."""
    base = tmp_path_factory.mktemp("prop")
    image = make_repo(base / "image")
    before = trees.snapshot(image)
    repo = base / "repo"
    trees.copy_tree(image, repo)
    for op, parts in ops:
        path = repo.joinpath(*parts)
        if op == "write" and not path.is_dir() and path.parent.is_dir():
            path.write_text(f"{parts}")
        elif op == "delete" and path.is_file():
            path.unlink()
        elif op == "mkdir" and path.parent.is_dir() and not path.exists():
            path.mkdir()
    after = trees.snapshot(repo)
    expected = {rel for rel in before.keys() ^ after.keys()}
    expected |= {
        rel for rel in before.keys() & after.keys()
        if before[rel].kind == "file" and (image / rel).read_bytes() != (repo / rel).read_bytes()
    }  # fmt: skip
    assert set(trees.changes(image, before, repo)) == expected


def test_protected_dirs_are_the_outermost_real_test_directories(tmp_path: Path, outside: Path) -> None:
    repo = make_repo(tmp_path / "repo")
    (repo / "tests" / "unit").mkdir()
    (repo / "test_top.py").write_text("")
    (repo / "linked").symlink_to(outside)
    files = {
        "tests/unit/test_a.py",
        "tests/test_core.py",
        "test_top.py",
        "linked/test_x.py",
        "../up.py",
        "gone/t.py",
    }
    assert trees.protected_dirs(repo, files) == ["test_top.py", "tests"]
