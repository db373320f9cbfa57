"""``rollbus sandbox run ROW.jsonl --role agent|grader [--adapter-url URL] -- CMD ...``: debug an image.

Runs ``CMD`` in the sandbox the runner (``agent``) or the grader (``grader``) would build for the row (the
first row of the file unless ``--line``), prints its output and exits with its status. The agent's sandbox
gets the Claude Code binary at its usual place and, with ``--adapter-url``, ``ANTHROPIC_BASE_URL`` pointing
there; the grader's has no network and never sees the CLI.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from rollbus import claude_cli
from rollbus.rows import Row, RowError, RowKeys, read_rows
from rollbus.sandbox import BwrapSandbox, Completed
from services.sandbox_runner.workspace import ImageError, materialize

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
    except ImageError as exc:
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
    scratch = Path(tempfile.mkdtemp(prefix="rollbus-sandbox-run-"))
    try:
        workdir = materialize(row.metadata, scratch)
        env = dict(BASE_ENV)
        if role == "agent":
            binary = claude_cli.binary_path()
            sandbox = BwrapSandbox(workdir, network="loopback", ro_binds={binary: claude_cli.SANDBOX_BINARY})
            if adapter_url:
                env["ANTHROPIC_BASE_URL"] = adapter_url
        else:
            sandbox = BwrapSandbox(workdir, network="none")
        env["HOME"] = sandbox.home
        try:
            return await sandbox.run(cmd, env, timeout=timeout)
        finally:
            await sandbox.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
