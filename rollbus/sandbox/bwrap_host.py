"""The privileged host side of a bubblewrap sandbox: its state directory, uids, mounts, cgroups and launcher.

As root the host makes, per sandbox, a state directory on a tmpfs of its own, hands the workspace and HOME to
a fresh unprivileged host uid, stages sources the uid could not reach in a private mount namespace of the
launcher, and creates the sandbox's cgroups; :func:`prepare_host` does all of it (blocking: callers run it
off the event loop) and undoes what it did when a step fails; :func:`release` undoes it at close.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollbus.sandbox.base import Network, SandboxUnavailable
from rollbus.sandbox.bwrap_layout import AGENT_UID, HOME, WORKSPACE, BwrapLayout, host_socat, system_mounts
from rollbus.sandbox.limits import Cgroups, Limits
from rollbus.sandbox.seccomp import nested_userns_filter

HOST_UID_BASE = 1_000_000  # per-sandbox host uids are drawn from [base, base + span)
HOST_UID_SPAN = 1_000_000
SCRATCH_ROOT = Path(os.environ.get("ROLLBUS_SANDBOX_ROOT", "/tmp/rollbus-sandboxes"))
OWNER_FILE = "owner.pid"
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 1 << 14, 1 << 18
MNT_DETACH = 2


@dataclass
class HostSide:
    """What :func:`prepare_host` made for one sandbox; :func:`release` undoes it."""

    sandbox_id: str
    bwrap: str  # the binary's path
    limits: Limits
    state: Path  # the sandbox's private host directory
    host_workdir: Path
    host_uid: int | None  # None when not root: the caller's uid
    layout: BwrapLayout
    system: list[str]  # the read-only system's bwrap arguments
    binds: list[tuple[str, str]]  # source -> staged mountpoint, bound by the launcher
    mounts: dict[str, Path]  # inside path -> host path, for files the host reads and writes
    tmp: Path | None  # the host-mounted /tmp (root only)
    seccomp: bytes | None
    cgroups: Cgroups | None
    netns: int | None  # our duplicate of the joined network namespace's fd
    disk_mounted: bool  # the workspace is a filesystem of its own (its free space says when it is full)
    home_capped: bool  # the state dir (HOME) is a capped tmpfs


def prepare_host(
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
) -> HostSide:
    """The host side of a sandbox over ``workdir``. ``netns``: for ``network="adapter"``, the sandbox's own
    network namespace with the adapter listener inside (:func:`rollbus.sandbox.netns.private_netns`; a
    duplicate of the fd is kept), instead of ``adapter_socket`` and a forwarder on ``forward_port``."""
    found = shutil.which(bwrap)
    if found is None:
        raise SandboxUnavailable(f"{bwrap!r} not found (apt-get install bubblewrap)")
    if netns is not None and network != "adapter":
        raise ValueError("a joined network namespace is for network='adapter' only")
    if network == "adapter" and netns is None and (adapter_socket is None or forward_port is None):
        raise ValueError("network='adapter' needs a netns, or adapter_socket and forward_port")
    sandbox_id = sandbox_id or secrets.token_hex(8)
    limits = limits or Limits()
    root = os.geteuid() == 0
    host_uid = (host_uid or HOST_UID_BASE + secrets.randbelow(HOST_UID_SPAN)) if root else None
    if root:
        require_traversable(scratch_root)
    state = make_scratch(scratch_root, sandbox_id, limits.disk_bytes)
    cgroups: Cgroups | None = None
    dup: int | None = None
    try:
        dup = os.dup(netns) if netns is not None else None
        host_workdir = Path(workdir).resolve()
        (state / "home").mkdir(mode=0o700)
        write_identity(state / "etc", uid)
        if host_uid is not None:
            chown_tree(host_workdir, host_uid)
            os.chown(state / "home", host_uid, host_uid)
        (state / "tmp").mkdir(mode=0o1777)  # as root a tmpfs the host mounts: its fill is measured
        private_tmp = mount_tmpfs(state / "tmp", 0o1777, limits.tmp_bytes, name="rollbus-tmp")
        tmp = state / "tmp" if private_tmp else None
        binds = {str(Path(host).resolve()): inside for host, inside in (ro_binds or {}).items()}
        sources = {"workdir": host_workdir, "home": state / "home", "etc": state / "etc"}
        sources |= {f"ro{i}": Path(host) for i, host in enumerate(binds)}
        if tmp is not None:
            sources["tmp"] = tmp
        forwarder = network == "adapter" and dup is None
        if forwarder:
            sources["adapter"] = Path(adapter_socket)  # type: ignore[arg-type]  # a str when network="adapter"
        if toolchain is not None:
            sources["toolchain"] = Path(toolchain).resolve()
        staged_binds: list[tuple[str, str]] = []
        staged = stage(state, sources, staged_binds) if root else sources
        layout = BwrapLayout(
            workdir=staged["workdir"],
            home=staged["home"],
            etc=staged["etc"],
            network=network,
            ro_binds={str(staged[f"ro{i}"]): inside for i, inside in enumerate(binds.values())},
            uid=uid,
            adapter_socket=staged.get("adapter"),
            forward_port=forward_port,
            tmp_bytes=limits.tmp_bytes,
            tmp_dir=staged.get("tmp"),
            disable_userns=uid is not None
            and userns_guard == "auto"
            and bwrap_supports("--disable-userns", found),
            toolchain=toolchain,
            inside_workdir=inside_workdir,
            host_loader=host_socat() if toolchain is not None and forwarder else (),
            netns_joined=dup is not None,
        )
        cgroups = Cgroups.create(f"rollbus-{sandbox_id}", limits)
        return HostSide(
            sandbox_id=sandbox_id,
            bwrap=found,
            limits=limits,
            state=state,
            host_workdir=host_workdir,
            host_uid=host_uid,
            layout=layout,
            system=system_mounts(toolchain, forwarder, staged.get("toolchain")),
            binds=staged_binds,
            mounts={inside_workdir: host_workdir, HOME: state / "home"},
            tmp=tmp,
            seccomp=None if layout.disable_userns else nested_userns_filter(),
            cgroups=cgroups,
            netns=dup,
            disk_mounted=os.path.ismount(host_workdir),
            home_capped=os.path.ismount(state) and limits.disk_bytes is not None,
        )
    except BaseException:
        release(cgroups, dup, state)
        raise


def stage(state: Path, sources: Mapping[str, Path], binds: list[tuple[str, str]]) -> dict[str, Path]:
    """Mountpoints in the traversable state dir; the launcher binds each source there (added to ``binds``)."""
    mnt = state / "mnt"
    mnt.mkdir(mode=0o711)
    staged = {}
    for name, src in sources.items():
        point = mnt / name
        if src.is_dir():
            point.mkdir(mode=0o755)
        else:
            point.touch(mode=0o644)
        staged[name] = point
        binds.append((str(src), str(point)))
    return staged


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
def libc() -> ctypes.CDLL:
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
    lib = libc()
    encoded = [(src.encode(), dst.encode()) for src, dst in binds]

    def launch() -> None:
        for path in procs_files:  # "0": the writer itself (the only thread of this child)
            with open(path, "w") as f:
                f.write("0")
        for which, value in limits:  # CPU: SIGXCPU at the soft limit (named), SIGKILL a second later
            resource.setrlimit(which, (value, value + 1 if which == resource.RLIMIT_CPU else value))
        if netns is not None and lib.setns(netns, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "join the sandbox's network namespace")
        if encoded:
            if lib.unshare(CLONE_NEWNS) != 0 or lib.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
                raise OSError(ctypes.get_errno(), "private mount namespace")
            for src, dst in encoded:
                if lib.mount(src, dst, None, MS_BIND | MS_REC, None) != 0:
                    raise OSError(ctypes.get_errno(), f"bind {src!r}")
        if host_uid is not None:
            os.setgroups([])
            os.setresgid(host_uid, host_uid, host_uid)
            os.setresuid(host_uid, host_uid, host_uid)

    return launch


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
    return libc().mount(name.encode(), str(path).encode(), b"tmpfs", flags, options.encode()) == 0


def unmount(path: Path) -> None:
    """Detach the mount at ``path`` and everything mounted under it."""
    libc().umount2(str(path).encode(), MNT_DETACH)


def remove_scratch(path: Path) -> None:
    """Remove a scratch directory, unmounting its tmpfs first (the files go with it, no walk)."""
    if os.path.ismount(path):
        unmount(path)
    shutil.rmtree(path, ignore_errors=True)


def free_bytes(path: Path) -> int:
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


class BwrapInfo:
    """What bwrap writes on ``--info-fd``, read once it is all there. bwrap writes the object in several
    writes (the opening and ``"child-pid": ``, the pid, the namespace ids, the closing brace), so a read can
    return part of it: bytes gather until they parse, or until bwrap closes the pipe."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""
        self._info: dict[str, Any] | None = None

    def child_pid(self) -> int | None:
        """The host pid of the PID namespace's init; None while bwrap has not started it (or not yet said so
        in full)."""
        if self._info is None:
            ended = False
            try:
                while chunk := os.read(self._fd, 65536):
                    self._buffer += chunk
                ended = True  # bwrap closed its end: nothing more will come
            except BlockingIOError:
                pass
            try:
                self._info = json.loads(self._buffer) if self._buffer else ({} if ended else None)
            except json.JSONDecodeError:
                if not ended:
                    return None  # part of the object: the rest is on its way
                self._info = {}  # bwrap died mid-write: no pid to report
            if self._info is None:
                return None
        pid = self._info.get("child-pid")
        return pid if isinstance(pid, int) else None


def kill_namespace(info: BwrapInfo) -> None:
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


def release(cgroups: Cgroups | None, netns: int | None, state: Path) -> None:
    """A closed sandbox's host resources, off the event loop (unmounts and removals block on the disk)."""
    if cgroups is not None:
        cgroups.destroy()
    if netns is not None:
        os.close(netns)
    remove_scratch(state)
