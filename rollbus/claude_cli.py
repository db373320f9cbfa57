"""The real Claude Code CLI: a pinned npm install, and the command line and environment to run it headless.

The npm package ships the native binary inside a per-platform package
(``@anthropic-ai/claude-code-linux-x64`` and so on); the wrapper's postinstall only hard-links it into place.
We install with ``--ignore-scripts`` and use the platform binary directly, so nothing is fetched at install
time beyond the npm tarballs themselves.
``python -m rollbus.claude_cli fetch`` installs it (``scripts/bootstrap.sh`` calls this).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from rollbus.npm_binary import CliInstallError, CliNotInstalled, NpmBinary

PACKAGE = "@anthropic-ai/claude-code"
VERSION = "2.1.197"
# Where sandboxes mount the binary (read-only): one fixed path, whatever the host's cache directory.
SANDBOX_BINARY = "/opt/claude-code/claude"

# Tools that would reach the internet (denied even when the network is sandboxed, so the model never tries).
DEFAULT_DISALLOWED_TOOLS = ("WebFetch", "WebSearch")
DEFAULT_MAX_OUTPUT_TOKENS = 8192


CLI = NpmBinary("Claude Code", PACKAGE, VERSION, "claude-code", "claude-code-*/claude", "rollbus.claude_cli")
install_dir, binary_path = CLI.install_dir, CLI.binary_path
execute_only_binary, fetch = CLI.execute_only_binary, CLI.fetch


def build_command(
    prompt: str,
    *,
    model: str,
    max_turns: int,
    binary: str | os.PathLike[str] = "claude",
    tools: Sequence[str] | None = None,
    disallowed_tools: Sequence[str] = DEFAULT_DISALLOWED_TOOLS,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv for one headless episode that streams JSON events on stdout.

    ``tools`` restricts the offered tools (``None`` keeps the CLI's default set). Permission prompts are
    bypassed: the sandbox, not the CLI, is the security boundary.
    """
    cmd = [str(binary), "-p", prompt, "--output-format", "stream-json", "--verbose"]
    cmd += ["--permission-mode", "bypassPermissions", "--model", model, "--max-turns", str(max_turns)]
    if tools is not None:
        cmd += ["--tools", ",".join(tools)]
    cmd += extra_args
    if disallowed_tools:  # last: the flag takes every following argument
        cmd += ["--disallowedTools", *disallowed_tools]
    return cmd


def build_env(
    base_url: str,
    token: str,
    *,
    model: str,
    small_fast_model: str | None = None,
    subagent_model: str | None = None,
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    home: str = "/home/agent",
    path: str = "/usr/local/bin:/usr/bin:/bin",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment for the CLI: every request goes to ``base_url``, nothing else leaves.

    A complete (not inherited) environment keeps host secrets such as ``ANTHROPIC_API_KEY`` out of the agent.
    ``IS_SANDBOX=1`` is what lets ``bypassPermissions`` run as root.
    """
    env = {
        "HOME": home,
        "PATH": path,
        "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": token,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": small_fast_model or model,
        "CLAUDE_CODE_SUBAGENT_MODEL": subagent_model or model,
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(max_output_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "DISABLE_PROMPT_CACHING": "1",
        "IS_SANDBOX": "1",
    }
    env.update(extra or {})
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollbus.claude_cli", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["fetch", "path"], help="fetch: install if absent; path: print it")
    parser.add_argument("--cli-version", default=VERSION, help=f"Claude Code version [default {VERSION}]")
    args = parser.parse_args(argv)
    try:
        binary = fetch(args.cli_version) if args.action == "fetch" else binary_path(args.cli_version)
        if args.action == "fetch":
            execute_only_binary(args.cli_version)  # made here once, not in a runner's first attempt
    except (CliNotInstalled, CliInstallError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"claude_cli: {exc}", file=sys.stderr)
        return 1
    print(binary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
