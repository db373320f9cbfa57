"""Shared entry-point shape for services whose pipeline stage is not built yet.

They parse their real flags (so compose files and `--help` are stable) and exit 2 with a clear message
instead of pretending to run.
"""

from __future__ import annotations

import sys


def not_built_yet(stage: str, what: str) -> int:
    print(f"rollbus {stage}: not built yet ({what}); see the open issues", file=sys.stderr)
    return 2
