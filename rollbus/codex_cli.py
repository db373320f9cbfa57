"""The real Codex CLI: a pinned npm install, and the command line, config and environment to run it headless.

``@openai/codex`` is a small Node wrapper whose optional dependency (``@openai/codex-linux-x64``, an alias of
``@openai/codex@<version>-linux-x64``) ships a static native binary under ``vendor/<triple>/bin/codex``. We
install with ``--ignore-scripts`` and run that binary directly, so Node is not needed at run time.
``python -m rollbus.codex_cli fetch`` installs it (``scripts/bootstrap.sh`` calls this).

What the real binary sends and needs on the wire is written down in ``docs/codex-wire.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollbus.config import cache_dir
from rollbus.npm_binary import CliInstallError, CliNotInstalled, NpmBinary

PACKAGE = "@openai/codex"
VERSION = "0.169.0"
# Where sandboxes mount the binary (read-only): one fixed path, whatever the host's cache directory.
SANDBOX_BINARY = "/opt/codex/codex"
PROVIDER = "rollbus"  # any name but "OpenAI": that one brings WebSocket attempts and remote compaction
TOKEN_ENV = "ROLLBUS_CODEX_TOKEN"  # the provider's env_key: sent as ``Authorization: Bearer``


CLI = NpmBinary(
    "Codex", PACKAGE, VERSION, "codex", "codex-*/vendor/*/bin/codex", "rollbus.codex_cli", npm_timeout_s=900
)
install_dir, binary_path = CLI.install_dir, CLI.binary_path
execute_only_binary, fetch = CLI.execute_only_binary, CLI.fetch


DEFAULT_INSTRUCTIONS = (
    "You are a coding agent working in the repository in the current directory. Use the tools to read and "
    "change files and to run commands; finish with a short summary of what you changed."
)
DEFAULT_CONTEXT_WINDOW = 32768  # the adapter's default --context-length
TOOL_OUTPUT_TOKENS = 10_000  # Codex's truncation of one tool output, at most a quarter of the context
CHECKPOINT_TOKENS = 1_000  # room for the compaction request's own message


def tool_output_tokens(context_length: int) -> int:
    """The most one tool output adds to a history (the catalog's ``truncation_policy``)."""
    return min(TOOL_OUTPUT_TOKENS, context_length // 4)


def compact_limit(context_length: int) -> int:
    """Codex's ``model_auto_compact_token_limit`` for a served context of ``context_length`` tokens.

    Codex compacts before a request once the last response's usage plus its estimate of the tool output
    added since reaches the limit, and the compaction request carries that whole history plus its checkpoint
    message. The adapter refuses a prompt at ``context_length`` with a 400 that Codex does not survive (Claude
    Code compacts on it; Codex fails the run), so the limit leaves room for one more tool output and the
    checkpoint: a history just under it, grown by a tool output, still fits as a compaction request."""
    return context_length - tool_output_tokens(context_length) - CHECKPOINT_TOKENS
STREAM_RETRIES = 2  # a stream cut mid-response is retried; the adapter answers with the rest of the turn


def model_catalog(
    model: str, *, instructions: str = DEFAULT_INSTRUCTIONS, context_window: int = DEFAULT_CONTEXT_WINDOW
) -> dict:
    """Our own ``model_catalog_json`` entry for ``model``: it decides Codex's tool set (the unified-exec
    shell, freeform ``apply_patch``; no search tool) and its base instructions (the first developer message).

    Without an entry Codex falls back to generic metadata: no apply_patch; sub-agent and goal tools."""
    entry = {
        "slug": model, "display_name": model, "description": "served by rollbus",
        "default_reasoning_level": None, "supported_reasoning_levels": [], "shell_type": "unified_exec",
        "visibility": "list", "supported_in_api": True, "priority": 0, "additional_speed_tiers": [],
        "service_tiers": [], "availability_nux": None, "upgrade": None,
        "include_skills_usage_instructions": False, "include_plugin_usage_instructions": False,
        "include_apps_usage_instructions": False, "default_reasoning_summary": "none",
        "support_verbosity": False, "default_verbosity": None, "apply_patch_tool_type": "freeform",
        "web_search_tool_type": "text",
        "truncation_policy": {"mode": "tokens", "limit": tool_output_tokens(context_window)},
        "supports_image_detail_original": False, "context_window": context_window,
        "max_context_window": context_window, "comp_hash": "rollbus", "effective_context_window_percent": 95,
        "experimental_supported_tools": [], "input_modalities": ["text"], "supports_search_tool": False,
        "supports_experimental_context": False, "use_responses_lite": False,
        "supports_reasoning_effort_updates": False, "node_repl_auto_review_required": False,
        "node_repl_disabled": True, "base_instructions": instructions,
    }  # fmt: skip
    return {"models": [entry]}


def catalog_file(model: str, **entry: Any) -> Path:
    """The catalog written once into the cache (content-addressed), for sandboxes to mount read-only."""
    text = json.dumps(model_catalog(model, **entry), sort_keys=True)
    path = cache_dir() / "codex-catalogs" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        staging.write_text(text)
        staging.chmod(0o644)
        staging.replace(path)
    return path


def config_overrides(
    base_url: str,
    *,
    model: str,
    catalog: str,
    max_turn_seconds: float = 1800.0,
    tool_env: Mapping[str, str] | None = None,
    context_length: int = DEFAULT_CONTEXT_WINDOW,
) -> list[str]:
    """``-c key=value`` settings (TOML values) for one headless run; everything Codex would reach besides
    ``base_url`` is off (analytics, feedback, update checks, plugins, apps, web search). Sub-agents are on:
    each child thread's requests train as a ``subagent`` chain of the rollout (docs/codex-wire.md).

    A custom provider named other than "OpenAI" speaks plain HTTPS (no WebSocket attempts, local compaction
    only). A stream cut mid-response is retried (``STREAM_RETRIES``): the turn was recorded before it was
    streamed, and the adapter answers the retry (the same history plus the items that arrived) with the rest
    of that turn instead of a new sample, so no turn trains twice. These retries also repeat a request
    answered with an HTTP error (a 401 is asked three times), which is safe: the adapter answers every error
    before it records a turn. Request retries stay off (not needed, not tested). The idle timeout is above any
    turn, since the adapter streams ``response.in_progress`` while it waits for the engine anyway. The
    context window is the served model's (``context_length``), and Codex compacts early enough that its
    compaction request still fits it (:func:`compact_limit`).

    The commands the model runs get Codex's ``core`` variables (HOME, PATH, SHELL, USER, TMPDIR, ...) and
    ``tool_env``, nothing else: by default Codex hands its whole environment to them, the session token
    included (tests/test_e2e_codex.py shows a shell command reading it)."""
    provider = (
        f'{{name = "{PROVIDER}", base_url = {json.dumps(base_url)}, env_key = "{TOKEN_ENV}", '
        f'wire_api = "responses", request_max_retries = 0, stream_max_retries = {STREAM_RETRIES}, '
        f"stream_idle_timeout_ms = {int(max_turn_seconds * 1000)}}}"
    )
    settings = {
        "model": json.dumps(model),
        "model_provider": f'"{PROVIDER}"',
        "model_catalog_json": json.dumps(catalog),
        "model_context_window": str(context_length),
        "model_auto_compact_token_limit": str(compact_limit(context_length)),
        f"model_providers.{PROVIDER}": provider,
        "approval_policy": '"never"',
        "sandbox_mode": '"danger-full-access"',
        "check_for_update_on_startup": "false",
        "web_search": '"disabled"',
        "analytics.enabled": "false",
        "feedback.enabled": "false",
        "features.plugins": "false",
        "features.apps": "false",
        "agents.enabled": "true",
        "skills.bundled.enabled": "false",
        "tools.update_plan.enabled": "true",
        "shell_environment_policy.inherit": '"core"',
        "shell_environment_policy.set": _inline_table(tool_env or {}),
    }
    return [arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")]


def _inline_table(values: Mapping[str, str]) -> str:
    return "{" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in values.items()) + "}"


def build_command(
    prompt: str,
    *,
    base_url: str,
    model: str,
    catalog: str,
    workdir: str,
    binary: str | os.PathLike[str] = "codex",
    max_turn_seconds: float = 1800.0,
    tool_env: Mapping[str, str] | None = None,
    context_length: int = DEFAULT_CONTEXT_WINDOW,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """argv for one headless episode printing JSON events on stdout; Codex's own sandbox and approvals are
    off because ours contains it. The prompt follows ``--``, so one starting with ``-`` stays a prompt."""
    cmd = [str(binary), "exec", "--json", "--skip-git-repo-check", "--ephemeral", "--ignore-rules"]
    cmd += ["-C", workdir, "--dangerously-bypass-approvals-and-sandbox"]
    cmd += config_overrides(
        base_url, model=model, catalog=catalog, max_turn_seconds=max_turn_seconds, tool_env=tool_env,
        context_length=context_length,
    )  # fmt: skip
    return [*cmd, *extra_args, "--", prompt]


def build_env(
    token: str,
    *,
    home: str = "/home/agent",
    path: str = "/usr/local/bin:/usr/bin:/bin",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment for the CLI (nothing inherited): the token as the provider's key, and
    ``CODEX_HOME`` the agent's home itself (Codex refuses one that does not exist yet)."""
    env = {"HOME": home, "PATH": path, "LANG": "C.UTF-8", "CODEX_HOME": home, TOKEN_ENV: token}
    env.update(extra or {})
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollbus.codex_cli", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["fetch", "path"], help="fetch: install if absent; path: print it")
    parser.add_argument("--cli-version", default=VERSION, help=f"Codex version [default {VERSION}]")
    args = parser.parse_args(argv)
    try:
        binary = fetch(args.cli_version) if args.action == "fetch" else binary_path(args.cli_version)
        if args.action == "fetch":
            execute_only_binary(args.cli_version)
    except (CliNotInstalled, CliInstallError, subprocess.TimeoutExpired, OSError) as exc:
        print(f"codex_cli: {exc}", file=sys.stderr)
        return 1
    print(binary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
