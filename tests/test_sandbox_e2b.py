"""E2BSandbox against a stand-in for the SDK's ``AsyncSandbox``, at the narrowest boundary we can fake.

No E2B cloud is reachable here, so ``FakeAsyncSandbox`` replaces the SDK object the backend wraps: the same
methods and arguments (``commands.run`` with ``background=True`` returning a handle with ``wait``/``kill``/
``stdout``/``stderr``; ``files.write``/``files.read``; ``kill``), raising the SDK's *real*
``CommandExitException`` on a non-zero exit, and running commands as real local ``bash -c`` processes in a
scratch directory standing for the VM's filesystem.

Left unexercised: ``E2BSandbox.create`` and ``AsyncSandbox.create`` (API key, template, network options),
envd's RPC transport and its ``bash -l`` login environment, the SDK's handling of ``timeout=0``, what
``handle.kill`` reaches inside the VM (one pid or a tree), remote users and permissions, and whether the
template really holds git and the Claude Code binary.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from e2b import CommandExitException, CommandResult

from rollbus.sandbox import E2BSandbox


class FakeCommandHandle:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self._out: list[str] = []
        self._err: list[str] = []
        assert proc.stdout is not None and proc.stderr is not None
        self._readers = [
            asyncio.ensure_future(self._pump(proc.stdout, self._out)),
            asyncio.ensure_future(self._pump(proc.stderr, self._err)),
        ]
        self.killed = False

    @staticmethod
    async def _pump(stream: asyncio.StreamReader, chunks: list[str]) -> None:
        while line := await stream.readline():
            chunks.append(line.decode())

    @property
    def stdout(self) -> str:
        return "".join(self._out)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    async def wait(self) -> CommandResult:
        code = await self._proc.wait()
        await asyncio.gather(*self._readers)
        if code != 0:
            raise CommandExitException(stdout=self.stdout, stderr=self.stderr, exit_code=code, error=None)
        return CommandResult(stdout=self.stdout, stderr=self.stderr, exit_code=0, error=None)

    async def kill(self) -> bool:
        self.killed = True
        os.killpg(self._proc.pid, signal.SIGKILL)
        await self._proc.wait()
        return True


class FakeCommands:
    def __init__(self, root: Path) -> None:
        self._root = root
        self.calls: list[dict[str, Any]] = []
        self.handles: list[FakeCommandHandle] = []

    async def run(
        self,
        cmd: str,
        background: bool | None = None,
        envs: dict[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        timeout: float | None = 60,
        **_: Any,
    ) -> Any:
        self.calls.append(
            {"cmd": cmd, "background": background, "envs": envs, "cwd": cwd, "timeout": timeout}
        )
        local_cwd = self._root / (cwd or "/home/user").lstrip("/")
        local_cwd.mkdir(parents=True, exist_ok=True)
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            cmd,
            cwd=local_cwd,
            env={"PATH": "/usr/bin:/bin", **(envs or {})},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        handle = FakeCommandHandle(proc)
        self.handles.append(handle)
        return handle if background else await handle.wait()


class FakeFilesystem:
    def __init__(self, root: Path) -> None:
        self._root = root

    async def write(self, path: str, data: str | bytes, **_: Any) -> None:
        target = self._root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)

    async def read(self, path: str, format: str = "text", **_: Any) -> str | bytearray:  # noqa: A002 - SDK name
        data = (self._root / path.lstrip("/")).read_bytes()
        return bytearray(data) if format == "bytes" else data.decode()


class FakeAsyncSandbox:
    """Stands in for ``e2b.AsyncSandbox``: ``commands``, ``files``, ``kill``."""

    def __init__(self, root: Path) -> None:
        self.commands = FakeCommands(root)
        self.files = FakeFilesystem(root)
        self.killed = False

    async def kill(self) -> bool:
        self.killed = True
        return True


@pytest.fixture
async def vm(tmp_path: Path) -> AsyncIterator[tuple[E2BSandbox, FakeAsyncSandbox]]:
    fake = FakeAsyncSandbox(tmp_path)
    yield E2BSandbox(fake), fake


async def test_exit_code_output_env_and_workdir(vm: tuple[E2BSandbox, FakeAsyncSandbox]) -> None:
    sandbox, fake = vm
    await sandbox.write_file(f"{sandbox.workdir}/in.txt", "payload")
    done = await sandbox.run(
        ["sh", "-c", 'cat in.txt; echo " $GREETING"; echo oops >&2; exit 3'], {"GREETING": "hi"}
    )
    assert (done.exit_code, done.stdout, done.stderr, done.timed_out) == (3, "payload hi\n", "oops\n", False)
    [call] = fake.commands.calls
    assert (
        call["background"] is True and call["cwd"] == sandbox.workdir and call["envs"] == {"GREETING": "hi"}
    )


async def test_zero_exit_and_quoting_survive_the_shell_string(
    vm: tuple[E2BSandbox, FakeAsyncSandbox],
) -> None:
    sandbox, _ = vm
    done = await sandbox.run(["printf", "%s|", "two words", "it's", "$HOME"], {})
    assert (done.exit_code, done.stdout) == (0, "two words|it's|$HOME|")


async def test_timeout_kills_the_command_and_keeps_partial_output(
    vm: tuple[E2BSandbox, FakeAsyncSandbox],
) -> None:
    sandbox, fake = vm
    done = await sandbox.run(["sh", "-c", "echo started; sleep 300"], {}, timeout=1)
    assert done.timed_out and done.exit_code < 0 and done.stdout == "started\n"
    assert fake.commands.handles[0].killed
    assert fake.commands.calls[0]["timeout"] == 0  # the SDK's own deadline would only hang up, not kill


async def test_files_round_trip_bytes_and_close_kills_the_vm(vm: tuple[E2BSandbox, FakeAsyncSandbox]) -> None:
    sandbox, fake = vm
    blob = bytes(range(256))
    await sandbox.write_file("/home/user/workspace/blob.bin", blob)
    assert await sandbox.read_file("/home/user/workspace/blob.bin") == blob
    await sandbox.close()
    assert fake.killed
