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
import ctypes
import dataclasses
import functools
import inspect
import json
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollbus.sandbox.base import (
    Completed,
    FailureKind,
    Network,
    SandboxBase,
    SandboxError,
    read_host_file,
    write_host_file,
)
from rollbus.sandbox.limits import Cgroups, Limits, enforcement, failure_from_counters, rlimits
from rollbus.sandbox.peer import AgentProcess, command_pid
from rollbus.sandbox.process import CappedBytes, run_process
from rollbus.sandbox.seccomp import filter_fd, nested_userns_filter

WORKSPACE = "/workspace"
HOME = "/home/agent"
ADAPTER_SOCKET = "/run/adapter.sock"
AGENT_UID = 1000
HOST_UID_BASE = 1_000_000  # per-sandbox host uids are drawn from [base, base + span)
HOST_UID_SPAN = 1_000_000
SCRATCH_ROOT = Path(os.environ.get("ROLLBUS_SANDBOX_ROOT", "/tmp/rollbus-sandboxes"))
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
# Start the forwarder, wait (at most ~10 s) until it listens, then become the command.
FORWARDER = (
    "$RB_SOCAT TCP-LISTEN:$RB_PORT,bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:" + ADAPTER_SOCKET + " &\n"
    'n=0; while ! grep -q "0100007F:$RB_HEX 00000000:0000 0A" /proc/net/tcp; do\n'
    "  n=$((n+1)); [ $n -gt 2000 ] && { echo 'rollbus: adapter forwarder did not start' >&2; exit 125; }\n"
    "  [ $n -gt 20 ] && sleep 0.005; done\n"
    'unset RB_PORT RB_HEX RB_SOCAT; exec "$@"'
)
HOST_USR = "/.rollbus/host/usr"
OWNER_FILE = "owner.pid"
TMP_MEASURED = "tmpfs size (host-mounted: its fill measured after each command)"
DISK_FULL_MARGIN = 64 << 10  # a tmpfs workspace with less free space than this after a command is full
TOOLCHAIN_SKIP = {"proc", "dev", "sys", "tmp", "run", "home", "workspace", ".rollbus"}
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 1 << 14, 1 << 18
MNT_DETACH = 2
AGENT_POLL_S = 0.005  # how often run(agent=True) looks for the command's process until it exists


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
    adapter_socket: Path | None = None  # host side of /run/adapter.sock ("adapter" network)
    forward_port: int | None = None  # loopback port of the forwarder inside
    tmp_bytes: int | None = None
    tmp_dir: Path | None = None  # host dir bound at /tmp (a tmpfs the host measures); None: bwrap's own tmpfs
    disable_userns: bool = True
    seccomp_fd: int | None = None  # a filter refusing new user namespaces (bwrap without --disable-userns)
    toolchain: Path | None = None  # a root filesystem mounted read-only as /; None: the host's /usr
    inside_workdir: str = WORKSPACE
    host_loader: tuple[str, ...] = ()  # how to run the host's socat over a foreign toolchain
    netns_joined: bool = False  # "adapter": the launcher joined the sandbox's own namespace (listener inside)


def system_mounts(
    toolchain: Path | None = None, host_usr: bool = False, staged_toolchain: Path | None = None
) -> list[str]:
    """The read-only system: a toolchain rootfs's top-level dirs, or the host's system dirs and /etc files.

    Over a toolchain, ``host_usr`` adds the host's ``/usr`` at ``/.rollbus/host/usr`` (read-only) so the
    forwarder can run the host's ``socat`` through the host's loader.
    """
    if toolchain is not None:
        return toolchain_mounts(toolchain, staged_toolchain) + (
            ["--ro-bind", "/usr", HOST_USR] if host_usr else []
        )
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


