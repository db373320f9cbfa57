"""A Docker engine to talk to: the one ``DOCKER_HOST`` (or the default socket) names if it answers, else one
the project starts itself and leaves running for the next caller.

The project's own engine keeps all its state under the cache (``$ROLLBUS_CACHE/docker``): images, containers
and volumes in ``data``, runtime state in ``exec``, the API on ``docker.sock``. It runs without a bridge and
without touching the host's firewall (``--bridge=none --iptables=false``): sandboxes have no network anyway,
and image builds use the host's. Paths stay short: a unix socket path must fit in 108 bytes. Starting it needs
root and Debian's ``docker.io`` (``scripts/bootstrap.sh`` installs it); where it cannot start,
:class:`EngineUnavailable` says why in one line.

Podman serves the same Engine API (``podman system service``): point ``DOCKER_HOST`` at its socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollbus.config import cache_dir

START_TIMEOUT_S = 60.0  # a cold dockerd answers within seconds; past this it is not coming
PING_TIMEOUT_S = 5  # whole seconds: docker's client takes an int
API_TIMEOUT_S = 600  # image imports and waits are long; a ping is not
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes, NUL included


class EngineUnavailable(RuntimeError):
    """No Docker engine answers and none could be started here (the message says why, in one line)."""


def engine_dir() -> Path:
    """The project's engine's state: ``data`` (images, containers, volumes), ``exec``, the socket, its log."""
    return cache_dir() / "docker"


def own_socket() -> Path:
    return engine_dir() / "docker.sock"


def client(start: bool = True) -> Any:
    """A ``docker.DockerClient`` for an engine that answers: ``DOCKER_HOST``'s if set (never replaced by one
    of ours: the caller chose it), else the default socket's, else the project's own, started if ``start``.
    Raises :class:`EngineUnavailable`."""
    import docker

    if os.environ.get("DOCKER_HOST"):
        if not _answers(lambda: docker.from_env(timeout=PING_TIMEOUT_S)):
            raise EngineUnavailable(f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer")
        return docker.from_env(timeout=API_TIMEOUT_S)
    return docker.DockerClient(base_url=f"unix://{_answering_socket(start)}", timeout=API_TIMEOUT_S)


def _answering_socket(start: bool) -> Path:
    """The default socket if its engine answers, else the project's own, started first if ``start``."""
    for sock in (Path("/var/run/docker.sock"), own_socket()):
        if _answers_at(sock):
            return sock
    if not start:
        raise EngineUnavailable("no Docker engine answers (and starting one was not asked for)")
    start_engine()
    return own_socket()


def start_engine() -> None:
    """Start the project's own ``dockerd`` (detached, in its own session: it outlives this process and
    serves every later caller) and wait until it answers. One starter at a time (a lock file)."""
    home = engine_dir()
    sock = own_socket()
    if len(str(sock)) > SOCKET_PATH_MAX:
        raise EngineUnavailable(f"the engine's socket path {sock} is longer than {SOCKET_PATH_MAX} bytes")
    dockerd = shutil.which("dockerd") or ("/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").exists() else None)
    if dockerd is None:
        raise EngineUnavailable("no dockerd here: run scripts/bootstrap.sh --test (Debian's docker.io)")
    if os.geteuid() != 0:
        raise EngineUnavailable("no Docker engine answers, and starting one needs root")
    home.mkdir(parents=True, exist_ok=True)

    with open(home / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second starter waits here, then finds the first one's engine
        if _answers_at(sock):
            return
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()  # left by an engine that died
        argv = [
            dockerd, "--iptables=false", "--ip-masq=false", "--bridge=none",
            "--data-root", str(home / "data"), "--exec-root", str(home / "exec"),
            "--pidfile", str(home / "dockerd.pid"), "-H", f"unix://{sock}",
        ]  # fmt: skip
        with open(home / "dockerd.log", "ab") as log:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                last = _last_line(home / "dockerd.log")
                raise EngineUnavailable(f"dockerd exited {proc.returncode}: {last}")
            if _answers_at(sock):
                return
            time.sleep(0.1)
        proc.kill()
        raise EngineUnavailable(
            f"dockerd did not answer within {START_TIMEOUT_S:.0f} s: {_last_line(home / 'dockerd.log')}"
        )


def _answers_at(sock: Path) -> bool:
    import docker

    if not sock.is_socket():
        return False
    return _answers(lambda: docker.DockerClient(base_url=f"unix://{sock}", timeout=PING_TIMEOUT_S))


def _answers(connect: Callable[[], Any]) -> bool:
    """Whether the engine ``connect()`` reaches answers a ping (the client is closed either way).

    Why a factory: the SDK's client asks the engine for its API version while it is being made, so a socket
    left behind by a dead engine raises there already, before any ping."""
    try:
        candidate = connect()
    except Exception:  # the SDK raises requests' and its own errors alike for "nobody there"
        return False
    try:
        return bool(candidate.ping())
    except Exception:
        return False
    finally:
        candidate.close()


def _last_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1][-300:] if lines else "(empty log)"


def docker_host() -> str:
    """The ``DOCKER_HOST`` value for the engine :func:`client` talks to (for tools that read the variable,
    such as testcontainers and the Compose CLI). Starts the project's own engine where none answers."""
    if os.environ.get("DOCKER_HOST"):
        return os.environ["DOCKER_HOST"]
    return f"unix://{_answering_socket(start=True)}"
