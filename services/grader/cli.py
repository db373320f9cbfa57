"""``rollbus grade ROW.jsonl PATCH_FILE [--json]``: grade one patch against one row as the grader does.

How users debug a 0: it prints reward, solved, applied_cleanly, failure kind, flags and per-test results (with
``--json``, one JSON object with those keys on stdout). It reads the same ``--grade-timeout`` ... flags and
``ROLLBUS_GRADER_*`` variables as the service. Relative paths in the row resolve against the row file's
directory. The row is the file's first one, or the one ``--instance-id`` names (a whole dataset works;
SWE-bench and SWE-bench Pro rows are read as ``rollbus submit`` reads them).
Exit status: 0 when solved, 1 when not, 2 for unusable input (no such file or row, not JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from rollbus.services.grader.core import grade_row
from rollbus.services.grader.settings import GradingOptions
from rollbus.task_formats import FormatError, convert_row, detect_row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("row", type=Path, help="a JSONL file holding the row (its first non-empty line)")
    parser.add_argument("patch", type=Path, help="the patch to grade ('-' reads stdin)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--instance-id", default=None, help="grade against the row with this instance_id")
    GradingOptions.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    options = GradingOptions.from_args(args)
    try:
        row = read_row(args.row, args.instance_id)
        patch = sys.stdin.read() if str(args.patch) == "-" else args.patch.read_text(errors="surrogateescape")
    except (OSError, ValueError) as exc:
        print(f"rollbus grade: {exc}", file=sys.stderr)
        return 2
    result = asyncio.run(grade_row(row, patch, args.row.resolve().parent, options.grade_config()))
    if args.json:
        print(json.dumps(result.as_dict(), default=str))
    else:
        print_result(result.as_dict())
    return 0 if result.solved else 1


def read_row(path: Path, instance_id: str | None = None) -> dict[str, Any]:
    """The first row of ``path``, or the one whose ``metadata.instance_id`` is ``instance_id``."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: a row is a JSON object")
        try:  # a SWE-bench or SWE-bench Pro row is graded as the rollbus row submit makes of it
            row = convert_row(row, detect_row(row))
        except FormatError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        metadata = row.get("metadata")
        if isinstance(metadata, str):
            with contextlib.suppress(json.JSONDecodeError):
                metadata = json.loads(metadata)
        if instance_id is None or (isinstance(metadata, dict) and metadata.get("instance_id") == instance_id):
            return row
    raise ValueError(f"{path}: no row" + (f" with instance_id {instance_id!r}" if instance_id else ""))


def print_result(result: dict[str, Any]) -> None:
    for key in ("reward", "solved", "applied_cleanly", "failure_kind", "flags"):
        value = result[key]
        print(f"{key:16} {', '.join(value) or '-' if isinstance(value, list) else value}")
    for test in result["tests"]:
        print(f"  {test['status']:8} {test['name']}")
    details = result["details"]
    for key in ("note", "apply_method", "changed_files", "stripped_binary"):
        if details.get(key):
            print(f"{key:16} {details[key]}")
    if details.get("log") and not result["solved"]:
        print("--- test output (tail) ---")
        print(details["log"].rstrip())
