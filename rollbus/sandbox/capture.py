"""Take an agent's patch inside its own sandbox: bytes, never text, streamed to the host under a byte cap.

The workspace is the attacker's: a few gigabytes of random data in it make ``git diff`` (and anything that
holds its output) take gigabytes. So git never runs on the host. It runs through the sandbox's ``run_tool``
(bwrap's or docker's) once the agent's processes are gone: the sandbox's cgroups bound its memory
whatever the workspace holds (a hit is named, the host is untouched), the trusted baseline is bound
read-only (git writes nothing there: the index is a copy in the tool's private /tmp, where the one object
it writes goes too, the empty blob of intent-to-add entries: no file's content is ever stored), and its
stdout reaches the host through a :class:`CappedBytes`, which stops git at the first byte over the cap. The
host holds at most the cap.

The bytes are the patch: a file in Latin-1 (or any encoding) is carried as it is, never decoded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from rollbus.sandbox.base import Completed
from rollbus.sandbox.process import CappedBytes
from rollbus.sandbox.repo import baseline_gitdir

BASELINE = "/.rollbus/baseline.git"  # where the trusted baseline appears inside, read-only
INDEX = "/tmp/rollbus-index"  # a copy of the baseline's index, in the tool's own /tmp
OBJECTS = "/tmp/rollbus-objects"  # new objects (only the empty blob); the baseline's are read through it
# Untracked files become intent-to-add entries (no blob written), then the whole tree is diffed against the
# baseline commit; configuration that runs programs (fsmonitor, hooks, diff drivers, textconv) is off.
SCRIPT = (
    'mkdir "$GIT_OBJECT_DIRECTORY" && cp "$GIT_DIR/index" "$GIT_INDEX_FILE" && chmod u+w "$GIT_INDEX_FILE"'
    ' && git add --all --intent-to-add -- "$@" >&2'
    ' && exec git diff --binary --no-ext-diff --no-textconv --no-color HEAD -- "$@"'
)
# The tool's limits that end a capture (a full workspace is the agent's doing, and git writes nothing there).
LIMITS = ("timeout", "memory_limit", "pids_limit", "cpu_limit")
GIT_CONFIG = {"core.fsmonitor": "false", "core.hooksPath": "/dev/null", "safe.directory": "*"}


class ToolRunner(Protocol):
    """A sandbox that runs a host program over its own files (bwrap's and docker's ``run_tool``)."""

    workdir: str

    @property
    def host_workdir(self) -> Path: ...

    async def run_tool(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        *,
        ro_binds: Mapping[Path, str] | None = None,
        stdout: CappedBytes | None = None,
        timeout: float = 600.0,
    ) -> Completed: ...


@dataclass(frozen=True)
class Captured:
    """The patch's bytes (at most the cap), whether more existed, and why capture failed (None: it did not).

    ``failure`` is a sandbox failure kind (``memory_limit``, ``timeout``, ...) or ``git_failed``.
    """

    patch: bytes
    truncated: bool = False
    failure: str | None = None
    error: str = ""


def git_env(workdir: str) -> dict[str, str]:
    """git inside the tool sandbox: the baseline as its repository, no user or system config, no prompts."""
    env = {
        "PATH": "/usr/bin:/bin",
        "LANG": "C",
        "HOME": "/nonexistent",
        "GIT_DIR": BASELINE,
        "GIT_WORK_TREE": workdir,
        "GIT_INDEX_FILE": INDEX,
        "GIT_OBJECT_DIRECTORY": OBJECTS,
        "GIT_ALTERNATE_OBJECT_DIRECTORIES": f"{BASELINE}/objects",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_OPTIONAL_LOCKS": "0",
        "GIT_CONFIG_COUNT": str(len(GIT_CONFIG)),
    }
    for i, (key, value) in enumerate(GIT_CONFIG.items()):
        env |= {f"GIT_CONFIG_KEY_{i}": key, f"GIT_CONFIG_VALUE_{i}": value}
    return env


def pathspec(excluded: Sequence[str]) -> list[str]:
    """Everything but ``excluded`` (paths or directories, relative to the workspace)."""
    return [".", *(f":(exclude,literal){path}" for path in excluded)]


async def capture_patch(
    sandbox: ToolRunner, max_bytes: int, excluded: Sequence[str] = (), timeout: float = 300.0
) -> Captured:
    """The agent's patch against the trusted baseline, at most ``max_bytes`` of it (``truncated`` when more
    existed: git was stopped there). Call it after the agent's last command has returned."""
    sink = CappedBytes(max_bytes)
    cmd = ["/bin/sh", "-c", SCRIPT, "capture", *pathspec(excluded)]
    done = await sandbox.run_tool(
        cmd,
        git_env(sandbox.workdir),
        ro_binds={baseline_gitdir(sandbox.host_workdir): BASELINE},
        stdout=sink,
        timeout=timeout,
    )
    patch = bytes(sink.data)
    if sink.overflowed:
        return Captured(patch, truncated=True)
    if done.timed_out or done.failure_kind in LIMITS:
        return Captured(patch, failure=done.failure_kind or "timeout", error=done.stderr[-2000:])
    if done.exit_code != 0:
        return Captured(patch, failure="git_failed", error=done.stderr[-2000:])
    return Captured(patch)
