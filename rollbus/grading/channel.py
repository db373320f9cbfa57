"""The host's end of the grader's channel into the test sandbox (its other end: :mod:`.sandbox_channel`).

A pipe and a socket pair opened before the sandbox starts and handed to it as inherited descriptors: the
pipe holds the configuration (the canaries and which must fail), read once by the grader's plugin and given
back when its run ends; the socket carries the report, read here while the tests run (a reader thread, so
a long report never blocks the writer) and capped (a socket, not a pipe: nothing that writes to the
output's pipes hits it by chance). The environment carries only the configuration pipe's descriptor
number (``ROLLBUS_CHANNEL``); no path, run id or canary name is in the environment or the file system of
the tested process. I/O at the edge; the report's meaning is :mod:`.report`'s.
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


class ReportListener:
    """The second run's report (:mod:`.second_run`): a unix socket ``path`` in a host directory the sandbox
    already mounts (``/eval``), listening for one connection, which its harness makes before any code of the
    repository runs; the listener then closes and its file goes, so nothing else connects. No descriptor is
    inherited and nothing goes into the environment, so any backend that mounts the directory carries it.
    :meth:`collect` after the command ended."""

    def __init__(self, path: os.PathLike[str] | str, max_bytes: int = MAX_BYTES) -> None:
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
        if len(data) > 60_000:  # under a pipe's buffer: the write never blocks
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
