"""Images: where a sandbox's repository and toolchain come from, and the agent's history-free copy.

``metadata.image`` is a repository directory or a tarball of one (the repository is the archive's root, or
its single top-level directory); a relative path resolves against the dataset file's directory. A toolchain
is a root filesystem directory or tarball (``docker export`` of a SWE-style image, an ``mmdebstrap`` tree).
Tarballs are unpacked once into a cache keyed by path, size, mtime, inode and ctime, with tarfile's ``data``
filter (no absolute paths, no ``..``, no devices, no setuid bits).

Threat model: the agent must not see the future. Images often hold the fix commit (SWE-bench Pro checks the
target tests out of it at grading time), so the agent's workspace is a *new* repository whose only commit is
the image's working tree: no later commits, tags, refs, reflogs, stash or packed objects, not even the old
object ids. The grader gets the image as it is.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from pathlib import Path

from rollbus.sandbox.base import SandboxError
from rollbus.sandbox.repo import GIT_IDENTITY, _git_env, pack_baseline, record_baseline, share_baseline

BASE_MESSAGE = "base"
AGENT_LAYOUT = "v3"  # what an agent cache entry holds; a new layout never reads an older entry
SMALL_ENTRY = 512  # paths: up to this many, copying in-process costs less than starting cp


def resolve_image(image: str | os.PathLike[str], dataset: Path | None = None) -> Path:
    """An image path as given in a row, made absolute against the dataset file's directory."""
    path = Path(image)
    if not path.is_absolute() and dataset is not None:
        path = Path(dataset).resolve().parent / path
    if not path.exists():
        raise SandboxError(f"image {str(image)!r} not found (looked at {path})", "image_error")
    return path