def toolchain_mounts(rootfs: Path, staged: Path | None = None) -> list[str]:
    """Each top-level entry of ``rootfs`` read-only (symlinks as symlinks) but what the sandbox provides.

    ``staged`` is where the launcher binds ``rootfs`` (the listing is read from the real one).
    """
    args: list[str] = []
    for entry in sorted(rootfs.iterdir()):
        if entry.name in TOOLCHAIN_SKIP:
            continue
        if entry.is_symlink():
            args += ["--symlink", os.readlink(entry), f"/{entry.name}"]
        elif entry.is_dir():
            args += ["--ro-bind", str((staged or rootfs) / entry.name), f"/{entry.name}"]
    return args


def host_socat() -> tuple[str, ...]:
    """The host's socat, run by the host's dynamic loader from ``/.rollbus/host/usr``."""
    loader = Path(os.path.realpath("/lib64/ld-linux-x86-64.so.2"))
    socat = Path(os.path.realpath(shutil.which("socat") or "/usr/bin/socat"))
    libdirs = ["/usr/lib/x86_64-linux-gnu", "/usr/lib"]

    def inside(path: Path | str) -> str:
        return HOST_USR + str(path).removeprefix("/usr")

    return (inside(loader), "--library-path", ":".join(inside(d) for d in libdirs), inside(socat))


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
    if layout.network == "loopback" or (layout.network == "adapter" and layout.netns_joined):
        argv.append("--share-net")  # the host's (debugging), or the sandbox's own the launcher joined
    if layout.uid is not None:
        argv += ["--unshare-user", "--uid", str(layout.uid), "--gid", str(layout.uid)]
        if layout.disable_userns:
            argv.append("--disable-userns")
        if layout.seccomp_fd is not None:
            argv += ["--seccomp", str(layout.seccomp_fd)]
    tmp = ["--size", str(layout.tmp_bytes), "--tmpfs", "/tmp"] if layout.tmp_bytes else ["--tmpfs", "/tmp"]
    if layout.tmp_dir is not None:
        tmp = ["--bind", str(layout.tmp_dir), "/tmp"]
    mounts = [
        ("--ro-bind", str(layout.etc / "passwd"), "/etc/passwd"),
        ("--ro-bind", str(layout.etc / "group"), "/etc/group"),
        ("--proc", "/proc"),
        ("--dev", "/dev"),
        tuple(tmp),
        ("--bind", str(layout.workdir), layout.inside_workdir),
        ("--bind", str(layout.home), HOME),
        *(("--ro-bind", host, inside) for host, inside in layout.ro_binds.items()),
    ]
    if layout.network == "adapter" and not layout.netns_joined:
        assert layout.adapter_socket is not None and layout.forward_port is not None
        mounts.append(("--ro-bind", str(layout.adapter_socket), ADAPTER_SOCKET))
        argv += ["--setenv", "RB_PORT", str(layout.forward_port)]
        argv += ["--setenv", "RB_HEX", f"{layout.forward_port:04X}"]
        argv += ["--setenv", "RB_SOCAT", " ".join(layout.host_loader) or "socat"]
        cmd = ["/bin/sh", "-c", FORWARDER, "sh", *cmd]
    mounts.append(("--remount-ro", "/"))  # last: everything above keeps its own flags
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
    for name in ("passwd", "group"):
        (etc / name).chmod(0o644)


def chown_tree(root: Path, uid: int) -> None:
    """Hand a tree to the sandbox's host uid (symlinks themselves, never their targets)."""
    os.chown(root, uid, uid, follow_symlinks=False)
    for parent, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.chown(os.path.join(parent, name), uid, uid, follow_symlinks=False)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def make_launcher(
    host_uid: int | None,
    binds: Sequence[tuple[str, str]],
    procs_files: Sequence[str],
    limits: Sequence[tuple[int, int]],
    netns: int | None = None,
) -> Callable[[], None]:
    """Child-side setup before bwrap: join cgroups and ``netns``, set rlimits, stage binds, drop to host_uid.

    Runs between fork and exec, so it only calls precomputed syscalls. The binds live in a private mount
    namespace of the launcher: the host's mount table never changes.
    """
    libc = _libc()
    encoded = [(src.encode(), dst.encode()) for src, dst in binds]

    def launch() -> None:
        for path in procs_files:  # "0": the writer itself (the only thread of this child)
            with open(path, "w") as f:
                f.write("0")
        for which, value in limits:  # CPU: SIGXCPU at the soft limit (named), SIGKILL a second later
            resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
        if netns is not None and libc.setns(netns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "join the sandbox's network namespace")
        if encoded:
            if libc.unshare(CLONE_NEWNS) != 0 or libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                raise OSError(ctypes.get_errno(), "private mount namespace")
            for src, dst in encoded:
                if libc.mount(src, dst, None, MS_BIND | MS_REC, None) != 0:
                    raise OSError(ctypes.get_errno(), f"bind {src!r}")
        if host_uid is not None:
            os.setgroups([])
            os.setresgid(host_uid, host_uid, host_uid)
            os.setresuid(host_uid, host_uid, host_uid)

    return launch


