"""The agent's workspace: the task's image (a repository directory or a tarball of one) copied into scratch.

Only the image enters: the row, its grading scripts and hidden tests stay on the host. A git image enters
with its base commit only (its ``HEAD``, cloned at depth 1: no later commits, branches, tags, reflogs or
stash, since SWE images hold the fix commit the grader restores tests from); its working tree is copied as
is, untracked files included (installed dependencies live there). A tarball is
extracted with tarfile's ``data`` filter (no absolute paths, no ``..``, no devices, no links out of the
tree); its repository is the tarball's root, or its single top-level directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from rollbus.sandbox import prepare_repo

TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.bz2")


class ImageError(RuntimeError):
    """The task names no usable image (missing, unreadable, not a directory or tarball)."""


def image_path(metadata: dict[str, Any]) -> Path:
    """``metadata.image`` (or ``remote_env_info.image``) as an absolute host path."""
    image = metadata.get("image") or (metadata.get("remote_env_info") or {}).get("image")
    if not isinstance(image, str) or not image:
        raise ImageError("the task's metadata names no image")
    path = Path(image).expanduser()
    if not path.is_absolute():
        raise ImageError(f"image {image!r} is relative: `rollbus submit` resolves it against the dataset")
    return path


def materialize(metadata: dict[str, Any], scratch: Path) -> Path:
    """A fresh copy of the task's repository under ``scratch`` with its trusted baseline; returns it."""
    image = image_path(metadata)
    if image.is_file() and image.name.endswith(TARBALL_SUFFIXES):
        image = extract(image, scratch / "image")
    if image.is_dir():
        return prepare_repo(base_commit_only(image, scratch / "base"), scratch / "repo")
    raise ImageError(
        f"image {str(image)!r} is neither a directory nor a tarball ({', '.join(TARBALL_SUFFIXES)})"
    )


def base_commit_only(image: Path, dest: Path) -> Path:
    """``image``'s working tree with a ``.git`` holding only its ``HEAD`` commit (``image`` if not git)."""
    if not (image / ".git").exists():
        return image
    shutil.copytree(image, dest, symlinks=True, ignore=lambda d, _: [".git"] if Path(d) == image else [])
    clone = dest.with_name(dest.name + ".clone")
    source = f"file://{image.resolve()}"
    _git(["clone", "-q", "--depth", "1", "--no-tags", "--single-branch", source, str(clone)], cwd=dest.parent)
    _git(["remote", "remove", "origin"], cwd=clone)
    _git(["reflog", "expire", "--expire=now", "--all"], cwd=clone)
    (clone / ".git").rename(dest / ".git")
    shutil.rmtree(clone)
    _git(["reset", "-q"], cwd=dest)  # the index of the copied tree, as `git status` shows it
    return dest


def _git(args: list[str], *, cwd: Path) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ImageError(f"git {args[0]} of the image failed: {done.stderr.strip()[-500:]}")


def extract(tarball: Path, dest: Path) -> Path:
    """Unpack ``tarball`` into ``dest``; the repository root (``dest`` or its single top-level directory)."""
    dest.mkdir(parents=True)
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise ImageError(f"image {str(tarball)!r} cannot be extracted: {exc}") from exc
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest
