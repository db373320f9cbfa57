"""Bubblewrap backend: each command runs in fresh Linux namespaces over a minimal, mostly read-only root.

Layout inside: ``/usr`` and the ``/lib*``, ``/bin`` links read-only from the host; a few ``/etc`` files
(plus our own ``passwd``/``group`` naming the agent user); fresh ``/proc``, ``/dev`` and ``/tmp``; the
repository read-write at ``/workspace``; a host-backed writable HOME at ``/home/agent``; extra read-only binds
(the CLI binary); the root itself read-only. The agent runs as uid 1000 in a user namespace, mapped to the
calling user outside (so, run as root, host-root-owned files look agent-owned inside: only read-only ones are
mounted).

Network: ``"none"`` gives a private network namespace with only its own loopback, so nothing on the host (or
beyond) is reachable. ``"loopback"`` (``--share-net``) *shares the host network namespace*: the agent can
reach every host port and any route the host has, not just the adapter. Future work: a private namespace
with only the adapter's socket forwarded in.

Timeouts SIGKILL the namespace's init process (found through ``--info-fd``), so the kernel kills every
process in the PID namespace, even those that started their own session; ``run`` returns once they are all
gone (they held its output pipes), so nothing the agent started outlives the call.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollbus.sandbox.base import Completed, Network, read_host_file, write_host_file
from rollbus.sandbox.process import run_process

WORKSPACE = "/workspace"
HOME = "/home/agent"
AGENT_UID = 1000
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = (
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/alternatives",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/localtime",
)


class SandboxUnavailable(RuntimeError):
    """This backend cannot run on this machine (binary missing, namespaces refused)."""


@dataclass(frozen=True)
class BwrapLayout:
    """Host directories behind the sandbox's writable and synthetic paths."""

    workdir: Path
    home: Path
    etc: Path
    network: Network = "none"
    ro_binds: Mapping[str, str] = field(default_factory=dict)  # host path -> inside path
    uid: int | None = AGENT_UID  # None: no uid switch (for hosts without user namespaces)


def system_mounts() -> list[str]:
    """Mirror the host's system directories: symlinks stay symlinks (merged /usr), directories bind ro."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


def bwrap_argv(
    layout: BwrapLayout, cmd: Sequence[str], *, cwd: str, system: Sequence[str], info_fd: int | None = None
) -> list[str]:
    """The full bwrap command line for ``cmd`` (pure: everything host-specific comes in as arguments)."""
    argv = [
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
    ]
    if layout.network == "loopback":
        argv.append("--share-net")
    if layout.uid is not None:
        argv += ["--uid", str(layout.uid), "--gid", str(layout.uid)]
    mounts = [
        ("--ro-bind", str(layout.etc / "passwd"), "/etc/passwd"),
        ("--ro-bind", str(layout.etc / "group"), "/etc/group"),
        ("--proc", "/proc"),
        ("--dev", "/dev"),
        ("--tmpfs", "/tmp"),
        ("--bind", str(layout.workdir), WORKSPACE),
        ("--bind", str(layout.home), HOME),
        *(("--ro-bind", host, inside) for host, inside in layout.ro_binds.items()),
        ("--remount-ro", "/"),  # last: everything above keeps its own flags
    ]
    argv += [*system, *(arg for mount in mounts for arg in mount), "--chdir", cwd]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    return [*argv, "--", *cmd]


def write_identity(etc: Path, uid: int | None) -> None:
    """``passwd``/``group`` naming the agent user: self-lookups work, host users stay hidden."""
    etc.mkdir(parents=True, exist_ok=True)
    agent = uid if uid is not None else os.getuid()
    passwd = f"root:x:0:0:root:/root:/bin/bash\nagent:x:{agent}:{agent}:agent:{HOME}:/bin/bash\n"
    (etc / "passwd").write_text(passwd)
    (etc / "group").write_text(f"root:x:0:\nagent:x:{agent}:\n")


class BwrapSandbox:
    """A bubblewrap sandbox around one prepared repository (see the module docstring for what is shared)."""

    workdir = WORKSPACE
    home = HOME

    def __init__(
        self,
        workdir: Path,
        *,
        network: Network = "none",
        ro_binds: Mapping[str | os.PathLike[str], str] | None = None,
        uid: int | None = AGENT_UID,
        bwrap: str = "bwrap",
    ) -> None:
        found = shutil.which(bwrap)
        if found is None:
            raise SandboxUnavailable(f"{bwrap!r} not found (apt-get install bubblewrap)")
        self._bwrap = found
        self._state = Path(tempfile.mkdtemp(prefix="rollbus-bwrap-"))
        (self._state / "home").mkdir()
        write_identity(self._state / "etc", uid)
        binds = {str(Path(host).resolve()): inside for host, inside in (ro_binds or {}).items()}
        self.layout = BwrapLayout(
            workdir=Path(workdir).resolve(),
            home=self._state / "home",
            etc=self._state / "etc",
            network=network,
            ro_binds=binds,
            uid=uid,
        )
        self._mounts = {WORKSPACE: self.layout.workdir, HOME: self.layout.home}
        self._system = system_mounts()

    async def run(
        self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None, timeout: float = 600.0
    ) -> Completed:
        info_r, info_w = os.pipe()
        os.set_blocking(info_r, False)
        argv = bwrap_argv(self.layout, cmd, cwd=cwd or WORKSPACE, system=self._system, info_fd=info_w)
        try:
            return await run_process(
                [self._bwrap, *argv],
                env=env,
                cwd=None,
                timeout=timeout,
                kill=lambda _proc: _kill_namespace(info_r),
                pass_fds=(info_w,),
            )
        finally:
            os.close(info_r)
            os.close(info_w)

    async def write_file(self, path: str, data: bytes | str) -> None:
        write_host_file(self._mounts, path, data)

    async def read_file(self, path: str) -> bytes:
        return read_host_file(self._mounts, path)

    async def close(self) -> None:
        shutil.rmtree(self._state, ignore_errors=True)


def _kill_namespace(info_fd: int) -> None:
    """SIGKILL the PID namespace's init, which takes every process in the namespace with it."""
    try:
        info = json.loads(os.read(info_fd, 65536) or b"{}")
    except BlockingIOError:  # bwrap had not started the sandbox yet: killing its group is enough
        return
    pid = info.get("child-pid")
    if isinstance(pid, int):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@functools.cache
def bwrap_usable(bwrap: str = "bwrap", uid: int | None = AGENT_UID) -> bool:
    """Whether bwrap can build this backend's sandbox here (namespaces allowed, flags supported)."""
    found = shutil.which(bwrap)
    if found is None:
        return False
    with tempfile.TemporaryDirectory(prefix="rollbus-bwrap-probe-") as tmp:
        state = Path(tmp)
        (state / "home").mkdir()
        write_identity(state / "etc", uid)
        layout = BwrapLayout(workdir=state / "home", home=state / "home", etc=state / "etc", uid=uid)
        argv = bwrap_argv(layout, ["true"], cwd=WORKSPACE, system=system_mounts())
        done = subprocess.run([found, *argv], capture_output=True, timeout=30, check=False)
    return done.returncode == 0
