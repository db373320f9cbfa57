"""Codex: the real CLI (:mod:`rollbus.codex_cli`), headless, on the adapter's Responses route.

It runs from its execute-only copy mounted read-only beside its model catalog (whose context window is the
served model's). Its token reaches it through a pipe, never the sandbox's environment, and its tools see
Codex's core variables only, never the token. No E2B install yet: on E2B a Codex row is a bad task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollbus import codex_cli
from rollbus.sandbox import Completed
from rollbus.services.sandbox_runner.harnesses import (
    SANDBOX_ENV,
    Exit,
    Launch,
    Where,
    execute_only,
    stream_json_exit,
)

if TYPE_CHECKING:
    from rollbus.sandbox import SandboxBase
    from rollbus.services.sandbox_runner.rollout import RunnerKit
    from rollbus.services.sandbox_runner.settings import RunnerSettings

CATALOG = "/opt/codex/catalog.json"  # where the sandbox mounts the Codex model catalog (read-only)


class Codex:
    name = "codex"
    adapter_harness = "codex"
    installs_in_vm = False

    def host_files(self, settings: RunnerSettings) -> dict[str, str]:
        catalog = codex_cli.catalog_file(settings.model, context_window=settings.context_length)
        return {execute_only(codex_cli): codex_cli.SANDBOX_BINARY, str(catalog): CATALOG}

    def launch(
        self, settings: RunnerSettings, where: Where, prompt: str, token: str, timeout: float
    ) -> Launch:
        cmd = command(
            prompt, base_url=where.base_url, model=settings.model, workdir=where.workdir, timeout=timeout,
            tool_env=SANDBOX_ENV, context_length=settings.context_length,
        )  # fmt: skip
        env = codex_cli.build_env(token, home=where.home, extra=SANDBOX_ENV)
        return Launch(cmd, env, {codex_cli.TOKEN_ENV: env.pop(codex_cli.TOKEN_ENV)})

    def read_exit(self, completed: Completed) -> Exit:
        return stream_json_exit(completed)

    async def install_in_vm(self, kit: RunnerKit, sandbox: SandboxBase) -> str:
        raise NotImplementedError("no E2B install of Codex")


def command(
    prompt: str,
    *,
    base_url: str,
    model: str,
    workdir: str,
    timeout: float,
    tool_env: dict[str, str],
    context_length: int = codex_cli.DEFAULT_CONTEXT_WINDOW,
) -> list[str]:
    """The Codex CLI's argv in the sandbox: the adapter's Responses route under ``base_url``; the commands
    it runs see ``tool_env`` and Codex's core variables only (never the token)."""
    return codex_cli.build_command(
        prompt, base_url=f"{base_url}/v1", model=model, catalog=CATALOG, workdir=workdir,
        binary=codex_cli.SANDBOX_BINARY, max_turn_seconds=timeout, tool_env=tool_env,
        context_length=context_length,
    )  # fmt: skip


HARNESS = Codex()
