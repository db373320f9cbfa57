"""Shared entry-point shape for services whose pipeline stage is not built yet.

They parse their real flags (so compose files and `--help` are stable) and exit 2 with a clear message instead of
pretending to run.
"""

from __future__ import annotations

import argparse
import sys


def not_built_yet(stage: str, what: str) -> int:
    print(f"rollbus {stage}: not built yet ({what}); see the open issues", file=sys.stderr)
    return 2


def parse(module_doc: str, prog: str, add_arguments, argv: list[str] | None) -> argparse.Namespace:  # noqa: ANN001
    parser = argparse.ArgumentParser(prog=prog, description=module_doc.splitlines()[0])
    add_arguments(parser)
    return parser.parse_args(argv)
