"""What every sandbox backend offers: run a command, move files in and out, close.

Paths given to a sandbox are paths *as the agent sees them* (``/workspace/calc.py``); each backend maps
them to wherever the bytes really live. A sandbox is made fresh for one sample and closed after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal, Protocol

Network = Literal["loopback", "none"]


@dataclass(frozen=True)
class Completed:
    """How a command ended. ``timed_out`` commands were killed (with their whole process tree)."""

    exit_code: int
    stdout: str
    stderr: str
    wall_time_s: float
    timed_out: bool


class SandboxPathError(ValueError):
    """A path outside the sandbox's host-visible directories (or escaping them through a symlink)."""


class Sandbox(Protocol):
    workdir: str  # the repository, as seen inside
    home: str  # a writable HOME, as seen inside

    async def run(
        self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None, timeout: float = 600.0
    ) -> Completed: ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def close(self) -> None: ...


def host_path(mounts: Mapping[str, Path], path: str) -> Path:
    """Map an inside path to its host file through ``mounts`` (inside dir -> host dir).

    The result is resolved and must stay under its mount, so a symlink the agent planted cannot make the
    host read or write outside the sandbox.
    """
    inside = PurePosixPath(path)
    if not inside.is_absolute():
        raise SandboxPathError(f"sandbox paths are absolute, got {path!r}")
    for prefix, root in mounts.items():
        if inside.is_relative_to(prefix):
            root = root.resolve()
            target = (root / inside.relative_to(prefix)).resolve()
            if not target.is_relative_to(root):
                raise SandboxPathError(f"{path!r} resolves outside {prefix} (to {target})")
            return target
    raise SandboxPathError(f"{path!r} is not under any host-visible directory ({', '.join(mounts)})")


def write_host_file(mounts: Mapping[str, Path], path: str, data: bytes | str) -> None:
    target = host_path(mounts, path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data.encode() if isinstance(data, str) else data)


def read_host_file(mounts: Mapping[str, Path], path: str) -> bytes:
    return host_path(mounts, path).read_bytes()
