"""The sandbox contract: what every backend offers, so a new backend needs nothing but this file.

A sandbox is made fresh for one rollout (agent role) or one grade (grader role) and closed after it. It is
an async context manager (``async with`` closes it, also on error) and offers:

- ``sandbox_id: str``: unique, stable for its life; logs and the adapter proxy name the rollout by it.
- ``workdir: str`` / ``home: str``: the repository and a writable HOME, *as seen inside*.
- ``run(cmd, env, cwd=None, timeout=600.0) -> Completed`` (``exec`` is the same call): run ``cmd`` (an argv,
  never a shell string) to completion. It never raises for what the command did: a non-zero exit, a kill at
  the deadline or a limit hit comes back as :class:`Completed` with ``failure_kind`` set
  (:data:`FailureKind`). Every process the command started is gone when it returns. Cancelling it kills
  the command. Keywords ``agent=True`` (``cmd`` is the agent: the adapter proxy stamps its own requests
  ``agent`` and its tools' ``tool``) and ``secret_env`` (variables such as the session token that the command
  gets without the sandbox's configuration holding them: a pipe on bwrap and docker; E2B, whose VM is the
  isolation, passes them with the environment) are how an agent harness runs.
- ``write_file(path, data)`` / ``read_file(path) -> bytes``: move bytes in and out by inside path; a path that
  resolves outside the sandbox's own files (a planted symlink) raises :class:`SandboxPathError`.
- ``capture_patch(max_bytes, excluded=(), timeout=300.0) -> Captured``: the agent's patch against the
  trusted baseline, as bytes under a cap, taken inside the sandbox's limits once the agent's commands
  returned; bwrap, docker and E2B attempts share one flow through it (the runner's ``rollout._attempt``).
- ``close()``: kill everything, free everything; idempotent.
- ``enforced: Mapping[str, str]``: which limits hold and how (``{"memory": "cgroup v1", ...}``), for the log.

What may fail *before* a command runs (the image cannot be unpacked, the backend is unreachable, boot fails)
raises :class:`SandboxError` with a ``failure_kind``; a backend kills whatever it had started first.

Paths given to a sandbox are inside paths (``/workspace/calc.py``); each backend maps them to where the
bytes really live.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol, Self

if TYPE_CHECKING:
    from rollbus.sandbox.capture import Captured

# "none": no network at all (grader). "adapter": a private network namespace whose only way out is the
# adapter socket, forwarded on loopback (agent). "loopback": the host's network namespace (debugging only:
# the agent reaches every host port).
Network = Literal["none", "adapter", "loopback"]

FailureKind = Literal[
    "timeout",  # wall clock
    "memory_limit",
    "pids_limit",
    "cpu_limit",  # CPU time
    "disk_full",
    "output_truncated",
    "sandbox_error",  # the backend itself failed (boot, setup, transport)
    "image_error",  # the image could not be read or unpacked
]


@dataclass(frozen=True)
class Completed:
    """How a command ended. ``timed_out`` commands were killed (with their whole process tree).

    ``failure_kind`` names the limit the command hit (the first that applies, most severe first);
    ``output_dropped`` counts the bytes cut from the middle of stdout and stderr.
    """

    exit_code: int
    stdout: str
    stderr: str
    wall_time_s: float
    timed_out: bool
    failure_kind: FailureKind | None = None
    output_dropped: int = 0


class SandboxPathError(ValueError):
    """A path outside the sandbox's host-visible directories (or escaping them through a symlink)."""


class SandboxError(RuntimeError):
    """The sandbox could not be made or used; ``failure_kind`` says which way."""

    def __init__(self, message: str, failure_kind: FailureKind = "sandbox_error") -> None:
        super().__init__(message)
        self.failure_kind = failure_kind


class SandboxUnavailable(RuntimeError):
    """This backend cannot run on this machine (binary missing, namespaces refused)."""


class Sandbox(Protocol):
    sandbox_id: str
    workdir: str  # the repository, as seen inside
    home: str  # a writable HOME, as seen inside

    async def run(
        self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None, timeout: float = 600.0
    ) -> Completed: ...

    async def write_file(self, path: str, data: bytes | str) -> None: ...

    async def read_file(self, path: str) -> bytes: ...

    async def close(self) -> None: ...


class SandboxBase:
    """Shared plumbing for backends: ``exec`` as an alias of ``run``, the async context manager."""

    sandbox_id: str = ""
    enforced: Mapping[str, str] = {}
    image_digest: str | None = None  # a container backend's image digest (sha256:...); None elsewhere
    workdir: str = ""
    home: str = ""

    async def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        timeout: float = 600.0,
        *,
        agent: bool = False,
        secret_env: Mapping[str, str] | None = None,
    ) -> Completed:
        raise NotImplementedError

    async def exec(
        self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None, timeout: float = 600.0
    ) -> Completed:
        return await self.run(cmd, env, cwd, timeout)

    async def write_file(self, path: str, data: bytes | str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def capture_patch(
        self, max_bytes: int, excluded: Sequence[str] = (), timeout: float = 300.0
    ) -> Captured:
        """The agent's patch against the trusted baseline as bytes, at most ``max_bytes`` (``truncated`` when
        more existed), taken inside the sandbox's own limits (:mod:`rollbus.sandbox.capture`); call it after
        the agent's last command returned. Backends that run host tools over their files (``run_tool``:
        bwrap, docker) share this one; a backend without it (E2B) overrides the method."""
        from rollbus.sandbox.capture import capture_patch

        if not hasattr(self, "run_tool"):
            raise NotImplementedError(f"{type(self).__name__} cannot take a patch")
        return await capture_patch(self, max_bytes, excluded, timeout)  # type: ignore[arg-type]  # has run_tool

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


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


def write_host_file(
    mounts: Mapping[str, Path], path: str, data: bytes | str, owner: int | None = None
) -> None:
    """Write through ``mounts``; ``owner`` (a host uid) makes new files and dirs the sandbox user's."""
    target = host_path(mounts, path)
    missing = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data.encode() if isinstance(data, str) else data)
    if owner is not None:
        for made in [*missing, target]:
            os.chown(made, owner, owner, follow_symlinks=False)


def read_host_file(mounts: Mapping[str, Path], path: str) -> bytes:
    return host_path(mounts, path).read_bytes()
