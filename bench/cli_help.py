"""``rollbus <command> --help``: wall time per command, best of three, beside importing the command's module.

Run: ``python bench/cli_help.py [--quick]``. For each command it prints the best of three ``--help`` runs
(a fresh interpreter each, as a user types it), the best of three imports of the command module (what the
help page cost before its parser was built from the settings alone) and their ratio, and the bare
interpreter's start for scale. The issue's goal is every help page under a second on a quiet machine: the
lines over it are marked. ``--quick``: the three commands that were slowest (adapter, sandbox-runner, demo).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from rollbus.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
QUICK = ("adapter", "sandbox-runner", "demo")


def best_of(argv: list[str], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    args = parser.parse_args()
    names = QUICK if args.quick else tuple(COMMANDS)
    bare = best_of([sys.executable, "-c", "pass"])
    print(f"python start: {bare:.2f}s (best of 3)")
    print(f"{'command':16} {'--help':>8} {'module import':>14} {'ratio':>6}")
    slowest = 0.0
    for name in names:
        shown = best_of([sys.executable, "-m", "rollbus", name, "--help"])
        module = best_of([sys.executable, "-c", f"import {COMMANDS[name][0]}"])
        slowest = max(slowest, shown)
        mark = "  over 1 s" if shown > 1.0 else ""
        print(f"{name:16} {shown:7.2f}s {module:13.2f}s {shown / module:5.2f}x{mark}")
    print(f"slowest --help {slowest:.2f}s; ratio slowest help / 1 s goal = {slowest:.2f}")


if __name__ == "__main__":
    main()