class BwrapSandbox(SandboxBase):
    """A bubblewrap sandbox around one prepared repository (see the module docstring for what holds)."""

    workdir = WORKSPACE
    home = HOME
    proxy: Any = None  # the AdapterProxy serving this sandbox's socket, when it has one

    def __init__(
        self,
        workdir: Path,
        *,
        network: Network = "none",
        ro_binds: Mapping[str | os.PathLike[str], str] | None = None,
        uid: int | None = AGENT_UID,
        bwrap: str = "bwrap",
        limits: Limits | None = None,
        adapter_socket: Path | None = None,
        forward_port: int | None = None,
        host_uid: int | None = None,
        sandbox_id: str | None = None,
        toolchain: Path | None = None,
        scratch_root: Path = SCRATCH_ROOT,
        inside_workdir: str = WORKSPACE,
        userns_guard: Literal["auto", "seccomp"] = "auto",
        netns: int | None = None,
    ) -> None:
        """``netns``: for ``network="adapter"``, the sandbox's own network namespace with the adapter listener
        inside (:func:`rollbus.sandbox.netns.private_netns`; the sandbox keeps a duplicate of the fd), instead
        of ``adapter_socket`` and a forwarder on ``forward_port``."""
        found = shutil.which(bwrap)
        if found is None:
            raise SandboxUnavailable(f"{bwrap!r} not found (apt-get install bubblewrap)")
        if netns is not None and network != "adapter":
            raise ValueError("a joined network namespace is for network='adapter' only")
        if network == "adapter" and netns is None and (adapter_socket is None or forward_port is None):
            raise ValueError("network='adapter' needs a netns, or adapter_socket and forward_port")
        self._bwrap = found
        self.workdir = inside_workdir
        self._on_close: list[Callable[[], Awaitable[None] | None]] = []
        self._binds: list[tuple[str, str]] = []
        self.sandbox_id = sandbox_id or secrets.token_hex(8)
        self.limits = limits or Limits()
        root = os.geteuid() == 0
        self.host_uid = (host_uid or HOST_UID_BASE + secrets.randbelow(HOST_UID_SPAN)) if root else None
        if root:
            require_traversable(scratch_root)
        self._state = make_scratch(scratch_root, self.sandbox_id, self.limits.disk_bytes)
        self.cgroups: Cgroups | None = None
        self._netns: int | None = None
        try:
            self._netns = os.dup(netns) if netns is not None else None
            self._host_workdir = self._prepare_host(Path(workdir).resolve(), uid)
            self._tmp = self._state / "tmp" if self._private_tmp() else None
            binds = {str(Path(host).resolve()): inside for host, inside in (ro_binds or {}).items()}
            sources = {
                "workdir": self._host_workdir,
                "home": self._state / "home",
                "etc": self._state / "etc",
            }
            sources |= {f"ro{i}": Path(host) for i, host in enumerate(binds)}
            if self._tmp is not None:
                sources["tmp"] = self._tmp
            forwarder = network == "adapter" and self._netns is None
            if forwarder:
                sources["adapter"] = Path(adapter_socket)  # type: ignore[arg-type]
            if toolchain is not None:
                sources["toolchain"] = Path(toolchain).resolve()
            staged = self._stage(sources) if root else sources
            self.layout = BwrapLayout(
                workdir=staged["workdir"],
                home=staged["home"],
                etc=staged["etc"],
                network=network,
                ro_binds={str(staged[f"ro{i}"]): inside for i, inside in enumerate(binds.values())},
                uid=uid,
                adapter_socket=staged.get("adapter"),
                forward_port=forward_port,
                tmp_bytes=self.limits.tmp_bytes,
                tmp_dir=staged.get("tmp"),
                disable_userns=uid is not None
                and userns_guard == "auto"
                and bwrap_supports("--disable-userns", found),
                toolchain=toolchain,
                inside_workdir=inside_workdir,
                host_loader=host_socat() if toolchain is not None and forwarder else (),
                netns_joined=self._netns is not None,
            )
            self._seccomp = None if self.layout.disable_userns else nested_userns_filter()
            self._mounts = {inside_workdir: self._host_workdir, HOME: self._state / "home"}
            self._system = system_mounts(toolchain, forwarder, staged.get("toolchain"))
            self.cgroups = Cgroups.create(f"rollbus-{self.sandbox_id}", self.limits)
        except BaseException:
            if self.cgroups is not None:
                self.cgroups.destroy()
            if self._netns is not None:
                os.close(self._netns)
            remove_scratch(self._state)
            raise
        self.enforced = self._report()

    def _prepare_host(self, workdir: Path, uid: int | None) -> Path:
        """HOME and the identity files in the state dir; the workspace and HOME handed to the host uid."""
        (self._state / "home").mkdir(mode=0o700)
        write_identity(self._state / "etc", uid)
        if self.host_uid is not None:
            chown_tree(workdir, self.host_uid)
            os.chown(self._state / "home", self.host_uid, self.host_uid)
        self._disk_mounted = os.path.ismount(workdir)
        self._home_capped = os.path.ismount(self._state) and self.limits.disk_bytes is not None
        return workdir

    def _private_tmp(self) -> bool:
        """As root /tmp is a tmpfs the host mounts (in the state dir, gone with it): its fill is measured."""
        path = self._state / "tmp"
        path.mkdir(mode=0o1777)
        return mount_tmpfs(path, 0o1777, self.limits.tmp_bytes, name="rollbus-tmp")

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

    def _stage(self, sources: Mapping[str, Path]) -> dict[str, Path]:
        """Mountpoints in the traversable scratch dir; the launcher binds each source there."""
        mnt = self._state / "mnt"
        mnt.mkdir(mode=0o711)
        staged = {}
        for name, src in sources.items():
            point = mnt / name
            if src.is_dir():
                point.mkdir(mode=0o755)
            else:
                point.touch(mode=0o644)
            staged[name] = point
            self._binds.append((str(src), str(point)))
        return staged

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
    ) -> Completed:
        """``agent``: ``cmd`` is the agent; while it runs the adapter proxy knows its process, so what it
        sends is stamped ``agent`` and what anything it starts sends is stamped ``tool``."""
        return await self._run(
            self.layout, self._system, self._binds, self._netns, cmd, env, cwd, timeout, agent=agent
        )

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
    ) -> Completed:
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
                kill=lambda _proc: _kill_namespace(info),
                pass_fds=(info_w,) if filter_in is None else (info_w, filter_in),
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
        full = _free_bytes(tmp) < DISK_FULL_MARGIN
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
        if tmp_full or _free_bytes(self._host_workdir) < DISK_FULL_MARGIN:
            return "disk_full"  # measured: whatever filesystem holds the workspace (a capped tmpfs) is full
        if self._home_capped and _free_bytes(self._state) < DISK_FULL_MARGIN:
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
        await asyncio.to_thread(_release, cgroups, netns, self._state)


