"""PEP 706's ``tar`` filter on every Python: the native one, and the fallback the rollbus image's Debian
3.11.2 runs (``native=False`` forces it here). Each hostile archive is refused, or defused, by both."""

from __future__ import annotations

import io
import stat
import tarfile
from pathlib import Path

import pytest

from rollbus.tar_extract import extract_tar

BOTH = pytest.mark.parametrize("native", [True, False], ids=["native", "fallback"])


def archive(*members: tuple[str, str, str | bytes]) -> tarfile.TarFile:
    """A tarball of (kind, name, content-or-link-target) members, kind one of file, dir, sym, hard."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for kind, name, content in members:
            info = tarfile.TarInfo(name)
            data = content.encode() if isinstance(content, str) else content
            if kind == "file":
                info.size, info.mode = len(data), 0o4777
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE}[kind]
            info.mode = 0o755
            if kind in ("sym", "hard"):
                info.linkname = str(content)
            tar.addfile(info)
    buffer.seek(0)
    return tarfile.open(fileobj=buffer)


@BOTH
def test_a_tree_unpacks_with_its_links_and_without_setuid_or_shared_write_bits(
    native: bool, tmp_path: Path
) -> None:
    tar = archive(("dir", "repo", ""), ("file", "repo/a.py", "x = 1\n"), ("sym", "repo/b.py", "a.py"),
                  ("hard", "repo/c.py", "repo/a.py"), ("file", "/repo/abs.py", "y\n"))  # fmt: skip
    extract_tar(tar, tmp_path, native=native)
    repo = tmp_path / "repo"
    assert (repo / "b.py").read_text() == (repo / "c.py").read_text() == "x = 1\n"
    assert (repo / "b.py").is_symlink() and (repo / "abs.py").read_text() == "y\n"
    assert stat.S_IMODE((repo / "a.py").stat().st_mode) == 0o755


@BOTH
@pytest.mark.parametrize(
    "members",
    [
        [("file", "../escaped", "x")],
        [("file", "repo/../../escaped", "x")],
        [("hard", "repo/link", "../escaped")],
        [("sym", "out", "{outside}"), ("file", "out/escaped", "x")],
    ],
    ids=["dotdot", "nested-dotdot", "hardlink-out", "through-a-symlink"],
)
def test_nothing_is_written_outside_the_destination(
    native: bool, members: list[tuple[str, str, str]], tmp_path: Path
) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (tmp_path / "escaped").write_text("original")
    tar = archive(*((k, n, c.format(outside=outside)) for k, n, c in members))
    if native and members[0][0] == "hard":  # the native tar filter links by name; nothing is written there
        extract_tar(tar, dest, native=native)
    else:
        with pytest.raises(tarfile.TarError):
            extract_tar(tar, dest, native=native)
    assert (tmp_path / "escaped").read_text() == "original" and not list(outside.iterdir())
