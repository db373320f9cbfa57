"""Which agent harness runs a row: the Claude Code CLI or the Codex CLI, each the real binary.

A row chooses with ``metadata.agent`` (``claude_code`` | ``codex``); the runner's ``--agent`` is the default,
so one dataset can mix harnesses and a group can compare them. Both run in the same sandbox with the adapter
as their only way out; each gets a session token that opens only its own route (``/v1/messages`` or
``/v1/responses``). The grader is the same for both: it grades the diff.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollbus import claude_cli, codex_cli

CLAUDE_CODE, CODEX = "claude_code", "codex"
AGENTS = (CLAUDE_CODE, CODEX)
CODEX_CATALOG = "/opt/codex/catalog.json"  # where the sandbox mounts the Codex model catalog (read-only)


class UnknownAgent(ValueError):
    """The row names an agent harness the runner does not have."""


def chosen(metadata: dict[str, Any], default: str, sample_index: int = 0) -> str:
    """The row's ``metadata.agent``, else ``default``; anything else is the row's error. A list of harnesses
    gives sample K the K-th (modulo its length), so one group compares them: ``["claude_code", "codex"]``."""
    agent = metadata.get("agent", default)
    if isinstance(agent, list) and agent and all(a in AGENTS for a in agent):
        return agent[sample_index % len(agent)]
    if agent not in AGENTS:
        raise UnknownAgent(
            f"metadata.agent must be one of {', '.join(AGENTS)} or a non-empty list of them, not {agent!r}"
        )
    return agent


def cli(agent: str) -> Any:
    """The module that installs and runs ``agent``'s CLI (``binary_path``, ``execute_only_binary``, ...)."""
    return codex_cli if agent == CODEX else claude_cli


def mounts(
    agent: str, binary: Path, model: str, context_length: int = codex_cli.DEFAULT_CONTEXT_WINDOW
) -> dict[str, str]:
    """Host path -> sandbox path of what the agent needs read-only: its binary (and Codex's catalog, whose
    context window is the served model's)."""
    binds = {str(binary): cli(agent).SANDBOX_BINARY}
    if agent == CODEX:
        binds[str(codex_cli.catalog_file(model, context_window=context_length))] = CODEX_CATALOG
    return binds


def codex_command(
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
        prompt, base_url=f"{base_url}/v1", model=model, catalog=CODEX_CATALOG, workdir=workdir,
        binary=codex_cli.SANDBOX_BINARY, max_turn_seconds=timeout, tool_env=tool_env,
        context_length=context_length,
    )  # fmt: skip
