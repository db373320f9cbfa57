"""The host's end of the grader's channel into the test sandbox (its other end: :mod:`.sandbox_channel`).

A pipe and a socket pair opened before the sandbox starts and handed to it as inherited descriptors: the
pipe holds the configuration (the canaries and which must fail), read once by the grader's plugin and given
back when its run ends; the socket carries the report, read here while the tests run (a reader thread, so
a long report never blocks the writer) and capped (a socket, not a pipe: nothing that writes to the
output's pipes hits it by chance). The environment carries only the configuration pipe's descriptor
number (``ROLLBUS_CHANNEL``); no path, run id or canary name is in the environment or the file system of
the tested process. I/O at the edge; the report's meaning is :mod:`.report`'s.

A container cannot inherit a host descriptor (the Engine API carries none), so :class:`SocketChannel` brings
the same channel in through a unix socket in a host directory bind-mounted alone: the grader's launcher
(:mod:`.sandbox_launch`, run as the command, before any code of the repository) connects, the host accepts
that one connection, closes its listener and removes the socket file, then sends the configuration; the
launcher makes the configuration pipe inside the container and becomes the command with the same
descriptors bwrap's command inherits. From there on everything is as above.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
from collections.abc import Mapping
from typing import Any

MAX_BYTES = 16 * 2**20
ENV = "ROLLBUS_CHANNEL"
SOCKET_NAME = "channel"  # the socket file in the directory a container backend mounts
MAX_CONFIG = 60_000  # under a pipe's buffer: the launcher's write into its pipe never blocks


class ReportListener:
    """The second run's report (:mod:`.second_run`): a unix socket ``path`` in a host directory the sandbox
    already mounts (``/eval``), listening for one connection, which its harness makes before any code of the
    repository runs; the listener then closes and its file goes, so nothing else connects. No descriptor is
    inherited and nothing goes into the environment, so any backend that mounts the directory carries it.
    :meth:`collect` after the command ended."""

    def __init__(
        self, path: os.PathLike[str] | str, max_bytes: int = MAX_BYTES, greeting: bytes = b""
    ) -> None:
        """``greeting``: sent on the connection first, then the host's side is shut (:class:`SocketChannel`'s
        configuration)."""
        self.path = os.fspath(path)
        directory, name = os.path.split(self.path)
        os.chmod(directory, 0o755)  # the sandbox's uid reaches the socket in it
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held = os.open(directory, os.O_PATH | os.O_DIRECTORY)
        try:  # through the directory's descriptor: however deep the scratch directory, the path fits
            self._listener.bind(f"/proc/self/fd/{held}/{name}")
        finally:
            os.close(held)
        os.chmod(self.path, 0o777)  # the sandbox's uid connects (once)
        self._listener.listen(1)
        self._max = max_bytes
        self._greeting = greeting
        self._chunks: list[bytes] = []
        self._size = 0
        self.text = ""
        self._accepted = threading.Event()
        self._reader = threading.Thread(target=self._serve, name="grader-report", daemon=True)
        self._reader.start()

    def _serve(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        finally:
            self._accepted.set()
            self._stop_listening()
        with conn:
            if self._greeting:
                try:
                    conn.sendall(self._greeting)
                    conn.shutdown(socket.SHUT_WR)  # nothing more from the host: the other end reads to here
                except OSError:
                    return
            while True:
                try:
                    chunk = conn.recv(1 << 16)
                except OSError:
                    return
                if not chunk:
                    return
                if self._size <= self._max:  # past the cap: drained, not kept
                    self._chunks.append(chunk)
                self._size += len(chunk)

    def _stop_listening(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes an accept still waiting
        with contextlib.suppress(OSError):
            self._listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def collect(self, wait_s: float = 5.0) -> str:
        """The report, once the command is over (its processes gone: the connection's other end closed). A
        connection still waiting in the backlog is accepted first: stopping the listener would drop it."""
        with contextlib.suppress(OSError, ValueError):
            if select.select([self._listener], [], [], 0)[0]:
                self._accepted.wait(wait_s)
        self._stop_listening()
        self._reader.join(wait_s)
        self.text = b"".join(self._chunks)[: self._max + 1].decode("utf-8", errors="replace")
        return self.text

    def close(self) -> None:
        self._stop_listening()


class Channel:
    """One run's pipes: :attr:`env` and :attr:`fds` go to the command; :meth:`collect` after it ended."""

    def __init__(self, config: Mapping[str, Any], max_bytes: int = MAX_BYTES) -> None:
        self._config_r, self._config_w = os.pipe()
        report_r, report_w = socket.socketpair()
        self._report_r, self._report_w = report_r.detach(), report_w.detach()
        self._open = {self._config_r, self._config_w, self._report_r, self._report_w}
        full = {**config, "report_fd": self._report_w, "refill_fd": self._config_w}
        data = (json.dumps(full) + "\n").encode()
        if len(data) > MAX_CONFIG:  # under a pipe's buffer: the write never blocks
            for fd in list(self._open):
                self._close(fd)
            raise ValueError(f"the channel's configuration takes {len(data)} bytes")
        os.write(self._config_w, data)
        self._max = max_bytes
        self.text = ""  # the report, once collected
        self._chunks: list[bytes] = []
        self._size = 0
        self._reader = threading.Thread(target=self._read, name="grader-channel", daemon=True)
        self._reader.start()

    @property
    def env(self) -> dict[str, str]:
        return {ENV: str(self._config_r)}

    @property
    def fds(self) -> tuple[int, ...]:
        return (self._config_r, self._config_w, self._report_w)

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._report_r, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            if self._size <= self._max:  # past the cap: drained, not kept (the writer never blocks)
                self._chunks.append(chunk)
            self._size += len(chunk)

    def collect(self, wait_s: float = 5.0) -> str:
        """The report, once the command is over (every process of the sandbox gone): the host's write ends
        closed, the reader drained. Text past the cap is cut (the report then fails to parse: not the
        grader's)."""
        for fd in (self._report_w, self._config_w, self._config_r):
            self._close(fd)
        self._reader.join(wait_s)
        self.close()
        self.text = b"".join(self._chunks)[: self._max + 1].decode("utf-8", errors="replace")
        return self.text

    def close(self) -> None:
        for fd in (self._config_r, self._config_w, self._report_w):
            self._close(fd)
        if not self._reader.is_alive():  # a reader still blocked keeps its descriptor (a daemon thread)
            self._close(self._report_r)

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)


class SocketChannel(ReportListener):
    """The channel of one command in a container: a listening unix socket ``directory/channel`` (the
    directory is what the backend mounts), one connection accepted (the launcher's), then the socket is
    gone; the configuration is sent on that connection and the report read from it. :attr:`env` and
    :attr:`fds` are empty (the launcher makes them inside)."""

    def __init__(
        self, config: Mapping[str, Any], directory: os.PathLike[str] | str, max_bytes: int = MAX_BYTES
    ) -> None:
        data = (json.dumps(dict(config)) + "\n").encode()
        if len(data) > MAX_CONFIG - 100:  # the launcher adds its two descriptor numbers
            raise ValueError(f"the channel's configuration takes {len(data)} bytes")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        super().__init__(os.path.join(self.directory, SOCKET_NAME), max_bytes, greeting=data)

    @property
    def env(self) -> dict[str, str]:
        return {}

    @property
    def fds(self) -> tuple[int, ...]:
        return ()
