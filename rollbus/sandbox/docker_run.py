"""One command in one fresh container, to completion: the Docker backend's ``run``, as blocking calls made
off the event loop.

The container is created from the image's digest with the host config the caller built, attached (stdin,
stdout, stderr as one multiplexed stream), started, and waited for under the deadline; at the deadline the
whole container is killed, every process in it with it. Secrets go in on its standard input, then stdin is
closed: they never reach the container's configuration (``docker inspect``) or its environment. Output is
bounded as :mod:`rollbus.sandbox.process` bounds a host process's. Where the engine is local, the pids
cgroup's ``max`` events are watched while the container runs, so a hit is named from the kernel's counter.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbus.sandbox.process import BoundedOutput, CappedBytes

PIDS_POLL_S = 0.02
EXEC_POLL_S = 0.05  # how often a running command's state is asked for
CGROUP_PIDS = (  # where a container's pids cgroup lives (cgroup v1 with cgroupfs; v2; v2 under systemd)
    "/sys/fs/cgroup/pids/docker/{id}/pids.events",
    "/sys/fs/cgroup/docker/{id}/pids.events",
    "/sys/fs/cgroup/system.slice/docker-{id}.scope/pids.events",
)


@dataclass(frozen=True)
class Ran:
    """How the container ended: its exit status, whether the deadline killed it, what the engine and the
    kernel said (``oom_killed``, ``pids_hit``), its output and the wall time."""

    exit_code: int
    timed_out: bool
    oom_killed: bool
    pids_hit: bool
    stdout: str
    stderr: str
    output_dropped: int
    wall_time_s: float


def run_container(
    client: Any,
    create: dict[str, Any],
    timeout: float,
    *,
    stdin: bytes = b"",
    output_limit: int,
    stdout: CappedBytes | None = None,
    started: Callable[[str, int], None] | None = None,
    cancelled: threading.Event | None = None,
) -> Ran:
    """Create (``create``: the keyword arguments of the low-level ``create_container``), run and remove one
    container. ``started(container_id, host_pid)`` is called once it runs; ``cancelled`` set kills it."""
    api = client.api
    config = api.create_container_config(**create, stdin_open=True, tty=False)
    config["StdinOnce"] = True  # the command sees EOF once the host closed its side
    cid = api.create_container_from_config(config)["Id"]
    t0 = time.monotonic()
    try:
        stream = api.attach_socket(cid, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        sock: socket.socket = getattr(stream, "_sock", stream)
        out, err = BoundedOutput(output_limit), BoundedOutput(output_limit)
        stop = cancelled or threading.Event()  # set by the reader too, once a capped stdout is full
        reader = threading.Thread(target=_demux, args=(sock, stdout or out, err, stop), daemon=True)
        reader.start()
        api.start(cid)
        done = threading.Event()
        pids = _PidsWatch(cid, done)
        if started is not None:
            started(cid, int(api.inspect_container(cid)["State"]["Pid"]))
        try:
            if stdin:
                sock.sendall(stdin)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the command already exited: it did not want its input
        timed_out = _wait(api, cid, t0 + timeout, stop)
        done.set()
        reader.join(timeout=5.0)
        sock.close()
        state = api.inspect_container(cid)["State"]
        pids.thread.join(timeout=1.0)
        return Ran(
            exit_code=int(state.get("ExitCode", -1)), timed_out=timed_out,
            oom_killed=bool(state.get("OOMKilled")), pids_hit=pids.hit,
            stdout=out.text(), stderr=err.text(), output_dropped=out.dropped + err.dropped,
            wall_time_s=time.monotonic() - t0,
        )  # fmt: skip
    finally:
        api.remove_container(cid, force=True, v=True)


def run_exec(
    client: Any,
    cid: str,
    create: dict[str, Any],
    timeout: float,
    *,
    stdin: bytes = b"",
    output_limit: int,
    kill: Callable[[], None],
    leftovers: Callable[[], None],
    started: Callable[[int], None] | None = None,
    cancelled: threading.Event | None = None,
) -> Ran:
    """One command in the running container ``cid`` (``create``: the keyword arguments of ``exec_create``).
    When its process exits, ``leftovers()`` kills whatever it left running (their output pipes would keep
    the stream open); at the deadline or when ``cancelled`` is set, ``kill()`` kills every process the
    command started (the caller's choice of how: the sandbox's container lives on).
    ``oom_killed`` and ``pids_hit`` are left to the caller's counters (the container outlives the command)."""
    api = client.api
    exec_id = api.exec_create(cid, **create, stdin=True, stdout=True, stderr=True, tty=False)["Id"]
    t0 = time.monotonic()
    stream = api.exec_start(exec_id, socket=True, tty=False)
    sock: socket.socket = getattr(stream, "_sock", stream)
    out, err = BoundedOutput(output_limit), BoundedOutput(output_limit)
    stop = cancelled or threading.Event()
    reader = threading.Thread(target=_demux, args=(sock, out, err, stop), daemon=True)
    reader.start()
    try:
        if stdin:
            sock.sendall(stdin)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    timed_out, pid, exited = False, 0, False
    deadline = t0 + timeout
    while reader.is_alive():
        if time.monotonic() >= deadline or stop.is_set():
            timed_out = True
            kill()
            break
        state = api.exec_inspect(exec_id)
        if not pid and state.get("Pid") and started is not None:
            pid = int(state["Pid"])
            started(pid)
        if not state.get("Running") and not exited:
            exited = True
            leftovers()
        reader.join(EXEC_POLL_S)
    reader.join(5.0)
    sock.close()
    state = api.exec_inspect(exec_id)
    code = state.get("ExitCode")
    return Ran(
        exit_code=137 if timed_out or code is None else int(code), timed_out=timed_out, oom_killed=False,
        pids_hit=False, stdout=out.text(), stderr=err.text(), output_dropped=out.dropped + err.dropped,
        wall_time_s=time.monotonic() - t0,
    )  # fmt: skip


