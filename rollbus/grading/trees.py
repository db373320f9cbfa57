"""Host-side work on the grading copy of a repository: what changed, stale bytecode, eval-only files.

Everything here walks with ``lstat`` and never follows a symlink, because the tree has just been rewritten by
a hostile patch: a planted link must not make the host read, write or delete outside the copy. Changes are
measured against the pristine image by comparing entries (type, mode, size, content), not by asking git,
whose configuration the patch may have rewritten.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rollbus.grading.flags import Change


@dataclass(frozen=True)
class Entry:
    kind: str  # "file", "link", "dir", "other"
    mode: int
    size: int
    mtime_ns: int


def snapshot(root: Path) -> dict[str, Entry]:
    """Every entry under ``root`` (relative POSIX path -> :class:`Entry`), symlinks not followed."""
    entries: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            info = os.lstat(full)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            entries[rel] = Entry(
                _kind(info.st_mode), stat.S_IMODE(info.st_mode), info.st_size, info.st_mtime_ns
            )
    return entries


GIT_BOOKKEEPING = (".git/index", ".git/objects/")  # what ``git apply --3way`` itself writes


def changes(before_root: Path, before: dict[str, Entry], after_root: Path) -> dict[str, Change]:
    """Paths added, modified or deleted between the pristine tree and the patched one (directories: only
    when they appear or vanish). The index and new objects that ``git apply --3way`` writes are not changes;
    anything else under ``.git`` is."""
    after = {k: v for k, v in snapshot(after_root).items() if not _bookkeeping(k, before)}
    before = {k: v for k, v in before.items() if k != GIT_BOOKKEEPING[0]}
    out: dict[str, Change] = {}
    for rel in before.keys() - after.keys():
        out[rel] = "deleted"
    for rel in after.keys() - before.keys():
        out[rel] = "added"
    for rel in before.keys() & after.keys():
        old, new = before[rel], after[rel]
        if old.kind != new.kind or old.mode != new.mode:
            out[rel] = "modified"
        elif new.kind in ("dir", "other") or old == new:
            continue
        elif old.size != new.size or _content(before_root / rel, new.kind) != _content(
            after_root / rel, new.kind
        ):
            out[rel] = "modified"
    return out


def _bookkeeping(rel: str, before: dict[str, Entry]) -> bool:
    return rel == GIT_BOOKKEEPING[0] or (rel.startswith(GIT_BOOKKEEPING[1]) and rel not in before)


def package_dirs(root: Path) -> set[str]:
    """Directories (relative) that hold an ``__init__.py``, i.e. are packages, not ``sys.path`` roots."""
    found = set()
    for dirpath, _dirs, filenames in os.walk(root, followlinks=False):
        if "__init__.py" in filenames and dirpath != str(root):
            found.add(os.path.relpath(dirpath, root).replace(os.sep, "/"))
    return found


def remove_bytecode(root: Path) -> int:
    """Delete each ``__pycache__`` dir and ``.pyc``/``.pyo`` file (or link so named); returns how many."""
    removed = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in list(dirnames):
            full = Path(dirpath, name)
            if name == "__pycache__":
                _remove(full)
                dirnames.remove(name)
                removed += 1
        for name in filenames:
            if name.endswith((".pyc", ".pyo")):
                _remove(Path(dirpath, name))
                removed += 1
    return removed


def place_file(root: Path, rel: str, data: bytes) -> None:
    """Write ``data`` at ``root/rel``, replacing whatever the patch put on that path or its parents (a link,
    a file where a directory belongs), so eval-only files land exactly where the row says."""
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or not parts:
        raise ValueError(f"eval file destination must stay inside the repository: {rel!r}")
    current = root
    for part in parts[:-1]:
        current = current / part
        if current.is_symlink() or (current.exists() and not current.is_dir()):
            _remove(current)
        current.mkdir(exist_ok=True)
    target = current / parts[-1]
    if target.is_symlink() or target.exists():
        _remove(target)
    target.write_bytes(data)


class RestoreFailed(RuntimeError):
    """The row's later commit does not hold what the row says it restores from it."""