def unpack(image: Path, cache: Path, *, repository: bool) -> Path:
    """The directory behind ``image``: itself, or its tarball unpacked (once) into ``cache``."""
    if image.is_dir():
        return image
    if not tarfile.is_tarfile(image):
        raise SandboxError(f"image {image} is neither a directory nor a tarball", "image_error")
    st = image.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"  # ctime: no rewrite hides from it
    key = hashlib.sha256(f"{image.resolve()}:{stamp}".encode()).hexdigest()[:20]
    target = cache / key
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
        try:
            with tarfile.open(image) as tar:
                tar.extractall(scratch, filter="data" if repository else rootfs_filter)
        except (tarfile.TarError, OSError) as exc:
            shutil.rmtree(scratch, ignore_errors=True)
            raise SandboxError(f"cannot unpack image {image}: {exc}", "image_error") from exc
        try:
            os.rename(scratch, target)  # atomic: a concurrent unpack of the same image just loses the race
        except OSError:
            shutil.rmtree(scratch, ignore_errors=True)
    if not repository:
        return target
    entries = list(target.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else target


def rootfs_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """A root filesystem keeps its absolute symlinks (they resolve inside the sandbox); no devices, no setuid.

    ``tar`` filter rules otherwise: nothing lands outside the cache, group/other write and setuid bits go.
    """
    if member.isdev():
        return None
    return tarfile.tar_filter(member, dest)


def copy_tree(src: Path, dest: Path, *, skip_git: bool) -> None:
    """Copy ``src`` to ``dest`` (reflinks where the filesystem has them, else a plain copy).

    Hard links would be faster but are unsafe for a writable workspace: an in-place write would reach the
    image every later sandbox starts from.
    """
    dest.mkdir(parents=True, exist_ok=True)  # it may be a size-capped tmpfs mounted for it
    entries = [e for e in os.listdir(src) if not (skip_git and e == ".git")]
    if entries:
        cmd = ["cp", "-a", "--reflink=auto", *(str(src / e) for e in entries), str(dest)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SandboxError(f"cannot copy image {src}: {done.stderr.strip()}", "image_error")


def copy_entry(src: Path, dest: Path) -> None:
    """Copy a cache entry's workspace to ``dest``: in-process when small and plain, else :func:`copy_tree`.

    Copies, never links (see :func:`copy_tree`): symlinks as symlinks, files and dirs with modes and times.
    """
    st = src.stat()
    listing = _plain_listing(str(src), st.st_ino, st.st_ctime_ns)
    if listing is None:
        copy_tree(src, dest, skip_git=False)
        return
    dest.mkdir(parents=True, exist_ok=True)
    made = []
    for rel, is_dir in listing:  # top-down: parents first
        source, target = os.path.join(src, rel), os.path.join(dest, rel)
        if is_dir:
            os.mkdir(target, 0o700)
            made.append((source, target))
        else:
            shutil.copy2(source, target, follow_symlinks=False)
    for source, target in reversed(made):  # modes last, so a read-only dir was still writable while filled
        shutil.copystat(source, target, follow_symlinks=False)


@functools.lru_cache(maxsize=64)
def _plain_listing(root: str, inode: int, ctime_ns: int) -> tuple[tuple[str, bool], ...] | None:
    """A cache entry's paths top-down (True for a directory), or None when it has more than ``SMALL_ENTRY``
    or anything but directories, regular files and symlinks. An entry never changes once built; a rebuilt
    one is a new directory (``inode``, ``ctime_ns``), so this is walked once per entry."""
    found: list[tuple[str, bool]] = []
    for parent, dirs, files in os.walk(root):
        for name in dirs + files:  # a symlink to a directory is listed in dirs, never followed
            path = os.path.join(parent, name)
            mode = os.lstat(path).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                return None
            found.append((os.path.relpath(path, root), stat.S_ISDIR(mode)))
            if len(found) > SMALL_ENTRY:
                return None
    return tuple(found)


def agent_workspace(src: Path, dest: Path) -> Path:
    """The agent's copy of ``src``: its files, and a fresh repository holding them as the only commit.

    Files the image's repository tracked are committed (even if ignored); everything else stays as it was
    (untracked or ignored). Without a repository in the image, everything not ignored is committed.
    """
    copy_tree(src, dest, skip_git=True)
    tracked = _tracked_files(src) if (src / ".git").exists() else None
    _git(["init", "-q", "--template=", "-b", "main"], dest)
    if tracked is None:
        _git(["add", "-A"], dest)
    elif tracked:
        _git(["add", "-f", "--pathspec-from-file=-", "--pathspec-file-nul"], dest, stdin=tracked)
    _git([*GIT_IDENTITY, "commit", "-q", "--allow-empty", "--no-verify", "-m", BASE_MESSAGE], dest)
    shutil.rmtree(dest / ".git" / "logs", ignore_errors=True)  # no reflog, not even of the base commit
    return dest


def tree_fingerprint(root: Path) -> str:
    """A digest of every path, size, mode, inode, mtime and ctime under ``root``: changes whenever a file
    or directory does (ctime too, which no one can set back: a rewrite that restores size and mtime)."""
    digest = hashlib.sha256(str(root.resolve()).encode())
    for parent, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(parent, name)
            st = os.lstat(path)
            stamp = f"{st.st_size}\0{st.st_mode}\0{st.st_ino}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
            digest.update(f"{path}\0{stamp}\n".encode())
    return digest.hexdigest()[:24]


def image_fingerprint(src: Path, cache: Path) -> str:
    """What names an image's state: a tarball unpacked into ``cache`` never changes (its directory is named
    after the tarball's path, size and mtime, see :func:`unpack`), so its path is enough; a directory image
    is walked every time (:func:`tree_fingerprint`), since any file in it may have changed."""
    resolved = src.resolve()
    if resolved.is_relative_to(cache.resolve()):
        return hashlib.sha256(f"unpacked:{resolved}".encode()).hexdigest()[:24]
    return tree_fingerprint(src)


def cached_agent_workspace(src: Path, dest: Path, cache: Path) -> Path:
    """:func:`agent_workspace` plus its trusted baseline, built once per image state and copied from then on.

    The git work (init, add, commit, baseline) costs more than the copy; a changed image has a new
    fingerprint, so a stale entry is never used. Per sandbox: one copy of the workspace (never links: the
    agent writes into it) and a baseline of its own sharing the entry's one pack (:func:`share_baseline`).
    """
    entry = cache / f"agent-{AGENT_LAYOUT}-{image_fingerprint(src, cache)}"
    if not entry.exists():
        cache.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=cache))
        try:
            pack_baseline(record_baseline(agent_workspace(src, scratch / "ws")))
            os.rename(scratch, entry)
        except OSError:  # another sandbox built it first
            shutil.rmtree(scratch, ignore_errors=True)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    copy_entry(entry / "ws", dest)
    return share_baseline(entry / "ws", dest)


def grader_workspace(src: Path, dest: Path) -> Path:
    """The grader's copy: the image as it is, history and all."""
    copy_tree(src, dest, skip_git=False)
    return dest


def _tracked_files(src: Path) -> bytes:
    return _git(["--git-dir", str(src / ".git"), "--work-tree", str(src), "ls-files", "-z"], src).encode()


def _git(args: list[str], cwd: Path, stdin: bytes | None = None) -> str:
    done = subprocess.run(
        ["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", *args],
        cwd=cwd,
        env=_git_env(),
        input=stdin,
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise SandboxError(
            f"git {' '.join(args)} failed: {done.stderr.decode(errors='replace').strip()}", "image_error"
        )
    return done.stdout.decode(errors="replace")
