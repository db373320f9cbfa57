"""Bubblewrap backend: each command runs in fresh Linux namespaces over a minimal, mostly read-only root.

Layout inside: ``/usr`` and the ``/lib*``, ``/bin`` links read-only from the host (or a toolchain root
filesystem, read-only as ``/``); a few ``/etc`` files plus our own ``passwd``/``group``; fresh ``/proc``,
``/dev`` and a size-capped ``/tmp`` (as root a tmpfs the host mounts and measures, emptied after each
command); the repository read-write at ``/workspace``; a writable HOME at
``/home/agent``; extra read-only binds (the CLI binary); everything else read-only.

Threat model: the agent is the attacker.
- Identity: run by root, the launcher drops to a per-sandbox unprivileged host uid before exec'ing bwrap, so
  the agent's uid 1000 maps to that uid, never to host root: files it creates are owned by it. Sources that
  uid could not reach (root-only parents) are bind-mounted to a traversable staging dir in a private mount
  namespace of the launcher, never on the host. bwrap adds ``no_new_privs``, drops every capability, mounts
  binds and tmpfs ``nosuid,nodev`` (setuid bits do nothing inside, and the host strips any the agent set
  after each command) and ``--disable-userns`` forbids nested user namespaces (a seccomp filter,
  :mod:`rollbus.sandbox.seccomp`, where bwrap lacks the flag).
- Network: every sandbox has its own network namespace. ``"none"``: loopback only, nothing else.
  ``"adapter"``: loopback, where the port ``ANTHROPIC_BASE_URL`` names reaches the adapter proxy and nothing
  else does. As root the host makes that namespace with the proxy's listener inside
  (:mod:`rollbus.sandbox.netns`) and the launcher joins it: no process inside. Otherwise a ``socat``
  forwarder inside (started before the command, gone with it) connects that port to the proxy's unix socket
  bind-mounted at ``/run/adapter.sock``. ``"loopback"`` shares the host network namespace (debugging only).
  A command run with ``agent=True`` is the agent: the proxy learns its host pid and stamps only what that
  process alone sends ``agent`` (:mod:`rollbus.sandbox.peer`).
- Limits (:mod:`rollbus.sandbox.limits`): the launcher joins the sandbox's cgroup; a hit is named. A full disk
  is named from the filesystems themselves (free space after the command), never from what the command
  printed: an agent that silences stderr still gets ``disk_full``.
- Host programs that must read the agent's files (git, taking its patch) run through :meth:`run_tool`, in
  the sandbox's cgroups and uid, never on the host itself.
- Timeouts SIGKILL the namespace's init (found through ``--info-fd``), which takes every process in the PID
  namespace with it; ``run`` returns once they are all gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollbus.sandbox.base import (
    Completed,
    FailureKind,
    SandboxBase,
    SandboxError,
    SandboxUnavailable,
    read_host_file,
    write_host_file,
)
from rollbus.sandbox.bwrap_host import (
    BwrapInfo,
    HostSide,
    free_bytes,
    kill_namespace,
    make_launcher,
    mount_tmpfs,
    prepare_host,
    release,
    settle,
    unmount,
    write_identity,
)
from rollbus.sandbox.bwrap_layout import (
    AGENT_UID,
    HOME,
    WORKSPACE,
    BwrapLayout,
    bwrap_argv,
    secret_lines,
    system_mounts,
    with_secrets,
)
from rollbus.sandbox.limits import Cgroups, enforcement, failure_from_counters, rlimits
from rollbus.sandbox.peer import AgentProcess, command_pid
from rollbus.sandbox.process import CappedBytes, run_process
from rollbus.sandbox.seccomp import filter_fd

TMP_MEASURED = "tmpfs size (host-mounted: its fill measured after each command)"
DISK_FULL_MARGIN = 64 << 10  # a tmpfs workspace with less free space than this after a command is full
AGENT_POLL_S = 0.005  # how often run(agent=True) looks for the command's process until it exists

__all__ = ["BwrapSandbox", "SandboxUnavailable", "bwrap_usable"]


class BwrapSandbox(SandboxBase):
    """A bubblewrap sandbox around one prepared repository (see the module docstring for what holds)."""

    workdir = WORKSPACE
    home = HOME
    proxy: Any = None  # the AdapterProxy serving this sandbox's socket, when it has one

    def __init__(self, host: HostSide) -> None:
        """Use :meth:`create`, which makes the host side (state dir, uids, mounts, cgroups) off the loop."""
        self._bwrap = host.bwrap
        self.workdir = host.layout.inside_workdir
        self._on_close: list[Callable[[], Awaitable[None] | None]] = []
        self.sandbox_id = host.sandbox_id
        self.limits = host.limits
        self.host_uid = host.host_uid
        self.layout = host.layout
        self.cgroups: Cgroups | None = host.cgroups
        self._state, self._host_workdir, self._tmp = host.state, host.host_workdir, host.tmp
        self._binds, self._system, self._mounts = host.binds, host.system, host.mounts
        self._netns, self._seccomp = host.netns, host.seccomp
        self._disk_mounted, self._home_capped = host.disk_mounted, host.home_capped
        self.enforced = self._report()

    @classmethod
    async def create(cls, workdir: Path, **options: Any) -> BwrapSandbox:
        """A sandbox over the prepared repository ``workdir``; ``options`` are those of
        :func:`~rollbus.sandbox.bwrap_host.prepare_host`, whose host work runs off the event loop. Raises
        :class:`SandboxUnavailable` where bwrap cannot run."""
        return cls(await asyncio.to_thread(functools.partial(prepare_host, workdir, **options)))

    def _report(self) -> dict[str, str]:
        """How each limit and boundary holds for this sandbox (``enforced``)."""
        disk = "checked after each command (du)"
        if self._disk_mounted:
            disk = "tmpfs size (workspace), checked after each command (HOME)"
            if self._home_capped:
                disk = "tmpfs size (workspace and HOME), checked after each command (both)"
        report = enforcement(self.limits, self.cgroups, disk)
        if self._tmp is not None:
            report["tmp"] = TMP_MEASURED
        report["nested_userns"] = (
            "bwrap --disable-userns"
            if self.layout.disable_userns
            else "seccomp filter"
            if self._seccomp
            else "NOT blocked"
        )
        report["identity"] = f"host uid {self.host_uid}" if self.host_uid else f"caller uid {os.getuid()}"
        report["network"] = {
            "none": "own namespace, loopback only",
            "loopback": "host namespace (debugging only)",
            "adapter": "own namespace, the adapter proxy listens inside"
            if self._netns is not None
            else "own namespace, socat to the adapter socket",
        }[self.layout.network]
        if self.layout.network == "adapter":  # which requests can be the agent's (x-rollbus-peer)
            report["attribution"] = (
                "the agent's process, from the host's /proc"
                if self._netns is not None
                else "none: behind socat every request is a tool's"
            )
        return report

    @property
    def host_workdir(self) -> Path:
        return self._host_workdir

    async def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        timeout: float = 600.0,
        *,
        agent: bool = False,
        secret_env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> Completed:
        """``pass_fds``: host descriptors the command inherits as they are numbered (the grader's channel).
        ``agent``: ``cmd`` is the agent; while it runs the adapter proxy knows its process, so what it
        sends is stamped ``agent`` and what anything it starts sends is stamped ``tool``. ``secret_env``:
        variables (the session token) the command gets through a pipe rather than from bwrap, whose pid 1
        inside keeps its own environment and command line readable to the agent's tools."""
        return await self._run(
            self.layout, self._system, self._binds, self._netns, cmd, env, cwd, timeout, agent=agent,
            secret_env=secret_env, pass_fds=pass_fds,
        )  # fmt: skip

    async def run_tool(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        *,
        ro_binds: Mapping[Path, str] | None = None,
        stdout: CappedBytes | None = None,
        timeout: float = 600.0,
    ) -> Completed:
        """Run a host program over this sandbox's files, for work the host must not do on them itself (git
        taking the agent's patch): the host's read-only system (never the image's toolchain), the sandbox's
        uid and cgroups (its memory cap holds whatever the files make the program do), no network, a fresh
        /tmp of bwrap's, ``ro_binds`` (host path -> inside path) read-only; stdout into ``stdout``."""
        binds, inside = list(self._binds), {}
        for i, (host, path) in enumerate((ro_binds or {}).items()):
            source = Path(host).resolve()
            point = self._state / "mnt" / f"tool{i}"
            if self.host_uid is None:  # not root: nothing staged, bwrap binds the source itself
                point = source
            elif source.is_dir():
                point.mkdir(mode=0o755, exist_ok=True)
            else:
                point.touch(mode=0o644)
            if point != source:
                binds.append((str(source), str(point)))
            inside[str(point)] = path
        layout = dataclasses.replace(
            self.layout, network="none", netns_joined=False, toolchain=None, host_loader=(), ro_binds=inside,
            tmp_dir=None,
        )  # fmt: skip
        return await self._run(layout, system_mounts(), binds, None, cmd, env, None, timeout, stdout)

    async def _run(
        self,
        layout: BwrapLayout,
        system: Sequence[str],
        binds: Sequence[tuple[str, str]],
        netns: int | None,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        timeout: float,
        stdout: CappedBytes | None = None,
        *,
        agent: bool = False,
        secret_env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> Completed:
        secret_r = None
        if secret_env:
            data = secret_lines(secret_env)
            secret_r, secret_w = os.pipe()
            try:
                os.write(secret_w, data)  # under a pipe's atomic size: never blocks
            finally:
                os.close(secret_w)
            cmd = with_secrets(cmd)
        info_r, info_w = os.pipe()
        os.set_blocking(info_r, False)
        info = BwrapInfo(info_r)
        filter_in = filter_fd(self._seccomp) if self._seccomp else None
        layout = dataclasses.replace(layout, seccomp_fd=filter_in)
        argv = bwrap_argv(layout, cmd, cwd=cwd or self.workdir, system=system, info_fd=info_w)
        launcher = make_launcher(
            self.host_uid,
            binds,
            self.cgroups.procs_files() if self.cgroups else [],
            rlimits(self.limits, self.cgroups),
            netns,
        )
        before = self.cgroups.counters() if self.cgroups else {}
        pin = asyncio.ensure_future(_agent_process(info)) if agent and self.proxy is not None else None
        if pin is not None:
            self.proxy.agent = pin
        try:
            done = await run_process(
                [self._bwrap, *argv],
                env=env,
                cwd=None,
                timeout=timeout,
                kill=lambda _proc: kill_namespace(info),
                pass_fds=(info_w, *pass_fds) if filter_in is None else (info_w, filter_in, *pass_fds),
                stdin=secret_r,
                output_limit=self.limits.output_bytes,
                preexec_fn=launcher,
                stdout=stdout,
            )
        except subprocess.SubprocessError as exc:  # the launcher failed (cgroup, mount, uid)
            raise SandboxError(f"cannot start the sandbox: {exc}") from exc
        finally:
            if pin is not None:
                pin.cancel()
                self.proxy.agent = None
            os.close(info_r)
            os.close(info_w)
            if secret_r is not None:
                os.close(secret_r)
            if filter_in is not None:
                os.close(filter_in)
        after = self.cgroups.counters() if self.cgroups else {}
        tmp = self._tmp if layout.tmp_dir is not None else None
        usage, tmp_full = await asyncio.to_thread(self._after, tmp)
        return _with_failure(done, self._classify(done, before, after, usage, tmp_full))

    def _after(self, tmp: Path | None) -> tuple[int, bool]:
        """After a command (its processes gone): the trees' usage (see :func:`settle`), whether the private
        /tmp was full, and a fresh empty /tmp for the next command."""
        usage = settle(self._mounts.values())
        if tmp is None:
            return usage, False
        full = free_bytes(tmp) < DISK_FULL_MARGIN
        unmount(tmp)
        if not mount_tmpfs(tmp, 0o1777, self.limits.tmp_bytes, name="rollbus-tmp"):
            raise SandboxError(f"cannot remount the sandbox's /tmp at {tmp}")
        return usage, full

    def _classify(
        self,
        done: Completed,
        before: dict[str, int],
        after: dict[str, int],
        usage: int,
        tmp_full: bool = False,
    ) -> FailureKind | None:
        if done.timed_out:
            return "timeout"
        if kind := failure_from_counters(before, after):
            return kind
        if self.limits.cpu_time_s is not None and done.exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
            return "cpu_limit"
        if tmp_full or free_bytes(self._host_workdir) < DISK_FULL_MARGIN:
            return "disk_full"  # measured: whatever filesystem holds the workspace (a capped tmpfs) is full
        if self._home_capped and free_bytes(self._state) < DISK_FULL_MARGIN:
            return "disk_full"
        if self.limits.disk_bytes is not None and usage > self.limits.disk_bytes:
            return "disk_full"
        full_tmp_said = self.limits.tmp_bytes is not None and "No space left on device" in done.stderr
        if self._tmp is None and full_tmp_said:
            return "disk_full"  # not root: bwrap's /tmp went with the command; only its message is left
        return done.failure_kind

    async def write_file(self, path: str, data: bytes | str) -> None:
        write_host_file(self._mounts, path, data, owner=self.host_uid)

    async def read_file(self, path: str) -> bytes:
        return read_host_file(self._mounts, path)

    def on_close(self, callback: Callable[[], Awaitable[None] | None]) -> None:
        """Run ``callback`` at close (after the sandbox's processes are gone), last registered first."""
        self._on_close.append(callback)

    async def close(self) -> None:
        while self._on_close:
            with contextlib.suppress(Exception):
                result = self._on_close.pop()()
                if inspect.isawaitable(result):
                    await result
        cgroups, self.cgroups = self.cgroups, None
        netns, self._netns = self._netns, None
        await asyncio.to_thread(release, cgroups, netns, self._state)


def _with_failure(done: Completed, kind: FailureKind | None) -> Completed:
    if kind == done.failure_kind:
        return done
    return Completed(
        done.exit_code, done.stdout, done.stderr, done.wall_time_s, done.timed_out, kind, done.output_dropped
    )


async def _agent_process(info: BwrapInfo) -> AgentProcess | None:
    """The command's process (the PID namespace's pid 2) as the host sees it, as soon as it exists."""
    while (init := info.child_pid()) is None or (pid := command_pid(init)) is None:
        await asyncio.sleep(AGENT_POLL_S)
    return AgentProcess.of(pid)


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
        layout = BwrapLayout(
            workdir=state / "home", home=state / "home", etc=state / "etc", uid=uid, disable_userns=False
        )
        argv = bwrap_argv(layout, ["true"], cwd=WORKSPACE, system=system_mounts())
        done = subprocess.run([found, *argv], capture_output=True, timeout=30, check=False)
    return done.returncode == 0
