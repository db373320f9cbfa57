"""Claude Code: the real CLI (:mod:`rollbus.claude_cli`), headless, on the adapter's Anthropic Messages route.

It runs from its execute-only copy mounted read-only; on E2B it is installed in the VM from the settings'
tarballs (:mod:`rollbus.services.sandbox_runner.remote`). Its token reaches it through a pipe on local
sandboxes; it hands its whole environment to its tools, so there the adapter proxy's peer stamp is what keeps
a tool's request from training. Its exit is read from its closing stream-json ``result`` event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollbus import claude_cli
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


class ClaudeCode:
    name = "claude_code"
    adapter_harness = "claude_code"
    installs_in_vm = True

    def host_files(self, settings: RunnerSettings) -> dict[str, str]:
        return {execute_only(claude_cli): claude_cli.SANDBOX_BINARY}

    def launch(
        self, settings: RunnerSettings, where: Where, prompt: str, token: str, timeout: float
    ) -> Launch:
        cmd = claude_cli.build_command(
            prompt, model=settings.model, max_turns=settings.max_turns,
            binary=where.binary or claude_cli.SANDBOX_BINARY,
            disallowed_tools=settings.denied_tools(), extra_args=settings.extra_cli_args(),
        )  # fmt: skip
        env = claude_cli.build_env(
            where.base_url, token, model=settings.model, home=where.home,
            max_output_tokens=settings.max_output_tokens, extra=SANDBOX_ENV,
            **({"path": where.path} if where.path else {}),
        )  # fmt: skip
        return Launch(cmd, env, {"ANTHROPIC_AUTH_TOKEN": env.pop("ANTHROPIC_AUTH_TOKEN")})

    def read_exit(self, completed: Completed) -> Exit:
        return stream_json_exit(completed)

    async def install_in_vm(self, kit: RunnerKit, sandbox: SandboxBase) -> str:
        from rollbus.services.sandbox_runner import remote

        return await remote.install(kit, sandbox)


HARNESS = ClaudeCode()