def _release(cgroups: Cgroups | None, netns: int | None, state: Path) -> None:
    """A closed sandbox's host resources, off the event loop (unmounts and removals block on the disk)."""
    if cgroups is not None:
        cgroups.destroy()
    if netns is not None:
        os.close(netns)
    remove_scratch(state)


def _with_failure(done: Completed, kind: FailureKind | None) -> Completed:
    if kind == done.failure_kind:
        return done
    return Completed(
        done.exit_code, done.stdout, done.stderr, done.wall_time_s, done.timed_out, kind, done.output_dropped
    )


def make_scratch(root: Path, sandbox_id: str, size: int | None = None) -> Path:
    """The sandbox's private host directory, under a root every sandbox uid may traverse but not list.

    As root it is a tmpfs of its own (``size`` caps it: HOME is part of the sandbox's disk): a sandbox's
    dozen small files and dirs cost no disk inodes, and close drops them all at once.
    """
    root.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        root.chmod(0o711)
    path = root / sandbox_id
    path.mkdir(mode=0o711)
    mount_tmpfs(path, 0o711, size)
    (path / OWNER_FILE).write_text(str(os.getpid()))  # for sweep_stale after a kill -9
    return path


def mount_tmpfs(path: Path, mode: int, size: int | None = None, name: str = "rollbus-scratch") -> bool:
    """A fresh ``nosuid,nodev`` tmpfs on the directory ``path`` (as root; False where there is none)."""
    if os.geteuid() != 0:
        return False
    options = f"mode={mode:o}" + (f",size={size}" if size is not None else "")
    flags = MS_NOSUID | MS_NODEV
    return _libc().mount(name.encode(), str(path).encode(), b"tmpfs", flags, options.encode()) == 0