HOST_GIT_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/nonexistent",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_COUNT": "1",  # the image may belong to another uid
    "GIT_CONFIG_KEY_0": "safe.directory",
    "GIT_CONFIG_VALUE_0": "*",
}
GIT_MODES = {b"100644": 0o644, b"100755": 0o755, b"120000": None}  # None: a symbolic link


def checkout_files(image: Path, ref: str, paths: tuple[str, ...], dest: Path) -> list[str]:
    """Write the files ``paths`` name (files or directories) as commit ``ref`` of ``image``'s own git holds
    them, under ``dest``; returns their relative paths. Run on the host, reading objects only (``ls-tree``,
    ``cat-file``: no checkout, no filter, hook or config command runs), so the later commit never enters a
    sandbox. A path the commit lacks raises :class:`RestoreFailed`, as ``git checkout`` fails on it."""
    git = ["git", "--git-dir", str(image / ".git"), "-c", "core.hooksPath=/dev/null"]
    listing = _host_git([*git, "ls-tree", "-r", "-z", "--full-tree", ref, "--", *paths])
    entries = []
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, _, name = record.partition(b"\t")
        git_mode, kind, oid = meta.split(b" ")
        if kind == b"blob" and git_mode in GIT_MODES:
            entries.append((os.fsdecode(name), GIT_MODES[git_mode], oid.decode()))
    names = [e[0] for e in entries]
    missing = [p for p in paths if not any(n == p or n.startswith(p.rstrip("/") + "/") for n in names)]
    if missing:
        raise RestoreFailed(f"{ref} holds no {', '.join(missing)}")
    blobs = _host_git([*git, "cat-file", "--batch"], "".join(f"{e[2]}\n" for e in entries).encode())
    at = 0
    for rel, mode, _oid in entries:
        header_end = blobs.index(b"\n", at)
        size = int(blobs[at:header_end].split(b" ")[2])
        data = blobs[header_end + 1 : header_end + 1 + size]
        at = header_end + 2 + size
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if mode is None:
            target.symlink_to(os.fsdecode(data))
        else:
            target.write_bytes(data)
            target.chmod(mode)
    return [e[0] for e in entries]


def _host_git(argv: list[str], stdin: bytes | None = None) -> bytes:
    done = subprocess.run(argv, input=stdin, env=HOST_GIT_ENV, capture_output=True, check=False)
    if done.returncode != 0:
        raise RestoreFailed(f"git {argv[5]}: {done.stderr.decode(errors='replace').strip()}")
    return done.stdout


def overlay(src: Path, root: Path, rels: list[str]) -> None:
    """Copy ``rels`` from ``src`` into ``root`` (links as links, modes kept), replacing whatever the patch put
    on those paths or their parents, as :func:`place_file` does."""
    for rel in rels:
        source = src / rel
        if source.is_symlink():
            _clear(root, rel)
            (root / rel).symlink_to(os.readlink(source))
        else:
            place_file(root, rel, source.read_bytes())
            (root / rel).chmod(stat.S_IMODE(source.lstat().st_mode))


def _clear(root: Path, rel: str) -> None:
    place_file(root, rel, b"")
    (root / rel).unlink()


def protected_dirs(root: Path, test_files: set[str]) -> list[str]:
    """What to mount read-only while the tests run: the directories holding the row's test files (a test
    file at the top level itself), outermost only, real directories and files only (never a link)."""
    wanted = set()
    for rel in test_files:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts:
            continue
        wanted.add(str(Path(*parts[:-1])) if len(parts) > 1 else parts[0])
    kept: list[str] = []
    for rel in sorted(wanted, key=lambda r: (len(Path(r).parts), r)):
        if any(Path(rel).is_relative_to(k) for k in kept):
            continue
        path = root / rel
        if not any(p.is_symlink() for p in [path, *path.parents] if p.is_relative_to(root) and p != root):
            if path.is_dir() or path.is_file():
                kept.append(rel)
    return kept


def copy_tree(src: Path, dest: Path) -> None:
    """A full copy of an image (its ``.git`` included), links kept as links, times kept."""
    shutil.copytree(src, dest, symlinks=True)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return "dir" if stat.S_ISDIR(mode) else "other"


def _content(path: Path, kind: str) -> bytes:
    return os.readlink(path).encode() if kind == "link" else path.read_bytes()
