"""``rollbus sandbox run ROW.jsonl --role agent|grader [--adapter-url URL] -- CMD ...``: debug an image.

Runs ``CMD`` in the sandbox the runner (``agent``) or the grader (``grader``) would build for the row (the
first row of the file unless ``--line``), prints its output and exits with its status. The agent's sandbox
gets the Claude Code binary at its usual place and, with ``--adapter-url``, ``ANTHROPIC_BASE_URL`` pointing
there; the grader's has no network and never sees the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import uuid
from pathlib import Path

from rollbus.rows import Row, RowError, RowKeys, read_rows
from rollbus.sandbox import Completed, SandboxError, SandboxSpec, create_local, resolve_image
from rollbus.sandbox.bwrap_layout import WORKSPACE
from rollbus.services.sandbox_runner.harnesses import claude_code
from rollbus.services.sandbox_runner.rollout import AttemptFailed, host_files, sandbox_spec
from rollbus.services.sandbox_runner.settings import RunnerSettings

BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["run"], help="run: one command in the row's sandbox")
    parser.add_argument("row_file", type=Path, help="JSONL file holding the row")
    parser.add_argument("--role", choices=["agent", "grader"], default="agent", help="whose sandbox to build")
    parser.add_argument("--line", type=int, default=0, help="the row's line number (default: the first row)")
    parser.add_argument("--adapter-url", default="", help="agent role: ANTHROPIC_BASE_URL inside the sandbox")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the command is killed")
    parser.add_argument("cmd", nargs="*", help="-- CMD ARGS...")
    parser.parse_args = parser.parse_intermixed_args  # type: ignore[method-assign]  # options around ROW


def run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("rollbus sandbox run: no command (put it after --)", file=sys.stderr)
        return 2
    try:
        row = pick_row(args.row_file, args.line)
    except (OSError, RowError) as exc:
        print(f"rollbus sandbox run: {exc}", file=sys.stderr)
        return 2
    try:
        done = asyncio.run(run_in_sandbox(row, args.role, cmd, args.adapter_url, args.timeout))
    except (SandboxError, AttemptFailed) as exc:
        print(f"rollbus sandbox run: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.timed_out:
        print(f"rollbus sandbox run: killed after {args.timeout:.0f}s", file=sys.stderr)
    return done.exit_code if done.exit_code >= 0 else 128 - done.exit_code


def pick_row(path: Path, line: int) -> Row:
    for item in read_rows(path, RowKeys()):
        number = item.line if isinstance(item, Row) else item[0]
        if line and number != line:
            continue
        if isinstance(item, Row):
            return item
        raise RowError(f"{path}:{number}: {item[1]}")
    raise RowError(f"{path}: no row" + (f" on line {line}" if line else ""))


async def run_in_sandbox(row: Row, role: str, cmd: list[str], adapter_url: str, timeout: float) -> Completed:
    """``cmd`` in a fresh sandbox for ``row``: the runner's own spec (agent), or the grader's (full image, no
    network); closed (everything killed and removed) afterwards."""
    settings = RunnerSettings.load({"adapter_url": adapter_url} if adapter_url else {})
    if role == "agent":
        files = host_files(claude_code.HARNESS, settings)
        spec = sandbox_spec(settings, row.metadata, files, f"debug-{uuid.uuid4().hex[:8]}")
        if not adapter_url:
            spec = dataclasses.replace(spec, adapter_url=None, base_url=None)
    else:
        image = resolve_image(str(row.metadata.get("image") or row.metadata["remote_env_info"]["image"]))
        spec = SandboxSpec(image=image, role="grader", workdir=str(row.metadata.get("workdir") or WORKSPACE),
                           limits=settings.limits())  # fmt: skip
    env = {**BASE_ENV, "HOME": "/home/agent"}
    if spec.base_url:
        env["ANTHROPIC_BASE_URL"] = spec.base_url
    async with await create_local(spec, scratch_root=settings.sandbox_root) as sandbox:
        return await sandbox.run(cmd, env, cwd=sandbox.workdir, timeout=timeout)
