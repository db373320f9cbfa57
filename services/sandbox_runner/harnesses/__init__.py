"""Agent harnesses: one real coding-agent CLI each, behind one small protocol, chosen by name.

A harness says everything the runner must know of its CLI and nothing else does: what the sandbox mounts
read-only for it (or how it installs in an E2B VM), its command line, environment and secrets, the adapter
route its session token opens, and how to read its exit. A row chooses with ``metadata.agent`` (one name, or a
list the group's samples take in turn); the runner's ``--agent`` is the default, so one dataset can mix
harnesses and a group can compare them. Every harness runs in the same sandbox with the adapter as its only
way out, and the grader grades the diff whoever made it. A new harness is one file here, added to
:func:`registry`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rollbus.sandbox import Completed
from rollbus.services.sandbox_runner import outcome

if TYPE_CHECKING:
    from rollbus.sandbox import SandboxBase
    from rollbus.services.sandbox_runner.rollout import RunnerKit
    from rollbus.services.sandbox_runner.settings import RunnerSettings

SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__ from the agent's test runs in its patch


class UnknownAgent(ValueError):
    """The row names an agent harness the runner does not have."""


class NotInstalled(RuntimeError):
    """The harness's pinned CLI is not on this host (bootstrap installs it; never fetched mid-rollout)."""


@dataclass(frozen=True)
class Where:
    """Where the harness runs, as its sandbox sees it."""

    base_url: str  # the adapter (the sandbox's forwarder locally, the public URL on E2B)
    home: str
    workdir: str
    binary: str | None = None  # the CLI as installed in the VM (E2B); None: where ``host_files`` mounts it
    path: str | None = None  # PATH, when the VM's own (E2B); None: the harness's default


@dataclass(frozen=True)
class Launch:
    """One run of the CLI: its argv, its complete environment, and the secrets it gets through a pipe
    (local sandboxes) rather than from the sandbox's configuration."""

    cmd: list[str]
    env: dict[str, str]
    secrets: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Exit:
    """What the CLI's run says: its failure kind (None: it ended normally) and how many turns it took."""

    failure: str | None
    turns: int


class Harness(Protocol):
    name: str  # as in ``--agent`` and ``metadata.agent``
    adapter_harness: str  # the adapter's harness its token opens (so the one route its wire protocol uses)
    installs_in_vm: bool  # runs on E2B (``install_in_vm``); elsewhere its rows are bad tasks there

    def host_files(self, settings: RunnerSettings) -> dict[str, str]:
        """Host path -> inside path of what the sandbox mounts read-only (its CLI first); raises
        :class:`NotInstalled` when the CLI is not on this host."""
        ...

    def launch(
        self, settings: RunnerSettings, where: Where, prompt: str, token: str, timeout: float
    ) -> Launch:
        """The CLI's command line, environment and secrets for one attempt."""
        ...

    def read_exit(self, completed: Completed) -> Exit:
        """The run's failure kind and turn count, from how it ended and what it printed."""
        ...

    async def install_in_vm(self, kit: RunnerKit, sandbox: SandboxBase) -> str:
        """E2B: install the CLI in the VM unless its template has it; its absolute path there."""
        ...


def stream_json_exit(completed: Completed) -> Exit:
    """The exit of a CLI that closes with a stream-json ``result`` event (Claude Code's)."""
    return Exit(outcome.classify(completed), outcome.agent_turns(completed.stdout))


def execute_only(cli: Any) -> str:
    """The cached binary of an npm-shipped CLI (``rollbus.claude_cli``, ``rollbus.codex_cli``) as its
    execute-only copy: the CLI runs non-dumpable, its memory and environment closed to its tools."""
    import os

    try:
        binary = cli.binary_path()
    except cli.CliNotInstalled as exc:
        raise NotInstalled(str(exc)) from exc
    if not os.access(binary, os.X_OK):
        raise NotInstalled(f"{binary} is not an executable file")
    try:
        return str(cli.execute_only_binary())
    except OSError as exc:
        raise NotInstalled(f"no execute-only copy of {binary}: {exc}") from exc


@functools.cache
def registry() -> Mapping[str, Harness]:
    """Every harness by name, imported at first use (``python -m`` of a harness module runs it once)."""
    from rollbus.services.sandbox_runner.harnesses import claude_code, codex, mini_swe_agent

    return {h.name: h for h in (claude_code.HARNESS, codex.HARNESS, mini_swe_agent.HARNESS)}


def __getattr__(name: str) -> Any:
    if name == "HARNESSES":
        return registry()
    if name == "AGENTS":
        return tuple(registry())
    raise AttributeError(name)


def harness(name: str) -> Harness:
    try:
        return registry()[name]
    except KeyError:
        raise UnknownAgent(f"no agent harness {name!r} (one of {', '.join(registry())})") from None


def chosen(metadata: dict[str, Any], default: str, sample_index: int = 0) -> str:
    """The row's ``metadata.agent``, else ``default``; anything else is the row's error. A list of harnesses
    gives sample K the K-th (modulo its length), so one group compares them: ``["claude_code", "codex"]``."""
    agent, names = metadata.get("agent", default), tuple(registry())
    if isinstance(agent, list) and agent and all(a in names for a in agent):
        return str(agent[sample_index % len(agent)])
    if agent not in names:
        raise UnknownAgent(
            f"metadata.agent must be one of {', '.join(names)} or a non-empty list of them, not {agent!r}"
        )
    return str(agent)