def unmount(path: Path) -> None:
    """Detach the mount at ``path`` and everything mounted under it."""
    _libc().umount2(str(path).encode(), MNT_DETACH)


def remove_scratch(path: Path) -> None:
    """Remove a scratch directory, unmounting its tmpfs first (the files go with it, no walk)."""
    if os.path.ismount(path):
        unmount(path)
    shutil.rmtree(path, ignore_errors=True)


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def require_traversable(path: Path) -> None:
    """The sandbox uids must reach their staging dirs: every existing ancestor needs the others' x bit."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.stat().st_mode & 0o001:
            raise SandboxUnavailable(
                f"sandbox scratch root {path}: {parent} is not traversable (chmod o+x it)"
            )


def settle(paths: Iterable[Path]) -> int:
    """After a command: strip setuid/setgid bits the agent set (they never reach the host), return the bytes
    the trees use (allocated blocks, hard links once). Symlinks are never followed. Only hard-linked files are
    remembered (to count them once): a workspace of a million small files costs the host no set of them."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top in paths:
        for parent, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(parent, name)
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                        os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
                    if st.st_nlink > 1:
                        if (st.st_dev, st.st_ino) in seen:
                            continue
                        seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


async def _agent_process(info: BwrapInfo) -> AgentProcess | None:
    """The command's process (the PID namespace's pid 2) as the host sees it, as soon as it exists."""
    while (init := info.child_pid()) is None or (pid := command_pid(init)) is None:
        await asyncio.sleep(AGENT_POLL_S)
    return AgentProcess.of(pid)


class BwrapInfo:
    """What bwrap writes on ``--info-fd`` (one small JSON write), read once it is there."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._info: dict[str, Any] | None = None

    def child_pid(self) -> int | None:
        """The host pid of the PID namespace's init; None while bwrap has not started it."""
        if self._info is None:
            try:
                self._info = json.loads(os.read(self._fd, 65536) or b"{}")
            except BlockingIOError:
                return None
        pid = self._info.get("child-pid")
        return pid if isinstance(pid, int) else None


def _kill_namespace(info: BwrapInfo) -> None:
    """SIGKILL the PID namespace's init, which takes every process in the namespace with it."""
    pid = info.child_pid()  # None: bwrap had not started the sandbox yet, and killing its group is enough
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@functools.cache
def bwrap_supports(flag: str, bwrap: str = "bwrap") -> bool:
    """Whether this bwrap knows ``flag`` (``--disable-userns`` came in 0.8)."""
    done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False)
    return flag in done.stdout + done.stderr


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
