"""E2B backend: the same interface over a cloud micro-VM (``e2b.AsyncSandbox``).

The VM is the isolation; its template must already hold ``git`` and the Claude Code binary. Commands go
through envd as ``bash -l -c``; a timed-out command is killed by its handle (SIGKILL to its process).
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rollbus.sandbox.base import Completed

E2B_HOME = "/home/user"
E2B_WORKSPACE = "/home/user/workspace"
KILLED_EXIT_CODE = -9


class E2BSandbox:
    """Wraps a live SDK sandbox. Build one with :meth:`create`; tests pass a stand-in to the constructor."""

    def __init__(self, sdk_sandbox: Any, *, workdir: str = E2B_WORKSPACE, home: str = E2B_HOME) -> None:
        self._sbx = sdk_sandbox
        self.workdir = workdir
        self.home = home

    @classmethod
    async def create(
        cls,
        *,
        template: str | None = None,
        lifetime_s: int = 3600,
        workdir: str = E2B_WORKSPACE,
        allow_internet_access: bool = False,
        **sdk_options: Any,
    ) -> E2BSandbox:
        """Start a VM from ``template`` (credentials come from the SDK's usual ``E2B_API_KEY``)."""
        from e2b import AsyncSandbox  # the SDK is only needed when this backend is chosen

        sbx = await AsyncSandbox.create(
            template=template, timeout=lifetime_s, allow_internet_access=allow_internet_access, **sdk_options
        )
        await sbx.commands.run(f"mkdir -p {shlex.quote(workdir)}")
        return cls(sbx, workdir=workdir)

    async def run(
        self, cmd: Sequence[str], env: Mapping[str, str], cwd: str | None = None, timeout: float = 600.0
    ) -> Completed:
        from e2b import CommandExitException

        start = time.monotonic()
        # timeout=0: no SDK-side stream deadline; ours below kills the command instead of just hanging up.
        handle = await self._sbx.commands.run(
            shlex.join(cmd), background=True, envs=dict(env), cwd=cwd or self.workdir, timeout=0
        )
        try:
            result = await asyncio.wait_for(handle.wait(), timeout)
        except CommandExitException as exc:  # the SDK raises on any non-zero exit
            result = exc
        except TimeoutError:
            await handle.kill()
            return Completed(KILLED_EXIT_CODE, handle.stdout, handle.stderr, time.monotonic() - start, True)
        return Completed(result.exit_code, result.stdout, result.stderr, time.monotonic() - start, False)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self._sbx.files.write(path, data)

    async def read_file(self, path: str) -> bytes:
        return bytes(await self._sbx.files.read(path, format="bytes"))

    async def close(self) -> None:
        await self._sbx.kill()
