"""Fallback backend: a plain subprocess in the repository directory, for hosts where bwrap cannot run.

Clearly weaker: the agent runs as the calling user with the host's whole filesystem and network, and
``workdir`` is the real host path (so prompts must not assume ``/workspace``). Only the process group
is killed on timeout; a process that starts its own POSIX session escapes it.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollbus.sandbox.base import Completed, SandboxBase, read_host_file, write_host_file
from rollbus.sandbox.process import run_process


class LocalSubprocessSandbox(SandboxBase):
    def __init__(self, workdir: Path, *, sandbox_id: str | None = None) -> None:
        self.sandbox_id = sandbox_id or secrets.token_hex(8)
        self.enforced = {"isolation": "NONE (plain subprocess)", "wall_clock": "process group kill"}
        self._workdir = Path(workdir).resolve()
        self._home = Path(tempfile.mkdtemp(prefix="rollbus-home-"))
        self.workdir = str(self._workdir)
        self.home = str(self._home)
        self._mounts = {self.workdir: self._workdir, self.home: self._home}

    async def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        timeout: float = 600.0,
        *,
        agent: bool = False,
        secret_env: Mapping[str, str] | None = None,
    ) -> Completed:
        """The contract's ``run``, agent keywords included (as E2B's): ``agent`` changes nothing (no proxy
        stamps requests), ``secret_env`` joins the environment (nothing here isolates the agent anyway)."""
        env = {**env, **(secret_env or {})}
        return await run_process(cmd, env=env, cwd=cwd or self.workdir, timeout=timeout)

    async def write_file(self, path: str, data: bytes | str) -> None:
        write_host_file(self._mounts, path, data)

    async def read_file(self, path: str) -> bytes:
        return read_host_file(self._mounts, path)

    async def close(self) -> None:
        shutil.rmtree(self._home, ignore_errors=True)
