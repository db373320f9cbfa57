"""Start rollbus services as child processes and wait until they answer: for the end-to-end tests.

Each service runs as ``python -m rollbus <service> ...``, exactly as a user would start it, with its output
in a log file, so a failure shows the service's own words.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from rollbus.polling import WaitTimeout, wait_until


class ServiceFailed(RuntimeError):
    """A service exited or did not answer its health check in time."""


class ServiceProcess:
    """``rollbus <name> <args>`` in the background; ``start()`` returns once ``health_url`` answers 200."""

    def __init__(self, name: str, args: list[str], *, health_url: str, log_dir: Path) -> None:
        self.name, self.args, self.health_url = name, args, health_url
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> float:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollbus", self.name, *self.args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy(),
            )  # fmt: skip
        try:
            wait_until(self._healthy, timeout=timeout, interval=0.2, what=f"{self.name} health")
        except WaitTimeout:
            self.stop()
            raise ServiceFailed(
                f"{self.name} did not answer {self.health_url} in {timeout:.0f}s:\n{self.log_tail()}"
            ) from None
        return time.monotonic() - started

    def _healthy(self) -> bool:
        """True once the health URL answers 200; :class:`ServiceFailed` at once if the process exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ServiceFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(self.health_url, timeout=2.0).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the service and every process it started (the adapter drains on it), then SIGKILL
        to whatever lingers after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            family = [psutil.Process(self.proc.pid)]
            family += family[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(family, timeout=timeout)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> ServiceProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
