"""The agent's workspace: the task's image (a repository directory or a tarball of one) copied into scratch.

Only the image enters: the row, its grading scripts and hidden tests stay on the host. A tarball is
extracted with tarfile's ``data`` filter (no absolute paths, no ``..``, no devices, no links out of the
tree); its repository is the tarball's root, or its single top-level directory.
"""

from __future__ import annotations

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
    if image.is_dir():
        return prepare_repo(image, scratch / "repo")
    if image.is_file() and image.name.endswith(TARBALL_SUFFIXES):
        return prepare_repo(extract(image, scratch / "image"), scratch / "repo")
    raise ImageError(
        f"image {str(image)!r} is neither a directory nor a tarball ({', '.join(TARBALL_SUFFIXES)})"
    )


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
