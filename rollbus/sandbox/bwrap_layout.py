"""The bubblewrap command line for a sandbox, as pure functions over a :class:`BwrapLayout`.

Everything host-specific (staged paths, fds, the toolchain's listing) comes in as arguments, so the layout a
sandbox gets is testable without a sandbox: ``/usr`` and the ``/lib*`` links (or a toolchain root) read-only,
our own ``passwd``/``group``, fresh ``/proc`` and ``/dev``, a capped ``/tmp``, the repository read-write,
a private HOME, extra read-only binds, the forwarder to the adapter where the namespace has no listener, and
the root remounted read-only last.
"""

from __future__ import annotations

import os
import re
import select
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollbus.sandbox.base import Network

WORKSPACE = "/workspace"
HOME = "/home/agent"
ADAPTER_SOCKET = "/run/adapter.sock"
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
# Start the forwarder, wait (at most ~10 s) until it listens, then become the command.
FORWARDER = (
    "$RB_SOCAT TCP-LISTEN:$RB_PORT,bind=127.0.0.1,fork,reuseaddr UNIX-CONNECT:" + ADAPTER_SOCKET + " &\n"
    'n=0; while ! grep -q "0100007F:$RB_HEX 00000000:0000 0A" /proc/net/tcp; do\n'
    "  n=$((n+1)); [ $n -gt 2000 ] && { echo 'rollbus: adapter forwarder did not start' >&2; exit 125; }\n"
    "  [ $n -gt 20 ] && sleep 0.005; done\n"
    'unset RB_PORT RB_HEX RB_SOCAT; exec "$@"'
)
# Reads ``NAME=value`` lines from standard input (a pipe the host wrote and closed), exports them and execs
# the rest with /dev/null as its input: the command gets its secrets without bwrap's pid 1 (dumpable, the
# agent's uid) ever holding them in its environment or command line. Nothing of the agent's runs before the
# exec, so no tool can race the read, and the pipe is empty by then.
SECRET_READER = 'while IFS= read -r kv; do export "$kv"; done; exec "$@" < /dev/null'
SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_BYTES = select.PIPE_BUF  # what one pipe write holds atomically: it never blocks


class BadSecret(ValueError):
    """A secret variable this reader cannot carry (a bad name, a newline or NUL in its value, too long)."""


def secret_lines(secrets: Mapping[str, str]) -> bytes:
    """What the host writes into the secret pipe: one ``NAME=value`` line a variable."""
    for name, value in secrets.items():
        if not SECRET_NAME.fullmatch(name):
            raise BadSecret(f"{name!r} is not a variable name")
        if "\n" in value or "\0" in value:
            raise BadSecret(f"the value of {name} holds a newline or NUL")
    data = "".join(f"{name}={value}\n" for name, value in secrets.items()).encode()
    if len(data) > SECRET_BYTES:
        raise BadSecret(f"the secrets take {len(data)} bytes, more than {SECRET_BYTES}")
    return data


def with_secrets(cmd: Sequence[str]) -> list[str]:
    """``cmd`` behind :data:`SECRET_READER`, which reads its secrets from standard input."""
    return ["/bin/sh", "-c", SECRET_READER, "sh", *cmd]


HOST_USR = "/.rollbus/host/usr"
TOOLCHAIN_SKIP = {"proc", "dev", "sys", "tmp", "run", "home", "workspace", ".rollbus"}


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
