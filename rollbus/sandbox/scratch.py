"""A scratch directory the host disk never pays for: a tmpfs of fixed size, for trees sandboxes write into.

The grader copies the image's repository into scratch and runs the tests there; code under test can
``fallocate -l 6G`` or write until the disk fills. Checking the size after the command is too late (the
host disk has already grown), so the directory is a filesystem of its own, capped at ``size``: a write
past it fails while it is written (ENOSPC), the sandbox names it ``disk_full`` from the free space left,
and nothing reaches the host disk. Its pages are memory, at most ``size`` of it; those the sandbox writes
count against the sandbox's memory cgroup.

As root only (mounting needs it); elsewhere a plain temporary directory, whose size is checked after each
command as before. A process killed -9 leaves its mount behind: :func:`sweep_scratch` removes those of dead
owners (each records its owner's pid), as :func:`rollbus.sandbox.spec.sweep_stale` does for sandboxes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from rollbus.sandbox.bwrap_host import mount_tmpfs, unmount
from rollbus.sandbox.limits import Limits

SCRATCH_BYTES = Limits().disk_bytes or 4 << 30  # a grade's whole tree: the image's copy, what tests write
OWNER_FILE = ".rollbus-owner.pid"
GRADE_SCRATCH_PREFIX = "rollbus-grade-"


@contextlib.contextmanager
def capped_scratch(
    prefix: str, dir: str | os.PathLike[str] | None = None, size: int | None = None
) -> Iterator[Path]:
    """A fresh directory on a tmpfs of ``size`` bytes (:data:`SCRATCH_BYTES` by default), removed on exit."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    mounted = mount_tmpfs(path, 0o700, size or SCRATCH_BYTES, name="rollbus-scratch")
    try:
        (path / OWNER_FILE).write_text(str(os.getpid()))
        yield path
    finally:
        if mounted:
            unmount(path)
        shutil.rmtree(path, ignore_errors=True)


def sweep_scratch(prefix: str, dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Unmount and remove the capped scratch directories of dead processes; returns what was removed."""
    swept = []
    for owner in sorted(Path(dir or tempfile.gettempdir()).glob(f"{prefix}*/{OWNER_FILE}")):
        with contextlib.suppress(ValueError, OSError):
            if Path(f"/proc/{int(owner.read_text())}").exists():
                continue
        path = owner.parent
        if os.path.ismount(path):
            unmount(path)
        shutil.rmtree(path, ignore_errors=True)
        swept.append(path)
    return swept
