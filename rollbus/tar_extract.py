"""Unpacking a tarball with PEP 706's ``tar`` filter, also on a Python that lacks it.

Why: the rollbus image's Python is Debian bookworm's 3.11.2 (``rollbus images build`` makes the
``python:3.11-slim-bookworm`` equivalent from Debian's mirror), whose ``tarfile`` predates PEP 706 (3.11.4):
``extractall(filter=...)`` raises ``TypeError`` there. Where the filter exists it is used as is; where not,
each member goes through the same checks first (:func:`tar_filter`), so an archive never writes outside
``dest`` on either Python.
"""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path


class OutsideDestination(tarfile.TarError):
    """A member would land (or link) outside the destination directory."""


def extract_tar(archive: tarfile.TarFile, dest: Path, *, native: bool | None = None) -> None:
    """``archive.extractall(dest, filter="tar")``; ``native=False`` forces the fallback (for its tests)."""
    if native is None:
        native = hasattr(tarfile, "tar_filter")
    if native:
        archive.extractall(dest, filter="tar")
        return
    # one member at a time, so a path is checked against the links extracted before it (realpath)
    directories = []
    for member in archive.getmembers():
        member = tar_filter(member, str(dest))
        if member.isdir():
            (dest / member.name).mkdir(parents=True, exist_ok=True)
            directories.append(member)
        else:
            archive.extractall(dest, members=[member])
    archive.extractall(dest, members=directories)  # their modes and times last, as extractall sets them


def tar_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    """PEP 706's ``tar`` filter: leading slashes stripped, nothing outside ``dest`` (by name, through a link
    extracted before it, or by a hard link's target), the setuid, setgid, sticky and group/other write bits
    cleared; symbolic links kept as they are, as that filter keeps them. Raises :class:`OutsideDestination`.
    """
    root = os.path.realpath(dest)
    name = member.name.lstrip("/" + os.sep)
    if os.path.isabs(name) or not _inside(root, os.path.join(root, name)):
        raise OutsideDestination(f"{member.name!r} would be extracted outside {dest}")
    member.name = name
    if member.islnk():
        target = member.linkname.lstrip("/" + os.sep)
        if not _inside(root, os.path.join(root, target)):
            raise OutsideDestination(f"{member.name!r} links to {member.linkname!r}, outside {dest}")
        member.linkname = target
    member.mode &= ~(stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH)
    return member


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, os.path.realpath(path)]) == root
