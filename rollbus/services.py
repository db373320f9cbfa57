"""Start rollbus services as child processes and wait until they answer: for the demo and end-to-end tests.

Each service runs as ``python -m rollbus <service> ...``, exactly as a user would start it, with its output
in a log file, so a failure shows the service's own words.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


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
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                raise ServiceFailed(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.health_url, timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise ServiceFailed(
            f"{self.name} did not answer {self.health_url} in {timeout:.0f}s:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the adapter drains on it), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
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