def _wait(api: Any, cid: str, deadline: float, cancelled: threading.Event | None) -> bool:
    """Until the container exits (False) or the deadline or ``cancelled`` kills it (True)."""
    import requests

    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (cancelled is not None and cancelled.is_set()):
            _kill(api, cid)
            api.wait(cid, timeout=60)
            return True
        try:
            api.wait(cid, timeout=min(left, 0.5) + 0.05)
            return False
        except requests.exceptions.ConnectionError:  # the SDK's read timeout: still running
            continue


def _kill(api: Any, cid: str) -> None:
    import docker

    try:
        api.kill(cid)
    except docker.errors.APIError:  # exited meanwhile
        pass


class _PidsWatch:
    """Polls the container's pids cgroup until ``done``: ``hit`` once the kernel refused it a fork."""

    def __init__(self, cid: str, done: threading.Event) -> None:
        self.hit = False
        self._files = [Path(p.format(id=cid)) for p in CGROUP_PIDS]
        self._done = done
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.hit:
            for path in self._files:
                try:
                    counts = dict(line.split() for line in path.read_text().splitlines() if line.strip())
                except (OSError, ValueError):
                    continue
                if int(counts.get("max", 0)) > 0:
                    self.hit = True
            if self._done.wait(PIDS_POLL_S):
                return


def _demux(
    sock: socket.socket, out: BoundedOutput | CappedBytes, err: BoundedOutput, stop: threading.Event
) -> None:
    """Split the engine's multiplexed stream (8-byte frame headers: stream, 0, 0, 0, big-endian length);
    a :class:`CappedBytes` stdout that overflows sets ``stop`` (the container is killed: the host holds
    no more than the cap)."""
    buffer = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            return
        if not chunk:
            return
        buffer += chunk
        while len(buffer) >= 8:
            kind, length = buffer[0], struct.unpack(">I", buffer[4:8])[0]
            if len(buffer) < 8 + length:
                break
            payload = bytes(buffer[8 : 8 + length])
            del buffer[: 8 + length]
            if kind == 2:
                err.add(payload)
            elif kind == 1:
                out.add(payload)
                if isinstance(out, CappedBytes) and out.overflowed:
                    stop.set()
                    return
