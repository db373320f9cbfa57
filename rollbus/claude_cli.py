"""The real Claude Code CLI: a pinned npm install, and the command line and environment to run it headless.

The npm package ships the native binary inside a per-platform package
(``@anthropic-ai/claude-code-linux-x64`` and so on); the wrapper's postinstall only hard-links it into place.
We install with ``--ignore-scripts`` and use the platform binary directly, so nothing is fetched at install
time beyond the npm tarballs themselves.
``python -m rollbus.claude_cli fetch`` installs it (``scripts/bootstrap.sh`` calls this).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollbus.config import cache_dir

PACKAGE = "@anthropic-ai/claude-code"
VERSION = "2.1.197"
MARKER = ".rollbus-installed.json"
EXECUTE_ONLY = "claude.execute-only"  # beside the marker: the copy sandboxes run (see execute_only_binary)
NPM_TIMEOUT_S = 600
# No install scripts: the wrapper's postinstall would only link the platform binary we use directly.
NPM_FLAGS = ("--ignore-scripts", "--no-audit", "--no-fund", "--no-save", "--loglevel=error")
# Where sandboxes mount the binary (read-only): one fixed path, whatever the host's cache directory.
SANDBOX_BINARY = "/opt/claude-code/claude"

# Tools that would reach the internet (denied even when the network is sandboxed, so the model never tries).
DEFAULT_DISALLOWED_TOOLS = ("WebFetch", "WebSearch")
DEFAULT_MAX_OUTPUT_TOKENS = 8192


class CliNotInstalled(RuntimeError):
    """The pinned CLI is not in the cache: run ``python -m rollbus.claude_cli fetch``."""


class CliInstallError(RuntimeError):
    """npm ran but did not leave a working native binary behind."""


def install_dir(version: str = VERSION) -> Path:
    return cache_dir() / f"claude-code-{version}"


def binary_path(version: str = VERSION) -> Path:
    """Absolute path of the installed native ``claude`` binary (read from the install marker)."""
    marker = install_dir(version) / MARKER
    if not marker.is_file():
        raise CliNotInstalled(
            f"Claude Code {version} is not installed in {install_dir(version)}; "
            "run `python -m rollbus.claude_cli fetch`"
        )
    return install_dir(version) / json.loads(marker.read_text())["binary"]


def execute_only_binary(version: str = VERSION) -> Path:
    """A copy of the installed binary that anyone may run and nobody but root may read (mode 0111).

    The kernel makes a process that runs a binary its user cannot read non-dumpable: its ``/proc/<pid>/mem``,
    ``/proc/<pid>/environ``, ``/proc/<pid>/fd`` and ptrace are closed to every process without
    ``CAP_SYS_PTRACE``, same-uid tools included. A sandbox that runs this copy keeps the CLI's memory, token
    and sockets from the tools it starts. The Bun-compiled CLI reads its bundled code from its own memory (the
    ``.bun`` section), never from the file, so it runs as is. Made once per version, atomically.
    """
    source = binary_path(version)
    dest = install_dir(version) / EXECUTE_ONLY
    with contextlib.suppress(FileNotFoundError):
        made = dest.stat()
        if stat.S_IMODE(made.st_mode) == 0o111 and made.st_size == source.stat().st_size:
            return dest
    staging = dest.with_name(f".{EXECUTE_ONLY}.{os.getpid()}")
    try:
        shutil.copyfile(source, staging)
        staging.chmod(0o111)
        staging.replace(dest)
    finally:
        staging.unlink(missing_ok=True)
    return dest


def fetch(version: str = VERSION, *, npm: str = "npm") -> Path:
    """Install ``PACKAGE@version`` into the cache unless the marker says it is there; return the binary.

    Installs into a temporary sibling directory and renames it into place, so a crash or a concurrent
    fetch never leaves a half-installed directory that looks complete.
    """
    dest = install_dir(version)
    if (dest / MARKER).is_file():
        return binary_path(version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the binary from other users
    try:
        _npm_install(npm, f"{PACKAGE}@{version}", staging)
        binary = _find_native_binary(staging)
        reported = _binary_version(binary)
        if not reported.startswith(version):
            raise CliInstallError(f"{binary} reports version {reported!r}, expected {version}")
        marker = {"version": version, "binary": str(binary.relative_to(staging))}
        (staging / MARKER).write_text(json.dumps(marker))
        if (dest / MARKER).is_file():  # a concurrent fetch finished first
            return binary_path(version)
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return binary_path(version)


def _npm_install(npm: str, spec: str, prefix: Path) -> None:
    cmd = [npm, "install", "--prefix", str(prefix), *NPM_FLAGS, spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=NPM_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:
        raise CliInstallError(f"{npm!r} not found: install Node.js and npm") from exc
    if done.returncode != 0:
        raise CliInstallError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()}")


def _find_native_binary(prefix: Path) -> Path:
    """The executable ``claude`` in the platform package npm picked for this os/cpu/libc."""
    scope = prefix / "node_modules" / PACKAGE.split("/")[0]
    found = [p for p in sorted(scope.glob(f"{PACKAGE.split('/')[1]}-*/claude")) if os.access(p, os.X_OK)]
    if len(found) != 1:
        raise CliInstallError(f"expected one native binary under {scope}, found {[str(p) for p in found]}")
    return found[0]


def _binary_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise CliInstallError(f"{binary} --version failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


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
